"""The rollout worker loop: dispatch → episode → outcome to the tracker → trajectory to the learner.

Up to `concurrency` episodes run at once on one engine (which batches their generations). The
worker composes the replica's concerns, each in its own module:
- services/rollout/leases.py: the ready queue, dispatch and prefetch, renewal, release, heartbeat;
- services/rollout/episodes.py: playing an episode, reporting its outcome, posting its trajectory;
- services/rollout/policy.py: following the policy version, draining, swapping the weights
  (through the gate of services/rollout/swap.py);
- services/rollout/startup.py: the run's record (`read_run`), read before the Worker is built from
  it, and the learner's /healthz before the first dispatch.
Here: the loop that keeps the slots full, and how the replica stops.

Every few seconds, and at the end, a heartbeat tells the tracker its counts (trajectories the
learner accepted, episodes finished). When the tracker says the run is finished (at start, or
answering a dispatch), it stops: running episodes are cancelled, every lease it holds is
released, and `run` returns, so the process exits 0.

Outages: every call to the tracker and the learner is retried for up to `retry_seconds`
(spopp.machine.retry), so a replica rides out a restart of either, or of Redis, keeping its in-flight
episodes, which report once the service is back. What still fails after that bound is logged and
counted (`spopp_rollout_lost`), never dropped silently; a dispatch that fails is tried again on
the next turn of the loop, so a replica outlives any outage. On SIGTERM it stops dispatching and
gives in-flight work `shutdown_seconds` to finish, then cancels it and releases its leases.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import httpx

from runtime.agent import reserve_env_threads
from runtime.engines.base import Engine
from runtime.envs.base import Environment, Task
from services.config.rollout import RolloutSettings
from spopp.api.client import AsyncTrackerClient, RunFinished, StalePolicy
from spopp.api.tracker_api import Lease, Run
from spopp.compare.streams import stream_key

from .episodes import Episodes, token_versions
from .leases import Leases, default_prefetch
from .metrics import RolloutMetrics
from .policy import PolicyFollower
from .startup import read_run, release_previous_life, run_finished, wait_for_learner
from .swap import VersionedEngine

__all__ = ["Worker", "default_prefetch", "read_run", "token_versions"]

log = logging.getLogger("spopp.rollout")

# At the run's finish, how long reports and deliveries under way may still take (at most
# shutdown_seconds): the learner may be gone, and nothing waits for it.
FINISH_GRACE_S = 5.0


class Worker:
    """One replica's worker for `run`, the run's record as the tracker had it when the replica
    started (`read_run`): a run's configuration never changes, so its lease length, max_staleness,
    seed and study are read once, and the components are built with them."""

    def __init__(
        self,
        settings: RolloutSettings,
        run: Run,
        engine: Engine,
        make_env: Callable[[], Environment],
        tasks: dict[str, Task],
        metrics: RolloutMetrics | None = None,
    ) -> None:
        self.s = settings
        self.run_record = run
        # Behind the swap gate: every generation carries the policy version that made it.
        self.engine = VersionedEngine(engine)
        self.metrics = metrics or RolloutMetrics()
        self._summarised = False  # the lifetime line is logged once (_log_summary)
        self.tracker = AsyncTrackerClient(
            settings.tracker, token=settings.api_token, retry_seconds=settings.retry_seconds
        )
        # The learner's intake takes the same bearer token as the tracker.
        auth = {"Authorization": f"Bearer {settings.api_token}"} if settings.api_token else {}
        self.learner = httpx.AsyncClient(base_url=settings.learner, timeout=60.0, headers=auth)
        self.stopping = asyncio.Event()
        self.leases = Leases(settings, run.config.lease_seconds, self.tracker, self.metrics, self.stopping)
        # A restarted replica counts on from what the tracker has of it, so its counts add up.
        mine = run.workers.get(settings.worker_id)
        self.episodes = Episodes(
            settings, self.engine, make_env, tasks, (self.tracker, self.learner), self.leases,
            self.metrics, self.stopping, run_seed=run.config.seed,
            stream=stream_key(settings.run, run.config.study),
            counted=(mine.trajectories, mine.episodes) if mine is not None else (0, 0),
        )  # fmt: skip
        self.policy = PolicyFollower(
            settings, run.config.max_staleness, self.engine, self.tracker, (self.leases, self.episodes),
            self.metrics, self.stopping,
        )  # fmt: skip

    # -- what the health route, the tests and the bench read ------------------------------------
    @property
    def agent_sessions(self):
        """The open agent episodes whose calls the replica serves (`runtime.chat_endpoint`), where
        its environment is an agent's; None otherwise (no chat routes)."""
        return self.episodes.endpoint.sessions if self.episodes.calls_over_chat else None

    def serve_agents_at(self, url: str) -> None:
        """The URL of this replica's chat routes: what an agent's child process is handed
        (`client.subprocess_env`), instead of a second server of its own."""
        self.episodes.endpoint.base_url = url

    @property
    def version(self) -> int | None:
        return self.policy.version

    @property
    def max_staleness(self) -> int:
        return self.policy.max_staleness

    @property
    def ready(self) -> list[Lease]:
        return self.leases.ready

    @ready.setter
    def ready(self, leases: list[Lease]) -> None:
        self.leases.ready = leases

    @property
    def inflight(self) -> dict[asyncio.Task, Lease]:
        return self.leases.inflight

    @inflight.setter
    def inflight(self, episodes: dict[asyncio.Task, Lease]) -> None:
        self.leases.inflight = episodes

    @property
    def prefetch(self) -> int:
        return self.leases.prefetch

    @property
    def dispatch_step(self) -> int:
        return self.leases.dispatch_step

    @property
    def dispatches(self) -> int:
        return self.leases.dispatches

    @property
    def run_seed(self) -> int:
        return self.episodes.run_seed

    @property
    def reporting(self) -> set[asyncio.Task]:
        return self.episodes.reporting

    @property
    def outcomes(self):
        return self.episodes.outcomes

    @property
    def trajectories(self):
        return self.episodes.trajectories

    # -- the loop -----------------------------------------------------------------------------
    async def run(self, max_episodes: int | None = None) -> None:
        """Play until stopped, `max_episodes`, or the run's finish (then return normally: the
        replica's work is done, and its process exits 0)."""
        reserve_env_threads(self.s.concurrency)
        self.episodes.check_prompts()
        try:
            await self._before_first_dispatch()
        except RunFinished as done:
            self._say_finished(done.policy_version)
            return
        beats = asyncio.create_task(self.leases.heartbeats(self.episodes.counts))
        try:
            finished = await self._loop(max_episodes)
            if finished is not None:
                await self._stop_for_finish(finished)
            elif self.stopping.is_set():
                await self._finish_for_shutdown()
            else:  # max_episodes reached: finish the work, deliveries included (bounded by the retries)
                await self.policy.drain()
                await asyncio.gather(*self.episodes.deliveries, return_exceptions=True)
            await self.leases.release_ready()
        finally:
            beats.cancel()
            await asyncio.gather(beats, return_exceptions=True)
            # The last counts, also on the way out of an error.
            await self.leases.beat(*self.episodes.counts())
        if self.episodes.fatal is not None:
            raise self.episodes.fatal

    async def _before_first_dispatch(self) -> None:
        """RunFinished if the run was over when read; give back a previous life's leases, wait for
        the learner, load the policy."""
        run = self.run_record
        if run.status == "finished":
            raise run_finished(run)
        if self.s.worker_id in run.workers:
            await release_previous_life(self.s, self.tracker)
        await wait_for_learner(self.s, self.learner, self.tracker, self.stopping)
        await self.policy.sync()

    async def _loop(self, max_episodes: int | None) -> RunFinished | None:
        """Keep the slots full until stopped or `max_episodes`; answers RunFinished when the
        tracker says the run is over."""
        while not self.stopping.is_set():
            if max_episodes is not None and self.leases.ended >= max_episodes:
                break
            self.leases.start_ready(self.episodes.play)
            try:
                got = await self.leases.dispatch(self.policy.version)
            except StalePolicy as stale:
                await self.policy.new_policy(stale.policy_version, stale.snapshot)
                continue  # the new policy is loaded: dispatch for it at once
            except RunFinished as done:
                return done
            self.leases.ready.extend(got)
            self.leases.start_ready(self.episodes.play)
            if running := list(self.leases.inflight):
                # Wake as soon as one episode ends (to refill its slot), or poll for idle tasks.
                await asyncio.wait(running, timeout=self.s.poll_seconds, return_when=asyncio.FIRST_COMPLETED)
            else:
                await asyncio.sleep(self.s.poll_seconds)
        return None

    # -- stopping -----------------------------------------------------------------------------
    async def _stop_for_finish(self, done: RunFinished) -> None:
        """The run is over and the learner takes nothing more: running episodes are cancelled and
        every lease held is released. Outcome reports under way may still land (late evidence
        counts at the tracker), and deliveries get a short grace in case the learner still
        answers, so that the last counts are right; what is left then is cancelled."""
        self._say_finished(done.policy_version)
        self.stopping.set()
        await self.leases.release_ready()
        episodes = list(self.leases.inflight)
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

    async def _finish_for_shutdown(self) -> None:
        """Give in-flight episodes and deliveries `shutdown_seconds` to finish, then cancel the rest
        (leases released; what was not delivered is logged and counted as lost)."""
        await self.leases.release_ready()
        await self._settle(self.s.shutdown_seconds)
        self._log_summary()

    async def _settle(self, seconds: float, include_episodes: bool = True) -> None:
        """Wait up to `seconds` for episodes, then reports, then deliveries; cancel what is left."""
        # Episodes first: they add reports, which add deliveries.
        groups = [("episodes", self.leases.inflight)] if include_episodes else []
        groups += [("outcome reports", self.episodes.reporting), ("deliveries", self.episodes.deliveries)]
        await settle(groups, seconds)

    async def shutdown(self) -> None:
        self.stopping.set()

    async def close(self) -> None:
        await self.episodes.outcomes.aclose()
        await self.episodes.trajectories.aclose()
        await self.tracker.aclose()
        await self.learner.aclose()


async def settle(groups: list[tuple[str, dict | set]], seconds: float) -> None:
    """Wait up to `seconds` in all for each group of tasks in turn; cancel what is left of it."""
    deadline = time.monotonic() + seconds
    for what, pending in groups:
        if not pending:
            continue
        log.info("shutting down: %d %s to finish", len(pending), what)
        _, late = await asyncio.wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        if late:
            log.warning("cancelled %d unfinished tasks at shutdown", len(late))
