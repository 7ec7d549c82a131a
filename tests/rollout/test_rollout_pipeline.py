"""A replica keeps its engine's batch full: reports leave the generation path, leases wait ready,
reports and deliveries that finish together leave in shared calls.

Real tracker over HTTP, the real rollout Worker and toy-calc environment, a learner sink over
HTTP; the engine is scripted (each generation sleeps a fixed time, then answers) so that what
runs when is visible, not timed.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from transformers import AutoTokenizer

from runtime.engines.base import Engine, Generation
from runtime.envs.toy_calc import ToyCalcEnv, generate_toy_calc_tasks
from services.config.rollout import RolloutSettings
from services.rollout.worker import Worker
from tools.sink import LearnerSink

pytestmark = pytest.mark.process  # starts processes: the process tier (tests/conftest.py)

TASKS = generate_toy_calc_tasks(8, seed=5)


class ScriptedEngine(Engine):
    """Answers every turn with `<ans>0</ans>` after `seconds`; counts generations running at once."""

    def __init__(self, tokenizer, seconds: float) -> None:
        self.tokenizer, self.seconds = tokenizer, seconds
        self.active = self.peak = self.done = 0

    async def generate(self, prompt_ids, sampling) -> Generation:
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            await asyncio.sleep(self.seconds)
        finally:
            self.active -= 1
        self.done += 1
        ids = self.tokenizer.encode("<ans>0</ans>", add_special_tokens=False)
        return Generation(token_ids=ids, logprobs=[-0.1] * len(ids), finish_reason="stop")

    async def load_weights(self, snapshot_dir) -> None:
        raise AssertionError("no policy change in these tests")

    async def close(self) -> None:
        pass


def _settings(tiny_model, tracker, run, sink, **over) -> RolloutSettings:
    base = dict(
        model=tiny_model, tracker=tracker.url, learner=sink.url, run=run, env="toy-calc", concurrency=2,
        max_turns=3, max_tokens_per_turn=16, max_total_tokens=256, poll_seconds=0.05, retry_seconds=5,
    )  # fmt: skip
    return RolloutSettings(**{**base, **over})


def test_episodes_keep_generating_while_their_outcome_reports_wait(tiny_model, tracker, client, make_run):
    run = make_run(tasks=[{"task_id": t.task_id, "alpha0": 1.0, "beta0": 1.0} for t in TASKS])
    engine = ScriptedEngine(AutoTokenizer.from_pretrained(tiny_model), seconds=0.05)
    with LearnerSink(run) as sink:
        worker = Worker(
            _settings(tiny_model, tracker, run, sink), client.get_run(run), engine, ToyCalcEnv,
            {t.task_id: t for t in TASKS},
        )  # fmt: skip
        gate = asyncio.Event()
        reported = []
        outcomes = worker.tracker.outcomes

        async def held_outcomes(r, items):
            await gate.wait()  # the tracker is slow to answer every report
            result = await outcomes(r, items)
            reported.extend(items)
            return result

        worker.tracker.outcomes = held_outcomes

        async def scenario():
            job = asyncio.create_task(worker.run(max_episodes=12))
            deadline = asyncio.get_running_loop().time() + 30
            while engine.done < 8:  # four times the slots, and not one report answered
                assert asyncio.get_running_loop().time() < deadline, (
                    f"slots stuck after {engine.done} episodes"
                )
                await asyncio.sleep(0.01)
            held, ready, answered = len(worker.reporting), len(worker.ready), len(reported)
            gate.set()
            await asyncio.wait_for(job, 60)
            await worker.close()
            return held, ready, answered

        held, ready, answered = asyncio.run(scenario())
    # Reports waited beside the generations instead of holding their slots...
    assert answered == 0 and held >= 6 and engine.peak == 2
    # ...a lease waited ready for the next free slot (prefetch: a quarter of concurrency, at least 1)...
    assert worker.prefetch == 1 and ready <= 1
    # ...and once the tracker answered, nothing was lost: every finished episode reported and
    # delivered, no lease left behind (leases held ready at the end were given back).
    assert len(reported) == engine.done >= 12
    assert len(sink.trajectories()) == engine.done
    assert client.get_run(run).counts.in_flight == 0
    # The held reports came back in one answer, so their trajectories left in shared calls.
    assert worker.outcomes.calls < engine.done and worker.trajectories.calls < engine.done - 4


class JitteredEngine(ScriptedEngine):
    """Generations of 100-300 ms: episodes end one at a time, as under continuous batching. Long
    next to a dispatch's round trip to the tracker even on a loaded machine (with 20-60 ms, a
    busy second core made the refills late and the batch look emptier than the code keeps it)."""

    def __init__(self, tokenizer, seed: int = 0) -> None:
        super().__init__(tokenizer, 0.0)
        self.rng = random.Random(seed)

    async def generate(self, prompt_ids, sampling) -> Generation:
        self.seconds = 0.1 + 0.2 * self.rng.random()  # read by the sleep before any other call runs
        return await super().generate(prompt_ids, sampling)


def test_episodes_ending_one_at_a_time_share_dispatches_reports_and_deliveries(
    tiny_model, tracker, client, make_run
):
    tasks = generate_toy_calc_tasks(64, seed=6)  # more than the 20 leases a replica holds at once
    run = make_run(tasks=[{"task_id": t.task_id, "alpha0": 1.0, "beta0": 1.0} for t in tasks])
    engine = JitteredEngine(AutoTokenizer.from_pretrained(tiny_model))
    with LearnerSink(run) as sink:
        settings = _settings(tiny_model, tracker, run, sink, concurrency=16, max_turns=1)
        worker = Worker(settings, client.get_run(run), engine, ToyCalcEnv, {t.task_id: t for t in tasks})
        dispatch, calls, active = worker.tracker.dispatch, [], []

        async def counted(*args, **kwargs):
            d = await dispatch(*args, **kwargs)
            calls.append(len(d.requests))
            return d

        worker.tracker.dispatch = counted

        async def scenario():
            job = asyncio.create_task(worker.run(max_episodes=160))
            while not job.done():
                if 32 <= engine.done <= 128:  # the steady state, past the start and before the end
                    active.append(engine.active)
                await asyncio.sleep(0.005)
            await job
            await worker.close()

        asyncio.run(scenario())
    episodes = engine.done
    assert episodes >= 160 and len(sink.trajectories()) == episodes
    # Ready leases are refilled two at a time (half of a prefetch of four), not one by one...
    assert worker.prefetch == 4 and worker.dispatch_step == 2
    assert len(calls) < 0.6 * episodes and sum(n >= 2 for n in calls) > 0.8 * len(calls), calls
    # ...and the batch stays full while they wait: a freed slot starts a held lease at once.
    assert engine.peak == 16 and sum(active) / len(active) > 14
    # Reports and deliveries wait a little for company instead of leaving one per episode.
    assert worker.outcomes.calls < episodes / 2 and worker.trajectories.calls < episodes / 4
    assert client.get_run(run).counts.in_flight == 0


def test_leases_held_ready_are_given_back_on_shutdown(tiny_model, tracker, client, make_run):
    run = make_run(tasks=[{"task_id": t.task_id, "alpha0": 1.0, "beta0": 1.0} for t in TASKS])
    engine = ScriptedEngine(AutoTokenizer.from_pretrained(tiny_model), seconds=0.2)
    with LearnerSink(run) as sink:
        settings = _settings(tiny_model, tracker, run, sink, prefetch=3, shutdown_seconds=5)
        worker = Worker(settings, client.get_run(run), engine, ToyCalcEnv, {t.task_id: t for t in TASKS})

        async def scenario():
            job = asyncio.create_task(worker.run())
            while len(worker.ready) < 3:
                await asyncio.sleep(0.01)
            assert client.get_run(run).counts.in_flight == 2 + 3  # two running, three held ready
            await worker.shutdown()
            await asyncio.wait_for(job, 30)
            await worker.close()

        asyncio.run(scenario())
    assert worker.ready == [] and client.get_run(run).counts.in_flight == 0
    assert len(sink.trajectories()) == engine.done >= 2  # the running ones finished and were delivered


def test_every_concurrent_episode_gets_a_thread_for_its_environment():
    """Sixteen environments inside a blocking call at once (a barrier only all sixteen pass): the
    default pool (cores + 4 threads here) would leave ten of them queued and the barrier broken."""
    import threading

    from runtime.agent import reserve_env_threads

    async def sixteen_at_once():
        reserve_env_threads(16)
        barrier = threading.Barrier(16, timeout=10)
        await asyncio.gather(*(asyncio.to_thread(barrier.wait) for _ in range(16)))

    asyncio.run(sixteen_at_once())


def test_default_prefetch_is_a_quarter_of_the_slots(tiny_model):
    from services.rollout.worker import default_prefetch

    def s(**kw):
        return RolloutSettings(run="r", model=tiny_model, **kw)

    # Both engines batch continuously: a quarter of the slots covers the dispatch round trip.
    assert default_prefetch(s(engine="transformers", concurrency=16)) == 4
    assert default_prefetch(s(engine="vllm", concurrency=16)) == 4
    assert default_prefetch(s(engine="vllm", concurrency=2)) == 1


def test_replicas_host_the_transformers_engine_in_a_process_of_its_own(tiny_model):
    def kw(**k):
        return RolloutSettings(run="r", model=tiny_model, **k).engine_kwargs()

    assert kw(engine="transformers") == {"process": True}
    assert kw(engine="transformers", engine_options={"process": False, "max_batch": 8}) == {
        "process": False,
        "max_batch": 8,
    }
    assert kw(engine="vllm", engine_options={"max_model_len": 1024}) == {
        "max_model_len": 1024
    }  # vLLM has its own


def test_each_episode_s_environment_is_seeded_from_the_run_seed_task_and_request(
    tiny_model, tracker, client, make_run
):
    """The replica seeds each episode's environment with episode_seed(the run's seed at the tracker,
    its stream key (here the run name: no study), task id, request id): nothing of the replica's
    own, so whichever replica plays a request, its environment draws alike."""
    from runtime.envs.base import episode_seed

    run = make_run(tasks=[{"task_id": t.task_id, "alpha0": 1.0, "beta0": 1.0} for t in TASKS], seed=41)
    seeds: list[int] = []

    class Recorded(ToyCalcEnv):
        def seed_episode(self, seed: int) -> None:
            seeds.append(seed)
            super().seed_episode(seed)

    engine = ScriptedEngine(AutoTokenizer.from_pretrained(tiny_model), seconds=0.01)
    with LearnerSink(run) as sink:
        worker = Worker(
            _settings(tiny_model, tracker, run, sink, worker_id="rollout-7"),
            client.get_run(run),
            engine,
            Recorded,
            {t.task_id: t for t in TASKS},
        )

        async def scenario():
            await asyncio.wait_for(worker.run(max_episodes=4), 30)
            await worker.close()

        asyncio.run(scenario())
        played = sink.trajectories()
    assert worker.run_seed == 41 and len(played) == len(seeds) >= 4
    assert sorted(seeds) == sorted(episode_seed(41, run, t.task_id, t.request_id) for t in played)
