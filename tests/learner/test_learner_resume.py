"""Checkpoints and `spopp learner run --resume`: a killed learner continues bit for bit.

No rollout replica: a driver thread POSTs a fixed, pre-generated stream of trajectories (the same
for every run) for whichever policy version the tracker announces. Run A trains N updates without
interruption; run B is SIGKILLed right after its checkpoint at update 2 and resumed. On CPU the
updates are deterministic, so both end on identical weights, and B publishes every version once.

With 2 processes the SIGKILL hits torchrun (the CLI execs itself into it, keeping its pid), as an
OOM kill or `kill -9` of the learner would: its ranks, in sessions of their own, must die with it
(PR_SET_PDEATHSIG) rather than keep rank 0's intake port and train on.
"""

import contextlib
import json
import os
import re
import socket
import threading
import time
import uuid
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from procs import cli, learner_config, running
from safetensors.torch import load_file

from services.learner.checkpoint import latest_tag, load_checkpoint

pytestmark = pytest.mark.process  # starts processes: the process tier (tests/conftest.py)

B, N, KILL_AFTER = 4, 4, 2


def _stream(tokenizer, run: str, version: int) -> list[dict]:
    """The B trajectories of `version`: deterministic tokens, rewards, advantages and log-probs."""
    out = []
    for i in range(B):
        prompt = tokenizer.encode(f"Task {i}: what is {i} + {version}?", add_special_tokens=False)
        answer = tokenizer.encode(f" The answer is {i + version + (i % 2)}.", add_special_tokens=False)
        reward = float(i % 2 == 0)
        out.append(
            {
                "run": run,
                "request_id": f"r-v{version}-{i}",
                "task_id": f"task-{i}",
                "policy_version": version,
                "token_ids": prompt + answer,
                "action_mask": [0] * len(prompt) + [1] * len(answer),
                "rollout_logprobs": [0.0] * len(prompt) + [-1.0 - 0.01 * k for k in range(len(answer))],
                "reward": reward,
                "value": 0.5,
                "advantage": reward - 0.5,
                "num_turns": 1,
                "finish_reason": "stop",
            }
        )
    return out


class Driver(threading.Thread):
    """Posts the fixed stream of each version the tracker announces, below `gate` (None: all)."""

    def __init__(self, client, tokenizer, run: str, learner_url: str, gate: int | None = None):
        super().__init__(daemon=True)
        self.client, self.tokenizer, self.run_name, self.url = client, tokenizer, run, learner_url
        self.gate = gate
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=10) as http:
            while not self.stop.is_set():
                try:
                    version = self.client.policy(self.run_name).version
                except Exception:
                    time.sleep(0.2)
                    continue
                if self.gate is None or version < self.gate:
                    for t in _stream(self.tokenizer, self.run_name, version):
                        try:
                            r = http.post(f"{self.url}/v1/trajectories", json=t)
                        except httpx.TransportError:
                            break  # the learner is (re)starting: retry from the tracker's version
                        if r.status_code == 409 and r.json()["detail"]["code"] == "stale_policy":
                            break
                time.sleep(0.2)


def _config(tmp: Path, tracker, tiny_model, run: str, **extra) -> tuple[Path, int]:
    return learner_config(
        tmp, tracker.url, tiny_model, run, batch_size=B, lr=1e-3, max_updates=N, checkpoint_every=1,
        updates_per_publish=1, verify_requests=False,  # the driver makes its request ids up
        **extra,
    )  # fmt: skip


def _records(tmp: Path) -> list[dict]:
    path = tmp / "logs" / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def _weights(tmp: Path, version: int) -> dict[str, torch.Tensor]:
    folder = tmp / "snapshots" / f"v{version:06d}"
    files = sorted(folder.glob("*.safetensors"))
    assert files, f"no weights in {folder}"
    out = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def _alive(proc: psutil.Process) -> bool:
    # A killed rank whose parent is gone may linger as a zombie until init reaps it: that is dead.
    # (Its other threads may still be exiting then; for rank 0 the port check covers them.)
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _refuses(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


def test_no_checkpoint_means_none(tmp_path):
    assert load_checkpoint(None, tmp_path / "missing") is None
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest").write_text("step00000003\n")  # names a folder that is not there
    assert latest_tag(tmp_path / "ckpt") is None
    assert load_checkpoint(None, tmp_path / "ckpt") is None


# Two ranks train LoRA adapters (ZeRO 1 partitions their optimizer states): the resumed run must
# restore adapters and optimizer exactly, or the two updates after the kill would differ.
LORA = {"lora_rank": 4, "lora_alpha": 8.0, "lora_target_modules": ["q_proj", "v_proj", "down_proj"]}


@pytest.mark.slow
# Six learner legs (two runs, a kill, three resumes), each 2 ranks starting DeepSpeed: 183-255 s
# alone on 2 cores, 300 s (the suite's bound) once when the slow tier shared the cores.
@pytest.mark.timeout(600)
@pytest.mark.parametrize("nproc,lora", [(1, False), (2, True)], ids=["1proc", "2proc-lora"])
def test_killed_learner_resumes_to_identical_weights(tiny_model, tracker, client, tmp_path, nproc, lora):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    env = {"TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))}
    runs = {}
    for name in ("a", "b"):
        run = f"t-{name}-{uuid.uuid4().hex[:10]}"
        client.put_run(run, {"recipe": "spopp", "lease_seconds": 30, "base_snapshot": str(tiny_model)})
        config, port = _config(tmp_path / name, tracker, tiny_model, run, **(LORA if lora else {}))
        runs[name] = (run, config, port)

    def learner(config: Path, *extra: str) -> list[str]:
        return cli("learner", "run", "--config", str(config), "--nproc", str(nproc), *extra)

    (run_a, config_a, port_a), (run_b, config_b, port_b) = runs["a"], runs["b"]
    drive_a = Driver(client, tokenizer, run_a, f"http://127.0.0.1:{port_a}")
    drive_b = Driver(client, tokenizer, run_b, f"http://127.0.0.1:{port_b}", gate=KILL_AFTER)
    drive_a.start(), drive_b.start()
    ranks_b: list[psutil.Process] = []
    try:
        with (
            running(learner(config_a), tmp_path / "a.log", env) as learner_a,
            running(learner(config_b), tmp_path / "b1.log", env) as learner_b,
        ):
            # B: kill right after the checkpoint of update KILL_AFTER is complete (and logged).
            deadline = time.monotonic() + 240
            while not any(r["step"] == KILL_AFTER for r in _records(tmp_path / "b")):
                assert learner_b.poll() is None, "learner B exited early"
                assert time.monotonic() < deadline, "learner B did not reach the kill point"
                time.sleep(0.1)
            assert latest_tag(tmp_path / "b" / "ckpt") == f"step{KILL_AFTER:08d}"
            # The processes that train: torchrun's children, or the CLI process itself.
            top = psutil.Process(learner_b.pid)
            ranks_b = top.children() if nproc > 1 else [top]
            assert len(ranks_b) == nproc, ranks_b
            learner_b.kill()
            learner_b.wait(10)
            # Every rank of B dies with it, within seconds, and with rank 0 its intake port closes
            # (which a process's zombie main thread may still hold while its other threads exit).
            t_kill = time.monotonic()
            while any(map(_alive, ranks_b)) or not _refuses(port_b):
                assert time.monotonic() - t_kill < 10, f"B outlived the kill: {ranks_b}, port {port_b}"
                time.sleep(0.1)
            print(f"ranks of B gone {time.monotonic() - t_kill:.2f}s after the kill")
            assert client.policy(run_b).version == KILL_AFTER
            assert learner_a.wait(300) == 0
        drive_b.gate = None
        t0 = time.monotonic()
        with running(learner(config_b, "--resume"), tmp_path / "b2.log", env) as learner_b:
            assert learner_b.wait(300) == 0
        print(f"resumed leg of B: {time.monotonic() - t0:.1f}s")
    finally:
        drive_a.stop.set(), drive_b.stop.set()
        for p in ranks_b:  # a failed check above must not leave orphans behind
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()

    # Same weights, bit for bit; the tracker at N for both.
    assert client.policy(run_a).version == N and client.policy(run_b).version == N
    wa, wb = _weights(tmp_path / "a", N), _weights(tmp_path / "b", N)
    assert wa.keys() == wb.keys()
    if lora:  # adapter snapshots: the adapters alone, trained away from their start
        assert (tmp_path / "b" / "snapshots" / f"v{N:06d}" / "adapter_model.safetensors").is_file()
        assert len(wa) == 12 and all(".lora_" in k for k in wa)
        assert any(float(v.abs().max()) > 0 for k, v in wa.items() if ".lora_B." in k)
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key

    # B: every update logged once, every version published once, the second leg began at KILL_AFTER+1.
    rec_a, rec_b = _records(tmp_path / "a"), _records(tmp_path / "b")
    assert [r["step"] for r in rec_b] == list(range(1, N + 1))
    assert [r["policy_version"] for r in rec_b] == list(range(N))
    assert all("publish_s" in r and "checkpoint_s" in r for r in rec_b)
    for ra, rb in zip(rec_a, rec_b, strict=True):
        assert ra["reward_mean"] == rb["reward_mean"]
    log_b2 = (tmp_path / "b2.log").read_text()
    assert f"update {KILL_AFTER}, policy version {KILL_AFTER}" in log_b2
    ckpts = sorted(p.name for p in (tmp_path / "b" / "ckpt").iterdir() if p.is_dir())
    assert ckpts == [f"step{N - 1:08d}", f"step{N:08d}"]  # the newest two
    print("checkpoint_s:", [round(r["checkpoint_s"], 3) for r in rec_b])

    # Both runs were marked finished at N after their last update. Reopened, a learner resumed
    # from its checkpoint at max_updates marks it finished again and exits, training nothing.
    assert client.get_run(run_a).final_version == N and client.get_run(run_b).final_version == N
    client.reopen(run_a, N)
    with running(learner(config_a, "--resume"), tmp_path / "a-end.log", env) as p:
        assert p.wait(300) == 0
    assert client.get_run(run_a).final_version == N
    assert len(_records(tmp_path / "a")) == N
    assert f"run {run_a} finished at version {N} after {N} updates" in (tmp_path / "a-end.log").read_text()

    # The tracker ahead of the checkpoint (a publish the checkpoint never saw): a clear refusal.
    client.reopen(run_a, N)
    client.publish(run_a, N + 1, str((tmp_path / "a" / "snapshots" / f"v{N:06d}").resolve()))
    with running(learner(config_a, "--resume"), tmp_path / "a2.log", env) as p:
        assert p.wait(120) != 0
    out = " ".join(re.sub(r"\n(\[rank0\]: )?", " ", (tmp_path / "a2.log").read_text()).split())
    assert "ResumeError" in out and f"is at version {N + 1}" in out
    assert "versions this checkpoint never saw" in out


@pytest.mark.slow
def test_a_crash_at_any_point_of_a_publish_resumes(tiny_model, tracker, client, tmp_path):
    """Killed after the snapshot is written (not yet checkpointed), after the checkpoint (not yet
    announced) and after the announcement, the learner resumes, publishes every version once,
    logs every update once and ends on the weights of an uninterrupted run."""
    from transformers import AutoTokenizer

    from services.learner.failpoints import ENV

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    env = {"TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))}
    points = ["after_snapshot", "after_checkpoint", "after_announce"]
    runs = {}
    for name in ["reference", *points]:
        run = f"t-{name[:8]}-{uuid.uuid4().hex[:8]}"
        client.put_run(run, {"recipe": "spopp", "lease_seconds": 30, "base_snapshot": str(tiny_model)})
        config, port = _config(tmp_path / name, tracker, tiny_model, run)
        drive = Driver(client, tokenizer, run, f"http://127.0.0.1:{port}")
        drive.start()
        runs[name] = (run, config, drive)
    try:
        run, config, _ = runs["reference"]
        with running(cli("learner", "run", "--config", str(config)), tmp_path / "ref.log", env) as p:
            assert p.wait(300) == 0
        for point in points:
            run, config, _ = runs[point]
            crash = {**env, ENV: f"{point}:{KILL_AFTER}"}
            with running(
                cli("learner", "run", "--config", str(config)), tmp_path / f"{point}1.log", crash
            ) as p:
                assert p.wait(300) == -9, f"{point}: the failpoint did not fire"
            announced = client.policy(run).version
            assert announced == (KILL_AFTER if point == "after_announce" else KILL_AFTER - 1), point
            if point == "after_snapshot":  # written, never checkpointed nor announced
                assert (tmp_path / point / "snapshots" / f"v{KILL_AFTER:06d}").is_dir()
            resume = cli("learner", "run", "--config", str(config), "--resume")
            with running(resume, tmp_path / f"{point}2.log", env) as p:
                assert p.wait(300) == 0, point
    finally:
        for _, _, drive in runs.values():
            drive.stop.set()

    reference = _weights(tmp_path / "reference", N)
    for point in points:
        run, _, _ = runs[point]
        assert client.policy(run).version == N, point
        weights = _weights(tmp_path / point, N)
        assert all(torch.equal(reference[k], weights[k]) for k in reference), point
        assert [r["step"] for r in _records(tmp_path / point)] == list(range(1, N + 1)), point
    log = (tmp_path / "after_snapshot2.log").read_text()
    assert "written but never announced" in log
    assert "checkpointed before the crash" in (tmp_path / "after_checkpoint2.log").read_text()
