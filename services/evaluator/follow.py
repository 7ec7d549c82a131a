"""`spopp evaluator run`: follow a run's policy clock and score every k-th published snapshot.

The loop reads the tracker's policy version every `poll_seconds`. Each version v with
`v % every == 0` that it has not handled yet (version 0, the base model, too unless `at_start`
is off) is scored on the held-out tasks and recorded (see records.py), in version order, or, when
its snapshot is gone or cannot be read, recorded as skipped with the reason and a warning. The
learner knows nothing of this process: it never waits for it. What keeps a snapshot on disk
until it is scored is a hold file under `<snapshots>/.holds/` (spopp.files.snapshots), which this
process writes at start, refreshes every `hold_seconds / 3` from a thread of its own (so a long
evaluation does not let it lapse), advances after each version and removes on a clean exit; if
the process dies, the hold expires and the learner prunes as usual.

A restart reads the records and goes on after the last recorded version: nothing is scored
twice, and a version whose evaluation was cut off is scored again.

When the tracker says the run is finished, every due version up to its final version is
handled, the final version too even when it is not a multiple of `every` (the curve ends where
the run ended), and the process exits 0; restarted on a finished run whose records reach the
final version already, it exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from pathlib import Path

import httpx
from fastapi import FastAPI

from services.config.evaluator import EvaluatorSettings
from services.shell import server as http
from services.shell.routes import service_app
from spopp.api.client import AsyncTrackerClient, TrackerError
from spopp.files.snapshots import (
    Hold,
    read_manifest,
    remove_hold,
    snapshot_path,
    version_dirname,
    write_hold,
)

from .metrics import EvaluatorMetrics
from .records import Records
from .scorer import Scorer, SnapshotUnreadable, check_model_folder

log = logging.getLogger("spopp.evaluator")


def first_version(s: EvaluatorSettings, last: int | None) -> int:
    """The first version to handle, given the last one recorded (None: none yet)."""
    if last is None:
        return 0 if s.at_start else s.every
    return (last // s.every + 1) * s.every


class HoldKeeper:
    """This evaluator's hold on the snapshots it has still to score, kept fresh by a thread."""

    def __init__(self, root: Path, holder: str, every: int, seconds: float) -> None:
        self.root, self.holder, self.every, self.seconds = Path(root), holder, every, seconds
        self.from_version = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh, name="spopp-eval-hold", daemon=True)

    def start(self, from_version: int) -> None:
        self.from_version = from_version
        self.write()  # before anything else: a failure to write the hold stops the start
        self._thread.start()
        log.info(
            "hold %s: versions >= %d that are multiples of %d, renewed every %.0f s",
            self.path, from_version, self.every, self.seconds / 3,
        )  # fmt: skip

    @property
    def path(self) -> Path:
        return self.root / ".holds" / f"{self.holder}.json"

    def advance(self, from_version: int) -> None:
        self.from_version = from_version
        self.write()

    def write(self) -> None:
        with self._lock:
            if self._stop.is_set():
                return
            hold = Hold(self.holder, self.from_version, self.every, time.time() + self.seconds)
            write_hold(self.root, hold)

    def _refresh(self) -> None:
        while not self._stop.wait(self.seconds / 3):
            try:
                self.write()
            except OSError:  # shared storage hiccup: try again at the next tick, before expiry
                log.warning("could not renew the hold %s", self.path, exc_info=True)

    def stop(self, remove: bool = True) -> None:
        """Stop renewing and remove the hold: the learner may prune everything again. With
        `remove=False` (a crash, likely followed by a restart) the hold is left to expire."""
        with self._lock:
            self._stop.set()
            if remove:
                remove_hold(self.root, self.holder)
        if self._thread.is_alive():
            self._thread.join(timeout=10)


class Follower:
    def __init__(self, s: EvaluatorSettings, metrics: EvaluatorMetrics | None = None) -> None:
        self.s = s
        self.metrics = metrics or EvaluatorMetrics()
        self.records = Records(s.out_dir)
        self.next_version = first_version(s, self.records.last_version)
        self.metrics.next_version.set(self.next_version)
        if (last := self.records.last_scored) is not None:
            self.metrics.last_scored_version.set(last["policy_version"])
            self.metrics.show_last(last)
        self.policy_version: int | None = None
        self.final_version: int | None = None  # set once the tracker says the run is finished
        self.scoring: int | None = None
        self.root: Path | None = s.snapshots
        self.model: Path | None = s.model
        self.hold: HoldKeeper | None = None
        self.scorer: Scorer | None = None
        self._tb = None
        self.tracker = AsyncTrackerClient(s.tracker, token=s.api_token)

    # -- the tracker ---------------------------------------------------------------------------
    async def _read(self, what: str, call):
        """A tracker read, retried every poll_seconds while the tracker is away or the run unknown."""
        said = False
        while True:
            try:
                return await call()
            except (httpx.HTTPError, TrackerError) as exc:
                if isinstance(exc, TrackerError) and exc.status not in (404, 502, 503, 504):
                    raise
                if not said:
                    log.warning("waiting for the tracker (%s of run %s): %s", what, self.s.run, exc)
                    said = True
                await asyncio.sleep(self.s.poll_seconds)

    async def _poll(self) -> int:
        """The run's policy version now (and whether it is finished: `final_version`)."""
        run = await self._read("run", lambda: self.tracker.get_run(self.s.run))
        self.policy_version = version = run.policy_version
        if run.status == "finished":
            self.final_version = run.final_version
        self.metrics.policy_version.set(version)
        if self.root is None and version >= 1 and run.snapshot:
            # The snapshot of version >= 1 lies in the learner's snapshot folder; version 0's
            # (the run's base_snapshot) may lie anywhere.
            self.root = snapshot_path(run.snapshot).parent
            log.info("snapshot folder: %s (the parent of the policy's snapshot)", self.root)
        if self.root is not None and self.hold is None:
            self.hold = HoldKeeper(self.root, self.s.holder_id(), self.s.every, self.s.hold_seconds)
            self.hold.start(self.next_version)
        return version

    # -- the loop ------------------------------------------------------------------------------
    async def run(self) -> None:
        s = self.s
        clean = False
        try:
            if self.model is None or s.seed is None:
                run = await self._read("config", lambda: self.tracker.get_run(s.run))
            if s.seed is None:
                # The run's seed, unless one is given: the arms of one pair (one seed) evaluate with
                # the same draws, so their curves differ by their policies only, and different
                # pairs with different draws, so that a mean over seeds averages evaluation noise.
                self.s = s = s.model_copy(update={"seed": run.config.seed})
            if self.model is None:
                if not run.config.base_snapshot:
                    raise ValueError(
                        f"no base model: set `model`, or the base_snapshot of run {s.run} at the tracker"
                    )
                self.model = snapshot_path(run.config.base_snapshot)
            check_model_folder(self.model)
            if self._finished():
                log.info(
                    "every version up to %s is recorded in %s already", s.until_version, self.records.path
                )
                clean = True
                return
            await self._poll()  # the hold goes up before the (slow) engine start when it can
            if self._finished():
                log.info(
                    "run %s is finished at version %d and every due version up to it is recorded in %s",
                    s.run, self.final_version, self.records.path,
                )  # fmt: skip
                clean = True
                return
            self.scorer = await Scorer.open(s, self.model)
            log.info(
                "evaluator for run %s: %d held-out tasks, greedy=%s, %d samples each, engine %s on %s; "
                "scoring every %d versions from version %d",
                s.run, len(self.scorer.tasks), s.greedy, s.samples, s.engine, self.scorer.engine.device_name,
                s.every, self.next_version,
            )  # fmt: skip
            while not self._finished():
                current = await self._poll()
                while (version := self._due(current)) is not None:
                    await self._handle(version)
                    self.next_version = first_version(s, version)
                    self.metrics.next_version.set(self.next_version)
                    if self.hold is not None:
                        self.hold.advance(self.next_version)
                if not self._finished():
                    await asyncio.sleep(s.poll_seconds)
            if self.final_version is not None and self._due(self.final_version) is None:
                log.info("run %s is finished at version %d: every due version is scored; exiting",
                         s.run, self.final_version)  # fmt: skip
            else:
                log.info("every version up to %s handled; exiting", s.until_version)
            clean = True
        except asyncio.CancelledError:  # SIGTERM, SIGINT: a clean stop
            clean = True
            raise
        finally:
            await self.close(remove_hold=clean)

    def _due(self, current: int) -> int | None:
        """The next version to handle now that the clock is at `current`: the next multiple of
        `every` (up to until_version and the final version), else the final version of a
        finished run when it is not recorded yet (and not past until_version); None: nothing."""
        limit = min(x for x in (self.s.until_version, self.final_version, current) if x is not None)
        if self.next_version <= limit:
            return self.next_version
        final, until = self.final_version, self.s.until_version
        if final is None or final > current or (until is not None and final > until):
            return None
        last = self.records.last_version
        if (last is None or last < final) and (final > 0 or self.s.at_start):
            return final
        return None

    def _finished(self) -> bool:
        """Every version this process is to handle is handled: up to until_version, or up to the
        final version of a finished run."""
        if self.s.until_version is not None and self.next_version > self.s.until_version:
            return True
        return self.final_version is not None and self._due(self.final_version) is None

    async def _handle(self, version: int) -> None:
        if version == 0:
            folder, step = self.model, 0
        else:
            folder = self.root / version_dirname(version)
            if not folder.is_dir():
                return self._skip(version, f"pruned: {folder} does not exist (deleted before it was scored)")
            try:
                manifest = read_manifest(folder)
            except FileNotFoundError:
                return self._skip(version, self._gone_or(folder, f"{folder} has no manifest.json"))
            except (OSError, ValueError) as exc:
                return self._skip(version, self._gone_or(folder, f"bad manifest: {exc}"))
            if manifest.version != version:
                return self._skip(
                    version, f"unreadable: {folder}'s manifest names version {manifest.version}"
                )
            step = manifest.step
        self.scoring = version
        try:
            scored = await self.scorer.score(folder)
        except SnapshotUnreadable as exc:
            return self._skip(version, self._gone_or(folder, str(exc)))
        finally:
            self.scoring = None
        line = self.records.write_scored(version, step, folder, scored.metrics, scored.episodes)
        self.metrics.observe_scored(version, scored.metrics)
        self._scalars(version, scored.metrics)
        log.info(
            "policy version %d (step %s): greedy success %s, sampled success %s, %.1f s",
            version, step, line.get("eval/greedy/success_rate"), line.get("eval/sampled/success_rate"),
            scored.metrics["eval/seconds"],
        )  # fmt: skip

    @staticmethod
    def _gone_or(folder: Path, why: str) -> str:
        if not folder.exists():
            return f"pruned: {folder} was deleted while it was read"
        return f"unreadable: {why}"

    def _skip(self, version: int, reason: str) -> None:
        log.warning("policy version %d skipped: %s", version, reason)
        self.records.write_skipped(version, reason)
        self.metrics.observe_skipped(reason)

    def _scalars(self, version: int, metrics: dict) -> None:
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.s.out_dir / "tb"))
        for key, value in metrics.items():
            if isinstance(value, int | float):
                self._tb.add_scalar(key, value, version)
        self._tb.flush()

    async def close(self, remove_hold: bool = True) -> None:
        """Release the engine and the records; the hold is removed unless `remove_hold` is off
        (after an error: a restarted evaluator finds its snapshots still there)."""
        if self.hold is not None:
            self.hold.stop(remove=remove_hold)
            if not remove_hold:
                log.warning("leaving the hold %s to expire by itself", self.hold.path)
        if self.scorer is not None:
            with contextlib.suppress(Exception):
                await self.scorer.close()
            self.scorer = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        await self.tracker.aclose()

    def health(self) -> dict:
        last = self.records.last_scored
        return {
            "status": "ok",
            "run": self.s.run,
            "policy_version": self.policy_version,
            "next_version": self.next_version,
            "scoring": self.scoring,
            "last_scored_version": None if last is None else last["policy_version"],
            # Where its engine generates (cpu, cuda:0); None until the engine is up.
            "device": None if self.scorer is None else self.scorer.engine.device_name,
        }


def health_app(follower: Follower) -> FastAPI:
    return service_app("spopp evaluator", health=follower.health, metrics=follower.metrics.registry)


async def follow(s: EvaluatorSettings) -> None:
    """The process: the follower loop beside /healthz and /metrics, until done or signalled."""
    follower = Follower(s)
    try:
        # A signal cancels run().
        await http.serve(health_app(follower), s.host, s.port, follower.run(), limits=s.server_limits())
    except asyncio.CancelledError:
        log.info("stopped by a signal")
