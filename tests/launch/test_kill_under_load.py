"""Every process of a run is SIGKILLed in turn under load, and the run comes through whole.

A real topology on the tiny model: Redis (external, or embedded in the tracker), the tracker, two
rollout replicas and the learner (1 process, checkpointing each publish). While it trains, a
ledger client keeps a second run busy with dispatches and outcome reports and remembers every
outcome the tracker acknowledged. At seeded random moments the tracker, Redis, one replica and
the learner are SIGKILLed, one after another, and started again (the learner with --resume; the
embedded Redis restarts by itself). Then:

- every acknowledged outcome is counted once by the tracker, in its run counts and its export;
- every policy version was published once, and the learner's logged steps are 1..N, each once;
- the replica that was never killed never exited before the run finished (it rode every outage
  out); once the learner marks the run finished, both replicas stop by themselves with code 0;
- no process the run started outlives it.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from procs import learner_config

from runtime.tasks import generate_arithmetic_tasks
from services.tracker.embedded import EmbeddedRedis
from spopp.api.client import TrackerClient
from spopp.machine.net import free_port
from spopp.machine.wait import WaitTimeout, wait_until
from spopp.settings.base import environ_without_settings

pytestmark = pytest.mark.process  # starts processes: the process tier (tests/conftest.py)

N_TASKS, UPDATES = 12, 6


class Proc:
    """A restartable child process of the test, its output appended to one log."""

    def __init__(self, name: str, args: list[str], log: Path, env: dict | None = None) -> None:
        self.name, self.args, self.log_path = name, args, log
        base = environ_without_settings()
        self.env = {**base, "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.seen: set[int] = set()  # every pid of this process and its descendants, ever

    def start(self, *extra: str) -> Proc:
        with open(self.log_path, "a") as log:
            log.write(f"\n=== start {' '.join(extra)} at {time.time():.1f}\n")
            log.flush()
            self.proc = subprocess.Popen(
                [*self.args, *extra], env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        return self

    def observe(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            top = psutil.Process(self.proc.pid)
            self.seen |= {top.pid, *(c.pid for c in top.children(recursive=True))}
        except psutil.NoSuchProcess:
            pass

    def kill(self) -> None:
        self.observe()
        self.proc.kill()
        self.proc.wait(30)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self) -> str:
        return self.log_path.read_text()[-4000:]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


class Ledger(threading.Thread):
    """Dispatches and reports outcomes on its own run through the retrying client; keeps the
    request ids the tracker acknowledged."""

    def __init__(self, url: str, run: str) -> None:
        super().__init__(daemon=True)
        self.url, self.run_name = url, run
        self.acked: dict[str, float] = {}
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        rng = random.Random(7)
        try:
            with TrackerClient(self.url, retry_seconds=120, backoff=0.05, max_backoff=1.0) as c:
                while not self.stop.is_set():
                    leases = c.dispatch(self.run_name, "ledger", 0, max_requests=4).requests
                    report = [(lease.request_id, float(rng.random() < 0.5)) for lease in leases]
                    if report:
                        for r in c.outcomes(self.run_name, report):
                            self.acked[r.request_id] = 1.0
                    time.sleep(0.05)
        except BaseException as exc:  # surfaced by the test
            self.error = exc


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
# One schedule per test run, drawn (and printed) like test_learning's seed: an external Redis
# killed beside the tracker, or the tracker's embedded one, with the kill order from the seed.
# Both were run on every test run before; one a run halves the test's minute, and over runs both
# are covered. The same kinds killed under `spopp launch`'s supervision:
# tests/launch/test_supervision_restarts.py.
def test_every_process_killed_in_turn_loses_nothing(tiny_model, tmp_path):
    seed = random.SystemRandom().randrange(1_000_000)
    redis_mode = ("external", "embedded")[seed % 2]
    print(f"seed {seed}, redis {redis_mode}")
    rng = random.Random(seed)
    tracker_port, redis_port = free_port(), free_port()
    url = f"http://127.0.0.1:{tracker_port}"
    procs: list[Proc] = []
    redis = None
    if redis_mode == "external":
        redis = EmbeddedRedis(tmp_path / "redis", port=redis_port).start()
        tracker_args = cli("tracker", "serve", "--port", str(tracker_port), "--redis-url", redis.url)
    else:
        tracker_args = cli(
            "tracker", "serve", "--port", str(tracker_port), "--data-dir", str(tmp_path / "tr")
        )
    tracker = Proc("tracker", [*tracker_args, "--log-level", "warning"], tmp_path / "tracker.log")
    procs.append(tracker.start())
    run, ledger_run = f"train-{seed}", f"ledger-{seed}"
    with TrackerClient(url, retry_seconds=60) as c:
        tasks = generate_arithmetic_tasks(N_TASKS, seed=0)
        c.put_run(run, {"recipe": "spopp", "lease_seconds": 20, "base_snapshot": str(tiny_model)})
        c.put_tasks(run, [{"task_id": t.task_id, "outcomes": [1, 0, 0, 0, 1, 0, 0, 0]} for t in tasks])
        c.put_run(ledger_run, {"recipe": "spopp", "lease_seconds": 20})
        c.put_tasks(ledger_run, [{"task_id": f"l{i}", "alpha0": 1.0, "beta0": 1.0} for i in range(64)])

    config, learner_port = learner_config(
        tmp_path, url, tiny_model, run, lr=1e-4, max_updates=UPDATES, checkpoint_every=1, updates_per_publish=1,
    )  # fmt: skip
    env = {"TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))}
    learner = Proc("learner", cli("learner", "run", "--config", str(config)), tmp_path / "learner.log", env)
    replicas = []
    for i in range(2):
        args = cli(
            "rollout", "serve", "--model", str(tiny_model), "--tracker", url, "--run", run,
            "--learner", f"http://127.0.0.1:{learner_port}", "--engine", "transformers",
            "--generated-tasks", str(N_TASKS), "--concurrency", "4", "--max-turns", "2",
            "--max-tokens-per-turn", "32", "--max-total-tokens", "900", "--port", str(free_port()),
            "--worker-id", f"rollout-{i}", "--shutdown-seconds", "5",
        )  # fmt: skip
        replicas.append(Proc(f"rollout-{i}", args, tmp_path / f"rollout-{i}.log"))
    procs += [learner.start(), *(r.start() for r in replicas)]
    ledger = Ledger(url, ledger_run)
    ledger.start()

    def pause(lo: float, hi: float) -> None:
        end = time.monotonic() + rng.uniform(lo, hi)
        while time.monotonic() < end:
            for p in procs:
                p.observe()
            time.sleep(0.2)

    def progress() -> int:
        path = tmp_path / "logs" / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.is_file() else 0

    try:
        # Wait for the first update, so the kills land on a run that is training.
        deadline = time.monotonic() + 300
        while progress() < 1:
            assert time.monotonic() < deadline, learner.tail()
            assert learner.alive(), learner.tail()
            pause(0.5, 0.5)
        kills = ["tracker", "redis", "replica", "learner"]
        for victim in kills:
            pause(2.0, 8.0)
            if victim == "tracker":
                tracker.kill()
                pause(1.0, 4.0)
                tracker.start()
            elif victim == "redis" and redis is not None:
                redis.proc.kill()
                redis.proc.wait(10)
                pause(1.0, 4.0)
                redis = EmbeddedRedis(tmp_path / "redis", port=redis_port).start()
            elif victim == "redis":  # the tracker's own redis-server: it restarts it by itself
                pidfile = tmp_path / "tr" / "redis.pid"
                deadline = time.monotonic() + 60
                while not pidfile.is_file():  # the restarted tracker's Redis may still be loading
                    assert time.monotonic() < deadline
                    pause(0.2, 0.2)
                os.kill(int(pidfile.read_text()), signal.SIGKILL)
            elif victim == "replica":
                replicas[1].kill()
                pause(1.0, 4.0)
                replicas[1].start()
            else:
                learner.kill()
                pause(1.0, 4.0)
                learner.start("--resume")

        def finished() -> bool:
            with TrackerClient(url, retry_seconds=60) as c:
                return c.get_run(run).status == "finished"

        deadline = time.monotonic() + 600
        while learner.alive():
            assert time.monotonic() < deadline, learner.tail()
            # Replica 0 exits only once the learner has marked the run finished (its last update).
            assert replicas[0].alive() or finished(), "replica 0 exited:\n" + replicas[0].tail()
            pause(0.5, 0.5)
        assert learner.proc.returncode == 0, learner.tail()
        ledger.stop.set()
        ledger.join(180)
        assert ledger.error is None, repr(ledger.error)
        # The run is finished: the replicas stop by themselves.
        for r in replicas:
            assert r.proc.wait(60) == 0, r.tail()
            assert f"run {run} is finished (version {UPDATES}): replica {r.name} exits" in " ".join(
                r.tail().split()
            )

        # Nothing acknowledged lost or doubled: the ledger run's counts and export equal it.
        with TrackerClient(url, retry_seconds=60) as c:
            counts = c.get_run(ledger_run).counts
            exported = c.export(ledger_run)
            assert counts.outcomes == len(ledger.acked), (counts, len(ledger.acked))
            assert sum(row["outcomes"] for row in exported) == len(ledger.acked)
            acked = list(ledger.acked)
            for lo in range(0, len(acked), 500):
                assert all(r.state == "reported" for r in c.lookup(ledger_run, acked[lo : lo + 500]))
            # Each version published once, the learner's steps contiguous.
            assert c.policy(run).version == UPDATES
        records = [json.loads(x) for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == list(range(1, UPDATES + 1))
        assert [r["policy_version"] for r in records] == list(range(UPDATES))
        log = learner.log_path.read_text()
        assert "already exists with other weights" not in log
        print(f"seed {seed} ({redis_mode}): {len(ledger.acked)} acknowledged outcomes through the kills")
    finally:
        ledger.stop.set()
        tracker_seen = tracker.seen
        for p in procs:
            p.observe()
            if p.alive():
                p.proc.send_signal(signal.SIGTERM)
                try:
                    p.proc.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
        if redis is not None:
            redis.stop()

    # No orphan: every process any of ours ever started is gone (the tracker's Redis included).
    # A process that was sent its last signal a moment ago may still be going: wait (bounded).
    def left() -> list[int]:
        return [pid for p in procs for pid in p.seen | tracker_seen if _alive(pid)]

    with contextlib.suppress(WaitTimeout):
        wait_until(lambda: not left(), 15, "every process to be gone")
    assert not left(), [psutil.Process(pid).cmdline() for pid in left() if _alive(pid)]
