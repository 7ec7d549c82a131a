"""Property-based fuzzing of every route of every service, over real HTTP: never a 5xx.

Each service runs for real: the tracker as a process on its own redis-server (with a bearer token),
the learner's intake, a replica's, the evaluator's and the launcher's apps from the factories those
services serve, under the service shell's ThreadedServer with their whole middleware stack (the
replica's and the evaluator's on stand-ins for the worker and the follower: their apps read only
a few attributes of them). Hypothesis sends, to every route:

  (a) arbitrary JSON documents (None, booleans, integers with huge ones, floats with bare NaN and
      Infinity tokens, strings with escaped lone surrogates, lists, objects), with the token or
      without it;
  (b) mutations of a valid body: a field replaced by a value of another type, removed, an extra
      field, a list one past its cap;
  (c) raw bytes: anything, invalid UTF-8, truncated JSON, arrays nested past the recursion limit,
      under several content types;
  (d) odd path parameters (.., %2F, very long, unicode) and odd methods.

Every answer: below 500; a 4xx is JSON in the API's error shape {"detail": {"code", "message"}}
and short (< 4 KB, never an echo of the input); the service answers /healthz afterwards; a /v1
route answers 401 to anyone without the token, whatever the body. At the tracker, a refused call
leaves the run as it was (GET /v1/runs/{run} before and after).

Examples, derandomized (the same every run, no example database): per service and kind below
(EXAMPLES); about 1,200 requests in all, some 20-30 s on two busy cores.
"""

from __future__ import annotations

import json
import math
import types
import typing
from types import SimpleNamespace
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from services.evaluator.follow import health_app as evaluator_app
from services.evaluator.metrics import EvaluatorMetrics
from services.launch.metrics import LaunchMetrics
from services.learner.ingest import IntakeLimits, TrajectoryBuffer, ingest_app
from services.learner.metrics import LearnerMetrics
from services.rollout.metrics import RolloutMetrics
from services.rollout.serve import health_app as replica_app
from services.shell.middleware import repeated_key
from services.shell.server import ThreadedServer
from services.tracker.embedded import EmbeddedRedis
from spopp.api import tracker_api as api
from spopp.api.client import TrackerClient
from spopp.api.trajectory import INTAKE, INTAKE_BATCH, Trajectory, TrajectoryBatch
from tools.tracker_process import TrackerProcess

TOKEN = "fuzz-token-for-tests-0123456789abc"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_ERROR_BYTES = 4096
LEARNER_MAX_BODY = 4 * 1024 * 1024  # room for a token list one past its cap (2^20 + 1 ids)

# Examples per (service, kind): (a) JSON, (b) mutations, (c) raw bytes, (d) paths and methods.
EXAMPLES = {
    "tracker": {"json": 150, "mutation": 250, "raw": 100, "path": 120},
    "learner": {"json": 80, "mutation": 150, "raw": 60, "path": 40},
    "health": {"json": 40, "raw": 40, "path": 60},  # replica, evaluator and launcher together
}


def fuzz(n: int):
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# -- what every answer must be -----------------------------------------------------------------
def check(r: httpx.Response, what: object = "") -> None:
    where = f"{r.request.method} {str(r.request.url)[:200]} {str(what)[:300]!r}"
    assert r.status_code < 500, f"{where}: {r.status_code} {r.text[:500]}"
    if r.status_code >= 400 and r.request.method != "HEAD":  # a HEAD's answer has no body
        assert r.headers.get("content-type", "").startswith("application/json"), f"{where}: {r.headers}"
        assert len(r.content) < MAX_ERROR_BYTES, f"{where}: a {len(r.content)}-byte error reply"
        detail = r.json()["detail"]
        assert isinstance(detail, dict), f"{where}: {r.text[:300]}"
        assert isinstance(detail.get("code"), str) and isinstance(detail.get("message"), str), detail


# -- (a) arbitrary JSON ------------------------------------------------------------------------
class Raw(str):
    """A JSON token written as it is (integers past Python's 4300 digits, floats past a double)."""


def encode(doc) -> bytes:
    def enc(x) -> str:
        if isinstance(x, Raw):
            return str(x)
        if isinstance(x, dict):
            return "{" + ",".join(json.dumps(k) + ":" + enc(v) for k, v in x.items()) + "}"
        if isinstance(x, list):
            return "[" + ",".join(enc(v) for v in x) + "]"
        return json.dumps(x)  # NaN, Infinity, -Infinity as bare tokens; surrogates escaped

    return enc(doc).encode()


TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)  # surrogates included
HUGE = st.sampled_from(
    [Raw("9" * 5000), Raw("-" + "1" * 4400), Raw("1e400"), Raw("-1e400"), Raw("1e-400"), Raw("2" * 400)]
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=2**53, max_value=2**200),
    HUGE,
    st.floats(allow_nan=True, allow_infinity=True),
    TEXT,
)
DOCS = st.recursive(
    SCALARS,
    lambda kids: st.one_of(st.lists(kids, max_size=6), st.dictionaries(TEXT, kids, max_size=6)),
    max_leaves=30,
)


# -- (b) mutations of a valid body -------------------------------------------------------------
def _list_cap(field) -> int | None:
    return next((m.max_length for m in field.metadata if getattr(m, "max_length", None)), None)


def _inner(annotation) -> list:
    """The models and list items an annotation holds: list[X] -> X, X | None -> X, Annotated."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _inner(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [x for a in typing.get_args(annotation) for x in _inner(a)]
    if origin in (list, dict):
        return [("item", typing.get_args(annotation)[-1])]
    return [annotation]


def containers(model: type[BaseModel], prefix: tuple = ()) -> dict[tuple, int | None]:
    """Every list and dict field of a request model, nested models' too ({path: its max_length});
    a list's items are at path + (0,)."""
    out = {}
    for name, field in model.model_fields.items():
        path = prefix + (name,)
        for kind in _inner(field.annotation):
            if isinstance(kind, tuple):
                out[path] = _list_cap(field)
                for sub in _inner(kind[1]):
                    if isinstance(sub, type) and issubclass(sub, BaseModel):
                        out.update(containers(sub, path + (0,)))
            elif isinstance(kind, type) and issubclass(kind, BaseModel):
                out.update(containers(kind, path))
    return out


def paths(doc, prefix=()) -> list[tuple]:
    out = []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += [prefix + (k,)] + paths(v, prefix + (k,))
    elif isinstance(doc, list) and doc:
        out += [prefix + (0,)] + paths(doc[0], prefix + (0,))
    return out


def _get(doc, path):
    for p in path:
        doc = doc[p]
    return doc


WRONG = st.one_of(
    st.sampled_from([None, True, False, "x", "0.5", "1", 1.0, 0.5, -1, 2**63, 10**30, [], {}, [1], {"a": 1}]),
    st.sampled_from([Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("9" * 5000), Raw("1e400")]),
    st.text(max_size=3).map(lambda s: s * 1000),
    DOCS,
)
EXTRA_KEYS = st.one_of(TEXT, st.sampled_from(["k" * 100_000, "x" * 300, "__proto__", ""]))


@st.composite
def mutated(draw, body: dict, caps: dict[tuple, int | None]):
    doc = json.loads(json.dumps(body))
    path = draw(st.sampled_from(paths(doc)))
    parent, key = _get(doc, path[:-1]), path[-1]
    ops = ["replace", "remove", "extra"] + (["extend"] if caps.get(path) else [])
    op = draw(st.sampled_from(ops))
    if op == "replace":
        parent[key] = draw(WRONG)
    elif op == "remove":
        del parent[key]
    elif op == "extra":
        target = parent if isinstance(parent, dict) else doc
        target[draw(EXTRA_KEYS)] = draw(WRONG)
    else:  # a list (or dict) one past its cap: refused on its length, before its items
        value, n = parent[key], caps[path] + 1
        if isinstance(value, dict):
            parent[key] = Raw(json.dumps({f"k{i}": 1.0 for i in range(n)}))
        else:  # written once as a token: 2^20 + 1 ids are encoded in C, not item by item
            parent[key] = Raw("[" + ",".join([json.dumps(value[0] if value else 0)] * n) + "]")
    return op, path, doc


# -- (c) raw bytes -----------------------------------------------------------------------------
def raw_bodies(valid: bytes):
    return st.one_of(
        st.binary(max_size=200),
        st.integers(0, max(0, len(valid) - 1)).map(lambda n: valid[:n]),  # truncated JSON
        st.integers(0, max(0, len(valid) - 1)).map(lambda n: valid[:n] + b"\xff\xfe\xc3" + valid[n:]),
        st.sampled_from([b"[" * 100_000, b"[" * 50_000 + b"]" * 50_000, b'{"a":' * 20_000, b"", b"null"]),
        st.sampled_from(
            [b'"\\ud800"', b'{"\\ud800": 1}', b"\xed\xa0\x80", b"\x00" * 10, b"NaN", b"-Infinity"]
        ),
    )


CONTENT_TYPES = st.sampled_from(
    ["application/json", None, "text/plain", "application/problem+json", "application/x-www-form-urlencoded"]
)


def send(http: httpx.Client, method, path, body: bytes | None, ctype="application/json", auth=True):
    headers = dict(AUTH) if auth else {}
    if ctype is not None and body is not None:
        headers["content-type"] = ctype
    return http.request(method, path, content=body, headers=headers)


# -- (d) odd path parameters -------------------------------------------------------------------
ODD_IDS = st.one_of(
    st.sampled_from(
        [
            "..",
            ".",
            "%2E%2E",
            "%2e",
            "%2F",
            "a%2Fb",
            "a%2F..%2Fb",
            "%00",
            "%25",
            "a%20b",
            "%3F",
            "%23",
            "x" * 257,
            "x" * 3000,
            "%C3%A9t%C3%A9",
            "%F0%9F%98%80",
            "%ED%A0%80",
            "%FF",
            "-",
            "@",
            "a:b",
        ]
    ),
    st.text(st.characters(codec="utf-8"), min_size=1, max_size=300).map(lambda s: quote(s, safe="")),
)
# Methods the server's HTTP parser takes (uvicorn's httptools refuses a made-up token such as FOO
# itself, with a plain-text 400, before any app sees it); PROPFIND is one no route knows.
METHODS = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "PROPFIND"])


# -- the tracker -------------------------------------------------------------------------------
RUN = "fuzz-run"
TASKS = [{"task_id": f"q{i}", "alpha0": 1.0 + i, "beta0": 2.0} for i in range(6)]


@pytest.fixture(scope="module")
def tracker_fz(tmp_path_factory):
    """A tracker process with a token on a redis-server of its own (runs made by fuzzed PUTs stay
    here), a spopp run with tasks and three live leases; answers (url, the ids the bodies use)."""
    with EmbeddedRedis(tmp_path_factory.mktemp("fuzz-redis"), appendonly=False) as redis:
        proc = TrackerProcess(redis.url, env={"SPOPP_API_TOKEN": TOKEN})
        try:
            with TrackerClient(proc.url, token=TOKEN) as c:
                c.put_run(RUN, {"recipe": "spopp", "base_snapshot": "s0"})
                c.put_tasks(RUN, TASKS)
                leases = c.dispatch(RUN, "w", 0, 3).requests
            yield proc.url, [lease.request_id for lease in leases]
        finally:
            proc.stop()


def tracker_routes(request_ids: list[str]) -> list[tuple[str, str, dict | None, type | None]]:
    """(method, path, a valid body, its model): every route of the tracker."""
    rid = request_ids[0]
    return [
        ("PUT", "/v1/runs/{run}", {"recipe": "spopp", "retention": 0.9, "max_staleness": 0}, api.RunConfig),
        ("GET", "/v1/runs/{run}", None, None),
        ("POST", "/v1/runs/{run}/finish", {"version": 0, "reason": "max_updates"}, api.FinishBody),
        ("POST", "/v1/runs/{run}/reopen", {"version": 0}, api.ReopenBody),
        ("POST", "/v1/runs/{run}/budget", {"max_updates": 8}, api.BudgetBody),
        (
            "PUT",
            "/v1/runs/{run}/tasks",
            {
                "tasks": [
                    {"task_id": "q0", "alpha0": 1.0, "beta0": 2.0},
                    {"task_id": "n1", "outcomes": [0, 1]},
                ]
            },
            api.PutTasks,
        ),
        ("GET", "/v1/runs/{run}/tasks/{task_id}", None, None),
        (
            "POST",
            "/v1/runs/{run}/dispatch",
            {"worker_id": "w", "policy_version": 0, "max_requests": 1, "idempotency_key": "k1"},
            api.DispatchBody,
        ),
        (
            "POST",
            "/v1/runs/{run}/outcomes",
            {"outcomes": [{"request_id": rid, "reward": 1.0}]},
            api.OutcomesBody,
        ),
        ("POST", "/v1/runs/{run}/requests/{request_id}/renew", None, None),
        ("POST", "/v1/runs/{run}/requests/{request_id}/release", None, None),
        ("POST", "/v1/runs/{run}/requests/lookup", {"request_ids": request_ids}, api.LookupBody),
        ("POST", "/v1/runs/{run}/values", {"task_ids": ["q0", "q1"]}, api.ValuesBody),
        (
            "POST",
            "/v1/runs/{run}/consume",
            {"update_id": "u1", "items": [{"task_id": "q0", "reward": 1.0, "drift": 0.1}]},
            api.ConsumeBody,
        ),
        ("POST", "/v1/runs/{run}/policy", {"version": 1, "snapshot": "s1"}, api.PolicyBody),
        ("GET", "/v1/runs/{run}/policy", None, None),
        ("GET", "/v1/runs/{run}/export", None, None),
        ("POST", "/v1/runs/{run}/workers/{worker_id}", {"trajectories": 1, "episodes": 1}, api.HeartbeatBody),
        ("POST", "/v1/runs/{run}/workers/{worker_id}/release", None, None),
        ("GET", "/healthz", None, None),
        ("GET", "/readyz", None, None),
        ("GET", "/metrics", None, None),
    ]


def fill(path: str, **ids) -> str:
    for k, v in ids.items():
        path = path.replace("{" + k + "}", v)
    return path


# A fuzzed call may not change the fixture run's policy clock or finish it (its valid bodies
# would): those two routes get a run of their own, so every other route keeps a live run to hit.
SIDE_RUN = "fuzz-side"


def tracker_ids(template: str, request_ids: list[str]) -> dict[str, str]:
    side = template.endswith(("/finish", "/reopen", "/budget", "/policy")) or template == "/v1/runs/{run}"
    return {
        "run": SIDE_RUN if side else RUN,
        "task_id": "q1",
        "request_id": request_ids[-1],
        "worker_id": "w",
    }


def tracker_path(template: str, request_ids: list[str]) -> str:
    return fill(template, **tracker_ids(template, request_ids))


def run_state(http: httpx.Client, run: str) -> dict:
    r = http.get(f"/v1/runs/{run}", headers=AUTH)
    return r.json() if r.status_code == 200 else {"status": r.status_code}


@pytest.fixture(scope="module")
def tracker_fz_http(tracker_fz):
    url, request_ids = tracker_fz
    with httpx.Client(base_url=url, timeout=30) as http:
        http.put(f"/v1/runs/{SIDE_RUN}", json={"recipe": "spopp"}, headers=AUTH).raise_for_status()
        yield http, request_ids
        assert http.get("/healthz").status_code == 200
        assert http.get("/readyz").status_code == 200


def _routes_strategy(routes, with_body=False):
    chosen = [r for r in routes if r[2] is not None] if with_body else routes
    return st.sampled_from(chosen)


@pytest.mark.process
def test_tracker_arbitrary_json(tracker_fz_http):
    http, ids = tracker_fz_http
    routes = tracker_routes(ids)

    @fuzz(EXAMPLES["tracker"]["json"])
    @given(route=_routes_strategy(routes), doc=DOCS, auth=st.booleans())
    def case(route, doc, auth):
        method, template, _, _ = route
        path = tracker_path(template, ids)
        r = send(http, method, path, encode(doc), auth=auth)
        check(r, doc)
        if not auth and path.startswith("/v1/"):
            assert r.status_code == 401  # whatever the body: the token is asked for first

    case()
    assert http.get("/healthz").status_code == 200


@pytest.mark.process
def test_tracker_mutated_bodies_leave_the_run_as_it_was(tracker_fz_http):
    http, ids = tracker_fz_http
    routes = tracker_routes(ids)

    @fuzz(EXAMPLES["tracker"]["mutation"])
    @given(data=st.data(), route=_routes_strategy(routes, with_body=True))
    def case(data, route):
        method, template, body, model = route
        op, where, doc = data.draw(mutated(body, containers(model)))
        path = tracker_path(template, ids)
        run = path.split("/")[3]
        before = run_state(http, run)
        r = send(http, method, path, encode(doc))
        check(r, (op, where))
        if 400 <= r.status_code < 500:
            assert run_state(http, run) == before, (op, where, r.text[:300])
        if op == "extend":  # a list past its cap is refused whatever its items
            assert r.status_code in (413, 422), (where, r.status_code)

    case()
    assert http.get("/healthz").status_code == 200


@pytest.mark.process
def test_tracker_raw_bytes(tracker_fz_http):
    http, ids = tracker_fz_http
    routes = tracker_routes(ids)

    @fuzz(EXAMPLES["tracker"]["raw"])
    @given(data=st.data(), route=_routes_strategy(routes, with_body=True), ctype=CONTENT_TYPES)
    def case(data, route, ctype):
        method, template, body, _ = route
        raw = data.draw(raw_bodies(json.dumps(body).encode()))
        path = tracker_path(template, ids)
        before = run_state(http, RUN)
        r = send(http, method, path, raw, ctype=ctype)
        check(r, raw[:100])
        if r.status_code >= 400:
            assert run_state(http, RUN) == before

    case()
    assert http.get("/healthz").status_code == 200


@pytest.mark.process
def test_tracker_odd_path_parameters_and_methods(tracker_fz_http):
    http, ids = tracker_fz_http
    routes = tracker_routes(ids)

    @fuzz(EXAMPLES["tracker"]["path"])
    @given(
        route=_routes_strategy(routes),
        odd=ODD_IDS,
        slot=st.sampled_from(["run", "task_id", "request_id", "worker_id"]),
        method=METHODS,
    )
    def case(route, odd, slot, method):
        _, template, body, _ = route
        path = fill(template, **{**tracker_ids(template, ids), slot: odd})
        before = run_state(http, RUN)
        r = send(http, method, path, None if body is None else encode(body))
        check(r, path)
        if r.status_code >= 400:
            assert run_state(http, RUN) == before

    case()
    # Made-up methods are counted as "other": no caller adds a series per method it invents.
    metrics = http.get("/metrics").text
    assert 'method="PROPFIND"' not in metrics and 'method="other"' in metrics
    assert http.get("/healthz").status_code == 200


# -- the learner's intake ----------------------------------------------------------------------
def traj(i: int, **change) -> dict:
    body = dict(
        run="r",
        request_id=f"q{i}",
        task_id=f"t{i % 5}",
        policy_version=0,
        token_ids=[1, 2, 3, 4],
        action_mask=[0, 0, 1, 1],
        rollout_logprobs=[0.0, 0.0, -0.5, -0.25],
        token_versions=[0, 0, 0, 1],
        reward=1.0,
        value=0.5,
        advantage=0.5,
        num_turns=1,
        finish_reason="done",
        timings={"generate": 0.5},
    )
    return {**body, **change}


@pytest.fixture(scope="module")
def learner_http():
    """The intake as the learner's rank 0 serves it (ingest_app with a token and the limits of a
    small model), on a buffer that takes many: an accepted fuzzed body only fills it."""
    buffer = TrajectoryBuffer("r", capacity=100_000)
    limits = IntakeLimits(vocab_size=1000, max_tokens=2048, recipe="spopp")
    app = ingest_app(buffer, LEARNER_MAX_BODY, token=TOKEN, limits=limits, metrics=LearnerMetrics())
    with ThreadedServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        yield http, buffer
        assert http.get("/healthz").status_code == 200


LEARNER_ROUTES = [
    ("POST", INTAKE, traj(0), Trajectory),
    ("POST", INTAKE_BATCH, {"trajectories": [traj(1), traj(2)]}, TrajectoryBatch),
    ("GET", "/healthz", None, None),
    ("GET", "/readyz", None, None),
    ("GET", "/metrics", None, None),
]


@pytest.mark.process
def test_learner_intake_arbitrary_json(learner_http):
    http, buffer = learner_http

    @fuzz(EXAMPLES["learner"]["json"])
    @given(route=st.sampled_from(LEARNER_ROUTES), doc=DOCS, auth=st.booleans())
    def case(route, doc, auth):
        method, path, _, _ = route
        before = len(buffer)
        r = send(http, method, path, encode(doc), auth=auth)
        check(r, doc)
        if not auth and path.startswith("/v1/"):
            assert r.status_code == 401
        if r.status_code >= 400:
            assert len(buffer) == before

    case()


@pytest.mark.process
def test_learner_intake_mutated_bodies(learner_http):
    http, buffer = learner_http
    bodies = [r for r in LEARNER_ROUTES if r[2] is not None]

    @fuzz(EXAMPLES["learner"]["mutation"])
    @given(data=st.data(), route=st.sampled_from(bodies))
    def case(data, route):
        method, path, body, model = route
        op, where, doc = data.draw(mutated(body, containers(model)))
        before = len(buffer)
        r = send(http, method, path, encode(doc))
        check(r, (op, where))
        if r.status_code >= 400:
            assert len(buffer) == before, (op, where)
        if op == "extend":
            assert r.status_code in (413, 422), (where, r.status_code)

    case()


@pytest.mark.process
def test_learner_intake_raw_bytes_and_paths(learner_http):
    http, buffer = learner_http

    @fuzz(EXAMPLES["learner"]["raw"])
    @given(data=st.data(), route=st.sampled_from(LEARNER_ROUTES[:2]), ctype=CONTENT_TYPES)
    def raw(data, route, ctype):
        method, path, body, _ = route
        before = len(buffer)
        r = send(http, method, path, data.draw(raw_bodies(json.dumps(body).encode())), ctype=ctype)
        check(r)
        if r.status_code >= 400:
            assert len(buffer) == before

    @fuzz(EXAMPLES["learner"]["path"])
    @given(
        odd=ODD_IDS, method=METHODS, where=st.sampled_from(["/v1/trajectories/", "/v1/", "/", "/healthz/"])
    )
    def paths_(odd, method, where):
        check(send(http, method, where + odd, encode(traj(9))), where + odd)

    raw()
    paths_()


# -- a replica's, the evaluator's and the launcher's /healthz and /metrics ---------------------
@pytest.fixture(scope="module")
def health_servers():
    """The three apps from the factories their services serve: the replica's health_app on a
    stand-in worker, the evaluator's on a stand-in follower (both read only these attributes),
    the launcher's LaunchMetrics app."""
    worker = SimpleNamespace(
        s=SimpleNamespace(worker_id="rollout-0"),
        engine=SimpleNamespace(device_name="cpu"),
        version=0,
        inflight={},
        metrics=RolloutMetrics(),
        agent_sessions=None,
    )
    follower = SimpleNamespace(health=lambda: {"status": "ok", "run": "r"}, metrics=EvaluatorMetrics())
    apps = {
        "replica": replica_app(worker),
        "evaluator": evaluator_app(follower),
        "launcher": LaunchMetrics({"rollout-0": 2}).app(),
    }
    servers = {name: ThreadedServer(app).start() for name, app in apps.items()}
    clients = {name: httpx.Client(base_url=s.url, timeout=30) for name, s in servers.items()}
    try:
        yield clients
        for http in clients.values():
            assert http.get("/healthz").status_code == 200
            assert http.get("/metrics").status_code == 200
    finally:
        for name in servers:
            clients[name].close()
            servers[name].stop()


HEALTH_PATHS = ["/healthz", "/readyz", "/metrics"]


@pytest.mark.process
def test_health_apps_arbitrary_json_and_raw_bytes(health_servers):
    names = sorted(health_servers)

    @fuzz(EXAMPLES["health"]["json"])
    @given(name=st.sampled_from(names), path=st.sampled_from(HEALTH_PATHS), method=METHODS, doc=DOCS)
    def json_(name, path, method, doc):
        check(send(health_servers[name], method, path, encode(doc)), (name, doc))

    @fuzz(EXAMPLES["health"]["raw"])
    @given(
        name=st.sampled_from(names),
        path=st.sampled_from(HEALTH_PATHS),
        method=METHODS,
        body=raw_bodies(b'{"status": "ok"}'),
        ctype=CONTENT_TYPES,
    )
    def raw(name, path, method, body, ctype):
        check(send(health_servers[name], method, path, body, ctype=ctype), (name, body[:100]))

    json_()
    raw()


@pytest.mark.process
def test_health_apps_odd_paths(health_servers):
    names = sorted(health_servers)

    @fuzz(EXAMPLES["health"]["path"])
    @given(
        name=st.sampled_from(names),
        odd=ODD_IDS,
        method=METHODS,
        where=st.sampled_from(["/", "/healthz/", "/v1/"]),
    )
    def case(name, odd, method, where):
        check(send(health_servers[name], method, where + odd, None), (name, where + odd))

    case()
    for name, http in health_servers.items():
        for path in ("/docs", "/openapi.json", "/nope"):  # no API, no API docs
            r = http.get(path)
            assert r.status_code == 404 and r.json()["detail"]["code"] == "not_found", (name, path)
        r = http.post("/metrics", content=b"x" * (1 << 20))
        assert r.status_code == 413 and r.json()["detail"]["code"] == "body_too_large", name


# -- every list on the wire is capped ----------------------------------------------------------
REQUEST_MODELS = [
    api.RunConfig,
    api.FinishBody,
    api.ReopenBody,
    api.HeartbeatBody,
    api.PutTasks,
    api.DispatchBody,
    api.OutcomesBody,
    api.LookupBody,
    api.ValuesBody,
    api.ConsumeBody,
    api.PolicyBody,
    Trajectory,
    TrajectoryBatch,
]


@pytest.mark.parametrize("model", REQUEST_MODELS, ids=lambda m: m.__name__)
def test_every_request_model_is_strict_and_caps_every_list(model):
    """The audit's rule, checked: strict types and no unknown fields on every body any service
    takes, and a max_length on every list and dict (pydantic checks it before the items)."""
    assert model.model_config.get("strict") is True and model.model_config.get("extra") == "forbid"
    for path, cap in containers(model).items():
        assert cap is not None, f"{model.__name__}.{'.'.join(map(str, path))} has no max_length"


# -- focused regressions of what the fuzzing found ---------------------------------------------
def test_deeply_nested_json_is_no_server_error():
    """'[' * 100,000 (200 KB, inside every body limit) raised RecursionError in the repeated-key
    check, a 500 at the tracker and the learner; now the parser's refusal answers it (400)."""
    assert repeated_key(b"[" * 100_000) is None
    assert repeated_key(b"[" * 50_000 + b"]" * 50_000) is None
    assert repeated_key(b'[{"a": 1, "a": 2}]') == "a"
    buffer = TrajectoryBuffer("r", capacity=4)
    with ThreadedServer(ingest_app(buffer, 1 << 20, token=TOKEN)) as server:
        for body in (b"[" * 100_000, b'{"run": ' * 30_000, b"[" * 5000 + b"1" + b"]" * 5000):
            r = httpx.post(
                server.url + INTAKE, content=body, headers={**AUTH, "content-type": "application/json"}
            )
            assert r.status_code == 400, r.text
            assert r.json()["detail"] == {
                "code": "bad_request",
                "message": "There was an error parsing the body",
            }
        assert httpx.get(server.url + "/healthz").status_code == 200 and len(buffer) == 0


def test_deeply_nested_json_at_the_tracker(api, make_run):
    """The same at the tracker (its app in this process, on the session's Redis)."""
    run = make_run()
    for body in (b"[" * 100_000, b'{"outcomes": ' + b"[" * 50_000):
        r = api.post(f"/v1/runs/{run}/outcomes", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["detail"]["code"] == "bad_request", r.text


def test_an_unknown_field_with_a_long_name_gets_a_short_reply(api, make_run):
    """An extra key of 100 KB came back twice per error (its name as the field, and in the
    message): field names are cut like messages."""
    buffer = TrajectoryBuffer("r", capacity=4)
    with ThreadedServer(ingest_app(buffer, 1 << 20)) as server:
        body = {**traj(0), **{("k" * 100_000) + str(i): 1 for i in range(5)}}
        r = httpx.post(server.url + INTAKE, json=body)
        assert r.status_code == 422 and len(r.content) < 2048, len(r.content)
        detail = r.json()["detail"]
        assert detail["error_count"] == 5 and detail["errors"][0]["field"].endswith("...")
        assert detail["errors"][0]["type"] == "extra_forbidden"
    r = api.put(f"/v1/runs/{make_run()}", json={"recipe": "spopp", "k" * 100_000: 1})
    assert r.status_code == 422 and len(r.content) < 1024, len(r.content)


def test_fastapi_refusals_answer_the_api_error_shape():
    """404, 405 and an unparsable body (FastAPI's own answers) were {"detail": "Not Found"} at the
    learner and the health apps: now {"detail": {"code", "message"}} as at the tracker."""
    buffer = TrajectoryBuffer("r", capacity=4)
    with ThreadedServer(ingest_app(buffer, 1 << 20)) as server:
        cases = [
            ("GET", "/nope", None, 404, "not_found"),
            ("GET", INTAKE, None, 405, "method_not_allowed"),
            ("POST", INTAKE, b'{"run": ' + b"9" * 5000 + b"}", 400, "bad_request"),  # past 4300 digits
            ("POST", INTAKE, b'{"run": "r"' + b"\xff}", 400, "bad_request"),  # not UTF-8
            ("POST", INTAKE, b'{"run": ', 422, "invalid"),  # truncated: the JSON decode error
        ]
        for method, path, body, status, code in cases:
            r = httpx.request(
                method, server.url + path, content=body, headers={"content-type": "application/json"}
            )
            assert r.status_code == status and r.json()["detail"]["code"] == code, (path, r.text)
        assert "allow" in {k.lower() for k in httpx.get(server.url + INTAKE).headers}


def test_nan_and_infinity_in_timings_are_refused():
    t = traj(0)
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError):
            Trajectory(**{**t, "timings": {"generate": bad}})
    with pytest.raises(ValueError):
        Trajectory(**{**t, "timings": {"x" * 65: 1.0}})
