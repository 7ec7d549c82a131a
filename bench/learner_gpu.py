"""The learner's update on one GPU: tokens/s and MFU beside a plain PyTorch loop, and peak memory
beside `spopp learner plan`'s prediction.

One process, one GPU, bf16, sdpa, random weights built from a config (Qwen2-0.5B's and Qwen2-1.5B's
shapes, written out below: no model hub is needed), a batch of 64 trajectories with the ALFWorld
demo's length spread (`bench.learner_bench.alfworld_like_batch`) in one mini-batch under a token
budget of 16,384 (micro-batches of up to 16k padded tokens). Each case is the project's own
`run_update` under DeepSpeed ZeRO 2 or 3, gradient checkpointing off or on; beside it, in the same
run, a plain PyTorch loop doing the same update (the same micro-batches, old log-probs pass, loss,
clipping; bf16 weights stepped by torch's fused AdamW, no DeepSpeed).

MFU = model FLOPs of the update / seconds / the GPU's dense bf16 peak, which the bench measures with
an 8192^3 bf16 matmul in the same run. Model FLOPs per real token (padding is not counted): 8N for
the old log-probs' forward (2N), the forward (2N) and the backward (4N), N = the parameters of every
matmul, the output layer included (tied or not; the embedding lookup is no matmul); plus causal
attention, 2 x layers x q_dim x s(s + 1) per sequence of s tokens per forward-equivalent (QK^T and
AV, each 2 q_dim FLOPs per visible key), times 4. Checkpointing's recomputation is not counted:
model FLOPs, as MFU is defined.

Peak memory is torch.cuda.max_memory_allocated from the case's start (the model built, the engine's
states made, the warm-up and timed updates), above what was allocated before it; the prediction
is `spopp learner plan`'s total for the case (the model's states and the activations of a
16,384-token micro-batch, services/learner/memory_plan.py), the aim being within 15%. A case whose
prediction exceeds the card's usable memory (90%, the plan's reserve) is skipped and said so, as is
one that would overrun the time budget (the whole bench is sized for one 6-minute run on an 80 GB
H100 as on a 141 GB H200).

    source .whl/install.sh && python3 -m bench.learner_gpu --out BENCHMARKS.md
    python -m bench.learner_gpu --smoke      # CPU, gloo, a tiny shape: the same code path in seconds
    python -m bench.learner_gpu --chunking [--out BENCHMARKS.md]   # chunked log-probs vs the whole vocabulary

Measured on an H200 on 2026-11-27 (BENCHMARKS.md, with where the time goes; logs under
docs/results/gpu-h200-2026-11-27/). Not yet on an H100, where the plan skips the 1.5B cases without
checkpointing.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HEAD = "## Learner on one GPU: tokens/s and MFU against plain PyTorch, peak memory against the plan"
CHUNK_HEAD = "## Learner: chunked log-probs on the CPU"
GIB = 1 << 30

# config.json of Qwen/Qwen2-0.5B and Qwen/Qwen2-1.5B, the fields that shape the model (both tie the
# output layer to the embedding): 0.49 B and 1.54 B parameters as `spopp learner plan` counts them.
QWEN2_0_5B = {
    "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 131072,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "tie_word_embeddings": True, "hidden_act": "silu",
}  # fmt: skip
QWEN2_1_5B = {
    "model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
    "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 131072,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "tie_word_embeddings": True, "hidden_act": "silu",
}  # fmt: skip
# The smoke's shape: small enough for seconds on one CPU core, a vocabulary larger than one chunk's
# worth of rows so that the log-probs run in several chunks.
SMOKE = {
    "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}  # fmt: skip
MODELS = {"Qwen2-0.5B": QWEN2_0_5B, "Qwen2-1.5B": QWEN2_1_5B}


@dataclass(frozen=True)
class Setup:
    """What one run of the bench measures with."""

    device: str
    dtype: str  # bf16 | fp32
    batch: int  # trajectories per update (one mini-batch)
    budget: int  # micro_batch_tokens
    repeats: int  # timed updates per case, after one warm-up
    matmul: int  # side of the square matmul that measures the peak
    # (checkpointing, ZeRO stage, packed rows, liger setting, ZeRO 3 keeps every parameter gathered)
    cases: tuple[tuple[bool, int, bool, str, bool], ...]


# Packed rows with liger (the defaults) under ZeRO 2 and 3 and with checkpointing; beside them, at
# ZeRO 2, packed without liger and padded without it (the learner as it was: the 2026-11-27 rows);
# and ZeRO 3 with every parameter persistent (zero3_persistence_threshold above the largest): on
# one GPU, whether its fixed per-update cost is the per-module gather and release.
GPU = Setup(
    device="cuda", dtype="bf16", batch=64, budget=16384, repeats=3, matmul=8192,
    cases=(
        (False, 2, True, "on", False), (False, 2, True, "off", False), (False, 2, False, "off", False),
        (False, 3, True, "on", False), (False, 3, True, "on", True), (True, 2, True, "on", False),
    ),
)  # fmt: skip
# Two cases cover both stages and both checkpointing paths; fp32, since bf16 matmuls on a CPU without
# bf16 units are emulated and slow, and the code path is the same (DeepSpeed's bf16 optimizer is
# covered by tests/learner/test_learner_update.py).
CPU_SMOKE = Setup(
    device="cpu", dtype="fp32", batch=8, budget=1024, repeats=1, matmul=256,
    cases=((False, 2, True, "off", False), (True, 3, False, "off", True)),
)  # fmt: skip


def settings(
    setup: Setup, zero: int, ckpt: bool, packing: bool = True, liger: str = "off", persist: bool = False
):
    from services.config.learner import LearnerSettings

    return LearnerSettings(
        run="bench", model=Path("unused"), zero_stage=zero, dtype=setup.dtype, batch_size=setup.batch,
        mini_batches=1, micro_batch_tokens=setup.budget, gradient_checkpointing=ckpt, attn_implementation="sdpa",
        lr=1e-6, grad_clip=1.0, packing=packing, liger=liger,
        zero3_persistence_threshold=10**12 if persist else None,
    )  # fmt: skip


def matmul_params(config: dict) -> int:
    """N: the weights of every matmul of one token's forward pass, the output layer included."""
    h, i, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    return layers * (h * q + 2 * h * kv + q * h + 3 * h * i) + h * config["vocab_size"]


def update_flops(config: dict, lengths: list[int]) -> float:
    """Model FLOPs of one update of these sequences: old log-probs, forward, backward (module docstring)."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    q = config["num_attention_heads"] * head_dim
    attention = sum(2 * config["num_hidden_layers"] * q * s * (s + 1) for s in lengths)
    return 4 * (2 * matmul_params(config) * sum(lengths) + attention)


def peak_flops(setup: Setup) -> float:
    """FLOP/s of a large square matmul in the training dtype: the card's dense peak as this run sees it."""
    import torch

    n, dtype = setup.matmul, _dtype(setup)
    a = torch.randn(n, n, device=setup.device, dtype=dtype)
    b = torch.randn(n, n, device=setup.device, dtype=dtype)
    for _ in range(3):
        a @ b
    # 100 of 8192^3 are about 0.15 s on an H100 or H200: long enough for steady clocks.
    iters = 100 if setup.device == "cuda" else 3
    _sync(setup)
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    _sync(setup)
    return 2 * n**3 * iters / (time.perf_counter() - t0)


def _dtype(setup: Setup):
    import torch

    return torch.bfloat16 if setup.dtype == "bf16" else torch.float32


def _sync(setup: Setup) -> None:
    import torch

    if setup.device == "cuda":
        torch.cuda.synchronize()


def random_model(config: dict, setup: Setup, ckpt: bool):
    """The causal LM of `config` with random weights, made on the device (no weights are read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict(config)
    cfg = AutoConfig.for_model(values.pop("model_type"), **values)
    with torch.device(setup.device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=_dtype(setup), attn_implementation="sdpa")
    model.to(setup.device)  # where it already is, unless from_config ignored the default device
    # As services.learner.deepspeed_engine.build_engine prepares a loaded model.
    model.config.use_cache = False
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def learner_engine(config: dict, setup: Setup, cfg):
    """The learner's DeepSpeed engine around a random model: build_engine's steps, the weights made
    from the config instead of read from a folder (a 1.5 B checkpoint would take longer to write
    and read than its case takes to run)."""
    import deepspeed
    import torch

    from services.learner.deepspeed_engine import deepspeed_config, init_distributed, seed_everything

    _, world = init_distributed()
    seed_everything(cfg.seed)
    model = random_model(config, setup, cfg.gradient_checkpointing)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.adam_eps, weight_decay=cfg.weight_decay
    )
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(cfg, world))
    return engine


def memory_start(setup: Setup) -> float:
    """Start a case's memory count: bytes already allocated (what an earlier case left), after
    resetting the peak. The case's peak is reported above this, its model and states included."""
    import torch

    if setup.device != "cuda":
        return float("nan")
    torch.cuda.reset_peak_memory_stats()
    return float(torch.cuda.memory_allocated())


def timed(setup: Setup, update, base: float) -> tuple[float, float]:
    """(median seconds of `setup.repeats` updates after a warm-up, peak bytes allocated since
    memory_start gave `base`, above it)."""
    import torch

    update()
    times = []
    for _ in range(setup.repeats):
        _sync(setup)
        t0 = time.perf_counter()
        update()
        _sync(setup)
        times.append(time.perf_counter() - t0)
    peak = float(torch.cuda.max_memory_allocated()) - base if setup.device == "cuda" else float("nan")
    return statistics.median(times), peak


def learner_case(
    config: dict, setup: Setup, zero: int, ckpt: bool, trajs, adv, profile: bool = False,
    packing: bool = True, liger: str = "off", persist: bool = False,
) -> dict:  # fmt: skip
    from services.learner.backend import DeepSpeedBackend
    from services.learner.deepspeed_engine import release_engine
    from services.learner.update import run_update

    cfg = settings(setup, zero, ckpt, packing, liger, persist)
    base = memory_start(setup)
    engine = learner_engine(config, setup, cfg)
    backend = DeepSpeedBackend(engine)
    try:
        seconds, peak = timed(setup, lambda: run_update(backend, trajs, adv, cfg), base)
        top = profiled(setup, lambda: run_update(backend, trajs, adv, cfg)) if profile else None
    finally:
        release_engine(engine)
    return {"seconds": seconds, "peak": peak, "profile": top}


def profiled(setup: Setup, update) -> str:
    """One more update under torch's profiler: where the device's time goes (the top operators by
    their own device time) and how much of the update the device was busy."""
    from torch.profiler import ProfilerActivity, profile

    cuda = setup.device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync(setup)
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        update()
        _sync(setup)
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    # On CUDA an operator's self device time is its kernels' time, and the kernels are listed too:
    # count the device's own events only (as the table's "Self CUDA time total" does), not both.
    from torch.autograd import DeviceType

    busy = sum(getattr(e, key) for e in events if not cuda or e.device_type != DeviceType.CPU) / 1e6
    table = events.table(sort_by=key, row_limit=12)
    return f"profiled update: {wall:.2f} s wall, {busy:.2f} s of operators' own {'device' if cuda else 'CPU'} time\n{table}"


def plain_case(config: dict, setup: Setup, ckpt: bool, trajs, adv) -> dict:
    """The same update without DeepSpeed: one process, bf16 weights, torch's fused AdamW."""
    import torch

    from services.learner.batch import action_tokens, collate, mini_batches, plan_micro_batches
    from services.learner.logprobs import token_logprobs
    from spopp.loss import policy_loss

    cfg = settings(setup, 2, ckpt)
    base = memory_start(setup)
    model = random_model(config, setup, ckpt)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.adam_eps, weight_decay=cfg.weight_decay, fused=True
    )
    lengths = [len(t.token_ids) for t in trajs]
    plan = plan_micro_batches(lengths, cfg.mini_batches, 1, micro_batch_tokens=cfg.micro_batch_tokens)
    adv_t = torch.as_tensor(adv, dtype=torch.float32)
    steps = [
        (part, [collate([trajs[i] for i in rows], adv_t[rows]).to(setup.device) for rows in per_rank[0]])
        for part, per_rank in zip(mini_batches(len(trajs), cfg.mini_batches), plan, strict=True)
    ]

    def update() -> None:
        with torch.no_grad():
            old = [
                [token_logprobs(model, b.input_ids, b.attention_mask) for b in micro] for _, micro in steps
            ]
        for (part, micro), olds in zip(steps, old, strict=True):
            denom = max(action_tokens(trajs[part]), 1)
            for b, o in zip(micro, olds, strict=True):
                logp = token_logprobs(model, b.input_ids, b.attention_mask)
                loss, _ = policy_loss(
                    logp, o, b.advantages, b.loss_mask, rollout_logp=b.rollout_logp, clip_low=cfg.clip_low,
                    clip_high=cfg.clip_high, dual_clip=cfg.dual_clip, is_cap=cfg.is_cap, token_count=denom,
                )  # fmt: skip
                loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)

    seconds, peak = timed(setup, update, base)
    return {"seconds": seconds, "peak": peak}


def _release(setup: Setup) -> None:
    """Free what the last case held (called once its frames are gone), so the next starts empty."""
    import torch

    gc.collect()
    if setup.device == "cuda":
        torch.cuda.empty_cache()


def plan_total(
    config: dict, setup: Setup, zero: int, ckpt: bool, gpu_gib: float, liger: str = "off"
) -> tuple[float, bool]:
    """`spopp learner plan`'s per-GPU total for the case (bytes), and whether it fits the card;
    with liger's kernels where the case asks for them on a GPU (kernels.enable decides the same)."""
    from services.learner import memory_plan
    from services.learner.kernels import family_not_patched

    shape = memory_plan.model_shape(config)
    rows = memory_plan.plan(
        shape,
        gpus=1,
        gpu_memory_gib=gpu_gib,
        tokens=setup.budget,
        dtype=setup.dtype,
        zero=zero,
        liger=liger != "off" and setup.device == "cuda" and family_not_patched(shape.model_type) is None,
    )
    row = next(r for r in rows if r.checkpointing == ckpt and r.offload == "none")
    return row.total, row.fits


def card(setup: Setup) -> tuple[str, float]:
    """(the device's name, its memory in GiB)."""
    import torch

    if setup.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        return props.name, props.total_memory / GIB
    # The smoke has no card: a nominal 80 GiB, so that every tiny case fits the plan.
    return f"CPU ({platform.machine()})", 80.0


def run(setup: Setup, models: dict[str, dict], budget_s: float, log, profile: bool = False) -> dict[str, Any]:
    import torch

    started = time.perf_counter()
    name, gpu_gib = card(setup)
    peak = peak_flops(setup)
    log(f"device: {name}, {gpu_gib:.1f} GiB; dense {setup.dtype} peak {peak / 1e12:.3g} TFLOP/s "
        f"({setup.matmul}^3 matmul)")  # fmt: skip
    out: dict[str, Any] = {"device": name, "gpu_gib": gpu_gib, "peak": peak, "models": {}, "lines": []}
    for label, config in models.items():
        trajs, adv, info = _model_batch(config, setup)
        out["models"][label] = info
        log(f"{label}: N = {info['n']:,} matmul parameters, {info['tokens']:,} tokens in {len(trajs)} "
            f"trajectories, micro-batches of {info['padded']} padded tokens, {info['flops'] / info['tokens'] / 1e9:.3g} GFLOP per token")  # fmt: skip
        last_case_s = 0.0
        plain: dict[bool, dict] = {}
        for ckpt, zero, packing, liger, persist in setup.cases:
            layout = "packed" if packing else "padded"
            head = f"learner gpu: {label} zero {zero}{' persistent' if persist else ''} ckpt {'on' if ckpt else 'off'} {layout} liger {liger}"
            predicted, fits = plan_total(config, setup, zero, ckpt, gpu_gib, liger)
            case = {
                "zero": f"{zero}{' persistent' if persist else ''}", "ckpt": ckpt, "predicted": predicted,
                "layout": layout, "liger": liger,
            }  # fmt: skip
            info["cases"].append(case)
            if not fits:
                case["skipped"] = (
                    f"plan says {_size(predicted)}, over the {gpu_gib * 0.9:.1f} GiB usable of this "
                    f"{gpu_gib:.0f} GiB card"
                )
            elif time.perf_counter() - started + 2 * last_case_s > budget_s:
                case["skipped"] = f"the {budget_s:.0f} s budget would be overrun"
            if "skipped" in case:
                out["lines"].append(f"{head}: skipped: {case['skipped']}")
                log(out["lines"][-1])
                continue
            t0 = time.perf_counter()
            if ckpt not in plain:
                plain[ckpt] = plain_case(config, setup, ckpt, trajs, adv)
                _release(setup)
            # The profiler's extra update is paid once per model (its first case run), not per case:
            # a GPU lease is short, and the cases share the kernels that matter.
            first = profile and not any("seconds" in c for c in info["cases"])
            case.update(
                learner_case(config, setup, zero, ckpt, trajs, adv, first, packing, liger, persist),
                plain=plain[ckpt],
            )
            _release(setup)
            # What the case left allocated: a leak shows here (the next case's peak is counted above it).
            case["left"] = float(torch.cuda.memory_allocated()) if setup.device == "cuda" else float("nan")
            last_case_s = time.perf_counter() - t0
            out["lines"] += _case_lines(head, case, info, peak)
            log(
                "\n".join(out["lines"][-2:])
                + f"  [{last_case_s:.0f} s, {_size(case['left'])} left allocated]"
            )
            if case["profile"]:
                log(case["profile"])
    out["seconds"] = time.perf_counter() - started
    return out


def _model_batch(config: dict, setup: Setup) -> tuple[list, list, dict]:
    """(trajectories, advantages, info) of a model's batch; info holds its real tokens, the padded
    tokens of each micro-batch, the update's model FLOPs and N, and an empty list of cases."""
    from bench.learner_bench import alfworld_like_batch
    from services.learner.batch import plan_micro_batches

    trajs, adv = alfworld_like_batch(config["vocab_size"], setup.batch)
    lengths = [len(t.token_ids) for t in trajs]
    (micro,) = (
        per_rank[0] for per_rank in plan_micro_batches(lengths, 1, 1, micro_batch_tokens=setup.budget)
    )
    padded = [len(rows) * max(lengths[i] for i in rows) for rows in micro]
    flops = update_flops(config, lengths)
    info = {
        "tokens": sum(lengths),
        "padded": padded,
        "flops": flops,
        "n": matmul_params(config),
        "cases": [],
    }
    return trajs, adv, info


def _mfu(info: dict, seconds: float, peak: float) -> float:
    return info["flops"] / seconds / peak


def _case_lines(head: str, case: dict, info: dict, peak: float) -> list[str]:
    tps = info["tokens"] / case["seconds"]
    mfu, plain_mfu = _mfu(info, case["seconds"], peak), _mfu(info, case["plain"]["seconds"], peak)
    off = f"{100 * (case['peak'] / case['predicted'] - 1):+.0f}%" if case["peak"] == case["peak"] else "n/a"
    return [
        f"{head}: tokens/s {tps:,.0f}, MFU {100 * mfu:.1f}% (plain torch {100 * plain_mfu:.1f}%)",
        f"  peak memory {_size(case['peak'])}, plan {_size(case['predicted'])} ({off}); "
        f"plain torch {_size(case['plain']['peak'])}; learner/plain speed {mfu / plain_mfu:.2f}",
    ]


def _size(n: float) -> str:
    """Bytes as GiB, or MiB below one GiB; n/a where not measured (the CPU has no allocator peak)."""
    if n != n:
        return "n/a"
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / (1 << 20):.1f} MiB"


def section(result: dict, setup: Setup) -> str:
    lines = [
        HEAD,
        "",
        f"Command: `source .whl/install.sh && python3 -m bench.learner_gpu {' '.join(sys.argv[1:])}` on "
        f"{result['device']} ({result['gpu_gib']:.0f} GiB), {time.strftime('%Y-%m-%d')}: {setup.dtype}, sdpa, "
        f"random weights, {setup.batch} ALFWorld-like trajectories in one mini-batch, micro_batch_tokens "
        f"{setup.budget}, median of {setup.repeats} updates after a warm-up. Dense {setup.dtype} peak measured "
        f"by a {setup.matmul}^3 matmul: {result['peak'] / 1e12:.0f} TFLOP/s. MFU counts 8N + attention FLOPs "
        "per real token (old log-probs, forward, backward; bench/learner_gpu.py). Layout: packed rows (the "
        "learner's default; varlen attention) or padded ones; liger: its fused RMSNorm, SwiGLU, rotary and linear "
        "cross-entropy. Plain torch: the same update on padded rows without DeepSpeed (bf16 weights, fused "
        f"AdamW) in the same run. {result['seconds']:.0f} s in all.",
        "",
        "| model | ZeRO | ckpt | layout | liger | tokens/s | MFU | plain torch MFU | learner/plain | peak GiB | "
        "plan GiB | plain peak GiB |",
        "| --- | ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, info in result["models"].items():
        for c in info["cases"]:
            ck = f"{'on' if c['ckpt'] else 'off'} | {c['layout']} | {c['liger']}"
            if "skipped" in c:
                lines.append(f"| {label} | {c['zero']} | {ck} | skipped: {c['skipped']} | | | | | "
                             f"{c['predicted'] / GIB:.1f} | |")  # fmt: skip
                continue
            mfu, pmfu = (
                _mfu(info, c["seconds"], result["peak"]),
                _mfu(info, c["plain"]["seconds"], result["peak"]),
            )
            lines.append(
                f"| {label} | {c['zero']} | {ck} | {info['tokens'] / c['seconds']:,.0f} | {100 * mfu:.1f}% | "
                f"{100 * pmfu:.1f}% | {mfu / pmfu:.2f} | {c['peak'] / GIB:.1f} | {c['predicted'] / GIB:.1f} | "
                f"{c['plain']['peak'] / GIB:.1f} |"
            )
    lines += ["", "```", *result["lines"], "```"]
    return "\n".join(lines) + "\n"


class _AllocatorPeak:
    """The most bytes the C allocator had in use at any operator's end, on Linux with glibc: the
    CPU has no allocator statistics of torch's own. Allocations above 1 MiB are made to be mmapped
    (M_MMAP_THRESHOLD), so that each tensor's bytes count while it lives and not after."""

    def __init__(self) -> None:
        import ctypes

        class Info(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in (
                "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                "keepcost",
            )]  # fmt: skip

        self.libc = ctypes.CDLL("libc.so.6")
        self.libc.mallinfo2.restype = Info
        self.libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD

    def used(self) -> int:
        info = self.libc.mallinfo2()
        return info.hblkhd + info.uordblks

    def peak_of(self, fn) -> int:
        """Peak bytes in use while fn() runs, above those in use before it."""
        from torch.utils._python_dispatch import TorchDispatchMode

        used, peak = self.used, [0]

        class Watch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                peak[0] = max(peak[0], used())
                return out

        base = used()
        with Watch():
            fn()
        return peak[0] - base


def chunking(repeats: int = 3) -> dict[str, dict[str, float]]:
    """One micro-batch of 4 x 512 tokens through a 2-layer Qwen2 shape with Qwen's vocabulary (the
    output layer dominates), fp32, on the CPU: the learner's chunked log-probs against the whole-
    vocabulary pass they replaced (logprobs.whole_vocabulary_logprobs, the fallback kept for models that
    post-process their logits). What autograd keeps, the allocator's peak of forward + backward,
    and the seconds of forward + backward and of a no-grad pass (median of `repeats`)."""
    import torch

    from services.learner import logprobs
    from services.learner.memory_plan import saved_bytes

    config = {**SMOKE, "hidden_size": 128, "intermediate_size": 256, "vocab_size": 151936}
    setup = Setup(device="cpu", dtype="fp32", batch=0, budget=0, repeats=repeats, matmul=0, cases=())
    model = random_model(config, setup, ckpt=False)
    ids = torch.randint(0, config["vocab_size"], (4, 512), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    for p in model.parameters():  # gradients allocated once, as in training: not part of the peak
        p.grad = torch.zeros_like(p)
    allocator = _AllocatorPeak()
    ways = {
        "whole vocabulary (before)": lambda: logprobs.whole_vocabulary_logprobs(model, ids, mask),
        f"chunks of {logprobs.CHUNK_TOKENS} tokens (after)": lambda: logprobs.token_logprobs(
            model, ids, mask
        ),
    }
    out = {}
    for name, fn in ways.items():
        fn().sum().backward()  # warm-up
        kept = saved_bytes(lambda fn=fn: fn().sum(), exclude=list(model.parameters()))
        peak = allocator.peak_of(lambda fn=fn: fn().sum().backward())
        train, nograd = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn().sum().backward()
            train.append(time.perf_counter() - t0)
            with torch.no_grad():
                t0 = time.perf_counter()
                fn()
                nograd.append(time.perf_counter() - t0)
        out[name] = {
            "kept": kept, "peak": peak, "train_s": statistics.median(train), "nograd_s": statistics.median(nograd),
        }  # fmt: skip
    return out


def chunking_section(result: dict[str, dict[str, float]], load: float) -> str:
    mib = 1 << 20
    lines = [
        CHUNK_HEAD,
        "",
        f"Command: `python -m bench.learner_gpu --chunking --out BENCHMARKS.md` on {platform.machine()}, one torch "
        f"thread, fp32, {time.strftime('%Y-%m-%d')}, load average {load:.1f} at the start (the machine's "
        f"{os.cpu_count()} cores were shared). A 2-layer Qwen2 shape (hidden 128) with Qwen's vocabulary "
        "(151,936), so that the output layer dominates; one micro-batch of 4 x 512 tokens; log-probs of every "
        "position, then backward of their sum; median of 3. Kept: autograd's saved tensors (plan.saved_bytes). "
        "Peak: the C allocator's bytes in use (glibc's mallinfo2, every allocation above 1 MiB mmapped) after "
        "every operator of forward and backward, above those in use before.",
        "",
        "| log-probs | kept for backward | peak above the start | forward + backward s | no-grad pass s |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, r in result.items():
        lines.append(
            f"| {name} | {r['kept'] / mib:,.0f} MiB | {r['peak'] / mib:,.0f} MiB | {r['train_s']:.2f} | "
            f"{r['nograd_s']:.2f} |"
        )
    from services.learner.logprobs import CHUNK_TOKENS
    from services.learner.memory_plan import HEAD_TRANSIENT

    (before, after), (positions, vocab) = result.values(), (4 * 511, 151936)
    lines += [
        "",
        f"- Kept for backward: the [{positions}, V] fp32 logits ({4 * positions * vocab / mib:,.0f} MiB) are gone; "
        "what is left is the copy of the hidden states the chunks read and the layers' activations.",
        f"- The peak is one chunk's backward now: plan.py's HEAD_TRANSIENT, {HEAD_TRANSIENT} bytes per token and "
        f"vocabulary entry x {CHUNK_TOKENS} tokens, is {HEAD_TRANSIENT * CHUNK_TOKENS * vocab / mib:,.0f} MiB, "
        f"beside the output layer's weight gradient ({4 * 128 * vocab / mib:,.0f} MiB); before, it was "
        f"{before['peak'] / (positions * vocab):.1f} bytes per token and entry over all {positions} positions.",
        f"- The price is recomputing each chunk's output-layer matmul in backward: forward + backward "
        f"x{after['train_s'] / before['train_s']:.2f} here, where that layer is nearly all the model's FLOPs "
        "(at Qwen2-1.5B's shape it is about 4% of an update's FLOPs, 7% at 0.5B's); the no-grad pass (old "
        f"log-probs) x{after['nograd_s'] / before['nograd_s']:.2f}.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--smoke", action="store_true", help="CPU, gloo, a tiny shape: the same code path in seconds"
    )
    ap.add_argument(
        "--chunking", action="store_true", help="CPU: chunked log-probs against the whole-vocabulary pass"
    )
    ap.add_argument("--out", type=Path, help="write the section into this markdown file (not with --smoke)")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--budget-s", type=float, default=330.0, help="skip cases that would end past this")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="profile one more update of each model's first case: the top operators (slower)",
    )
    args = ap.parse_args()
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    if args.chunking:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import torch

        torch.set_num_threads(1)
        load = os.getloadavg()[0]
        text = chunking_section(chunking(), load)
        print(text)
        if args.out:
            from bench.tracker_bench import write_section

            write_section(args.out, text, CHUNK_HEAD)
        return
    if args.smoke:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import torch

        torch.set_num_threads(1)
        result = run(CPU_SMOKE, {"smoke": SMOKE}, args.budget_s, log, args.profile)
        print("\n".join(result["lines"]))
        if args.out:
            raise SystemExit("--out takes GPU figures only: the smoke's are not worth a section")
        return
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(
            "bench.learner_gpu needs a CUDA GPU (python -m bench.learner_gpu --smoke runs on the CPU)"
        )
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        raise SystemExit(f"unknown models {sorted(unknown)}: choose from {', '.join(MODELS)}")
    result = run(GPU, {m: MODELS[m] for m in args.models.split(",")}, args.budget_s, log, args.profile)
    text = section(result, GPU)
    print(text)
    if args.out:
        from bench.tracker_bench import write_section

        write_section(args.out, text, HEAD)


if __name__ == "__main__":
    main()
