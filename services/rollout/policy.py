"""Following the policy: which version the engine holds, and what happens when a newer one is out.

When the tracker answers a dispatch with 409, a newer policy is out: the worker releases the
leases it holds ready, stops dispatching, drains (`finish`: in-flight episodes complete and
report; `abort`: their leases are released), swaps in the new snapshot's weights and goes on.
Under bounded staleness (the run's max_staleness k > 0) nothing that may still train waits: the
weights change between turns (services/rollout/swap.py records each token's version) or at
episode ends (`swap`), ready leases within k versions are kept, and only episodes now more than
k versions old are drained.
"""

from __future__ import annotations

import asyncio
import logging
import time

from services.config.rollout import RolloutSettings
from spopp import staleness
from spopp.api.client import AsyncTrackerClient
from spopp.files.snapshots import snapshot_path

from .episodes import Episodes
from .leases import Leases
from .metrics import RolloutMetrics
from .swap import VersionedEngine

log = logging.getLogger("spopp.rollout")


class PolicyFollower:
    """The policy `engine` generates with (`version`, from `snapshot`), kept in step with the tracker;
    `max_staleness` is the run's k."""

    def __init__(
        self,
        settings: RolloutSettings,
        max_staleness: int,
        engine: VersionedEngine,
        tracker: AsyncTrackerClient,
        work: tuple[Leases, Episodes],
        metrics: RolloutMetrics,
        stopping: asyncio.Event,
    ) -> None:
        self.s = settings
        self.engine = engine
        self.tracker = tracker
        self.leases, self.episodes = work
        self.metrics = metrics
        self.stopping = stopping
        self.version: int | None = None
        self.snapshot: str | None = None
        self.max_staleness = max_staleness  # the run's k (fixed at the run's creation)

    async def sync(self) -> None:
        """Load the tracker's current snapshot if it is not the one the engine holds."""
        policy = await self.tracker.policy(self.s.run)
        await self.follow(policy.version, policy.snapshot)

    async def follow(self, version: int, snapshot: str | None) -> None:
        """Switch to `version`; if its snapshot cannot be loaded, ask the tracker again and
        load what it names then. A replica that lagged (a long drain, an outage) can find the
        version it was told about already pruned by the learner, which keeps only its newest
        snapshots; the tracker's current one is there."""
        while True:
            try:
                await self._switch(version, snapshot)
                return
            except Exception as exc:  # noqa: BLE001 - any failed load: the weights are unknown now
                self.version = None
                log.warning(
                    "policy v%d (%s) did not load: %s; asking the tracker again", version, snapshot, exc
                )
                self.metrics.reload_failures.inc()
            await asyncio.sleep(self.s.poll_seconds)
            if self.stopping.is_set():
                return
            policy = await self.tracker.policy(self.s.run)
            version, snapshot = policy.version, policy.snapshot

    async def _switch(self, version: int, snapshot: str | None) -> None:
        if version == self.version:
            return
        if snapshot and version > 0:
            t0 = time.perf_counter()
            waited = await self.engine.swap(snapshot_path(snapshot), version)
            if self.max_staleness:  # episodes went on: the swap waited for their running turns only
                self.metrics.drain_seconds.observe(waited)
            self.metrics.reload_seconds.observe(time.perf_counter() - t0 - waited)
            self.metrics.reloads.inc()
            log.info("policy v%d loaded from %s in %.2f s", version, snapshot, time.perf_counter() - t0)
        else:
            await self.engine.swap(None, version)
        self.version, self.snapshot = version, snapshot
        self.metrics.policy_version.set(version)

    async def new_policy(self, version: int, snapshot: str | None) -> None:
        """A newer policy is out (a dispatch said so): drain (k = 0), or keep going (k > 0), then
        load it."""
        if self.max_staleness == 0:
            await self.drain()
        else:
            await self.keep_going(version)
        await self.follow(version, snapshot)

    async def keep_going(self, version: int) -> None:
        """Bounded staleness: episodes dispatched within k versions of `version` may still train,
        so they go on (`swap: turn`: under the new weights from their next turn; `episode`: to
        their end under the old ones, new episodes waiting). Those older than that can only feed
        the tracker's evidence now: `drain` says whether they finish (and report) or are released."""
        floor = staleness.oldest_trainable(version, self.max_staleness)
        await self.leases.release_all(self.leases.keep_ready(floor))
        inflight = self.leases.inflight
        if self.s.drain == "abort":
            for task, lease in list(inflight.items()):
                if lease.policy_version < floor:
                    task.cancel()
        if self.s.swap == "episode" and inflight:
            t0 = time.perf_counter()
            log.info("swap at episode ends: %d episodes finish under the old weights", len(inflight))
            await asyncio.gather(*inflight, return_exceptions=True)
            self.metrics.drain_seconds.observe(time.perf_counter() - t0)

    async def drain(self) -> None:
        """Release the ready leases, let the episodes in flight end (`drain`: finish or abort) and
        their outcome reports land; timed."""
        t0 = time.perf_counter()
        try:
            await self._drain_work()
        finally:
            self.metrics.drain_seconds.observe(time.perf_counter() - t0)

    async def _drain_work(self) -> None:
        await self.leases.release_ready()
        inflight = self.leases.inflight
        if inflight:
            log.info("draining %d episodes (%s)", len(inflight), self.s.drain)
            if self.s.drain == "abort":
                for task in inflight:
                    task.cancel()
            await asyncio.gather(*inflight, return_exceptions=True)
        # Their outcomes land before the new policy's episodes start (each at its own event time).
        await asyncio.gather(*self.episodes.reporting, return_exceptions=True)
