"""Many trajectories a call: the learner's POST /v1/trajectories/batch, and the replica's coalesced
deliveries (services/rollout/deliveries.py) against it, over real HTTP.

The route answers each record as the single route would (accepted, stale, batch full, a repeat
counted once), but a record that is the sender's fault (schema, the model's limits, another run)
refuses the whole call naming its index, with nothing buffered. The replica's side narrows any
refusal of a whole call down to the records at fault, so a bad or oversized trajectory fails
alone and the rest land; a learner away is waited for up to the retry bound.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from test_learner_ingest import traj
from test_learner_intake_security import (
    AUTH,
    CASES,
    MAX_BODY,
    VOCAB_EDGE,
    long,
    refused,
    scrape,
    start,
)

from services.learner.ingest import TrajectoryBuffer, ingest_app
from services.learner.metrics import LearnerMetrics
from services.rollout.deliveries import TrajectoryBatcher, Undelivered
from services.shell.server import ThreadedServer
from spopp.api.trajectory import INTAKE_BATCH, MAX_TRAJECTORIES_PER_CALL
from spopp.machine.net import free_port
from spopp.machine.retry import RetryPolicy


def post_batch(url, records, headers=AUTH):
    return httpx.post(url + INTAKE_BATCH, json={"trajectories": records}, headers=headers)


def accepted_total(url) -> float:
    return scrape(url)[("spopp_learner_trajectories_accepted_total", frozenset())]


@pytest.fixture
def intake(model_limits):
    buffer, server = start(model_limits[0], capacity=4)
    yield buffer, server.url
    server.stop()


# -- the route -------------------------------------------------------------------------------
def test_each_record_gets_the_single_routes_answer(intake):
    buffer, url = intake
    records = [traj(0), traj(1, version=1), traj(0), traj(2), traj(3), traj(4), traj(5)]
    r = post_batch(url, records)
    assert r.status_code == 200, r.text
    got = [(x["request_id"], x["status"], x.get("code"), x.get("position")) for x in r.json()["results"]]
    assert got == [
        ("q0", 200, None, 0),
        ("q1", 409, "stale_policy", None),
        ("q0", 200, None, 0),  # a repeat answers as before and counts once
        ("q2", 200, None, 1),
        ("q3", 200, None, 2),
        ("q4", 200, None, 3),
        ("q5", 409, "batch_full", None),  # capacity 4
    ]
    assert r.json()["policy_version"] == 0
    assert [t.request_id for t in buffer.take(4)] == ["q0", "q2", "q3", "q4"]
    m = scrape(url)
    assert accepted_total(url) == 4
    assert refused(m, "stale") == 1 and refused(m, "full") == 1


@pytest.mark.parametrize("change,field", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_malformed_record_refuses_the_call_naming_its_index_and_nothing_is_buffered(
    intake,
    model_limits,
    change,
    field,
):
    buffer, url = intake
    good = [traj(0), traj(1)]
    if change == VOCAB_EDGE:
        bad = traj(2, token_ids=[1, 2, model_limits[0].vocab_size, 4])
    elif change == b"NaN":
        bad = traj(2, reward=float("nan"))  # Python's encoder writes the NaN literal
    else:
        bad = traj(2, **change)
    body = json.dumps({"trajectories": [*good, bad, traj(3)]}).encode()
    r = httpx.post(url + INTAKE_BATCH, content=body, headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert detail["code"] == "invalid"
    assert detail["errors"][0]["field"] == f"trajectories.2.{field}"
    assert detail["message"].startswith(f"trajectories.2.{field}: ")
    assert len(buffer) == 0 and buffer.accepted == 0  # the good records before it too
    assert refused(scrape(url), "invalid") == 1 and accepted_total(url) == 0
    assert post_batch(url, [*good, traj(2), traj(3)]).status_code == 200  # repaired, all land
    assert buffer.accepted == 4


def test_another_runs_record_refuses_the_call(intake):
    buffer, url = intake
    r = post_batch(url, [traj(0), traj(1, run="other")])
    assert r.status_code == 422
    detail = r.json()["detail"]
    assert (detail["code"], detail["index"], detail["request_id"]) == ("unknown_run", 1, "q1")
    assert buffer.accepted == 0 and refused(scrape(url), "unknown_run") == 1


def test_empty_overlong_unauthorized_oversized_and_broken_calls(intake):
    buffer, url = intake
    assert post_batch(url, []).status_code == 422
    many = [traj(i) for i in range(MAX_TRAJECTORIES_PER_CALL + 1)]
    r = post_batch(url, many)
    assert r.status_code == 422 and r.json()["detail"]["errors"][0]["field"] == "trajectories"
    assert post_batch(url, [traj(0)], headers={}).status_code == 401
    assert post_batch(url, [traj(0), traj(1, **long(30_000))]).status_code == 413  # over MAX_BODY
    r = httpx.post(url + INTAKE_BATCH, content=b'{"trajectories": [', headers=AUTH)
    assert r.status_code == 422
    r = httpx.post(url + INTAKE_BATCH, json=[traj(0)], headers=AUTH)  # a bare list, not the object
    assert r.status_code == 422
    assert buffer.accepted == 0
    m = scrape(url)
    assert refused(m, "unauthorized") == 1 and refused(m, "too_large") == 1


# -- the replica's side ----------------------------------------------------------------------
def _deliver_all(url, records, *, retry_s=5.0, stagger=False, **kw):
    """Deliver `records` concurrently through one batcher: (answers or exceptions, calls, retries)."""
    retries = []

    async def go():
        async with httpx.AsyncClient(base_url=url, headers=AUTH) as client:
            b = TrajectoryBatcher(
                client, RetryPolicy(retry_s, initial=0.05), on_retry=lambda: retries.append(1), **kw
            )
            tasks = []
            for rec in records:
                tasks.append(asyncio.create_task(b.deliver(rec)))
                if stagger and len(tasks) == 1:
                    await asyncio.sleep(0)  # the first call is on its way; the rest queue behind it
            out = await asyncio.gather(*tasks, return_exceptions=True)
            await b.aclose()
            return out, b.calls, len(retries), b.batch_route

    return asyncio.run(go())


def test_concurrent_deliveries_share_calls_and_each_gets_its_own_answer(model_limits):
    buffer, server = start(model_limits[0], capacity=20)
    try:
        records = [traj(i, version=1 if i in (3, 11) else 0) for i in range(24)]
        out, calls, _, _ = _deliver_all(server.url, records, stagger=True)
    finally:
        server.stop()
    assert calls == 2  # the first alone, the other 23 together behind it
    status = {d.request_id: (d.status, d.code) for d in out}
    fresh = [f"q{i}" for i in range(24) if i not in (3, 11)]
    assert status["q3"] == status["q11"] == (409, "stale_policy")
    assert all(status[rid] == (200, None) for rid in fresh[:20])
    assert all(status[rid] == (409, "batch_full") for rid in fresh[20:])
    assert [t.request_id for t in buffer.take(20)] == fresh[:20]  # in submission order


@pytest.mark.parametrize(
    "bad,code",
    [
        ({"reward": float("nan")}, "invalid"),
        ({"advantage": None}, "invalid"),
        ({"run": "other"}, "unknown_run"),
        ({"token_ids": [1, 2, 10**6, 4]}, "invalid"),
    ],
    ids=["nan reward", "no advantage", "other run", "token past the vocabulary"],
)
def test_a_record_the_learner_refuses_fails_alone_and_the_rest_land(model_limits, bad, code):
    buffer, server = start(model_limits[0], capacity=20)
    try:
        records = [traj(i, **(bad if i == 5 else {})) for i in range(10)]
        out, calls, _, _ = _deliver_all(server.url, records, stagger=True)
    finally:
        server.stop()
    by_id = {d.request_id: d for d in out}
    assert (by_id["q5"].status, by_id["q5"].code, by_id["q5"].accepted) == (422, code, False)
    assert by_id["q5"].message
    assert all(by_id[f"q{i}"].status == 200 for i in range(10) if i != 5)
    assert sorted(t.request_id for t in buffer.take(9)) == sorted(f"q{i}" for i in range(10) if i != 5)
    assert calls == 2 + 9  # first, the refused batch, then its nine records alone


def test_an_oversized_call_is_halved_and_a_record_too_large_alone_is_refused(model_limits):
    buffer, server = start(model_limits[0], capacity=64)
    try:
        records = [traj(i, **long(1000)) for i in range(40)]  # ~12 KB each: ~480 KB together
        records.append(traj(40, **long(30_000)))  # over MAX_BODY by itself
        assert len(json.dumps(records).encode()) > 1.5 * MAX_BODY
        # The batcher's own bound set past the learner's, so that the learner's 413 is what it meets.
        out, calls, _, _ = _deliver_all(server.url, records, max_bytes=1 << 30, stagger=True)
    finally:
        server.stop()
    by_id = {d.request_id: d.status for d in out}
    assert by_id.pop("q40") == 413
    assert set(by_id.values()) == {200}
    assert buffer.accepted == 40
    assert calls > 3  # refused whole, then halves until each fits


def test_the_batchers_byte_bound_splits_calls_itself(model_limits):
    buffer, server = start(model_limits[0], capacity=64)
    try:
        records = [traj(i, **long(1000)) for i in range(20)]
        size = len(json.dumps(records[0], separators=(",", ":")).encode())
        out, calls, _, _ = _deliver_all(server.url, records, max_bytes=4 * size + 10, stagger=True)
    finally:
        server.stop()
    assert {d.status for d in out} == {200} and buffer.accepted == 20
    assert calls == 1 + 5  # the first alone, then 19 in calls of at most 4


def intake_app(limits, capacity):
    buffer = TrajectoryBuffer("r", capacity=capacity)
    token = AUTH["Authorization"].split()[1]
    return buffer, ingest_app(buffer, MAX_BODY, token=token, limits=limits, metrics=LearnerMetrics())


def test_a_learner_without_the_batch_route_gets_single_posts(model_limits):
    buffer, app = intake_app(model_limits[0], capacity=20)

    async def older_build(scope, receive, send):
        if scope["type"] == "http" and scope["path"] == INTAKE_BATCH:
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b'{"detail":"Not Found"}'})
            return
        await app(scope, receive, send)

    old = ThreadedServer(older_build).start()
    try:
        records = [traj(i, version=1 if i == 2 else 0) for i in range(6)]
        out, calls, _, batch_route = _deliver_all(old.url, records, stagger=True)
    finally:
        old.stop()
    assert batch_route is False
    assert [(d.request_id, d.status) for d in out] == [(f"q{i}", 409 if i == 2 else 200) for i in range(6)]
    assert out[2].code == "stale_policy"
    assert [t.request_id for t in buffer.take(5)] == ["q0", "q1", "q3", "q4", "q5"]


def test_a_learner_away_past_the_retry_bound_leaves_each_record_undelivered():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    out, _, retries, _ = _deliver_all(url, [traj(i) for i in range(3)], retry_s=0.5)
    assert all(isinstance(x, Undelivered) for x in out) and "ConnectError" in str(out[0])
    assert retries > 0


def test_a_learner_that_comes_back_within_the_bound_gets_everything(model_limits):
    port = free_port()
    buffer, server = None, None

    async def go():
        nonlocal buffer, server
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=AUTH) as client:
            retries = []
            b = TrajectoryBatcher(client, RetryPolicy(30.0, initial=0.05), on_retry=lambda: retries.append(1))
            tasks = [asyncio.create_task(b.deliver(traj(i))) for i in range(5)]
            await asyncio.sleep(1.0)  # retrying against nothing
            assert not any(t.done() for t in tasks)
            buffer, app = intake_app(model_limits[0], capacity=8)
            server = await asyncio.to_thread(ThreadedServer(app, port=port).start)
            return await asyncio.gather(*tasks), len(retries)

    try:
        out, retries = asyncio.run(go())
    finally:
        if server is not None:
            server.stop()
    assert [d.status for d in out] == [200] * 5 and retries > 0
    assert sorted(t.request_id for t in buffer.take(5)) == [f"q{i}" for i in range(5)]


def test_a_delivery_cancelled_before_it_leaves_never_reaches_the_learner(intake):
    buffer, url = intake

    async def go():
        async with httpx.AsyncClient(base_url=url, headers=AUTH) as client:
            b = TrajectoryBatcher(client, RetryPolicy(5.0))
            first = asyncio.create_task(b.deliver(traj(0)))
            await asyncio.sleep(0)  # the first call is on its way
            queued = asyncio.create_task(b.deliver(traj(1)))
            kept = asyncio.create_task(b.deliver(traj(2)))
            await asyncio.sleep(0)
            queued.cancel()
            assert (await first).status == 200 and (await kept).status == 200
            with pytest.raises(asyncio.CancelledError):
                await queued

    asyncio.run(go())
    assert [t.request_id for t in buffer.take(2)] == ["q0", "q2"]
    assert buffer.take(1, timeout=0.05) is None


def test_an_answer_that_does_not_line_up_fails_its_records_and_nothing_hangs():
    """A learner answering 200 with the wrong number of results (a broken proxy, a bug): each
    waiter gets the error at once, and the batcher goes on with what comes next."""
    seen = []

    async def broken(scope, receive, send):
        if scope["type"] != "http":
            return
        seen.append(scope["path"])
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b'{"results": []}'})

    server = ThreadedServer(broken).start()
    try:
        out, calls, _, _ = _deliver_all(server.url, [traj(i) for i in range(3)], stagger=True)
    finally:
        server.stop()
    assert all(isinstance(x, ValueError) for x in out), out
    assert calls == 2 and seen == [INTAKE_BATCH] * 2
