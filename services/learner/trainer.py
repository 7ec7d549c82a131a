"""The learner's loop, on every rank: batch → advantages → update → (SPO) consume → publish.

Rank 0 owns the I/O: the trajectory intake, the tracker client and the logs. Each batch is the
first B trajectories of the current policy version, broadcast to every rank; every
`updates_per_publish` updates the weights are gathered into a snapshot folder and the tracker's
policy clock advances, which makes the rollouts drain and reload.

SPO++ takes the advantages frozen at dispatch (reward - value, from the trajectory); SPO reads
the batch's values from the tracker before the update and, after it, hands the tracker the
rewards and drifts in receipt order (/consume).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from services.config.learner import LearnerSettings
from spopp.advantages import normalize_advantages
from spopp.api.client import TrackerClient, TrackerError

from .backend import DeepSpeedBackend
from .checkpoint import load_checkpoint, save_checkpoint
from .deepspeed_engine import build_engine, init_distributed
from .failpoints import failpoint
from .ingest import IntakeLimits, TrajectoryBuffer, ingest_app
from .metrics import LearnerMetrics
from .metrics_log import MetricsLog
from .run_terms import adopt_run_terms
from .scoring import sequence_logprobs
from .snapshot import discard_unannounced, publish_snapshot
from .spo import SpoDriftCache
from .update import NonFiniteTrajectories, length_advantage_corr, run_update, staleness_stats

log = logging.getLogger("spopp.learner")
# Batches screened out whole, in a row, after which the learner stops (the weights are suspect).
WHOLE_BATCHES_DROPPED = 3
_WAIT = "wait"  # broadcast while rank 0 still waits for a batch, so other ranks' collectives stay alive


def _broadcast(obj):
    if dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Trained(NamedTuple):
    """One update as _train made it."""

    batch: list  # the trajectories trained on, in receipt order
    raw: list[float]  # their advantages before normalization
    lengths: list[int]  # their action tokens
    waited: float  # seconds waited for the batch
    dropped: int  # trajectories dropped before it for a non-finite loss term
    stats: dict  # run_update's statistics


class ResumeError(RuntimeError):
    """The checkpoint and the tracker's policy disagree; resuming would fork the run."""


class Learner:
    """`resume=True` loads the newest complete checkpoint under `cfg.checkpoints` (weights,
    optimizer, step, policy version, RNG, SPO cache, buffered trajectories); with none there it
    starts fresh from `cfg.model` (logged as a warning).

    Publishing is one step that a crash anywhere leaves resumable: the snapshot folder is written,
    then a checkpoint of the new version's training state, then the tracker is told. Killed
    before the checkpoint, the learner resumes from the previous one and the unannounced folder,
    which no replica can have loaded, is discarded; killed between checkpoint and announcement, it
    resumes and announces again (the tracker takes the same version and snapshot twice as one).
    Besides every publish, `checkpoint_every` adds checkpoints between publishes.
    """

    def __init__(self, cfg: LearnerSettings, resume: bool = False) -> None:
        init_distributed()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.tracker = self.server = self.metrics = None
        version = None
        if self.rank == 0:
            # What the run fixed at its creation (recipe, k, budget) comes from the tracker, before
            # anything is built on it; every rank trains under the same bound settings.
            self.tracker = TrackerClient(cfg.tracker, token=cfg.api_token)
            run = self.tracker.get_run(cfg.run)
            cfg = adopt_run_terms(cfg, run.config)
            version = run.policy_version
        self.cfg = cfg = _broadcast(cfg)
        self.engine, self.tokenizer = build_engine(cfg, cfg.model)
        self.backend = DeepSpeedBackend(self.engine)  # what the PPO step (update.py) trains through
        # What DeepSpeed placed the model on (cuda:<local rank> with a GPU, else cpu): /healthz and
        # the start-up line say it, so a run meant for the GPU cannot train on the CPU unnoticed.
        self.device = str(self.engine.device)
        self.step = 0
        self.spo = SpoDriftCache() if cfg.recipe == "spo" else None
        self.buffer = TrajectoryBuffer(
            cfg.run, capacity=cfg.batch_size * cfg.updates_per_publish, max_staleness=cfg.max_staleness
        )
        self.prometheus = LearnerMetrics()  # /metrics beside the intake (rank 0)
        self.snapshot: str | None = None  # folder of the newest published version (rank 0)
        if self.rank == 0:
            self.metrics = MetricsLog(cfg.log_dir, total=cfg.max_updates)
        self.version = _broadcast(version)
        self.buffer.advance(self.version)
        self.resumed_from: str | None = None
        if resume:
            self._resume(tracker_version=self.version)
        if self.rank == 0:
            for gone in discard_unannounced(cfg.snapshots, self.version):
                log.warning("removed %s: written but never announced before a crash", gone)

    # -- checkpoints -------------------------------------------------------------------------
    def _resume(self, tracker_version: int) -> None:
        t0 = time.perf_counter()
        state = load_checkpoint(self.engine, self.cfg.checkpoints)
        if state is None:
            log.warning("--resume: no checkpoint under %s; starting fresh", self.cfg.checkpoints)
            return
        where = Path(self.cfg.checkpoints) / state["tag"]
        announce = state["version"] == tracker_version + 1 and state.get("snapshot")
        if state["version"] != tracker_version and not announce:
            if tracker_version > state["version"]:
                why = (
                    "the tracker has versions this checkpoint never saw: the checkpoint folder is "
                    "not the one this run wrote (every publish is checkpointed before it is "
                    "announced), or its newest checkpoints were lost. Resuming would publish a "
                    "different policy under version numbers the rollouts already used; start a "
                    "new run from the tracker's current snapshot instead."
                )
            else:
                why = "the tracker is behind the checkpoint: wrong run, or wrong tracker?"
            raise ResumeError(
                f"checkpoint {where} holds policy version {state['version']} (update {state['step']}) "
                f"but the tracker's run {self.cfg.run!r} is at version {tracker_version}: {why}"
            )
        self.step = state["step"]
        self.version = state["version"]
        for rid, why in self.buffer.restore(state["buffer"]).items():
            if self.rank == 0:  # each rank restores the same buffer; one says it
                log.warning(
                    "dropped trajectory %s from the checkpoint: the intake now refuses it (%s)", rid, why
                )
                self.prometheus.refuse("invalid")
        if self.spo is not None and state.get("spo") is not None:
            self.spo.restore(state["spo"])
        self.snapshot = state.get("snapshot")
        self.resumed_from = str(where)
        if self.metrics is not None:
            self.metrics.rewind(self.step, state.get("record"))
        if announce and self.rank == 0:
            # Killed between the checkpoint and the announcement: announce now (idempotent).
            log.info(
                "announcing policy version %d (%s), checkpointed before the crash",
                self.version,
                self.snapshot,
            )
            self.tracker.publish(self.cfg.run, self.version, self.snapshot)
        log.info(
            "resumed from %s: update %d, policy version %d (%.2fs)",
            where,
            self.step,
            self.version,
            time.perf_counter() - t0,
        )

    def checkpoint(self, record: dict | None = None) -> float:
        """Save the training state; `record` is this update's metrics record, kept so that a
        learner killed before writing it to the log writes it on resume."""
        t0 = time.perf_counter()
        state = None
        if self.rank == 0:
            state = {
                "record": record,
                "step": self.step,
                "version": self.version,
                "snapshot": self.snapshot,
                "run": self.cfg.run,
                "spo": self.spo.state() if self.spo is not None else None,
                "buffer": self.buffer.state(),
            }
        save_checkpoint(self.engine, self.cfg.checkpoints, self.step, state)
        elapsed = time.perf_counter() - t0
        self.prometheus.checkpoint_seconds.observe(elapsed)
        return elapsed

    # -- intake ------------------------------------------------------------------------------
    def serve(self) -> str | None:
        """Rank 0 starts POST /v1/trajectories; answers its URL."""
        if self.rank != 0:
            return None
        from services.shell.server import ThreadedServer

        app = ingest_app(
            self.buffer,
            self.cfg.max_body_bytes,
            token=self.cfg.api_token,
            limits=IntakeLimits.for_model(self.engine.module, self.cfg.recipe),
            metrics=self.prometheus,
            device=self.device,
        )
        self.server = ThreadedServer(
            app, self.cfg.host, self.cfg.port, limits=self.cfg.server_limits()
        ).start()
        log.info(
            "learner intake on %s (run %s, version %d): training on %s, %d rank(s), process group %s",
            self.server.url, self.cfg.run, self.version, self.device, self.world, dist.get_backend(),
        )  # fmt: skip
        return self.server.url

    def _next_batch(self) -> tuple[list, list[float] | None, float]:
        """The next B trainable trajectories, broadcast to every rank, with SPO's values read at the
        tracker before the update (None for SPO++); and the seconds waited for them."""
        t0 = time.perf_counter()
        while True:
            got = None
            if self.rank == 0:
                self._intake_serving()
                batch = self.buffer.take(self.cfg.batch_size, timeout=30.0)
                if batch is not None:
                    kept, values = self._screen(batch)
                    if len(kept) == len(batch):
                        got = (batch, values)
                    else:  # wait for later arrivals to take the dropped ones' places
                        self.buffer.putback(kept)
            got = _broadcast(got if got is not None else _WAIT)
            if got != _WAIT:
                return *got, time.perf_counter() - t0

    def _intake_serving(self) -> None:
        """Rank 0, before each wait for trajectories: with the intake's server gone nothing can
        arrive, and waiting would hang the run without a word; stop loudly instead (the
        supervisor restarts the learner from its checkpoint)."""
        if self.server is not None and not self.server.serving():
            raise RuntimeError(
                f"the trajectory intake on {self.server.url} stopped serving (its HTTP server's "
                "thread ended): no trajectory can arrive, so the learner stops rather than wait"
            )

    def _screen(self, batch: list) -> tuple[list, list[float] | None]:
        """Rank 0: drop what the intake could not judge alone, so that no trajectory stops the
        learner: requests the tracker never issued for this run (with `verify_requests`), and, for
        SPO, tasks the tracker does not know (its values call would fail). Answers the kept
        trajectories and, when none was dropped, SPO's values for them."""
        bad: dict[str, str] = {}
        if self.cfg.verify_requests:
            infos = self.tracker.lookup(self.cfg.run, [t.request_id for t in batch])
            for t, info in zip(batch, infos, strict=True):
                if info.state != "reported":
                    bad[t.request_id] = f"request {info.state}"
                elif (info.task_id, info.policy_version) != (t.task_id, t.policy_version):
                    bad[t.request_id] = f"issued for task {info.task_id!r} at version {info.policy_version}"
        values = None
        if self.cfg.recipe == "spo" and not bad:
            try:
                values = [v.value for v in self.tracker.values(self.cfg.run, [t.task_id for t in batch])]
            except TrackerError as err:
                if err.code != "unknown_task":
                    raise
                unknown = set(err.detail.get("task_ids", ()))
                bad = {t.request_id: "unknown task" for t in batch if t.task_id in unknown}
        if bad:
            self.buffer.forget(bad)
            for rid, why in bad.items():
                log.warning("dropped trajectory %s: %s", rid, why)
                self.prometheus.refuse("unissued")
            return [t for t in batch if t.request_id not in bad], None
        return batch, values

    # -- one update --------------------------------------------------------------------------
    def _advantages(self, batch: list, values: list[float] | None) -> list[float]:
        if self.cfg.recipe == "spopp":
            return [float(t.advantage) for t in batch]
        return [t.reward - v for t, v in zip(batch, values, strict=True)]  # SPO: values pre-update

    def _logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Token log-probs of whole sequences under the current weights (SPO's drift)."""
        return sequence_logprobs(self.engine.module, self.engine.device, sequences, self.cfg)

    def _drop_nonfinite(self, batch: list, reasons: dict[int, str]) -> None:
        """Rank 0: the trajectories run_update screened out are dropped (logged, counted) and the
        rest go back to the front of the buffer, so later arrivals take the dropped ones' places."""
        if self.rank != 0:
            return
        bad = {batch[i].request_id: why for i, why in reasons.items()}
        self.buffer.forget(bad)
        self.buffer.putback([t for i, t in enumerate(batch) if i not in reasons])
        for rid, why in bad.items():
            log.warning("dropped trajectory %s: its loss term is not finite (%s)", rid, why)
            self.prometheus.refuse("nonfinite")
        if len(reasons) == len(batch):
            log.error(
                "every trajectory of the batch had a non-finite loss term: if that goes on, suspect "
                "the weights (a NaN or inf in the model), not the trajectories"
            )

    def _train(self) -> Trained:
        """The update on the next batch the screen lets through."""
        waited, dropped, whole = 0.0, 0, 0
        while True:
            batch, values, w = self._next_batch()
            waited += w
            raw = self._advantages(batch, values)
            lengths = [t.action_tokens for t in batch]
            adv = normalize_advantages(
                torch.tensor(raw, dtype=torch.float64), torch.tensor(lengths), measure=self.cfg.normalization
            )
            try:
                stats = run_update(self.backend, batch, adv.tolist(), self.cfg, version=self.version)
            except NonFiniteTrajectories as exc:  # raised before any step: nothing was trained
                dropped += len(exc.reasons)
                self._drop_nonfinite(batch, exc.reasons)
                # Whole batches in a row: the weights, not the trajectories (every rank counts
                # alike: the screen's answer is all-reduced). Stop loudly, as before the screen,
                # rather than drain the run's trajectories without ever training.
                whole = whole + 1 if len(exc.reasons) == len(batch) else 0
                if whole >= WHOLE_BATCHES_DROPPED:
                    raise RuntimeError(
                        f"{whole} batches in a row had a non-finite loss term in every trajectory: the "
                        "model's weights are not finite (a NaN or inf), not the trajectories"
                    ) from exc
                continue
            return Trained(batch, raw, lengths, waited, dropped, stats)

    def update_once(self) -> dict:
        trained = self._train()
        batch, raw, lengths, stats = trained.batch, trained.raw, trained.lengths, trained.stats
        lags = [self.version - t.policy_version for t in batch]
        self.prometheus.observe_update(stats, lags)
        if self.spo is not None:
            drifts = self.spo.after_update(batch, self._logprobs)
            if self.rank == 0:
                items = [(t.task_id, t.reward, d) for t, d in zip(batch, drifts, strict=True)]
                try:
                    self.tracker.consume(self.cfg.run, f"{self.cfg.run}-u{self.step + 1}", items)
                except TrackerError as err:
                    if err.code != "idempotency_conflict":
                        raise
                    # A resumed learner redoing an update whose consume landed before the crash:
                    # that evidence is in; drifts that differ in the last bits must not stop us.
                    log.warning("update %d's evidence was already consumed before a restart", self.step + 1)
            stats["drift_mean"] = sum(drifts) / len(drifts)
        self.step += 1
        rewards = [t.reward for t in batch]
        sequence_tokens = sum(len(t.token_ids) for t in batch)
        stats.update(
            policy_version=self.version,
            world_size=self.world,
            reward_mean=sum(rewards) / len(rewards),
            success_rate=sum(r >= 1.0 for r in rewards) / len(rewards),
            response_tokens_mean=sum(lengths) / len(lengths),
            # Every token the update ran through (prompts and observations too), per second of its
            # own time: the learner's throughput, where tokens_per_s counts action tokens only.
            sequence_tokens=float(sequence_tokens),
            sequence_tokens_per_s=sequence_tokens / stats["update_seconds"]
            if stats.get("update_seconds")
            else math.nan,
            advantage_raw_mean=sum(raw) / len(raw),
            length_advantage_corr=length_advantage_corr(lengths, raw),
            batch_wait_s=trained.waited,
            # Trajectories dropped before this update for a non-finite loss term (replaced by later ones).
            dropped_nonfinite=float(trained.dropped),
            **staleness_stats(lags, self.cfg.max_staleness),
        )
        if self.step % self.cfg.updates_per_publish == 0:
            stats.update(self.publish(record={"step": self.step, "time": time.time(), **stats}))
        elif self.step % self.cfg.checkpoint_every == 0:
            stats["checkpoint_s"] = self.checkpoint(record={"step": self.step, "time": time.time(), **stats})
        if self.metrics is not None:
            self.metrics.write(self.step, stats)
        return stats

    def publish(self, record: dict | None = None) -> dict[str, float]:
        """Snapshot the weights as the next version, checkpoint, then advance the tracker's clock."""
        t0 = time.perf_counter()
        version = self.version + 1
        path = publish_snapshot(
            self.engine,
            self.cfg.model,
            self.cfg.snapshots,
            version,
            keep=self.cfg.keep_snapshots,
            step=self.step,
            lora_publish=self.cfg.lora_publish,
        )
        failpoint("after_snapshot", self.step)
        if self.rank == 0:
            self.snapshot = str(Path(path).resolve())
        self.version = version
        self.buffer.advance(version)
        publish_s = time.perf_counter() - t0
        checkpoint_s = self.checkpoint(record)
        failpoint("after_checkpoint", self.step)
        t1 = time.perf_counter()
        if self.rank == 0:
            self.tracker.publish(self.cfg.run, version, self.snapshot)
        failpoint("after_announce", self.step)
        if dist.get_world_size() > 1:
            dist.barrier()
        publish_s += time.perf_counter() - t1
        self.prometheus.publish_seconds.observe(publish_s)
        return {"publish_s": publish_s, "checkpoint_s": checkpoint_s}

    def run(self) -> None:
        self.serve()
        try:
            while self.cfg.max_updates is None or self.step < self.cfg.max_updates:
                self.update_once()
            self.finish()
        finally:
            self.close()

    def finish(self) -> None:
        """The budget is spent (the last update's snapshot published): rank 0 marks the run
        finished at its current version, so replicas stop dispatching and exit, and the evaluator
        scores up to this version and exits. Idempotent: a learner resumed at the end repeats it."""
        if self.rank != 0:
            return
        self.tracker.finish(self.cfg.run, self.version)
        log.info("run %s finished at version %d after %d updates", self.cfg.run, self.version, self.step)

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self.metrics is not None:
            self.metrics.close()
        if self.tracker is not None:
            self.tracker.close()
