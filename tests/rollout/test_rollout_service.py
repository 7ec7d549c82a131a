"""A real tracker + Redis + one rollout replica (the real CLI) on the tiny model, against a learner sink.

Checks the whole loop: trajectories arrive tagged with their version; a new policy makes the
replica drain, reload and tag later trajectories with the new version (whose log-probs are the
new weights'); a replica killed mid-episode loses nothing at the tracker: its leases expire.
"""

import signal
import time

import httpx
import pytest
import torch
from service_procs import REPLICA_TASKS as N_TASKS
from service_procs import replica
from transformers import AutoModelForCausalLM

from runtime.tasks import generate_arithmetic_tasks
from spopp.machine.net import free_port
from spopp.machine.wait import wait_until
from tools.sink import LearnerSink
from tools.tiny_model import perturb_weights

pytestmark = pytest.mark.process  # starts processes: the process tier (tests/conftest.py)


def _logprobs(model_dir, traj):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([traj.token_ids])).logits[0], -1)
    return [
        float(logp[i - 1, traj.token_ids[i]]) for i in range(1, len(traj.token_ids)) if traj.action_mask[i]
    ]


def _renewals(tracker):
    text = httpx.get(tracker.url + "/metrics").text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("spopp_tracker_requests_total") and "/renew" in line and 'status="200"' in line
    )


def _metric(url, name):
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_replica_drains_reloads_and_its_leases_come_back(tiny_model, tracker, client, run_name, tmp_path):
    tasks = generate_arithmetic_tasks(N_TASKS, seed=0)
    client.put_run(run_name, {"recipe": "spopp", "lease_seconds": 3, "base_snapshot": str(tiny_model)})
    client.put_tasks(run_name, [{"task_id": t.task_id, "alpha0": 1.0, "beta0": 1.0} for t in tasks])
    port = free_port()
    replica_url = f"http://127.0.0.1:{port}"
    with LearnerSink(run_name) as sink:
        renews_before = _renewals(tracker)
        # Renew leases every 0.05 s (the floor; 1.7% of their 3 s): episodes of the tiny model take
        # 0.1 s and more, so renewals happen whatever the load, and long ones keep their leases.
        fast_renew = {"SPOPP_ROLLOUT_RENEW_FRACTION": "0.017"}
        with replica(
            tiny_model, tracker, sink, run_name, port, tmp_path / "replica.log", env_extra=fast_renew
        ) as proc:
            first = sink.wait_for(6, timeout=180, version=0, proc=proc)
            assert {t.task_id for t in first} <= {t.task_id for t in tasks}
            assert all(t.run == run_name and t.value is not None for t in first)
            # A new policy: different weights in a snapshot folder on "shared storage".
            snap = perturb_weights(tiny_model, tmp_path / "snapshots" / "v000001", scale=0.5, seed=1)
            sink.version = 1
            client.publish(run_name, 1, f"file://{snap}")
            later = sink.wait_for(4, timeout=180, version=1, proc=proc)
            assert _renewals(tracker) > renews_before
            health = httpx.get(replica_url + "/healthz").json()
            assert health["policy_version"] == 1
            assert _metric(replica_url, "spopp_rollout_weight_reloads_total") == 1.0
            assert _metric(replica_url, "spopp_rollout_drain_seconds_count") == 1.0  # one drain, timed
            assert _metric(replica_url, "spopp_rollout_drained_episodes_total") == sink.refused_stale
            # The version-1 trajectories were sampled from the new weights, not the old ones.
            traj = later[0]
            sampled = [
                lp
                for i, (lp, m) in enumerate(zip(traj.rollout_logprobs, traj.action_mask, strict=True))
                if m and i
            ]
            new, old = _logprobs(snap, traj), _logprobs(tiny_model, traj)
            assert sampled == pytest.approx(new, abs=2e-4)
            assert new != pytest.approx(old, abs=2e-4)
            # Kill the replica while it holds leases: they expire and the tasks come back.
            # Frozen first, so that no report lands between the check and the kill.
            deadline = time.monotonic() + 60
            while True:
                proc.send_signal(signal.SIGSTOP)
                time.sleep(0.3)  # a report already on the wire lands
                if client.get_run(run_name).counts.in_flight > 0:
                    break
                proc.send_signal(signal.SIGCONT)
                assert time.monotonic() < deadline, "timed out waiting for a lease in flight"
                time.sleep(0.1)
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            assert client.get_run(run_name).counts.in_flight > 0
            time.sleep(3.5)
            counts = client.get_run(run_name).counts
            assert counts.in_flight == 0
            got = client.dispatch(run_name, "other", 1, N_TASKS).requests
            assert len(got) == N_TASKS
            assert client.get_run(run_name).counts.expirations > 0


def test_abort_drain_releases_leases_and_sigterm_stops_cleanly(
    tiny_model, tracker, client, run_name, tmp_path
):
    tasks = generate_arithmetic_tasks(N_TASKS, seed=0)
    client.put_run(run_name, {"recipe": "spopp", "lease_seconds": 60})
    client.put_tasks(run_name, [{"task_id": t.task_id, "alpha0": 1.0, "beta0": 1.0} for t in tasks])
    port, learner_port = free_port(), free_port()
    first = LearnerSink(run_name, port=learner_port)
    with replica(
        tiny_model, tracker, first, run_name, port, tmp_path / "replica.log", "--drain", "abort"
    ) as proc:
        # The replica dispatches once the learner answers; then the learner goes away: finished
        # episodes keep their trajectories and retry. (The POST leaves the episode once its
        # outcome is in, so wait for a retry itself.)
        with first:
            wait_until(lambda: client.get_run(run_name).counts.dispatches > 0, 180, "a dispatch")
        wait_until(lambda: client.get_run(run_name).counts.outcomes >= 2, 180, "outcomes")
        wait_until(
            lambda: _metric(f"http://127.0.0.1:{port}", "spopp_rollout_learner_retries_total") > 0,
            60,
            "a trajectory POST retried",
        )
        sink = LearnerSink(run_name, port=learner_port)  # the learner is back, on its port
        with sink:
            sink.wait_for(3, timeout=180, version=0, proc=proc)
            # Publish while episodes are in flight; abort releases their leases at once (long
            # leases here, so nothing comes back by expiry). Episodes are short: try a few times.
            for version in range(1, 6):
                wait_until(lambda: client.get_run(run_name).counts.in_flight > 0, 60, "a lease in flight")
                snap = perturb_weights(tiny_model, tmp_path / f"v{version:06d}", scale=0.1, seed=version)
                sink.version = version
                client.publish(run_name, version, str(snap))
                wait_until(
                    lambda v=version: (
                        httpx.get(f"http://127.0.0.1:{port}/healthz").json()["policy_version"] == v
                    ),
                    60,
                    "the reload",
                )
                if client.get_run(run_name).counts.releases > 0:
                    break
            assert client.get_run(run_name).counts.releases > 0
            assert client.get_run(run_name).counts.expirations == 0
            # SIGTERM: the replica stops dispatching, releases what it holds (abort) and exits 0.
            wait_until(lambda: client.get_run(run_name).counts.in_flight > 0, 60, "a lease in flight")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
            assert client.get_run(run_name).counts.in_flight == 0


def test_replica_with_the_wrong_task_file_stops_with_a_clear_error(
    tiny_model, tracker, client, run_name, tmp_path
):
    other = generate_arithmetic_tasks(4, seed=123)  # not what the replica generates
    client.put_run(run_name, {"recipe": "spopp"})
    client.put_tasks(run_name, [{"task_id": t.task_id, "alpha0": 1.0, "beta0": 1.0} for t in other])
    with LearnerSink(run_name) as sink:
        with replica(tiny_model, tracker, sink, run_name, free_port(), tmp_path / "replica.log") as proc:
            assert proc.wait(120) != 0
        output = " ".join((tmp_path / "replica.log").read_text().split())  # rich wraps long lines
    assert "not in this replica's tasks" in output
    assert client.get_run(run_name).counts.in_flight == 0  # what it had leased went back
