"""Common random numbers: the arms of one seed and study draw alike (spopp.compare.streams).

A paired comparison measures the method only if what is not the method draws the same numbers in
both arms: which prompts the tracker dispatches, which tokens the engine samples, what the
environment draws. The real tracker (HTTP, Redis) and the real rollout Worker with the
transformers engine on the tiny model play the SPO and the SPO++ arm of one seed and study: their
first batches are the same episodes, token for token; another study, or the same name keyed runs
of before, draw apart.
"""

from __future__ import annotations

import asyncio

import pytest

from runtime.engines.hf import TransformersEngine
from runtime.envs.base import episode_seed
from runtime.envs.toy_calc import ToyCalcEnv, generate_toy_calc_tasks
from services.config.rollout import RolloutSettings
from services.rollout.worker import Worker, read_run
from spopp.api.tracker_api import RunConfig
from spopp.compare.streams import sampling_seed, stream_key
from spopp.sampler import race_draws
from tools.sink import LearnerSink

pytestmark = pytest.mark.process  # starts processes: the process tier (tests/conftest.py)

TASKS = generate_toy_calc_tasks(48, seed=11)
# Outcomes-form priors of different strength: the sampler's weights differ by task, so which
# prompts come first is the race's draws' doing, not a tie broken by order.
PRIOR = [{"task_id": t.task_id, "outcomes": [1] * (i % 5) + [0] * (4 - i % 5)} for i, t in enumerate(TASKS)]
FIRST_BATCH = 6


def test_the_stream_key_is_the_study_else_the_run_name():
    assert stream_key("spo-s3", "cell-a") == stream_key("spopp-s3", "cell-a") == "cell-a"
    assert stream_key("spo-s3", None) == "spo-s3" != stream_key("spopp-s3", None)
    # Equal keys and seeds, equal numbers; any part changed, other numbers.
    assert sampling_seed(3, "cell-a", "r7") == sampling_seed(3, "cell-a", "r7")
    assert len({sampling_seed(3, "cell-a", "r7"), sampling_seed(4, "cell-a", "r7"),
                sampling_seed(3, "cell-b", "r7"), sampling_seed(3, "cell-a", "r8")}) == 4  # fmt: skip
    assert 0 <= sampling_seed(2**63 - 1, "x" * 256, "r1") < 2**63  # vLLM and torch take it
    assert race_draws(3, "cell-a", 0, 50) != race_draws(3, "cell-b", 0, 50)


def test_a_run_without_a_study_stores_the_config_it_stored_before():
    """Runs made before studies existed compare equal to the same config PUT again: no `study` key."""
    assert "study" not in RunConfig(recipe="spo", seed=3).canonical()
    assert RunConfig(recipe="spo", seed=3, study="cell-a").canonical()["study"] == "cell-a"
    with pytest.raises(ValueError):
        RunConfig(recipe="spo", study="../elsewhere")  # an id, like a run name


def test_two_arms_of_one_seed_dispatch_the_same_first_batch_and_another_study_does_not(client, run_name):
    """At the tracker: SPO and SPO++ of seed 3 and one study pop the same tasks as the same
    request ids; the same seed in another study, or without a study (keyed on its run name),
    pops others. Both arms' values differ from here on (SPO's and SPO++'s updates), so only what
    was drawn before any outcome is compared."""
    runs = {
        "spo": ("spo", "crn"),
        "spopp": ("spopp", "crn"),
        "other-study": ("spopp", "crn-2"),
        "no-study": ("spopp", None),
    }
    batches = {}
    for arm, (recipe, study) in runs.items():
        name = f"{run_name}-{arm}"
        client.put_run(name, {"recipe": recipe, "seed": 3, **({"study": study} if study else {})})
        client.put_tasks(name, PRIOR)
        leases = client.dispatch(name, "w0", 0, FIRST_BATCH).requests
        batches[arm] = [(lease.request_id, lease.task_id) for lease in leases]
    assert len(batches["spo"]) == FIRST_BATCH and batches["spo"] == batches["spopp"]
    assert [t for _, t in batches["other-study"]] != [t for _, t in batches["spo"]]
    assert [t for _, t in batches["no-study"]] != [t for _, t in batches["spo"]]


def _play_first_batch(tiny_model, tracker, client, name: str, recipe: str, study: str | None) -> dict:
    """The first FIRST_BATCH episodes a replica delivers for a fresh run (one slot: one at a time,
    in dispatch order), as {request_id: (task_id, token ids, reward)}."""
    client.put_run(name, {"recipe": recipe, "seed": 5, **({"study": study} if study else {})})
    client.put_tasks(name, PRIOR)
    engine = TransformersEngine(tiny_model)
    with LearnerSink(name) as sink:
        settings = RolloutSettings(
            model=tiny_model, tracker=tracker.url, learner=sink.url, run=name, env="toy-calc", concurrency=1,
            max_turns=2, max_tokens_per_turn=12, max_total_tokens=256, poll_seconds=0.05, retry_seconds=5,
            temperature=1.0,
        )  # fmt: skip

        async def scenario():
            worker = Worker(
                settings, await read_run(settings), engine, ToyCalcEnv, {t.task_id: t for t in TASKS}
            )
            await asyncio.wait_for(worker.run(max_episodes=FIRST_BATCH), 120)
            await worker.close()

        asyncio.run(scenario())
        delivered = sink.trajectories()[:FIRST_BATCH]
    return {t.request_id: (t.task_id, list(t.token_ids), t.reward) for t in delivered}


def test_the_arms_first_batches_are_the_same_episodes_token_for_token(tiny_model, tracker, client, run_name):
    """Through the replica: sampling seeds and environment streams come from (seed, study,
    request), so the SPO and SPO++ arms play each request of their first batch with the same
    tokens and rewards (version 0: one policy), whichever arm; another study samples apart."""
    spo = _play_first_batch(tiny_model, tracker, client, f"{run_name}-spo", "spo", "crn")
    spopp = _play_first_batch(tiny_model, tracker, client, f"{run_name}-spopp", "spopp", "crn")
    other = _play_first_batch(tiny_model, tracker, client, f"{run_name}-other", "spopp", "crn-other")
    assert len(spo) == FIRST_BATCH and spo == spopp
    # Temperature 1 on an untrained model: another study's draws give other tasks or other tokens.
    assert other != spo


def test_the_episode_seeds_are_the_runs_not_the_replicas():
    """Two replicas (any worker id) of one run, and the two arms of one study, give request r4 the
    same sampling seed and environment stream; the key changes both."""
    a = (sampling_seed(9, stream_key("spo-s9", "cell"), "r4"), episode_seed(9, "cell", "t1", "r4"))
    b = (sampling_seed(9, stream_key("spopp-s9", "cell"), "r4"), episode_seed(9, "cell", "t1", "r4"))
    c = (sampling_seed(9, stream_key("spopp-s9", None), "r4"), episode_seed(9, "spopp-s9", "t1", "r4"))
    assert a == b and a[0] != c[0] and a[1] != c[1]
