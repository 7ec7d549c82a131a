"""The learner's intake over real HTTP: first B of the current version, in arrival order."""

import json
import threading

import httpx
import pytest

from services.learner.ingest import TrajectoryBuffer, ingest_app
from services.shell.server import ThreadedServer
from spopp.api.trajectory import Trajectory


def traj(i, version=0, run="r", **change):
    body = dict(
        run=run,
        request_id=f"q{i}",
        task_id=f"t{i % 5}",
        policy_version=version,
        token_ids=[1, 2, 3, 4],
        action_mask=[0, 0, 1, 1],
        rollout_logprobs=[0.0, 0.0, -0.5, -0.25],
        reward=1.0,
        value=0.5,
        advantage=0.5,
        num_turns=1,
        finish_reason="done",
    )
    return {**body, **change}


@pytest.fixture
def intake():
    buffer = TrajectoryBuffer("r", capacity=6)
    with ThreadedServer(ingest_app(buffer, max_body_bytes=64 * 1024)) as server:
        yield buffer, server.url


def post(url, body):
    return httpx.post(url + "/v1/trajectories", json=body)


def test_first_capacity_in_arrival_order_then_batch_full(intake):
    buffer, url = intake
    for i in range(6):
        assert post(url, traj(i)).json()["position"] == i
    r = post(url, traj(6))
    assert r.status_code == 409 and r.json()["detail"]["code"] == "batch_full"
    assert [t.request_id for t in buffer.take(4)] == ["q0", "q1", "q2", "q3"]
    assert [t.request_id for t in buffer.take(2)] == ["q4", "q5"]
    assert buffer.take(1, timeout=0.05) is None


def test_repeated_request_counts_once(intake):
    buffer, url = intake
    assert post(url, traj(0)).status_code == 200
    again = post(url, traj(0))
    assert again.status_code == 200 and again.json()["position"] == 0
    assert len(buffer) == 1


def test_other_version_is_409_and_advance_drops_leftovers(intake):
    buffer, url = intake
    post(url, traj(0))
    r = post(url, traj(1, version=1))
    assert r.status_code == 409 and r.json()["detail"] == {
        "code": "stale_policy",
        "message": "trajectory of policy version 1; this learner takes version 0 (max_staleness 0)",
        "policy_version": 0,
    }
    buffer.advance(1)
    assert len(buffer) == 0
    assert post(url, traj(0, version=0)).status_code == 409
    assert post(url, traj(1, version=1)).status_code == 200
    assert buffer.refused["stale"] == 2


@pytest.mark.parametrize(
    "change,field,needle",
    [
        ({"run": "other"}, None, "trains run"),
        ({"action_mask": [0, 1, 1]}, "action_mask", "one length"),
        ({"action_mask": [1, 0, 1, 1]}, "action_mask", "action_mask[0] must be 0"),
        # Strict types: the string "NaN" is no number (a bare NaN token is refused as not finite,
        # test_learner_intake_security).
        ({"rollout_logprobs": [0.0, 0.0, "NaN", -0.2]}, "rollout_logprobs.2", "valid number"),
        ({"reward": True}, "reward", "valid number"),
        ({"token_ids": [1, "2", 3, 4]}, "token_ids.1", "valid integer"),
        ({"policy_version": 0.0}, "policy_version", "valid integer"),
        ({"reward": 1.5}, "reward", "less than or equal to 1"),
        ({"token_ids": []}, "token_ids", "at least 1"),
    ],
)
def test_malformed_trajectories_are_422_and_never_enter_a_batch(intake, change, field, needle):
    buffer, url = intake
    r = post(url, traj(0, **change))
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert needle in detail["message"]
    if field:
        assert detail["code"] == "invalid" and detail["errors"][0]["field"] == field
        assert detail["message"].startswith(f"{field}: ")
    else:
        assert detail["code"] == "unknown_run"
    assert len(buffer) == 0


def test_malformed_json_and_oversized_body(intake):
    buffer, url = intake
    r = httpx.post(
        url + "/v1/trajectories", content=b'{"run": ', headers={"content-type": "application/json"}
    )
    assert r.status_code == 422
    big = traj(0, token_ids=[1] * 40_000, action_mask=[1] * 40_000, rollout_logprobs=[-1.0] * 40_000)
    r = httpx.post(
        url + "/v1/trajectories",
        content=json.dumps(big).encode(),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 413
    assert len(buffer) == 0


def test_take_waits_for_concurrent_posts(intake):
    buffer, url = intake
    got = {}
    waiter = threading.Thread(target=lambda: got.setdefault("batch", buffer.take(3, timeout=10)))
    waiter.start()
    for i in range(3):
        post(url, traj(i))
    waiter.join()
    assert [t.request_id for t in got["batch"]] == ["q0", "q1", "q2"]


def test_state_round_trips(intake):
    buffer, url = intake
    for i in range(3):
        post(url, traj(i))
    buffer.take(1)
    state = json.loads(json.dumps(buffer.state()))
    other = TrajectoryBuffer("r", capacity=6)
    other.restore(state)
    assert [t.request_id for t in other.take(2)] == ["q1", "q2"]
    # q0 was seen before the checkpoint: re-posting it counts once and queues nothing.
    assert other.add(Trajectory(**traj(0))) == 0
    assert len(other) == 0
