"""A launched run on the GPU (GPU tier): `spopp launch` with the demo's quick setting on one CUDA
device shared by every process, and the same with LoRA adapters.

The topology is the one tried by hand on an H200 in issue 34: the tracker with its embedded Redis,
the learner on NCCL, one rollout replica and the evaluator, both with the transformers engine on
CUDA (`engine_options: {device: cuda}`), all on GPU 0 (`gpus: {learner: [0], rollout: [[0]],
evaluator: [0], share: true}`). The model is the demo's quick cold start (tools/cold_start.py,
400 supervised steps of the 332k-parameter toy model on imperfect teacher traces), trained here on
the GPU in seconds; the tasks are `make demo-quick`'s (128 training, 64 held-out toy-calc tasks);
the prior is the launcher's flat Jeffreys prior (`spopp prior` would add a minute of rollouts and
changes nothing this test looks at). Both runs start together: they share the GPU (a few hundred
MB each) and the CPUs, and the tier's time is what a GPU session is short of.

Each run must finish its budget, its held-out reward must rise, and each of its services must say
that it computes on CUDA: the learner's start-up line names its device and the NCCL process
group, the replica's and the evaluator's their engine's device (tests/rollout/test_device_report.py checks
the same lines and /healthz bodies say `cpu` on a CPU). The LoRA run must publish adapter-only
snapshots, which the replica and the evaluator swap into their CUDA engines in place.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml
from procs import cli

from spopp.machine.net import PORT_RANGE_ENV, port_range
from spopp.settings.base import environ_without_settings

pytestmark = [
    pytest.mark.process,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU tier needs a CUDA GPU"),
]

# make demo-quick's sizes (tools/demo.py QUICK) and episode budget (BUDGET).
N_TRAIN, N_HELDOUT, COLD_START_STEPS = 128, 64, 400
BUDGET = {"max_turns": 3, "max_tokens_per_turn": 32, "max_total_tokens": 128}
UPDATES = {"full": 24, "lora": 12}  # as measured by hand: 24 updates, and 12 with rank-8 adapters
EVERY, SAMPLES = 4, 4  # an evaluation every 4 versions: 64 held-out tasks x 4 samples at T = 1

# The held-out reward must rise by RISE from version 0 to the last version. Measured by hand on an
# H200 (issue 34): 0.451 -> 0.74 and 0.75 after 24 updates, 0.451 -> 0.693 after 12 with adapters,
# rises of 0.24 to 0.30. One evaluation is 256 episodes of success 0 or 1 near p = 0.45-0.75: a
# standard error of at most sqrt(0.25 / 256) = 0.031 were they independent, about 0.04 as a task's 4
# samples tend to agree; a rise is the difference of two, known to sqrt(2) x 0.04 = 0.057. 0.10 lies
# 2.5 standard errors below the smallest measured rise and 1.75 above no rise at all: a run that
# does not learn passes it about 4% of the time, and the two runs together about 0.2%.
RISE = 0.10
# Both runs together. By hand on an H200: 24 updates in about 30 s, plus the processes' start-up and
# the evaluations; 300 s is over twice what that adds up to, and keeps a hung run from eating the
# GPU session (15 minutes for the whole tier and its reruns).
LAUNCH_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict:
    """The quick demo's data and cold start, the cold start trained on the GPU."""
    from runtime.envs.toy_calc import write_toy_calc_tasks
    from tools.cold_start import train_cold_start
    from tools.toy_model import new_toy_model, save_toy_model

    root = tmp_path_factory.mktemp("launch-gpu")
    train, heldout = write_toy_calc_tasks(root / "data", seed=0, n_train=N_TRAIN, n_heldout=N_HELDOUT)
    model, tok = new_toy_model(0, max_positions=128)
    t0 = time.perf_counter()
    report = train_cold_start(model.cuda(), tok, steps=COLD_START_STEPS, seed=0, log=None)
    print(
        f"cold start on {torch.cuda.get_device_name()}: {time.perf_counter() - t0:.1f} s, loss {report['loss']:.3f}"
    )
    cold = save_toy_model(model.cpu(), tok, root / "cold-start")
    return {"root": root, "model": cold, "train": train, "heldout": heldout}


def launch_config(demo: dict, kind: str) -> Path:
    """tools/demo.py's base_config on GPU 0, with `kind` "full" or "lora" (tools/demo.py --lora 8)."""
    cuda = {"device": "cuda"}
    learner = {
        "batch_size": 32, "mini_batches": 2, "micro_batch_size": 16, "lr": 1e-4, "zero_stage": 1,
        "keep_snapshots": 2, "checkpoint_every": 1000,
    }  # fmt: skip
    if kind == "lora":
        learner.update(lora_rank=8, lora_alpha=16.0, lr=1e-3)  # tools/demo.py: LORA_LR
    cfg = {
        "run": f"gpu-{kind}", "run_dir": str(demo["root"] / "runs" / kind),
        "model": str(demo["model"]), "tasks": str(demo["train"]), "heldout": str(demo["heldout"]),
        "env": "toy-calc", "max_updates": UPDATES[kind], "progress_seconds": 10,
        "rollout": {"engine": "transformers", "engine_options": cuda, "concurrency": 32, "temperature": 1.0,
                    **BUDGET},
        "learner": learner,
        "evaluator": {"every": EVERY, "greedy": False, "samples": SAMPLES, "temperature": 1.0, "concurrency": 64,
                      "engine_options": cuda, **BUDGET},
        "gpus": {"learner": [0], "rollout": [[0]], "evaluator": [0], "share": True},
    }  # fmt: skip
    path = demo["root"] / f"launch-{kind}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def runs(demo) -> dict[str, dict]:
    """Both runs launched at once and waited for: kind -> {code, out, dir, seconds}."""
    procs, logs = {}, {}
    # Each launcher draws its ports from its own half of this machine's range: two launchers checking
    # ports at the same moment could otherwise both find the same one free.
    lo, hi = port_range()
    mid = (lo + hi) // 2
    halves = dict(zip(UPDATES, (f"{lo}-{mid}", f"{mid + 1}-{hi}"), strict=True))
    t0 = time.perf_counter()
    for kind in UPDATES:
        logs[kind] = open(demo["root"] / f"launch-{kind}.log", "w+")
        procs[kind] = subprocess.Popen(
            cli("launch", str(launch_config(demo, kind))), stdout=logs[kind], stderr=subprocess.STDOUT,
            env={**environ_without_settings(), PORT_RANGE_ENV: halves[kind]},
        )  # fmt: skip
    out = {}
    try:
        for kind, proc in procs.items():
            left = max(1.0, LAUNCH_TIMEOUT_S - (time.perf_counter() - t0))
            try:
                code = proc.wait(left)
            except subprocess.TimeoutExpired:
                code = None
            logs[kind].seek(0)
            out[kind] = {
                "code": code, "out": logs[kind].read(), "dir": demo["root"] / "runs" / kind,
                "seconds": time.perf_counter() - t0,
            }  # fmt: skip
    finally:
        for kind, proc in procs.items():
            if proc.poll() is None:
                proc.kill()  # the launcher's children die with it (a parent-death signal each)
                proc.wait(30)
            logs[kind].close()
    return out


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_run(run: dict, kind: str, gpu_report: list[str]) -> None:
    assert run["code"] == 0, f"spopp launch ({kind}) exited with {run['code']}:\n{run['out'][-6000:]}"
    d = run["dir"]
    state = json.loads((d / "run.json").read_text())
    assert state["status"] == "finished" and state["updates_done"] == UPDATES[kind], state

    # Each service on CUDA, in its own words: the start-up lines.
    logs = {name: (d / "logs" / f"{name}.log").read_text() for name in ("learner", "rollout-0", "evaluator")}
    assert "training on cuda:0, 1 rank(s), process group nccl" in logs["learner"], logs["learner"][-3000:]
    assert "engine transformers on cuda:0" in logs["rollout-0"], logs["rollout-0"][-3000:]
    assert "engine transformers on cuda:0" in logs["evaluator"], logs["evaluator"][-3000:]

    evals = _jsonl(d / "eval" / "evals.jsonl")
    versions = [e["policy_version"] for e in evals]
    assert versions == list(range(0, UPDATES[kind] + 1, EVERY)), versions
    reward = [e["eval/sampled/reward_mean"] for e in evals]
    first, last = reward[0], reward[-1]
    gpu_report.append(
        f"launch, {kind}: {UPDATES[kind]} updates, held-out reward by version {' '.join(f'{r:.3f}' for r in reward)} "
        f"(a rise of {last - first:+.3f}, asked {RISE}); {run['seconds']:.0f} s with the other run beside it; "
        "learner, replica and evaluator on cuda:0, NCCL"
    )
    print(gpu_report[-1])
    assert last - first >= RISE, reward


# The first test sets the module's fixtures up: the cold start (seconds on a GPU), both launches
# (at most LAUNCH_TIMEOUT_S) and their teardown if they hang (30 s each); the suite's 300 s is short.
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 180)
def test_a_launched_run_learns_on_cuda(runs, gpu_report):
    check_run(runs["full"], "full", gpu_report)


def test_a_launched_lora_run_swaps_adapters_on_cuda(runs, gpu_report):
    check_run(runs["lora"], "lora", gpu_report)
    d = runs["lora"]["dir"]
    last = d / "snapshots" / f"v{UPDATES['lora']:06d}"
    assert sorted(f.name for f in last.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "manifest.json",
    ]  # fmt: skip
    # Every version the replica generated with reached it as an adapter swap into its CUDA engine
    # (the evaluator's scores of versions > 0, checked above, are swaps into its own).
    replica = (d / "logs" / "rollout-0.log").read_text()
    # Versions 1 .. N-1 (update N trains on version N-1's episodes; the replica stops at version N).
    for v in range(1, UPDATES["lora"]):
        assert f"policy v{v} loaded from" in replica, f"v{v}"
