"""`make map`: when does SPO++ beat SPO? The demo's setting on a grid of toy-calc's two knobs.

1. data, cold start and prior: the demo's stages (tools/demo.py), in --out, each skipped when done;
2. `spopp map` with the pilot rule (services/study/protocol.py): the four arms (SPO, + event-time
   evidence, + Dual-Clip 2, + the action-token measure = SPO++) on the pilot's seeds in every cell of
   coupling {-1, 0, +1} x latency sigma {0, 1.5}, from the same cold start, prior and budget;
3. from the pilot's SPO++ − SPO s.d. per cell, each cell's n of main seeds (fresh ones), written to
   protocol.json before the main runs, within what the budget leaves;
4. the main runs, then map.json, map.md and map.png in --out (`spopp map --render` redraws them).

The budget leaves room for the coupled side's extra turns: 6 turns of at most 32 tokens, 256 in
all, for the replicas and the evaluator alike, in every cell; the cold start is the demo's with a
context of 256 positions (its rotary positions have no learned table: below 128 it is the same
model). A stopped map resumes; its protocol is read back, never decided again.

The environment is time-neutral (toy-calc's `time_neutral`): the uncoupled side waits at its end
for as long as a recent padded episode spent padding. Without it the padded side also comes back
later, so the learner's first-completed batches hold fewer of it: at coupling +1 its batches held
0.24 reward against 0.44 held out, runs stalled or not by the luck of their first batches, and the
cell's standard error stayed near 4.6 area points over 3 seeds (1.9 over 7); time-neutral, 0.6 over
3. Coupling then changes lengths only, and the order outcomes come back in is latency's alone.

    python -m tools.map --out map-out [--pilot-seeds 1000,1001] [--coupling -1,0,1] [--latency 0,1.5]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from services.study.map import N_MIN, SE_TARGET
from tools import steps
from tools.demo import FULL, TINY, add_cold_start_flag, base_config, prepare

# Room for the extra turns on the coupled side (toy-calc's extra_turns, 3 by default).
MAP_BUDGET = {"max_turns": 6, "max_tokens_per_turn": 32, "max_total_tokens": 256}
# The end-to-end test's size: the demo's tiny one, with a cold start long enough to succeed about
# a third of the time (60 steps never do, and without successes no length can co-vary with them).
MAP_TINY = {**TINY, "cold_start_steps": 250, "max_updates": 3, "eval_every": 1}
# The map's run: the demo's cold start, data and batch, 8 updates with evaluations of the 128
# held-out tasks x 2 samples at versions 0, 2, 4, 6, 8. Sized for the budget: the pilot (SPO and
# SPO++, 2 seeds) and at least 3 main seeds of 4 arms in 6 cells are 96 runs, and a run is about
# 25 s of start-up (four processes) plus its updates and evaluations; the earlier map's 16 updates
# with 128 x 3 at every 4th version took 60 to 110 s a run, 160 minutes for these 96.
MAP_SIZE = {**FULL, "max_updates": 8, "eval_every": 2, "eval_samples": 2}
# The pilot's seeds: never a main seed (those start at 0).
PILOT_SEEDS = "1000,1001"
# What `make map` may take on 2 cores, cold start, pilot and main runs together.
BUDGET_MINUTES = 150.0


def map_config(out: Path, size: dict) -> dict:
    config = base_config(out, size, wandb=False)
    config["rollout"].update(MAP_BUDGET)
    # One batch in flight, as in the demo (32 and 32): with more, the first-completed batch would
    # be ever more of the quickest episodes, the coupled side's padding making it slower.
    config["rollout"]["concurrency"] = size["batch_size"]
    config["evaluator"].update(MAP_BUDGET)
    # Under latency a drain waits for slow episodes; a progress line every 30 s is plenty.
    config["progress_seconds"] = 30
    return config


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("map-out"), help="output folder")
    p.add_argument("--pilot-seeds", default=PILOT_SEEDS, help=f"the pilot's seeds (default {PILOT_SEEDS})")
    p.add_argument(
        "--seeds", default=None, help="fixed seeds in every cell instead of a pilot (the end-to-end test's)"
    )
    p.add_argument("--coupling", default="-1,0,1", help="coupling levels (default -1,0,1)")
    p.add_argument("--latency", default="0,1.5", help="latency sigma levels (default 0,1.5)")
    p.add_argument(
        "--arms",
        default="spo,spo-eventtime,spopp-trajnorm,spopp",
        help="arms (default the four of the chain)",
    )
    p.add_argument(
        "--latency-median", type=float, default=0.02, help="median of the delay, seconds (default 0.02)"
    )
    p.add_argument(
        "--time-neutral", action=argparse.BooleanOptionalAction, default=True,
        help="the uncoupled side waits out the coupled side's padding, so that coupling changes lengths and not "
        "the order outcomes arrive in (default on; --no-time-neutral: the padded side also arrives later)",
    )  # fmt: skip
    p.add_argument(
        "--max-updates", type=int, default=None, help="the budget of each run in learner updates (default 8)"
    )
    p.add_argument("--eval-every", type=int, default=None, help="versions between evaluations (default 2)")
    p.add_argument("--eval-samples", type=int, default=None, help="samples per held-out task (default 2)")
    p.add_argument(
        "--target-se",
        type=float,
        default=SE_TARGET,
        help=f"the s.e. each cell's n aims at (default {SE_TARGET})",
    )
    p.add_argument(
        "--n-min", type=int, default=N_MIN, help=f"the fewest main seeds of a cell (default {N_MIN})"
    )
    p.add_argument(
        "--budget-minutes", type=float, default=BUDGET_MINUTES,
        help=f"minutes for the whole map, cold start included; the pilot's run times price the main runs (default {BUDGET_MINUTES:g})",
    )  # fmt: skip
    add_cold_start_flag(p)
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # the end-to-end test's size
    light = p.add_mutually_exclusive_group()
    light.add_argument("--pack", type=Path, metavar="DIR",
                       help="only copy the map's light files (no weights) from --out into DIR (tools/map_pack.py)")  # fmt: skip
    light.add_argument("--unpack", type=Path, metavar="DIR",
                       help="only copy a light copy in DIR back into --out, to resume from it")  # fmt: skip
    return p


def _light(a: argparse.Namespace) -> int:
    """--pack or --unpack."""
    from tools.map_pack import PackError, pack, unpack

    try:
        if a.pack:
            copied, runs = pack(a.out.resolve(), a.pack)
            steps.say(f"packed {runs} finished run(s) of {a.out} into {a.pack}: {copied} file(s) copied")
        else:
            copied = unpack(a.unpack, a.out.resolve())
            steps.say(
                f"unpacked {a.unpack} into {a.out}: {copied} file(s) copied; the same command without --unpack resumes"
            )
    except PackError as exc:
        steps.say(f"error: {exc}")
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.pack or a.unpack:
        return _light(a)
    size = dict(MAP_TINY if a.tiny else MAP_SIZE)
    for key, value in (
        ("max_updates", a.max_updates),
        ("eval_every", a.eval_every),
        ("eval_samples", a.eval_samples),
    ):
        if value is not None:
            size[key] = value
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.monotonic()
    prepare(out, size, data_seed=0, max_positions=MAP_BUDGET["max_total_tokens"], cold_start=a.cold_start)
    config = map_config(out, size)
    config["env_options"] = {"latency_median_s": a.latency_median, "time_neutral": a.time_neutral}
    path = out / "map.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    seeds = f"seeds {a.seeds}" if a.seeds else f"pilot seeds {a.pilot_seeds}, then n per cell from the pilot"
    steps.say(f"4/5 map: arms {a.arms} x {seeds} x coupling {a.coupling} x latency {a.latency}")
    args = [sys.executable, "-m", "services.cli", "map", str(path), "--arms", a.arms,
            f"--coupling={a.coupling}", f"--latency={a.latency}", "--out", str(out)]  # fmt: skip
    if a.seeds:
        args += ["--seeds", a.seeds]
    else:
        # What the preparation left of the budget (a resumed map's preparation is a few seconds).
        left = max(1.0, a.budget_minutes - (time.monotonic() - t0) / 60)
        args += ["--pilot-seeds", a.pilot_seeds, "--target-se", str(a.target_se), "--n-min", str(a.n_min),
                 "--budget-minutes", f"{left:.1f}"]  # fmt: skip
    code = subprocess.run(args).returncode
    if code != 0:
        steps.say(f"the map stopped with exit code {code}; run the same command again to resume")
        return code
    steps.say(
        f"5/5 done in {time.monotonic() - t0:.0f} s: {out / 'map.md'}, {out / 'map.json'}, {out / 'map.png'}"
    )
    print((out / "map.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
