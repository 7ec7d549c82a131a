"""Environments draw from the run's seed, one stream per episode (runtime/envs/base.py).

Toy-calc's draws (the lognormal step delays, which recent padding time a time-neutral episode waits)
are checked through the real agent loop with a scripted engine: one seed and one episode identity
give the same delays, the same wait, the same length and reward; another seed or another episode,
other draws. A whole run is not replayed here: its episodes' policy versions depend on when the
learner published (wall-clock timing), so only the streams are the seed's to fix.
"""

from __future__ import annotations

import asyncio
from collections import deque

import pytest
from scripted import ScriptedEngine

import runtime.envs.toy_calc as toy
from runtime.agent import run_episode
from runtime.engines.base import SamplingConfig
from runtime.envs import env_factory
from runtime.envs.base import UNSEEDED, episode_seed
from runtime.envs.toy_calc import ToyCalcEnv, make_task
from runtime.episode import Budget
from tools.toy_model import build_toy_tokenizer

TASK = make_task(123, 45, 67)  # 5602
# coupling +1 pads successes with 3 turns; a failure is the other side and waits out a padding time.
OPTIONS = {
    "coupling": 1.0,
    "extra_turns": 3,
    "time_neutral": True,
    "latency_sigma": 1.0,
    "latency_median_s": 0.001,
}
# A fixed pool of padding times (1..64 ms), so that only the episode's draw picks among them.
POOL = [0.001 * (k + 1) for k in range(64)]


@pytest.fixture(scope="module")
def tok():
    return build_toy_tokenizer()


def test_the_episode_seed_is_fixed_across_processes_and_versions():
    """SHA-256, not hash(): no per-process salt, so the pinned value is what every process derives,
    and a later version of spopp gives a run's episodes the same streams."""
    here = episode_seed(3, "toycalc-123-45-67", "r17")
    assert here == 9591068684192837088
    # Every part of the identity counts, and its parts do not run into each other.
    others = {episode_seed(4, "toycalc-123-45-67", "r17"), episode_seed(3, "toycalc-123-45-67", "r18"),
              episode_seed(3, "toycalc-123-45-6", "7r17"), episode_seed(3, "toycalc-123-45-67r17")}  # fmt: skip
    assert here not in others and len(others) == 4
    assert 0 <= here < 2**64


def play(tok, seed: int, request: str, answer: str) -> tuple[dict, int, float, list[int]]:
    """One episode through the agent loop, the environment seeded as the replica seeds it:
    (last info, turns, reward, token ids)."""
    toy._PADDING_SECONDS[3] = deque(POOL, maxlen=64)
    engine = ScriptedEngine(tok, ["<code>123*45+67</code>", answer, "x", "x", "x"])
    env = env_factory("toy-calc", OPTIONS)()
    ep = asyncio.run(run_episode(
        engine, env, TASK, Budget(8, 32, 512), SamplingConfig(32), env_seed=episode_seed(seed, TASK.task_id, request)
    ))  # fmt: skip
    return ep.info, ep.num_turns, ep.reward, ep.token_ids


def test_one_seed_and_one_episode_give_the_same_draws_others_other_draws(tok):
    try:
        wrong = play(tok, 0, "r1", "<ans>1</ans>")
        assert wrong == play(tok, 0, "r1", "<ans>1</ans>")
        info, turns, reward, _ = wrong
        assert (turns, reward) == (2, 0.0) and info["latency_s"] > 0 and info["neutral_wait_s"] in POOL
        right = play(tok, 0, "r1", "<ans>5602</ans>")  # the coupled side: padded, no wait drawn
        assert right == play(tok, 0, "r1", "<ans>5602</ans>")
        assert (right[1], right[2]) == (5, 1.0) and "neutral_wait_s" not in right[0]
        # The first two steps' delays are the same draws whatever the answer.
        for other in (play(tok, 1, "r1", "<ans>1</ans>"), play(tok, 0, "r2", "<ans>1</ans>")):
            assert other[1:] == wrong[1:]  # a scripted policy: the same length, reward and tokens
            assert other[0]["latency_s"] != info["latency_s"]
            assert other[0]["neutral_wait_s"] != info["neutral_wait_s"]
    finally:
        toy._PADDING_SECONDS.clear()


def test_the_stream_is_the_seed_s_alone():
    """Two environments seeded alike draw alike, whatever the global `random` does between; one
    never seeded draws the fixed UNSEEDED stream, never OS entropy; a reseed starts over."""
    import random

    a, b = ToyCalcEnv(latency_sigma=1.0), ToyCalcEnv(latency_sigma=1.0)
    a.seed_episode(episode_seed(5, "t", "r3"))
    random.seed()  # the process's global stream, reseeded from the OS: irrelevant to the episode
    b.seed_episode(episode_seed(5, "t", "r3"))
    draws = [a.latency() for _ in range(5)]
    assert draws == [b.latency() for _ in range(5)]
    fresh = [ToyCalcEnv(latency_sigma=1.0).latency() for _ in range(2)]
    assert fresh[0] == fresh[1] == ToyCalcEnv(latency_sigma=1.0, latency_median_s=0.02).latency()
    c = ToyCalcEnv(latency_sigma=1.0)
    c.seed_episode(UNSEEDED)
    assert c.latency() == fresh[0]
    a.seed_episode(episode_seed(5, "t", "r3"))
    assert a.latency() == draws[0]
