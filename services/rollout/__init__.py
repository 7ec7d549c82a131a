"""The rollout service: replicas that lease tasks, play episodes with the agent runtime, report and push trajectories."""
