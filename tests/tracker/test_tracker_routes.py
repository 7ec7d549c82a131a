"""Every route of the tracker API over real HTTP against a tracker process on a real Redis."""

import math

import httpx
import pytest

from spopp.api.client import StalePolicy, TrackerError
from spopp.evidence import jeffreys_init

pytestmark = pytest.mark.process  # starts processes: the process tier (tests/conftest.py)

LAM = -math.log(0.875)


def test_put_run_creates_then_is_idempotent_then_conflicts(tracker, run_name):
    url = f"{tracker.url}/v1/runs/{run_name}"
    first = httpx.put(url, json={"recipe": "spopp", "seed": 3})
    assert first.status_code == 201
    body = first.json()
    assert body["policy_version"] == 0 and body["config"]["retention"] == 0.875
    assert body["config"]["lease_seconds"] == 900.0 and body["counts"]["tasks"] == 0
    # The same body after defaults is the same run.
    again = httpx.put(url, json={"recipe": "spopp", "seed": 3, "retention": 0.875})
    assert again.status_code == 200
    other = httpx.put(url, json={"recipe": "spopp", "seed": 4})
    assert other.status_code == 409 and other.json()["detail"]["code"] == "run_conflict"
    assert httpx.get(url).json()["config"]["seed"] == 3


def test_get_run_counts(client, make_run):
    run = make_run(tasks=[{"task_id": f"q{i}", "alpha0": 1, "beta0": 1} for i in range(5)])
    d = client.dispatch(run, "w", 0, 2)
    client.outcomes(run, [(d.requests[0].request_id, 1.0)])
    counts = client.get_run(run).counts
    assert (counts.tasks, counts.idle, counts.in_flight) == (5, 4, 1)
    assert (counts.dispatches, counts.outcomes) == (2, 1)


def test_put_tasks_both_forms_and_get_task(client, make_run):
    run = make_run(prior_mass=4.0)
    res = client.put_tasks(
        run, [{"task_id": "a", "alpha0": 2.0, "beta0": 6.0}, {"task_id": "b", "outcomes": [1, 1, 0]}]
    )
    assert (res.created, res.unchanged) == (2, 0)
    a = client.get_task(run, "a")
    assert (a.alpha, a.beta, a.value) == (2.0, 6.0, 0.25)
    assert not a.in_flight and a.dispatches == 0 and a.outcomes == 0
    b = client.get_task(run, "b")
    assert (b.alpha, b.beta) == pytest.approx(jeffreys_init(2, 3, mass=4.0))
    res = client.put_tasks(
        run, [{"task_id": "a", "alpha0": 2.0, "beta0": 6.0}, {"task_id": "c", "alpha0": 1, "beta0": 1}]
    )
    assert (res.created, res.unchanged) == (1, 1)
    with pytest.raises(TrackerError) as err:
        client.put_tasks(run, [{"task_id": "a", "alpha0": 3.0, "beta0": 6.0}])
    assert err.value.status == 409 and err.value.detail["task_ids"] == ["a"]


def test_dispatch_leases_each_task_once(client, make_run):
    run = make_run(tasks=[{"task_id": f"q{i}", "alpha0": 1 + i, "beta0": 2} for i in range(3)])
    d = client.dispatch(run, "w1", 0, 10)
    assert d.policy_version == 0 and len(d.requests) == 3
    assert sorted(r.task_id for r in d.requests) == ["q0", "q1", "q2"]
    for r in d.requests:
        assert r.value == pytest.approx((1 + int(r.task_id[1])) / (3 + int(r.task_id[1])))
        assert r.lease_expires_at.endswith("Z") and r.policy_version == 0
        assert client.get_task(run, r.task_id).in_flight
    assert client.dispatch(run, "w2", 0, 10).requests == []  # every task is in flight


def test_dispatch_idempotency_key(client, make_run):
    run = make_run(tasks=[{"task_id": f"q{i}", "alpha0": 1, "beta0": 1} for i in range(4)])
    first = client.dispatch(run, "w", 0, 2, idempotency_key="k1")
    again = client.dispatch(run, "w", 0, 2, idempotency_key="k1")
    assert again == first
    assert client.get_run(run).counts.dispatches == 2
    with pytest.raises(TrackerError) as err:
        client.dispatch(run, "w", 0, 3, idempotency_key="k1")
    assert err.value.status == 409 and err.value.code == "idempotency_conflict"


def test_dispatch_with_stale_version_is_409_with_current_snapshot(client, make_run):
    run = make_run(tasks=[{"task_id": "q", "alpha0": 1, "beta0": 1}], base_snapshot="file:///s/v000000")
    assert client.dispatch(run, "w", 0, 1).snapshot == "file:///s/v000000"
    client.publish(run, 1, "file:///s/v000001")
    with pytest.raises(StalePolicy) as err:
        client.dispatch(run, "w", 0, 1)
    assert err.value.status == 409
    assert (err.value.policy_version, err.value.snapshot) == (1, "file:///s/v000001")


def test_outcomes_spopp_value_frozen_at_dispatch(client, make_run):
    run = make_run(tasks=[{"task_id": "q", "alpha0": 1.0, "beta0": 3.0}])
    r = client.dispatch(run, "w", 0, 1).requests[0]
    [res] = client.outcomes(run, [(r.request_id, 1.0)])
    assert res.value == 0.25 and res.advantage == pytest.approx(0.75)
    assert client.get_task(run, "q").value == pytest.approx(2.0 / 5.0)


def test_outcomes_spo_frees_lease_without_evidence(client, make_run):
    run = make_run(recipe="spo", tasks=[{"task_id": "q", "alpha0": 1.0, "beta0": 3.0}])
    r = client.dispatch(run, "w", 0, 1).requests[0]
    [res] = client.outcomes(run, [(r.request_id, 1.0)])
    assert res.value == 0.25 and res.advantage is None
    t = client.get_task(run, "q")
    assert (t.alpha, t.beta, t.in_flight, t.outcomes) == (1.0, 3.0, False, 1)


def test_renew_extends_lease_and_release_returns_task(client, make_run):
    run = make_run(tasks=[{"task_id": "q", "alpha0": 1, "beta0": 1}])
    r = client.dispatch(run, "w", 0, 1).requests[0]
    renewed = client.renew(run, r.request_id)
    assert renewed.state == "leased" and renewed.lease_expires_at >= r.lease_expires_at
    released = client.release(run, r.request_id)
    assert released.state == "released"
    assert not client.get_task(run, "q").in_flight
    assert client.release(run, r.request_id).state == "released"  # twice: a no-op
    assert client.get_run(run).counts.releases == 1
    with pytest.raises(TrackerError) as err:
        client.renew(run, r.request_id)
    assert err.value.status == 409
    r2 = client.dispatch(run, "w", 0, 1).requests[0]
    assert r2.task_id == "q" and r2.request_id != r.request_id
    client.outcomes(run, [(r2.request_id, 0.0)])
    with pytest.raises(TrackerError) as err:
        client.release(run, r2.request_id)
    assert err.value.status == 409 and err.value.code == "already_reported"


def test_values_route(client, make_run):
    run = make_run(
        tasks=[{"task_id": "a", "alpha0": 1, "beta0": 1}, {"task_id": "b", "alpha0": 1, "beta0": 4}]
    )
    vals = client.values(run, ["b", "a"])
    assert [(v.task_id, v.value) for v in vals] == [("b", 0.2), ("a", 0.5)]


def test_consume_applies_spo_update_in_order_once(client, make_run):
    run = make_run(recipe="spo", tasks=[{"task_id": "a", "alpha0": 2.0, "beta0": 6.0}])
    res = client.consume(run, "u1", [("a", 1.0, 0.0), ("a", 0.0, 0.06)])
    # first visit: D = 0 -> rho 0.96; then D = d_half -> 2^-1 clipped to 0.875
    a1, b1 = 0.96 * 2 + 1, 0.96 * 6
    a2, b2 = 0.875 * a1, 0.875 * b1 + 1
    assert [r.rho for r in res] == [0.96, 0.875]
    assert (res[1].alpha, res[1].beta) == pytest.approx((a2, b2), rel=1e-15)
    assert res[1].value == pytest.approx(a2 / (a2 + b2))
    again = client.consume(run, "u1", [("a", 1.0, 0.0), ("a", 0.0, 0.06)])
    assert again == res
    with pytest.raises(TrackerError) as err:  # the same update_id with other items
        client.consume(run, "u1", [("a", 1.0, 0.0)])
    assert err.value.status == 409 and err.value.code == "idempotency_conflict"
    t = client.get_task(run, "a")
    assert (t.alpha, t.beta) == pytest.approx((a2, b2), rel=1e-15)
    assert client.get_run(run).counts.consumed_updates == 1


def test_policy_clock(client, make_run):
    run = make_run(base_snapshot="s0")
    p = client.policy(run)
    assert (p.version, p.z, p.snapshot) == (0, 0.0, "s0")
    p = client.publish(run, 1, "s1")
    assert (p.version, p.snapshot) == (1, "s1") and p.z == pytest.approx(LAM)
    assert client.publish(run, 1, "s1").version == 1  # the same again: no-op
    assert client.publish(run, 2, "s2").version == 2
    for version, snap, why in [(2, "other", "another snapshot"), (4, "s4", "gap"), (1, "s1", "step back")]:
        with pytest.raises(TrackerError) as err:
            client.publish(run, version, snap)
        assert err.value.status == 409 and why in err.value.detail["message"]
        assert err.value.detail["policy_version"] == 2
    assert client.policy(run).snapshot == "s2"


def test_export_lists_every_task(client, make_run):
    tasks = [{"task_id": f"q{i:04d}", "alpha0": 1 + i % 3, "beta0": 2} for i in range(2500)]
    run = make_run(tasks=tasks)
    rows = client.export(run)
    assert sorted(r["task_id"] for r in rows) == [t["task_id"] for t in tasks]
    by_id = {r["task_id"]: r for r in rows}
    assert by_id["q0002"]["alpha"] == 3 and by_id["q0002"]["value"] == pytest.approx(0.6)


def test_health_ready_metrics(tracker, client, make_run):
    run = make_run(tasks=[{"task_id": "q", "alpha0": 1, "beta0": 1}])
    client.dispatch(run, "w", 0, 1)
    health, ready = httpx.get(tracker.url + "/healthz").json(), httpx.get(tracker.url + "/readyz")
    assert health["status"] == "ok" and health["service"] == "tracker" and len(health["instance"]) == 32
    assert ready.status_code == 200 and ready.json()["instance"] == health["instance"]  # one process
    text = httpx.get(tracker.url + "/metrics").text
    assert f'spopp_tracker_leases_in_flight{{run="{run}"}} 1.0' in text
    assert f'spopp_tracker_tasks{{run="{run}"}} 1.0' in text
    assert f'spopp_tracker_outcomes_total{{run="{run}"}} 0.0' in text
    assert "spopp_tracker_request_seconds_bucket" in text
    assert 'spopp_tracker_requests_total{method="POST"' in text
    assert httpx.get(tracker.url + "/docs").status_code == 200


def test_lookup_tells_each_request_state(client, make_run, tracker):
    run = make_run(lease_seconds=60, tasks=[{"task_id": f"q{i}", "alpha0": 1, "beta0": 1} for i in range(3)])
    a, b, c = client.dispatch(run, "w", 0, max_requests=3).requests
    client.outcomes(run, [(a.request_id, 1.0)])
    client.release(run, b.request_id)
    got = client.lookup(run, [a.request_id, b.request_id, c.request_id, "never-issued"])
    assert [(r.request_id, r.state) for r in got] == [
        (a.request_id, "reported"), (b.request_id, "released"), (c.request_id, "leased"), ("never-issued", "unknown"),
    ]  # fmt: skip
    assert (got[0].task_id, got[0].policy_version) == (a.task_id, 0)
    assert got[3].task_id is None and got[3].policy_version is None
    # Bad input: an empty list is 422, an unknown run 404; nothing is written either way.
    r = httpx.post(f"{tracker.url}/v1/runs/{run}/requests/lookup", json={"request_ids": []})
    assert r.status_code == 422
    with pytest.raises(TrackerError) as err:
        client.lookup(run + "-nope", ["x"])
    assert err.value.status == 404


def test_oversized_body_is_413_and_changes_nothing(tracker, client, make_run):
    """The body limit where the socket matters: with a Content-Length over the limit, and
    streamed in chunks without one (counted as it comes in)."""
    run = make_run(tasks=[{"task_id": "q0", "alpha0": 1.0, "beta0": 2.0}])
    before = client.get_run(run).model_dump(), client.export(run)
    big = b'{"tasks": [' + b" " * (9 * 1024 * 1024) + b"]}"
    resp = httpx.put(f"{tracker.url}/v1/runs/{run}/tasks", content=big, timeout=30)
    assert resp.status_code == 413 and resp.json()["detail"]["code"] == "body_too_large"

    def chunks():  # no Content-Length
        for _ in range(10):
            yield b" " * (1024 * 1024)

    resp = httpx.put(f"{tracker.url}/v1/runs/{run}/tasks", content=chunks(), timeout=30)
    assert resp.status_code == 413
    assert (client.get_run(run).model_dump(), client.export(run)) == before
