"""`spopp scale RUN_DIR N` while `spopp launch` runs: replicas join and leave a running run.

A new replica (rollout-1) starts, reports outcomes to the tracker and trains the learner; scaled
back down, it stops (exit 0, its leases given back) and the run goes on; a bad count changes
nothing and says why. Then the last replica is stopped by someone else: that fails the run.
Real processes (tests/test_launch.py's toy run).
"""

from __future__ import annotations

import json
import signal
import subprocess

import pytest
import yaml
from procs import cli
from test_launch import _start, _wait_for, config, toy  # noqa: F401  (toy: the module's fixture)
from test_supervision_restarts import Watcher, child, no_orphans, updates

from spopp.client import TrackerClient
from spopp.settings import environ_without_settings
from spopp.wait import wait_until

pytestmark = pytest.mark.process  # starts processes: the process tier (tests/conftest.py)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        cli(*args), capture_output=True, text=True, timeout=120, env=environ_without_settings()
    )


@pytest.mark.slow
def test_replicas_join_and_leave_a_running_run(toy, tmp_path):  # noqa: F811
    path = config(toy, tmp_path, updates=1000, evaluator={"enabled": False})
    run_dir = tmp_path / "run"
    log = tmp_path / "launch.log"
    proc = _start(path, log)
    watcher = Watcher(proc.pid)
    watcher.start()
    try:
        _wait_for(log, "every process is up", proc)
        wait_until(lambda: updates(run_dir) >= 1, 120, "the first update", proc=proc)
        port = yaml.safe_load((run_dir / "config" / "tracker.yaml").read_text())["port"]
        tracker = TrackerClient(f"http://127.0.0.1:{port}")

        # Bad counts: refused by the command (nothing written) or by the launcher (nothing changes).
        r = _cli("scale", str(run_dir), "0")
        assert r.returncode == 2 and "replicas must be 1..256, got 0" in r.stderr
        assert not (run_dir / "replicas").exists()

        r = _cli("scale", str(run_dir), "2")
        assert r.returncode == 0, r.stdout + r.stderr
        assert "run spopp-s0: 2 rollout replica(s)" in r.stdout
        _wait_for(log, "started rollout-1", proc)

        def outcomes(worker: str) -> int:
            w = tracker.get_run("spopp-s0").workers.get(worker)
            return w.outcomes if w is not None else 0

        wait_until(lambda: outcomes("rollout-1") > 0, 120, "outcomes from rollout-1", proc=proc)
        (run_dir / "replicas").write_text("lots\n")
        _wait_for(
            log, "expected a whole number of replicas, got 'lots'; the run keeps its 2 replica(s)", proc
        )
        assert child(proc.pid, "rollout-1") is not None

        r = _cli("scale", str(run_dir), "1")
        assert r.returncode == 0, r.stdout + r.stderr
        _wait_for(log, "replicas 2 -> 1", proc)
        assert child(proc.pid, "rollout-1") is None
        # The run goes on without it: more updates, from rollout-0's outcomes.
        mark = updates(run_dir)
        before = outcomes("rollout-0")
        wait_until(lambda: updates(run_dir) > mark + 1, 120, "updates after the scale-down", proc=proc)
        assert outcomes("rollout-0") > before
        assert proc.poll() is None
        # A replica's exit 0 is normal only once the run is finished at the tracker (the learner
        # marks it so after its last update). Stopped by someone else (SIGTERM: it exits 0) while
        # the run goes on, it is no crash for supervision to mend: it fails the run.
        child(proc.pid, "rollout-0").send_signal(signal.SIGTERM)  # its exit code reaches only the launcher
        assert proc.wait(120) == 1, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    no_orphans(watcher)
    assert "run spopp-s0 failed: rollout-0 exited with code 0" in log.read_text()
    state = json.loads((run_dir / "run.json").read_text())
    assert state["replicas"] == 1 and state["status"] == "failed" and "restarts" not in state
    r = _cli("scale", str(run_dir), "2")
    assert r.returncode == 1 and "is failed, not running" in r.stderr
