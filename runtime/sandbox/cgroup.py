"""One control group per sandbox run: the run's memory and processes bounded as a whole.

rlimits bound each process of a run alone: RLIMIT_AS per process, RLIMIT_NPROC per uid. A run
that forks eight children of 400 MiB holds 3.2 GiB under a 512 MiB RLIMIT_AS, and the files it
writes to its tmpfs are host memory that no rlimit counts. A memory cgroup counts all of it (every
process's pages and the tmpfs pages they wrote) against one limit, and a pids cgroup counts the
run's processes alone (not every process of the uid on the host).

Where: a new group below this process's own group, in each hierarchy that has the controller
(cgroup v1: the `memory` and `pids` hierarchies, as on this project's CI machines; v2: the unified
hierarchy, when this process's group delegates `memory` (and `pids`) to its children, which v2's
"no internal processes" rule refuses for a group holding processes, such as a container's root
group). Creating groups needs write access to them (root, as the sandbox already needs).

When no group can be made (`detect()` says why), `runtime.sandbox.bubblewrap` falls back to rlimits alone,
chosen so that RLIMIT_AS times the process cap stays within the same total: docs/rollout.md.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

PREFIX = "spopp-sandbox-"
_counter = itertools.count()


@dataclass(frozen=True)
class _Hierarchy:
    version: int  # 1 or 2
    controller: str  # "memory", "pids", or "memory+pids" on v2
    parent: Path  # this process's own group in that hierarchy: new groups go below it


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(mount point, root of the mount in its hierarchy, fs type, super options) of cgroup mounts."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
                continue
            found.append((fields[4], fields[3], tail[0], set(tail[2].split(","))))
    return found


def _own_groups() -> dict[str, str]:
    """This process's group per v1 controller, and under "" its v2 group (/proc/self/cgroup)."""
    groups: dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                groups[c] = path
    return groups


def _join(mount_point: str, mount_root: str, path: str) -> Path:
    # Inside a cgroup namespace the path is relative to the namespace's root, which is the mount's.
    rel = os.path.relpath(path, mount_root) if path.startswith(mount_root) else path.lstrip("/")
    return Path(mount_point) / ("" if rel == "." else rel)


def _writable(d: Path) -> bool:
    return d.is_dir() and os.access(d, os.W_OK)


def _find() -> list[_Hierarchy] | str:
    own = _own_groups()
    v1: dict[str, _Hierarchy] = {}
    v2: Path | None = None
    for point, root, fstype, options in _mounts():
        if fstype == "cgroup":
            for c in ("memory", "pids"):
                if c in options and c in own and c not in v1:
                    v1[c] = _Hierarchy(1, c, _join(point, root, own[c]))
        elif "" in own and v2 is None:
            v2 = _join(point, root, own[""])
    if "memory" in v1:
        found = [v1["memory"]] + ([v1["pids"]] if "pids" in v1 else [])
        if all(_writable(h.parent) for h in found):
            return found
        return (
            f"the memory cgroup {v1['memory'].parent} is not writable (not root, or read-only in a container)"
        )
    if v2 is None:
        return "no memory cgroup controller is mounted"
    return _v2(v2)


def _v2(parent: Path) -> list[_Hierarchy] | str:
    control = parent / "cgroup.subtree_control"
    try:
        delegated = control.read_text().split()
        if "memory" not in delegated:
            # Refused (EBUSY) when the group holds processes itself: v2's no-internal-process rule.
            wanted = "+memory" + (" +pids" if "pids" in (parent / "cgroup.controllers").read_text() else "")
            control.write_text(wanted)
            delegated = control.read_text().split()
    except OSError as e:
        return f"cgroup v2 group {parent} does not delegate the memory controller ({e.strerror or e})"
    if "memory" not in delegated:
        return f"cgroup v2 group {parent} does not delegate the memory controller"
    return [_Hierarchy(2, "memory+pids" if "pids" in delegated else "memory", parent)]


class RunGroup:
    """The group(s) of one sandbox run: made before it starts, read and removed after it ends."""

    def __init__(self, hierarchies: list[_Hierarchy], memory_bytes: int, max_processes: int):
        self.dirs: list[tuple[_Hierarchy, Path]] = []
        name = f"{PREFIX}{os.getpid()}-{next(_counter)}"
        try:
            for h in hierarchies:
                d = h.parent / name
                d.mkdir()
                self.dirs.append((h, d))
                self._limit(h, d, memory_bytes, max_processes)
        except OSError:
            self.remove()
            raise

    @staticmethod
    def _limit(h: _Hierarchy, d: Path, memory_bytes: int, max_processes: int) -> None:
        if h.version == 1 and h.controller == "memory":
            (d / "memory.limit_in_bytes").write_text(str(memory_bytes))
            memsw = d / "memory.memsw.limit_in_bytes"  # memory + swap: no way around the limit
            if memsw.exists():
                memsw.write_text(str(memory_bytes))
        elif h.version == 1:
            (d / "pids.max").write_text(str(max_processes))
        else:
            (d / "memory.max").write_text(str(memory_bytes))
            if (d / "memory.swap.max").exists():
                (d / "memory.swap.max").write_text("0")
            if "pids" in h.controller:
                (d / "pids.max").write_text(str(max_processes))

    @property
    def procs_files(self) -> list[str]:
        """The files a process writes its pid to, to join the run's group in every hierarchy."""
        return [str(d / "cgroup.procs") for _, d in self.dirs]

    def _count(self, file: str, key: str) -> int:
        for _, d in self.dirs:
            p = d / file
            if p.exists():
                with contextlib.suppress(OSError):
                    for line in p.read_text().splitlines():
                        k, _, v = line.partition(" ")
                        if k == key:
                            return int(v)
        return 0

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the run for the group's memory limit."""
        return (
            self._count("memory.oom_control", "oom_kill") > 0 or self._count("memory.events", "oom_kill") > 0
        )

    def remove(self, timeout_s: float = 2.0) -> None:
        """Remove the groups, killing what is left in them (the run's pid namespace is normally gone
        already, its processes on their way out)."""
        deadline = time.monotonic() + timeout_s
        for _, d in reversed(self.dirs):
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        break  # left for `sweep()` of a later process
                    _kill_members(d)
                    time.sleep(0.01)
        self.dirs = []


def _kill_members(d: Path) -> None:
    with contextlib.suppress(OSError):
        for pid in (d / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
                os.kill(int(pid), signal.SIGKILL)


def _sweep(hierarchies: list[_Hierarchy]) -> None:
    """Remove groups that dead processes left behind (a service SIGKILLed mid-run)."""
    for h in hierarchies:
        for d in h.parent.glob(PREFIX + "*"):
            owner = d.name[len(PREFIX) :].split("-", 1)[0]
            if owner.isdigit() and not Path(f"/proc/{owner}").exists():
                with contextlib.suppress(OSError):
                    _kill_members(d)
                    d.rmdir()


_detected: list[_Hierarchy] | str | None = None
_detect_lock = threading.Lock()


def detect() -> list[_Hierarchy] | str:
    """The hierarchies to make run groups in, or why there are none; probed once per process."""
    global _detected
    with _detect_lock:
        if _detected is None:
            try:
                found = _find()
                if not isinstance(found, str):
                    RunGroup(found, 64 * 2**20, 4).remove()  # a group can really be made and limited
                    _sweep(found)
            except OSError as e:
                found = f"cannot make a cgroup: {e}"
            _detected = found
        return _detected
