"""The rollout worker loop: dispatch → episode → outcome to the tracker → trajectory to the learner.

Up to `concurrency` episodes run at once on one engine (which batches their generations). The
engine's batch is kept full: a slot frees the moment its episode's generation ends (the outcome
report and the trajectory POST go on beside it), and `prefetch` leases wait ready, so a freed
slot starts its next episode at once while the dispatch that refills the queue is under way.
Outcome reports and trajectory deliveries are coalesced (services/rollout/outcomes.py,
deliveries.py): those that finish while a call is on its way leave together in the next.
When the tracker answers a dispatch with 409, a newer policy is out: the worker releases the
leases it holds ready, stops dispatching, drains (`finish`: in-flight episodes complete and
report; `abort`: their leases are released), swaps in the new snapshot's weights and goes on.
Under bounded staleness (the run's max_staleness k > 0) nothing that may still train waits: the
weights change between turns (services/rollout/swap.py records each token's version) or at
episode ends (`swap`), ready leases within k versions are kept, and only episodes now more than
k versions old are drained.
Leases of long episodes are renewed. The replica keeps nothing the system needs: killed at any
moment, its leases expire at the tracker.

Before its first dispatch it waits for the learner's /healthz (bounded by `retry_seconds`), so
that no lease waits on a learner that is still loading its model. Every few seconds, and at the
end, a heartbeat tells the tracker its counts (trajectories the learner accepted, episodes
finished). When the tracker says the run is finished (at start, or answering a dispatch), it
stops: running episodes are cancelled, every lease it holds is released, and `run` returns, so
the process exits 0.

Outages: every call to the tracker and the learner is retried for up to `retry_seconds`
(spopp.retry), so a replica rides out a restart of either, or of Redis, keeping its in-flight
episodes, which report once the service is back. What still fails after that bound is logged and
counted (`spopp_rollout_lost`), never dropped silently; a dispatch that fails is tried again on
the next turn of the loop, so a replica outlives any outage. On SIGTERM it stops dispatching and
gives in-flight work `shutdown_seconds` to finish, then cancels it and releases its leases.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import zlib
from collections.abc import Callable
from dataclasses import replace

import httpx

from runtime.agent import (
    Budget,
    Episode,
    prompts_over_budget,
    reserve_env_threads,
    run_episode,
    within_context,
)
from runtime.chat import ChatRenderer
from runtime.engines.base import Engine, SamplingConfig
from runtime.envs.base import Environment, Task, episode_seed
from spopp import staleness
from spopp.client import AsyncTrackerClient, RunFinished, StalePolicy, TrackerError
from spopp.retry import RETRYABLE_STATUS, RetryPolicy
from spopp.snapshots import snapshot_path
from spopp.tracker_api import Lease, Run
from spopp.trajectory import Trajectory

from .config import RolloutSettings
from .deliveries import TrajectoryBatcher, Undelivered
from .metrics import RolloutMetrics
from .outcomes import OutcomeBatcher
from .swap import VersionedEngine

log = logging.getLogger("spopp.rollout")

# How long an outcome report and a trajectory wait for others to share their call. Episodes end
# one at a time (continuous batching), usually further apart than a call takes, so without it
# each would get a call of its own (measured: 0.85 calls per episode for each). An outcome's wait
# is short because the tracker's evidence (and a drain) waits on it; the learner only waits for
# whole batches, so a trajectory can wait longer.
OUTCOME_LINGER_S = 0.02
TRAJECTORY_LINGER_S = 0.05
# Heartbeats (the replica's counts at the tracker) every few seconds, and one at the end.
HEARTBEAT_S = 5.0
# How often the learner's /healthz is tried before the first dispatch.
LEARNER_WAIT_POLL_S = 1.0
# At the run's finish, how long reports and deliveries under way may still take (at most
# shutdown_seconds): the learner may be gone, and nothing waits for it.
FINISH_GRACE_S = 5.0


def default_prefetch(s: RolloutSettings) -> int:
    """Leases to hold ready when the settings leave it open: a quarter of the slots, at least one.

    Both engines batch continuously (a request joins the running batch whenever it comes, and a
    row leaves it the step it ends), so slots free one at a time and a few ready leases cover the
    dispatch round trip. More would only freeze more prompt values early: a ready lease's value
    is the one at its dispatch.
    """
    return max(1, s.concurrency // 4)


class Worker:
    def __init__(
        self,
        settings: RolloutSettings,
        engine: Engine,
        make_env: Callable[[], Environment],
        tasks: dict[str, Task],
        metrics: RolloutMetrics | None = None,
    ) -> None:
        self.s = settings
        # Behind the swap gate: every generation carries the policy version that made it.
        self.engine = VersionedEngine(engine)
        self.make_env = make_env
        self.tasks = tasks
        self.metrics = metrics or RolloutMetrics()
        self._summarised = False  # the lifetime line is logged once (_log_summary)
        self.tracker = AsyncTrackerClient(
            settings.tracker, token=settings.api_token, retry_seconds=settings.retry_seconds
        )
        self.outcomes = OutcomeBatcher(self.tracker, settings.run, linger=OUTCOME_LINGER_S)
        # The learner's intake takes the same bearer token as the tracker.
        auth = {"Authorization": f"Bearer {settings.api_token}"} if settings.api_token else {}
        self.learner = httpx.AsyncClient(base_url=settings.learner, timeout=60.0, headers=auth)
        self.trajectories = TrajectoryBatcher(
            self.learner,
            RetryPolicy(settings.retry_seconds),
            linger=TRAJECTORY_LINGER_S,
            on_retry=self.metrics.learner_retries.inc,
        )
        self.renderer = ChatRenderer(engine.tokenizer)
        self.budget = Budget(settings.max_turns, settings.max_tokens_per_turn, settings.max_total_tokens)
        self.sampling = SamplingConfig(
            max_tokens=settings.max_tokens_per_turn,
            temperature=settings.temperature,
            top_p=settings.top_p,
            top_k=settings.top_k,
        )
        self.version: int | None = None
        self.snapshot: str | None = None
        self.inflight: dict[asyncio.Task, Lease] = {}
        # Leased, not started: the next episodes, so that a freed slot never waits on a dispatch.
        self.ready: list[Lease] = []
        self.prefetch = settings.prefetch if settings.prefetch is not None else default_prefetch(settings)
        # Refill the ready leases once half of them are gone (or none is left), not after every
        # episode: half the dispatch calls, and the other half still covers a dispatch's round trip.
        self.dispatch_step = max(1, self.prefetch // 2)
        # Outcome reports of episodes whose generation is over; their slots are free already.
        self.reporting: set[asyncio.Task] = set()
        # Trajectory POSTs under way. They leave the episode once its outcome is reported, so a
        # drain waits for generation and reports only, never for a learner that is away.
        self.deliveries: set[asyncio.Task] = set()
        self.stopping = asyncio.Event()
        self.fatal: Exception | None = None
        self.lease_seconds = 900.0
        self.max_staleness = 0  # the run's k, read at start
        # The run's seed at the tracker (read at start): the base of the environments' per-episode
        # streams, the same whichever replica plays a request (the replicas' `seed`s differ).
        self.run_seed = 0
        self._episodes = 0
        # This replica's counts for its heartbeats: trajectories the learner accepted, episodes
        # played to the end; `counted` is what the tracker had of this worker id at start.
        self.accepted = 0
        self.episodes_done = 0
        self.counted = (0, 0)
        self.dispatches = 0  # dispatch calls made (the rollout bench reports calls per episode)

    # -- policy -------------------------------------------------------------------------------
    async def sync_policy(self) -> None:
        """Load the tracker's current snapshot if it is not the one the engine holds."""
        policy = await self.tracker.policy(self.s.run)
        await self._follow(policy.version, policy.snapshot)

    async def _follow(self, version: int, snapshot: str | None) -> None:
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

    async def _new_policy(self, version: int, snapshot: str | None) -> None:
        """A newer policy is out (a dispatch said so): drain (k = 0), or keep going (k > 0), then
        load it."""
        if self.max_staleness == 0:
            await self._drain()
        else:
            await self._keep_going(version)
        await self._follow(version, snapshot)

    async def _keep_going(self, version: int) -> None:
        """Bounded staleness: episodes dispatched within k versions of `version` may still train,
        so they go on (`swap: turn`: under the new weights from their next turn; `episode`: to
        their end under the old ones, new episodes waiting). Those older than that can only feed
        the tracker's evidence now: `drain` says whether they finish (and report) or are released."""
        floor = staleness.oldest_trainable(version, self.max_staleness)
        late = [lease for lease in self.ready if lease.policy_version < floor]
        if late:
            self.ready = [lease for lease in self.ready if lease.policy_version >= floor]
            self.metrics.prefetched.set(len(self.ready))
            await asyncio.gather(*(self._release(lease) for lease in late))
        if self.s.drain == "abort":
            for task, lease in list(self.inflight.items()):
                if lease.policy_version < floor:
                    task.cancel()
        if self.s.swap == "episode" and self.inflight:
            t0 = time.perf_counter()
            log.info("swap at episode ends: %d episodes finish under the old weights", len(self.inflight))
            await asyncio.gather(*self.inflight, return_exceptions=True)
            self.metrics.drain_seconds.observe(time.perf_counter() - t0)

    async def _drain(self) -> None:
        t0 = time.perf_counter()
        try:
            await self._drain_work()
        finally:
            self.metrics.drain_seconds.observe(time.perf_counter() - t0)

    async def _drain_work(self) -> None:
        await self._release_ready()
        if self.inflight:
            log.info("draining %d episodes (%s)", len(self.inflight), self.s.drain)
            if self.s.drain == "abort":
                for task in self.inflight:
                    task.cancel()
            await asyncio.gather(*self.inflight, return_exceptions=True)
        # Their outcomes land before the new policy's episodes start (each at its own event time).
        await asyncio.gather(*self.reporting, return_exceptions=True)

    async def _release_ready(self) -> None:
        """Give back the leases held ready: a new policy or a shutdown means they will not run."""
        ready, self.ready = self.ready, []
        self.metrics.prefetched.set(0)
        if ready:
            await asyncio.gather(*(self._release(lease) for lease in ready))

    def _start_ready(self) -> None:
        """Start held leases in the free slots."""
        while self.ready and len(self.inflight) < self.s.concurrency and not self.stopping.is_set():
            lease = self.ready.pop(0)
            task = asyncio.create_task(self._episode(lease))
            self.inflight[task] = lease
            task.add_done_callback(self._finished)
        self.metrics.in_flight.set(len(self.inflight))
        self.metrics.prefetched.set(len(self.ready))

    # -- the loop -----------------------------------------------------------------------------
    def check_prompts(self) -> None:
        """Fail at start-up when a task's opening alone fills the token budget: such a task could
        never get an answer, and its leases would only bounce between tracker and replica."""
        budget = within_context(self.budget, self.engine)
        too_long = prompts_over_budget(self.tasks.values(), self.make_env, self.renderer, budget)
        if too_long:
            raise ValueError(
                f"{len(too_long)} task prompts leave no room under max_total_tokens="
                f"{budget.max_total_tokens} (the budget, or the engine's context if smaller): "
                f"{', '.join(too_long[:5])}; raise the budget or drop them"
            )

    async def run(self, max_episodes: int | None = None) -> None:
        """Play until stopped, `max_episodes`, or the run's finish (then return normally: the
        replica's work is done, and its process exits 0)."""
        reserve_env_threads(self.s.concurrency)
        self.check_prompts()
        try:
            await self._before_first_dispatch()
        except RunFinished as done:
            self._say_finished(done.policy_version)
            return
        beats = asyncio.create_task(self._heartbeats())
        try:
            finished = await self._loop(max_episodes)
            if finished is not None:
                await self._stop_for_finish(finished)
            elif self.stopping.is_set():
                await self._finish_for_shutdown()
            else:  # max_episodes reached: finish the work, deliveries included (bounded by the retries)
                await self._drain()
                await asyncio.gather(*self.deliveries, return_exceptions=True)
            await self._release_ready()
        finally:
            beats.cancel()
            await asyncio.gather(beats, return_exceptions=True)
            await self._beat()  # the last counts, also on the way out of an error
        if self.fatal is not None:
            raise self.fatal

    async def _before_first_dispatch(self) -> None:
        """Read the run (RunFinished if it is over), wait for the learner, load the policy."""
        run = await self.tracker.get_run(self.s.run)
        # A run's configuration never changes: read its lease length once, not per episode.
        self.lease_seconds = run.config.lease_seconds
        self.max_staleness = run.config.max_staleness
        self.run_seed = run.config.seed
        if run.status == "finished":
            raise _finished(run)
        # A restarted replica counts on from what the tracker has of it, so its counts add up.
        mine = run.workers.get(self.s.worker_id)
        if mine is not None:
            self.counted = (mine.trajectories, mine.episodes)
            # Its previous life's leases have no episode behind them now: give them back at once
            # rather than keep their tasks out of the race until the leases expire.
            back = await self.tracker.release_worker(self.s.run, self.s.worker_id)
            if back.released or back.expired:
                log.info(
                    "gave back %d leases of this worker's previous life (%d found expired)",
                    len(back.released), back.expired,
                )  # fmt: skip
        await self._wait_for_learner()
        await self.sync_policy()

    async def _wait_for_learner(self) -> None:
        """Wait until the learner's /healthz answers before the first dispatch: leases taken while
        the learner starts (its model load is the slowest start of all) would only wait on it,
        their prompt values frozen early. Bounded by retry_seconds, then the replica goes on (its
        POSTs retry by themselves); the run's status is read meanwhile, so that a run finished
        during the wait ends it (RunFinished)."""
        deadline = time.monotonic() + self.s.retry_seconds
        said = False
        while not self.stopping.is_set():
            with contextlib.suppress(httpx.HTTPError):
                if (await self.learner.get("/healthz", timeout=5.0)).status_code == 200:
                    if said:
                        log.info("the learner answers at %s: dispatching", self.s.learner)
                    return
            if time.monotonic() >= deadline:
                log.warning(
                    "the learner at %s did not answer /healthz within %.0f s; dispatching anyway",
                    self.s.learner, self.s.retry_seconds,
                )  # fmt: skip
                return
            if not said:
                log.info("waiting for the learner at %s before the first dispatch", self.s.learner)
                said = True
            run = await self.tracker.get_run(self.s.run)
            if run.status == "finished":
                raise _finished(run)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), timeout=LEARNER_WAIT_POLL_S)

    async def _loop(self, max_episodes: int | None) -> RunFinished | None:
        """Keep the slots full until stopped or `max_episodes`; answers RunFinished when the
        tracker says the run is over."""
        while not self.stopping.is_set():
            if max_episodes is not None and self._episodes >= max_episodes:
                break
            self._start_ready()
            try:
                got = await self._dispatch_more()
            except RunFinished as done:
                return done
            if got is None:  # a new policy is loaded: dispatch for it at once
                continue
            self.ready.extend(got)
            self._start_ready()
            if self.inflight:
                # Wake as soon as one episode ends (to refill its slot), or poll for idle tasks.
                await asyncio.wait(
                    list(self.inflight), timeout=self.s.poll_seconds, return_when=asyncio.FIRST_COMPLETED
                )
            else:
                await asyncio.sleep(self.s.poll_seconds)
        return None

    async def _dispatch_more(self) -> list[Lease] | None:
        """New leases for the free slots and the ready queue ([] when none is needed or the
        tracker is away); None after a new policy was drained and loaded."""
        want = self.s.concurrency + self.prefetch - len(self.inflight) - len(self.ready)
        if not (want >= self.dispatch_step or (want > 0 and not self.ready)):
            return []
        self.dispatches += 1
        try:
            d = await self._unless_stopping(
                self.tracker.dispatch(self.s.run, self.s.worker_id, self.version, want)
            )
        except StalePolicy as stale:
            await self._new_policy(stale.policy_version, stale.snapshot)
            return None
        except RunFinished:
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
            await asyncio.gather(*(self._release(lease) for lease in got))
            got = []
        return got

    async def _stop_for_finish(self, done: RunFinished) -> None:
        """The run is over and the learner takes nothing more: running episodes are cancelled and
        every lease held is released. Outcome reports under way may still land (late evidence
        counts at the tracker), and deliveries get a short grace in case the learner still
        answers, so that the last counts are right; what is left then is cancelled."""
        self._say_finished(done.policy_version)
        self.stopping.set()
        await self._release_ready()
        episodes = list(self.inflight)
        for task in episodes:
            task.cancel()  # each releases its lease as it ends
        await asyncio.gather(*episodes, return_exceptions=True)
        await self._settle(min(self.s.shutdown_seconds, FINISH_GRACE_S), include_episodes=False)

    def _say_finished(self, version: int) -> None:
        log.info("run %s is finished (version %d): replica %s exits", self.s.run, version, self.s.worker_id)
        self._log_summary()

    def _log_summary(self) -> None:
        """The replica's lifetime line (episodes, generated tokens, tokens/s), once, however it stops:
        a finished run or a signal (the launcher stops replicas once the budget is reached)."""
        if not self._summarised:
            self._summarised = True
            log.info("replica %s generated %s", self.s.worker_id, self.metrics.summary())

    # -- heartbeats ---------------------------------------------------------------------------
    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            await self._beat()

    async def _beat(self) -> None:
        """Tell the tracker this replica's cumulative counts: trajectories the learner accepted and
        episodes finished. The tracker keeps the largest it has seen, so a late one is harmless."""
        trajectories, episodes = self.counted[0] + self.accepted, self.counted[1] + self.episodes_done
        try:
            # Bounded: the next heartbeat carries the same counts or larger ones anyway.
            await asyncio.wait_for(
                self.tracker.heartbeat(self.s.run, self.s.worker_id, trajectories, episodes), timeout=10.0
            )
        except (TrackerError, httpx.HTTPError, TimeoutError) as exc:
            log.warning("heartbeat (%d trajectories, %d episodes) failed: %s", trajectories, episodes, exc)
        else:
            log.debug("heartbeat: %d trajectories accepted, %d episodes", trajectories, episodes)

    async def _unless_stopping(self, call, grace: float = 2.0):
        """Await `call`, unless a shutdown comes first (then None): a dispatch retrying through an
        outage must not hold up SIGTERM. An answer already on its way carries leases only this
        replica knows of, so it gets `grace` seconds to arrive (the caller releases them); a
        dispatch cut off after that may have leased tasks whose leases expire at the tracker."""
        work = asyncio.ensure_future(call)
        stop = asyncio.ensure_future(self.stopping.wait())
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

    async def _finish_for_shutdown(self) -> None:
        """Give in-flight episodes and deliveries `shutdown_seconds` to finish, then cancel the rest
        (leases released; what was not delivered is logged and counted as lost)."""
        await self._release_ready()
        await self._settle(self.s.shutdown_seconds)
        self._log_summary()

    async def _settle(self, seconds: float, include_episodes: bool = True) -> None:
        """Wait up to `seconds` for episodes, then reports, then deliveries; cancel what is left."""
        deadline = time.monotonic() + seconds
        # Episodes first: they add reports, which add deliveries.
        groups = [("episodes", self.inflight)] if include_episodes else []
        for what, pending in [*groups, ("outcome reports", self.reporting), ("deliveries", self.deliveries)]:
            if not pending:
                continue
            log.info("shutting down: %d %s to finish", len(pending), what)
            _, late = await asyncio.wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
            if late:
                log.warning("cancelled %d unfinished tasks at shutdown", len(late))

    def _finished(self, task: asyncio.Task) -> None:
        self.inflight.pop(task, None)
        self._episodes += 1
        if not task.cancelled() and task.exception() is not None:
            log.error("episode failed: %r", task.exception())

    async def shutdown(self) -> None:
        self.stopping.set()

    async def close(self) -> None:
        await self.outcomes.aclose()
        await self.trajectories.aclose()
        await self.tracker.aclose()
        await self.learner.aclose()

    # -- one episode --------------------------------------------------------------------------
    async def _episode(self, lease: Lease) -> None:
        task = self.tasks.get(lease.task_id)
        if task is None:
            # The replica's task file does not match the run's tasks: a configuration error that
            # no retry fixes, so stop rather than bounce leases back and forth.
            await self._release(lease)
            self.fatal = ValueError(
                f"the tracker dispatched task {lease.task_id!r}, which is not in this replica's tasks: "
                "give the replica the task file the run was registered from"
            )
            self.stopping.set()
            return
        renewer = asyncio.create_task(self._renew(lease))
        env = self.make_env()
        try:
            # Per-episode seed from (seed, request): reproducible across processes, unlike hash().
            seed = zlib.crc32(f"{self.s.seed}:{lease.request_id}".encode())
            # The environment's stream: from the run's seed, the task and the request id. Request
            # ids are the tracker's per-run counter (r1, r2, ...: dispatch.lua), so a run that
            # dispatches in the same order gives each episode the same stream, and no two episodes
            # of a run share one.
            env_seed = episode_seed(self.run_seed, lease.task_id, lease.request_id)
            ep = await run_episode(
                self.engine, env, task, self.budget, replace(self.sampling, seed=seed), self.renderer,
                env_seed=env_seed,
            )  # fmt: skip
        except asyncio.CancelledError:
            await asyncio.shield(self._release(lease))
            raise
        except Exception:
            await self._release(lease)
            raise
        finally:
            renewer.cancel()
            env.close()
        if ep.generated_tokens == 0:  # nothing to learn from and no answer to judge
            log.error("task %s: no room to generate (%s); releasing", lease.task_id, ep.finish_reason)
            await self._release(lease)
            return
        self.metrics.observe_episode(ep)
        self.episodes_done += 1
        # The slot is free from here on: the report and the POST go on beside the next episode.
        report = asyncio.create_task(self._report(lease, ep))
        self.reporting.add(report)
        self.metrics.reporting.set(len(self.reporting))
        report.add_done_callback(self._reported)

    def _reported(self, task: asyncio.Task) -> None:
        self.reporting.discard(task)
        self.metrics.reporting.set(len(self.reporting))
        if not task.cancelled() and task.exception() is not None:
            log.error("outcome report failed: %r", task.exception())

    async def _report(self, lease: Lease, ep: Episode) -> None:
        """Report the outcome (its value and advantage come back), then hand the POST to a delivery."""
        try:
            result = await self.outcomes.report(lease.request_id, ep.reward)
        except asyncio.CancelledError:
            # Cut off by a shutdown while reporting: give the lease back (a 409 if the report had
            # landed after all, which is logged and harmless) rather than leave it until expiry.
            self.metrics.lost.labels("outcome").inc()
            await asyncio.shield(self._release(lease))
            raise
        except (TrackerError, httpx.HTTPError) as exc:
            # Past the retry bound, or refused (409: the lease expired during a long outage).
            # Without the tracker's value there is no advantage to train on: the episode is lost.
            self.metrics.lost.labels("outcome").inc()
            log.error("outcome of %s not reported: %s", lease.request_id, exc)
            return
        delivery = asyncio.create_task(self._post(lease, ep, result.value, result.advantage))
        self.deliveries.add(delivery)
        delivery.add_done_callback(self.deliveries.discard)

    async def _release(self, lease: Lease) -> None:
        try:
            # Bounded: the lease expires by itself anyway, and a shutdown must not wait on this.
            await asyncio.wait_for(self.tracker.release(self.s.run, lease.request_id), timeout=10.0)
        except (TrackerError, httpx.HTTPError, TimeoutError) as exc:
            log.warning("release of %s failed: %s", lease.request_id, exc)

    async def _renew(self, lease: Lease) -> None:
        period = max(0.05, self.lease_seconds * self.s.renew_fraction)
        while True:
            await asyncio.sleep(period)
            try:
                await self.tracker.renew(self.s.run, lease.request_id)
            except (TrackerError, httpx.HTTPError) as exc:
                # The episode goes on: its outcome may still land if the lease outlives the outage.
                log.warning("renewal of %s failed: %s", lease.request_id, exc)

    async def _post(self, lease: Lease, ep: Episode, value: float, advantage: float | None) -> None:
        versions = token_versions(lease, ep)
        if versions is not None:
            self.metrics.mixed_episodes.inc()
        body = Trajectory(
            run=self.s.run,
            request_id=lease.request_id,
            task_id=lease.task_id,
            policy_version=lease.policy_version,
            token_ids=ep.token_ids,
            action_mask=ep.action_mask,
            rollout_logprobs=ep.rollout_logprobs,
            token_versions=versions,
            reward=ep.reward,
            value=value,
            advantage=advantage,
            num_turns=ep.num_turns,
            finish_reason=ep.finish_reason,
            timings=ep.timings,
        ).model_dump(mode="json")
        try:
            d = await self.trajectories.deliver(body)
        except Undelivered as exc:
            log.error("trajectory %s %s", lease.request_id, exc)
            self.metrics.lost.labels("trajectory").inc()
            self.metrics.posted.labels("unreachable").inc()
            return
        except asyncio.CancelledError:
            self.metrics.lost.labels("trajectory").inc()
            raise
        except Exception as exc:  # noqa: BLE001 - an answer that makes no sense: counted, not hidden
            log.error("trajectory %s not delivered: %r", lease.request_id, exc)
            self.metrics.lost.labels("trajectory").inc()
            self.metrics.posted.labels("error").inc()
            return
        if d.accepted:
            self.accepted += 1
        if d.status == 409:
            # An old version's episode: SPO++ already has its outcome, the learner has moved on.
            self.metrics.drained.inc()
        elif d.status >= 400:
            log.error("learner refused %s: %s %s %s", lease.request_id, d.status, d.code, d.message)
        self.metrics.posted.labels(str(d.status)).inc()


def token_versions(lease: Lease, ep: Episode) -> list[int] | None:
    """The version of every token where a swap fell inside the episode, else None (all of them
    are the dispatch's version: the record stays as small as before)."""
    if len(ep.token_versions) != len(ep.token_ids):
        return None  # an engine outside the gate: versions unknown, the dispatch's stands
    versions = [lease.policy_version if v is None else v for v in ep.token_versions]
    return versions if any(v != lease.policy_version for v in versions) else None


def _finished(run: Run) -> RunFinished:
    """The refusal a dispatch would get, made from the run as the tracker reads it."""
    message = f"run {run.run} finished at version {run.final_version}: no new leases"
    return RunFinished(409, {"code": "run_finished", "message": message, "policy_version": run.final_version})
