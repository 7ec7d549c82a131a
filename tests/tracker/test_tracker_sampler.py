"""Dispatch frequencies of the exponential race match sqrt(v(1-v)) + 0.05 (chi-square, fixed seed)."""

import asyncio

import numpy as np
import redis.asyncio as aioredis
from scipy import stats

from services.tracker.store import Store
from spopp.api.tracker_api import RunConfig, TaskPrior
from spopp.sampler import uncertainty_weight

PRIORS = {"p50": (4.0, 4.0), "p25": (2.0, 6.0), "p10": (0.8, 7.2), "p02": (0.16, 7.84), "p90": (7.2, 0.8)}


async def _frequencies(url: str, run: str, picks: int) -> dict[str, int]:
    client = aioredis.Redis.from_url(url, decode_responses=True)
    store = Store(client)
    await store.put_run(run, RunConfig(recipe="spo", seed=11))
    await store.put_tasks(run, [TaskPrior(task_id=t, alpha0=a, beta0=b) for t, (a, b) in PRIORS.items()])
    counts = dict.fromkeys(PRIORS, 0)
    # One at a time, released at once: every pop is a race among all tasks, each re-entering
    # with the fresh Exp(1) draw reserved at its dispatch.
    for _ in range(picks):
        [req] = (await store.dispatch(run, "w", 0, 1, None))["requests"]
        counts[req["task_id"]] += 1
        await store.release(run, req["request_id"])
    await client.aclose()
    return counts


def test_dispatch_frequencies_match_weights(redis_server, run_name):
    counts = asyncio.run(_frequencies(redis_server.url, run_name, 4000))
    weights = np.array([uncertainty_weight(a / (a + b)) for a, b in PRIORS.values()])
    expected = weights / weights.sum() * sum(counts.values())
    observed = np.array([counts[t] for t in PRIORS])
    chi2 = stats.chisquare(observed, expected)
    assert chi2.pvalue > 1e-3, (observed, expected)
    # And the test can fail: uniform picking is rejected with these counts.
    assert stats.chisquare(observed, np.full(len(PRIORS), observed.sum() / len(PRIORS))).pvalue < 1e-6


async def _order(url, run):
    client = aioredis.Redis.from_url(url, decode_responses=True)
    store = Store(client)
    await store.put_run(run, RunConfig(recipe="spo", seed=3))
    await store.put_tasks(run, [TaskPrior(task_id=t, alpha0=a, beta0=b) for t, (a, b) in PRIORS.items()])
    order = []
    for _ in range(50):
        [req] = (await store.dispatch(run, "w", 0, 1, None))["requests"]
        order.append(req["task_id"])
        await store.release(run, req["request_id"])
    await client.aclose()
    return order


def test_draw_stream_is_a_function_of_seed_run_and_counter(tmp_path, run_name):
    from services.tracker.embedded import EmbeddedRedis

    with (
        EmbeddedRedis(tmp_path / "a", appendonly=False) as r1,
        EmbeddedRedis(tmp_path / "b", appendonly=False) as r2,
    ):
        assert asyncio.run(_order(r1.url, run_name)) == asyncio.run(_order(r2.url, run_name))


async def _stream_position(client, run):
    return int(await client.hget(f"spopp:{{{run}}}:run", "draws"))


def test_stream_advances_only_by_draws_used_and_survives_stale_hints(redis_server, run_name):
    """Two Store objects stand for two tracker processes sharing one Redis."""
    from services.tracker.errors import ApiError

    async def main():
        client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        a, b = Store(client), Store(client)
        await a.put_run(run_name, RunConfig(recipe="spopp", seed=5))
        await a.put_tasks(run_name, [TaskPrior(task_id=f"q{i}", alpha0=1, beta0=1) for i in range(6)])
        assert await _stream_position(client, run_name) == 6
        # b's hint is empty and a's becomes stale: both get the true position and go on.
        got_b = await b.dispatch(run_name, "w", 0, 4, None)
        got_a = await a.dispatch(run_name, "w", 0, 4, None)
        assert len(got_b["requests"]) == 4 and len(got_a["requests"]) == 2
        assert await _stream_position(client, run_name) == 12  # 6 + 4 + 2: unused draws are not spent
        assert (await a.dispatch(run_name, "w", 0, 8, None))["requests"] == []
        for bad in (
            a.dispatch(run_name, "w", 3, 1, None),  # stale policy version: 409
            b.put_tasks(
                run_name,
                [TaskPrior(task_id="new", alpha0=1, beta0=1), TaskPrior(task_id="q0", alpha0=2, beta0=1)],
            ),  # prior conflict: 409
        ):
            try:
                await bad
            except ApiError as err:
                assert err.status == 409
            else:
                raise AssertionError("expected a 409")
        assert await _stream_position(client, run_name) == 12
        await client.aclose()

    asyncio.run(main())
