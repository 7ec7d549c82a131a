"""Tie a process's life to its parent's: Linux PR_SET_PDEATHSIG, a no-op elsewhere.

Used where a parent may die by SIGKILL (or the OOM killer) and leave a child running that holds
a port or a data folder: the tracker's embedded redis-server, and the learner's torchrun ranks.
"""

from __future__ import annotations

import ctypes
import signal

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
