"""Running what a model wrote, bounded: model-written Python in a bubblewrap sandbox (bubblewrap.py)
with one control group per run (cgroup.py), and answer checks that may never return in worker
processes killed at their deadline (check_pool.py, the parent; check_worker.py, the child)."""
