"""Tie a process's life to its parent's: Linux PR_SET_PDEATHSIG, a no-op elsewhere.

Used where a parent may die by SIGKILL (or the OOM killer) and leave a child running that holds
a port, a data folder or GPU memory: the tracker's embedded redis-server, the learner's torchrun
ranks (die_with_parent), and vLLM's engine core processes (guard_children).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time

_PR_SET_PDEATHSIG = 1

# Resolved once, at import in the parent: die_with_parent also runs as a subprocess preexec_fn,
# between fork and exec, where loading a library could block on a lock another thread held.
try:
    _prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except (OSError, AttributeError):  # not glibc Linux
    _prctl = None


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Have the kernel send `sig` to this process when its parent dies, even by SIGKILL.

    Answers whether that is now set (False where prctl is unavailable). The signal follows the
    *thread* that forked this process, not the process: if that thread exits while its process
    lives on, the signal fires anyway, so children must be started from a thread that outlives
    them. A parent that is already gone when this is called sends nothing: callers that can die
    with their parent at any moment check os.getppid() right after.
    """
    if _prctl is None:
        return False
    return _prctl(_PR_SET_PDEATHSIG, int(sig)) == 0


def guard_children(pids: list[int], poll_s: float = 0.5) -> subprocess.Popen | None:
    """Start a small watchdog that SIGKILLs `pids` once this process is gone.

    For children this process did not start itself and cannot give a death signal: vLLM spawns
    its engine core through multiprocessing, and a SIGKILLed replica or learner would leave that
    engine core running (holding the GPU's memory). The watchdog is a separate process that
    notices its parent change (it is reparented when we die) and then kills the pids; it leaves
    on its own once all of them have ended. Answers the watchdog, or None with nothing to guard.
    """
    if not pids:
        return None
    return subprocess.Popen(
        [sys.executable, "-m", "spopp.machine.lifetime", str(os.getpid()), str(poll_s), *map(str, pids)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a signal to our process group must not take the watchdog first
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _watch(parent: int, poll_s: float, pids: list[int]) -> None:
    while True:
        pids = [p for p in pids if _alive(p)]
        if not pids:
            return
        if os.getppid() != parent:
            for p in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
            return
        time.sleep(poll_s)


if __name__ == "__main__":
    _watch(int(sys.argv[1]), float(sys.argv[2]), [int(p) for p in sys.argv[3:]])
