"""The learner's door over real HTTP: bearer token, checks that name the field, Prometheus /metrics.

Nothing refused may reach the buffer: a hostile or broken sender interleaved with good ones must
leave exactly the good trajectories, in arrival order, and a real learner must keep training
through such a stream. The limits come from the tiny model itself (its embedding and context).
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import httpx
import pytest
from learner_worker import dist_env_restored, make_batch
from procs import cli, learner_config, running, wait_learner
from prometheus_client.parser import text_string_to_metric_families
from test_learner_ingest import traj

from services.learner.batch import collate, trainable_tokens
from services.learner.ingest import IntakeLimits, TrajectoryBuffer, ingest_app
from services.learner.metrics import LearnerMetrics
from services.shell.server import ThreadedServer
from spopp.api.trajectory import FLOAT32_MAX, Trajectory, count_action_tokens
from spopp.machine.wait import WaitTimeout, wait_until

TOKEN = "intake-token-for-tests-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_BODY = 256 * 1024


def long(n):
    return dict(token_ids=[1] * n, action_mask=[0] + [1] * (n - 1), rollout_logprobs=[0.0] + [-0.5] * (n - 1))


def start(limits, capacity=6, token=TOKEN):
    buffer, metrics = TrajectoryBuffer("r", capacity=capacity), LearnerMetrics()
    app = ingest_app(buffer, MAX_BODY, token=token, limits=limits, metrics=metrics)
    return buffer, ThreadedServer(app).start()


@pytest.fixture
def intake(model_limits):
    buffer, server = start(model_limits[0])
    yield buffer, server.url
    server.stop()


def post(url, body, headers=AUTH, **kw):
    if isinstance(body, dict):
        return httpx.post(url + "/v1/trajectories", json=body, headers=headers, **kw)
    return httpx.post(
        url + "/v1/trajectories", content=body, headers={**headers, "content-type": "application/json"}
    )


def scrape(url) -> dict:
    """/metrics as {(sample name, frozenset of labels): value}."""
    r = httpx.get(url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def refused(metrics, reason):
    return metrics[("spopp_learner_trajectories_refused_total", frozenset({("reason", reason)}))]


def gauge(metrics, name):
    return metrics[(name, frozenset())]


# -- the limits are the model's ---------------------------------------------------------------
def test_limits_are_read_from_the_model(model_limits):
    limits, config = model_limits
    assert limits.vocab_size == config.vocab_size and limits.max_tokens == config.max_position_embeddings
    assert limits.recipe == "spopp"


# -- the token -------------------------------------------------------------------------------
def test_intake_needs_the_bearer_token_health_and_metrics_do_not(intake):
    buffer, url = intake
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
        r = post(url, traj(0), headers=headers)
        assert r.status_code == 401, r.text
        assert r.json()["detail"]["code"] == "unauthorized"
        assert r.headers["www-authenticate"] == "Bearer"
    # Auth is decided before the body is parsed: a caller without the token learns nothing.
    assert post(url, b'{"run": ', headers={}).status_code == 401
    assert len(buffer) == 0 and buffer.accepted == 0
    assert httpx.get(url + "/healthz").status_code == 200
    assert refused(scrape(url), "unauthorized") == 4
    r = post(url, traj(0))
    assert r.status_code == 200 and r.json()["position"] == 0
    assert [t.request_id for t in buffer.take(1)] == ["q0"]


def test_without_a_token_the_intake_is_open(model_limits):
    buffer, server = start(model_limits[0], token=None)
    try:
        assert post(server.url, traj(0), headers={}).status_code == 200
        assert len(buffer) == 1
    finally:
        server.stop()


# -- checks at the door ----------------------------------------------------------------------
VOCAB_EDGE = "vocab"  # token id = vocabulary size, the first one past the embedding
CASES = [
    ("token past the vocabulary", VOCAB_EDGE, "token_ids"),
    ("longer than the context", long(1025), "token_ids"),
    ("action_mask[0] = 1", {"action_mask": [1, 0, 1, 1]}, "action_mask"),
    ("mask shorter than the tokens", {"action_mask": [0, 1, 1]}, "action_mask"),
    ("log-probs shorter than the tokens", {"rollout_logprobs": [0.0, -0.5, -0.25]}, "rollout_logprobs"),
    (
        "positive log-prob on an action token",
        {"rollout_logprobs": [0.0, 0.0, 0.5, -0.25]},
        "rollout_logprobs",
    ),
    # Finite float64s that float32, the learner's training dtype, holds as infinities: -1e308
    # became -inf in the loss and stopped the learner at its first update (issue 48).
    (
        "log-prob -1e308 on an action token",
        {"rollout_logprobs": [0.0, 0.0, -1e308, -0.25]},
        "rollout_logprobs",
    ),
    ("log-prob 1e308 on a prompt token", {"rollout_logprobs": [0.0, 1e308, -0.5, -0.25]}, "rollout_logprobs"),
    ("value -1e308", {"value": -1e308}, "value"),
    ("NaN reward", b"NaN", "reward"),
    ("advantage null on SPO++", {"advantage": None}, "advantage"),
    ("advantage 1.7e308", {"advantage": 1.7e308}, "advantage"),
    ("advantage below -1", {"advantage": -1.5}, "advantage"),
    ("negative token id", {"token_ids": [1, -2, 3, 4]}, "token_ids.1"),
]


@pytest.mark.parametrize("change,field", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_malformed_trajectory_is_422_naming_the_field(intake, model_limits, change, field):
    buffer, url = intake
    if change == VOCAB_EDGE:
        body = traj(0, token_ids=[1, 2, model_limits[0].vocab_size, 4])
    elif change == b"NaN":
        # JSON has no NaN, but Python's encoder (and many senders) write the literal anyway.
        body = json.dumps(traj(0)).replace('"reward": 1.0', '"reward": NaN').encode()
        assert b"NaN" in body
    else:
        body = traj(0, **change)
    r = post(url, body)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert detail["code"] == "invalid"
    assert detail["errors"][0]["field"] == field
    assert detail["message"].startswith(f"{field}: ")
    assert len(buffer) == 0 and buffer.accepted == 0
    assert refused(scrape(url), "invalid") == 1
    # The same record, repaired, is accepted: the refusal was about that field alone.
    assert post(url, traj(0)).status_code == 200


def test_a_repeated_key_is_400_and_buffers_nothing(intake):
    """{"reward": 0.0, ..., "reward": 1.0}: Python's parser would keep the last value silently, a
    sender's another; refused whole, counted as invalid, before any field is read."""
    buffer, url = intake
    body = json.dumps(traj(0)).replace('"reward": 1.0', '"reward": 0.0, "reward": 1.0').encode()
    r = post(url, body)
    assert r.status_code == 400 and r.json()["detail"]["code"] == "duplicate_key", r.text
    assert "'reward'" in r.json()["detail"]["message"]
    assert len(buffer) == 0 and buffer.accepted == 0
    assert refused(scrape(url), "invalid") == 1


def test_a_long_bad_list_gets_a_short_reply(intake):
    """Every item of a 15,000-token mask bad: the reply lists the first few errors and counts them
    all, never an echo of the list (it was one error entry per item)."""
    buffer, url = intake
    n = 15_000  # about 200 KB, under this intake's 256 KB body limit
    body = traj(0, token_ids=[1] * n, action_mask=["x"] * n, rollout_logprobs=[0.0] * n)
    r = post(url, json.dumps(body).encode())
    assert r.status_code == 422 and len(r.content) < 4096, len(r.content)
    detail = r.json()["detail"]
    assert len(detail["errors"]) <= 5 and detail["error_count"] == n
    assert detail["errors"][0]["field"] == "action_mask.0"
    assert len(buffer) == 0


def test_the_edges_themselves_are_accepted(intake, model_limits):
    buffer, url = intake
    limits = model_limits[0]
    edges = [
        traj(0, token_ids=[0, 1, 2, limits.vocab_size - 1]),
        traj(1, **long(limits.max_tokens)),
        traj(2, advantage=1.0),
        traj(3, advantage=-1.0),
        traj(4, rollout_logprobs=[0.0, -FLOAT32_MAX, -FLOAT32_MAX, -0.25]),  # float32's lowest
    ]
    for body in edges:
        assert post(url, body).status_code == 200, post(url, body).text
    assert [t.request_id for t in buffer.take(5)] == ["q0", "q1", "q2", "q3", "q4"]


def test_spo_learner_accepts_a_missing_advantage_spopp_does_not(model_limits):
    spo = IntakeLimits(model_limits[0].vocab_size, model_limits[0].max_tokens, recipe="spo")
    buffer, server = start(spo)
    try:
        r = post(server.url, traj(0, advantage=None))
        assert r.status_code == 200, r.text
        # The bound on the advantage is the record's, whatever the recipe.
        r = post(server.url, traj(1, advantage=1.7e308))
        assert r.status_code == 422 and r.json()["detail"]["errors"][0]["field"] == "advantage"
        assert [t.advantage for t in buffer.take(1)] == [None]
    finally:
        server.stop()


# -- a hostile stream ------------------------------------------------------------------------
def test_hostile_stream_leaves_exactly_the_good_ones_in_order_and_metrics_count_it(intake, model_limits):
    buffer, url = intake
    vocab = model_limits[0].vocab_size
    good = iter(range(100))
    big = traj(99, **long(30_000))  # over MAX_BODY
    stream = [
        ("good", traj(next(good)), {}),
        (401, traj(50), {"headers": {}}),
        ("good", traj(next(good)), {}),
        (401, traj(51, token_ids=[1, 2, vocab, 4]), {"headers": {"Authorization": "Bearer nope"}}),
        (422, traj(52, token_ids=[1, 2, vocab + 7, 4]), {}),
        ("good", traj(next(good)), {}),
        (409, traj(53, version=1), {}),
        (422, traj(54, run="other"), {}),
        ("good", traj(next(good)), {}),
        (422, traj(55, action_mask=[1, 1, 1, 1]), {}),
        (422, traj(56, advantage=None), {}),
        (413, big, {}),
        (422, b'{"run": ', {}),
        ("good", traj(next(good)), {}),
        ("repeat", traj(2), {}),  # a retry of an accepted one answers as before and counts once
        (422, traj(57, **long(1025)), {}),
        ("good", traj(next(good)), {}),
        (409, traj(58), {}),  # capacity 6 reached
    ]
    accepted = []
    for expect, body, kw in stream:
        r = post(url, body, **kw)
        if expect == "good":
            assert r.status_code == 200, r.text
            assert r.json()["position"] == len(accepted)
            accepted.append(body["request_id"])
        elif expect == "repeat":
            assert r.status_code == 200 and r.json()["position"] == 2
        else:
            assert r.status_code == expect, (body if isinstance(body, bytes) else body["request_id"], r.text)
    assert accepted == [f"q{i}" for i in range(6)]

    m = scrape(url)
    assert m[("spopp_learner_trajectories_accepted_total", frozenset())] == 6
    counts = {
        r: refused(m, r) for r in ("unauthorized", "invalid", "unknown_run", "stale", "full", "too_large")
    }
    assert counts == {
        "unauthorized": 2,
        "invalid": 5,
        "unknown_run": 1,
        "stale": 1,
        "full": 1,
        "too_large": 1,
    }
    assert gauge(m, "spopp_learner_buffer_trajectories") == 6
    assert gauge(m, "spopp_learner_buffer_pending") == 6
    assert gauge(m, "spopp_learner_buffer_capacity") == 6
    assert gauge(m, "spopp_learner_policy_version") == 0

    assert [t.request_id for t in buffer.take(6)] == accepted
    assert buffer.take(1, timeout=0.05) is None
    m = scrape(url)
    assert gauge(m, "spopp_learner_buffer_pending") == 0
    assert gauge(m, "spopp_learner_buffer_trajectories") == 6  # still this version's six
    buffer.advance(1)
    m = scrape(url)
    assert gauge(m, "spopp_learner_policy_version") == 1
    assert gauge(m, "spopp_learner_buffer_trajectories") == 0


# -- one definition of action tokens ---------------------------------------------------------
def test_action_tokens_are_one_count_for_normalisation_and_loss():
    t = Trajectory(**traj(0, **long(7)))
    one = collate([t], [1.0])
    assert t.action_tokens == trainable_tokens(t) == one.tokens == 6
    # A trajectory-like object that never passed validation: position 0 is ignored by all three.
    raw = SimpleNamespace(
        token_ids=[1, 2, 3, 4], action_mask=[1, 0, 1, 1], rollout_logprobs=[-0.1, 0, -0.5, -0.2]
    )
    assert count_action_tokens(raw.action_mask) == trainable_tokens(raw) == collate([raw], [1.0]).tokens == 2


# -- a real learner through the CLI ----------------------------------------------------------
def _wait_for_metrics(url: str, ready, deadline_s: float = 120) -> dict:
    seen = {}

    def got():
        seen["last"] = m = scrape(url)
        return m if ready(m) else None

    try:
        return wait_until(got, deadline_s, "the learner's metrics", interval=0.2)
    except WaitTimeout:
        raise AssertionError(f"learner metrics never got there: {seen.get('last')}") from None


@pytest.mark.process
def test_real_learner_keeps_training_through_hostile_trajectories(
    tiny_model, model_limits, tracker, client, run_name, tmp_path
):
    B = 4
    client.put_run(run_name, {"recipe": "spopp", "lease_seconds": 30, "base_snapshot": str(tiny_model)})
    config, port = learner_config(
        tmp_path, tracker.url, tiny_model, run_name, batch_size=B, mini_batches=2, micro_batch_size=2,
        max_updates=2, checkpoint_every=1, lr=1e-4, verify_requests=False,  # request ids made up here
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    trajs, _ = make_batch(tiny_model, n=B)
    vocab = model_limits[0].vocab_size

    def good(i, version):
        t = trajs[i % B]
        return {
            **t.model_dump(), "run": run_name, "request_id": f"v{version}-{i}", "policy_version": version,
            "value": 0.5, "advantage": t.reward - 0.5,
        }  # fmt: skip

    def hostile(version):
        # What an update must never see: an index past the embedding (an IndexError mid-update on
        # CPU, a device fault on GPU), positions past the context, a trained position 0, SPO++
        # without its advantage, an advantage that would swamp the batch's normalisation, a log-prob
        # that is -inf in float32 (it stopped the learner at its first update: issue 48).
        b = good(0, version)
        n = len(b["token_ids"])
        action = b["action_mask"].index(1)
        minus_inf = [-1e308 if k == action else x for k, x in enumerate(b["rollout_logprobs"])]
        return [
            (401, {**b, "request_id": "h-noauth"}, {}),
            (422, {**b, "request_id": "h-vocab", "token_ids": [vocab + 3] * n}, AUTH),
            (422, {**b, "request_id": "h-long", **long(1100)}, AUTH),
            (422, {**b, "request_id": "h-mask0", "action_mask": [1] + b["action_mask"][1:]}, AUTH),
            (422, {**b, "request_id": "h-adv", "advantage": None}, AUTH),
            (422, {**b, "request_id": "h-huge", "advantage": 1.7e308}, AUTH),
            (422, {**b, "request_id": "h-logp", "rollout_logprobs": minus_inf}, AUTH),
        ]

    def send(version):
        # Hostile and good trajectories interleave, the good ones on the last B turns, so that the
        # one completing the batch is the last request: at the last version the learner trains,
        # publishes and exits as soon as it has that one, and a request after it would find the
        # port closed (as one could on a loaded machine when the good ones went first).
        bad = hostile(version)
        for i, (status, body, headers) in enumerate(bad):
            r = httpx.post(f"{url}/v1/trajectories", json=body, headers=headers)
            assert r.status_code == status, r.text
            k = i - (len(bad) - B)
            if k >= 0:
                r = httpx.post(f"{url}/v1/trajectories", json=good(k, version), headers=AUTH)
                assert r.status_code == 200 and r.json()["position"] == k, r.text

    env = {
        "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext")),
        "SPOPP_API_TOKEN": TOKEN,
    }
    with running(cli("learner", "run", "--config", str(config)), tmp_path / "learner.log", env) as learner:
        wait_learner(url, learner)
        send(0)
        # After the first update is published and checkpointed, the learner waits for version 1.
        m = _wait_for_metrics(
            url,
            lambda m: (
                gauge(m, "spopp_learner_policy_version") == 1
                and m[("spopp_learner_checkpoint_seconds_count", frozenset())] == 1
                # observed last, after the tracker heard of the version
                and m[("spopp_learner_publish_seconds_count", frozenset())] == 1
            ),
        )
        assert m[("spopp_learner_updates_total", frozenset())] == 1
        assert m[("spopp_learner_trained_tokens_total", frozenset())] == sum(t.action_tokens for t in trajs)
        assert gauge(m, "spopp_learner_tokens_per_second") > 0
        assert m[("spopp_learner_publish_seconds_count", frozenset())] == 1
        assert m[("spopp_learner_trajectories_accepted_total", frozenset())] == B
        assert refused(m, "unauthorized") == 1 and refused(m, "invalid") == 6
        # A trajectory of the old version is drained, not trained on.
        r = httpx.post(f"{url}/v1/trajectories", json=good(0, 0), headers=AUTH)
        assert r.status_code == 409 and r.json()["detail"]["code"] == "stale_policy"
        send(1)
        assert learner.wait(180) == 0
    assert client.policy(run_name).version == 2
    records = [json.loads(x) for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["tokens"] == sum(t.action_tokens for t in trajs) for r in records)


_dist_env = pytest.fixture(dist_env_restored)


@pytest.mark.process
def test_a_learner_whose_intake_stopped_says_so_instead_of_waiting(
    tiny_model, tmp_path, tracker, make_run, _dist_env
):
    """The intake's server runs in a thread beside training. If that thread ends (an exception out
    of uvicorn's loop), clients are refused while the learner would wait for a batch forever: it
    stops at its next wait, naming the intake, and nothing was trained."""
    from services.config.learner import LearnerSettings
    from services.learner.trainer import Learner

    cfg = LearnerSettings(
        run=make_run(), tracker=tracker.url, model=tiny_model, port=0, batch_size=2, mini_batches=1,
        micro_batch_size=2, snapshots=tmp_path / "snapshots", checkpoints=tmp_path / "ckpt",
        log_dir=tmp_path / "logs",
    )  # fmt: skip
    learner = Learner(cfg)
    try:
        url = learner.serve()
        assert httpx.get(url + "/healthz", timeout=10).status_code == 200
        # End the loop, then leave the server as a crashed loop would: its thread gone and its
        # socket closed, but no stop ever asked (should_exit unset), so only the thread tells.
        learner.server.server.should_exit = True
        learner.server.thread.join(10)
        learner.server.server.should_exit = False
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/healthz", timeout=10)
        with pytest.raises(RuntimeError, match=f"intake on {url} stopped serving"):
            learner.update_once()
        assert learner.step == 0 and learner.version == 0
    finally:
        learner.close()
        if hasattr(learner.engine, "destroy"):
            learner.engine.destroy()
