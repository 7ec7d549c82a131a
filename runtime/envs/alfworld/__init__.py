"""ALFWorld environment plug-in: the `alfworld` package's text engine behind spopp's environment.

* `engine`: the package's engine (PDDL + grammar), one game at a time, one lock per process;
* `env`: `AlfworldEnv`, the environment the replicas, the evaluator and `spopp prior` play;
* `games`: game files on disk, task lists, and the task rows that point at games;
* `generate`: ALFWorld-format games of our own, for machines without the canonical data;
* `cli`: `spopp alfworld generate` and `spopp alfworld tasks`.

Nothing here imports the alfworld package at import time: it is an optional extra
(`pip install 'spopp[alfworld]'`), and `spopp --help` must not wait for it.
"""
