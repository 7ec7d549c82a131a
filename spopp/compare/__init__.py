"""Comparing arms across seeds: the arms, their common random numbers, and the paired statistics a
reader needs to judge a difference (the curve metrics themselves are spopp.metrics)."""
