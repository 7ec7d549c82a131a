"""The tracker under abuse and failure: bounded numbers (checked whole, in the API and again in
Lua), an embedded Redis that dies, records that expire, and 503s that say when to retry."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import time

import httpx
import psutil
import pytest
import redis as redis_sync
import redis.asyncio as aioredis
from procs import held_port

from services.tracker.embedded import EmbeddedRedis, SupervisedRedis
from services.tracker.errors import ApiError
from services.tracker.store import Store, prefix
from spopp.api.client import TrackerClient
from spopp.api.tracker_api import RunConfig, TaskPrior
from spopp.machine.net import free_port
from spopp.machine.wait import wait_http
from tools.tracker_process import TrackerProcess


def _send(url, method, path, body=None, raw=None, timeout=30):
    kw = {"content": raw} if raw is not None else ({"json": body} if body is not None else {})
    return httpx.request(method, url + path, timeout=timeout, **kw)


def _strict_json(line: str):
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(line, parse_constant=refuse)


def _export_lines(url, run) -> list[dict]:
    resp = _send(url, "GET", f"/v1/runs/{run}/export")
    assert resp.status_code == 200, resp.text
    return [_strict_json(line) for line in resp.text.splitlines() if line]


def _dump(r: redis_sync.Redis, run: str) -> dict:
    """Every key of a run with its type and content: what "changes nothing" compares."""
    out = {}
    for key in sorted(r.scan_iter(match=prefix(run).replace("{", "[{]").replace("}", "[}]") + "*")):
        kind = r.type(key)
        if kind == "hash":
            out[key] = r.hgetall(key)
        elif kind == "zset":
            out[key] = r.zrange(key, 0, -1, withscores=True)
        elif kind == "set":
            out[key] = sorted(r.smembers(key))
        else:
            out[key] = r.get(key)
    return out


@pytest.fixture
def rdb(redis_server):
    with redis_sync.Redis.from_url(redis_server.url, decode_responses=True) as r:
        yield r


# -- 1. every number is bounded ---------------------------------------------------------------


@pytest.mark.process
def test_user_report_prior_mass_1e308_is_refused_and_leaves_nothing(tracker, run_name, rdb):
    """The report: prior_mass 1e308 was accepted, the next PUT tasks answered 500 after writing
    half (1 task, 0 idle, never dispatched), a retry said "unchanged" and the export printed
    Infinity. Now the run is refused whole, and the export of any run is strict JSON."""
    resp = _send(tracker.url, "PUT", f"/v1/runs/{run_name}", {"recipe": "spopp", "prior_mass": 1e308})
    assert resp.status_code == 422, resp.text
    assert resp.json()["detail"]["message"].startswith("prior_mass")
    resp = _send(
        tracker.url, "PUT", f"/v1/runs/{run_name}/tasks", {"tasks": [{"task_id": "a", "outcomes": [1, 1]}]}
    )
    assert resp.status_code == 404  # no run was made
    assert _dump(rdb, run_name) == {}
    # At the bound the whole path works: the task is idle, dispatchable, its export strict JSON.
    resp = _send(tracker.url, "PUT", f"/v1/runs/{run_name}", {"recipe": "spopp", "prior_mass": 1e6})
    assert resp.status_code == 201, resp.text
    resp = _send(
        tracker.url, "PUT", f"/v1/runs/{run_name}/tasks", {"tasks": [{"task_id": "a", "outcomes": [1, 1]}]}
    )
    assert resp.status_code == 200, resp.text
    counts = _send(tracker.url, "GET", f"/v1/runs/{run_name}").json()["counts"]
    assert (counts["tasks"], counts["idle"]) == (1, 1)
    [row] = _export_lines(tracker.url, run_name)
    assert row["alpha"] == pytest.approx(1e6 * 2.5 / 3) and 0 < row["value"] < 1


@pytest.mark.process
def test_huge_priors_are_refused(tracker, client, make_run):
    """alpha0 = beta0 = 1.7e308 gave the value 0.0 (a + b overflows) instead of 0.5."""
    run = make_run()
    for a, b in [(1.7e308, 1.7e308), (1e6 * 1.0000001, 1.0), (1.0, 1e-7)]:
        body = {
            "tasks": [{"task_id": "ok", "alpha0": 1, "beta0": 1}, {"task_id": "big", "alpha0": a, "beta0": b}]
        }
        resp = _send(tracker.url, "PUT", f"/v1/runs/{run}/tasks", body)
        assert resp.status_code == 422, (a, b, resp.text)
        assert resp.json()["detail"]["message"].startswith("tasks.1.")
    assert client.get_run(run).counts.tasks == 0
    client.put_tasks(run, [{"task_id": "edge", "alpha0": 1e6, "beta0": 1e6}])
    assert client.get_task(run, "edge").value == 0.5


BIG = 2**63
OUT_OF_BOUNDS = [
    # (what, method, path suffix, body)
    ("prior_mass tiny", "PUT", "/x", {"recipe": "spopp", "prior_mass": 1e-300}),
    ("retention tiny", "PUT", "/x", {"recipe": "spopp", "retention": 1e-300}),
    ("lease_seconds tiny", "PUT", "/x", {"recipe": "spopp", "lease_seconds": 1e-300}),
    ("lease_seconds 8 days", "PUT", "/x", {"recipe": "spopp", "lease_seconds": 8 * 86400}),
    ("d_half tiny", "PUT", "/x", {"recipe": "spo", "d_half": 1e-300}),
    ("d_half huge", "PUT", "/x", {"recipe": "spo", "d_half": 1e300}),
    ("rho_min tiny", "PUT", "/x", {"recipe": "spo", "rho_min": 1e-300}),
    ("seed 2^63", "PUT", "/x", {"recipe": "spo", "seed": BIG}),
    (
        "dispatch version 2^63",
        "POST",
        "/dispatch",
        {"worker_id": "w", "policy_version": BIG, "max_requests": 1},
    ),
    (
        "dispatch version 2^31",
        "POST",
        "/dispatch",
        {"worker_id": "w", "policy_version": 2**31, "max_requests": 1},
    ),
    ("policy version 2^31", "POST", "/policy", {"version": 2**31, "snapshot": "s"}),
    ("policy version 1e400", "POST", "/policy", b'{"version": 1' + b"0" * 400 + b', "snapshot": "s"}'),
    (
        "drift 1e300",
        "POST",
        "/consume",
        {"update_id": "u", "items": [{"task_id": "q", "reward": 1, "drift": 1e300}]},
    ),
    ("reward 1e308", "POST", "/outcomes", {"outcomes": [{"request_id": "r1", "reward": 1e308}]}),
    ("snapshot too long", "POST", "/policy", {"version": 1, "snapshot": "s" * 4097}),
]


@pytest.mark.process
@pytest.mark.parametrize("what,method,suffix,body", OUT_OF_BOUNDS, ids=[c[0] for c in OUT_OF_BOUNDS])
def test_out_of_bounds_numbers_are_422_and_change_nothing(
    tracker, client, make_run, rdb, what, method, suffix, body
):
    run = make_run(recipe="spo", tasks=[{"task_id": "q", "alpha0": 1, "beta0": 1}])
    before = _dump(rdb, run)
    path = f"/v1/runs/{run}-{suffix[1:]}" if suffix == "/x" else f"/v1/runs/{run}{suffix}"
    raw = body if isinstance(body, bytes) else None
    resp = _send(tracker.url, method, path, None if raw else body, raw=raw)
    assert resp.status_code == 422, resp.text
    assert resp.json()["detail"]["code"] == "invalid"
    assert _dump(rdb, run) == before
    assert _dump(rdb, f"{run}-x") == {}


def _script_cases(store: Store, run: str, rids: list[str]):
    """Calls that went around the API's validation, each bad only in its last item."""
    nan, inf = float("nan"), float("inf")
    return {
        "put_tasks inf prior": lambda: store._with_draws(
            "put_tasks", run, 2, lambda _: [2, "fresh1", "1.0", "1.0", "fresh2", repr(inf), "1.0"]
        ),
        "put_tasks prior above bound": lambda: store._with_draws(
            "put_tasks", run, 2, lambda _: [2, "fresh1", "1.0", "1.0", "fresh2", "1000000.5", "1.0"]
        ),
        "put_tasks zero prior": lambda: store._with_draws(
            "put_tasks", run, 2, lambda _: [2, "fresh1", "1.0", "1.0", "fresh2", "0", "1.0"]
        ),
        "outcomes nan reward": lambda: store._call(
            "outcomes", run, store.ttl_ms, store.max_workers, rids[0], "1.0", rids[1], repr(nan)
        ),
        "outcomes reward 2": lambda: store._call(
            "outcomes", run, store.ttl_ms, store.max_workers, rids[0], "1.0", rids[1], "2"
        ),
        "outcomes odd args": lambda: store._call(
            "outcomes", run, store.ttl_ms, store.max_workers, rids[0], "1.0", rids[1]
        ),
        "consume inf drift": lambda: store._call(
            "consume", run, "u1", store.ttl_ms, "q0", "1", "0", "q1", "1", "inf"
        ),
        "consume nan reward": lambda: store._call(
            "consume", run, "u1", store.ttl_ms, "q0", "1", "0", "q1", "nan", "0"
        ),
        "policy version 1e400": lambda: store._call("policy", run, "1" + "0" * 400, "s"),
        "policy version 1.5": lambda: store._call("policy", run, "1.5", "s"),
        "dispatch nan draw": lambda: _dispatch_bad_draw(store, run),
        "dispatch version 2^53": lambda: store._call(
            "dispatch", run, "0", "0", "8.0", "w", str(2**53), "1", "", "1000", store.max_workers, "1.0"
        ),
        "finish version 1.5": lambda: store._call("finish", run, "1.5", "max_updates"),
        "finish empty reason": lambda: store._call("finish", run, "0", ""),
        "reopen version -1": lambda: store._call("reopen", run, "-1"),
        "heartbeat nan episodes": lambda: store._call("heartbeat", run, "w", "1", "nan", store.max_workers),
        "heartbeat 2^53 trajectories": lambda: store._call(
            "heartbeat", run, "w", str(2**53), "1", store.max_workers
        ),
        "put_run inf lam": lambda: _put_run(store, run + "-new", lam="inf"),
        "put_run prior mass 1e308": lambda: _put_run(store, run + "-new", prior_mass="1e308"),
    }


def _put_run(store: Store, run: str, **bad):
    fields = {
        "recipe": "spo", "lam": "0.1", "floor": "0.05", "lease_ms": "1000", "seed": "0", "prior_mass": "8.0",
        "d_half": "0.06", "rho_min": "0.875", "rho_max": "0.96", "snapshot": "", **bad,
    }  # fmt: skip
    return store._call("put_run", run, run, "{}", *[x for kv in fields.items() for x in kv])


async def _dispatch_bad_draw(store: Store, run: str):
    head = await store.redis.hmget(prefix(run) + "run", "draws", "seed", "prior_mass")
    args = ("w", "0", "2", "", store.ttl_ms, store.max_workers, "1.0", "nan")
    return await store._call("dispatch", run, *head, *args)


def test_every_script_checks_its_whole_call_before_its_first_write(redis_server, rdb, run_name):
    """Redis keeps what a failing script wrote before the failure: each script must refuse a bad
    call (here: one the API would have refused, sent around it) before it writes anything."""

    async def main():
        client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        store = Store(client)  # the default TTL
        runs, rids = {}, {}
        for recipe in ("spo", "spopp"):
            run = runs[recipe] = f"{run_name}-{recipe}"
            await store.put_run(run, RunConfig(recipe=recipe))
            await store.put_tasks(run, [TaskPrior(task_id=f"q{i}", alpha0=1.0, beta0=2.0) for i in range(4)])
            got = await store.dispatch(run, "w", 0, 2, None)
            rids[recipe] = [r["request_id"] for r in got["requests"]]
        results = {}
        for name in _script_cases(store, "", ["", ""]):
            recipe = "spo" if name.startswith("consume") else "spopp"
            run = runs[recipe]
            call = _script_cases(store, run, rids[recipe])[name]
            before = _dump(rdb, run)
            try:
                await call()
            except ApiError as exc:
                outcome = (exc.status, exc.detail["code"])
            except Exception as exc:  # a script that failed half-way: Redis's error, not ours
                outcome = (type(exc).__name__, str(exc)[:80])
            else:
                outcome = ("accepted", "")
            results[name] = (*outcome, _dump(rdb, run) == before and _dump(rdb, run + "-new") == {})
        await client.aclose()
        return results

    results = asyncio.run(main())
    assert len(results) == 19
    bad = {k: v for k, v in results.items() if v != (422, "invalid", True)}
    assert not bad, bad


@pytest.mark.process
def test_export_is_strict_json_at_the_extremes(tracker, client, run_name):
    """The largest priors, the smallest retention and drift half-life, 40 policy events with
    outcomes placed at old versions, and SPO at the bounds: every number stays finite."""
    spopp, spo = f"{run_name}-p", f"{run_name}-s"
    client.put_run(spopp, {"recipe": "spopp", "retention": 1e-6, "prior_mass": 1e6, "lease_seconds": 604800})
    tasks = []
    for i in range(3):
        tasks += [
            {"task_id": f"big{i}", "alpha0": 1e6, "beta0": 1e6},
            {"task_id": f"tiny{i}", "alpha0": 1e-6, "beta0": 1e-6},
            {"task_id": f"jeff{i}", "outcomes": [1] * 100_000},
        ]
    client.put_tasks(spopp, tasks)
    old = client.dispatch(spopp, "w", 0, 3).requests
    for v in range(1, 41):
        client.publish(spopp, v, f"s{v}")
        reqs = client.dispatch(spopp, "w", v, 3).requests
        assert reqs
        client.outcomes(spopp, [(r.request_id, float(v % 2)) for r in reqs])
    client.outcomes(spopp, [(r.request_id, 1.0) for r in old])  # at version 0, 40 events later
    client.put_run(
        spo, {"recipe": "spo", "d_half": 1e-6, "rho_min": 1e-6, "rho_max": 1.0, "prior_mass": 1e-6}
    )
    client.put_tasks(
        spo, [{"task_id": "a", "alpha0": 1e6, "beta0": 1e-6}, {"task_id": "j", "outcomes": [0] * 100_000}]
    )
    for u in range(5):
        client.consume(spo, f"u{u}", [("a", 0.0, 1e6), ("j", 1.0, 0.0)])
    for run in (spopp, spo):
        rows = _export_lines(tracker.url, run)
        assert rows
        for row in rows:
            for key in ("alpha", "beta", "value"):
                assert isinstance(row[key], float | int) and math.isfinite(row[key]), row
            assert 0.0 <= row["value"] <= 1.0


@pytest.mark.process
def test_export_of_state_written_before_the_bounds_is_still_json(tracker, client, make_run, rdb):
    """A run damaged by the old unbounded API (a task whose alpha is inf) still exports strict
    JSON: the numbers that are not finite come out as null."""
    run = make_run(
        tasks=[{"task_id": "ok", "alpha0": 1, "beta0": 3}, {"task_id": "bad", "alpha0": 1, "beta0": 1}]
    )
    rdb.hset(prefix(run) + "t:bad", mapping={"a": "inf", "a0": "inf"})
    rows = {r["task_id"]: r for r in _export_lines(tracker.url, run)}
    assert rows["ok"]["value"] == 0.25
    assert rows["bad"]["alpha"] is None and rows["bad"]["value"] is None and rows["bad"]["beta"] == 1.0


# -- 2. the embedded Redis is supervised ------------------------------------------------------


# Seconds a step of a redis restart may take on a loaded machine (see the test that uses it).
LOADED_S = 30.0


def _redis_child(tracker: TrackerProcess, data) -> psutil.Process:
    """The tracker's embedded redis-server: its one redis-server child (the pid in the data
    folder's pidfile names the same process). Killed by this pid, never by name."""
    deadline = time.monotonic() + LOADED_S
    while True:
        try:
            children = [
                p for p in psutil.Process(tracker.proc.pid).children() if p.name().startswith("redis-server")
            ]
            if len(children) == 1 and children[0].status() != psutil.STATUS_ZOMBIE:
                pidfile = data / "redis.pid"
                if not pidfile.exists() or int(pidfile.read_text()) == children[0].pid:
                    return children[0]
        except (OSError, ValueError, psutil.Error):
            pass
        assert time.monotonic() < deadline, "no redis-server child found"
        time.sleep(0.05)


def _wait_status(url: str, path: str, status: int, seconds: float) -> float:
    """Seconds until `path` answers `status`."""
    t0 = time.monotonic()
    wait_http(url + path, seconds, f"{path} to answer {status}", ok=(status,), interval=0.05)
    return time.monotonic() - t0


def _workload(c: TrackerClient, run: str) -> tuple[list, list]:
    c.put_run(run, {"recipe": "spopp", "seed": 3})
    c.put_tasks(run, [{"task_id": f"q{i}", "outcomes": [i % 2, 1, 0]} for i in range(30)])
    acked = []
    for v in range(3):
        reqs = c.dispatch(run, "w", v, 8).requests
        acked += c.outcomes(run, [(r.request_id, float(i % 2)) for i, r in enumerate(reqs[:6])])
        c.publish(run, v + 1, f"s{v + 1}")
    return acked, reqs[6:]


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no metric {name}")


@pytest.mark.process
def test_sigkilled_embedded_redis_is_restarted_and_keeps_every_acknowledged_outcome(tmp_path, run_name):
    data = tmp_path / "data"
    tracker = TrackerProcess(None, data_dir=data)
    try:
        with TrackerClient(tracker.url, retry_seconds=0) as c:
            acked, pending = _workload(c, run_name)
            before = (c.get_run(run_name).model_dump(), c.export(run_name))
            redis = _redis_child(tracker, data)
            os.kill(redis.pid, signal.SIGKILL)  # by pid, never by name
            took = _wait_status(tracker.url, "/readyz", 200, 10)
            assert httpx.get(tracker.url + "/healthz").status_code == 200
            after = (c.get_run(run_name).model_dump(), c.export(run_name))
            assert after == before
            assert after[0]["counts"]["outcomes"] == len(acked) == 18
            # The leases taken before the crash are still live; the run goes on.
            c.outcomes(run_name, [(r.request_id, 1.0) for r in pending])
            assert c.get_run(run_name).counts.outcomes == 20
            assert c.dispatch(run_name, "w", 3, 2).requests
            new = _redis_child(tracker, data)
            assert new.pid != redis.pid and _metric(tracker.url, "spopp_tracker_redis_restarts_total") == 1
        print(f"answered again {took:.2f} s after the SIGKILL")
    finally:
        tracker.stop()
    assert tracker.proc.returncode == 0


@pytest.mark.process
def test_healthz_fails_when_the_embedded_redis_keeps_dying(tmp_path, run_name):
    data = tmp_path / "data"
    env = {"SPOPP_TRACKER_REDIS_MAX_RESTARTS": "1", "SPOPP_TRACKER_REDIS_RESTART_WINDOW_SECONDS": "600"}
    tracker = TrackerProcess(None, data_dir=data, env=env)
    try:
        with TrackerClient(tracker.url, retry_seconds=0) as c:
            c.put_run(run_name, {"recipe": "spo"})
        first = _redis_child(tracker, data)
        os.kill(first.pid, signal.SIGKILL)
        # One restart is allowed. Its bounds are what a loaded 2-core machine needs, not what the
        # tracker should take: a restart is a fork, exec and AOF load (well under a second idle),
        # which waited behind two busy processes and a suite once failed this test at 10 s.
        _wait_status(tracker.url, "/readyz", 200, LOADED_S)
        second = _redis_child(tracker, data)
        assert second.pid != first.pid
        os.kill(second.pid, signal.SIGKILL)  # a second death within the window: give up
        _wait_status(tracker.url, "/healthz", 503, LOADED_S)
        resp = httpx.get(tracker.url + "/healthz", timeout=LOADED_S)
        assert resp.json()["detail"]["code"] == "redis_failed"
        assert httpx.get(tracker.url + "/readyz", timeout=LOADED_S).status_code == 503
        resp = httpx.get(f"{tracker.url}/v1/runs/{run_name}", timeout=LOADED_S)
        assert resp.status_code == 503 and resp.json()["detail"]["code"] == "redis_unavailable"
    finally:
        tracker.stop()


@pytest.mark.process
def test_a_stopped_embedded_redis_is_slow_not_dead_and_is_not_restarted(tmp_path, run_name):
    data = tmp_path / "data"
    tracker = TrackerProcess(None, data_dir=data, env={"SPOPP_TRACKER_REDIS_TIMEOUT_SECONDS": "0.5"})
    try:
        redis = _redis_child(tracker, data)
        os.kill(redis.pid, signal.SIGSTOP)
        try:
            resp = httpx.get(f"{tracker.url}/v1/runs/{run_name}", timeout=10)
            assert resp.status_code == 503 and resp.json()["detail"]["code"] == "redis_unavailable"
            assert resp.headers["Retry-After"] == "1"
            time.sleep(1.0)
            assert httpx.get(tracker.url + "/healthz").status_code == 200  # within redis_down_seconds
        finally:
            os.kill(redis.pid, signal.SIGCONT)
        _wait_status(tracker.url, "/readyz", 200, 10)
        assert _redis_child(tracker, data).pid == redis.pid
        assert _metric(tracker.url, "spopp_tracker_redis_restarts_total") == 0
    finally:
        tracker.stop()


@pytest.mark.process
def test_a_drawn_redis_port_taken_before_redis_binds_it_is_drawn_again(tmp_path, monkeypatch):
    """The embedded Redis's port is drawn free, then bound by redis-server a moment later; another
    process may take it in between. The first start draws again (the tracker has told no one the
    port yet); a port that was given is refused by name; a restart keeps its port whatever happens
    (the tracker's connection pool knows it)."""
    from services.tracker import embedded

    with held_port() as taken:
        draws = [taken]
        real = embedded.free_port
        monkeypatch.setattr(
            embedded, "free_port", lambda taken=(): draws.pop() if draws else real(taken=taken)
        )
        supervised = SupervisedRedis(tmp_path / "drawn").start()
        try:
            assert not draws and supervised.redis.port != taken and supervised.state == "running"
            assert redis_sync.Redis.from_url(supervised.url).ping()
        finally:
            supervised.stop()

        given = SupervisedRedis(tmp_path / "given", port=taken)
        with pytest.raises(RuntimeError, match=f"port {taken} is in use: redis-server exited with 1"):
            given.start()
        assert given.redis.port == taken
        restarted = EmbeddedRedis(tmp_path / "drawn")  # drawn, but a restart passes no redraw
        restarted.port = taken
        with pytest.raises(RuntimeError, match=f"port {taken} is in use"):
            restarted.start()
        assert restarted.port == taken


@pytest.mark.process
def test_healthz_fails_when_an_external_redis_stays_unreachable(tmp_path, run_name):
    port = free_port()
    redis = EmbeddedRedis(tmp_path, port=port).start()  # main thread: its death signal follows it
    tracker = TrackerProcess(redis.url, env={"SPOPP_TRACKER_REDIS_DOWN_SECONDS": "2"})
    try:
        assert httpx.get(tracker.url + "/healthz").status_code == 200
        redis.stop()
        assert httpx.get(tracker.url + "/readyz").status_code == 503  # at once
        assert httpx.get(tracker.url + "/healthz").status_code == 200  # not yet: it may come back
        took = _wait_status(tracker.url, "/healthz", 503, 10)
        assert 1.0 < took < 6.0
        detail = httpx.get(tracker.url + "/healthz").json()["detail"]
        assert detail["code"] == "redis_unreachable"
        redis = EmbeddedRedis(tmp_path, port=port).start()
        _wait_status(tracker.url, "/healthz", 200, 10)
        _wait_status(tracker.url, "/readyz", 200, 10)
    finally:
        tracker.stop()
        redis.stop()


# -- 3. idempotency records and finished requests expire ---------------------------------------


@pytest.mark.process
def test_idempotency_records_and_finished_requests_expire(tracker, client, make_run, rdb):
    """A dispatch's idempotency record, a finished request and a consumed update each live for
    idempotency_ttl_seconds (an hour by default), not forever; a live lease does not expire."""
    run = make_run(tasks=[{"task_id": f"q{i}", "alpha0": 1, "beta0": 1} for i in range(3)])
    reqs = client.dispatch(run, "w", 0, 3, idempotency_key="k1").requests
    client.outcomes(run, [(reqs[0].request_id, 1.0)])
    client.release(run, reqs[1].request_id)
    p = prefix(run)
    hour = 3600 * 1000
    assert 0 < rdb.pttl(p + "idem:k1") <= hour
    assert 0 < rdb.pttl(p + f"r:{reqs[0].request_id}") <= hour
    assert 0 < rdb.pttl(p + f"r:{reqs[1].request_id}") <= hour
    assert rdb.pttl(p + f"r:{reqs[2].request_id}") == -1  # live: kept while it is
    spo = f"{run}-spo"
    client.put_run(spo, {"recipe": "spo"})
    client.put_tasks(spo, [{"task_id": "a", "alpha0": 1, "beta0": 1}])
    client.consume(spo, "u1", [("a", 1.0, 0.1)])
    assert 0 < rdb.pttl(prefix(spo) + "upd:u1") <= hour
    assert not rdb.exists(prefix(spo) + "consumed")


@pytest.mark.process
def test_finished_records_are_forgotten_after_the_ttl(redis_server, rdb, run_name):
    tracker = TrackerProcess(redis_server.url, env={"SPOPP_TRACKER_IDEMPOTENCY_TTL_SECONDS": "1"})
    try:
        with TrackerClient(tracker.url, retry_seconds=0) as c:
            n = 10
            c.put_run(run_name, {"recipe": "spopp"})
            c.put_tasks(run_name, [{"task_id": f"q{i}", "alpha0": 1, "beta0": 1} for i in range(n)])
            first = None
            started = time.monotonic()
            for round_ in range(30):
                reqs = c.dispatch(run_name, "w", 0, 4, idempotency_key=f"k{round_}").requests
                c.outcomes(run_name, [(r.request_id, 1.0) for r in reqs[:3]])
                for r in reqs[3:]:
                    c.release(run_name, r.request_id)
                first = first or reqs[0]
            took = time.monotonic() - started
            pattern = prefix(run_name).replace("{", "[{]").replace("}", "[}]")
            # Every record of a finished request or a dispatch carries the 1 s TTL, however long
            # the rounds took; the 150 of them are all still there only if the rounds took under 1 s
            # (a loaded machine can take longer, and the first have expired by then).
            records = rdb.keys(pattern + "idem:*") + rdb.keys(pattern + "r:*")
            ttls = [rdb.pttl(k) for k in records]  # -2: expired since keys() listed it
            assert all(t == -2 or 0 < t <= 1000 for t in ttls), f"a finished record without its TTL: {ttls}"
            if took < 1.0:
                assert len(records) > 100, f"the rounds took {took:.2f} s, under the TTL, yet records expired"
            time.sleep(1.5)
            keys = rdb.keys(prefix(run_name).replace("{", "[{]").replace("}", "[}]") + "*")
            # run, idle, tasks, one hash per task and five per-worker hashes (whatever the number
            # of workers): O(tasks), whatever the number of dispatches.
            assert len(keys) <= n + 4 + 5, sorted(keys)
            assert c.get_run(run_name).counts.outcomes == 90
            with pytest.raises(Exception) as err:  # a report long after its TTL: forgotten
                c.outcomes(run_name, [(first.request_id, 1.0)])
            assert err.value.status == 404 and err.value.code == "unknown_request"
            # The same idempotency key long after: a new dispatch, not the old answer.
            again = c.dispatch(run_name, "w", 0, 4, idempotency_key="k0").requests
            assert {r.request_id for r in again}.isdisjoint({first.request_id})
    finally:
        tracker.stop()


# -- 4. Redis unavailable: 503 redis_unavailable with Retry-After on every route ---------------

V1_CALLS = [
    ("PUT", "", {"recipe": "spopp"}),
    ("GET", "", None),
    ("PUT", "/tasks", {"tasks": [{"task_id": "q", "alpha0": 1, "beta0": 1}]}),
    ("GET", "/tasks/q", None),
    ("POST", "/dispatch", {"worker_id": "w", "policy_version": 0, "max_requests": 1}),
    ("POST", "/outcomes", {"outcomes": [{"request_id": "r1", "reward": 1}]}),
    ("POST", "/requests/r1/renew", None),
    ("POST", "/requests/r1/release", None),
    ("POST", "/values", {"task_ids": ["q"]}),
    ("POST", "/consume", {"update_id": "u", "items": [{"task_id": "q", "reward": 1, "drift": 0}]}),
    ("GET", "/policy", None),
    ("POST", "/policy", {"version": 1, "snapshot": "s"}),
    ("GET", "/export", None),
]


@pytest.mark.process
def test_every_v1_route_answers_503_with_retry_after_while_redis_is_down(tmp_path, run_name):
    port = free_port()
    redis = EmbeddedRedis(tmp_path, port=port).start()
    tracker = TrackerProcess(redis.url)
    try:
        with TrackerClient(tracker.url) as c:
            c.put_run(run_name, {"recipe": "spopp"})
        redis.stop()
        for method, suffix, body in V1_CALLS:
            resp = _send(tracker.url, method, f"/v1/runs/{run_name}{suffix}", body)
            assert resp.status_code == 503, (method, suffix, resp.text)
            assert resp.json()["detail"]["code"] == "redis_unavailable", (method, suffix)
            assert resp.headers.get("Retry-After") == "1", (method, suffix)
        for path in ("/readyz", "/metrics"):
            resp = httpx.get(tracker.url + path)
            assert resp.status_code == 503 and resp.headers.get("Retry-After") == "1", path
        redis = EmbeddedRedis(tmp_path, port=port).start()
        _wait_status(tracker.url, "/readyz", 200, 10)
        assert _send(tracker.url, "GET", f"/v1/runs/{run_name}").status_code == 200
    finally:
        tracker.stop()
        redis.stop()
