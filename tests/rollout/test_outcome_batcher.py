"""Coalesced outcome reports (services/rollout/outcomes.py) against a real tracker process.

Reports that arrive while a call is under way leave together; each still gets its own answer. A
report the tracker refuses (released lease, unknown request, reward out of range) fails alone:
the rest of its batch lands. A report cancelled before it leaves never reaches the tracker.
"""

from __future__ import annotations

import asyncio

import pytest

from services.rollout.outcomes import OutcomeBatcher
from spopp.api.client import AsyncTrackerClient, TrackerError

pytestmark = pytest.mark.process  # starts processes: the process tier (tests/conftest.py)

N = 24


@pytest.fixture
def leased(client, make_run):
    """A run of N tasks with one lease each: (run, [(request_id, task_id)])."""
    run = make_run(tasks=[{"task_id": f"t{i}", "alpha0": 1 + i, "beta0": 2} for i in range(N)])
    d = client.dispatch(run, "w", 0, N)
    assert len(d.requests) == N
    return run, [(r.request_id, r.task_id, r.value) for r in d.requests]


def _run(coro_fn, url):
    async def main():
        async with AsyncTrackerClient(url) as c:
            return await coro_fn(c)

    return asyncio.run(main())


def test_concurrent_reports_share_calls_and_each_gets_its_own_answer(tracker, client, leased):
    run, reqs = leased
    rewards = {rid: float(i % 2) for i, (rid, _, _) in enumerate(reqs)}

    async def go(c):
        b = OutcomeBatcher(c, run)
        results = await asyncio.gather(*(b.report(rid, rewards[rid]) for rid, _, _ in reqs))
        return b.calls, results

    calls, results = _run(go, tracker.url)
    assert calls < N / 2  # the first leaves alone, the rest together
    for (rid, _, value), res in zip(reqs, results, strict=True):
        assert res.request_id == rid
        assert res.value == pytest.approx(value)
        assert res.advantage == pytest.approx(rewards[rid] - value)
    assert all(r.state == "reported" for r in client.lookup(run, [rid for rid, _, _ in reqs]))


@pytest.mark.parametrize("fault", ["released", "unknown", "bad_reward"])
def test_a_refused_report_fails_alone_and_the_rest_of_its_batch_lands(tracker, client, leased, fault):
    run, reqs = leased
    victim = reqs[5][0]
    if fault == "released":
        client.release(run, victim)
    reports = [(rid, 1.0) for rid, _, _ in reqs]
    if fault == "unknown":
        reports.append(("no-such-request", 1.0))
        victim = "no-such-request"
    if fault == "bad_reward":
        reports[5] = (victim, 1.5)  # rewards lie in [0, 1]

    async def go(c):
        b = OutcomeBatcher(c, run)
        # Hold the first call back so that every report joins one batch behind it.
        first = asyncio.create_task(b.report(*reports[0]))
        rest = [asyncio.create_task(b.report(rid, r)) for rid, r in reports[1:]]
        out = await asyncio.gather(first, *rest, return_exceptions=True)
        return b.calls, dict(zip([rid for rid, _ in reports], out, strict=True))

    calls, out = _run(go, tracker.url)
    err = out.pop(victim)
    assert isinstance(err, TrackerError)
    expected = {
        "released": (409, "lease_not_live"),
        "unknown": (404, "unknown_request"),
        "bad_reward": (422, None),
    }
    status, code = expected[fault]
    assert err.status == status and (code is None or err.code == code)
    assert all(not isinstance(r, Exception) for r in out.values()), out
    landed = client.lookup(run, [rid for rid, _, _ in reqs if rid != victim])
    assert all(r.state == "reported" for r in landed)
    if fault != "unknown":
        assert client.lookup(run, [victim])[0].state != "reported"  # nothing half applied for it


def test_a_report_cancelled_before_it_leaves_never_reaches_the_tracker(tracker, client, leased):
    run, reqs = leased
    (a, _, _), (b_, _, _), (c_, _, _) = reqs[:3]

    async def go(c):
        b = OutcomeBatcher(c, run)
        first = asyncio.create_task(b.report(a, 1.0))
        await asyncio.sleep(0)  # the first call is on its way
        queued = asyncio.create_task(b.report(b_, 1.0))
        kept = asyncio.create_task(b.report(c_, 0.0))
        await asyncio.sleep(0)
        queued.cancel()
        await first
        await kept
        with pytest.raises(asyncio.CancelledError):
            await queued

    _run(go, tracker.url)
    states = {r.request_id: r.state for r in client.lookup(run, [a, b_, c_])}
    assert states == {a: "reported", b_: "leased", c_: "reported"}


def test_reports_spaced_wider_than_a_call_share_one_when_lingering(tracker, client, leased):
    run, reqs = leased

    async def go(c):
        b = OutcomeBatcher(c, run, linger=0.5)
        tasks = []
        for rid, _, _ in reqs[:10]:
            tasks.append(asyncio.create_task(b.report(rid, 1.0)))
            await asyncio.sleep(0.005)  # one at a time, as episodes end under continuous batching
        await asyncio.gather(*tasks)
        return b.calls

    assert _run(go, tracker.url) == 1  # the first waited for the other nine
    assert all(r.state == "reported" for r in client.lookup(run, [rid for rid, _, _ in reqs[:10]]))
    with pytest.raises(ValueError, match="linger"):
        OutcomeBatcher(None, run, linger=-1)
