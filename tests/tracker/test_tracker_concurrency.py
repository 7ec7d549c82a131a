"""64 concurrent clients dispatching and reporting lose and duplicate nothing."""

import asyncio
import random

import pytest

from spopp.api.client import AsyncTrackerClient, TrackerError
from tools.tracker_process import TrackerProcess

pytestmark = pytest.mark.process  # starts processes: the process tier (tests/conftest.py)


async def _worker(url, run, wid, rounds, log, held):
    rnd = random.Random(wid)
    async with AsyncTrackerClient(url) as c:
        for _ in range(rounds):
            d = await c.dispatch(run, f"w{wid}", 0, rnd.randint(1, 3))
            for r in d.requests:
                assert r.task_id not in held, "a task was leased twice at once"
                held.add(r.task_id)
            await asyncio.sleep(rnd.random() * 0.002)
            reports = []
            for r in d.requests:
                held.discard(r.task_id)
                if rnd.random() < 0.1:
                    await c.release(run, r.request_id)
                    log.append(("released", r.task_id, None))
                else:
                    reports.append((r.request_id, float(rnd.random() < 0.5)))
                    log.append(("reported", r.task_id, reports[-1][1]))
            if reports:
                await c.outcomes(run, reports)
                if rnd.random() < 0.2:  # a retry of the same report: must count once
                    await c.outcomes(run, reports)


@pytest.mark.parametrize("processes", [1, 2])
def test_64_concurrent_clients_lose_and_duplicate_nothing(redis_server, tracker, client, make_run, processes):
    n_tasks = 40
    run = make_run(tasks=[{"task_id": f"q{i}", "alpha0": 1.0, "beta0": 1.0} for i in range(n_tasks)])
    log, held = [], set()
    trackers = [tracker] + [TrackerProcess(redis_server.url) for _ in range(processes - 1)]

    async def main():
        await asyncio.gather(*[_worker(trackers[w % processes].url, run, w, 8, log, held) for w in range(64)])

    try:
        asyncio.run(main())
    finally:
        for extra in trackers[1:]:
            extra.stop()
    reported = [x for x in log if x[0] == "reported"]
    rows = {r["task_id"]: r for r in client.export(run)}
    counts = client.get_run(run).counts
    assert counts.outcomes == len(reported) > 0
    assert counts.releases == len(log) - len(reported)
    assert counts.dispatches == len(log) == sum(r["dispatches"] for r in rows.values())
    assert counts.in_flight == 0 and counts.idle == n_tasks
    for tid, row in rows.items():
        mine = [x for x in reported if x[1] == tid]
        successes = sum(x[2] for x in mine)
        # All at version 0: alpha = 1 + successes, beta = 1 + failures, exactly.
        assert row["outcomes"] == len(mine)
        assert row["alpha"] == pytest.approx(1.0 + successes, rel=1e-12)
        assert row["beta"] == pytest.approx(1.0 + len(mine) - successes, rel=1e-12)


def test_unknown_run_from_async_client(tracker):
    async def main():
        async with AsyncTrackerClient(tracker.url) as c:
            with pytest.raises(TrackerError) as err:
                await c.get_run("no-such-run")
            return err.value

    err = asyncio.run(main())
    assert err.status == 404 and err.code == "unknown_run"
