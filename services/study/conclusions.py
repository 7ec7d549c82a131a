"""The sentences a study page says about its result, generated from its statistics and nothing else:
what the comparison can say and what it cannot. No sentence about a result is written by hand, so
a page cannot claim more than its numbers hold.

The rules, each from the arithmetic of the test it speaks for:
- a difference is claimed only when its 95 % t interval excludes 0 and its Holm-adjusted p (over
  the planned metrics) is below 0.05; otherwise the page says the interval holds both signs;
- the sign test is cited only when it could have rejected: over n untied pairs its smallest p is
  2 / 2^n, above 0.05 for n < 6, and then the page says so;
- the planned effect is excluded only when the interval's far end stops short of it;
- a ceiling (either arm's final five at or above 0.9) and every design check run past with
  --force are stated as limits.
"""

from __future__ import annotations

from .design import CEILING

ALPHA = 0.05

# What a design check that failed (and was run past with --force) takes from the answer.
CONSEQUENCE = {
    "prior": "without the offline prior this is not the paper's protocol: every prompt's value starts flat",
    "headroom": "version 0 is near the floor or the top, so there is little for either method to learn",
    "ceiling": "the pilot reached the ceiling, so the arms' curves are pressed together at the end",
    "outcomes per prompt": "the persistent value barely engaged, so this does not test SPO++'s mechanism",
}


def _p(p: float | None) -> str:
    return "n/a" if p is None else f"{p:.3g}"


def _interval(d: dict) -> str:
    return f"[{d['lo']:+.2f}, {d['hi']:+.2f}]"


def metric_sentence(name: str, d: dict, treatment: str, control: str) -> tuple[str, str]:
    """("can" or "cannot", the sentence) for one metric's paired difference."""
    n = d["n"]
    head = f"On {name}, {treatment} − {control} is {d['mean']:+.2f}"
    if d.get("se") is None or d.get("lo") is None:
        return "cannot", f"{head} points from {n} pair: one pair has no spread, so no interval and no test."
    head += f" ± {d['se']:.2f} points (mean ± s.e., {n} pairs, 95 % t interval {_interval(d)}"
    tests = f"paired t p = {_p(d.get('t_p'))}, Holm p = {_p(d.get('holm_p'))}"
    if d["lo"] > 0 or d["hi"] < 0:
        holm_p = d.get("holm_p")
        if holm_p is not None and holm_p < ALPHA:
            which = "higher" if d["mean"] > 0 else "lower"
            return "can", f"{head}; {tests}): {treatment} is {which} than {control} on {name} in this design."
        return "cannot", (
            f"{head}; {tests}): the interval excludes 0 alone, but not after Holm's adjustment over the "
            "planned metrics, so no direction is claimed."
        )
    return (
        "cannot",
        f"{head}; {tests}): the interval holds both signs, so which arm is better on {name} is open.",
    )


def sign_sentence(d: dict, treatment: str) -> tuple[str, str]:
    untied = d["won"] + d["lost"]
    floor = 2.0 / 2**untied if untied else 1.0
    split = f"{d['won']} of {d['n']} pairs favour {treatment}, {d['lost']} the other arm, {d['tied']} tied"
    if floor > ALPHA:
        return "cannot", (
            f"The sign test decides nothing here: {split}, and over {untied} untied pairs its smallest "
            f"possible p is {floor:.3g}, above {ALPHA}."
        )
    if d["sign_p"] < ALPHA:
        return "can", f"{split} (two-sided sign test p = {_p(d['sign_p'])})."
    return "cannot", f"{split}: the sign test does not reject an even split (p = {_p(d['sign_p'])})."


def effect_sentence(d: dict, effect: float, name: str) -> tuple[str, str] | None:
    if d.get("lo") is None:
        return None
    lo, hi = d["lo"], d["hi"]
    if (effect > 0 and hi < effect) or (effect < 0 and lo > effect):
        end = hi if effect > 0 else lo
        return "can", (
            f"An effect as large as the planned {effect:+.2f} points on {name} is excluded: the interval "
            f"ends at {end:+.2f}."
        )
    if lo <= effect <= hi and lo <= 0 <= hi:
        return "cannot", (
            f"Whether the effect on {name} is 0 or as large as the planned {effect:+.2f} points: the "
            f"interval {_interval(d)} holds both."
        )
    return None


def conclude(result: dict, effect: float, forced: list[dict]) -> dict[str, list[str]]:
    """{"can": [...], "cannot": [...]} from an analysis (services.study.analysis.analyse), the
    planned effect in points, and the design checks that failed and were run past (--force)."""
    out: dict[str, list[str]] = {"can": [], "cannot": []}
    treatment, control = result["arms"]["treatment"], result["arms"]["control"]
    primary = result["primary"]
    for name in result["metrics"]:
        kind, text = metric_sentence(name, result["diffs"][name], treatment, control)
        out[kind].append(text)
    d = result["diffs"][primary]
    for said in (sign_sentence(d, treatment), effect_sentence(d, effect, primary)):
        if said is not None:
            out[said[0]].append(said[1])
    ends = {arm: result["ends"][arm] for arm in (control, treatment)} if "ends" in result else {}
    top = {arm: end for arm, end in ends.items() if end >= CEILING}
    if top:
        listed = ", ".join(f"{arm} {end:.3f}" for arm, end in top.items())
        out["cannot"].append(
            f"How the arms differ below the ceiling: the final five of {listed} reach {CEILING} or more, so "
            "their difference rests on the few tasks still failed."
        )
    for check in forced:
        out["cannot"].append(
            f"The design check '{check['name']}' failed ({check['measured']}) and the study ran with "
            f"--force: {CONSEQUENCE.get(check['name'], 'the design cannot answer as planned')}."
        )
    out["cannot"].append(
        f"Whether this holds beyond this design: {d['n']} pairs of one model, one task family and one budget."
    )
    return out


def refused(found: dict, effect: float, arms: tuple[str, str], need_h: float | None) -> dict[str, list[str]]:
    """{"can": [...], "cannot": [...]} of a study refused after its pilot (`found`: what
    registered.pilot_design measured), `need_h` the machine hours its n pairs and pilot take at the
    pilot's run time. The pilot sizes the study; it is never read as a test of it."""
    control, treatment = arms
    out: dict[str, list[str]] = {"can": [], "cannot": []}
    for check in found["checks"]:
        if not check["ok"]:
            out["can"].append(f"This design fails the check '{check['name']}' ({check['measured']}); "
                              f"to change: {check['fix']}.")  # fmt: skip
    pairs = len(found["pilot"]["seeds"])
    sd = found["pilot_sd"]
    if sd is not None:
        hours = "" if need_h is None else f", {need_h:.1f} h of machine time with the pilot at its run time"
        out["can"].append(
            f"At the pilot's paired s.d. of {sd:.3g} points on the primary metric ({pairs} pairs), a two-sided "
            f"paired t test needs n = {found['n']} pairs for 80 % power against {effect:+g} points{hours}."
        )
    out["cannot"].append(
        f"Whether {treatment} beats {control} on this config: no main run was made. The pilot's {pairs} pairs size "
        "the study; their difference is not a test of it."
    )
    return out
