"""`spopp map CONFIG --out DIR`: when does SPO++ beat SPO? Paired runs over a grid of two knobs.

The knobs are toy-calc's (runtime/envs/toy_calc.py): `coupling`, how a response's length
co-varies with its success, and `latency_sigma`, a heavy-tailed environment delay that brings
outcomes back after newer policies were published (`make map` also sets `time_neutral`, so that
the coupled side's extra turns do not also make it arrive later). Each cell of the grid is the base
config with those two env_options set and nothing else changed; in each cell every arm runs on
every seed from the same checkpoint, prior and budget. The arms walk from SPO to SPO++ one change
at a time (spopp/compare/arms.py), so each step's paired difference is that change alone.

How many seeds each cell gets is fixed before its main runs (protocol.py): by a pilot on seeds
of its own, or the given seeds. Pilot runs go into `<out>/pilot/cells/<cell>/runs/<arm>-s<seed>/`,
main runs into `<out>/cells/...`, one after another; a stopped map resumes (finished runs are
skipped, an unfinished one resumes, the protocol is read back). Within a cell, the i-th seed runs
the arms in the given order rotated by i (`arm_order`), so that a drift of the machine's load over
a map falls on every arm alike rather than always on the last one. Then map.json (summary.py:
every run's area, each paired difference with its t interval, t test, sign test and Holm's
adjustment over the cells, a pooled test per comparison, the protocol, the machine and the
times), map.md and map.png (render.py).
"""

from __future__ import annotations

import math
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.config.launch import LaunchSettings

from .compare import arm_settings, run_in_turn
from .protocol import PROTOCOL, decide, fixed
from .protocol import read as read_protocol
from .protocol import write as write_protocol
from .render import write
from .summary import TOTAL, across_cells, diff_key, run_times, summarize_cell

SE_TARGET = 1.5  # area points: the standard error the design aims each cell's SPO++ − SPO at
N_MIN = 3  # seeds a cell gets at least: 2 degrees of freedom for its t interval
PILOT = "pilot"


def cell_name(coupling: float, latency: float) -> str:
    return f"coupling{coupling:+g}-latency{latency:g}"


def cell_settings(base: LaunchSettings, coupling: float, latency: float) -> LaunchSettings:
    """The base config with the two knobs set in env_options, and nothing else changed."""
    if base.env != "toy-calc":
        raise ValueError(f"spopp map needs env toy-calc (its knobs), the base config has {base.env}")
    values = base.model_dump()
    values["env_options"] = {**base.env_options, "coupling": coupling, "latency_sigma": latency}
    return LaunchSettings.model_validate(values)


def cells(couplings: list[float], latencies: list[float]) -> list[tuple[str, float, float]]:
    """(name, coupling, latency) of every cell, latency-major (the order of map.json's cells)."""
    return [(cell_name(c, lat), c, lat) for lat in latencies for c in couplings]


def arm_order(arms: list[str], index: int) -> list[str]:
    """The order the `index`-th seed of a cell runs the arms in: `arms` rotated by index mod n."""
    k = index % len(arms) if arms else 0
    return list(arms[k:]) + list(arms[:k])


def plan_runs(
    base: LaunchSettings,
    couplings: list[float],
    latencies: list[float],
    arms: list[str],
    seeds: dict[str, list[int]],
    out: Path,
) -> list[tuple[str, LaunchSettings]]:
    """Every (cell, run settings), seed-major within a cell so a stopped map has whole pairs; the
    i-th of a cell's `seeds` runs the arms in `arm_order(arms, i)`."""
    runs = []
    for name, coupling, latency in cells(couplings, latencies):
        cell = cell_settings(base, coupling, latency)
        runs += [
            (name, arm_settings(cell, arm, seed, out / "cells" / name))
            for i, seed in enumerate(seeds[name])
            for arm in arm_order(arms, i)
        ]
    return runs


def summarize(
    out: Path,
    couplings: list[float],
    latencies: list[float],
    arms: list[str],
    seeds: dict[str, list[int]],
    mixed_code: str = "refuse",
) -> dict:
    """map.json's grid part from the run folders under `out`: every cell over its seeds, each
    difference with its t test's p and Holm's adjustment over the cells, and per comparison the
    cells' pooled test (summary.across_cells)."""
    out_cells = [
        {"cell": name, "coupling": c, "latency_sigma": lat, **summarize_cell(out, name, arms, seeds[name], arm_order, mixed_code)}
        for name, c, lat in cells(couplings, latencies)
    ]  # fmt: skip
    total = diff_key(*TOTAL)
    ses = [c["diffs"][total]["se"] for c in out_cells if total in c["diffs"]]
    return {
        "couplings": couplings, "latencies": latencies, "arms": arms, "metric": "area points", "se_target": SE_TARGET,
        "largest_se": max((se for se in ses if se is not None), default=None), "cells": out_cells,
        "pooled": across_cells(out_cells),
    }  # fmt: skip


def machine() -> dict[str, Any]:
    """What ran the map: the numbers behind its times."""
    return {
        "cpus": os.cpu_count(), "machine": platform.machine(), "system": platform.system(),
        "python": platform.python_version(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }  # fmt: skip


def _check_resume(
    protocol: dict, grid: dict, seeds: list[int] | None, pilot_seeds: list[int] | None, path: Path
) -> None:
    """A resumed map keeps its protocol: a different grid, or seeds other than it fixed, is refused
    naming both, since the seeds were decided for that grid."""
    if protocol["grid"] != grid:
        raise ValueError(f"{path} fixed the map for {protocol['grid']}, not {grid}: use a new --out")
    if pilot_seeds is not None and protocol["pilot_seeds"] != pilot_seeds:
        raise ValueError(f"{path} ran the pilot on seeds {protocol['pilot_seeds']}, not {pilot_seeds}")
    if seeds is not None and (
        protocol["rule"] != "fixed" or any(s != seeds for s in protocol["seeds"].values())
    ):
        raise ValueError(
            f"{path} fixed the seeds per cell as {protocol['seeds']}, not {seeds} (rule {protocol['rule']})"
        )


def _pilot(
    base: LaunchSettings, grid: dict, pilot_seeds: list[int], out: Path, echo, runner, mixed_code: str
) -> tuple[dict | None, int]:
    """Run (or resume) the pilot into out/pilot: SPO and SPO++ only, since the design's aim is on
    their difference (the steps between them are not sized); answers (its summary, exit code)."""
    couplings, latencies, arms = grid["couplings"], grid["latencies"], grid["arms"]
    if not all(a in arms for a in TOTAL):
        raise ValueError("a pilot sizes the cells by SPO++ − SPO: the arms need spo and spopp")
    if len(pilot_seeds) < 2:
        raise ValueError("a pilot needs two seeds or more: one pair has no standard deviation")
    seeds = {name: pilot_seeds for name, _c, _l in cells(couplings, latencies)}
    pilot_arms = [a for a in arms if a in TOTAL]
    _l, code = runner(
        plan_runs(base, couplings, latencies, pilot_arms, seeds, out / PILOT), echo, "map pilot"
    )
    if code != 0:
        return None, code
    return summarize(out / PILOT, couplings, latencies, pilot_arms, seeds, mixed_code), 0


def _decide(pilot: dict, grid: dict, pilot_seeds: list[int], out: Path, budget_s: float | None,
            spent: float, target: float, n_min: int, first_seed: int) -> dict:  # fmt: skip
    """The pilot rule's protocol: each cell's n from its pilot s.d., within what the budget leaves
    after `spent` seconds, priced by the pilot's mean run time."""
    times = run_times(out / PILOT)
    per_seed = (times["mean_s"] or 0.0) * len(grid["arms"])  # a main seed runs every arm
    spent = max(spent, times["total_s"] or 0.0)  # a resumed pilot ran in an earlier call
    capacity = math.inf
    if budget_s is not None and per_seed > 0:
        capacity = max(0, math.floor((budget_s - spent) / per_seed))
    sds = {c["cell"]: c["diffs"][diff_key(*TOTAL)]["sd"] for c in pilot["cells"]}
    return decide(sds, pilot_seeds, target, n_min, first_seed, capacity, times["mean_s"], budget_s)


def _say_protocol(protocol: dict, echo) -> None:
    for cell, seeds in protocol["seeds"].items():
        want = protocol["wanted"].get(cell)
        sd = protocol["pilot_sd"].get(cell)
        why = (
            ""
            if want is None
            else f" (pilot s.d. {sd:.2f}: wanted {want}"
            + (", capped by the budget)" if cell in protocol["capped"] else ")")
        )
        echo(f"=== map protocol: {cell}: n = {len(seeds)}{why}, seeds {seeds[0]}..{seeds[-1]}")


def _result(out: Path, grid: dict, protocol: dict, mixed_code: str) -> dict:
    """map.json's content: the main runs' grid summary, the protocol, the machine and the times,
    and under the pilot rule the pilot's summary (SPO and SPO++ only) beside them."""
    couplings, latencies, arms = grid["couplings"], grid["latencies"], grid["arms"]
    result = summarize(out, couplings, latencies, arms, protocol["seeds"], mixed_code)
    result |= {"protocol": protocol, "machine": machine(), "times": {"main": run_times(out)}}
    if protocol["pilot_seeds"]:
        pilot_seeds_by_cell = {n: protocol["pilot_seeds"] for n in protocol["seeds"]}
        pilot_arms = [a for a in arms if a in TOTAL]
        result["pilot"] = summarize(
            out / PILOT, couplings, latencies, pilot_arms, pilot_seeds_by_cell, mixed_code
        )
        result["times"]["pilot"] = run_times(out / PILOT)
    return result


def run_map(
    base: LaunchSettings,
    couplings: list[float],
    latencies: list[float],
    arms: list[str],
    out: Path,
    *,
    seeds: list[int] | None = None,
    pilot_seeds: list[int] | None = None,
    target_se: float = SE_TARGET,
    n_min: int = N_MIN,
    first_seed: int = 0,
    budget_s: float | None = None,
    echo: Callable[[str], None] = print,
    runner: Callable = run_in_turn,
    clock: Callable[[], float] = time.monotonic,
    mixed_code: str = "refuse",
) -> int:
    """Run (or resume) the map: the pilot (with `pilot_seeds`) or the given `seeds`, the protocol
    written before the main runs, the main runs, then map.json, map.md and map.png; answers the exit
    code. `runner` runs a list of (cell, settings) in turn and answers (launchers, exit code):
    compare.run_in_turn. `budget_s` (seconds from this call's start, the pilot's runs included)
    bounds the main runs the pilot rule plans. A cell (pilot or main) whose runs do not come from one
    clean commit is refused (spopp.files.provenance.MixedCode, a ValueError), or flagged with `mixed_code`
    "flag"."""
    if (seeds is None) == (pilot_seeds is None):
        raise ValueError(
            "give the main seeds (the fixed rule) or the pilot's seeds (the pilot rule), not both"
        )
    t0 = clock()
    out.mkdir(parents=True, exist_ok=True)
    grid = {"couplings": couplings, "latencies": latencies, "arms": arms}
    protocol = read_protocol(out)
    if protocol is not None:
        _check_resume(protocol, grid, seeds, pilot_seeds, out / PROTOCOL)
    else:
        if pilot_seeds is not None:
            pilot, code = _pilot(base, grid, pilot_seeds, out, echo, runner, mixed_code)
            if pilot is None:
                return code
            protocol = _decide(
                pilot, grid, pilot_seeds, out, budget_s, clock() - t0, target_se, n_min, first_seed
            )
        else:
            protocol = fixed([n for n, _c, _l in cells(couplings, latencies)], seeds, target_se)
        protocol["grid"] = grid
        write_protocol(out, protocol)  # before the first main run: the seeds are fixed now
    _say_protocol(protocol, echo)
    planned = plan_runs(base, couplings, latencies, arms, protocol["seeds"], out)
    _launchers, code = runner(planned, echo, "map")
    if code != 0:
        return code
    write(out, _result(out, grid, protocol, mixed_code))
    for path in ("map.json", "map.md", "map.png"):
        echo(f"wrote {out / path}")
    return 0
