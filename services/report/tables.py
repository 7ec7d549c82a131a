"""The paired results: Table 1 (SPO++ vs SPO by seed), Table 2 (the normalization ablation by C10),
Table 3 (an arm under bounded staleness, e.g. spopp-k1, against its k = 0 arm: by version and by
wall-clock time).

Runs pair by seed across arms. Each pair is cut to its common number of points before anything
is computed, so that a run that stopped early is not scored against the other's longer, usually
better, tail; `--points N` instead compares every pair at exactly N curve points and leaves out those
that have fewer. The report is one JSON-ready dict holding the curves as well as the results, so
that anyone can recompute the table from `report.json` alone; the markdown renders that dict.
"""

from __future__ import annotations

import json
import math
from typing import Any

from spopp.compare.stats import summarize, wins
from spopp.files import provenance
from spopp.files.runs import Run
from spopp.metrics import C10_POINTS, POINTS, area, c10, c10_label, end_reward

SPO, SPOPP, TRAJNORM, EVENTTIME = "spo", "spopp", "spopp-trajnorm", "spo-eventtime"
# The arms of spopp/compare/arms.py, each named for what it changes.
ARM_NAMES = {
    SPO: "SPO",
    EVENTTIME: "SPO + event-time evidence",
    TRAJNORM: "SPO++ (trajectory norm.)",
    SPOPP: "SPO++",
}
ABLATION_ROWS = (
    ("SPO++ (trajectory norm.) vs SPO", TRAJNORM, SPO),
    ("SPO++ vs SPO", SPOPP, SPO),
    ("Action-token vs. trajectory (paired difference)", SPOPP, TRAJNORM),
)


def staleness_arm(arm: str) -> tuple[str, int] | None:
    """(the k = 0 arm, k) of an arm under bounded staleness (spopp-k1 -> (spopp, 1)), else None."""
    base, sep, k = arm.rpartition("-k")
    return (base, int(k)) if sep and base in ARM_NAMES and k.isdigit() and int(k) > 0 else None


def arm_name(arm: str) -> str:
    if (stale := staleness_arm(arm)) is not None:
        return f"{ARM_NAMES[stale[0]]} (k = {stale[1]})"
    return ARM_NAMES.get(arm, arm)


def staleness_pairs(runs: list[Run], kind: str, warnings: list[str]) -> list[dict[str, Any]]:
    """Each run under bounded staleness beside its k = 0 arm of the same seed, at their common
    points: the curve by version (area, end) and the wall-clock time to get there, so a reader
    sees whether the faster clock pays for the staleness."""
    out = []
    for seed, arms in sorted(_by_seed(runs).items()):
        for arm, run in sorted(arms.items()):
            stale = staleness_arm(arm)
            if stale is None:
                continue
            base = arms.get(stale[0])
            if base is None:
                warnings.append(
                    f"run {run.label} (arm {arm}, seed {seed}) has no {stale[0]} partner: no Table 3 row"
                )
                continue
            points = min(len(base.rewards), len(run.rewards))
            entry: dict[str, Any] = {
                "seed": seed,
                "arm": arm,
                "base": stale[0],
                "k": stale[1],
                "points": points,
            }
            for key, r in (("k0", base), ("stale", run)):
                curve = r.rewards[:points]
                entry[key] = {
                    "area": area(curve, kind),
                    "end": end_reward(curve),
                    "version": r.versions[points - 1],
                    "seconds": r.seconds[points - 1] if r.seconds else None,
                }
            entry["d_area"] = POINTS * (entry["stale"]["area"] - entry["k0"]["area"])
            entry["d_end"] = POINTS * (entry["stale"]["end"] - entry["k0"]["end"])
            s0, s1 = entry["k0"]["seconds"], entry["stale"]["seconds"]
            entry["speedup"] = s0 / s1 if s0 and s1 else None
            out.append(entry)
    return out


def _by_seed(runs: list[Run]) -> dict[int, dict[str, Run]]:
    seeds: dict[int, dict[str, Run]] = {}
    for run in runs:
        seeds.setdefault(run.seed, {})[run.arm] = run
    return seeds


def pair_results(runs: list[Run], kind: str, points: int | None, warnings: list[str]) -> list[dict[str, Any]]:
    """One entry per seed that has both an SPO and an SPO++ run, in seed order."""
    pairs = []
    for seed, arms in sorted(_by_seed(runs).items()):
        if SPO not in arms or SPOPP not in arms:
            for run in arms.values():
                if run.arm in (SPO, SPOPP):
                    partner = SPOPP if run.arm == SPO else SPO
                    warnings.append(
                        f"run {run.label} (arm {run.arm}, seed {seed}) has no {partner} partner: "
                        "left out of the pairs"
                    )
            continue
        spo, spopp = arms[SPO], arms[SPOPP]
        a, b = len(spo.rewards), len(spopp.rewards)
        common = min(a, b)
        if points is not None and common < points:
            warnings.append(
                f"pair seed {seed}: left out, {common} common points is below --points {points} "
                f"(spo has {a}, spopp has {b})"
            )
            continue
        cut = points if points is not None else common
        if a != b:
            warnings.append(
                f"pair seed {seed}: truncated to {cut} common points (spo has {a}, spopp has {b})"
            )
        arms_out = {}
        for arm, run in ((SPO, spo), (SPOPP, spopp)):
            curve = run.rewards[:cut]
            arms_out[arm] = {"area": area(curve, kind), "end": end_reward(curve)}
        pairs.append(
            {
                "seed": seed,
                "points": cut,
                SPO: arms_out[SPO],
                SPOPP: arms_out[SPOPP],
                "d_area": POINTS * (arms_out[SPOPP]["area"] - arms_out[SPO]["area"]),
                "d_end": POINTS * (arms_out[SPOPP]["end"] - arms_out[SPO]["end"]),
            }
        )
    return pairs


def staleness_summary(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Table 3's aggregates per arm (mean ± sample s.d. over its seeds), None without rows."""
    out = {}
    for arm in sorted({r["arm"] for r in rows}):
        mine = [r for r in rows if r["arm"] == arm]
        ups = [r["speedup"] for r in mine if r["speedup"] is not None]
        out[arm] = {
            "pairs": len(mine),
            "d_area": summarize([r["d_area"] for r in mine]).as_dict(),
            "d_end": summarize([r["d_end"] for r in mine]).as_dict(),
            "speedup": summarize(ups).as_dict() if ups else None,
            "won_area": wins([r["d_area"] for r in mine]),
        }
    return out or None


def main_table(pairs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Table 1's aggregates over the pairs (None without pairs), each with its display text."""
    if not pairs:
        return None
    n = len(pairs)
    stats = {
        "spo_area": summarize([p[SPO]["area"] for p in pairs]),
        "spopp_area": summarize([p[SPOPP]["area"] for p in pairs]),
        "d_area": summarize([p["d_area"] for p in pairs]),
        "d_end": summarize([p["d_end"] for p in pairs]),
        "spo_end": summarize([p[SPO]["end"] for p in pairs]),
        "spopp_end": summarize([p[SPOPP]["end"] for p in pairs]),
    }
    won_area, won_end = wins([p["d_area"] for p in pairs]), wins([p["d_end"] for p in pairs])
    rows = {
        "SPO area": _level(stats["spo_area"]),
        "SPO++ area": _level(stats["spopp_area"]),
        "Δ area (points)": _delta(stats["d_area"]),
        "Δ end reward (points)": _delta(stats["d_end"]),
        "SPO end": _level(stats["spo_end"]),
        "SPO++ end": _level(stats["spopp_end"]),
        "pairs won (area)": f"{won_area}/{n}",
        "pairs won (end)": f"{won_end}/{n}",
        "pairs": str(n),
    }
    return {
        **{key: s.as_dict() for key, s in stats.items()},
        "pairs_won_area": {"won": won_area, "n": n},
        "pairs_won_end": {"won": won_end, "n": n},
        "pairs": n,
        "rows": rows,
    }


def ablation(runs: list[Run], warnings: list[str]) -> dict[str, Any] | None:
    """Table 2 over the seeds that have all three arms; None when no trajectory-norm. run is given."""
    if not any(run.arm == TRAJNORM for run in runs):
        return None
    per_seed = []
    for seed, arms in sorted(_by_seed(runs).items()):
        missing = [arm for arm in (SPO, SPOPP, TRAJNORM) if arm not in arms]
        if missing:
            if TRAJNORM in arms:
                warnings.append(f"ablation: seed {seed} lacks {', '.join(missing)}: left out of Table 2")
            continue
        lengths = {arm: len(arms[arm].rewards) for arm in (SPO, SPOPP, TRAJNORM)}
        common = min(lengths.values())
        points = min(common, C10_POINTS)
        if common < C10_POINTS:
            # Only the first ten points count, so a shorter common length is the one cut that matters.
            shown = ", ".join(f"{arm} has {k}" for arm, k in lengths.items())
            warnings.append(
                f"ablation seed {seed}: only {common} common points ({shown}): C10 over {common} points "
                "(AUC plus the mean of the final five) instead of 10"
            )
        scores = {arm: c10(arms[arm].rewards[:points]) for arm in (SPO, SPOPP, TRAJNORM)}
        per_seed.append(
            {
                "seed": seed,
                "points": points,
                "c10": scores,
                "d": {name: POINTS * (scores[a] - scores[b]) for name, a, b in ABLATION_ROWS},
            }
        )
    if not per_seed:
        warnings.append("ablation: no seed has all of spo, spopp and spopp-trajnorm: no Table 2")
        return {"seeds": [], "per_seed": [], "rows": None}
    rows = {}
    for name, _a, _b in ABLATION_ROWS:
        s = summarize([entry["d"][name] for entry in per_seed])
        rows[name] = {**s.as_dict(), "text": _delta(s)}
    return {"seeds": [entry["seed"] for entry in per_seed], "per_seed": per_seed, "rows": rows}


def build(
    runs: list[Run],
    metric: str,
    kind: str,
    points: int | None,
    title: str,
    warnings: list[str],
    code: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The whole report as one JSON-ready dict (see the module docstring); `code` is what the runs'
    code says (spopp.files.provenance.check's summary; by default their agreement, nothing refused)."""
    for run in runs:
        if run.arm not in ARM_NAMES and staleness_arm(run.arm) is None:
            warnings.append(
                f"run {run.label}: arm {run.arm!r} is none of {', '.join(ARM_NAMES)}: drawn, in no table"
            )
    # A comparison of staleness arms only (spopp against spopp-k1, no SPO run) is not missing its
    # SPO runs: Table 1's absence is said in its section, not warned about run by run.
    staleness_only = not any(run.arm == SPO for run in runs) and any(staleness_arm(r.arm) for r in runs)
    pairs = pair_results(runs, kind, points, [] if staleness_only else warnings)
    if not pairs and not staleness_only:
        paired = any(SPO in arms and SPOPP in arms for arms in _by_seed(runs).values())
        why = (
            f"every pair has fewer than {points} common points"
            if paired
            else "no seed has both an spo and an spopp run"
        )
        warnings.append(f"no SPO/SPO++ pair: {why}, so no Table 1")
    return {
        "title": title,
        "metric": metric,
        "area": kind,
        "points": points,
        "runs": [run.as_dict() for run in runs],
        "pairs": pairs,
        "table": main_table(pairs),
        "ablation": ablation(runs, warnings),
        "staleness": (stale := staleness_pairs(runs, kind, warnings)),
        "staleness_summary": staleness_summary(stale),
        "warnings": list(warnings),
        "code": code or provenance.agree({run.label: run.code for run in runs}),
    }


def _level(s: Any) -> str:
    return f"{s.mean:.3f}" + ("" if s.sd is None else f" ± {s.sd:.3f}")


def _delta(s: Any) -> str:
    return f"{s.mean:+.1f}" + (" ± n/a" if s.sd is None else f" ± {s.sd:.1f}")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_json(report: dict[str, Any]) -> str:
    """Strict JSON: non-finite floats would be an error here rather than a NaN nobody can parse."""
    return json.dumps(_finite(report), indent=2, ensure_ascii=False, allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def to_markdown(report: dict[str, Any]) -> str:
    """Table 1, the per-pair numbers, Table 2 when there is an ablation, then the warnings."""
    area_rule = "trapezoid area" if report["area"] == "trapezoid" else "step mean"
    points = _points(report)
    at = f", every pair at {points} points" if points is not None else ""
    out = [f"# {_cell(report['title'])}", ""]
    out.append(f"Metric `{report['metric']}`, {area_rule}{at}; {len(report['runs'])} runs.")
    out.append("")
    out += _code_lines(report)
    out += _table1_lines(report)
    out += _table2_lines(report)
    out += _table3_lines(report)
    if report["warnings"]:
        out += ["", "## Warnings", ""]
        out += [f"- {_cell(w)}" for w in report["warnings"]]
    return "\n".join(out) + "\n"


def _points(report: dict[str, Any]) -> int | None:
    """`--points N` of the report; a report.json written before the rename says "budget"."""
    return report.get("points", report.get("budget"))


def _code_lines(report: dict[str, Any]) -> list[str]:
    """The commit(s) of the report's runs, and the flag of runs from different code let through; a
    report.json written before reports named the code says, from its runs, that it was not recorded."""
    code = report.get("code") or provenance.agree(
        {f"{r['run']} ({r['dir']})": r.get("code") for r in report["runs"]}
    )
    line = provenance.describe(code)
    if code.get("flagged"):
        line += f" **Mixed code, let through by `--mixed-code flag`:** {code['problem']}."
    return [_cell(line), ""]


def _table1_lines(report: dict[str, Any]) -> list[str]:
    """Table 1 and the per-pair numbers under it (or why there is none)."""
    table = report["table"]
    out = ["## Table 1: SPO++ vs SPO", ""]
    if table is None:
        out.append("No SPO/SPO++ pair to compare (see the warnings).")
        return out
    out.append(
        "Levels in reward units (mean ± s.d. over pairs); Δ = SPO++ − SPO in percentage points "
        "(mean ± sample s.d.); end reward = mean of the final five points."
    )
    out.append("")
    out += ["| | value |", "|---|---|"]
    out += [f"| {name} | {text} |" for name, text in table["rows"].items()]
    out.append("")
    out.append("### Pairs")
    out.append("")
    out.append("| seed | points | SPO area | SPO++ area | Δ area | SPO end | SPO++ end | Δ end |")
    out.append("|---|---|---|---|---|---|---|---|")
    for p in report["pairs"]:
        out.append(
            f"| {p['seed']} | {p['points']} | {p[SPO]['area']:.3f} | {p[SPOPP]['area']:.3f} "
            f"| {p['d_area']:+.1f} | {p[SPO]['end']:.3f} | {p[SPOPP]['end']:.3f} | {p['d_end']:+.1f} |"
        )
    return out


def _table2_lines(report: dict[str, Any]) -> list[str]:
    """Table 2, the normalization ablation; no lines when the report has none."""
    ablation_ = report["ablation"]
    if ablation_ is None:
        return []
    label = c10_label(entry["points"] for entry in ablation_["per_seed"])
    out = ["", f"## Table 2: normalization ablation ({label.replace(' (', ', ').rstrip(')')})", ""]
    if ablation_["rows"] is None:
        out.append("No seed has all three arms (`spo`, `spopp`, `spopp-trajnorm`).")
        return out
    what = (
        "C10 = ½ (AUC of points 1–10 + mean of points 6–10)"
        if label == "C10"
        else f"{label} = ½ (AUC + mean of the final five) over the points each seed's runs have, not the paper's "
        "C10 of ten points (AUC of points 1–10 + mean of points 6–10), with which it is not comparable"
    )
    out.append(
        f"{what}, each seed's three runs cut to "
        "their common length; Δ in percentage points, mean ± sample s.d. over "
        f"{len(ablation_['seeds'])} seeds ({', '.join(str(s) for s in ablation_['seeds'])})."
        + (" --points applies to Table 1 only." if _points(report) is not None else "")
    )
    out.append("")
    unit = "(points)" if label == "C10" else "in percentage points"
    out += [f"| comparison | Δ {label} {unit} |", "|---|---|"]
    out += [f"| {name} | {row['text']} |" for name, row in ablation_["rows"].items()]
    return out


def _table3_lines(report: dict[str, Any]) -> list[str]:
    """Table 3, bounded staleness against k = 0 by pair, then by arm; no lines without such a pair."""
    if not report.get("staleness"):
        return []
    out = ["", "## Table 3: bounded staleness against k = 0", ""]
    out.append(
        "Each pair at its common points. Time: seconds from the learner's start to the "
        "publication of the last common version; speed-up = the k = 0 run's time over the "
        "other's. Δ in percentage points (other − k = 0)."
    )
    out.append("")
    out.append(
        "| seed | arms | points | area k=0 | area | Δ area | end k=0 | end | Δ end | time k=0 | time | speed-up |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for p in report["staleness"]:
        a, b = p["k0"], p["stale"]
        t0 = "n/a" if a["seconds"] is None else f"{a['seconds']:.0f} s"
        t1 = "n/a" if b["seconds"] is None else f"{b['seconds']:.0f} s"
        up = "n/a" if p["speedup"] is None else f"{p['speedup']:.2f}x"
        out.append(
            f"| {p['seed']} | {p['arm']} vs {p['base']} | {p['points']} | {a['area']:.3f} | {b['area']:.3f} "
            f"| {p['d_area']:+.1f} | {a['end']:.3f} | {b['end']:.3f} | {p['d_end']:+.1f} | {t0} | {t1} | {up} |"
        )
    for arm, agg in (report.get("staleness_summary") or {}).items():
        up = agg["speedup"]
        clock = (
            "n/a" if up is None else f"{up['mean']:.2f}x" + ("" if up["sd"] is None else f" ± {up['sd']:.2f}")
        )
        da, de = agg["d_area"], agg["d_end"]
        sd = lambda x: "" if x["sd"] is None else f" ± {x['sd']:.1f}"  # noqa: E731
        out.append("")
        out.append(
            f"{arm} over {agg['pairs']} seeds: Δ area {da['mean']:+.1f}{sd(da)}, Δ end {de['mean']:+.1f}{sd(de)} "
            f"points (mean ± sample s.d.), pairs won on area {agg['won_area']}/{agg['pairs']}; "
            f"speed-up to the same version {clock}."
        )
    return out
