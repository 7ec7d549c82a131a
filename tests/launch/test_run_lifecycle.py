"""A run that ends, and who did what: the tracker's finish and per-worker accounting, and every
service that reacts to a finished run.

Tracker: POST /finish (and /reopen) over real HTTP on a real Redis; dispatch and publish refused
on a finished run while outcomes, releases and renewals of earlier leases still land; each
worker's leases, outcomes, heartbeat counts and last sighting, in GET /v1/runs/{run} and in
/metrics; the bound on workers per run. Processes (the real CLI): a replica on the tiny model
exits 0 when its run finishes mid-run and leaves its counts at the tracker; the evaluator scores
up to the final version and exits; the learner on a finished run exits 0 before loading anything.
"""

from __future__ import annotations

import re
import time
from datetime import datetime

import httpx
import pytest
from procs import cli, learner_config, running
from service_procs import REPLICA_TASKS, evaluator_args, publish, recorded, replica

from runtime.tasks import generate_arithmetic_tasks, write_jsonl
from spopp.api.client import RunFinished, TrackerClient, TrackerError
from spopp.machine.net import free_port
from tools.sink import LearnerSink
from tools.tracker_process import TrackerProcess

pytestmark = pytest.mark.process  # starts processes: the process tier (tests/conftest.py)

TASKS = [{"task_id": f"q{i}", "alpha0": 1.0, "beta0": 1.0} for i in range(6)]


@pytest.fixture(scope="module")
def held_out(tmp_path_factory):
    path = tmp_path_factory.mktemp("lifecycle") / "held_out.jsonl"
    write_jsonl(generate_arithmetic_tasks(4, seed=123), path)
    return path


def _when(stamp: str) -> float:
    assert stamp.endswith("Z"), stamp
    return datetime.fromisoformat(stamp).timestamp()


def _error(call) -> TrackerError:
    with pytest.raises(TrackerError) as err:
        call()
    return err.value


# -- finish ------------------------------------------------------------------------------------
def test_finish_marks_the_run_finished_once(tracker, client, make_run):
    run = make_run(tasks=TASKS, base_snapshot="s0")
    client.publish(run, 1, "s1")
    fresh = client.get_run(run)
    assert (fresh.status, fresh.finished_at, fresh.final_version, fresh.finish_reason) == (
        "running", None, None, None,
    )  # fmt: skip
    before = time.time()
    done = client.finish(run, 1)
    assert (done.status, done.final_version, done.finish_reason) == ("finished", 1, "max_updates")
    assert abs(_when(done.finished_at) - before) < 5
    assert client.get_run(run) == done
    # A repeat at the same version is a no-op: same time, same (first) reason.
    r = httpx.post(f"{tracker.url}/v1/runs/{run}/finish", json={"version": 1, "reason": "again"})
    assert r.status_code == 200 and r.json()["finished_at"] == done.finished_at
    assert r.json()["finish_reason"] == "max_updates"
    # Another version: 409 naming the current one; the finish stands.
    err = _error(lambda: client.finish(run, 2))
    assert (err.status, err.code, err.detail["policy_version"]) == (409, "version_mismatch", 1)
    assert client.get_run(run) == done


def test_finish_another_version_or_an_unknown_run(tracker, client, make_run):
    run = make_run(tasks=TASKS)
    client.publish(run, 1, "s1")
    err = _error(lambda: client.finish(run, 0, reason="stale learner"))
    assert (err.status, err.code, err.detail["policy_version"]) == (409, "version_mismatch", 1)
    assert client.get_run(run).status == "running"
    r = httpx.post(f"{tracker.url}/v1/runs/no-such-run/finish", json={"version": 0})
    assert r.status_code == 404 and r.json()["detail"]["code"] == "unknown_run"
    # The reason is kept as given.
    assert client.finish(run, 1, reason="budget: 40 updates").finish_reason == "budget: 40 updates"


def test_a_finished_run_refuses_dispatch_at_any_version_and_new_policies(tracker, client, make_run):
    run = make_run(tasks=TASKS, base_snapshot="s0")
    client.publish(run, 1, "s1")
    client.publish(run, 2, "s2")
    client.finish(run, 2)
    for version in (2, 0, 7):  # current, stale and unknown versions alike
        r = httpx.post(
            f"{tracker.url}/v1/runs/{run}/dispatch",
            json={"worker_id": "w", "policy_version": version, "max_requests": 2},
        )
        assert r.status_code == 409, r.text
        detail = r.json()["detail"]
        assert detail["code"] == "run_finished" and detail["policy_version"] == 2
        assert detail["message"] == f"run {run} finished at version 2: no new leases"
    with pytest.raises(RunFinished) as err:
        client.dispatch(run, "w", 1, 1)
    assert err.value.policy_version == 2 and err.value.status == 409
    with pytest.raises(RunFinished) as err:
        client.publish(run, 3, "s3")
    assert err.value.policy_version == 2
    assert "no new policy versions" in err.value.detail["message"]
    # Announcing the final version again (a learner resumed after its announcement) is harmless.
    assert client.publish(run, 2, "s2").version == 2
    got = client.get_run(run)
    assert (got.policy_version, got.counts.dispatches, got.counts.in_flight) == (2, 0, 0)
    assert got.workers == {}  # a refused dispatch leaves no trace


def test_leases_from_before_the_finish_still_report_release_and_renew(client, make_run):
    run = make_run(tasks=TASKS)
    leases = client.dispatch(run, "w", 0, 3).requests
    assert len(leases) == 3
    client.finish(run, 0)
    a, b, c = leases
    before = client.get_task(run, a.task_id)
    result = client.outcomes(run, [(a.request_id, 1.0)])[0]
    assert result.advantage == pytest.approx(1.0 - a.value)
    after = client.get_task(run, a.task_id)
    assert after.outcomes == before.outcomes + 1 and after.alpha == pytest.approx(before.alpha + 1.0)
    assert client.release(run, b.request_id).state == "released"
    assert client.renew(run, c.request_id).state == "leased"
    counts = client.get_run(run).counts
    assert (counts.outcomes, counts.releases, counts.in_flight) == (1, 1, 1)
    stats = client.get_run(run).workers["w"]
    assert (stats.leases, stats.outcomes) == (3, 1)


def test_reopen_undoes_a_finish(client, make_run):
    run = make_run(tasks=TASKS)
    client.finish(run, 0)
    err = _error(lambda: client.reopen(run, 1))
    assert (err.status, err.code) == (409, "version_mismatch")
    again = client.reopen(run, 0)
    assert (again.status, again.final_version, again.finished_at) == ("running", None, None)
    assert len(client.dispatch(run, "w", 0, 2).requests) == 2
    assert client.reopen(run, 0).status == "running"  # a no-op on a running run


def test_a_runs_budget_is_fixed_at_creation_and_changed_only_by_budget(client, make_run):
    """max_updates is part of the run's config: PUT again with another is a conflict; /budget changes
    it (a run created without one gets one), never under the run's policy version; the config then
    compares equal."""
    run = make_run(tasks=TASKS, max_updates=6)
    assert client.get_run(run).config.max_updates == 6
    err = _error(lambda: client.put_run(run, {"recipe": "spopp", "max_updates": 30}))
    assert (err.status, err.code) == (409, "run_conflict") and err.detail["config"]["max_updates"] == 6
    assert client.set_budget(run, 30).config.max_updates == 30
    assert client.put_run(run, {"recipe": "spopp", "max_updates": 30}).config.max_updates == 30  # same: 200
    assert client.set_budget(run, 30).config.max_updates == 30  # the same budget: a no-op
    for version in (1, 2, 3):
        client.publish(run, version, f"s{version}")
    assert client.set_budget(run, 3).config.max_updates == 3  # lower, but not under version 3
    err = _error(lambda: client.set_budget(run, 2))
    assert (err.status, err.code) == (409, "budget_below_version") and err.detail["policy_version"] == 3
    assert "would end before where it is" in str(err) and client.get_run(run).config.max_updates == 3
    unbounded = run + "-unbounded"
    assert client.put_run(unbounded, {"recipe": "spopp"}).config.max_updates is None
    assert client.set_budget(unbounded, 4).config.max_updates == 4
    err = _error(lambda: client.set_budget("no-such-run", 4))
    assert (err.status, err.code) == (404, "unknown_run")


# -- who did what -----------------------------------------------------------------------------
def test_per_worker_counts(client, make_run):
    run = make_run(tasks=TASKS)
    one = client.dispatch(run, "w1", 0, 3).requests
    two = client.dispatch(run, "w2", 0, 2).requests
    assert (len(one), len(two)) == (3, 2)
    seen_before = client.get_run(run).workers["w1"].last_seen
    time.sleep(0.01)
    report = [(one[0].request_id, 1.0), (one[1].request_id, 0.0), (two[0].request_id, 1.0)]
    client.outcomes(run, report)
    client.outcomes(run, report)  # an idempotent repeat: counted once
    client.outcomes(run, [(one[0].request_id, 1.0), (one[0].request_id, 1.0)])  # twice in one call
    client.release(run, two[1].request_id)
    # Idle again: the never-leased task, the three reported and the released one.
    assert len(client.dispatch(run, "w2", 0, 4).requests) == 4
    workers = client.get_run(run).workers
    assert sorted(workers) == ["w1", "w2"]
    w1, w2 = workers["w1"], workers["w2"]
    assert (w1.leases, w1.outcomes, w1.trajectories, w1.episodes) == (3, 2, 0, 0)
    assert (w2.leases, w2.outcomes, w2.trajectories, w2.episodes) == (6, 1, 0, 0)
    assert _when(w1.last_seen) > _when(seen_before)  # the outcomes of its requests count as a sighting
    assert client.get_run(run).counts.dispatches == 9


def test_heartbeat_counts_are_monotone(client, make_run):
    run = make_run(tasks=TASKS)
    beat = client.heartbeat(run, "w1", 5, 7)
    assert (beat.worker_id, beat.trajectories, beat.episodes, beat.run_status) == ("w1", 5, 7, "running")
    assert (beat.leases, beat.outcomes) == (0, 0)
    first = _when(beat.last_seen)
    time.sleep(0.01)
    late = client.heartbeat(run, "w1", 3, 9)  # reordered: an older trajectory count arrives late
    assert (late.trajectories, late.episodes) == (5, 9)
    assert _when(late.last_seen) > first
    restarted = client.heartbeat(run, "w1", 0, 0)  # the same worker id, counting again from 0
    assert (restarted.trajectories, restarted.episodes) == (5, 9)
    assert client.heartbeat(run, "w1", 6, 9).trajectories == 6
    stats = client.get_run(run).workers["w1"]
    assert (stats.trajectories, stats.episodes) == (6, 9)
    client.finish(run, 0)
    assert client.heartbeat(run, "w1", 8, 10).run_status == "finished"  # the last one lands too
    assert client.get_run(run).workers["w1"].trajectories == 8
    r = httpx.post(
        f"{client.http.base_url}/v1/runs/nope-run/workers/w1", json={"trajectories": 1, "episodes": 1}
    )
    assert r.status_code == 404 and r.json()["detail"]["code"] == "unknown_run"


def test_a_run_keeps_stats_of_a_bounded_number_of_workers(redis_server, run_name):
    tracker = TrackerProcess(redis_server.url, env={"SPOPP_TRACKER_MAX_WORKERS_PER_RUN": "2"})
    try:
        with TrackerClient(tracker.url) as c:
            c.put_run(run_name, {"recipe": "spopp"})
            c.put_tasks(run_name, TASKS)
            c.heartbeat(run_name, "w1", 1, 1)
            assert len(c.dispatch(run_name, "w2", 0, 1).requests) == 1
            for call in (
                lambda: c.heartbeat(run_name, "w3", 1, 1),
                lambda: c.dispatch(run_name, "w3", 0, 1),
            ):
                err = _error(call)
                assert (err.status, err.code, err.detail["max_workers"]) == (409, "too_many_workers", 2)
                assert "at most 2 workers" in err.detail["message"]
            got = c.get_run(run_name)
            assert sorted(got.workers) == ["w1", "w2"] and got.counts.dispatches == 1
            # Known workers go on.
            assert len(c.dispatch(run_name, "w1", 0, 2).requests) == 2
            assert c.heartbeat(run_name, "w2", 4, 4).trajectories == 4
    finally:
        tracker.stop()


def _samples(text: str, name: str) -> dict[tuple[str, str], float]:
    out = {}
    for line in text.splitlines():
        m = re.fullmatch(name + r'\{run="([^"]+)",worker="([^"]+)"\} (\S+)', line)
        if m:
            out[m.group(1), m.group(2)] = float(m.group(3))
    return out


def test_metrics_carry_each_workers_counts(tracker, client, make_run, redis_server):
    run = make_run(tasks=TASKS)
    one = client.dispatch(run, "w1", 0, 2).requests
    client.dispatch(run, "w2", 0, 3)
    client.outcomes(run, [(one[0].request_id, 1.0)])
    client.heartbeat(run, "w1", 11, 12)
    # A second tracker process on the same Redis reports the same: the counts are read from Redis.
    other = TrackerProcess(redis_server.url)
    try:
        texts = [httpx.get(url + "/metrics").text for url in (tracker.url, other.url)]
    finally:
        other.stop()
    for text in texts:
        expect = {
            "spopp_tracker_worker_leases_total": {"w1": 2, "w2": 3},
            "spopp_tracker_worker_outcomes_total": {"w1": 1, "w2": 0},
            "spopp_tracker_worker_trajectories_total": {"w1": 11, "w2": 0},
            "spopp_tracker_worker_episodes_total": {"w1": 12, "w2": 0},
        }
        for name, values in expect.items():
            got = {w: v for (r, w), v in _samples(text, name).items() if r == run}
            assert got == values, name
        seen = {w: v for (r, w), v in _samples(text, "spopp_tracker_worker_last_seen_timestamp_seconds").items() if r == run}  # fmt: skip
        workers = client.get_run(run).workers
        assert seen == {w: pytest.approx(_when(s.last_seen)) for w, s in workers.items()}
        assert all(abs(v - time.time()) < 30 for v in seen.values())


# -- the services ---------------------------------------------------------------------------------
def test_a_replica_exits_0_when_its_run_finishes_and_leaves_its_counts(
    tiny_model, tracker, client, run_name, tmp_path
):
    tasks = generate_arithmetic_tasks(REPLICA_TASKS, seed=0)
    client.put_run(run_name, {"recipe": "spopp", "lease_seconds": 60, "base_snapshot": str(tiny_model)})
    client.put_tasks(run_name, [{"task_id": t.task_id, "alpha0": 1.0, "beta0": 1.0} for t in tasks])
    with LearnerSink(run_name) as sink:
        log_path = tmp_path / "replica.log"
        with replica(tiny_model, tracker, sink, run_name, free_port(), log_path) as proc:
            # Mid-run: a periodic heartbeat has told the tracker of accepted trajectories.
            deadline = time.monotonic() + 180
            while (w := client.get_run(run_name).workers.get("rollout-0")) is None or w.trajectories < 2:
                assert time.monotonic() < deadline and proc.poll() is None, "no heartbeat with counts"
                time.sleep(0.5)
            assert len(sink.trajectories()) >= w.trajectories
            client.finish(run_name, 0)
            assert proc.wait(60) == 0
        accepted = len(sink.trajectories())
    text = " ".join(log_path.read_text().split())
    assert f"run {run_name} is finished (version 0): replica rollout-0 exits" in text
    # Its lifetime line, once: what `make demo-real` reads the replica's tokens/s from.
    assert (
        len(re.findall(r"replica rollout-0 generated \d+ episodes, \d+ generated tokens in \d+ s \(", text))
        == 1
    )
    got = client.get_run(run_name)
    assert got.counts.in_flight == 0  # every lease it held went back
    stats = got.workers["rollout-0"]
    # Its last heartbeat: exactly what the learner (the sink) accepted from it.
    assert stats.trajectories == accepted >= 2
    assert stats.episodes >= stats.trajectories and stats.outcomes >= stats.trajectories
    assert stats.leases == got.counts.dispatches == stats.outcomes + got.counts.releases

    # Started on a finished run, a replica exits 0 at once, leasing nothing.
    with replica(tiny_model, tracker, sink, run_name, free_port(), tmp_path / "again.log") as proc:
        assert proc.wait(120) == 0
    assert "is finished (version 0): replica rollout-0 exits" in (tmp_path / "again.log").read_text()
    assert client.get_run(run_name).counts.dispatches == got.counts.dispatches


def test_the_evaluator_scores_up_to_the_final_version_then_exits(
    tracker, client, make_run, tiny_model, held_out, tmp_path
):
    """every=2, no until_version: the run finishes at version 3, which is scored although it is
    not a multiple of 2; restarted, the evaluator finds it recorded and exits at once."""
    run = make_run()
    root, out = tmp_path / "snapshots", tmp_path / "eval"
    root.mkdir()
    for v in (1, 2):
        publish(client, run, root, tiny_model, v)
    base = ("--model", str(tiny_model), "--snapshots", str(root), "--every", "2")
    args, _ = evaluator_args(tracker, run, held_out, out, *base)
    with running(args, tmp_path / "first.log") as proc:
        deadline = time.monotonic() + 90
        while 2 not in [x["policy_version"] for x in recorded(out)]:
            assert time.monotonic() < deadline and proc.poll() is None, "version 2 was not scored"
            time.sleep(0.1)
        publish(client, run, root, tiny_model, 3)
        client.finish(run, 3)
        assert proc.wait(90) == 0
    lines = recorded(out)
    assert [x["policy_version"] for x in lines] == [0, 2, 3]
    assert not any("skipped" in x for x in lines)
    assert (
        f"run {run} is finished at version 3: every due version is scored"
        in (tmp_path / "first.log").read_text()
    )
    t0 = time.monotonic()
    with running(args, tmp_path / "second.log") as proc:
        assert proc.wait(60) == 0
    assert recorded(out) == lines
    second = (tmp_path / "second.log").read_text()
    assert f"run {run} is finished at version 3 and every due version up to it is recorded" in second
    assert "held-out tasks" not in second  # its engine never started
    print(f"restarted evaluator on a finished run: {time.monotonic() - t0:.1f} s")


def test_a_learner_on_a_finished_run_exits_0_before_loading_anything(
    tracker, client, make_run, tiny_model, tmp_path
):
    run = make_run(base_snapshot=str(tiny_model))
    client.finish(run, 0)
    config, port = learner_config(tmp_path, tracker.url, tiny_model, run, max_updates=3)
    for extra in ((), ("--resume",), ("--nproc", "2")):
        log_path = tmp_path / f"learner{'-'.join(extra)}.log"
        t0 = time.monotonic()
        with running(cli("learner", "run", "--config", str(config), *extra), log_path) as proc:
            assert proc.wait(120) == 0
        took = time.monotonic() - t0
        text = log_path.read_text()
        assert f"run {run} is finished at version 0: nothing to train" in text
        assert "learner intake on" not in text and "torch.distributed" not in text
        for folder in ("snapshots", "ckpt", "logs"):  # nothing written: no relaunch, no model
            assert not (tmp_path / folder).exists(), folder
        print(f"learner {extra} on a finished run: {took:.1f} s")
        assert took < 60
    assert client.get_run(run).policy_version == 0
