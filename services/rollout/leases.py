"""A replica's leases at the tracker: the ready queue, dispatch and prefetch, renewal, release, and
the heartbeat that tells the tracker the replica's counts.

The engine's batch is kept full: `prefetch` leases wait ready, so a freed slot starts its next
episode at once while the dispatch that refills the queue is under way. Leases of long episodes
are renewed. The replica keeps nothing the system needs: killed at any moment, its leases expire
at the tracker. Releases are bounded in time for the same reason: the lease expires by itself
anyway, and a shutdown must not wait on one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine

import httpx

from services.config.rollout import RolloutSettings
from spopp.api.client import AsyncTrackerClient, RunFinished, StalePolicy, TrackerError
from spopp.api.tracker_api import Lease
from spopp.machine.retry import RETRYABLE_STATUS

from .metrics import RolloutMetrics

log = logging.getLogger("spopp.rollout")

# Heartbeats (the replica's counts at the tracker) every few seconds, and one at the end.
HEARTBEAT_S = 5.0


def default_prefetch(s: RolloutSettings) -> int:
    """Leases to hold ready when the settings leave it open: a quarter of the slots, at least one.

    Both engines batch continuously (a request joins the running batch whenever it comes, and a
    row leaves it the step it ends), so slots free one at a time and a few ready leases cover the
    dispatch round trip. More would only freeze more prompt values early: a ready lease's value
    is the one at its dispatch.
    """
    return max(1, s.concurrency // 4)


class Leases:
    """The leases this replica holds: `ready` (leased, not started) and `inflight` (an episode each),
    each `lease_seconds` long (the run's)."""

    def __init__(
        self,
        settings: RolloutSettings,
        lease_seconds: float,
        tracker: AsyncTrackerClient,
        metrics: RolloutMetrics,
        stopping: asyncio.Event,
    ) -> None:
        self.s = settings
        self.tracker = tracker
        self.metrics = metrics
        self.stopping = stopping
        self.inflight: dict[asyncio.Task, Lease] = {}
        # Leased, not started: the next episodes, so that a freed slot never waits on a dispatch.
        self.ready: list[Lease] = []
        self.prefetch = settings.prefetch if settings.prefetch is not None else default_prefetch(settings)
        # Refill the ready leases once half of them are gone (or none is left), not after every
        # episode: half the dispatch calls, and the other half still covers a dispatch's round trip.
        self.dispatch_step = max(1, self.prefetch // 2)
        self.lease_seconds = lease_seconds  # the run's (renewals come at a fraction of it)
        self.ended = 0  # episodes ended, however (what max_episodes counts)
        self.dispatches = 0  # dispatch calls made (the rollout bench reports calls per episode)

    # -- dispatch and prefetch ----------------------------------------------------------------
    async def dispatch(self, version: int | None) -> list[Lease]:
        """New leases for the free slots and the ready queue ([] when none is needed or the
        tracker is away). Raises StalePolicy when a newer policy is out, RunFinished when the run
        is over."""
        want = self.s.concurrency + self.prefetch - len(self.inflight) - len(self.ready)
        if not (want >= self.dispatch_step or (want > 0 and not self.ready)):
            return []
        self.dispatches += 1
        try:
            d = await unless_stopping(
                self.tracker.dispatch(self.s.run, self.s.worker_id, version, want), self.stopping
            )
        except (StalePolicy, RunFinished):
            raise
        except (TrackerError, httpx.HTTPError) as exc:
            if isinstance(exc, TrackerError) and exc.status not in RETRYABLE_STATUS:
                raise  # 401, 404 unknown run...: configuration, which no waiting fixes
            # The tracker stayed away longer than the retry bound: keep the episodes in
            # flight and try again, rather than exit and lose them.
            self.metrics.tracker_errors.inc()
            log.error("dispatch failed after %.0f s of retries: %s", self.s.retry_seconds, exc)
            return []
        got = d.requests if d is not None else []
        if got and self.stopping.is_set():
            # Leased as the shutdown came: give them straight back rather than start them.
            await self.release_all(got)
            got = []
        return got

    def start_ready(self, play: Callable[[Lease], Coroutine]) -> None:
        """Start held leases in the free slots, each as the episode `play(lease)`."""
        while self.ready and len(self.inflight) < self.s.concurrency and not self.stopping.is_set():
            lease = self.ready.pop(0)
            task = asyncio.create_task(play(lease))
            self.inflight[task] = lease
            task.add_done_callback(self._ended)
        self.metrics.in_flight.set(len(self.inflight))
        self.metrics.prefetched.set(len(self.ready))

    def _ended(self, task: asyncio.Task) -> None:
        self.inflight.pop(task, None)
        self.ended += 1
        if not task.cancelled() and task.exception() is not None:
            log.error("episode failed: %r", task.exception())

    # -- renew and release --------------------------------------------------------------------
    async def renew(self, lease: Lease) -> None:
        """Renew `lease` until cancelled (its episode ended)."""
        period = max(0.05, self.lease_seconds * self.s.renew_fraction)
        while True:
            await asyncio.sleep(period)
            try:
                await self.tracker.renew(self.s.run, lease.request_id)
            except (TrackerError, httpx.HTTPError) as exc:
                # The episode goes on: its outcome may still land if the lease outlives the outage.
                log.warning("renewal of %s failed: %s", lease.request_id, exc)

    async def release(self, lease: Lease) -> None:
        try:
            # Bounded: the lease expires by itself anyway, and a shutdown must not wait on this.
            await asyncio.wait_for(self.tracker.release(self.s.run, lease.request_id), timeout=10.0)
        except (TrackerError, httpx.HTTPError, TimeoutError) as exc:
            log.warning("release of %s failed: %s", lease.request_id, exc)

    async def release_all(self, leases: list[Lease]) -> None:
        await asyncio.gather(*(self.release(lease) for lease in leases))

    async def release_ready(self) -> None:
        """Give back the leases held ready: a new policy or a shutdown means they will not run."""
        ready, self.ready = self.ready, []
        self.metrics.prefetched.set(0)
        if ready:
            await self.release_all(ready)

    def keep_ready(self, floor: int) -> list[Lease]:
        """Keep the ready leases dispatched at version `floor` or later; answers the others (which
        the caller releases)."""
        late = [lease for lease in self.ready if lease.policy_version < floor]
        if late:
            self.ready = [lease for lease in self.ready if lease.policy_version >= floor]
            self.metrics.prefetched.set(len(self.ready))
        return late

    # -- heartbeats ---------------------------------------------------------------------------
    async def heartbeats(self, counts: Callable[[], tuple[int, int]]) -> None:
        """Every HEARTBEAT_S, until cancelled: `beat(*counts())`."""
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            await self.beat(*counts())

    async def beat(self, trajectories: int, episodes: int) -> None:
        """Tell the tracker this replica's cumulative counts: trajectories the learner accepted and
        episodes finished. The tracker keeps the largest it has seen, so a late one is harmless."""
        try:
            # Bounded: the next heartbeat carries the same counts or larger ones anyway.
            await asyncio.wait_for(
                self.tracker.heartbeat(self.s.run, self.s.worker_id, trajectories, episodes), timeout=10.0
            )
        except (TrackerError, httpx.HTTPError, TimeoutError) as exc:
            log.warning("heartbeat (%d trajectories, %d episodes) failed: %s", trajectories, episodes, exc)
        else:
            log.debug("heartbeat: %d trajectories accepted, %d episodes", trajectories, episodes)


async def unless_stopping(call, stopping: asyncio.Event, grace: float = 2.0):
    """Await `call`, unless `stopping` is set first (then None): a dispatch retrying through an
    outage must not hold up SIGTERM. An answer already on its way carries leases only this
    replica knows of, so it gets `grace` seconds to arrive (the caller releases them); a
    dispatch cut off after that may have leased tasks whose leases expire at the tracker."""
    work = asyncio.ensure_future(call)
    stop = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
    if not work.done():
        await asyncio.wait({work}, timeout=grace)
    if work.done():
        return work.result()
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)
    return None
