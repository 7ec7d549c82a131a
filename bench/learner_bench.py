"""Learner throughput: one update under DeepSpeed (1 and 2 processes) against a plain PyTorch loop.

The same model, the same batch of B synthetic trajectories (random tokens, a prompt part with
mask 0 and a response part with mask 1), the same mini- and micro-batching and the same loss
(`spopp.loss.policy_loss` with the mini-batch's token count). Tokens/s counts every token of
the batch (prompt included) per second of update: old-logp pass, forward, backward, steps.
Also the time to gather and publish a snapshot. Each DeepSpeed run is its own torchrun launch.

    python -m bench.learner_bench [--quick] [--out BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HEAD = "## Learner: one update under DeepSpeed against plain PyTorch"


def synthetic_batch(vocab: int, n: int, seed: int = 0):
    import torch

    from spopp.api.trajectory import Trajectory

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = int(torch.randint(24, 48, (1,), generator=g))
        resp = int(torch.randint(32, 96, (1,), generator=g))
        ids = torch.randint(5, vocab, (prompt + resp,), generator=g).tolist()
        out.append(
            Trajectory(
                run="bench",
                request_id=f"r{i}",
                task_id=f"t{i}",
                policy_version=0,
                token_ids=ids,
                action_mask=[0] * prompt + [1] * resp,
                rollout_logprobs=[0.0] * prompt + (-torch.rand(resp, generator=g) * 3 - 2).tolist(),
                reward=float(i % 2),
                num_turns=1,
                finish_reason="done",
            )
        )
    adv = [1.0 if i % 2 else -1.0 for i in range(n)]
    return out, adv


# The ALFWorld demo's budget (tools/alfworld_cold_start.BUDGET): 12 interactions, 640 tokens.
ALFWORLD_CAP = 640


def alfworld_like_batch(vocab: int, n: int, seed: int = 0):
    """n trajectories with the length spread of the ALFWorld demo's episodes, in receipt order.

    Lengths are modelled on the demo's budget and teacher (success 0.6): a success ends after 2 to
    8 of the 12 interactions, about 35 tokens each after a prompt of about 90 (150-380 tokens);
    a failure runs on to the cap (540-640). Receipt order is simulated, not shuffled: n slots play
    episodes back to back, each started at a random point of its previous one, and an episode
    takes time in proportion to its length; the batch is the first n to finish. Short episodes
    therefore tend to come first, as they do for the learner's first-completed batches.
    """
    import random

    rng = random.Random(seed)

    def length() -> int:
        if rng.random() < 0.6:
            return 90 + 35 * rng.randint(2, 8) + rng.randint(-10, 10)
        return rng.randint(540, ALFWORLD_CAP)

    finished = []
    for _slot in range(n):
        t = -rng.random() * 600  # already part-way through an episode when the version starts
        for _ in range(4):
            k = length()
            t += k
            if t > 0:
                finished.append((t, k))
    lengths = [k for _t, k in sorted(finished)[:n]]
    trajs, adv = synthetic_batch(vocab, n, seed)
    g = random.Random(seed + 1)
    out = []
    for t, k in zip(trajs, lengths, strict=True):
        prompt = 90
        ids = [g.randrange(5, vocab) for _ in range(k)]
        out.append(t.model_copy(update={
            "token_ids": ids, "action_mask": [0] * prompt + [1] * (k - prompt),
            "rollout_logprobs": [0.0] * prompt + [-2.0 - 3 * g.random() for _ in range(k - prompt)],
        }))  # fmt: skip
    return out, adv


def median_update_s(engine, trajs, adv, cfg, repeats: int) -> float:
    """Seconds of one run_update: the median of `repeats` after a warm-up."""
    from services.learner.backend import DeepSpeedBackend
    from services.learner.update import run_update

    backend = DeepSpeedBackend(engine)
    run_update(backend, trajs, adv, cfg)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run_update(backend, trajs, adv, cfg)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def memory_settings(model: Path, repeats: int) -> dict:
    """One process, ZeRO 2, B = 32 ALFWorld-like trajectories, 2 mini-batches: tokens/s of the
    update by count (4 a micro-batch) and by a token budget of the same largest micro-batch
    (4 x 640 padded tokens); then, by tokens, with gradient checkpointing and with the optimizer
    offloaded, and with eager attention instead of sdpa; and the activations autograd keeps for the
    largest micro-batch, with and without checkpointing."""
    import torch

    from services.config.learner import LearnerSettings
    from services.learner.batch import collate
    from services.learner.deepspeed_engine import build_engine, release_engine
    from services.learner.logprobs import token_logprobs
    from services.learner.memory_plan import saved_bytes

    batch = 32
    common = {
        "run": "bench",
        "model": model,
        "zero_stage": 2,
        "batch_size": batch,
        "mini_batches": 2,
        "lr": 1e-5,
    }
    variants = {
        "count": {"micro_batch_size": 4},
        "tokens": {"micro_batch_tokens": 4 * ALFWORLD_CAP},
        "tokens+checkpointing": {"micro_batch_tokens": 4 * ALFWORLD_CAP, "gradient_checkpointing": True},
        "tokens+offload": {"micro_batch_tokens": 4 * ALFWORLD_CAP, "offload_optimizer": True},
        "tokens+eager": {"micro_batch_tokens": 4 * ALFWORLD_CAP, "attn_implementation": "eager"},
    }
    out: dict = {}
    trajs = None
    for name, extra in variants.items():
        cfg = LearnerSettings(**common, **extra)
        engine, tok = build_engine(cfg)
        if trajs is None:
            trajs, adv = alfworld_like_batch(len(tok), batch)
            lengths = [len(t.token_ids) for t in trajs]
            out.update(_padding(lengths, batch))
        out[name] = out["real_tokens"] / median_update_s(engine, trajs, adv, cfg, repeats)
        if name in ("tokens", "tokens+checkpointing"):
            # The largest micro-batch the token budget makes: what autograd keeps for its backward.
            longest = sorted(range(batch), key=lambda i: -lengths[i])[:4]
            b = collate([trajs[i] for i in longest], [adv[i] for i in longest]).to(engine.device)
            out[f"saved_{name}"] = saved_bytes(
                lambda eng=engine, b=b: token_logprobs(eng, b.input_ids, b.attention_mask).sum(),
                exclude=list(engine.module.parameters()),
            )
        print(f"{name}: {out[name]:,.0f} tok/s", file=sys.stderr, flush=True)
        release_engine(engine)
        del engine
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return out


def _padding(lengths: list[int], batch: int) -> dict:
    """The batch's real tokens and length spread, and per micro-batching (by count, by tokens) its
    padded tokens and micro-batches."""
    from services.learner.batch import plan_micro_batches

    out: dict = {}
    out["real_tokens"] = sum(lengths)
    out["lengths"] = (min(lengths), sorted(lengths)[batch // 2], max(lengths))
    for how, kw in (
        ("count", {"micro_batch_size": 4}),
        ("tokens", {"micro_batch_tokens": 4 * ALFWORLD_CAP}),
    ):
        plan = plan_micro_batches(lengths, 2, 1, **kw)
        micro = [mb for per_rank in plan for mb in per_rank[0]]
        out[f"padded_{how}"] = sum(len(mb) * max(lengths[i] for i in mb) for mb in micro)
        out[f"micro_{how}"] = len(micro)
    return out


def _config(model: Path, stage: int, batch: int, snapshots: Path):
    from services.config.learner import LearnerSettings

    return LearnerSettings(
        run="bench",
        model=model,
        snapshots=snapshots,
        zero_stage=stage,
        batch_size=batch,
        mini_batches=2,
        micro_batch_size=4,
        lr=1e-5,
    )


def worker(model: Path, stage: int, batch: int, repeats: int, out: Path) -> None:
    """One DeepSpeed run (under torchrun): warm-up, timed updates, a timed publish."""
    import torch.distributed as dist

    from services.learner.deepspeed_engine import build_engine
    from services.learner.snapshot import publish_snapshot

    cfg = _config(model, stage, batch, out.parent / f"snap-{stage}-{os.environ.get('WORLD_SIZE', '1')}")
    engine, tok = build_engine(cfg)
    trajs, adv = synthetic_batch(len(tok), batch)
    tokens = sum(len(t.token_ids) for t in trajs)
    update_s = median_update_s(engine, trajs, adv, cfg, repeats)
    t0 = time.perf_counter()
    publish_snapshot(engine, model, cfg.snapshots, 1, keep=1)
    publish_s = time.perf_counter() - t0
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"update_s": update_s, "tokens": tokens, "publish_s": publish_s}))


def plain_torch(model: Path, batch: int, repeats: int) -> dict:
    """The reference loop: the same work with torch.optim.AdamW and no DeepSpeed."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.learner.batch import collate, micro_batches, mini_batches
    from services.learner.logprobs import token_logprobs
    from spopp.loss import policy_loss

    tok = AutoTokenizer.from_pretrained(model)
    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-5, weight_decay=0.1)
    trajs, adv = synthetic_batch(len(tok), batch)

    def update():
        with torch.no_grad():  # old log-probs: the weights before this update's first step
            old = {}
            for mb in micro_batches(slice(0, batch), 4):
                b = collate(trajs[mb], adv[mb])
                old[mb.start] = token_logprobs(net, b.input_ids, b.attention_mask)
        for part in mini_batches(batch, 2):
            n_tok = sum(sum(t.action_mask[1:]) for t in trajs[part])
            for mb in micro_batches(part, 4):
                b = collate(trajs[mb], adv[mb])
                with torch.no_grad():
                    old_lp = token_logprobs(net, b.input_ids, b.attention_mask)
                lp = token_logprobs(net, b.input_ids, b.attention_mask)
                loss, _ = policy_loss(
                    lp, old_lp, b.advantages, b.loss_mask, rollout_logp=b.rollout_logp, token_count=n_tok
                )
                loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            opt.zero_grad()

    update()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        update()
        times.append(time.perf_counter() - t0)
    return {"update_s": statistics.median(times), "tokens": sum(len(t.token_ids) for t in trajs)}


def launch(model: Path, stage: int, nproc: int, batch: int, repeats: int, workdir: Path) -> dict:
    out = workdir / f"ds-{stage}-{nproc}.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "bench.learner_bench",
        "--worker",
        str(model),
        str(stage),
        str(batch),
        str(repeats),
        str(out),
    ]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def _memory_lines(mem: dict) -> list[str]:
    """The memory settings' paragraph of the section (from memory_settings)."""
    lo, mid, hi = mem["lengths"]
    mib = 1 << 20
    return [
        "",
        "Memory settings, one process, ZeRO 2, fp32: B = 32 trajectories with the ALFWorld demo's length spread "
        f"(modelled on its 640-token budget and 0.6 success: {lo}-{hi} tokens, median {mid}; see "
        "`alfworld_like_batch`), 2 mini-batches; by count, 4 trajectories a micro-batch; by tokens, "
        f"micro_batch_tokens {4 * 640} (the same largest micro-batch). Tokens/s counts real tokens.",
        "",
        f"    micro-batching: tokens/s count-based {mem['count']:,.0f}, token-budget {mem['tokens']:,.0f} "
        f"(ratio {mem['tokens'] / mem['count']:.2f}); padded tokens {mem['padded_count']:,} -> {mem['padded_tokens']:,} "
        f"in {mem['micro_count']} -> {mem['micro_tokens']} micro-batches",
        f"    gradient checkpointing: activations kept for the largest micro-batch {mem['saved_tokens'] / mib:.1f} MiB -> "
        f"{mem['saved_tokens+checkpointing'] / mib:.1f} MiB (ratio {mem['saved_tokens'] / mem['saved_tokens+checkpointing']:.1f}); "
        f"tokens/s {mem['tokens']:,.0f} -> {mem['tokens+checkpointing']:,.0f} ({mem['tokens+checkpointing'] / mem['tokens']:.2f})",
        f"    optimizer offload: tokens/s {mem['tokens']:,.0f} -> {mem['tokens+offload']:,.0f} "
        f"({mem['tokens+offload'] / mem['tokens']:.2f}; on a CPU-only machine there is no GPU memory to free, only the copies' cost)",
        f"    attention: tokens/s sdpa {mem['tokens']:,.0f}, eager {mem['tokens+eager']:,.0f} "
        f"(sdpa/eager {mem['tokens'] / mem['tokens+eager']:.2f})",
    ]


def _parser() -> argparse.ArgumentParser:
    """The bench's command line; --worker is torchrun's entry into one DeepSpeed run."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--worker", nargs=5, metavar=("MODEL", "STAGE", "BATCH", "REPEATS", "OUT"), help=argparse.SUPPRESS
    )
    return ap


def main() -> None:
    args = _parser().parse_args()
    if args.worker:
        model, stage, batch, repeats, out = args.worker
        worker(Path(model), int(stage), int(batch), int(repeats), Path(out))
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from tools.tiny_model import build_tiny_model

    batch, repeats = (8, 2) if args.quick else (16, 5)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "tiny")
        base = plain_torch(model, batch, repeats)
        print(f"plain torch: {base['tokens'] / base['update_s']:,.0f} tok/s", file=sys.stderr, flush=True)
        for nproc in (1, 2):
            for stage in (1, 2, 3):
                r = launch(model, stage, nproc, batch, repeats, Path(tmp))
                rows.append({"nproc": nproc, "stage": stage, **r})
                print(
                    f"ZeRO {stage}, {nproc} proc: {r['tokens'] / r['update_s']:,.0f} tok/s, "
                    f"publish {r['publish_s'] * 1e3:.0f} ms",
                    file=sys.stderr,
                    flush=True,
                )
    base_tps = base["tokens"] / base["update_s"]
    lines = [
        HEAD,
        "",
        f"Command: `{'make bench' if not args.quick else 'python -m bench.learner_bench --quick'}` on "
        f"{platform.machine()}, Python {platform.python_version()}, one torch thread per process, fp32, "
        f"{time.strftime('%Y-%m-%d')}. Tiny model (0.35 M parameters), B = {batch} synthetic trajectories of "
        f"56-144 tokens, 2 mini-batches, micro-batch 4; median of {repeats} updates after a warm-up. "
        f"Baseline: a plain PyTorch loop doing the same work in the same run: {base_tps:,.0f} tok/s.",
        "",
        "| processes | ZeRO stage | update s | tokens/s | vs plain torch | publish ms |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        tps = r["tokens"] / r["update_s"]
        lines.append(
            f"| {r['nproc']} | {r['stage']} | {r['update_s']:.3f} | {tps:,.0f} | {tps / base_tps:.2f} | "
            f"{r['publish_s'] * 1e3:.0f} |"
        )
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "tiny")
        mem = memory_settings(model, repeats)
    lines += _memory_lines(mem)
    section = "\n".join(lines) + "\n"
    print(section)
    if args.out:
        from bench.tracker_bench import write_section

        write_section(args.out, section, HEAD)


if __name__ == "__main__":
    main()
