"""Bounded staleness on the replica: weights swapped between the turns of running episodes, with
the version of every token recorded (services/rollout/swap.py), on the real transformers engine.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from records import run_record

from runtime.agent import run_episode
from runtime.engines.base import SamplingConfig
from runtime.envs.base import Environment, StepResult, Task
from runtime.episode import Budget
from services.rollout.swap import VersionedEngine
from services.rollout.worker import token_versions
from spopp.api.tracker_api import Lease
from spopp.api.trajectory import Trajectory

TASK = Task("t1", "What is 123*45+6?", "5541")
LONG = SamplingConfig(max_tokens=48, temperature=1.0, seed=3)


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine


def test_a_swap_waits_for_running_generations_and_holds_new_ones(engine, tiny_model, runner):
    async def scenario():
        gate = VersionedEngine(engine, version=3)
        prompt = engine.tokenizer.encode("What is 2+2?")
        first = asyncio.create_task(gate.generate(prompt, LONG))
        await asyncio.sleep(0)
        assert gate.running == 1
        swap = asyncio.create_task(gate.swap(tiny_model, 4))
        await asyncio.sleep(0)
        second = asyncio.create_task(gate.generate(prompt, LONG))
        await asyncio.sleep(0)
        # The first is still generating (its answer comes from the engine's thread, loop turns
        # later); the second waits at the closed gate, and the swap waits for the first.
        assert gate.running == 1 and not first.done() and not swap.done()
        g1 = await first
        waited = await swap
        g2 = await second
        return gate, g1, g2, waited

    gate, g1, g2, waited = runner.run(scenario())
    assert (g1.version, g2.version, gate.version) == (3, 4, 4)
    assert waited > 0.0  # it waited for the first generation, not for nothing


def test_a_failed_load_keeps_the_old_version_and_reopens(engine, tiny_model, tmp_path, runner):
    async def scenario():
        gate = VersionedEngine(engine, version=3)
        with pytest.raises(FileNotFoundError):
            await gate.swap(tmp_path / "missing", 4)
        await gate.load_weights(tiny_model)  # the engine's own entry goes through the gate too
        return gate, await gate.generate(engine.tokenizer.encode("hi"), SamplingConfig(max_tokens=4, seed=1))

    gate, gen = runner.run(scenario())
    assert gate.version == 3 and gen.version == 3


class TwoTurns(Environment):
    """Two turns; the first step waits (in its thread) until the test has swapped the weights."""

    name = "two-turns"
    stop = ("</code>",)

    def __init__(self) -> None:
        self.stepped, self.go, self.turns = threading.Event(), threading.Event(), 0

    def reset(self, task: Task) -> list[dict]:
        return [{"role": "user", "content": task.prompt}]

    def step(self, action: str) -> StepResult:
        self.turns += 1
        if self.turns == 1:
            self.stepped.set()
            self.go.wait(30)
            return StepResult([{"role": "tool", "content": "<output>\n7\n</output>"}], done=False)
        return StepResult([], done=True, reward=1.0)


def test_an_episode_across_a_swap_records_each_tokens_version(engine, tiny_model, runner):
    env = TwoTurns()

    async def scenario():
        gate = VersionedEngine(engine, version=5)
        budget = Budget(2, 24, 2048)
        episode = asyncio.create_task(run_episode(gate, env, TASK, budget, LONG))
        await asyncio.to_thread(env.stepped.wait, 30)
        await gate.swap(tiny_model, 6)  # between the episode's two turns
        env.go.set()
        return await episode

    ep = runner.run(scenario())
    assert ep.num_turns == 2
    generated = [v for v, m in zip(ep.token_versions, ep.action_mask, strict=True) if m]
    first_turn = generated.index(6)
    assert first_turn > 0 and set(generated[:first_turn]) == {5} and set(generated[first_turn:]) == {6}
    lease = Lease(
        request_id="r1", task_id="t1", value=0.5, policy_version=5, lease_expires_at="2026-11-25T00:00:00Z"
    )
    versions = token_versions(lease, ep)
    assert versions is not None and versions[0] == 5 and versions[-1] == 6
    Trajectory(
        run="r", request_id="r1", task_id="t1", policy_version=5, token_ids=ep.token_ids,
        action_mask=ep.action_mask, rollout_logprobs=ep.rollout_logprobs, token_versions=versions,
        reward=ep.reward, value=0.5, advantage=0.5, num_turns=ep.num_turns, finish_reason=ep.finish_reason,
    )  # fmt: skip
    # An episode that never saw a swap sends no list: the record stays as small as before.
    same = Lease(
        request_id="r2", task_id="t1", value=0.5, policy_version=6, lease_expires_at="2026-11-25T00:00:00Z"
    )
    ep.token_versions = [None if v is None else 6 for v in ep.token_versions]
    assert token_versions(same, ep) is None


@pytest.mark.parametrize(
    "swap,drain,waits,cancelled",
    [("turn", "finish", False, set()), ("episode", "finish", True, set()), ("turn", "abort", False, {"r1"})],
)
def test_a_new_policy_under_staleness_keeps_what_may_still_train(
    engine, tiny_model, runner, swap, drain, waits, cancelled
):
    """k = 1 and a new version 3 (floor 2): the ready lease of version 0 is given back, those of 2
    and 3 are kept; running episodes go on (turn), are waited for (episode), and with `drain:
    abort` the one that can no longer train (version 1) is cancelled. No tracker answers here: the
    release is logged as failed, which is what a replica does when the tracker is away."""
    from services.config.rollout import RolloutSettings
    from services.rollout.worker import Worker

    s = RolloutSettings(
        run="r", model=tiny_model, tracker="http://127.0.0.1:9", learner="http://127.0.0.1:9", retry_seconds=0,
        swap=swap, drain=drain,
    )  # fmt: skip

    def lease(rid: str, version: int) -> Lease:
        return Lease(request_id=rid, task_id="t", value=0.5, policy_version=version, lease_expires_at="x")

    async def scenario():
        worker = Worker(s, run_record("r", max_staleness=1), engine, make_env=lambda: None, tasks={})
        worker.ready = [lease("q0", 0), lease("q2", 2), lease("q3", 3)]
        episodes = {"r1": lease("r1", 1), "r2": lease("r2", 2)}
        tasks = {rid: asyncio.create_task(asyncio.sleep(0.3)) for rid in episodes}
        worker.inflight = {tasks[rid]: episodes[rid] for rid in episodes}
        t0 = asyncio.get_running_loop().time()
        await worker.policy.keep_going(3)
        took = asyncio.get_running_loop().time() - t0
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        await worker.close()
        return worker, took, {rid for rid, t in tasks.items() if t.cancelled()}

    worker, took, gone = runner.run(scenario())
    assert [x.request_id for x in worker.ready] == ["q2", "q3"]
    assert (took >= 0.3) == waits
    assert gone == cancelled


def test_a_worker_is_built_with_what_its_run_fixes(engine, tiny_model, runner):
    """The run's record, read before the worker is built, sets its k, lease length, seed, stream
    key and (a restarted worker id) the counts the tracker had of it: nothing is patched later."""
    from services.config.rollout import RolloutSettings
    from services.rollout.worker import Worker
    from spopp.compare.streams import stream_key

    s = RolloutSettings(run="r", model=tiny_model, tracker="http://127.0.0.1:9", learner="http://127.0.0.1:9",
                        worker_id="rollout-2")  # fmt: skip
    before = {"leases": 3, "outcomes": 3, "trajectories": 5, "episodes": 6, "last_seen": None}
    run = run_record(
        "r", max_staleness=2, lease_seconds=30.0, seed=7, study="cell", workers={"rollout-2": before}
    )

    async def built(run):
        worker = Worker(s, run, engine, make_env=lambda: None, tasks={})
        await worker.close()
        return worker

    worker = runner.run(built(run))
    assert (worker.max_staleness, worker.leases.lease_seconds, worker.run_seed) == (2, 30.0, 7)
    assert worker.episodes.stream == stream_key("r", "cell") and worker.episodes.counts() == (5, 6)
    fresh = runner.run(built(run_record("r")))
    assert (fresh.max_staleness, fresh.leases.lease_seconds, fresh.run_seed) == (0, 900.0, 0)
    assert fresh.episodes.stream == stream_key("r", None) and fresh.episodes.counts() == (0, 0)
