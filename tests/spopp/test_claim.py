"""Claims of a device or a numbered slot (spopp.machine.claim), with real processes: several claimers
started at once get distinct claims, a full pool names its holders, a SIGKILLed holder's claim goes
to its successor, a child process never keeps its parent's claim; and two real `spopp rollout
serve` processes started alike come up on distinct ports with distinct worker ids."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from procs import cli, kill_unless_reused, running

from runtime.tasks import generate_arithmetic_tasks
from services.config.evaluator import EvaluatorSettings
from services.config.rollout import RolloutSettings
from spopp.machine.claim import ClaimError, DeviceSpecError, claim, visible_devices
from spopp.machine.net import free_port, port_free
from spopp.machine.wait import http_answer, wait_until
from spopp.settings.base import SettingsError, environ_without_settings
from tools.sink import LearnerSink

# A claimer: claims as told (JSON in argv[1]), prints its claim as one JSON line, then sleeps until
# killed. With "children", it first starts a child by fork+exec and one by a bare fork, which
# outlive it; their pids are printed too.
HOLDER = r"""
import json, os, subprocess, sys, time
from pathlib import Path
from spopp.machine.claim import ClaimError, claim_process
a = json.loads(sys.argv[1])
try:
    held, port = claim_process(Path(a["dir"]), a.get("role", "rollout"), a.get("devices"),
                               port=a.get("port", 8200), wait_seconds=a.get("wait", 0.0),
                               record=a.get("record"))
except ClaimError as exc:
    print(json.dumps({"error": str(exc)}), flush=True)
    sys.exit(2)
out = {"index": held.index, "device": held.device, "worker_id": held.worker_id, "port": port,
       "pid": os.getpid(), "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}
if a.get("children"):
    out["exec_child"] = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]).pid
    pid = os.fork()
    if pid == 0:
        time.sleep(120)
        os._exit(0)
    out["fork_child"] = pid
print(json.dumps(out), flush=True)
time.sleep(600)
"""


class Holders:
    """Claimer processes of one test, killed by their pids at the end."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.extra: list = []  # psutil processes taken while alive: killed unless their pid was reused

    def start(self, directory: Path, **args) -> subprocess.Popen:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("CUDA_VISIBLE_DEVICES", None)
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, json.dumps({"dir": str(directory), **args})],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.procs.append(proc)
        return proc

    @staticmethod
    def answer(proc: subprocess.Popen) -> dict:
        line = proc.stdout.readline()
        assert line, f"the claimer exited with {proc.wait(10)} and printed nothing"
        return json.loads(line)

    def kill(self, proc: subprocess.Popen) -> None:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            proc.stdout.close()
        kill_unless_reused(self.extra)


@pytest.fixture
def holders():
    h = Holders()
    yield h
    h.close()


@pytest.mark.process
def test_four_claimers_started_at_once_get_four_distinct_slots(holders, tmp_path):
    procs = [holders.start(tmp_path, role="rollout", record=str(tmp_path / f"rec{i}.json")) for i in range(4)]
    got = [holders.answer(p) for p in procs]
    assert sorted(g["index"] for g in got) == [0, 1, 2, 3]
    assert sorted(g["worker_id"] for g in got) == ["rollout-0", "rollout-1", "rollout-2", "rollout-3"]
    assert sorted(g["port"] for g in got) == [8200, 8201, 8202, 8203]
    assert all(g["device"] is None and g["cuda"] is None for g in got)
    # Each lock file and each claim record names its live holder and port.
    for g, i in zip(got, range(4), strict=True):
        lock = json.loads((tmp_path / f"rollout-slot-{g['index']}.lock").read_text())
        assert (lock["pid"], lock["worker_id"], lock["port"]) == (g["pid"], g["worker_id"], g["port"])
        assert lock["hostname"] and lock["time"]
        rec = json.loads((tmp_path / f"rec{i}.json").read_text())
        assert (rec["pid"], rec["worker_id"], rec["port"], rec["index"]) == (
            procs[i].pid, got[i]["worker_id"], got[i]["port"], got[i]["index"],
        )  # fmt: skip
    assert not (tmp_path / "rollout-slot-4.lock").exists()  # nobody tried further than needed


@pytest.mark.process
def test_a_full_device_pool_names_its_holders_and_a_waiter_gets_the_freed_device(holders, tmp_path):
    procs = [holders.start(tmp_path, devices="0,1,2") for _ in range(3)]
    got = {}
    for p in procs:
        g = holders.answer(p)
        got[g["device"]] = (p, g)
    assert sorted(got) == ["0", "1", "2"]
    for device, (_, g) in got.items():
        assert g["worker_id"] == f"rollout-gpu{device}"
        assert g["cuda"] == device  # the process sees exactly its GPU
        assert g["port"] == 8200 + int(device)  # index = position in the pool
    fourth = holders.start(tmp_path, devices="0,1,2")
    answer = holders.answer(fourth)
    assert fourth.wait(30) == 2
    for device, (_, g) in got.items():
        assert f"device-{device}.lock: rollout-gpu{device} (pid {g['pid']}" in answer["error"]
    # A waiter gets the device of the holder that dies, and only that one.
    waiter = holders.start(tmp_path, devices="0,1,2", wait=60)
    # A negative over a window (no device frees up, so no claim): it has to take some time.
    time.sleep(0.5)
    assert waiter.poll() is None
    holders.kill(got["1"][0])
    g = holders.answer(waiter)
    assert (g["device"], g["worker_id"], g["cuda"]) == ("1", "rollout-gpu1", "1")


@pytest.mark.process
def test_a_sigkilled_holders_slot_goes_to_its_successor(holders, tmp_path):
    procs = [holders.start(tmp_path) for _ in range(3)]
    got = {holders.answer(p)["index"]: p for p in procs}
    assert sorted(got) == [0, 1, 2]
    holders.kill(got[1])
    successor = holders.answer(holders.start(tmp_path))
    assert (successor["index"], successor["worker_id"]) == (1, "rollout-1")
    after = holders.answer(holders.start(tmp_path))
    assert (after["index"], after["worker_id"]) == (3, "rollout-3")


@pytest.mark.process
def test_a_replica_and_an_evaluator_never_share_a_device(holders, tmp_path):
    replica = holders.answer(holders.start(tmp_path, role="rollout", devices="0,1"))
    evaluator = holders.answer(holders.start(tmp_path, role="evaluator", devices="0,1"))
    assert {replica["device"], evaluator["device"]} == {"0", "1"}
    assert evaluator["worker_id"] == f"evaluator-gpu{evaluator['device']}"
    late = holders.start(tmp_path, role="rollout", devices="0,1")
    assert "error" in holders.answer(late) and late.wait(30) == 2
    # Slots, unlike devices, are per role: each role numbers its own from 0.
    slots = [holders.answer(holders.start(tmp_path, role=r)) for r in ("rollout", "evaluator")]
    assert [s["worker_id"] for s in slots] == ["rollout-0", "evaluator-0"]


@pytest.mark.process
def test_no_child_keeps_the_claim_after_its_parent_dies(holders, tmp_path):
    parent = holders.start(tmp_path, children=True)
    got = holders.answer(parent)
    holders.extra += [psutil.Process(got["exec_child"]), psutil.Process(got["fork_child"])]
    holders.kill(parent)
    for pid in (got["exec_child"], got["fork_child"]):
        os.kill(pid, 0)  # both children still live
    successor = holders.answer(holders.start(tmp_path))
    assert successor["index"] == 0  # and neither holds slot 0


def test_claims_in_one_process_release_and_context_manager(tmp_path):
    with claim(tmp_path, "rollout") as first:
        second = claim(tmp_path, "rollout")  # another open file: the lock is not re-entrant
        assert (first.index, second.index) == (0, 1)
        assert json.loads(first.path.read_text())["pid"] == os.getpid()
        second.release()
        assert not second.held and second.path.read_text() == ""
        assert claim(tmp_path, "rollout").index == 1
    assert not first.held
    assert claim(tmp_path, "rollout").index == 0
    with pytest.raises(ClaimError, match="2 slots of role 'x' are held"):
        claim(tmp_path, "x", slots=2) and claim(tmp_path, "x", slots=2) and claim(tmp_path, "x", slots=2)
    waited = time.monotonic()
    with pytest.raises(ClaimError, match="after waiting 0.3 s"):
        claim(tmp_path, "x", slots=2, wait_seconds=0.3)
    assert time.monotonic() - waited >= 0.3
    for bad in ("../x", "device", "", ".hidden"):
        with pytest.raises(ClaimError):
            claim(tmp_path, bad)
    with pytest.raises(ClaimError, match="twice"):
        claim(tmp_path, "rollout", ["1", "1"])
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ClaimError, match="cannot use the claim folder"):
        claim(tmp_path / "a-file" / "claims", "rollout")


def test_visible_devices_parses_lists_and_ranges_and_rejects_bad_specs():
    assert visible_devices(None) is None
    assert visible_devices("") is None and visible_devices("  ") is None
    assert visible_devices("0,1,2") == ["0", "1", "2"]
    assert visible_devices("2-5") == ["2", "3", "4", "5"]
    assert visible_devices(" 0, 4-5 ,7") == ["0", "4", "5", "7"]
    assert visible_devices("3") == ["3"]
    for bad, why in [
        ("a", "not a GPU index"), ("1-", "not a GPU index"), ("-1", "not a GPU index"),
        ("0,,1", "not a GPU index"), ("0,", "not a GPU index"), ("1.5", "not a GPU index"),
        ("5-2", "backwards"), ("1,0-2", "more than once"), ("0-5000", "above 1023"),
    ]:  # fmt: skip
        with pytest.raises(DeviceSpecError, match=why):
            visible_devices(bad)


def _fake_nvidia_smi(folder: Path, body: str) -> None:
    folder.mkdir(exist_ok=True)
    tool = folder / "nvidia-smi"
    tool.write_text("#!/bin/sh\n" + body + "\n")
    tool.chmod(0o755)


@pytest.mark.process
def test_visible_devices_auto_asks_nvidia_smi(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    _fake_nvidia_smi(bin_dir, '[ "$1" = "--query-gpu=index" ] && [ "$2" = "--format=csv,noheader" ] '
                     '&& printf "0\\n1\\n3\\n" && exit 0; exit 7')  # fmt: skip
    monkeypatch.setenv("PATH", str(bin_dir))
    assert visible_devices("auto") == ["0", "1", "3"]
    _fake_nvidia_smi(bin_dir, 'echo "NVIDIA-SMI has failed" >&2; exit 9')
    with pytest.raises(ClaimError, match="nvidia-smi failed \\(exit 9\\): NVIDIA-SMI has failed") as failed:
        visible_devices("auto")
    assert "give the GPU indices" not in str(failed.value)  # a broken driver is not fixed by indices
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(ClaimError, match="nvidia-smi is not on PATH: give the GPU indices"):
        visible_devices("auto")


@pytest.mark.process
def test_the_launcher_counts_the_same_gpus_and_none_where_nvidia_smi_fails(tmp_path, monkeypatch):
    # One lister (spopp/machine/gpus.py) for the claim and the launcher's plan check.
    from spopp.machine.gpus import GpuListError, NoNvidiaSmi, count_gpus, list_gpus

    bin_dir = tmp_path / "bin"
    _fake_nvidia_smi(bin_dir, 'printf "0\\n1\\n3\\n"')
    monkeypatch.setenv("PATH", str(bin_dir))
    assert (list_gpus(), count_gpus()) == ([0, 1, 3], 3)
    _fake_nvidia_smi(bin_dir, 'echo "No devices were found"')
    with pytest.raises(GpuListError, match="unexpected nvidia-smi output 'No devices were found'"):
        list_gpus()
    assert count_gpus() == 0  # a CPU machine's answer: the plan check then names the missing GPU
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(NoNvidiaSmi):
        list_gpus()
    assert count_gpus() == 0


def test_claim_settings_read_from_the_environment_and_checked():
    env = {"SPOPP_ROLLOUT_CLAIM_DIR": "/claims", "SPOPP_ROLLOUT_DEVICES": "2-3",
           "SPOPP_ROLLOUT_CLAIM_PORTS": "false", "SPOPP_ROLLOUT_CLAIM_WAIT_SECONDS": "5"}  # fmt: skip
    s = RolloutSettings.resolve(env=env, flags={"run": "r", "model": "m"})
    assert (s.claim_dir, s.devices, s.claim_ports, s.claim_wait_seconds) == (
        Path("/claims"),
        "2-3",
        False,
        5.0,
    )
    assert RolloutSettings.resolve(env={}, flags={"run": "r", "model": "m"}).claim_dir is None
    with pytest.raises(SettingsError, match="devices \\(flag --devices\\).*backwards"):
        RolloutSettings.resolve(env={}, flags={"run": "r", "model": "m", "claim_dir": "/c", "devices": "3-1"})
    with pytest.raises(SettingsError, match="set claim_dir too"):
        RolloutSettings.resolve(env={}, flags={"run": "r", "model": "m", "devices": "0"})
    typed = RolloutSettings.resolve(env={}, flags={"run": "r", "model": "m", "claim_dir": "/c", "devices": 3})
    assert typed.devices == "3"  # a YAML number
    ev = EvaluatorSettings.resolve(
        env={"SPOPP_EVALUATOR_DEVICES": "auto"}, flags={"run": "r", "tasks": "t", "claim_dir": "/c"}
    )
    assert ev.devices == "auto"
    with pytest.raises(SettingsError, match="set claim_dir too"):
        EvaluatorSettings.resolve(env={}, flags={"run": "r", "tasks": "t", "devices": "1"})


@pytest.mark.process
def test_the_services_take_worker_id_port_and_gpu_from_their_claim(holders, tmp_path, monkeypatch):
    from services.evaluator.cli import _claimed as evaluator_claimed
    from services.rollout.cli import _claimed as rollout_claimed

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "unset-by-the-test")  # restored after the test
    replica = holders.answer(holders.start(tmp_path, devices="5,6"))
    assert replica["device"] == "5"
    record = tmp_path / "eval-claim.json"
    ev = EvaluatorSettings(tasks="t", run="my:run", claim_dir=tmp_path, devices="5,6", claim_record=record)
    got = evaluator_claimed(ev)
    assert got.port == 8301 and os.environ["CUDA_VISIBLE_DEVICES"] == "6"
    rec = json.loads(record.read_text())
    # The evaluator's worker id is its hold's name, whichever GPU it got.
    assert (rec["worker_id"], rec["device"], rec["index"], rec["port"]) == ("evaluator-my_run", "6", 1, 8301)
    assert json.loads((tmp_path / "device-6.lock").read_text())["worker_id"] == "evaluator-my_run"
    # A replica in a pod of its own keeps its port; without a claim the settings are as configured.
    s = rollout_claimed(
        RolloutSettings(run="r", model="m", claim_dir=tmp_path / "pods", claim_ports=False, port=9000)
    )
    assert (s.worker_id, s.port) == ("rollout-0", 9000)
    plain = RolloutSettings(
        run="r", model="m", worker_id="r-7", port=9100, claim_record=tmp_path / "plain.json"
    )
    assert rollout_claimed(plain) is plain
    assert json.loads((tmp_path / "plain.json").read_text())["worker_id"] == "r-7"
    assert not (tmp_path / "rollout-slot-0.lock").exists()


@pytest.mark.process
@pytest.mark.parametrize("command", [["rollout", "serve", "--model", "nowhere", "--run", "r"],
                                     ["evaluator", "run", "--tasks", "nowhere", "--run", "r"]])  # fmt: skip
def test_a_taken_pool_stops_the_service_with_code_2_and_no_traceback(holders, tmp_path, command):
    holder = holders.answer(holders.start(tmp_path, devices="4"))
    env = environ_without_settings()
    done = subprocess.run(
        cli(*command, "--claim-dir", str(tmp_path), "--devices", "4"),
        env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert f"Error: no free claim for '{command[0]}'" in done.stderr
    assert f"device-4.lock: rollout-gpu4 (pid {holder['pid']}" in done.stderr


@pytest.mark.process
@pytest.mark.slow
def test_two_replicas_started_alike_come_up_on_distinct_ports_and_ids(
    tiny_model, tracker, client, run_name, tmp_path
):
    tasks = generate_arithmetic_tasks(8, seed=0)
    client.put_run(run_name, {"recipe": "spopp"})
    client.put_tasks(run_name, [{"task_id": t.task_id, "alpha0": 1.0, "beta0": 1.0} for t in tasks])
    port = free_port()
    while port + 1 > 65535 or not port_free(port + 1):
        port = free_port()
    claims = tmp_path / "claims"
    with LearnerSink(run_name) as sink, contextlib.ExitStack() as stack:
        procs = []
        for i in range(2):
            args = cli(
                "rollout", "serve", "--model", str(tiny_model), "--tracker", tracker.url, "--learner", sink.url,
                "--run", run_name, "--engine", "transformers", "--env", "math-tir", "--generated-tasks", "8",
                "--concurrency", "2", "--max-turns", "2", "--max-tokens-per-turn", "16", "--port", str(port),
                "--claim-dir", str(claims), "--claim-record", str(tmp_path / f"claim{i}.json"),
            )  # fmt: skip
            procs.append(stack.enter_context(running(args, tmp_path / f"replica{i}.log")))
        health = {p: _healthz(p, procs, 240) for p in (port, port + 1)}
        assert {h["worker_id"] for h in health.values()} == {"rollout-0", "rollout-1"}
        assert health[port]["worker_id"] == "rollout-0" and health[port + 1]["worker_id"] == "rollout-1"
        records = [json.loads((tmp_path / f"claim{i}.json").read_text()) for i in range(2)]
        by_pid = {r["pid"]: r for r in records}
        assert set(by_pid) == {p.pid for p in procs}
        assert {(r["worker_id"], r["port"]) for r in records} == {
            ("rollout-0", port),
            ("rollout-1", port + 1),
        }
        logs = " ".join((tmp_path / f"replica{i}.log").read_text() for i in range(2))
        assert "worker id rollout-0" in logs and "worker id rollout-1" in logs
        # And both serve: each one's engine generates (on the port it claimed).
        for p in (port, port + 1):
            wait_until(lambda p=p: _tokens(p) > 0, 240, f"tokens from the replica on port {p}", interval=0.2)
        assert len(sink.trajectories()) >= 1


def _tokens(port: int) -> float:
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text.splitlines():
        if line.startswith("spopp_rollout_generated_tokens_total "):
            return float(line.split()[-1])
    return 0.0


def _healthz(port: int, procs, timeout: float) -> dict:
    def answer():
        for p in procs:
            assert p.poll() is None, f"a replica exited with {p.returncode}"
        return http_answer(f"http://127.0.0.1:{port}/healthz", ok=None, timeout=5)

    return wait_until(answer, timeout, f"anything healthy on port {port}", interval=0.2).json()
