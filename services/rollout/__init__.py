"""The rollout service: engines, the multi-turn agent loop, environments and the worker loop."""
