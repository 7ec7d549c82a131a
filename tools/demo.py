"""`make demo`: the paper's protocol (§5) end to end on one CPU, every stage real.

1. data        toy-calc training and held-out tasks, disjoint, fixed by --data-seed
2. cold start  a 332k-parameter character-level Qwen3 trained on imperfect teacher traces
               (tools/cold_start.py): it succeeds on some tasks and fails on others
3. prior       `spopp prior`: 8 rollouts per training task with the cold-start policy, Jeffreys
               init with mass 8, one file shared by every run
4. runs        `spopp ablate --arms spo,spopp` (and spopp-trajnorm with --ablate): `spopp launch`
               per arm and seed, same checkpoint, tasks, prior and budget
5. report      `spopp report`: Table 1 (Table 2 with --ablate), report.json and curves.png

Every stage writes into --out and is skipped when its output is already there, so an interrupted
demo resumes where it stopped (each run resumes through `spopp launch`). The defaults were sized
for about 12 minutes on 2 cores; --quick is the same path with a shorter cold start and budget.
The seeds of the runs come from --seeds; the data, the cold start and the prior are shared.

    python -m tools.demo --out demo-out [--seeds 0,1,2] [--ablate] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tools import steps

# One episode: the toy model has 128 positions; a task needs at most 3 turns (tool, answer).
BUDGET = {"max_turns": 3, "max_tokens_per_turn": 32, "max_total_tokens": 128}

# Adapters move the output by alpha / rank * B A from B = 0: a larger step than full fine-tuning's
# (1e-4) for the same progress per update, as usual for LoRA.
LORA_LR = 1e-3

FULL = {
    "cold_start_steps": 1000, "n_train": 256, "n_heldout": 128, "max_updates": 40, "eval_every": 4,
    "eval_samples": 4, "batch_size": 32, "seeds": "0,1,2",
}  # fmt: skip
QUICK = {
    "cold_start_steps": 400, "n_train": 128, "n_heldout": 64, "max_updates": 24, "eval_every": 4,
    "eval_samples": 4, "batch_size": 32, "seeds": "0,1",
}  # fmt: skip
# The smallest path through every stage, for the end-to-end test.
TINY = {
    "cold_start_steps": 60, "n_train": 32, "n_heldout": 16, "max_updates": 4, "eval_every": 2,
    "eval_samples": 2, "batch_size": 8, "seeds": "0",
}  # fmt: skip


def base_config(out: Path, size: dict, wandb: bool) -> dict:
    """The launch config every run shares; `spopp ablate` sets recipe, seed and run per run."""
    return {
        "model": str(out / "cold-start"),
        "tasks": str(out / "data" / "train.jsonl"),
        "heldout": str(out / "data" / "heldout.jsonl"),
        "prior": str(out / "prior.json"),
        "env": "toy-calc",
        "max_updates": size["max_updates"],
        "progress_seconds": 10,
        "wandb": wandb,
        "rollout": {"engine": "transformers", "concurrency": 32, "temperature": 1.0, **BUDGET},
        # The learning rate and batch were sized with tools/toy_rl_probe.py on the cold start (not
        # on either method's result): sampled success rises within a few updates for both recipes.
        "learner": {
            "batch_size": size["batch_size"],
            "mini_batches": 2,
            "micro_batch_size": 16,
            "lr": 1e-4,
            "zero_stage": 1,
            "keep_snapshots": 2,
            "checkpoint_every": 1000,
        },  # fmt: skip
        # Sampled avg@k at T = 1: the cold start is already right most of the time when greedy.
        "evaluator": {
            "every": size["eval_every"],
            "greedy": False,
            "samples": size["eval_samples"],
            "temperature": 1.0,
            "concurrency": 64,
            **BUDGET,
        },  # fmt: skip
    }


def demo_parser(doc: str, out: str, *, seeds: str, quick: str, data_seed: str) -> argparse.ArgumentParser:
    """The demos' shared command line: --out, --seeds, --quick, --tiny, --ablate, --max-updates, --data-seed, --wandb."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(out), help="output folder")
    p.add_argument("--seeds", default=None, help=f"run seeds, comma-separated (default {seeds})")
    p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # the end-to-end test's size
    p.add_argument("--ablate", action="store_true", help="add SPO++ with trajectory normalization (Table 2)")
    p.add_argument("--max-updates", type=int, default=None, help="the budget of each run in learner updates")
    p.add_argument("--data-seed", type=int, default=0, help=data_seed)
    p.add_argument("--wandb", action="store_true", help="also log to Weights & Biases (offline)")
    return p


def add_cold_start_flag(p: argparse.ArgumentParser) -> None:
    """--cold-start DIR: the toy-calc demo's and the map's (their cold start is tools.cold_start's)."""
    p.add_argument(
        "--cold-start", type=Path, default=None, metavar="DIR",
        help="a cold start trained already (a folder of tools.cold_start): copied in instead of training one",
    )  # fmt: skip


def demo_size(a: argparse.Namespace, full: dict, quick: dict, tiny: dict) -> tuple[dict, str]:
    """(the size the flags pick, with --max-updates applied; the run seeds as "0,1,2")."""
    size = dict(tiny if a.tiny else quick if a.quick else full)
    if a.max_updates is not None:
        size["max_updates"] = a.max_updates
    # `make demo SEEDS="3 4 5"` or --seeds 3,4,5
    return size, ",".join((a.seeds or size["seeds"]).replace(",", " ").split())


def begin(a: argparse.Namespace, full: dict, quick: dict, tiny: dict) -> tuple[dict, str, Path, float]:
    """What every demo does first: its size and seeds from the flags, its output folder (made), the
    start time, one torch thread for every process it starts."""
    size, seeds = demo_size(a, full, quick, tiny)
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return size, seeds, out, time.monotonic()


def make_prior(out: Path, *, env: str, rollouts: int, concurrency: int, seed: int, budget: dict,
               extra: tuple[str, ...] = ()) -> None:  # fmt: skip
    """`spopp prior` with the cold-start policy on the training tasks, Jeffreys mass 8, into out/prior.json."""
    steps.run([sys.executable, "-m", "services.cli", "prior", "--model", str(out / "cold-start"),
          "--tasks", str(out / "data" / "train.jsonl"), "--out", str(out / "prior.json"),
          "--env", env, *extra, "--engine", "transformers", "--rollouts", str(rollouts), "--prior-mass", "8",
          "--concurrency", str(concurrency), "--seed", str(seed),
          *[f"--{k.replace('_', '-')}={v}" for k, v in budget.items()]])  # fmt: skip


def run_and_report(out: Path, config: dict, *, seeds: str, ablate: bool, max_updates: int) -> int:
    """Stages 4 and 5: `spopp ablate` over the arms and seeds with `config`, then the learning check."""
    arms = "spo,spopp-trajnorm,spopp" if ablate else "spo,spopp"
    n_runs = len(arms.split(",")) * len(seeds.split(","))
    steps.say(f"4/5 runs: {n_runs} runs ({arms} x seeds {seeds}), {max_updates} updates each")
    path = out / "launch.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    code = subprocess.run([sys.executable, "-m", "services.cli", "ablate", str(path), "--seeds", seeds,
                           "--arms", arms, "--out", str(out)]).returncode  # fmt: skip
    if code != 0:
        steps.say(f"the runs stopped with exit code {code}; run the same command again to resume")
        return code
    steps.say("5/5 report (printed above by `spopp report`)")
    report = json.loads((out / "report.json").read_text())
    for line in learning_check(report):
        steps.say(line)
    return 0


def prepare(
    out: Path, size: dict, data_seed: int, max_positions: int = 128, cold_start: Path | None = None
) -> None:
    """Stages 1-3, each skipped when its output is there: the tasks, the cold start (with a context
    of `max_positions`, or a copy of `cold_start`, a folder trained already), the prior."""
    from runtime.envs.toy_calc import write_toy_calc_tasks

    steps.say(f"1/5 data: {size['n_train']} training and {size['n_heldout']} held-out toy-calc tasks")
    if not (out / "data" / "heldout.jsonl").is_file():
        write_toy_calc_tasks(
            out / "data", seed=data_seed, n_train=size["n_train"], n_heldout=size["n_heldout"]
        )

    if cold_start is not None:
        copy_cold_start(cold_start, out / "cold-start", max_positions)
    else:
        steps.say(f"2/5 cold start: {size['cold_start_steps']} supervised steps on imperfect teacher traces")
    if not (out / "cold-start" / "cold_start.json").is_file():
        steps.run([sys.executable, "-m", "tools.cold_start", "--out", str(out / "cold-start"), "--seed", str(data_seed),
              "--steps", str(size["cold_start_steps"]), "--eval-tasks", "0", "--log-every", "250",
              "--max-positions", str(max_positions)])  # fmt: skip

    steps.say("3/5 prior: 8 rollouts per training task with the cold-start policy, Jeffreys mass 8")
    if not (out / "prior.json").is_file():
        make_prior(out, env="toy-calc", rollouts=8, concurrency=64, seed=data_seed, budget=BUDGET)


def copy_cold_start(source: Path, target: Path, max_positions: int) -> None:
    """Stage 2 from a folder trained already: checked (a tools.cold_start folder, with the context
    the episodes need) and copied, unless the output has its cold start already."""
    import shutil

    if (target / "cold_start.json").is_file():
        return
    if not (source / "cold_start.json").is_file():
        raise SystemExit(f"demo: --cold-start {source}: not a cold start (no cold_start.json there)")
    positions = json.loads((source / "config.json").read_text())["max_position_embeddings"]
    if positions < max_positions:
        raise SystemExit(
            f"demo: --cold-start {source}: {positions} positions, the episodes need {max_positions}"
        )
    report = json.loads((source / "cold_start.json").read_text())
    steps.say(f"2/5 cold start: copied from {source} ({report['steps']} steps trained there)")
    shutil.copytree(source, target.with_name(target.name + ".copying"), dirs_exist_ok=True)
    target.with_name(target.name + ".copying").rename(target)


def finish(out: Path, t0: float) -> None:
    steps.say(f"done in {time.monotonic() - t0:.0f} s")
    print(f"demo output: {out}")
    print(f"  {out / 'report.md'}\n  {out / 'report.json'}\n  {out / 'curves.png'}")


def main(argv: list[str] | None = None) -> int:
    p = demo_parser(__doc__, "demo-out", seeds="0,1,2; quick 0,1", quick="the same path, smaller (about 3.5 minutes on 2 idle cores)",
                    data_seed="seed of the tasks and the cold start")  # fmt: skip
    p.add_argument(
        "--lora", type=int, default=0, metavar="RANK",
        help="train rank-RANK LoRA adapters on the frozen cold start (snapshots carry the adapters alone)",
    )  # fmt: skip
    add_cold_start_flag(p)
    a = p.parse_args(argv)
    size, seeds, out, t0 = begin(a, FULL, QUICK, TINY)
    prepare(out, size, a.data_seed, cold_start=a.cold_start)
    config = base_config(out, size, a.wandb)
    if a.lora:
        steps.say(f"LoRA: rank {a.lora} adapters on every linear layer, alpha {2 * a.lora}, lr {LORA_LR}")
        config["learner"].update(lora_rank=a.lora, lora_alpha=2.0 * a.lora, lr=LORA_LR)
    code = run_and_report(out, config, seeds=seeds, ablate=a.ablate, max_updates=size["max_updates"])
    if code == 0:
        finish(out, t0)
    return code


def learning_check(report: dict) -> list[str]:
    """Per arm, the mean over its runs of (final-five mean − first evaluation): did it learn?"""
    by_arm: dict[str, list[float]] = {}
    for run in report["runs"]:
        r = run["rewards"]
        if r:
            by_arm.setdefault(run["arm"], []).append(sum(r[-5:]) / len(r[-5:]) - r[0])
    return [
        f"{arm}: final-five mean - first evaluation = {sum(v) / len(v):+.3f} (mean over {len(v)} runs)"
        for arm, v in sorted(by_arm.items())
    ]


if __name__ == "__main__":
    raise SystemExit(main())
