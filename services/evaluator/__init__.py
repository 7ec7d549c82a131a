"""The evaluator: held-out scores of the policy as it trains, in a process of its own.

`spopp evaluator run` follows a run's policy clock at the tracker and scores every k-th
published snapshot (follow.py) with the rollout's agent loop (scorer.py), keeping a hold on the
snapshots it has still to score (spopp.files.snapshots) and its records under `out_dir` (records.py).
`spopp evaluator score` scores model folders outside training. See docs/evaluator.md.
"""
