"""A learner waiting on a build lock says so.

On CPU, DeepSpeed compiles its shared-memory op (the CPU all-reduce) on first use with torch's
extension builder, which guards the build with a `lock` file in the op's folder under
TORCH_EXTENSIONS_DIR (~/.cache/torch_extensions by default) and waits, silently and without end,
while that file exists. A build killed midway (a stopped first run) leaves the file behind, and
every later learner then hangs at start-up with nothing in its log. `LockWatch` names such files
when joining the process group takes longer than a build should.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger("spopp.learner")

WAIT_S = 60.0  # a build takes a minute or two of one core: past this, say what it waits on


def extensions_dir() -> Path:
    """Where torch builds its extensions: TORCH_EXTENSIONS_DIR, else its default."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")


def build_locks(root: Path) -> list[Path]:
    """The build lock files under `root` (torch's FileBaton: `<root>/<python>_<device>/<op>/lock`)."""
    return sorted(root.glob("*/*/lock")) + sorted(root.glob("*/lock"))


def lock_message(locks: list[Path], now: float) -> str:
    ages = ", ".join(f"{p} ({(now - p.stat().st_mtime) / 60:.0f} min old)" for p in locks)
    return (
        f"joining the process group has taken over {WAIT_S:.0f} s: DeepSpeed's CPU op build waits while "
        f"{ages} exists. If no build is running (no ninja or c++ process), a killed build left it: delete it"
    )


class LockWatch:
    """A timer around process-group start-up: after `wait_s`, one warning naming any build lock."""

    def __init__(self, root: Path | None = None, wait_s: float = WAIT_S) -> None:
        self.root = root or extensions_dir()
        self.timer = threading.Timer(wait_s, self._check)
        self.timer.daemon = True

    def _check(self) -> None:
        try:
            locks = build_locks(self.root)
            if locks:
                log.warning(lock_message(locks, time.time()))
        except OSError:  # a lock that went away while looking: the build finished
            pass

    def __enter__(self) -> LockWatch:
        self.timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self.timer.cancel()
