"""DeepSpeed's CPU op, built under a lock that dies with its builder.

On CPU, DeepSpeed compiles its shared-memory op (the CPU all-reduce) on first use with torch's
extension builder, which guards the build with a `lock` file in the op's folder under
TORCH_EXTENSIONS_DIR (~/.cache/torch_extensions/<python>_<device> by default; torch's
FileBaton) and waits, without end, while that file exists. A build killed midway (a learner
stopped during its first start) leaves the file behind, and every later learner then hung at
start-up, with no build running.

`build_shm_op` builds the op as DeepSpeed would, but first takes an `fcntl.flock` on a file
beside torch's (`lock.flock`), held for the whole build: the kernel releases a flock when its
holder dies, however it dies (SIGKILL too). Whoever holds the flock is the only builder among
those that take it, so torch's lock file found then belongs to no live builder of ours, and is
removed, unless some process still has it open (a build that does not take the flock, such as
DeepSpeed's own build_shm_op run by hand) or ninja still works in the op's folder (a killed
builder's ninja and compilers outlive it): those are waited for first, since two builds in one
folder could write the same objects at once. A learner that finds another learner building waits for
that build (the flock) and then loads what it built.

`LockWatch` still names any lock file when joining the process group takes longer than a build
should: what remains is a live build that does not finish.

    python -m services.learner.op_build     # build it now (what `make ops` needs)
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("spopp.learner")

WAIT_S = 60.0  # a build takes a minute or two of one core: past this, say what it waits on
TORCH_LOCK = "lock"  # torch.utils.file_baton.FileBaton's file in the op's build folder
FLOCK = "lock.flock"  # ours, beside it: flock()ed by the builder for the whole build
_POLL_S = 0.5  # how often a start waiting on the processes of another build looks again
SHM_OP = "ShareMemCommBuilder"  # DeepSpeed's op builder of the CPU all-reduce


def extensions_dir() -> Path:
    """Where torch builds its extensions: TORCH_EXTENSIONS_DIR, else its default."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")


def build_locks(root: Path) -> list[Path]:
    """The build lock files under `root` (torch's FileBaton: `<root>/<python>_<device>/<op>/lock`)."""
    return sorted(root.glob(f"*/*/{TORCH_LOCK}")) + sorted(root.glob(f"*/{TORCH_LOCK}"))


def build_folder(op_name: str) -> Path:
    """The folder torch builds `op_name` in, exactly as its loader computes it (with the
    <python>_<device> level when TORCH_EXTENSIONS_DIR is unset); created if missing."""
    from torch.utils.cpp_extension import _get_build_directory

    # torch's own (private) function rather than a copy of it: a folder that differed from the
    # one its FileBaton uses by one level would leave the real lock file unseen.
    return Path(_get_build_directory(op_name, verbose=False))


def _builders(folder: Path) -> list[int]:
    """Live processes (other than this one) of a build in `folder`: one with torch's lock file open
    (a FileBaton holder that does not take the flock: it keeps the file open while it builds), or
    one working in `folder` (ninja and its compilers, which outlive a killed builder). Linux's
    /proc; processes this user may not inspect are not seen."""
    folder = folder.resolve()
    lock, me, found = str(folder / TORCH_LOCK), os.getpid(), []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        proc = Path(entry.path)
        try:
            # ninja and the compilers it ran (cc1plus, c++) work in the folder; each outlives a
            # killed builder, and any of them still writing objects is a live build.
            if os.readlink(proc / "cwd") == str(folder):
                found.append(int(entry.name))
            elif any(os.readlink(fd.path) == lock for fd in os.scandir(proc / "fd")):
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to look at
            continue
    return found


def _clear_stale(folder: Path) -> None:
    """Under the flock: remove torch's lock file, once no process builds in `folder`."""
    lock = folder / TORCH_LOCK
    said = False
    while lock.exists() and (users := _builders(folder)):
        if not said:
            log.info(
                "DeepSpeed's op build lock %s is in use by process(es) %s: waiting for them", lock, users
            )
            said = True
        time.sleep(_POLL_S)
    with contextlib.suppress(FileNotFoundError):  # a build we waited for removed it itself
        age = time.time() - lock.stat().st_mtime
        lock.unlink()
        log.warning(
            "removed %s (%.0f s old): a build killed midway left it, and no live process holds it", lock, age
        )


@contextlib.contextmanager
def build_lock(folder: Path) -> Iterator[None]:
    """Hold the flock of the build in `folder` (waiting for a live holder), with torch's lock
    file cleared when no one holds it; the flock goes when the block ends or this process dies."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / FLOCK, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "?"
            log.info("waiting for DeepSpeed's op build in %s by process %s", folder, holder)
            fcntl.flock(f, fcntl.LOCK_EX)
        # Who builds, for the message of a start that waits on it.
        f.truncate(0)
        f.write(f"{os.getpid()}\n")
        f.flush()
        _clear_stale(folder)
        yield  # closing the file releases the flock


def build_shm_op():
    """DeepSpeed's deepspeed.comm.torch.build_shm_op under build_lock: the op module, or None
    where the accelerator has no such op. DeepSpeed's own call later finds it loaded (its op
    builders cache what they load), so it never reaches torch's lock file."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(SHM_OP)
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return None
    with build_lock(build_folder(builder.NAME)):
        return builder.load()


def lock_message(locks: list[Path], now: float) -> str:
    ages = ", ".join(f"{p} ({(now - p.stat().st_mtime) / 60:.0f} min old)" for p in locks)
    return (
        f"joining the process group has taken over {WAIT_S:.0f} s: DeepSpeed's CPU op build waits while "
        f"{ages} exists. A live build holds it (a killed one's file is removed at start-up); if no "
        "build is running (no ninja or c++ process), delete it"
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


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    t0 = time.perf_counter()
    op = build_shm_op()
    print(
        f"DeepSpeed's CPU op {'ready' if op is not None else 'not needed here'} ({time.perf_counter() - t0:.1f} s)"
    )
