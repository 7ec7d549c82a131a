"""Service processes for tests: the real CLI in a subprocess, its output shown when a test fails,
killed by its own pid if still running at the end."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "spopp.cli", *args]


@contextlib.contextmanager
def running(args: list[str], log_path, env: dict | None = None):
    base = {k: v for k, v in os.environ.items() if not k.startswith("SPOPP_")}
    log = open(log_path, "w+")
    proc = subprocess.Popen(
        args, env={**base, "OMP_NUM_THREADS": "1", **(env or {})}, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        yield proc
    except BaseException:
        log.seek(0)
        print(f"{' '.join(args[3:5])} output (tail):\n" + log.read()[-5000:])
        raise
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
