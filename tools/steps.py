"""What every demo and study driver under tools/ prints and runs: a timestamped line (`say`) and a
command echoed before it runs, stopping the driver when it fails (`run`)."""

from __future__ import annotations

import subprocess
import sys
import time


def say(text: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {text}", flush=True)


def run(args: list[str]) -> None:
    say("$ " + " ".join(args[2:] if args[:2] == [sys.executable, "-m"] else args))
    code = subprocess.run(args).returncode
    if code != 0:
        raise SystemExit(f"demo: `{' '.join(args)}` failed with exit code {code}")
