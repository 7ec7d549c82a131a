"""Test harness for the learner: a fixed trajectory batch, and tasks run in-process or under torchrun.

A task builds a DeepSpeed engine from the tiny model, runs one update on the job's batch and
reports what the tests compare: the update's stats, the full gradient of every mini-batch
(read before its optimizer step), the full weights afterwards, and optionally a published
snapshot. In-process tests call `run_task` directly; multi-process tests `launch` this file:

    python -m torch.distributed.run --nproc_per_node N tests/learner_worker.py JOB.json OUT_DIR

which writes OUT_DIR/rank{r}.pt per rank (weights and gradients on rank 0 only).
"""

from __future__ import annotations

import gc
import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from spopp.advantages import normalize_advantages
from spopp.api.trajectory import Trajectory
from spopp.machine.net import free_port
from tools.tiny_model import render, sample_chat

HERE = Path(__file__).resolve().parent


def make_batch(model_dir: str | Path, n: int = 8, seed: int = 0) -> tuple[list[Trajectory], list[float]]:
    """n tool-use chats of the tiny model's task, tokenized, with varied lengths and masks.

    Action tokens are the assistant messages' content (a header, tool output and user turns are
    not); some chats are cut short. Rollout log-probs are the model's own plus noise, so the
    rollout importance weights vary and some reach the cap; advantages are token-whitened rewards
    (both signs).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    trajs, rewards = [], []
    for i in range(n):
        ids: list[int] = []
        mask: list[int] = []
        for m in sample_chat(rng):
            seg = tok.encode(render([m]), add_special_tokens=False)
            header = 2  # "<|im_start|>" and the role name
            ids += seg
            mask += [0] * header + [int(m["role"] == "assistant")] * (len(seg) - header)
        if i % 3 == 1:  # cut inside the last assistant message
            cut = max(len(ids) - rng.randint(3, 8), mask.index(1) + 2)
            ids, mask = ids[:cut], mask[:cut]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        noisy = (lp + 0.4 * torch.randn(lp.shape, generator=gen)).clamp(max=-1e-4)
        rollout = [0.0] + [float(x) if mk else 0.0 for x, mk in zip(noisy, mask[1:], strict=True)]
        trajs.append(
            Trajectory(
                run="test",
                request_id=f"req-{i}",
                task_id=f"task-{i % 3}",
                policy_version=0,
                token_ids=ids,
                action_mask=mask,
                rollout_logprobs=rollout,
                reward=float(rng.random() < 0.5),
                num_turns=2,
                finish_reason="stop",
            )
        )
        rewards.append(trajs[-1].reward + 0.1 * rng.random())
    lengths = [sum(t.action_mask[1:]) for t in trajs]
    adv = normalize_advantages(torch.tensor(rewards), torch.tensor(lengths), "token")
    return trajs, adv.tolist()


def _optimizer_elements(engine: Any) -> int:
    """Elements of AdamW's first moments inside DeepSpeed after the update (ZeRO's flat
    partitions, or one per parameter without ZeRO), on this rank: what the optimizer holds."""
    basic = getattr(engine.optimizer, "optimizer", engine.optimizer)
    return sum(int(st["exp_avg"].numel()) for st in basic.state.values() if "exp_avg" in st)


def run_task(
    model_dir: str | Path, trajs: list[Trajectory], advantages: list[float], task: dict[str, Any]
) -> dict[str, Any]:
    """Build an engine for task["cfg"] (LearnerSettings fields), update once, report.

    task keys: cfg (dict), grads (bool: capture per-mini-batch full gradients), master (bool: the
    optimizer's fp32 master weights after the update, where ZeRO keeps them apart from the model's
    bf16 weights), publish (dict of publish_snapshot keyword arguments root/version/keep, or absent),
    version (the policy version being trained, which marks older tokens stale; absent: None).
    """
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    from services.config.learner import LearnerSettings
    from services.learner.backend import DeepSpeedBackend
    from services.learner.deepspeed_engine import build_engine, release_engine
    from services.learner.snapshot import gather_state_dict, publish_snapshot
    from services.learner.update import run_update

    cfg = LearnerSettings(run="test", model=Path(model_dir), **task["cfg"])
    engine, _ = build_engine(cfg)
    grads: list[dict[str, torch.Tensor]] = []

    def capture(eng: Any, mini: int) -> None:
        # safe_get_full_grad is a collective under ZeRO (partitioned gradients): all ranks call it.
        grads.append(
            {
                n: safe_get_full_grad(p).detach().float().cpu().clone()
                for n, p in eng.module.named_parameters()
                if p.requires_grad  # under LoRA the frozen base has none
            }
        )

    stats = run_update(
        DeepSpeedBackend(engine),
        trajs,
        advantages,
        cfg,
        before_step=capture if task.get("grads") else None,
        version=task.get("version"),
    )
    master = None
    if task.get("master"):
        # A collective under ZeRO-3, like safe_get_full_grad.
        master = {
            n: safe_get_full_fp32_param(p).detach().cpu().clone() for n, p in engine.module.named_parameters()
        }
    state = gather_state_dict(engine)
    published = None
    if task.get("publish"):
        p = task["publish"]
        published = publish_snapshot(
            engine, model_dir, p["root"], p["version"], keep=p["keep"], lora_publish=p.get("lora", "adapter")
        )
    rank = dist.get_rank()
    result = {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "stats": stats,
        "grads": grads if rank == 0 else None,
        "state": {k: v.float().clone() for k, v in state.items()} if state is not None else None,
        "master": master if rank == 0 else None,
        "published": str(published) if published is not None else None,
        # What DeepSpeed and the model really run with (the memory settings' tests check it).
        "memory": {
            "checkpointing": bool(getattr(engine.module, "is_gradient_checkpointing", False)),
            "offload_optimizer": bool(
                getattr(engine.optimizer, "cpu_offload", False)
                or getattr(engine.optimizer, "offload_optimizer", False)
            ),
            "offload_params": bool(getattr(engine.optimizer, "offload_param", False)),
        },
        # ZeRO 3's parameters kept gathered between uses (ds_persist), of all.
        "persistent": (
            sum(bool(getattr(p, "ds_persist", False)) for p in engine.module.parameters()),
            sum(1 for _ in engine.module.parameters()),
        ),
        # Elements the optimizer steps (under LoRA: the adapters alone).
        "optimizer_elements": _optimizer_elements(engine),
        "trainable": sorted(n for n, p in engine.module.named_parameters() if p.requires_grad),
    }
    if hasattr(engine, "destroy"):
        release_engine(engine)  # ZeRO-3 would keep the model alive in DeepSpeed's module state
    del engine
    gc.collect()
    return result


DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DS_ACCELERATOR")


def dist_env_restored() -> Iterator[None]:
    """Generator for a module fixture: in-process engines fill RANK etc. (init_distributed,
    DeepSpeed), which later tests of the session should not inherit."""
    saved = {k: os.environ.get(k) for k in DIST_ENV}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def launch(job: dict[str, Any], workdir: Path, nproc: int, timeout: float = 240) -> list[dict[str, Any]]:
    """Run job's tasks under torchrun with nproc ranks; answers each rank's {task name: result}."""
    workdir.mkdir(parents=True, exist_ok=True)
    job_file, out = workdir / "job.json", workdir / "out"
    job_file.write_text(json.dumps(job))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(HERE / "learner_worker.py"),
        str(job_file),
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    # A parent process that itself initialised a process group leaves its RANK etc. behind.
    for k in DIST_ENV:
        env.pop(k, None)
    proc = subprocess.run(cmd, env=env, cwd=HERE.parent, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(
            f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(nproc)]


def main(job_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    job = json.loads(Path(job_file).read_text())
    trajs = [Trajectory.model_validate(t) for t in job["trajectories"]]
    results = {t["name"]: run_task(job["model"], trajs, job["advantages"], t) for t in job["tasks"]}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(results, out / f"rank{dist.get_rank()}.pt")
    dist.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:3])
