"""Machine plumbing every process shares: GPU and slot claims, the NVIDIA driver and GPU list, free
ports, a process's lifetime, retries and restart budgets, waiting for readiness."""
