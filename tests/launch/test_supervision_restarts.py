"""`spopp launch` supervises its children: each kind of process SIGKILLed mid-run is restarted and
the run ends at its budget with nothing lost or doubled; a process that dies on every start spends
its restart budget and the run stops naming it; with supervision off, any death ends the run.
No process of any of these runs outlives it.

Real processes throughout: the launcher, the tracker with its embedded Redis, two transformers
replicas, the DeepSpeed learner and the evaluator on the toy model (tests/launch/test_launch.py's).
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest
from test_launch import _start, _wait_for, config, toy, updates  # noqa: F401  (toy: the module's fixture)

from spopp.machine.wait import wait_until
from tools.chaos import Descendants, check, launched_child

pytestmark = pytest.mark.process  # starts processes: the process tier (tests/conftest.py)

FAST = {"backoff_seconds": 0.5, "max_backoff_seconds": 2}


@contextlib.contextmanager
def launched(path: Path, log: Path):
    """`spopp launch path` for the block; afterwards (the block passed) no process it ever had
    below it is still running."""
    proc = _start(path, log)
    below = Descendants(proc.pid)
    below.start()
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
    left = below.gone(20)
    assert not left, [p.cmdline() for p in left]


def _frozen_holding(run_dir: Path, worker: str, process: psutil.Process) -> bool:
    """Whether the replica's /metrics shows a lease prefetched (leased, not started); if so the
    replica is stopped (SIGSTOP) at once, so that it still holds that lease when it is killed.

    A ready lease leaves the replica only by starting an episode (still held) or at a policy
    change; an episode in flight may be delivering its outcome as the metrics are read. Between
    this read and the SIGSTOP there is a millisecond, far less than an episode plus its report."""
    import yaml

    port = yaml.safe_load((run_dir / "config" / f"{worker}.yaml").read_text())["port"]
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return False  # not serving yet
    ready = [
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("spopp_rollout_prefetched ")
    ]
    if sum(ready) <= 0:
        return False
    process.send_signal(signal.SIGSTOP)
    return True


@pytest.mark.slow
def test_each_kind_killed_mid_run_is_restarted_and_the_run_ends_whole_no_orphan(toy, tmp_path):  # noqa: F811
    budget = 24
    path = config(
        toy, tmp_path, max_updates=budget, rollout={"replicas": 2}, supervision=FAST,
        learner={"checkpoint_every": 1},
    )  # fmt: skip
    run_dir = tmp_path / "run"
    log = tmp_path / "launch.log"
    killed: list[tuple[str, int]] = []
    with launched(path, log) as proc:
        _wait_for(log, "every process is up", proc)
        wait_until(lambda: updates(run_dir) >= 1, 120, "the first update", proc=proc)
        # rollout-1 holds leases when it dies, so that its restart has a previous life to give
        # back: it is stopped the moment its /metrics shows a lease ready (killed while idle, say
        # between its last delivery of a version and the next dispatch, it would have none, and
        # the check at the end could not tell).
        replica = launched_child(proc.pid, "rollout-1")
        assert replica is not None
        wait_until(
            lambda: _frozen_holding(run_dir, "rollout-1", replica), 120, "rollout-1 holding leases", proc=proc
        )
        # One of each kind at the same moment (a node's hiccup): the replica, the tracker (and with
        # it its embedded Redis), the evaluator and the learner. Training stops until the learner
        # and the tracker are back, so the run is mid-way whatever the machine's speed.
        targets = {
            name: launched_child(proc.pid, name) for name in ("rollout-1", "tracker", "evaluator", "learner")
        }
        assert None not in targets.values(), log.read_text()[-3000:]
        assert updates(run_dir) < budget
        for name, target in targets.items():
            target.kill()
            killed.append((name, target.pid))
        for name in targets:
            _wait_for(log, f"restarted {name} (pid", proc)
        # The launcher's /metrics counts them (its URL is in run.json).
        url = json.loads((run_dir / "run.json").read_text())["metrics_url"]
        scraped = httpx.get(url, timeout=10).text
        for name in targets:
            assert f'spopp_restarts_total{{process="{name}"}} 1.0' in scraped, scraped
        for name in targets:
            _wait_for(log, f"{name} is up again", proc)
        assert proc.wait(400) == 0, log.read_text()[-5000:]

    out = log.read_text()
    for victim, pid in killed:
        assert f"{victim} (pid {pid}) exited with SIGKILL; restarting it in" in out
    state = json.loads((run_dir / "run.json").read_text())
    assert state["status"] == "finished" and state["updates_done"] == budget
    assert state["restarts"] == {"rollout-1": 1, "tracker": 1, "learner": 1, "evaluator": 1}
    assert "restarts by supervision over this run: evaluator 1, learner 1, rollout-1 1, tracker 1" in out

    # Each update once, each version published once, evaluations increasing to the last; at the
    # tracker every dispatch ended exactly one way and the per-task evidence and the per-replica
    # outcomes add up to the outcomes counted: `make chaos`'s checks, on this run.
    whole = check(run_dir, budget, out)
    assert (whole["updates"], whole["lost"], whole["doubled"], whole["published_once"]) == (
        budget,
        0,
        0,
        True,
    )
    assert whole["counts"]["outcomes"] > 0 and whole["downtime_seconds"].keys() == {
        "rollout", "tracker", "evaluator", "learner"
    }  # fmt: skip
    assert set(state["workers"]) == {"rollout-0", "rollout-1"}
    # The restarted replica gave its old life's leases back at once.
    assert "gave back" in (run_dir / "logs" / "rollout-1.log").read_text()


@pytest.mark.parametrize("case", ["budget", "supervision-off", "stopped-by-someone"])
def test_a_process_that_dies_on_every_start_stops_the_run_with_its_restarts_spent_no_orphan(
    toy,  # noqa: F811
    tmp_path,
    case,
):
    """budget: rollout-0 is SIGKILLed each time it appears (as a replica that crashes at once would
    die); with a budget of 2 restarts the third death ends the run, naming the process, its deaths,
    its last exit and the last lines of its log. supervision-off: the first death does.
    stopped-by-someone: a replica's exit 0 is normal only once the run is finished at the tracker;
    stopped (SIGTERM: it exits 0) while the run goes on, it is no crash to mend: the run fails."""
    path = config(
        toy, tmp_path, max_updates=1000, evaluator={"enabled": False},
        supervision={**FAST, "max_restarts": 2, "enabled": case != "supervision-off"},
    )  # fmt: skip
    log = tmp_path / "launch.log"
    kills = 0
    with launched(path, log) as proc:
        if case == "stopped-by-someone":
            _wait_for(log, "every process is up", proc)
            # Its exit code reaches only the launcher, its parent.
            launched_child(proc.pid, "rollout-0").send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 240
        while proc.poll() is None and case != "stopped-by-someone":
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            target = launched_child(proc.pid, "rollout-0")
            if target is not None:
                try:
                    target.send_signal(signal.SIGKILL)
                    kills += 1
                    target.wait(10)
                except psutil.NoSuchProcess:
                    pass
            time.sleep(0.05)
        assert proc.wait(120) == 1, log.read_text()[-3000:]
    out = log.read_text()
    state = json.loads((tmp_path / "run" / "run.json").read_text())
    assert state["status"] == "failed"
    if case == "budget":
        assert kills == 3
        assert "run spopp-s0 failed: rollout-0 died 3 times in" in out
        assert "more than the 2 restarts that supervision allows within 600 s; its last exit: SIGKILL" in out
        assert f"the last lines of {tmp_path / 'run' / 'logs' / 'rollout-0.log'}:" in out
        assert state["restarts"] == {"rollout-0": 2}
    elif case == "supervision-off":
        assert kills == 1
        assert "run spopp-s0 failed: rollout-0 exited with code -9" in out
        assert state.get("restarts", {}) == {}
    else:
        assert "run spopp-s0 failed: rollout-0 exited with code 0" in out
        assert state.get("restarts", {}) == {}
