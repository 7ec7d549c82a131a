"""Rollout throughput and weight swaps, for both engines.

- Service against raw engine: the same tasks' Math-TIR opening prompts, the same sampling (stop
  strings, max tokens), the same concurrency and the same engine object. `raw` awaits
  `engine.generate` on the prompts directly; `service` runs the rollout worker (dispatch from a
  real tracker over HTTP, one-turn episodes, outcome report, trajectory POST to a sink standing
  in for the learner, in a process of its own as the learner is). The engine is built as a
  replica builds it (transformers: in a process of its own) and shared by both. Generated
  tokens/s of each, and service/raw: the service's overhead.
- Weight swap: `engine.load_weights(snapshot)` for the tiny model and a ~100 M parameter model
  (random weights, same tokenizer), median of 3 swaps; then, on the same ~100 M engine (started
  for LoRA), adapter snapshots of rank 8 on every linear layer: `lora swap: full X s, adapter Y s
  (ratio R)`, and the two snapshots' sizes.

    python -m bench.rollout_bench [--quick] [--out BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from bench.tracker_bench import write_section
from runtime.chat import ChatRenderer
from runtime.engines.base import SamplingConfig
from runtime.engines.factory import make_engine
from runtime.envs.base import StepResult
from runtime.envs.math_tir import MathTIREnv
from runtime.tasks import generate_arithmetic_tasks
from services.config.rollout import RolloutSettings
from services.rollout.worker import Worker, read_run
from services.tracker.embedded import EmbeddedRedis
from spopp.api.client import TrackerClient
from tools.sink import LearnerSink
from tools.tiny_model import build_tiny_model, perturb_weights, random_adapter
from tools.tracker_process import TrackerProcess

HEAD = "## Rollout: service against raw engine, weight swaps"


class OneTurnEnv(MathTIREnv):
    """Math-TIR's opening and stop strings; the first turn ends the episode without running its code.

    Raw generation runs no tool, so neither may the service: the ratio is the service's overhead
    (dispatch, reports, POSTs, scheduling), not the sandbox's CPU on a machine both share.
    """

    def step(self, action: str) -> StepResult:
        return StepResult([], done=True, reward=0.0, info={"finish": "answer"})


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def raw_generate(engine, prompts, sampling, concurrency) -> tuple[int, float]:
    gate = asyncio.Semaphore(concurrency)

    async def one(i, ids):
        async with gate:
            return await engine.generate(ids, replace(sampling, seed=i))

    t0 = time.perf_counter()
    gens = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return sum(len(g.token_ids) for g in gens), time.perf_counter() - t0


def _sink_process(conn, run: str) -> None:
    """Child: the stand-in learner, answering with the tokens it accepted when told to stop."""
    with LearnerSink(run) as sink:
        conn.send(sink.url)
        conn.recv()
        conn.send(sum(t.action_tokens for t in sink.trajectories()))


class SinkProcess:
    """The sink in a process of its own, as the learner is: in the bench's process its HTTP server
    would share the replica's GIL, which the learner never does."""

    def __init__(self, run: str) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_sink_process, args=(child, run), daemon=True)

    def __enter__(self) -> SinkProcess:
        self._proc.start()
        self.url = self._conn.recv()
        return self

    def accepted_tokens(self) -> int:
        self._conn.send("stop")
        return self._conn.recv()

    def __exit__(self, *exc) -> None:
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()


class _FirstCall:
    """The engine, noting when the replica first asks it to generate."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.first: float | None = None

    def __getattr__(self, name):
        return getattr(self._engine, name)

    async def generate(self, *args, **kwargs):
        if self.first is None:
            self.first = time.perf_counter()
        return await self._engine.generate(*args, **kwargs)


async def service_generate(engine, settings, tasks, episodes) -> tuple[int, float, float, tuple]:
    """(tokens, seconds from the first generate call to the end, start-up seconds before it,
    (dispatch, outcome and trajectory calls per episode))."""
    with SinkProcess(settings.run) as sink:
        watched = _FirstCall(engine)
        settings = settings.model_copy(update={"learner": sink.url})
        t0 = time.perf_counter()  # the run's read is part of the replica's start-up, as before
        worker = Worker(
            settings, await read_run(settings), watched, OneTurnEnv, {t.task_id: t for t in tasks}
        )
        await worker.run(max_episodes=episodes)
        end = time.perf_counter()
        await worker.close()
        # The replica's start-up (prompt check of every task, run and policy reads, first
        # dispatch) happens once per replica, not per episode: timed apart from the throughput.
        first = watched.first if watched.first is not None else t0
        done = max(1, worker.leases.ended)
        calls = (worker.dispatches, worker.outcomes.calls, worker.trajectories.calls)
        return sink.accepted_tokens(), end - first, first - t0, tuple(c / done for c in calls)


def build_100m(tiny: Path, out: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if (out / "config.json").exists():
        return out
    base = AutoConfig.from_pretrained(tiny)
    sizes = dict(
        hidden_size=768,
        num_hidden_layers=12,
        intermediate_size=3072,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
    )
    # A fresh config of the same class, so that per-layer fields (layer_types) follow the new depth.
    fields = {
        k: v
        for k, v in base.to_dict().items()
        if k not in ("layer_types", "model_type", "transformers_version")
    }
    cfg = type(base)(**{**fields, **sizes})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(out)
    return out


def n_params(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for key in st.keys():
                total += math.prod(st.get_slice(key).get_shape())
    return total


async def swap_seconds(engine, a: Path, b: Path, repeats: int = 3) -> float:
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        await engine.load_weights(b if i % 2 == 0 else a)
        times.append(time.perf_counter() - t0)
    await engine.load_weights(a)
    return statistics.median(times)


LORA_RANK = 8


def folder_bytes(folder: Path, pattern: str) -> int:
    return sum(f.stat().st_size for f in folder.glob(pattern))


async def bench_engine(kind, tiny, tiny2, big, big2, tracker_url, run, tasks, cfg, adapters) -> dict:
    settings = RolloutSettings(
        model=tiny,
        tracker=tracker_url,
        run=run,
        engine=kind,
        concurrency=cfg["concurrency"],
        max_turns=1,
        max_tokens_per_turn=cfg["max_tokens"],
        max_total_tokens=1024,
    )
    # The engine as a replica builds it (transformers: in a process of its own); raw and service
    # share it, so the ratio is the service's overhead and nothing else.
    _progress(f"{kind}: starting engine {settings.engine_kwargs()}")
    engine = make_engine(kind, tiny, **settings.engine_kwargs())
    try:
        renderer = ChatRenderer(engine.tokenizer)
        env = MathTIREnv()
        prompts = [renderer.prompt(env.reset(t)) for t in tasks]
        sampling = SamplingConfig(max_tokens=cfg["max_tokens"], stop=MathTIREnv.stop)
        await raw_generate(engine, prompts[:4], sampling, cfg["concurrency"])  # warm-up
        rows = []
        for rep in range(cfg["repeats"]):
            _progress(f"{kind}: repeat {rep + 1}/{cfg['repeats']}")
            rt, rs = await raw_generate(engine, prompts, sampling, cfg["concurrency"])
            st, ss, startup, calls = await service_generate(engine, settings, tasks, len(tasks))
            rows.append((rt / rs, st / ss, startup, calls))
        raw_tps = statistics.median(r[0] for r in rows)
        svc_tps = statistics.median(r[1] for r in rows)
        pair_ratios = sorted(r[1] / r[0] for r in rows)
        startup_s = statistics.median(r[2] for r in rows)
        calls = tuple(statistics.median(r[3][i] for r in rows) for i in range(3))
        swap_tiny = await swap_seconds(engine, tiny, tiny2)
    finally:
        await engine.close()
    _progress(f"{kind}: swapping the ~100M model, full weights then rank-{LORA_RANK} adapters")
    engine = make_engine(kind, big, **settings.model_copy(update={"lora_rank": LORA_RANK}).engine_kwargs())
    try:
        swap_big = await swap_seconds(engine, big, big2)
        await engine.load_weights(adapters[0])  # the first adapter sets the engine up (PEFT's layers)
        swap_adapter = await swap_seconds(engine, adapters[0], adapters[1])
    finally:
        await engine.close()
    return {
        "engine": kind,
        "raw_tps": raw_tps,
        "service_tps": svc_tps,
        "swap_tiny_s": swap_tiny,
        "swap_big_s": swap_big,
        "swap_adapter_s": swap_adapter,
        "pair_ratios": pair_ratios,
        "startup_s": startup_s,
        "calls": calls,
    }


async def run_all(engines, cfg, workdir: Path) -> tuple[list[dict], dict]:
    tiny = build_tiny_model(workdir / "tiny")
    tiny2 = perturb_weights(tiny, workdir / "tiny-v1", scale=0.1, seed=1)
    big = build_100m(tiny, workdir / "m100")
    big2 = perturb_weights(big, workdir / "m100-v1", scale=0.01, seed=1)
    adapters = [random_adapter(big, workdir / f"m100-lora-v{i}", seed=i, rank=LORA_RANK) for i in (1, 2)]
    sizes = {
        "tiny": n_params(tiny), "big": n_params(big), "adapter": n_params(adapters[0]),
        "big_bytes": folder_bytes(big, "*.safetensors"), "adapter_bytes": folder_bytes(adapters[0], "*.safetensors"),
    }  # fmt: skip
    tasks = generate_arithmetic_tasks(cfg["episodes"], seed=0)
    rows = []
    with EmbeddedRedis(workdir / "redis", appendonly=False) as server:
        tracker = TrackerProcess(server.url)
        try:
            with TrackerClient(tracker.url) as client:
                for kind in engines:
                    run = f"bench-{kind}"
                    client.put_run(run, {"recipe": "spopp"})
                    client.put_tasks(run, [{"task_id": t.task_id, "alpha0": 1, "beta0": 1} for t in tasks])
                    rows.append(
                        await bench_engine(
                            kind, tiny, tiny2, big, big2, tracker.url, run, tasks, cfg, adapters
                        )
                    )
                    r = rows[-1]
                    print(
                        f"{kind}: raw {r['raw_tps']:,.0f} tok/s, service {r['service_tps']:,.0f} tok/s "
                        f"(ratio {r['service_tps'] / r['raw_tps']:.2f}, per repeat "
                        f"{', '.join(f'{x:.2f}' for x in r['pair_ratios'])}; start-up {r['startup_s']:.2f} s; "
                        f"calls per episode {', '.join(f'{x:.2f}' for x in r['calls'])}); "
                        f"swap tiny {r['swap_tiny_s']:.3f} s, "
                        f"~100M {r['swap_big_s']:.3f} s",
                        flush=True,
                    )
                    print(
                        f"{kind}: lora swap: full {r['swap_big_s']:.3f} s, adapter {r['swap_adapter_s']:.3f} s "
                        f"(ratio {r['swap_big_s'] / r['swap_adapter_s']:.1f}); snapshot {sizes['big_bytes'] / 2**20:.0f} MiB "
                        f"full, {sizes['adapter_bytes'] / 2**20:.2f} MiB adapter",
                        flush=True,
                    )
        finally:
            tracker.stop()
    return rows, sizes


def markdown(rows, sizes, cfg, command) -> str:
    out = [
        HEAD,
        "",
        f"Command: `{command}` on {platform.machine()}, Python {platform.python_version()}, one torch thread, "
        f"{time.strftime('%Y-%m-%d')}. {cfg['episodes']} Math-TIR opening prompts (generated arithmetic tasks), "
        f"up to {cfg['max_tokens']} new tokens with the environment's stop strings, {cfg['concurrency']} in "
        f"flight, temperature 1; median of {cfg['repeats']} alternating repeats. Tiny model: "
        f"{sizes['tiny'] / 1e6:.2f} M parameters; swap model: {sizes['big'] / 1e6:.0f} M (fp32, random weights).",
        "",
        "| engine | raw generate tok/s | through the service tok/s | service/raw | per-repeat service/raw "
        "| calls per episode: dispatch, outcomes, trajectories | replica start-up s | swap tiny s | swap ~100M s "
        f"| LoRA swap ~100M s (rank {LORA_RANK}) | full/adapter |",
        "| --- | ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        pairs = ", ".join(f"{x:.2f}" for x in r["pair_ratios"])
        out.append(
            f"| {r['engine']} | {r['raw_tps']:,.0f} | {r['service_tps']:,.0f} | "
            f"{r['service_tps'] / r['raw_tps']:.2f} | {pairs} | {', '.join(f'{x:.2f}' for x in r['calls'])} | "
            f"{r['startup_s']:.2f} | "
            f"{r['swap_tiny_s']:.3f} | {r['swap_big_s']:.3f} | {r['swap_adapter_s']:.3f} | "
            f"{r['swap_big_s'] / r['swap_adapter_s']:.1f} |"
        )
    out += [
        "",
        "`service` counts the tokens of trajectories the sink accepted, from the replica's first "
        "generate call to the end of its last episode (dispatch, outcome reports and trajectory "
        "POSTs included); the replica's one-off start-up before that call (prompt check of every "
        "task, run and policy reads, first dispatch) is the start-up column. service/raw is the "
        "ratio of the medians; the per-repeat ratios (sorted) show the spread on this machine. "
        "Calls per episode are the replica's HTTP calls (medians): ready leases are refilled half a "
        "prefetch at a time, and outcome reports and trajectories wait briefly to share calls. The "
        "sink stands in for the learner in a process of its own; the transformers engine runs in "
        "a process of its own, as replicas run it (`engine_options: {process: false}` keeps it in "
        "the replica's process).",
        "",
        f"LoRA swaps: the ~100M engine started for rank-{LORA_RANK} adapters (`lora_rank`) swaps full weights, "
        f"then adapter snapshots on every linear layer ({sizes['adapter'] / 1e6:.2f} M parameters): "
        f"{sizes['adapter_bytes'] / 2**20:.2f} MiB of adapter_model.safetensors against "
        f"{sizes['big_bytes'] / 2**20:.0f} MiB of model.safetensors "
        f"({sizes['big_bytes'] / sizes['adapter_bytes']:.0f}x less to write, copy and read). "
        "The transformers engine copies the adapter tensors into PEFT's layers in place; vLLM "
        "loads the adapter under a new id and drops the old one.",
    ]
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer episodes and one repeat (a smoke run)")
    ap.add_argument("--engines", default="transformers,vllm")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    cfg = (
        {"episodes": 16, "max_tokens": 32, "concurrency": 8, "repeats": 1}
        if args.quick
        else {"episodes": 384, "max_tokens": 64, "concurrency": 16, "repeats": 5}
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        rows, sizes = asyncio.run(run_all(args.engines.split(","), cfg, Path(tmp)))
    command = "make bench" if not args.quick else "python -m bench.rollout_bench --quick"
    section = markdown(rows, sizes, cfg, command)
    print(section)
    if args.out:
        write_section(args.out, section, HEAD)


if __name__ == "__main__":
    main()
