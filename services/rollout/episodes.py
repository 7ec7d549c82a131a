"""One episode of a replica: play it under a lease, report its outcome to the tracker, post its
trajectory to the learner.

A slot frees the moment its episode's generation ends: the outcome report and the trajectory POST
go on beside the next episode. Outcome reports and trajectory deliveries are coalesced
(services/rollout/outcomes.py, deliveries.py): those that finish while a call is on its way leave
together in the next. What still fails after the retry bound (spopp.machine.retry) is logged and counted
(`spopp_rollout_lost`), never dropped silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import replace

import httpx

from runtime.agent import prompts_over_budget, run_episode
from runtime.chat import ChatRenderer
from runtime.chat_endpoint import Endpoint
from runtime.engines.base import Engine, SamplingConfig
from runtime.envs.base import Playable, Task, episode_seed
from runtime.episode import Episode, within_context
from services.config.rollout import RolloutSettings
from spopp.api.client import AsyncTrackerClient, TrackerError
from spopp.api.tracker_api import Lease
from spopp.api.trajectory import Trajectory
from spopp.compare.streams import sampling_seed
from spopp.machine.retry import RetryPolicy

from .deliveries import TrajectoryBatcher, Undelivered
from .leases import Leases
from .metrics import RolloutMetrics
from .outcomes import OutcomeBatcher

log = logging.getLogger("spopp.rollout")

# How long an outcome report and a trajectory wait for others to share their call. Episodes end
# one at a time (continuous batching), usually further apart than a call takes, so without it
# each would get a call of its own (measured: 0.85 calls per episode for each). An outcome's wait
# is short because the tracker's evidence (and a drain) waits on it; the learner only waits for
# whole batches, so a trajectory can wait longer.
OUTCOME_LINGER_S = 0.02
TRAJECTORY_LINGER_S = 0.05
# Episodes that generate nothing (an agent that returns without a call) take no engine time, so a
# replica whose every episode is one would dispatch and report as fast as the tracker answers. Once
# `concurrency` of them end in a row, each further one holds its slot this long before the next
# episode starts in it (one ending with tokens ends the streak).
EMPTY_EPISODE_HOLD_S = 1.0


class Episodes:
    """Episodes of `tasks` on `engine`; their reports and deliveries, and the replica's counts."""

    def __init__(
        self,
        settings: RolloutSettings,
        engine: Engine,
        make_env: Callable[[], Playable],
        tasks: dict[str, Task],
        clients: tuple[AsyncTrackerClient, httpx.AsyncClient],
        leases: Leases,
        metrics: RolloutMetrics,
        stopping: asyncio.Event,
        *,
        run_seed: int,
        stream: str,
        counted: tuple[int, int],
    ) -> None:
        self.s = settings
        self.engine = engine
        self.make_env = make_env
        self.tasks = tasks
        self.leases = leases
        self.metrics = metrics
        self.stopping = stopping
        tracker, learner = clients
        self.outcomes = OutcomeBatcher(tracker, settings.run, linger=OUTCOME_LINGER_S)
        self.trajectories = TrajectoryBatcher(
            learner,
            RetryPolicy(settings.retry_seconds),
            linger=TRAJECTORY_LINGER_S,
            on_retry=metrics.learner_retries.inc,
        )
        self.renderer = ChatRenderer(engine.tokenizer)
        # Agent-driven episodes' sessions: their calls come in through the replica's
        # /v1/chat/completions (serve.py adds the routes), or in-process from spopp's own client.
        self.endpoint = Endpoint()
        self._calls_over_chat: bool | None = None
        self.budget = settings.budget()
        self.sampling = SamplingConfig(
            max_tokens=settings.max_tokens_per_turn,
            temperature=settings.temperature,
            top_p=settings.top_p,
            top_k=settings.top_k,
        )
        # Outcome reports of episodes whose generation is over; their slots are free already.
        self.reporting: set[asyncio.Task] = set()
        # Trajectory POSTs under way. They leave the episode once its outcome is reported, so a
        # drain waits for generation and reports only, never for a learner that is away.
        self.deliveries: set[asyncio.Task] = set()
        self.fatal: Exception | None = None
        # The run's seed and stream key at the tracker: the base of each episode's sampling seed
        # and environment stream, the same whichever replica plays a request and, for the arms of
        # one study, whichever arm (spopp.compare.streams).
        self.run_seed = run_seed
        self.stream = stream
        # This replica's counts for its heartbeats: trajectories the learner accepted, episodes
        # played to the end; `counted` is what the tracker had of this worker id at start.
        self.accepted = 0
        self.episodes_done = 0
        self.counted = counted
        self.empty_streak = 0  # episodes that generated nothing, ended in a row

    @property
    def calls_over_chat(self) -> bool:
        """Whether the episodes' model calls come in over the chat routes (an agent's: one built and
        closed to see)."""
        if self._calls_over_chat is None:
            probe = self.make_env()
            self._calls_over_chat = bool(probe.calls_over_chat)
            probe.close()
        return self._calls_over_chat

    def counts(self) -> tuple[int, int]:
        """The replica's cumulative (trajectories accepted, episodes finished), its earlier lives'
        included: what a heartbeat tells the tracker."""
        return self.counted[0] + self.accepted, self.counted[1] + self.episodes_done

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

    # -- play ---------------------------------------------------------------------------------
    async def play(self, lease: Lease) -> None:
        """Play the episode `lease` names; once its generation ends, its report goes on beside."""
        task = self.tasks.get(lease.task_id)
        if task is None:
            # The replica's task file does not match the run's tasks: a configuration error that
            # no retry fixes, so stop rather than bounce leases back and forth.
            await self.leases.release(lease)
            self.fatal = ValueError(
                f"the tracker dispatched task {lease.task_id!r}, which is not in this replica's tasks: "
                "give the replica the task file the run was registered from"
            )
            self.stopping.set()
            return
        ep = await self._generate(lease, task)
        if ep.generated_tokens == 0:
            # Nothing generated (an agent that made no call or whose calls were all refused, a
            # prompt with no room to answer in): no answer of the policy's to judge, so it scores 0,
            # as an episode cut by a budget does, and its outcome is reported (under SPO++ it counts
            # for the task's value); there is nothing to train on, so no trajectory is posted.
            # Released instead, it went back to the pool at once: a replica whose agent returned
            # 0.0 without a call played 3,811 episodes in 19.7 s and nothing counted anywhere.
            ep.reward = 0.0
            self.metrics.untrained.inc()
        self.metrics.observe_episode(ep)
        self.episodes_done += 1
        # The slot is free from here on: the report and the POST go on beside the next episode.
        report = asyncio.create_task(self._report(lease, ep))
        self.reporting.add(report)
        self.metrics.reporting.set(len(self.reporting))
        report.add_done_callback(self._reported)
        self.empty_streak = self.empty_streak + 1 if ep.generated_tokens == 0 else 0
        if self.empty_streak >= self.s.concurrency:
            log.warning(
                "%d episodes in a row generated nothing (the last: task %s, %s): each scores 0 and "
                "holds its slot %.0f s; an agent must call the model for its episode to train",
                self.empty_streak, lease.task_id, ep.finish_reason, EMPTY_EPISODE_HOLD_S,
            )  # fmt: skip
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), EMPTY_EPISODE_HOLD_S)

    async def _generate(self, lease: Lease, task: Task) -> Episode:
        """The episode itself, its lease renewed meanwhile (released if it fails or is cancelled)."""
        renewer = asyncio.create_task(self.leases.renew(lease))
        env = self.make_env()
        try:
            # The sampling seed and the environment's stream: from the run's seed and stream key,
            # the request id (the tracker's per-run counter r1, r2, ...: dispatch.lua) and, for the
            # environment, the task. A run that dispatches in the same order gives each episode the
            # same numbers, the arms of one study included, and no two episodes of a run share one.
            seed = sampling_seed(self.run_seed, self.stream, lease.request_id)
            env_seed = episode_seed(self.run_seed, self.stream, lease.task_id, lease.request_id)
            return await run_episode(
                self.engine, env, task, self.budget, replace(self.sampling, seed=seed), self.renderer,
                env_seed=env_seed, endpoint=self.endpoint,
            )  # fmt: skip
        except asyncio.CancelledError:
            await asyncio.shield(self.leases.release(lease))
            raise
        except Exception:
            await self.leases.release(lease)
            raise
        finally:
            renewer.cancel()
            env.close()

    # -- report -------------------------------------------------------------------------------
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
            await asyncio.shield(self.leases.release(lease))
            raise
        except (TrackerError, httpx.HTTPError) as exc:
            # Past the retry bound, or refused (409: the lease expired during a long outage).
            # Without the tracker's value there is no advantage to train on: the episode is lost.
            self.metrics.lost.labels("outcome").inc()
            log.error("outcome of %s not reported: %s", lease.request_id, exc)
            return
        if ep.generated_tokens == 0:
            return  # scored, nothing to train on (play)
        delivery = asyncio.create_task(self._post(lease, ep, result.value, result.advantage))
        self.deliveries.add(delivery)
        delivery.add_done_callback(self.deliveries.discard)

    # -- post ---------------------------------------------------------------------------------
    async def _post(self, lease: Lease, ep: Episode, value: float, advantage: float | None) -> None:
        body = self._trajectory(lease, ep, value, advantage)
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

    def _trajectory(self, lease: Lease, ep: Episode, value: float, advantage: float | None) -> dict:
        """The learner's record of the episode (JSON-ready)."""
        versions = token_versions(lease, ep)
        if versions is not None:
            self.metrics.mixed_episodes.inc()
        return Trajectory(
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
            segment_starts=ep.segment_starts if len(ep.segment_starts) > 1 else None,
            finish_reason=ep.finish_reason,
            timings=ep.timings,
        ).model_dump(mode="json")


def token_versions(lease: Lease, ep: Episode) -> list[int] | None:
    """The version of every token where a swap fell inside the episode, else None (all of them
    are the dispatch's version: the record stays as small as before)."""
    if len(ep.token_versions) != len(ep.token_ids):
        return None  # an engine outside the gate: versions unknown, the dispatch's stands
    versions = [lease.policy_version if v is None else v for v in ep.token_versions]
    return versions if any(v != lease.policy_version for v in versions) else None
