"""`spopp map CONFIG --out DIR`: when does SPO++ beat SPO? Paired runs over a grid of two knobs.

The knobs are toy-calc's (runtime/envs/toy_calc.py): `coupling`, how a response's length
co-varies with its success, and `latency_sigma`, a heavy-tailed environment delay that brings
outcomes back after newer policies were published (`make map` also sets `time_neutral`, so that
the coupled side's extra turns do not also make it arrive later). Each cell of the grid is the base
config with those two env_options set and nothing else changed; in each cell every arm (SPO, SPO++ with
trajectory normalization, SPO++) runs on every seed from the same checkpoint, prior and budget,
so SPO++'s two changes are seen apart: trajectory-normalized SPO++ against SPO is event-time
evidence alone, SPO++ against it is the action-token measure alone.

Runs go one after another into `<out>/cells/<cell>/runs/<arm>-s<seed>/`; a stopped map resumes
(finished runs are skipped, an unfinished one resumes). Within a cell, the i-th seed runs the arms
in the given order rotated by i (`arm_order`), so that a drift of the machine's load over a map
falls on every arm alike rather than always on the last one; map.json records each seed's order,
and every environment option the cell's runs had (time_neutral included, from their run.json). Then, per cell: each arm's area and C10,
the paired differences with their standard error over seeds, pairs won, and what each knob
measurably did (the mean correlation of a batch's response lengths with its advantages, from the
learners' logs; the share of outcomes reported after a newer policy, from the tracker's counts),
into `map.json`, `map.md` and the heatmap `map.png`.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spopp.records import RunRecord

from .compare import arm_settings, run_in_turn
from .config import LaunchSettings

ARMS = ("spo", "spopp-trajnorm", "spopp")
# (name, arm, against): SPO++ against SPO, and each of its two changes on its own.
DIFFS = (
    ("spopp-spo", "spopp", "spo"),
    ("trajnorm-spo", "spopp-trajnorm", "spo"),
    ("spopp-trajnorm", "spopp", "spopp-trajnorm"),
)
DIFF_TITLES = {
    "spopp-spo": "SPO++ − SPO",
    "trajnorm-spo": "event-time evidence alone (SPO++ traj. norm. − SPO)",
    "spopp-trajnorm": "action-token measure alone (SPO++ − SPO++ traj. norm.)",
}
SE_TARGET = 1.5  # area points: the standard error each cell's paired difference should stay under


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
    seeds: list[int],
    out: Path,
    extra: dict[str, list[int]] | None = None,
) -> list[tuple[str, LaunchSettings]]:
    """Every (cell, run settings), seed-major within a cell so a stopped map has whole pairs; a
    cell's added seeds (`extra`) come after the common ones; the i-th seed of a cell runs the arms
    in `arm_order(arms, i)`."""
    runs = []
    for name, coupling, latency in cells(couplings, latencies):
        cell = cell_settings(base, coupling, latency)
        runs += [
            (name, arm_settings(cell, arm, seed, out / "cells" / name))
            for i, seed in enumerate(seeds + (extra or {}).get(name, []))
            for arm in arm_order(arms, i)
        ]
    return runs


EXTRA_SEEDS = "extra-seeds.json"  # {cell: [seed, ...]}: seeds the target added, kept for a resume


def read_extra(out: Path) -> dict[str, list[int]]:
    """The seeds added to each cell by an earlier --target-se (none when there is no file)."""
    try:
        data = json.loads((out / EXTRA_SEEDS).read_text())
    except FileNotFoundError:
        return {}
    except ValueError as exc:
        raise ValueError(
            f"{out / EXTRA_SEEDS} is not JSON ({exc}); delete it to start the added seeds over"
        ) from None
    if not isinstance(data, dict) or not all(
        isinstance(v, list) and all(isinstance(x, int) for x in v) for v in data.values()
    ):
        raise ValueError(f"{out / EXTRA_SEEDS} should map each cell to a list of seeds")
    return data


def _write_extra(out: Path, extra: dict[str, list[int]]) -> None:
    # Written before the seed's runs start, atomically, so a stopped map finishes them on resume.
    tmp = out / (EXTRA_SEEDS + ".tmp")
    tmp.write_text(json.dumps(extra, indent=1) + "\n")
    tmp.replace(out / EXTRA_SEEDS)


def seeds_needed(d: dict, target: float) -> float:
    """Seeds a cell still needs for its paired difference's standard error to reach the target, if
    its standard deviation holds: ceil((sd / target)^2) - n (inf without a standard deviation)."""
    if d["sd"] is None:
        return math.inf
    return max(0, math.ceil((d["sd"] / target) ** 2 - 1e-9) - d["n"])


def _over(cell: dict, target: float) -> bool:
    d = cell["diffs"].get("spopp-spo")
    return d is not None and (d["se"] is None or d["se"] > target)


def choose_cell(result: dict, target: float) -> dict | None:
    """The cell to give one more seed: of the cells whose SPO++ − SPO standard error is over the
    target (or not yet known), the one that needs the fewest more seeds to reach it, so a budget
    brings as many cells under the target as it can; None when every cell is under it."""
    over = [c for c in result["cells"] if _over(c, target)]
    if not over:
        return None
    return min(over, key=lambda c: (seeds_needed(c["diffs"]["spopp-spo"], target), c["cell"]))


def run_seconds(out: Path) -> float | None:
    """Mean wall time of the finished runs under `out` (from their run.json), to price a seed."""
    times = []
    for path in (out / "cells").glob("*/runs/*/run.json"):
        try:
            record = RunRecord.model_validate_json(path.read_text())
        except (OSError, ValueError):
            continue
        if record.status == "finished" and record.started and record.finished:
            times.append(record.finished - record.started)
    return _mean(times)


def run_map(
    base: LaunchSettings,
    couplings: list[float],
    latencies: list[float],
    arms: list[str],
    seeds: list[int],
    out: Path,
    echo: Callable[[str], None] = print,
    target_se: float | None = None,
    budget_s: float | None = None,
    runner: Callable = run_in_turn,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Run (or resume) every run of the grid, then write the map; answers the exit code.

    With `target_se`, after the given seeds every cell whose SPO++ − SPO standard error is over the
    target gets more seeds, one at a time (every arm, so all three differences stay paired), the
    cell that needs the fewest more first, while the next seed's runs fit in what is left of
    `budget_s` (seconds from this call's start; unbounded when None). `runner` runs a list of
    (cell, settings) in turn and answers (launchers, exit code): compare.run_in_turn."""
    t0 = clock()
    out.mkdir(parents=True, exist_ok=True)
    extra = read_extra(out)
    known = {name for name, _c, _l in cells(couplings, latencies)}
    if unknown := sorted(set(extra) - known):
        raise ValueError(f"{out / EXTRA_SEEDS} has seeds for cells not in this grid: {', '.join(unknown)}")
    planned = plan_runs(base, couplings, latencies, arms, seeds, out, extra)
    _launchers, code = runner(planned, echo, "map")
    if code != 0:
        return code
    while target_se is not None:
        result = summarize(out, couplings, latencies, arms, seeds, extra)
        if not any("spopp-spo" in c["diffs"] for c in result["cells"]):
            echo("--target-se: no SPO++ − SPO pairs to size (the map needs arms spo and spopp)")
            break
        cell = choose_cell(result, target_se)
        if cell is None:
            echo(f"every cell's SPO++ − SPO standard error is within {target_se}")
            break
        per_run = run_seconds(out) or 0.0
        left = None if budget_s is None else budget_s - (clock() - t0)
        if left is not None and per_run * len(arms) > left:
            over = [c["cell"] for c in result["cells"] if _over(c, target_se)]
            echo(f"the budget is spent ({left / 60:.0f} min left, a seed takes about "
                 f"{per_run * len(arms) / 60:.0f}); over the target still: {', '.join(over)}")  # fmt: skip
            break
        name, coupling, latency = cell["cell"], cell["coupling"], cell["latency_sigma"]
        d = cell["diffs"]["spopp-spo"]
        new_seed = max(seeds + extra.get(name, [])) + 1
        extra.setdefault(name, []).append(new_seed)
        _write_extra(out, extra)
        se = "unknown" if d["se"] is None else f"{d['se']:.2f}"
        echo(f"=== map: {name}: SPO++ − SPO standard error {se} over {d['n']} seeds, target {target_se}: "
             f"adding seed {new_seed}")  # fmt: skip
        # The new seed's runs only, in the order of its place among the cell's seeds.
        planned = plan_runs(base, [coupling], [latency], arms, seeds, out, {name: extra[name]})
        _l, code = runner([(c, s) for c, s in planned if s.seed == new_seed], echo, "map")
        if code != 0:
            return code
    write(out, summarize(out, couplings, latencies, arms, seeds, extra))
    for path in ("map.json", "map.md", "map.png"):
        echo(f"wrote {out / path}")
    return 0


# -- the summary ---------------------------------------------------------------------------------
def _mean(xs: list[float]) -> float | None:
    return math.fsum(xs) / len(xs) if xs else None


def _diff_stats(values: list[float]) -> dict[str, Any]:
    n = len(values)
    mean = _mean(values)
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else None
    return {
        "mean": mean, "sd": sd, "se": sd / math.sqrt(n) if sd is not None else None, "n": n,
        "won": sum(1 for v in values if v > 0), "per_seed": values,
    }  # fmt: skip


def _measured(run_dir: Path) -> dict[str, float | None]:
    """What the knobs did in one run: mean length-advantage correlation over its updates; the mean
    reward of its training batches (first-completed: below the held-out reward where successes are
    the slower episodes); the share
    of its outcomes reported after a newer policy was published (late), and after the outcome of a
    request dispatched later (overtaken: out of dispatch order)."""
    corr, batch_reward = [], []
    try:
        for line in (run_dir / "learner" / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            if "length_advantage_corr" in record:
                corr.append(float(record["length_advantage_corr"]))
            if "reward_mean" in record:
                batch_reward.append(float(record["reward_mean"]))
    except (OSError, ValueError):
        pass
    late = overtaken = distance = None
    try:
        counts = RunRecord.model_validate_json((run_dir / "run.json").read_text()).tracker_counts or {}
        if counts.get("outcomes"):
            late = counts.get("late_outcomes", 0) / counts["outcomes"]
            overtaken = counts.get("overtaken_outcomes", 0) / counts["outcomes"]
            distance = counts.get("reorder_distance", 0) / counts["outcomes"]
    except (OSError, ValueError):
        pass
    return {
        "length_advantage_corr": _mean(corr), "batch_reward": _mean(batch_reward), "late_fraction": late, "overtaken_fraction": overtaken,
        "reorder_distance": distance,
    }  # fmt: skip


def _env_options(run_dir: Path) -> dict | None:
    """Every environment option one run had: run.json's env_options, or for a run launched before
    they were written there, its identity's (as given) with the environment's defaults filled in;
    None without a readable run.json."""
    from runtime.envs import resolved_env_options

    try:
        record = RunRecord.model_validate_json((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        return None
    if record.env_options is not None:
        return record.env_options
    env = record.env or record.identity.get("env")
    if env is None:
        return None
    try:
        return resolved_env_options(env, record.identity.get("env_options"))
    except ValueError:  # an environment this version does not know
        return None


def _common(options: list[dict | None], warnings: list[str]) -> dict | None:
    """The environment options a cell's runs share (None when no run says); a warning when they
    differ, which a cell of one base config never should."""
    known = [o for o in options if o is not None]
    if not known:
        return None
    if any(o != known[0] for o in known[1:]):
        warnings.append("the runs of this cell ran with different env_options: " + "; ".join(
            sorted({json.dumps(o, sort_keys=True) for o in known})))  # fmt: skip
        return None
    return known[0]


def options_line(result: dict) -> str | None:
    """The environment options every cell shares besides its two knobs, as `k=v, ...` (None when no
    cell's runs say)."""
    each = [c.get("env_options") for c in result["cells"]]
    known = [o for o in each if o is not None]
    if not known:
        return None
    keys = sorted(set.intersection(*(set(o) for o in known)) - {"coupling", "latency_sigma"})
    same = [k for k in keys if all(o[k] == known[0][k] for o in known)]
    return ", ".join(f"{k}={json.dumps(known[0][k])}" for k in same)


MEASURES = (
    "length_advantage_corr",
    "batch_reward",
    "late_fraction",
    "overtaken_fraction",
    "reorder_distance",
)


def _means(runs: list[dict]) -> dict[str, float | None]:
    """Each measure's mean over the runs that have it (None where none does)."""
    return {key: _mean([m[key] for m in runs if m[key] is not None]) for key in MEASURES}


def summarize(
    out: Path,
    couplings: list[float],
    latencies: list[float],
    arms: list[str],
    seeds: list[int],
    extra: dict[str, list[int]] | None = None,
) -> dict:
    """map.json's content, from the run folders (what a finished map holds): every cell over the
    common seeds and the ones --target-se added to it (`extra`)."""
    from services.report.runs import read_run
    from services.report.summaries import area, c10

    out_cells = []
    for name, coupling, latency in cells(couplings, latencies):
        cell_seeds = seeds + (extra or {}).get(name, [])
        warnings: list[str] = []
        curves: dict[str, dict[int, list[float]]] = {arm: {} for arm in arms}
        measured: dict[str, list[dict]] = {arm: [] for arm in arms}
        env_options: list[dict | None] = []
        for arm in arms:
            for seed in cell_seeds:
                run_dir = out / "cells" / name / "runs" / f"{arm}-s{seed}"
                curves[arm][seed] = read_run(run_dir, "eval/sampled/reward_mean", warnings).rewards
                measured[arm].append(_measured(run_dir))
                env_options.append(_env_options(run_dir))
        options = _common(env_options, warnings)
        points = min(len(c) for by_seed in curves.values() for c in by_seed.values())
        per_arm = {
            arm: {
                "area": _mean([area(curves[arm][s][:points]) for s in cell_seeds]),
                "c10": _mean([c10(curves[arm][s][:points]) for s in cell_seeds]),
                **_means(measured[arm]),
            }
            for arm in arms
        }  # fmt: skip
        diffs = {
            key: _diff_stats(
                [100 * (area(curves[a][s][:points]) - area(curves[b][s][:points])) for s in cell_seeds]
            )
            for key, a, b in DIFFS
            if a in arms and b in arms
        }
        everything = [m for arm in arms for m in measured[arm]]
        out_cells.append({
            "cell": name, "coupling": coupling, "latency_sigma": latency, "seeds": cell_seeds, "points": points,
            "env_options": options,
            "arm_order": {str(seed): arm_order(arms, i) for i, seed in enumerate(cell_seeds)},
            "start": _mean([curves[arm][s][0] for arm in arms for s in cell_seeds if curves[arm][s]]),
            "arms": per_arm, "diffs": diffs, "warnings": warnings,
            "measured": _means(everything),
        })  # fmt: skip

    def worst(keys: tuple[str, ...]) -> float | None:
        ses = [c["diffs"][k]["se"] for c in out_cells for k in keys if k in c["diffs"]]
        return max((se for se in ses if se is not None), default=None)

    # The cell's paired difference is SPO++ − SPO (the target applies to it); its two parts, each
    # change on its own, are reported with their own largest standard error.
    return {
        "couplings": couplings, "latencies": latencies, "arms": arms, "seeds": seeds, "metric": "area points",
        "se_target": SE_TARGET, "largest_se": worst(("spopp-spo",)),
        "largest_se_parts": worst(("trajnorm-spo", "spopp-trajnorm")), "cells": out_cells,
    }  # fmt: skip


def _pm(d: dict) -> str:
    if d["mean"] is None:
        return "n/a"
    return f"{d['mean']:+.1f}" + ("" if d["se"] is None else f" ± {d['se']:.1f}")


def markdown(result: dict) -> str:
    out = [
        "# When does SPO++ beat SPO? coupling × latency", "",
        f"Seeds {', '.join(map(str, result['seeds']))}; arms {', '.join(result['arms'])}. Area = mean held-out "
        "reward over the common points (trapezoid); Δ in area points (100 × area difference), mean ± standard "
        "error over the seeds' paired differences; C10 per arm; coupling = mean Pearson correlation of a batch's "
        "response lengths with its advantages; late = share of outcomes reported after a newer policy; overtaken = "
        "share reported after the outcome of a request dispatched later; distance = mean over outcomes of how "
        "many dispatches the newest reported request was past it; batch = mean reward of the training batches "
        "(first completed), against the held-out reward at version 0 (start); n = seeds in the cell (--target-se "
        "adds seeds where the standard error is over the target).", "",
        *([f"Environment options of every cell besides its coupling and latency σ: {line}.", ""]
          if (line := options_line(result)) else []),
        *_order_lines(result),
        "| coupling | latency σ | measured coupling | late | overtaken | distance | batch / start | n | SPO area "
        "| SPO++ area | Δ SPO++ − SPO | pairs won | Δ event-time alone | Δ token measure alone | C10 SPO / traj. / SPO++ |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]  # fmt: skip
    for c in result["cells"]:
        a, d, m = c["arms"], c["diffs"], c["measured"]

        def num(x: float | None, fmt: str = ".3f") -> str:
            return "n/a" if x is None else format(x, fmt)

        main = d.get("spopp-spo")
        won = f"{main['won']}/{main['n']}" if main else "n/a"
        c10s = " / ".join(num(a[arm]["c10"]) for arm in ARMS if arm in a)
        out.append(
            f"| {c['coupling']:+g} | {c['latency_sigma']:g} | {num(m['length_advantage_corr'], '+.2f')} "
            f"| {num(m['late_fraction'], '.2f')} | {num(m['overtaken_fraction'], '.2f')} "
            f"| {num(m['reorder_distance'], '.1f')} | {num(m['batch_reward'], '.2f')} / {num(c.get('start'), '.2f')} "
            f"| {len(c.get('seeds', result['seeds']))} | {num(a.get('spo', {}).get('area'))} | {num(a.get('spopp', {}).get('area'))} "
            f"| {_pm(main) if main else 'n/a'} | {won} "
            f"| {_pm(d['trajnorm-spo']) if 'trajnorm-spo' in d else 'n/a'} "
            f"| {_pm(d['spopp-trajnorm']) if 'spopp-trajnorm' in d else 'n/a'} | {c10s} |"
        )
    worst, parts = result["largest_se"], result.get("largest_se_parts")
    if worst is None:
        out += ["", "One seed: no standard error."]
    else:
        out += ["", f"Largest standard error of a cell's paired difference (SPO++ − SPO): {worst:.2f} area points "
                f"(target ≤ {SE_TARGET})."]  # fmt: skip
        if parts is not None:
            out.append(f"Largest standard error of its parts (each change alone): {parts:.2f} area points.")
    return "\n".join(out) + "\n"


def _order_lines(result: dict) -> list[str]:
    """The order each seed ran the arms in (the same in every cell for the common seeds)."""
    orders: dict[str, list[str]] = {}
    for c in result["cells"]:
        for seed, order in c.get("arm_order", {}).items():
            orders.setdefault(seed, order)
    if not orders:
        return []
    said = "; ".join(f"seed {seed}: {' → '.join(order)}" for seed, order in orders.items())
    return [f"Arm order (rotated per seed, so that load drift is not one arm's): {said}.", ""]


def heatmap(result: dict, path: Path) -> None:
    """One panel per paired difference: Δ area over coupling (x) and latency (y), each cell
    annotated with its mean ± standard error."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    keys = [k for k, _a, _b in DIFFS if any(k in c["diffs"] for c in result["cells"])]
    xs, ys = result["couplings"], result["latencies"]
    fig = Figure(figsize=(4.2 * max(1, len(keys)), 3.6), dpi=150)
    FigureCanvasAgg(fig)
    values = [c["diffs"][k]["mean"] for c in result["cells"] for k in keys if c["diffs"].get(k)]
    lim = max([abs(v) for v in values if v is not None] + [1.0])
    for i, key in enumerate(keys):
        ax = fig.add_subplot(1, len(keys), i + 1)
        grid = [[math.nan] * len(xs) for _ in ys]
        for c in result["cells"]:
            d = c["diffs"].get(key)
            if d and d["mean"] is not None:
                r, k = ys.index(c["latency_sigma"]), xs.index(c["coupling"])
                grid[r][k] = d["mean"]
                # White on the saturated ends of the colour map, black in its pale middle.
                ink = "white" if abs(d["mean"]) > 0.6 * lim else "black"
                ax.text(k, r, _pm(d), ha="center", va="center", fontsize=8, color=ink)
        image = ax.imshow(grid, cmap="RdBu", vmin=-lim, vmax=lim, origin="lower", aspect="auto")
        ax.set_xticks(range(len(xs)), [f"{x:+g}" for x in xs])
        ax.set_yticks(range(len(ys)), [f"{y:g}" for y in ys])
        ax.set_xlabel("coupling (−: failures longer, +: successes longer)")
        ax.set_ylabel("latency σ")
        ax.set_title(DIFF_TITLES[key], fontsize=8)
        fig.colorbar(image, ax=ax, label="Δ area (points)")
    if line := options_line(result):
        fig.suptitle(f"toy-calc: {line}", fontsize=6)
    fig.tight_layout()
    fig.savefig(path, format="png")


def write(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "map.json").write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")
    (out / "map.md").write_text(markdown(result))
    heatmap(result, out / "map.png")
