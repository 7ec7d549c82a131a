"""Collection under heavy-tailed tool latency: single-stream (spopp) against group-synchronous.

The same engine (the tiny model, transformers), the same number of slots and the same learner
batch collect 4 batches two ways:

- single-stream: every slot runs an episode of its own task; a slot that frees starts the next
  task at once; a batch is the first B trajectories to finish (what spopp's learner consumes);
- group-synchronous: a round is B/8 tasks with 8 samples each (GRPO-style groups); the next
  round is dispatched only when every trajectory of this one is back.

Episodes are 3 turns of up to 16 tokens. After each turn the environment answers after a tool
latency drawn from a lognormal (median 0.1 s, sigma 0.5 / 1 / 1.5), slept in the environment's
thread as a real tool would block; draws are fixed per (task, sample, turn), so both ways see
the same latencies. Reported, as ratios from one run: time to collect, slot occupancy (mean
running episodes / slots over the wall time) and the engine's busy fraction (share of the wall
time with at least one generation running).

    python -m bench.collection_bench [--quick] [--out BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

from bench.tracker_bench import write_section
from runtime.agent import reserve_env_threads, run_episode
from runtime.chat import ChatRenderer
from runtime.engines.base import Engine, SamplingConfig
from runtime.envs.base import Environment, StepResult, Task
from runtime.episode import Budget

HEAD = "## Collection under heavy-tailed tool latency: single-stream against group-synchronous"
MEDIAN_S = 0.1
TURNS = 3
GROUP = 8


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class SlowToolEnv(Environment):
    """TURNS turns; each answer comes after a lognormal tool latency fixed by (task, sample, turn)."""

    name = "slow-tool"
    # Turns end at the first of these, so every turn ends by a stop, not by the token budget (which
    # would end the episode): the tiny model writes them within a few tokens.
    stop = (" ", "\n", "(", ">", "}")

    def __init__(self, sigma: float, sample: int) -> None:
        self.sigma, self.sample = sigma, sample
        self.turn = 0
        self.task: Task | None = None

    def reset(self, task: Task) -> list[dict]:
        self.task, self.turn = task, 0
        return [{"role": "user", "content": task.prompt}]

    def step(self, action: str) -> StepResult:
        self.turn += 1
        rng = random.Random(f"{self.task.task_id}:{self.sample}:{self.turn}:{self.sigma}")
        time.sleep(math.exp(math.log(MEDIAN_S) + self.sigma * rng.gauss(0.0, 1.0)))
        if self.turn >= TURNS:
            return StepResult([], done=True, reward=float(rng.random() < 0.5), info={"finish": "done"})
        return StepResult([{"role": "tool", "content": f"<output>{self.turn}</output>"}], done=False)


class Meter:
    """Time-weighted counts of running episodes and running generations."""

    def __init__(self) -> None:
        self.t0 = self.last = time.perf_counter()
        self.episodes = self.generating = 0
        self.episode_area = self.busy = 0.0
        self.turns: list[int] = []  # per finished episode; 0 when a budget cut it

    def _tick(self) -> None:
        now = time.perf_counter()
        self.episode_area += self.episodes * (now - self.last)
        self.busy += (now - self.last) if self.generating else 0.0
        self.last = now

    def episode(self, d: int) -> None:
        self._tick()
        self.episodes += d

    def generation(self, d: int) -> None:
        self._tick()
        self.generating += d

    def wall(self) -> float:
        self._tick()
        return self.last - self.t0


class MeteredEngine(Engine):
    def __init__(self, inner: Engine, meter: Meter) -> None:
        self.inner, self.meter, self.tokenizer = inner, meter, inner.tokenizer

    async def generate(self, prompt_ids, sampling):
        self.meter.generation(+1)
        try:
            return await self.inner.generate(prompt_ids, sampling)
        finally:
            self.meter.generation(-1)

    async def load_weights(self, snapshot_dir) -> None:
        await self.inner.load_weights(snapshot_dir)

    async def close(self) -> None:
        pass


async def _episode(engine, renderer, task, sample, sigma, meter, seed) -> None:
    meter.episode(+1)
    try:
        sampling = SamplingConfig(max_tokens=32, temperature=1.0, seed=seed)
        env = SlowToolEnv(sigma, sample)
        ep = await run_episode(engine, env, task, Budget(TURNS, 32, 512), sampling, renderer)
        meter.turns.append(ep.num_turns if ep.finish_reason == "done" else 0)
    finally:
        meter.episode(-1)


async def single_stream(inner, renderer, tasks, slots, batch, batches, sigma) -> dict:
    meter = Meter()
    engine = MeteredEngine(inner, meter)
    want, done, started = batch * batches, 0, 0
    running: set[asyncio.Task] = set()
    while done < want:
        while len(running) < slots:
            task = tasks[started % len(tasks)]  # every slot its own task, as the tracker samples them
            running.add(asyncio.create_task(_episode(engine, renderer, task, 0, sigma, meter, started)))
            started += 1
        finished, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
        done += len(finished)
    wall = meter.wall()
    for t in running:  # what is still running belongs to the next batch
        t.cancel()
    await asyncio.gather(*running, return_exceptions=True)
    return {
        "wall": wall, "occupancy": meter.episode_area / wall / slots, "busy": meter.busy / wall,
        "whole": sum(t == TURNS for t in meter.turns) / max(1, len(meter.turns)),
    }  # fmt: skip


async def group_sync(inner, renderer, tasks, slots, batch, batches, sigma) -> dict:
    meter = Meter()
    engine = MeteredEngine(inner, meter)
    gate = asyncio.Semaphore(slots)
    per_round = batch // GROUP

    async def one(task, sample, seed):
        async with gate:
            await _episode(engine, renderer, task, sample, sigma, meter, seed)

    for r in range(batches):
        group = [tasks[(r * per_round + i) % len(tasks)] for i in range(per_round)]
        # The next round waits for the whole batch: the slowest group member holds everyone.
        await asyncio.gather(
            *(one(t, s, r * batch + i * GROUP + s) for i, t in enumerate(group) for s in range(GROUP))
        )
    wall = meter.wall()
    return {
        "wall": wall, "occupancy": meter.episode_area / wall / slots, "busy": meter.busy / wall,
        "whole": sum(t == TURNS for t in meter.turns) / max(1, len(meter.turns)),
    }  # fmt: skip


def run(quick: bool) -> dict:
    from runtime.engines.factory import make_engine
    from tools.tiny_model import build_tiny_model

    slots, batch, batches = 16, 32, 4
    sigmas = (0.5, 1.5) if quick else (0.5, 1.0, 1.5)
    tasks = [Task(f"t{i}", f"Compute {i} * 7 + 3 with the tool.", str(i * 7 + 3)) for i in range(512)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="collection-bench-") as tmp:
        model = build_tiny_model(Path(tmp) / "tiny")
        engine = make_engine("transformers", model)
        renderer = ChatRenderer(engine.tokenizer)

        async def measure():
            reserve_env_threads(slots)
            for sigma in sigmas:
                _progress(f"sigma {sigma}: single-stream")
                ss = await single_stream(engine, renderer, tasks, slots, batch, batches, sigma)
                _progress(f"sigma {sigma}: group-synchronous")
                gs = await group_sync(engine, renderer, tasks, slots, batch, batches, sigma)
                rows.append({"sigma": sigma, "ss": ss, "gs": gs})
            await engine.close()

        asyncio.run(measure())
    return {"rows": rows, "slots": slots, "batch": batch, "batches": batches}


def markdown(r: dict, command: str) -> str:
    lines = [
        HEAD, "",
        f"Command: `{command}` on {platform.machine()}, Python {platform.python_version()}, one torch thread, "
        f"{time.strftime('%Y-%m-%d')}. The tiny model on the transformers engine, {r['slots']} slots, "
        f"{r['batches']} batches of {r['batch']} trajectories; episodes of {TURNS} turns, each answered after a "
        f"lognormal tool latency (median {MEDIAN_S} s), the same draws for both. Group-synchronous: "
        f"{r['batch'] // GROUP} tasks x {GROUP} samples a round, the next round once the whole batch is back.", "",
        "| sigma | single-stream s | group-sync s | time ratio (group/single) | occupancy single | occupancy group "
        "| engine busy single | engine busy group | episodes of 3 turns |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]  # fmt: skip
    for row in r["rows"]:
        ss, gs = row["ss"], row["gs"]
        lines.append(
            f"| {row['sigma']} | {ss['wall']:.1f} | {gs['wall']:.1f} | {gs['wall'] / ss['wall']:.2f} | "
            f"{ss['occupancy']:.2f} | {gs['occupancy']:.2f} | {ss['busy']:.2f} | {gs['busy']:.2f} | "
            f"{min(ss['whole'], gs['whole']):.2f} |"
        )
    lines += [
        "",
        "Single-stream keeps every slot busy and takes the first trajectories to finish; a synchronous round "
        "ends with its slowest episode, so its slots idle through the tail, more so the heavier the tail.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="two sigmas (a smoke run)")
    ap.add_argument("--out", type=Path, help="write the section into this markdown file")
    args = ap.parse_args()
    r = run(args.quick)
    section = markdown(r, "make bench" if not args.quick else "python -m bench.collection_bench --quick")
    print(section)
    if args.out:
        write_section(args.out, section, HEAD)


if __name__ == "__main__":
    main()
