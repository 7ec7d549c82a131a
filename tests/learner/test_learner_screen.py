"""What the intake cannot judge alone is screened before an update: a trajectory whose request the
tracker never issued for this run (or issued for another task, or never saw reported) is dropped,
logged and counted, its place in the batch goes to a later arrival, and the learner trains on.
For SPO, a task the tracker does not know is dropped the same way instead of failing the update."""

from __future__ import annotations

import json
import os

import httpx
import pytest
from learner_worker import make_batch
from procs import cli, learner_config, running

from spopp.machine.wait import wait_http, wait_until

pytestmark = pytest.mark.process  # starts processes: the process tier (tests/conftest.py)

B = 4


@pytest.mark.parametrize("recipe", ["spopp", "spo"])
def test_unissued_requests_are_dropped_and_the_learner_trains_on(
    recipe, tiny_model, tracker, client, run_name, tmp_path
):
    tasks = [f"task-{i}" for i in range(B + 3)]
    client.put_run(run_name, {"recipe": recipe, "lease_seconds": 900, "base_snapshot": str(tiny_model)})
    client.put_tasks(run_name, [{"task_id": t, "alpha0": 1.0, "beta0": 1.0} for t in tasks])
    leases = client.dispatch(run_name, "test", 0, max_requests=B + 3).requests
    reported, unreported = leases[: B + 1], leases[B + 1 :]
    results = client.outcomes(run_name, [(lease.request_id, 1.0) for lease in reported])
    trajs, _ = make_batch(tiny_model, n=B)

    def body(t, lease_like, result=None, **change):
        adv = result.advantage if result is not None and result.advantage is not None else None
        return {
            **t.model_dump(), "run": run_name, "request_id": lease_like.request_id,
            "task_id": lease_like.task_id, "policy_version": 0, "reward": 1.0,
            "value": result.value if result is not None else 0.5, "advantage": adv if recipe == "spopp" else None,
            **change,
        }  # fmt: skip

    made_up = type("L", (), {"request_id": "never-issued", "task_id": tasks[0]})
    hostile = [
        body(trajs[0], unreported[0], results[0]),  # leased, never reported
        body(trajs[1], made_up, results[0]),  # an id this run never issued
        body(trajs[2], reported[B], results[B], task_id=unreported[1].task_id),  # issued for another task
    ]
    good = [body(t, lease, r) for t, lease, r in zip(trajs, reported[:B], results[:B], strict=True)]
    config, port = learner_config(
        tmp_path, tracker.url, tiny_model, run_name, recipe=recipe, batch_size=B, mini_batches=2,
        micro_batch_size=2, max_updates=1, lr=1e-4, normalization="token" if recipe == "spopp" else "trajectory",
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/v1/trajectories"
    env = {"TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))}
    log_path = tmp_path / "learner.log"
    with running(cli("learner", "run", "--config", str(config)), log_path, env) as learner:
        wait_http(
            url.removesuffix("/v1/trajectories") + "/healthz", 180, "the learner intake", ok=None,
            interval=0.2, request_timeout=5, proc=learner,
        )  # fmt: skip
        for b in hostile + good[:1]:  # the batch fills with three of these: all but one to drop
            assert httpx.post(url, json=b).status_code == 200
        # Until the learner has screened the batch (a call to the tracker), its four places are
        # taken and a fifth arrival is refused as batch_full; the dropped ones' places open after.
        wait_until(
            lambda: log_path.read_text().count("dropped trajectory") >= len(hostile), 120,
            "the learner to drop the three it cannot train on", proc=learner,
        )  # fmt: skip
        for b in good[1:]:  # later arrivals take the dropped ones' places
            assert httpx.post(url, json=b).status_code == 200
        assert learner.wait(180) == 0
    [record] = [json.loads(x) for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert record["tokens"] == sum(t.action_tokens for t in trajs)  # exactly the good four
    log = log_path.read_text()
    assert log.count("dropped trajectory") == 3, log[-3000:]
    assert "request leased" in log and "request unknown" in log and "issued for task" in log
    assert client.policy(run_name).version == 1


def test_spo_drops_an_unknown_task_without_request_checks(tiny_model, tracker, client, run_name, tmp_path):
    client.put_run(run_name, {"recipe": "spo", "lease_seconds": 60, "base_snapshot": str(tiny_model)})
    client.put_tasks(run_name, [{"task_id": f"task-{i}", "alpha0": 1.0, "beta0": 1.0} for i in range(B)])
    trajs, _ = make_batch(tiny_model, n=B)
    config, port = learner_config(
        tmp_path, tracker.url, tiny_model, run_name, recipe="spo", batch_size=B, mini_batches=2,
        micro_batch_size=2, max_updates=1, lr=1e-4, normalization="trajectory", verify_requests=False,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/v1/trajectories"

    def body(i, task):
        return {**trajs[i].model_dump(), "run": run_name, "request_id": f"r{i}-{task}", "task_id": task,
                "policy_version": 0, "advantage": None}  # fmt: skip

    env = {"TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))}
    log_path = tmp_path / "learner.log"
    with running(cli("learner", "run", "--config", str(config)), log_path, env) as learner:
        wait_http(
            url.removesuffix("/v1/trajectories") + "/healthz", 180, "the learner intake", ok=None,
            interval=0.2, request_timeout=5, proc=learner,
        )  # fmt: skip
        assert httpx.post(url, json=body(0, "no-such-task")).status_code == 200
        for i in range(B - 1):
            assert httpx.post(url, json=body(i, f"task-{i}")).status_code == 200
        # The batch is full until the learner has screened it (its values call to the tracker).
        wait_until(
            lambda: "dropped trajectory" in log_path.read_text(), 120, "the learner to drop the unknown task",
            proc=learner,
        )  # fmt: skip
        assert httpx.post(url, json=body(B - 1, f"task-{B - 1}")).status_code == 200
        assert learner.wait(180) == 0
    assert "dropped trajectory r0-no-such-task: unknown task" in log_path.read_text()
    assert client.policy(run_name).version == 1
