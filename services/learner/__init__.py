"""The learner service: DeepSpeed ZeRO updates on first-completed trajectories, snapshot publication."""
