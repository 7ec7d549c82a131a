"""The page of a `spopp study compare` (README.md), drawn from its study.json alone: the design and
its checks, the registered protocol, every run, the paired differences, and the sentences that
services/study/conclusions.py generated from them. A study refused after its pilot has a page too:
why it stopped, the pilot's numbers, the n a study that can answer needs, its hours, and the command
that runs it. `spopp study compare --render OUT` redraws either.
"""

from __future__ import annotations

import math

from spopp.files import provenance


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "–" if x is None else format(x, fmt)


def _design(protocol: dict) -> list[str]:
    lines = [
        "## Design checks (from the pilot, before the main runs)",
        "",
        "| check | | measured |",
        "|---|---|---|",
    ]
    for c in protocol["design_checks"]:
        mark = (
            "ok"
            if c["ok"]
            else ("FAILED, run past with --force" if c["name"] in protocol["forced"] else "FAILED")
        )
        lines.append(f"| {c['name']} | {mark} | {c['measured']} |")
    return lines + [""]


def _protocol(protocol: dict, digest: str) -> list[str]:
    p = protocol["pilot"]
    mean_run = None if p["mean_run_s"] is None else p["mean_run_s"] / 60
    return [
        "## Protocol (registered before the first main run)", "",
        f"- Hypothesis: {protocol['hypothesis']}.",
        f"- Metrics, the primary first: {', '.join(protocol['metrics'])} (held-out: {p['heldout_why']}).",
        f"- Analysis: {protocol['analysis']}.",
        f"- n = {protocol['n']} pairs on seeds {', '.join(map(str, protocol['seeds']))}: the fewest (at least 6, "
        f"where a sign test can reach p < 0.05) giving the paired t test {protocol['power']:.0%} power against "
        f"{protocol['effect']:+g} points at the pilot's s.d. {_f(p['pilot_sd'], '.3g')} (pilot seeds "
        f"{', '.join(map(str, protocol['pilot_seeds']))}, pilot mean {_f(p['pilot_mean'], '+.2f')}, "
        f"{_f(mean_run, '.1f')} min a run).",
        *_pilot_time(p),
        f"- Stopping rule: {protocol['stopping_rule']}.",
        f"- protocol.json sha256 {digest} (carried by every main run's run.json), registered {protocol['registered']}.",
        "",
    ]  # fmt: skip


def _pilot_time(pilot: dict) -> list[str]:
    """Where a pilot run's wall time went (a protocol registered before it was recorded has none)."""
    parts = pilot.get("time_parts") or {}
    if not parts:
        return []
    return [
        "- A pilot run's time, on average: "
        + ", ".join(f"{k} {v / 60:.1f} min" for k, v in parts.items())
        + "."
    ]


def _runs(study: dict) -> list[str]:
    result = study["result"]
    names = result["metrics"]
    by = {(r["arm"], r["seed"]): r for r in study["runs"]}
    lines = [
        f"## Runs (the first {result['budget_updates']} updates of each: the common budget)", "",
        "| arm | seed | " + " | ".join(names) + " | version-0 success | outcomes per prompt | minutes |",
        "|---|---|" + "---|" * (len(names) + 3),
    ]  # fmt: skip
    for row in result["runs"]:
        run = by[(row["arm"], row["seed"])]
        minutes = None if run["seconds"] is None else run["seconds"] / 60
        lines.append(
            f"| {row['arm']} | {row['seed']} | " + " | ".join(_f(row[n]) for n in names)
            + f" | {_f(run['v0_success'])} | {_f(run['outcomes_per_prompt'], '.2f')} | {_f(minutes, '.1f')} |"
        )  # fmt: skip
    return lines + [""]


def _diffs(study: dict) -> list[str]:
    result = study["result"]
    arms = result["arms"]
    lines = [
        f"## {arms['treatment']} − {arms['control']}, paired by seed (points)", "",
        "| metric | mean ± s.e. | s.d. | 95 % t interval | t p | Holm p | won / lost / tied | sign p |",
        "|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for name in result["metrics"]:
        d = result["diffs"][name]
        interval = "–" if d["lo"] is None else f"[{d['lo']:+.2f}, {d['hi']:+.2f}]"
        lines.append(
            f"| {name}{' (primary)' if name == result['primary'] else ''} | {d['mean']:+.2f} ± {_f(d['se'], '.2f')} "
            f"| {_f(d['sd'], '.2f')} | {interval} | {_f(d['t_p'], '.3g')} | {_f(d['holm_p'], '.3g')} "
            f"| {d['won']} / {d['lost']} / {d['tied']} | {d['sign_p']:.3g} |"
        )  # fmt: skip
    return lines + [""]


def _pilot(study: dict) -> list[str]:
    """A refused study's pilot: its runs' metrics, the numbers that sized it, where its time went."""
    found = study["design"]
    mean_run = None if found["mean_run_s"] is None else found["mean_run_s"] / 60
    seeds = ", ".join(map(str, found["pilot"]["seeds"]))
    lines = _runs({"result": found["pilot"], "runs": study["pilot_runs"]})
    lines[0] = f"## The pilot (seeds {seeds}; it sizes the study and is not a test of it)"
    return lines + [
        f"- The primary metric's paired s.d.: {_f(found['pilot_sd'], '.3g')} points over "
        f"{len(found['pilot']['seeds'])} pairs; {_f(mean_run, '.1f')} min a run.",
        *_pilot_time(found),
        "",
    ]


def _needed(study: dict) -> list[str]:
    """What a study that can answer needs, and the command that runs it where runs are faster."""
    found, req = study["design"], study["request"]
    hours = study["needed_hours"]
    budget = (
        "no budget given"
        if req["budget_hours"] is None
        else f"the budget given was {req['budget_hours']:g} h"
    )
    command = (
        f"spopp study compare {req['config'] or 'CONFIG'} --out {req['out']} --effect {req['effect']:g} "
        f"--pilot-seeds {','.join(map(str, req['pilot_seeds']))}"
        + (f" --budget-hours {math.ceil(hours * 10) / 10:g}" if hours is not None else "")
    )
    return [
        "## What a study that can answer needs", "",
        f"- n = {found['n']} pairs (80 % power against {req['effect']:+g} points at the pilot's s.d.): "
        f"{_f(hours, '.1f')} h with the pilot at its run time; {budget}.",
        "- Where runs are faster (a GPU node: the config's `gpus:` gives each process its devices), the same "
        "command runs its own pilot there and sizes n again from it:", "",
        "```", command, "```", "",
    ]  # fmt: skip


def _said(study: dict) -> list[str]:
    lines = (
        ["## What it can say", ""] + [f"- {s}" for s in study["conclusions"]["can"] or ["Nothing."]] + [""]
    )
    return lines + ["## What it cannot say", ""] + [f"- {s}" for s in study["conclusions"]["cannot"]] + [""]


def render_refused(study: dict) -> str:
    arms = study["design"]["pilot"]["arms"]
    lines = [
        f"# Does {arms['treatment']} beat {arms['control']} here? Refused after its pilot, before any main run", "",
        f"Written by `spopp study compare` from study.json; every sentence under *What it can say* and *What it "
        f"cannot say* is generated from the numbers below. Machine time: {study['machine_hours']:.2f} h "
        "(the pilot).", "",
        "## Why it stopped", "", "```", study["refusal"], "```", "",
    ]  # fmt: skip
    lines += _design({"design_checks": study["design"]["checks"], "forced": study["forced"]})
    lines += _pilot(study) + _needed(study) + _said(study)
    return "\n".join(lines + [provenance.describe(study["code"]), ""])


def render(study: dict) -> str:
    if study.get("status") == "refused":
        return render_refused(study)
    protocol, result = study["protocol"], study["result"]
    arms = result["arms"]
    lines = [
        f"# Does {arms['treatment']} beat {arms['control']} here? A pre-registered paired comparison", "",
        f"Written by `spopp study compare` from study.json; every sentence under *What it can say* and *What it "
        f"cannot say* is generated from the numbers below. Machine time: {study['machine_hours']:.2f} h "
        "(pilot and main runs).", "",
    ]  # fmt: skip
    lines += _design(protocol) + _protocol(protocol, study["protocol_sha256"]) + _runs(study) + _diffs(study)
    lines += _said(study) + [provenance.describe(study["code"]), ""]
    return "\n".join(lines)
