"""Every bad input gets its status code and a detail body, and leaves the state unchanged.

The routes' logic, in the fast tier: the tracker's app in this process on a real Redis (the
`api` and `client` fixtures). Where the socket matters (a body over the limit, streamed or not)
the test is in test_tracker_routes, over real HTTP to a tracker process."""

import json

import pytest

TASKS = [{"task_id": f"q{i}", "alpha0": 1.0 + i, "beta0": 2.0} for i in range(4)]


@pytest.fixture
def live(client, make_run):
    """A spopp run with two live leases, one reported request and one released request."""
    run = make_run(tasks=TASKS, base_snapshot="s0")
    reqs = client.dispatch(run, "w", 0, 4).requests
    client.outcomes(run, [(reqs[0].request_id, 1.0)])
    client.release(run, reqs[1].request_id)
    return run, reqs


def snapshot(client, run):
    r = client.get_run(run)
    return r.model_dump(), client.export(run)


def _send(api, method, path, body=None, raw=None, headers=None):
    kw = {"content": raw} if raw is not None else ({"json": body} if body is not None else {})
    return api.request(method, path, headers=headers, **kw)


CASES = [
    # (what, method, path-suffix, body or raw bytes, status, code)
    ("malformed JSON", "POST", "/outcomes", b'{"outcomes": [', 422, "invalid"),
    (
        "NaN reward",
        "POST",
        "/outcomes",
        b'{"outcomes": [{"request_id": "REQ2", "reward": NaN}]}',
        422,
        "invalid",
    ),
    (
        "reward above 1",
        "POST",
        "/outcomes",
        {"outcomes": [{"request_id": "REQ2", "reward": 1.5}]},
        422,
        "invalid",
    ),
    ("empty outcomes", "POST", "/outcomes", {"outcomes": []}, 422, "invalid"),
    (
        "unknown field",
        "POST",
        "/outcomes",
        {"outcomes": [{"request_id": "REQ2", "reward": 1, "x": 1}]},
        422,
        "invalid",
    ),
    (
        "unknown request",
        "POST",
        "/outcomes",
        {"outcomes": [{"request_id": "nope", "reward": 1}]},
        404,
        "unknown_request",
    ),
    (
        "one unknown in a batch",
        "POST",
        "/outcomes",
        {"outcomes": [{"request_id": "REQ2", "reward": 1}, {"request_id": "nope", "reward": 1}]},
        404,
        "unknown_request",
    ),
    (
        "released in a batch",
        "POST",
        "/outcomes",
        {"outcomes": [{"request_id": "REQ2", "reward": 1}, {"request_id": "REQ1", "reward": 1}]},
        409,
        "lease_not_live",
    ),
    (
        "other reward in a batch",
        "POST",
        "/outcomes",
        {"outcomes": [{"request_id": "REQ3", "reward": 1}, {"request_id": "REQ0", "reward": 0}]},
        409,
        "outcome_conflict",
    ),
    (
        "stale version",
        "POST",
        "/dispatch",
        {"worker_id": "w", "policy_version": 7, "max_requests": 1},
        409,
        "stale_policy",
    ),
    (
        "max_requests 0",
        "POST",
        "/dispatch",
        {"worker_id": "w", "policy_version": 0, "max_requests": 0},
        422,
        "invalid",
    ),
    (
        "max_requests 1025",
        "POST",
        "/dispatch",
        {"worker_id": "w", "policy_version": 0, "max_requests": 1025},
        422,
        "invalid",
    ),
    ("missing worker", "POST", "/dispatch", {"policy_version": 0, "max_requests": 1}, 422, "invalid"),
    (
        "negative alpha0",
        "PUT",
        "/tasks",
        {"tasks": [{"task_id": "n", "alpha0": -1, "beta0": 1}]},
        422,
        "invalid",
    ),
    (
        "infinite beta0",
        "PUT",
        "/tasks",
        b'{"tasks": [{"task_id": "n", "alpha0": 1, "beta0": Infinity}]}',
        422,
        "invalid",
    ),
    (
        "both prior forms",
        "PUT",
        "/tasks",
        {"tasks": [{"task_id": "n", "alpha0": 1, "beta0": 1, "outcomes": [1]}]},
        422,
        "invalid",
    ),
    ("neither prior form", "PUT", "/tasks", {"tasks": [{"task_id": "n"}]}, 422, "invalid"),
    ("outcome not 0/1", "PUT", "/tasks", {"tasks": [{"task_id": "n", "outcomes": [2]}]}, 422, "invalid"),
    (
        "duplicate task ids",
        "PUT",
        "/tasks",
        {"tasks": [{"task_id": "n", "alpha0": 1, "beta0": 1}, {"task_id": "n", "alpha0": 1, "beta0": 1}]},
        422,
        "duplicate_task",
    ),
    (
        "bad task id",
        "PUT",
        "/tasks",
        {"tasks": [{"task_id": "a b", "alpha0": 1, "beta0": 1}]},
        422,
        "invalid",
    ),
    (
        "prior conflict",
        "PUT",
        "/tasks",
        {"tasks": [{"task_id": "new", "alpha0": 1, "beta0": 1}, {"task_id": "q0", "alpha0": 5, "beta0": 5}]},
        409,
        "prior_conflict",
    ),
    (
        "too many tasks",
        "PUT",
        "/tasks",
        {"tasks": [{"task_id": f"m{i}", "alpha0": 1, "beta0": 1} for i in range(10_001)]},
        413,
        "too_many_tasks",
    ),
    (
        # Over the cap and all one id: the cap answers (the duplicate check is never reached).
        "one task id repeated past the cap",
        "PUT",
        "/tasks",
        {"tasks": [{"task_id": "same", "alpha0": 1, "beta0": 1}] * 10_001},
        413,
        "too_many_tasks",
    ),
    ("unknown task", "GET", "/tasks/nope", None, 404, "unknown_task"),
    ("values of unknown task", "POST", "/values", {"task_ids": ["q0", "nope"]}, 404, "unknown_task"),
    (
        "consume on spopp",
        "POST",
        "/consume",
        {"update_id": "u", "items": [{"task_id": "q0", "reward": 1, "drift": 0}]},
        409,
        "wrong_recipe",
    ),
    (
        "consume negative drift",
        "POST",
        "/consume",
        {"update_id": "u", "items": [{"task_id": "q0", "reward": 1, "drift": -1}]},
        422,
        "invalid",
    ),
    (
        "consume unknown task",
        "POST",
        "/consume",
        {"update_id": "u", "items": [{"task_id": "nope", "reward": 1, "drift": 0}]},
        404,
        "unknown_task",
    ),
    ("policy gap", "POST", "/policy", {"version": 3, "snapshot": "s3"}, 409, "policy_conflict"),
    ("policy version 0", "POST", "/policy", {"version": 0, "snapshot": "s"}, 422, "invalid"),
    ("renew unknown", "POST", "/requests/nope/renew", None, 404, "unknown_request"),
    ("renew released", "POST", "/requests/REQ1/renew", None, 409, "lease_not_live"),
    ("release reported", "POST", "/requests/REQ0/release", None, 409, "already_reported"),
    ("run conflict", "PUT", "", {"recipe": "spo"}, 409, "run_conflict"),
    ("unknown recipe", "PUT", "", {"recipe": "grpo"}, 422, "invalid"),
    ("retention 1", "PUT", "", {"recipe": "spopp", "retention": 1.0}, 422, "invalid"),
    ("max_staleness 65", "PUT", "", {"recipe": "spopp", "max_staleness": 65}, 422, "invalid"),
    ("max_staleness negative", "PUT", "", {"recipe": "spopp", "max_staleness": -1}, 422, "invalid"),
    ("max_staleness fractional", "PUT", "", {"recipe": "spopp", "max_staleness": 1.5}, 422, "invalid"),
    ("max_staleness string", "PUT", "", {"recipe": "spopp", "max_staleness": "1"}, 422, "invalid"),
    ("dispatch worker id of 129", "POST", "/dispatch", {"worker_id": "w" * 129, "policy_version": 0, "max_requests": 1}, 422, "invalid"),
    # Finishing a run: only at its current version (0 here), with a short printable reason.
    ("finish another version", "POST", "/finish", {"version": 3}, 409, "version_mismatch"),
    ("finish no version", "POST", "/finish", {}, 422, "invalid"),
    ("finish negative version", "POST", "/finish", {"version": -1}, 422, "invalid"),
    ("finish fractional version", "POST", "/finish", {"version": 0.5}, 422, "invalid"),
    ("finish version 2^31", "POST", "/finish", {"version": 2**31}, 422, "invalid"),
    ("finish empty reason", "POST", "/finish", {"version": 0, "reason": ""}, 422, "invalid"),
    ("finish reason of 201", "POST", "/finish", {"version": 0, "reason": "x" * 201}, 422, "invalid"),
    ("finish reason with a newline", "POST", "/finish", {"version": 0, "reason": "a\nb"}, 422, "invalid"),
    ("finish unknown field", "POST", "/finish", {"version": 0, "why": "x"}, 422, "invalid"),
    ("finish malformed JSON", "POST", "/finish", b'{"version": ', 422, "invalid"),
    ("finish a list", "POST", "/finish", [0], 422, "invalid"),
    ("reopen another version", "POST", "/reopen", {"version": 2}, 409, "version_mismatch"),
    # A run's budget: whole updates in [1, 2^31), never a string, float or NaN.
    ("budget zero", "POST", "/budget", {"max_updates": 0}, 422, "invalid"),
    ("budget string", "POST", "/budget", {"max_updates": "8"}, 422, "invalid"),
    ("budget float", "POST", "/budget", {"max_updates": 8.0}, 422, "invalid"),
    ("budget NaN", "POST", "/budget", b'{"max_updates": NaN}', 422, "invalid"),
    ("budget 2^31", "POST", "/budget", {"max_updates": 2**31}, 422, "invalid"),
    ("budget no body", "POST", "/budget", None, 422, "invalid"),
    # Heartbeats: whole counts >= 0 (no strings, floats, booleans or NaN), a worker id of at most
    # 128 characters from the id alphabet; for a known worker ("w") and a new one ("w2") alike.
    ("heartbeat negative", "POST", "/workers/w", {"trajectories": -1, "episodes": 0}, 422, "invalid"),
    ("heartbeat NaN", "POST", "/workers/w", b'{"trajectories": NaN, "episodes": 0}', 422, "invalid"),
    ("heartbeat Infinity", "POST", "/workers/w2", b'{"trajectories": 1, "episodes": Infinity}', 422, "invalid"),
    ("heartbeat string", "POST", "/workers/w", {"trajectories": "5", "episodes": 0}, 422, "invalid"),
    ("heartbeat float", "POST", "/workers/w2", {"trajectories": 5.0, "episodes": 0}, 422, "invalid"),
    ("heartbeat boolean", "POST", "/workers/w", {"trajectories": True, "episodes": 0}, 422, "invalid"),
    ("heartbeat 2^53", "POST", "/workers/w", {"trajectories": 2**53, "episodes": 0}, 422, "invalid"),
    ("heartbeat missing count", "POST", "/workers/w2", {"trajectories": 1}, 422, "invalid"),
    ("heartbeat unknown field", "POST", "/workers/w", {"trajectories": 1, "episodes": 1, "x": 1}, 422, "invalid"),
    ("heartbeat no body", "POST", "/workers/w2", None, 422, "invalid"),
    ("heartbeat worker id of 129", "POST", "/workers/" + "w" * 129, {"trajectories": 1, "episodes": 1}, 422, "invalid"),
    ("heartbeat worker id with a space", "POST", "/workers/a%20b", {"trajectories": 1, "episodes": 1}, 422, "invalid"),
    ("heartbeat worker id with a quote", "POST", "/workers/a%22b", {"trajectories": 1, "episodes": 1}, 422, "invalid"),
    ("release worker id of 129", "POST", "/workers/" + "w" * 129 + "/release", None, 422, "invalid"),
    ("release worker id with a space", "POST", "/workers/a%20b/release", None, 422, "invalid"),
    # Strict types on the wire: JSON's true is no number, "0.25" no reward, 1.0 no integer (before,
    # {"version": true} published version 1 and each of these was accepted).
    ("policy version true", "POST", "/policy", {"version": True, "snapshot": "s1"}, 422, "invalid"),
    ("policy version 1.0", "POST", "/policy", {"version": 1.0, "snapshot": "s1"}, 422, "invalid"),
    ("reward true", "POST", "/outcomes", {"outcomes": [{"request_id": "REQ2", "reward": True}]}, 422, "invalid"),
    ("reward as text", "POST", "/outcomes", {"outcomes": [{"request_id": "REQ2", "reward": "0.25"}]}, 422, "invalid"),
    ("max_requests true", "POST", "/dispatch", {"worker_id": "w", "policy_version": 0, "max_requests": True}, 422,
     "invalid"),
    ("alpha0 as text", "PUT", "/tasks", {"tasks": [{"task_id": "q9", "alpha0": "1", "beta0": 1.0}]}, 422, "invalid"),
    ("outcomes of true", "PUT", "/tasks", {"tasks": [{"task_id": "q9", "outcomes": [True, 0]}]}, 422, "invalid"),
    # Ids are path segments: no "/", not "." or ".." (a task "a/b" could be created but not read).
    ("task id with a slash", "PUT", "/tasks", {"tasks": [{"task_id": "a/b", "alpha0": 1, "beta0": 1}]}, 422, "invalid"),
    ("task id climbing", "PUT", "/tasks", {"tasks": [{"task_id": "../../x", "alpha0": 1, "beta0": 1}]}, 422,
     "invalid"),
    ("task id dot", "PUT", "/tasks", {"tasks": [{"task_id": ".", "alpha0": 1, "beta0": 1}]}, 422, "invalid"),
    ("task id dot dot", "PUT", "/tasks", {"tasks": [{"task_id": "..", "alpha0": 1, "beta0": 1}]}, 422, "invalid"),
    ("worker id dot dot", "POST", "/dispatch", {"worker_id": "..", "policy_version": 0, "max_requests": 1}, 422,
     "invalid"),
    # A key twice in one JSON object: Python's parser kept the last silently (another parser would
    # keep the first), so it is refused before anything reads the body, at any depth.
    ("reward twice", "POST", "/outcomes", b'{"outcomes": [{"request_id": "REQ2", "reward": 1, "reward": 0}]}', 400,
     "duplicate_key"),
    ("version twice", "POST", "/policy", b'{"version": 1, "snapshot": "s1", "version": 2}', 400, "duplicate_key"),
    ("alpha0 twice", "PUT", "/tasks", b'{"tasks": [{"task_id": "q9", "alpha0": 1, "alpha0": 2, "beta0": 1}]}', 400,
     "duplicate_key"),
    ("tasks twice", "PUT", "/tasks", b'{"tasks": [], "tasks": [{"task_id": "q9", "alpha0": 1, "beta0": 1}]}', 400,
     "duplicate_key"),
]  # fmt: skip


@pytest.mark.parametrize("what,method,suffix,body,status,code", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_and_changes_nothing(
    api, client, live, what, method, suffix, body, status, code
):
    run, reqs = live
    suffix = suffix.replace("REQ0", reqs[0].request_id).replace("REQ1", reqs[1].request_id)
    if isinstance(body, bytes):
        raw = body
        for i, r in enumerate(reqs):
            raw = raw.replace(f"REQ{i}".encode(), r.request_id.encode())
        body = None
    else:
        raw = None
        text = json.dumps(body)
        for i, r in enumerate(reqs):
            text = text.replace(f'"REQ{i}"', json.dumps(r.request_id))
        body = json.loads(text)
    before = snapshot(client, run)
    resp = _send(api, method, f"/v1/runs/{run}{suffix}", body=body, raw=raw)
    assert resp.status_code == status, resp.text
    detail = resp.json()["detail"]
    assert detail["code"] == code and detail["message"]
    assert snapshot(client, run) == before


def test_an_integer_is_still_a_number_where_a_number_is_asked(api, live):
    """Strictness refuses other types, not an integer for a real: reward 1 (JSON 1, not 1.0) is a reward."""
    run, reqs = live
    resp = _send(api, "POST", f"/v1/runs/{run}/outcomes", raw=b'{"outcomes": [{"request_id": "%s", "reward": 1}]}'
                 % reqs[2].request_id.encode(), headers={"content-type": "application/json"})  # fmt: skip
    assert resp.status_code == 200, resp.text


def test_validation_message_names_the_field(api, live):
    run, _ = live
    resp = _send(api, "POST", f"/v1/runs/{run}/outcomes", {"outcomes": [{"request_id": "x", "reward": 2}]})
    assert resp.json()["detail"]["message"].startswith("outcomes.0.reward")


def test_unknown_run_is_404_and_422_comes_first(api):
    assert _send(api, "GET", "/v1/runs/nope-run").status_code == 404
    resp = _send(
        api,
        "POST",
        "/v1/runs/nope-run/dispatch",
        {"worker_id": "w", "policy_version": 0, "max_requests": 1},
    )
    assert resp.status_code == 404 and resp.json()["detail"]["code"] == "unknown_run"
    resp = _send(api, "POST", "/v1/runs/nope-run/outcomes", {"outcomes": [{"request_id": "x", "reward": 9}]})
    assert resp.status_code == 422
    assert _send(api, "GET", "/v1/runs/nope-run/export").status_code == 404
    assert _send(api, "PUT", "/v1/runs/nope-run/tasks", {"tasks": []}).status_code == 404
    assert _send(api, "POST", "/v1/runs/nope-run/workers/w/release").status_code == 404


def test_404_comes_before_409(api, client, live):
    run, reqs = live
    body = {
        "outcomes": [{"request_id": reqs[1].request_id, "reward": 1}, {"request_id": "nope", "reward": 1}]
    }
    resp = _send(api, "POST", f"/v1/runs/{run}/outcomes", body)
    assert resp.status_code == 404 and resp.json()["detail"]["request_ids"] == ["nope"]


# A long list of bad items: the cap is checked before the items, and the reply is short whatever
# the list. Before, {"tasks": [1] * 100_000} took 1.4 s and answered 13.5 MB naming every item;
# [1] * 10**6 took 10 s and answered 136 MB. The reply's size is the assertion that could not pass
# then; the time bound is the order of magnitude, with room for a loaded machine.
SHORT_REPLY_BYTES = 4096


@pytest.mark.parametrize(
    "suffix,field,n,status,code",
    [
        ("/tasks", "tasks", 10**6, 413, "too_many_tasks"),  # past the cap: answered at the cap
        ("/tasks", "tasks", 10_000, 422, "invalid"),  # at the cap, every item bad
        ("/outcomes", "outcomes", 10**6, 422, "invalid"),
        ("/outcomes", "outcomes", 10_000, 422, "invalid"),
        ("/values", "task_ids", 10**6, 422, "invalid"),
    ],
    ids=["tasks-past-cap", "tasks-at-cap", "outcomes-past-cap", "outcomes-at-cap", "values-past-cap"],
)
def test_a_long_list_of_bad_items_gets_a_short_reply_at_once(
    api, client, live, suffix, field, n, status, code
):
    import time

    run, _ = live
    before = snapshot(client, run)
    method = "PUT" if suffix == "/tasks" else "POST"
    raw = json.dumps({field: [1] * n}).encode()
    t0 = time.perf_counter()
    resp = _send(
        api, method, f"/v1/runs/{run}{suffix}", raw=raw, headers={"content-type": "application/json"}
    )
    seconds = time.perf_counter() - t0
    assert resp.status_code == status, resp.text[:500]
    assert len(resp.content) < SHORT_REPLY_BYTES, len(resp.content)
    detail = resp.json()["detail"]
    assert detail["code"] == code
    if code == "invalid":
        # The first few errors and a count: n items each bad, or one error for the whole list.
        assert len(detail["errors"]) <= 5 and detail["error_count"] in (1, n)
        assert detail["error_count"] == (n if n <= 10_000 else 1)
    else:
        assert detail["count"] == n
    assert seconds < 2.0, seconds
    assert snapshot(client, run) == before


def test_a_repeated_key_is_refused_before_the_route_reads_the_body(api, live):
    """The refusal names the key and is a 400 (the body is no valid request whatever the route
    makes of it); a body that is not JSON at all still gets the route's own 422."""
    run, _ = live
    headers = {"content-type": "application/json"}
    resp = _send(api, "POST", f"/v1/runs/{run}/finish", raw=b'{"version": 0, "version": 0}', headers=headers)
    assert resp.status_code == 400 and "'version'" in resp.json()["detail"]["message"]
    resp = _send(api, "POST", f"/v1/runs/{run}/finish", raw=b'{"version": ', headers=headers)
    assert resp.status_code == 422


def test_nothing_is_kept_in_memory_per_unknown_run(tracker_http):
    """Dispatches to runs that do not exist are 404s and leave no lock or stream hint behind (a lock
    per run name was made before the run was checked: 20,000 distinct unknown runs grew the tracker
    by 6 MB). The app in this process, whose store's state this reads."""
    store = tracker_http.app.state.store
    locks, streams = len(store._locks), len(store._streams)
    body = {"worker_id": "w", "policy_version": 0, "max_requests": 1}
    for i in range(200):
        resp = _send(tracker_http, "POST", f"/v1/runs/nope-{i}/dispatch", body)
        assert resp.status_code == 404
    assert len(store._locks) == locks and len(store._streams) == streams


@pytest.mark.parametrize("name", [".", ".."])
def test_a_run_named_as_a_path_step_is_refused_at_creation(tracker_http, redis_server, name):
    """PUT /v1/runs/{run} with "." or ".." (percent-encoded, so the client does not resolve it):
    422, and no such run is registered."""
    import redis

    encoded = name.replace(".", "%2E")
    resp = tracker_http.put(f"/v1/runs/{encoded}", json={"recipe": "spo"})
    assert resp.status_code == 422, resp.text
    assert name in resp.json()["detail"]["message"]
    runs = redis.Redis.from_url(redis_server.url, decode_responses=True).smembers("spopp:runs")
    assert name not in runs
