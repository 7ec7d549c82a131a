"""Exclusive claims on a GPU or a numbered slot, so that processes started alike end up distinct.

`docker compose up --scale rollout=N` starts N identical containers on the host network: the same
hostname, the same configured port, the same GPU reservation. Each replica therefore claims, at
start-up, a free device (or, without GPUs, the lowest free numbered slot of its role) in a
directory that all of them share (a Docker volume, a ReadWriteMany volume in Kubernetes) and takes
its worker id and its port from what it got.

A claim is an `fcntl.flock(LOCK_EX | LOCK_NB)` on a lock file in that directory, held on a file
descriptor that stays open for the life of the process (or until `Claim.release()`): the kernel
drops the lock when the process dies, however it dies, so a restarted container claims its
predecessor's device or slot again. Lock files are never deleted (unlinking a locked file would
let a second process lock a new file of the same name). The descriptor is not inherited: `os.open`
makes it close-on-exec (PEP 446), and a fork (multiprocessing's "fork" start method, vLLM's
workers) closes the child's copy, so no child outlives its parent with the parent's claim.

Files in the directory:

- `device-<id>.lock`: a device, shared by every role, so a replica and the evaluator never share a
  GPU. Worker id `<role>-gpu<id>` (`rollout-gpu3`): unique across roles, stable across restarts.
- `<role>-slot-<n>.lock`: slot n of a role, n from 0. Worker id `<role>-<n>` (`rollout-0`).

After locking, the holder writes one JSON line into the lock file (pid, hostname, worker id,
port, time); a claim that finds everything taken names each holder from those lines. flock on
NFS goes through the NFS client's lock manager; the lock of a node that died is released once
the server's lease period has passed. There the client emulates flock with POSIX locks, which
are per process: make one claim per process (what the services do), as two claims of one process
would not exclude each other.

Standard library only: the services call this before anything imports torch or vLLM.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import socket
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spopp.machine.gpus import GpuListError, NoNvidiaSmi, list_gpus

NAME_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")
MAX_DEVICE_INDEX = 1023
MAX_LISTED_HOLDERS = 16  # a full pool of 1024 slots names its first holders, then a count


class ClaimError(RuntimeError):
    """No claim could be made (everything taken, or the devices could not be listed)."""


class DeviceSpecError(ClaimError, ValueError):
    """A `devices` setting that does not parse (a ValueError, so settings validation reports it)."""


class _Lock:
    """The open, locked file descriptor behind a claim. Every live one is in `_LIVE`, which keeps
    it open for the life of the process even when nobody keeps the Claim, and lets a forked child
    close its copies."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        _LIVE.discard(self)
        if fd >= 0:
            os.close(fd)


_LIVE: set[_Lock] = set()


def _close_in_forked_child() -> None:
    # The child shares the parent's open file description, and with it the lock: closing the
    # child's descriptor drops only its reference; the parent keeps the lock.
    for lock in list(_LIVE):
        try:
            lock.close()
        except OSError:
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_forked_child)


@dataclass(frozen=True)
class Claim:
    """A held claim. `index`: the position in the device pool, or the slot number; `device`: the
    device id (None for a slot); `path`: the lock file. The claim owns its file descriptor (in
    `_lock`) and holds it until `release()`, the end of a `with` block, or the process's end."""

    role: str
    index: int
    device: str | None
    worker_id: str
    path: Path
    _lock: _Lock = field(repr=False, compare=False)

    @property
    def held(self) -> bool:
        return self._lock.fd >= 0

    def release(self) -> None:
        """Give the claim back. The record is cleared first so the file no longer names a holder."""
        if self.held:
            try:
                os.ftruncate(self._lock.fd, 0)
            finally:
                self._lock.close()

    def note(self, **fields: Any) -> None:
        """Rewrite the holder record in the lock file with `fields` added (the port, once known)."""
        if not self.held:
            raise ClaimError(f"claim {self.worker_id} was released")
        line = json.dumps({**self.record(), **fields}) + "\n"
        os.ftruncate(self._lock.fd, 0)
        os.pwrite(self._lock.fd, line.encode(), 0)

    def record(self) -> dict[str, Any]:
        """Who holds this claim, as written into the lock file."""
        return {
            "worker_id": self.worker_id,
            "role": self.role,
            "index": self.index,
            "device": self.device,
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(frozen=True)
class _Candidate:
    index: int
    device: str | None
    name: str  # the lock file's name
    worker_id: str


def _check_name(what: str, value: str) -> str:
    if not isinstance(value, str) or not NAME_PATTERN.fullmatch(value):
        raise ClaimError(
            f"{what} {value!r}: use 1 to 100 letters, digits, '_', '.' or '-', not starting with '.' or '-'"
        )
    return value


def _candidates(role: str, devices: Sequence[str] | None, slots: int) -> Iterator[_Candidate]:
    if devices is not None:
        for index, device in enumerate(devices):
            yield _Candidate(index, device, f"device-{device}.lock", f"{role}-gpu{device}")
    else:
        for n in range(slots):
            yield _Candidate(n, None, f"{role}-slot-{n}.lock", f"{role}-{n}")


def _try_lock(path: Path) -> _Lock | None:
    """The lock on `path`, or None if another open file holds it. The fd is close-on-exec."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as exc:
        raise ClaimError(f"cannot open the lock file {path}: {exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return _Lock(fd)


def claim(
    directory: Path,
    role: str,
    devices: Sequence[str] | None = None,
    *,
    slots: int = 1024,
    wait_seconds: float = 0.0,
    poll_seconds: float = 0.2,
    worker_id: str | None = None,
) -> Claim:
    """Claim the first free device of `devices` (in order), or without devices the lowest free slot
    of `role` among `slots`. When everything is taken, poll for up to `wait_seconds`, then raise
    ClaimError naming each holder. `worker_id` replaces the derived id in the claim and its record
    (the evaluator's hold name); uniqueness is then the caller's."""
    _check_name("role", role)
    if role == "device":
        raise ClaimError("role 'device' is reserved: device lock files are named device-<id>.lock")
    if devices is not None:
        devices = [_check_name("device id", d) for d in devices]
        if not devices:
            raise ClaimError("an empty device pool: give at least one device, or None for slots")
        if len(set(devices)) != len(devices):
            raise ClaimError(f"device pool {devices} names a device twice")
    if not 1 <= slots <= 1_000_000:
        raise ClaimError(f"slots must be in [1, 1000000], got {slots}")
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ClaimError(f"cannot use the claim folder {directory}: {exc}") from None
    deadline = time.monotonic() + max(0.0, wait_seconds)
    while True:
        for cand in _candidates(role, devices, slots):
            lock = _try_lock(directory / cand.name)
            if lock is not None:
                _LIVE.add(lock)
                held = Claim(
                    role, cand.index, cand.device, worker_id or cand.worker_id, directory / cand.name, lock
                )
                held.note(port=None)
                return held
        left = deadline - time.monotonic()
        if left <= 0:
            raise ClaimError(_all_taken(directory, role, devices, slots, wait_seconds))
        time.sleep(min(poll_seconds, left))


def _holder(path: Path) -> str:
    try:
        line = path.read_text().strip().splitlines()
        rec = json.loads(line[0]) if line else None
    except (OSError, ValueError):
        rec = None
    if not isinstance(rec, dict):
        return "holder unknown (no record yet)"
    return (
        f"{rec.get('worker_id')} (pid {rec.get('pid')} on {rec.get('hostname')}, "
        f"port {rec.get('port')}, since {rec.get('time')})"
    )


def _all_taken(
    directory: Path, role: str, devices: Sequence[str] | None, slots: int, wait_seconds: float
) -> str:
    cands = list(_candidates(role, devices, slots))
    what = f"devices {','.join(devices)}" if devices is not None else f"{slots} slots of role {role!r}"
    lines = [f"{c.name}: {_holder(directory / c.name)}" for c in cands[:MAX_LISTED_HOLDERS]]
    if len(cands) > MAX_LISTED_HOLDERS:
        lines.append(f"... and {len(cands) - MAX_LISTED_HOLDERS} more")
    waited = f" after waiting {wait_seconds:g} s" if wait_seconds > 0 else ""
    return f"no free claim for {role!r} in {directory}{waited}: all {what} are held\n  " + "\n  ".join(lines)


def visible_devices(spec: str | None) -> list[str] | None:
    """The device pool of a `devices` setting: None or "" → None (claim numbered slots);
    "auto" → the GPU indices nvidia-smi lists; "0,1,2", "2-5" or "0,4-6" → those indices."""
    if spec is None or not spec.strip():
        return None
    spec = spec.strip()
    if spec == "auto":
        return _nvidia_smi_indices()
    out: list[str] = []
    for item in (part.strip() for part in spec.split(",")):
        match = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", item)
        if not match:
            raise DeviceSpecError(
                f"devices {spec!r}: {item!r} is not a GPU index or a range like 2-5 "
                "(give 'auto', a list like 0,1,2, a range like 2-5, or nothing for numbered slots)"
            )
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        if last < first:
            raise DeviceSpecError(f"devices {spec!r}: the range {item!r} runs backwards")
        if last > MAX_DEVICE_INDEX:
            raise DeviceSpecError(f"devices {spec!r}: GPU index {last} is above {MAX_DEVICE_INDEX}")
        out += [str(i) for i in range(first, last + 1)]
    if len(set(out)) != len(out):
        raise DeviceSpecError(f"devices {spec!r} names a GPU more than once")
    return out


def devices_setting(value: object) -> object:
    """A `devices` settings value checked early: a YAML number or list becomes text (`3`, `[0, 1]`
    → "3", "0,1") and a list that does not parse raises DeviceSpecError (a ValueError) at
    validation, naming the field. "auto" is resolved only at claim time, on the node that claims."""
    if isinstance(value, bool):
        return value  # let the field's own validation reject it
    if isinstance(value, int):
        value = str(value)
    elif isinstance(value, list | tuple):
        value = ",".join(str(v) for v in value)
    if isinstance(value, str) and value.strip() not in ("", "auto"):
        visible_devices(value)
    return value


def _nvidia_smi_indices() -> list[str]:
    try:
        found = list_gpus()
    except NoNvidiaSmi as exc:
        raise ClaimError(
            f"devices 'auto': {exc}: give the GPU indices (devices: 0,1,2) or leave devices unset to "
            "claim numbered slots"
        ) from None
    except GpuListError as exc:
        raise ClaimError(f"devices 'auto': {exc}") from None
    if not found:
        raise ClaimError("devices 'auto': nvidia-smi lists no GPU")
    return [str(i) for i in found]


def claimed_port(port: int, index: int, offset: bool) -> int:
    """The port a claimer listens on: `port + index` with `offset` (replicas sharing one host
    network), else `port`; 0 (any free port) stays 0."""
    if port == 0 or not offset:
        return port
    if port + index > 65535:
        raise ClaimError(f"port {port} + claim index {index} is above 65535: lower the port")
    return port + index


def write_record(path: Path, record: dict[str, Any]) -> Path:
    """Write `record` as one JSON object at `path`, atomically (a health check may read it any time)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record) + "\n")
    tmp.replace(path)
    return path


def claim_process(
    directory: Path,
    role: str,
    devices: str | None,
    *,
    port: int,
    claim_ports: bool = True,
    record: Path | None = None,
    wait_seconds: float = 0.0,
    worker_id: str | None = None,
) -> tuple[Claim, int]:
    """A service's start-up claim: claim from the pool `devices` names (see visible_devices), pin
    the process to the claimed GPU (CUDA_VISIBLE_DEVICES, so it is cuda:0; this must run before
    torch or vLLM initialise CUDA), note the port in the lock file and write `record` if given.
    Returns the claim, held for the life of the process, and the port to listen on."""
    held = claim(directory, role, visible_devices(devices), wait_seconds=wait_seconds, worker_id=worker_id)
    try:
        listen = claimed_port(port, held.index, claim_ports)
        if held.device is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = held.device
        held.note(port=listen)
        if record is not None:
            try:
                write_record(record, {**held.record(), "port": listen, "lock": str(held.path)})
            except OSError as exc:
                raise ClaimError(f"cannot write the claim record {record}: {exc}") from None
    except BaseException:
        held.release()
        raise
    return held, listen


def claim_at_start(s, role: str, log: logging.Logger, *, worker_id: str | None = None) -> tuple[str, int]:
    """A service's start-up step, from its settings (`claim_dir`, `devices`, `port`, `claim_ports`,
    `claim_record`, `claim_wait_seconds`, `worker_id`): without `claim_dir` nothing is claimed and
    only the record is written; with it, `claim_process`. Answers (worker id, port to listen on).
    `worker_id` overrides the claim's (the evaluator keeps its hold's name). Raises ClaimError."""
    own = worker_id or getattr(s, "worker_id", None)
    if s.claim_dir is None:
        if s.claim_record is not None:
            write_record(s.claim_record, {"worker_id": own, "port": s.port, "index": None, "device": None,
                                          "pid": os.getpid()})  # fmt: skip
        return own, s.port
    held, port = claim_process(
        s.claim_dir, role, s.devices, port=s.port, claim_ports=s.claim_ports, record=s.claim_record,
        wait_seconds=s.claim_wait_seconds, worker_id=worker_id,
    )  # fmt: skip
    log.info("claimed %s (index %d, device %s): worker id %s, port %d",
             held.path, held.index, held.device, held.worker_id, port)  # fmt: skip
    return held.worker_id, port
