"""ALFWorld: how fast the environment steps, and how an episode's time splits between it and the engine.

- Steps/s: the package's engine stack called directly (`raw`: `PddlEnv` under the demangler, no
  lock, one thread) against our plug-in (`AlfworldEnv.step`: action parsing, the process-wide
  lock, the observation text), on the same games and the same commands (each game's planner
  walkthrough, then `look` up to a fixed number of steps). Resets (game loads) are timed apart.
- Episodes at once: the plug-in's aggregate steps/s (game loads included) with 1, 2 and 4
  episodes in threads, in-process (one lock: the engine is not thread-safe) and with a pool of 2
  engine processes (`workers: 2`).
- Episode time: whole episodes through `runtime.agent.run_episode` with a real engine (the tiny
  model, which has never seen ALFWorld, so its actions are mostly invalid and episodes run to the
  interaction limit), `concurrency` at once. Shares of the summed episode time spent generating
  (`generate_s`), in the environment (`env_s`, game load included) and elsewhere.

    python -m bench.alfworld_bench [--quick] [--out BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.tracker_bench import write_section

HEAD = "## ALFWorld: environment steps and the episode's time split"
# The tiny model's positions; the episode split plays small games (4 receptacles, 2 distractors) so
# that up to EPISODE_STEPS interactions fit.
MAX_LEN = 1024
EPISODE_STEPS = 6


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _scripts(tasks, walks, steps: int) -> list[list[str]]:
    """Per task: its walkthrough without the last command (so the game is not won), then `look`s."""
    out = []
    for t in tasks:
        walk = walks[t.task_id][:-1]
        out.append((walk + ["look"] * steps)[:steps])
    return out


def raw_steps(gamefiles: list[Path], scripts: list[list[str]]) -> tuple[float, float]:
    """(steps/s, median reset s) of the package's stack called directly."""
    import textworld
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
    from textworld.envs import PddlEnv

    infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])
    env = AlfredInfos(AlfredDemangler(PddlEnv(infos), shuffle=False))
    resets, n, spent = [], 0, 0.0
    for gf, script in zip(gamefiles, scripts, strict=True):
        t0 = time.perf_counter()
        env.load(str(gf))
        env.reset()
        resets.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for command in script:
            env.step(command)
        spent += time.perf_counter() - t0
        n += len(script)
    env.close()
    return n / spent, statistics.median(resets)


def plugin_steps(tasks, scripts) -> tuple[float, float]:
    """(steps/s, median reset s) of AlfworldEnv on the same games and commands."""
    from runtime.envs.alfworld.env import AlfworldEnv

    env = AlfworldEnv(max_steps=10_000)
    resets, n, spent = [], 0, 0.0
    for task, script in zip(tasks, scripts, strict=True):
        t0 = time.perf_counter()
        env.reset(task)
        resets.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for command in script:
            env.step(command)
        spent += time.perf_counter() - t0
        n += len(script)
    env.close()
    return n / spent, statistics.median(resets)


def threaded_episodes(tasks, scripts, threads: int, workers: int) -> float:
    """Aggregate steps/s, game loads included, of every game played once by `threads` threads at once
    (thread i plays games i, i + threads, ...): the same work whatever the thread count.

    workers=0: the plug-in in this process (one lock); workers=N: a pool of N engine processes.
    """
    from runtime.envs.alfworld.engine import engine_pool
    from runtime.envs.alfworld.env import AlfworldEnv

    if workers:
        engine_pool(workers)  # started before the clock, as a replica starts it once
    start = threading.Barrier(threads + 1)

    def play(offset):
        env = AlfworldEnv(max_steps=10_000, workers=workers)
        start.wait()
        for k in range(offset, len(tasks), threads):
            env.reset(tasks[k])
            for command in scripts[k]:
                env.step(command)
        env.close()

    pool = [threading.Thread(target=play, args=(i,)) for i in range(threads)]
    for w in pool:
        w.start()
    start.wait()
    t0 = time.perf_counter()
    for w in pool:
        w.join()
    return sum(len(s) for s in scripts) / (time.perf_counter() - t0)


async def episode_split(
    kind: str, model: Path, tasks, episodes: int, concurrency: int, max_steps: int
) -> dict:
    from runtime.agent import run_episode
    from runtime.chat import ChatRenderer
    from runtime.engines.base import SamplingConfig
    from runtime.engines.factory import make_engine
    from runtime.envs.alfworld.env import AlfworldEnv
    from runtime.episode import Budget

    kwargs = {"max_model_len": MAX_LEN} if kind == "vllm" else {}
    engine = make_engine(kind, model, **kwargs)
    renderer = ChatRenderer(engine.tokenizer)
    budget = Budget(max_turns=max_steps, max_tokens_per_turn=16, max_total_tokens=MAX_LEN)
    gate = asyncio.Semaphore(concurrency)

    async def one(i):
        async with gate:
            env = AlfworldEnv(max_steps=max_steps)
            try:
                sampling = SamplingConfig(max_tokens=16, temperature=1.0, seed=i)
                return await run_episode(engine, env, tasks[i % len(tasks)], budget, sampling, renderer)
            finally:
                env.close()

    try:
        t0 = time.perf_counter()
        eps = await asyncio.gather(*(one(i) for i in range(episodes)))
        wall = time.perf_counter() - t0
    finally:
        await engine.close()
    total = sum(e.timings["total_s"] for e in eps)
    gen = sum(e.timings["generate_s"] for e in eps)
    env = sum(e.timings["env_s"] for e in eps)
    reset = sum(e.timings["reset_s"] for e in eps)
    return {
        "engine": kind, "episodes": episodes, "wall_s": wall, "turns": sum(e.num_turns for e in eps),
        "gen": gen / total, "env": env / total, "reset": reset / total, "other": 1 - (gen + env) / total,
        "steps_per_s": sum(e.num_turns for e in eps) / wall,
    }  # fmt: skip


def markdown(r: dict, command: str) -> str:
    lines = [
        HEAD, "",
        f"Command: `{command}` on {platform.machine()}, Python {platform.python_version()}, one torch thread, "
        f"{time.strftime('%Y-%m-%d')}. {r['games']} generated games (every task type), each played with its "
        f"walkthrough less the winning command, then `look`, {r['steps']} commands a game. `raw`: the package's "
        "`PddlEnv` stack called directly, in the same run on the same games and commands.", "",
        "| measure | raw engine | plug-in | plug-in/raw |", "| --- | ---: | ---: | ---: |",
        f"| steps/s, one episode | {r['raw_sps']:.1f} | {r['plugin_sps']:.1f} | {r['plugin_sps'] / r['raw_sps']:.2f} |",
        f"| median reset (game load) s | {r['raw_reset']:.3f} | {r['plugin_reset']:.3f} | "
        f"{r['plugin_reset'] / r['raw_reset']:.2f} |",
        "",
        f"Episodes at once: every game played once (load and {r['steps']} commands), split over the threads; steps/s with "
        f"the loads' time included. `in-process`: one engine lock (the default); `pool of {r['workers']}`: "
        f"`workers: {r['workers']}`, games in {r['workers']} engine processes.", "",
        f"| episodes at once | in-process steps/s | pool of {r['workers']} steps/s | pool/in-process |",
        "| ---: | ---: | ---: | ---: |",
    ]  # fmt: skip
    for k, (local, pooled) in r["threads"].items():
        lines.append(f"| {k} | {local:.1f} | {pooled:.1f} | {pooled / local:.2f} |")
    lines += [
        "",
        f"Whole episodes (`run_episode`, up to {r['max_steps']} interactions, {r['concurrency']} at once, the "
        f"tiny model ({MAX_LEN} positions), T = 1, small games: 4 receptacles, 2 distractors): shares of the "
        "summed episode time.",
        "",
        "| engine | episodes | turns | env steps/s | generating | environment | of which game loads | other |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in r["split"]:
        lines.append(
            f"| {s['engine']} | {s['episodes']} | {s['turns']} | {s['steps_per_s']:.1f} | {s['gen']:.2f} | "
            f"{s['env']:.2f} | {s['reset']:.2f} | {s['other']:.2f} |"
        )
    lines += [
        "",
        "In-process, one lock serializes every engine call (the package's parsers are module-global and "
        "fast-downward rewrites `sys.argv`), so more episodes at once add no steps/s. A pool plays games in "
        "separate processes, so it can use as many cores as it has workers, at the cost of a pipe round trip "
        "per call; with no core to spare (this machine has 2, shared with the caller and whatever else runs) "
        "that cost is all it adds. Concurrent episodes overlap, so a share is of summed episode time, not of "
        "wall time.",
        "",
    ]
    return "\n".join(lines)


def run(quick: bool, engines: list[str]) -> dict:
    from runtime.envs.alfworld.games import GAME_FILE, read_game, write_alfworld_tasks
    from runtime.envs.alfworld.generate import generate_games
    from runtime.tasks import load_tasks
    from tools.tiny_model import build_tiny_model

    steps = 20 if quick else 40
    with tempfile.TemporaryDirectory(prefix="alfworld-bench-") as tmp:
        root = Path(tmp)
        _progress("generating games")
        generate_games(root / "data", seed=0, per_type=1 if quick else 2, split="train")
        write_alfworld_tasks(root / "data", root / "data" / "train_seed0.txt", root / "tasks.jsonl")
        tasks = load_tasks(root / "tasks.jsonl")
        gamefiles = [root / "data" / "json_2.1.1" / t.answer / GAME_FILE for t in tasks]
        walks = {t.task_id: read_game(g).walkthrough for t, g in zip(tasks, gamefiles, strict=True)}
        scripts = _scripts(tasks, walks, steps)
        r = {"games": len(tasks), "steps": steps}
        raws, plugs = [], []
        for rep in range(3):  # alternate, so drift on a shared machine hits both
            _progress(f"steps/s, repeat {rep + 1} of 3")
            raws.append(raw_steps(gamefiles, scripts))
            plugs.append(plugin_steps(tasks, scripts))
        r["raw_sps"] = statistics.median(x[0] for x in raws)
        r["raw_reset"] = statistics.median(x[1] for x in raws)
        r["plugin_sps"] = statistics.median(x[0] for x in plugs)
        r["plugin_reset"] = statistics.median(x[1] for x in plugs)
        r["threads"], r["workers"] = {}, 2
        for k in (1, 2, 4):
            _progress(f"{k} episodes at once")
            local = [threaded_episodes(tasks, scripts, k, 0) for _ in range(2)]
            pooled = [threaded_episodes(tasks, scripts, k, r["workers"]) for _ in range(2)]
            r["threads"][k] = (statistics.median(local), statistics.median(pooled))
        model = build_tiny_model(root / "tiny")
        generate_games(
            root / "small", seed=0, per_type=2, split="train", max_receptacles=4, max_distractors=2
        )
        write_alfworld_tasks(root / "small", root / "small" / "train_seed0.txt", root / "small.jsonl")
        small = load_tasks(root / "small.jsonl")
        r["max_steps"], r["concurrency"] = EPISODE_STEPS, 8
        r["split"] = []
        for kind in engines:
            _progress(f"episodes with {kind}")
            r["split"].append(
                asyncio.run(episode_split(kind, model, small, 16 if quick else 48, 8, r["max_steps"]))
            )
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer games, steps and episodes (a smoke run)")
    ap.add_argument("--engines", default="transformers,vllm", help="engines of the episode split")
    ap.add_argument("--out", type=Path, help="write the section into this markdown file")
    args = ap.parse_args()
    r = run(args.quick, [e for e in args.engines.split(",") if e])
    command = "make bench" if not args.quick else "python -m bench.alfworld_bench --quick"
    section = markdown(r, command)
    print(section)
    if args.out:
        write_section(args.out, section, HEAD)


if __name__ == "__main__":
    main()
