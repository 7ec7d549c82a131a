"""Rescaling a running launch: `spopp scale` writes the wanted replica count to <run_dir>/replicas,
and the launcher reads it each tick, starting rollout-N.. or stopping the highest replicas."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from services.config.launch import LaunchSettings
from services.launch.process_plan import ProcessPlan, rollout_settings
from spopp.machine.net import free_port

# `spopp scale` writes the wanted replica count here; the running launcher reads it each tick.
SCALE_FILE = "replicas"
MAX_REPLICAS = 256


def parse_replicas(text: str, gpu_slots: int) -> int:
    """The replica count in a scale file: a whole number from 1 (a run without replicas would
    stall) up to MAX_REPLICAS, and up to the replicas gpus.rollout has devices for (when given)."""
    try:
        n = int(text.strip())
    except ValueError:
        raise ValueError(f"expected a whole number of replicas, got {text.strip()[:40]!r}") from None
    if not 1 <= n <= MAX_REPLICAS:
        raise ValueError(f"replicas must be 1..{MAX_REPLICAS}, got {n}")
    if gpu_slots and n > gpu_slots:
        raise ValueError(f"gpus.rollout has devices for {gpu_slots} replicas, not {n}")
    return n


class Replicas(Protocol):
    """What rescaling needs of the supervisor (supervise.Supervisor): named by its shape, so that
    this module sits beside the supervisor rather than above it."""

    done: set[str]

    def spawn(self, p: ProcessPlan, name: str, service: str, command: str) -> Any: ...

    def wait_started(self, names: list[str]) -> None: ...

    def retire(self, name: str) -> None: ...


class Scaler:
    """Applies the scale file's count to the supervised replicas of plan `p`; `record(p, replicas=n)`
    writes the new count into the run's record (run_folder.RunFolder.update)."""

    def __init__(self, s: LaunchSettings, sup: Replicas, record: Callable[..., None], echo) -> None:
        self.s = s
        self.sup = sup
        self.record = record
        self.echo = echo
        self.seen: int | None = None  # the scale file's mtime last read

    def forget_earlier(self, p: ProcessPlan) -> None:
        """Remove a scale file an earlier launch of this folder left."""
        stale = p.run_dir / SCALE_FILE
        if stale.is_file():
            # A count set for an earlier launch of this folder: this one starts from its config.
            stale.unlink()
            self.echo(
                f"removed {stale} of an earlier launch: replicas start at rollout.replicas ({len(p.rollouts)})"
            )

    def rescale(self, p: ProcessPlan) -> None:
        """Apply a new count from <run_dir>/replicas: start rollout-N.. or stop the highest ones
        (SIGTERM: a replica drains and gives back its leases). A bad file changes nothing."""
        path = p.run_dir / SCALE_FILE
        try:
            mtime = path.stat().st_mtime_ns
            if mtime == self.seen:
                return
            self.seen = mtime
            want = parse_replicas(path.read_text(), len(self.s.gpus.rollout))
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            self.echo(f"{path}: {exc}; the run keeps its {len(p.rollouts)} replica(s)")
            return
        have = len(p.rollouts)
        for i in range(have, want):
            self._add_replica(p, i)
        for r in reversed(p.rollouts[want:]):
            self.sup.retire(r.worker_id)
            p.rollouts.remove(r)
        if want != have:
            self.echo(f"replicas {have} -> {want} ({path})")
        self.record(p, replicas=want)

    def _add_replica(self, p: ProcessPlan, i: int) -> None:
        taken = {p.tracker.port, p.learner.port, *(r.port for r in p.rollouts)}
        if p.evaluator is not None:
            taken.add(p.evaluator.port)
        r = rollout_settings(
            self.s, i, p.binding, f"http://127.0.0.1:{p.learner.port}", free_port(taken=taken),
        )  # fmt: skip
        r.to_file(p.run_dir / "config" / f"{r.worker_id}.yaml")
        p.rollouts.append(r)
        self.sup.done.discard(r.worker_id)
        child = self.sup.spawn(p, r.worker_id, "rollout", "serve")
        self.sup.wait_started([r.worker_id])
        self.echo(f"started {r.worker_id} (pid {child.pid})")
