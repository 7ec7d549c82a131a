"""The numbers the prose quotes are the numbers the committed data gives.

Generated sections (the map's tables, the report tables) are checked by test_published.py as the
rendering of their data; this file checks the sentences written by hand around them. Each claim is
(page, sentence, compute): the sentence as it stands on the page with `{}` where it quotes a number
(line breaks and spaces match any run of white space), and a function that computes, from the
committed data alone, each quoted number as the page writes it. An edited sentence no longer
matches and a changed data file no longer gives its numbers: either fails here, naming the claim.
A qualitative word that rests on the data ("in every cell", "the same pattern") is checked by its
compute function, which fails when the data stops supporting it.
"""

from __future__ import annotations

import gzip
import json
import math
import re
import statistics
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest

from services.study.render import p_value
from spopp.compare.stats import sign_test
from spopp.metrics import POINTS, area, end_reward

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
NUMBER = r"([−+-]?\d[\d,]*(?:\.\d+)?)"

TOTAL, EVENT, CLIP, TOKEN = (
    "spopp vs spo",
    "spo-eventtime vs spo",
    "spopp-trajnorm vs spo-eventtime",
    "spopp vs spopp-trajnorm",
)


def pattern(sentence: str) -> re.Pattern:
    """The sentence as a regex: literal text, any white space for a space, a number for `{}`."""
    parts = [re.escape(part) for part in sentence.split("{}")]
    return re.compile(NUMBER.join(r"\s+".join(p.split(r"\ ")) for p in parts))


def signed(x: float, digits: int = 1) -> str:
    """+1.2 / −1.2 as the prose writes them (a true minus sign); 0.0 unsigned."""
    text = f"{round(x, digits) + 0.0:+.{digits}f}"
    return text.lstrip("+") if float(text) == 0 else text.replace("-", "−")


def f(x: float, fmt: str) -> str:
    return format(x, fmt)


# -- the committed data --------------------------------------------------------------------------------
@cache
def _map() -> dict:
    return json.loads((ROOT / "docs" / "map" / "map.json").read_text())


def cell(coupling: float, latency: float, result: dict | None = None) -> dict:
    result = result or _map()
    [c] = [c for c in result["cells"] if c["coupling"] == coupling and c["latency_sigma"] == latency]
    return c


def diffs(key: str) -> list[dict]:
    return [c["diffs"][key] for c in _map()["cells"]]


@cache
def _json(path: str) -> dict:
    return json.loads((RESULTS / path).read_text())


@cache
def _lines(path: str) -> list[dict]:
    return [json.loads(line) for line in (RESULTS / path).read_text().splitlines() if line.strip()]


@cache
def _episodes(arm: str, version: int) -> dict:
    path = RESULTS / "demo-real-cuda" / arm / "eval" / "episodes" / f"v{version:06d}.jsonl.gz"
    with gzip.open(path, "rt") as fh:
        return {(r["task_id"], r["mode"]): r for r in map(json.loads, fh)}


# -- the map (docs/results.md, README.md) ------------------------------------------------------------
def _behind() -> tuple[str, ...]:
    d = cell(0.0, 1.5)["diffs"][TOTAL]
    assert d["hi"] < 0, "the cell no longer excludes zero"
    return (
        f(-d["mean"], ".1f"),
        f(d["se"], ".1f"),
        signed(d["lo"]),
        signed(d["hi"]),
        str(d["n"]),
        p_value(d["t_p"]),
    )


def _behind_holm() -> tuple[str, ...]:
    d = cell(0.0, 1.5)["diffs"][TOTAL]
    assert d["holm_p"] >= 0.05, "the cell now survives Holm's correction"
    return str(sum(1 for c in _map()["cells"] if c["diffs"][TOTAL]["t_p"] is not None)), p_value(d["holm_p"])


def _pilot_pairs() -> tuple[str, ...]:
    pairs = cell(0.0, 1.5, _map()["pilot"])["diffs"][TOTAL]["per_seed"]
    assert all(x >= 0 for x in pairs) and cell(0.0, 1.5)["diffs"][TOTAL]["mean"] < 0  # "the other way"
    return tuple(signed(x) for x in pairs)


def _coupling0_pooled() -> tuple[str, ...]:
    ds = [cell(0.0, lat)["diffs"][TOTAL] for lat in _map()["latencies"]]
    won, lost = sum(d["won"] for d in ds), sum(d["lost"] for d in ds)
    return str(won), str(sum(d["n"] for d in ds)), f(sign_test(won, lost), ".3f")


def _ahead() -> tuple[str, ...]:
    d = cell(-1.0, 0.0)["diffs"][TOTAL]
    assert d["lo"] < 0 < d["hi"]  # "not an interval clear of zero"
    return (f(d["mean"], ".1f"), f(d["se"], ".1f"), signed(d["lo"]), signed(d["hi"]), str(d["won"]), str(d["n"]),
            f(d["sign_p"], ".2f"), p_value(d["t_p"]), p_value(d["holm_p"]))  # fmt: skip


def _pooled(key: str) -> Callable[[], tuple[str, ...]]:
    return lambda: (p_value(_map()["pooled"][key]["p"]),)


def _fisher_total() -> tuple[str, ...]:
    pooled = _map()["pooled"][TOTAL]
    return str(pooled["k"]), p_value(pooled["p"])


def _token_size() -> tuple[str, ...]:
    sizes = [abs(d["mean"]) for d in diffs(TOKEN)]
    largest = [
        abs(c["diffs"][TOKEN]["mean"]) >= max(abs(c["diffs"][k]["mean"]) for k in (EVENT, CLIP))
        for c in _map()["cells"]
    ]
    [other] = [c for c, ok in zip(_map()["cells"], largest, strict=True) if not ok]
    return (f(min(sizes), ".1f"), f(max(sizes), ".1f"), str(sum(largest)), str(len(largest)),
            f"{other['coupling']:+g}", f"{other['latency_sigma']:g}", signed(other["diffs"][CLIP]["mean"], 2),
            signed(other["diffs"][TOKEN]["mean"], 2))  # fmt: skip


def _token_same_sign() -> tuple[str, ...]:
    assert all((c["diffs"][TOKEN]["mean"] > 0) == (c["diffs"][TOTAL]["mean"] > 0) for c in _map()["cells"])
    return ()


def _token_tests() -> tuple[str, ...]:
    ds = diffs(TOKEN)
    assert all(d["lo"] < 0 < d["hi"] for d in ds)  # "no cell's interval for it excludes zero"
    return (p_value(min(d["t_p"] for d in ds)), p_value(max(d["t_p"] for d in ds)),
            p_value(min(d["holm_p"] for d in ds)))  # fmt: skip


def _small_steps() -> tuple[str, ...]:
    event, clip = diffs(EVENT), diffs(CLIP)
    assert all(abs(d["mean"]) < 1 for d in event + clip)  # "within a point of zero everywhere"
    return (f(max(abs(d["mean"]) for d in event), ".2f"), f(max(abs(d["mean"]) for d in clip), ".2f"),
            str(sum(d["won"] for d in event)), str(sum(d["won"] for d in clip)), str(sum(d["n"] for d in event)),
            p_value(_map()["pooled"][EVENT]["p"]), p_value(_map()["pooled"][CLIP]["p"]))  # fmt: skip


def _latency_did() -> tuple[str, ...]:
    out = []
    for key, fmt in (("late_fraction", ".2f"), ("reorder_distance", ".1f")):
        for lat in _map()["latencies"]:
            values = [c["measured"][key] for c in _map()["cells"] if c["latency_sigma"] == lat]
            out += [f(min(values), fmt), f(max(values), fmt)]
    return tuple(out)


def _coupling_measured() -> tuple[str, ...]:
    corr = [c["measured"]["length_advantage_corr"] for c in _map()["cells"]]
    zero = [c["measured"]["length_advantage_corr"] for c in _map()["cells"] if c["coupling"] == 0]
    return f(min(abs(x) for x in corr), ".2f"), *(signed(x, 2) for x in zero)


def _token_sign_by_coupling() -> tuple[str, ...]:
    def pattern_at(lat: float) -> list[tuple[float, bool]]:
        cs = sorted((c for c in _map()["cells"] if c["latency_sigma"] == lat), key=lambda c: c["coupling"])
        return [(c["coupling"], c["diffs"][TOKEN]["mean"] > 0) for c in cs]

    lats = _map()["latencies"]
    assert all(pattern_at(lat) == pattern_at(lats[0]) for lat in lats)  # "the same pattern at latency 1.5"
    cs = [c for c in _map()["cells"] if c["latency_sigma"] == lats[0]]
    pos = [signed(c["measured"]["length_advantage_corr"], 2) for c in cs if c["diffs"][TOKEN]["mean"] > 0]
    neg = [signed(c["measured"]["length_advantage_corr"], 2) for c in cs if c["diffs"][TOKEN]["mean"] < 0]
    return (*pos, *neg)


def _c10_points() -> tuple[str, ...]:
    [points] = {c["points"] for c in _map()["cells"]}
    assert points < 10
    return str(points), str(points)


def _arm_correlations() -> list[tuple[dict, float]]:
    """Each cell with the Pearson correlation, over its main seeds, of SPO's and SPO++'s areas."""
    out = []
    for c in _map()["cells"]:
        a, b = c["arms"]["spo"]["per_seed"], c["arms"]["spopp"]["per_seed"]
        seeds = [str(s) for s in c["seeds"]]
        out.append((c, statistics.correlation([a[s] for s in seeds], [b[s] for s in seeds])))
    return out


def _map_pairing() -> tuple[str, ...]:
    # The binomial s.e. of one curve point, in reward points, at the sentence's success rate.
    se = [f(100 * math.sqrt(0.55 * 0.45 / n), ".1f") for n in (256, 384)]
    rs = _arm_correlations()
    negative = [r for _c, r in rs if r < 0]
    [(other, r)] = [(c, r) for c, r in rs if r >= 0]  # "positively in one"
    return (*se, str(len(negative)), str(len(rs)), signed(min(negative), 2), signed(max(negative), 2),
            signed(r, 2), f"{other['coupling']:g}", f"{other['latency_sigma']:g}", str(len(other["seeds"])))  # fmt: skip


def _no_cell_survives() -> tuple[str, ...]:
    holm = [d["holm_p"] for c in _map()["cells"] for d in c["diffs"].values()]
    assert min(holm) >= 0.05, "a cell survives Holm's correction now"
    return (str(len(_map()["cells"])),)


def _readme_token() -> tuple[str, ...]:
    ds = diffs(TOKEN)
    assert {d["mean"] > 0 for d in ds} == {True, False}  # "a sign that depends on the cell"
    assert all(d["lo"] < 0 < d["hi"] for d in ds)  # "no interval clear of zero"
    return tuple(f(g(abs(d["mean"]) for d in ds), ".1f") for g in (min, max))


def _readme_map_minutes() -> tuple[str, ...]:
    # From the pilot's first start to the last main run's finish, to the nearest ten minutes.
    t = _map()["times"]
    return (str(10 * round((t["main"]["last_finish"] - t["pilot"]["first_start"]) / 600)),)


def _ablation_small() -> tuple[str, ...]:
    rows = _json("demo-ablate/report.json")["ablation"]["rows"].values()
    assert all(abs(r["mean"]) <= r["sd"] for r in rows)  # "within about one s.d. of zero"
    return ()


def _map_times() -> tuple[str, ...]:
    t = _map()["times"]
    return (str(t["main"]["runs"] + t["pilot"]["runs"]), str(t["pilot"]["runs"]), str(t["main"]["runs"]),
            f(t["main"]["mean_s"], ".1f"))  # fmt: skip


def _map_times_table() -> tuple[str, ...]:
    t = _map()["times"]
    return tuple(
        x
        for part in ("pilot", "main")
        for x in (str(t[part]["runs"]), f(t[part]["mean_s"], ".1f"), f(t[part]["total_s"] / 60, ".1f"))
    )


# -- the demos (docs/results.md, BENCHMARKS.md) ---------------------------------------------------------
def _demo_learns() -> tuple[str, ...]:
    runs = _json("demo/report.json")["runs"] + _json("demo-ablate/report.json")["runs"]
    [start] = {f(r["rewards"][0], ".2f") for r in runs}
    ends = [end_reward(r["rewards"]) for r in runs]
    return start, f(min(ends), ".2f"), f(max(ends), ".2f")


def _demo_tables() -> tuple[str, ...]:
    a, b = _json("demo/report.json")["table"], _json("demo-ablate/report.json")["table"]
    assert a["pairs_won_area"]["won"] == 0  # "lost all"
    return (str(a["pairs"]), signed(a["d_area"]["mean"]), f(a["d_area"]["sd"], ".1f"), signed(b["d_area"]["mean"]),
            f(b["d_area"]["sd"], ".1f"), str(b["pairs_won_area"]["won"]), str(b["pairs"]))  # fmt: skip


def _agent_within_two_se() -> tuple[str, ...]:
    d = _json("demo-agent/summary.json")["comparison"]["paired_difference"]
    assert abs(d["mean"]) < 2 * d["se"]
    return ()


def _staleness() -> tuple[str, ...]:
    report = _json("staleness/report.json")
    pairs = report["staleness"]
    summary = report["staleness_summary"]["spopp-k1"]
    behind = [-p["d_area"] for p in pairs]
    assert all(x > 0 for x in behind)  # "behind k = 0 on every seed"
    return (str(summary["won_area"]), str(summary["pairs"]), f(min(behind), ".1f"), f(max(behind), ".1f"),
            f(summary["speedup"]["mean"], ".1f"))  # fmt: skip


# -- the pretrained model (docs/models.md) -------------------------------------------------------------
def _cpu_curve() -> dict:
    return {p["version"]: p for p in _json("demo-real/summary.json")["spopp"]["curve"]}


def _cpu_rise() -> tuple[str, ...]:
    c = _cpu_curve()
    out = []
    for v in (8, 4):
        delta, se = c[v]["success"] - c[0]["success"], math.hypot(c[v]["se"], c[0]["se"])
        out += [f(delta, "+.3f"), f(se, ".3f"), f(delta / se, ".0f")]
    return tuple(out)


def _cpu_table() -> tuple[str, ...]:
    return tuple(f"{p['success']:.3f} ± {p['se']:.3f}" for p in _cpu_curve().values())


def _batches() -> tuple[str, ...]:
    by_version = {r["policy_version"]: r["reward_mean"] for r in _lines("demo-real/learner/metrics.jsonl")}
    later = {v: r for v, r in by_version.items() if v >= 1}
    [low] = [v for v, r in later.items() if r == min(later.values())]
    return (f(100 * by_version[0], ".0f"), f(100 * min(later.values()), ".0f"), f(100 * max(later.values()), ".0f"),
            f(100 * max(later.values()), ".0f"), str(sum(r == 1.0 for r in later.values())), str(len(later)),
            f(100 * min(later.values()), ".0f"), str(low))  # fmt: skip


def _learner_steps() -> tuple[str, ...]:
    rows = _lines("demo-real/learner/metrics.jsonl")
    fast = [r for r in rows if r["update_seconds"] < 100]
    slow = [r for r in rows if r["update_seconds"] >= 100]
    return (f(min(r["update_seconds"] for r in fast), ".0f"), f(max(r["update_seconds"] for r in fast), ".0f"),
            f(min(r["sequence_tokens_per_s"] for r in fast), ".0f"),
            f(max(r["sequence_tokens_per_s"] for r in fast), ".0f"), *(str(r["step"]) for r in fast),
            f(min(r["update_seconds"] for r in slow), ".0f"), f(max(r["update_seconds"] for r in slow), ".0f"))  # fmt: skip


def _cpu_eval() -> tuple[str, ...]:
    evals = {r["policy_version"]: r for r in _lines("demo-real/eval/evals.jsonl")}
    v0 = evals[0]
    rate = v0["eval/tasks"] * v0["eval/sampled/response_tokens_mean"] / v0["eval/seconds"]
    longest = max(r["eval/seconds"] for r in evals.values())
    return f(v0["eval/seconds"], ".0f"), f(rate, ".1f"), f(longest / 60, ".0f")


def _cuda(arm: str) -> dict:
    return _json(f"demo-real-cuda/{arm}/summary.json")


def _cuda_row(arm: str) -> Callable[[], tuple[str, ...]]:
    def compute() -> tuple[str, ...]:
        s = _cuda(arm)
        cells = [f"{p['success']:.3f} ± {p['se']:.3f}" for p in s["curve"]]
        rise = s["rise"]
        return (*cells, f(rise["delta"], "+.3f"), f(rise["se"], ".3f"), f(rise["z"], ".1f"))

    return compute


def _cuda_costs() -> tuple[str, ...]:
    a, b = _cuda("spopp")["costs"], _cuda("spo")["costs"]
    [learner] = {f(c["learner_update_seconds"], ".1f") for c in (a, b)}
    return (f(a["update_seconds"], ".1f"), f(b["update_seconds"], ".1f"), learner,
            f(a["learner_tokens_per_s"], ",.0f"), f(b["learner_tokens_per_s"], ",.0f"),
            f(a["learner_action_tokens_per_s"], ".0f"), f(b["learner_action_tokens_per_s"], ".0f"),
            f(a["rollout_tokens_per_s"][0], ".0f"), f(b["rollout_tokens_per_s"][0], ".0f"))  # fmt: skip


def _cuda_v0() -> tuple[str, ...]:
    return f(_cuda("spopp")["curve"][0]["success"], ".3f"), f(_cpu_curve()[0]["success"], ".3f")


def _cuda_ceiling() -> tuple[str, ...]:
    a, b = _episodes("spopp", 4), _episodes("spo", 4)
    assert a.keys() == b.keys()
    right = {sum(r["reward"] == 1.0 for r in arm.values()) for arm in (a, b)}
    [each] = right  # "each arm": the same count in both
    both = sum(a[k]["reward"] == 1.0 and b[k]["reward"] == 1.0 for k in a)
    same = sum(a[k]["response"] == b[k]["response"] for k in a)
    return str(each), str(len(a)), str(both), str(same), str(len(a))


# -- the claims -----------------------------------------------------------------------------------------
README, RESULTS_MD, MODELS, BENCH = "README.md", "docs/results.md", "docs/models.md", "BENCHMARKS.md"
LEARNER = "docs/learner.md"


# -- the common-random-numbers measurement (docs/results/crn/crn.json) ------------------------------
def _crn(side: str) -> dict:
    return _json("crn/crn.json")[side]


def _crn_pairing() -> tuple[str, ...]:
    after, before = _crn("after"), _crn("before")
    fewer = (before["delta_sd"] / after["delta_sd"]) ** 2
    return (signed(after["correlation"], 2), signed(before["correlation"], 2), f(before["delta_sd"], ".2f"),
            f(after["delta_sd"], ".2f"), f(before["delta_sd"], ".2f"), f(after["delta_sd"], ".2f"), f(fewer, ".1f"))  # fmt: skip


def _crn_ratio_interval() -> tuple[str, ...]:
    """The 95 % interval of the variance ratio before / after: each side's paired s.d. comes from
    its own n pairs, so (s_b² / s_a²) / (σ_b² / σ_a²) is F with (n_b − 1, n_a − 1) degrees of
    freedom when the two sides are independent normal samples."""
    from scipy.stats import f as fisher_f

    crn = _json("crn/crn.json")
    n_b, n_a = len(crn["before"]["areas"]["spo"]), len(crn["after"]["areas"]["spo"])
    ratio = (crn["before"]["delta_sd"] / crn["after"]["delta_sd"]) ** 2
    lo = ratio / fisher_f.ppf(0.975, n_b - 1, n_a - 1)
    hi = ratio / fisher_f.ppf(0.025, n_b - 1, n_a - 1)
    assert 1 < lo  # "anywhere from about 2": the interval clears 1, so pairing now pays for certain
    assert n_b == n_a == len(crn["seeds"])  # "each estimated from 10 pairs"
    about = [f"{float(f'{x:.1g}'):g}" for x in (lo, hi)]  # "about": one significant digit
    return (f(ratio, ".1f"), str(n_a), f(lo, ".1f"), f(hi, ".0f"), str(n_b - 1), str(n_a - 1), f(ratio, ".1f"),
            *about)  # fmt: skip


def _crn_batches() -> tuple[str, ...]:
    n = str(len(_json("crn/crn.json")["seeds"]))
    return (str(_crn("after")["first_batch_equal"]), n, str(_crn("before")["first_batch_equal"]), n)


def _crn_spread() -> tuple[str, ...]:
    before, after = _crn("before")["sd"].values(), _crn("after")["sd"].values()
    assert max(before) - min(before) < 0.1  # "1.6" stands for both arms
    return (f(statistics.fmean(before), ".1f"), f(min(after), ".1f"), f(max(after), ".1f"))


def _crn_deltas() -> tuple[str, ...]:
    b, a = _crn("before"), _crn("after")
    return (
        signed(b["delta_mean"], 2),
        f(b["delta_se"], ".2f"),
        signed(a["delta_mean"], 2),
        f(a["delta_se"], ".2f"),
    )


# -- the pretrained-model study (docs/models.md) --------------------------------------------------------
def _study() -> dict:
    return _json("pretrained-study/data/study.json")


def _study_rise() -> tuple[str, ...]:
    runs = _study()["runs"]
    assert all(r["versions"] == [0, 2, 4] for r in runs)  # "at version 0 ... at version 4"
    assert all(r["rewards"][-1] > r["rewards"][0] for r in runs)  # "both arms learn in every run"
    v0, v4 = [r["rewards"][0] for r in runs], [r["rewards"][-1] for r in runs]
    return f(min(v0), ".3f"), f(max(v0), ".3f"), f(min(v4), ".3f"), f(max(v4), ".3f")


def _study_diff() -> tuple[str, ...]:
    [d] = _study()["diffs"]
    assert (d["arm"], d["against"], d["n"]) == ("spopp", "spo", 3)
    return signed(d["mean"], 2), f(d["se"], ".2f"), signed(d["lo"], 2), f(d["hi"], "+.2f"), f(d["t_p"], ".3f")


def _study_pairs() -> tuple[str, ...]:
    [d] = _study()["diffs"]
    assert d["lost"] == d["n"]  # "lost all"
    behind = [-x for x in d["per_seed"]]
    assert d["sign_p"] == sign_test(d["n"], 0)  # "the smallest a sign test over 3 pairs can give"
    return str(d["n"]), f(min(behind), ".2f"), f(max(behind), ".2f"), f(d["sign_p"], ".3f")


def _study_n() -> tuple[str, ...]:
    protocol = _study()["protocol"]
    [seeds] = protocol["seeds"].values()
    sd = protocol["pilot"]["summary"]["sd"]
    asked = math.ceil((sd / protocol["target_se"]) ** 2)
    assert asked < protocol["n_min"] == len(seeds)  # "the protocol's floor"
    return str(len(seeds)), str(asked)


def _study_sign_floor() -> tuple[str, ...]:
    from spopp.compare.stats import SIGN_TEST_MIN_PAIRS, sign_floor

    [d] = _study()["diffs"]
    assert sign_floor(SIGN_TEST_MIN_PAIRS) < 0.05 <= sign_floor(SIGN_TEST_MIN_PAIRS - 1)  # "needs 6 pairs"
    return f(d["sign_p"], ".3f"), str(d["n"]), str(SIGN_TEST_MIN_PAIRS)


def _study_both_signs() -> tuple[str, ...]:
    [d] = _study()["diffs"]
    assert d["lo"] < 0 < d["hi"]  # "the interval holds both signs"
    return ()


def _study_metric() -> tuple[str, ...]:
    from tools.pretrained_study import PAPER_EFFECTS

    study = _study()
    [versions] = {tuple(r["versions"]) for r in study["runs"]}
    size = study["protocol"]["grid"]["size"]
    updates = size.get("max_updates", size.get("updates"))  # a protocol decided before the rename
    return (signed(PAPER_EFFECTS["Math-TIR"], 2), signed(PAPER_EFFECTS["ALFWorld"], 2), str(len(versions)),
            str(updates))  # fmt: skip


def _study_headroom() -> tuple[str, ...]:
    """The most SPO++ could have gained in each pair: its curve at success 1 after its first point
    against SPO's curve as measured, in area points."""
    from tools.pretrained_study import PAPER_EFFECTS

    study = _study()
    curves = {(r["arm"], r["seed"]): r["rewards"] for r in study["runs"]}
    seeds = sorted({r["seed"] for r in study["runs"]})
    [versions] = {tuple(r["versions"]) for r in study["runs"]}
    most = [POINTS * (area([curves[("spopp", s)][0]] + [1.0] * (len(versions) - 1)) - area(curves[("spo", s)]))
            for s in seeds]  # fmt: skip
    assert max(most) < PAPER_EFFECTS["ALFWorld"]  # "under the size of the ALFWorld effect"
    v4 = [r["rewards"][-1] for r in study["runs"]]
    return f(min(v4), ".3f"), str(versions[1]), f(min(most), ".2f"), f(max(most), ".2f")


def _stopped_pilot_wrong() -> tuple[str, ...]:
    """The stopped pilot run's page predicted version 4 below the ceiling: the study's numbers."""
    pilot = _json("pretrained-study/data/pilot/report.json")["runs"]
    main = _study()["runs"]
    n_heldout = _study()["protocol"]["grid"]["size"]["n_heldout"]
    failed = [round((1 - r["rewards"][-1]) * n_heldout) for r in main]
    assert all(r["versions"][-1] == 4 for r in pilot + main)
    return (f(min(r["rewards"][-1] for r in pilot), ".3f"), f(max(r["rewards"][-1] for r in pilot), ".3f"),
            str(len(pilot)), f(min(r["rewards"][-1] for r in main), ".3f"), f(max(r["rewards"][-1] for r in main), ".3f"),
            str(len(main)), str(min(failed)), str(max(failed)), str(n_heldout))  # fmt: skip


DEMO_PADDING = "docs/results/demo-padding/README.md"
STOPPED_PILOT = "docs/results/pretrained-study/stopped-pilot-run/README.md"


@cache
def _demo_padding() -> dict[str, list[float]]:
    """Each arm's per-update padding share in the demo run made with `packing: false`."""
    out = {}
    for run in ("spo-s0", "spopp-s0"):
        rows = (RESULTS / "demo-padding" / run / "metrics.jsonl").read_text().splitlines()
        out[run] = [json.loads(x)["padding_fraction"] for x in rows if x]
    return out


def _demo_padding_row(run: str) -> Callable[[], tuple[str, ...]]:
    def row() -> tuple[str, ...]:
        shares = _demo_padding()[run]
        return (
            str(len(shares)),
            *(f(100 * x, ".1f") for x in (statistics.mean(shares), min(shares), max(shares))),
        )

    return row


def _demo_padding_means() -> tuple[str, ...]:
    return tuple(f(100 * statistics.mean(s), ".1f") for s in _demo_padding().values())


def _demo_padding_ceiling() -> tuple[str, ...]:
    return tuple(f(1 / (1 - statistics.mean(s)), ".2f") for s in _demo_padding().values())


def _liger_plan() -> tuple[str, ...]:
    """`spopp learner plan` at the GPU bench's Qwen2-1.5B shape, ZeRO 2, 16,384 tokens, bf16, no
    checkpointing or offload: with liger's kernels and without."""
    from bench.learner_gpu import MODELS as SHAPES
    from services.learner import memory_plan

    shape = memory_plan.model_shape(SHAPES["Qwen2-1.5B"])
    out = []
    for liger in (True, False):
        rows = memory_plan.plan(shape, gpus=1, gpu_memory_gib=80, tokens=16384, zero=2, liger=liger)
        [row] = [r for r in rows if not r.checkpointing and r.offload == "none"]
        out.append(f(row.total / memory_plan.GIB, ".1f"))
    return tuple(out)


def _liger_layer_share() -> tuple[str, ...]:
    """liger's saving per token and layer (8H + 2I in bf16) as a share of a Qwen2 layer's, at
    1.5B's shape and at 7B's."""
    from bench.learner_gpu import MODELS as SHAPES
    from services.learner import memory_plan

    config = json.loads((ROOT / "tests" / "data" / "qwen2-7b-config.json").read_text())
    shares = []
    for shape in (memory_plan.model_shape(SHAPES["Qwen2-1.5B"]), memory_plan.model_shape(config)):
        layer = memory_plan.saved_per_token(shape)[0]
        shares.append(f(100 * (layer - memory_plan.saved_per_token(shape, liger=True)[0]) / layer, ".0f"))
    return tuple(shares)


SMOLLM2_STUDY = "docs/results/smollm2-study/README.md"


def _design1_last_points() -> tuple[str, ...]:
    """The last online reward (learner/metrics.jsonl's last reward_mean) of design 1's two pilot runs."""
    runs = RESULTS / "smollm2-study" / "design-1" / "out" / "pilot" / "runs"
    last = []
    for run in ("spo-s1000", "spopp-s1000"):
        rows = [
            json.loads(x) for x in (runs / run / "learner" / "metrics.jsonl").read_text().splitlines() if x
        ]
        assert [r["step"] for r in rows] == list(range(1, 9)), run  # the whole budget, 8 updates
        last.append(rows[-1]["reward_mean"])
    assert all(x >= 0.9 for x in last)  # "at or above the ceiling"
    return tuple(f(x, ".4f") for x in last)


DESIGN2 = RESULTS / "smollm2-study" / "design-2" / "out"


@cache
def _design2() -> dict:
    """study.json of the SmolLM2 study's design 2, as `spopp study compare` wrote it (its refusal)."""
    return json.loads((DESIGN2 / "study.json").read_text())


def _design2_refusal() -> tuple[str, ...]:
    """The pilot's paired s.d., the n it asks, the hours it needs with the pilot, the budget."""
    study = _design2()
    found, asked = study["design"], study["request"]
    # "Every design check passed; the budget stopped it."
    assert study["status"] == "refused" and all(c["ok"] for c in found["checks"])
    return (f(found["pilot_sd"], ".3g"), str(found["n"]), f(asked["effect"], "+g"), f(study["needed_hours"], ".1f"),
            f(asked["budget_hours"], "g"))  # fmt: skip


def _design2_minutes() -> tuple[str, ...]:
    minutes = [r["seconds"] / 60 for r in _design2()["pilot_runs"]]
    return f(min(minutes), ".1f"), f(max(minutes), ".1f")


def _design2_fastest() -> tuple[str, ...]:
    """n pairs of both arms at the fastest pilot run's time, against what the budget left after the
    pilot: "would still take more" holds only while the first is larger."""
    study = _design2()
    found, asked = study["design"], study["request"]
    fastest = found["n"] * len(asked["arms"]) * min(r["seconds"] for r in study["pilot_runs"]) / 3600
    left = asked["budget_hours"] - found["pilot_s"] / 3600
    assert fastest > left
    return str(found["n"]), f(fastest, ".2f"), f(left, ".2f")


def _design2_coupling() -> tuple[str, ...]:
    """Failures longer than successes in design 2's pilot: the held-out episodes' mean turns and
    response tokens by outcome (eval/episodes of the six runs), and the learner's per-update
    correlation of length with advantage (learner/metrics.jsonl's length_advantage_corr)."""
    runs = sorted((DESIGN2 / "pilot" / "runs").iterdir())
    episodes = [json.loads(x) for run in runs for path in sorted((run / "eval" / "episodes").glob("*.jsonl"))
                for x in path.read_text().splitlines() if x]  # fmt: skip
    won = [e for e in episodes if e["reward"] == 1.0]
    lost = [e for e in episodes if e["reward"] == 0.0]
    assert len(runs) == 6 and len(won) + len(lost) == len(episodes)
    assert all(
        sorted(p.name for p in (r / "eval" / "episodes").iterdir()) == ["v000000.jsonl", "v000008.jsonl"]
        for r in runs
    )
    corr = [json.loads(x)["length_advantage_corr"] for run in runs
            for x in (run / "learner" / "metrics.jsonl").read_text().splitlines() if x]  # fmt: skip
    turns = [statistics.fmean(e["turns"] for e in side) for side in (won, lost)]
    tokens = [statistics.fmean(e["response_tokens"] for e in side) for side in (won, lost)]
    assert turns[1] > turns[0] and tokens[1] > tokens[0] and max(corr) < 0  # "failures run longer"
    return (str(len(episodes)), f(turns[0], ".1f"), f(tokens[0], ".1f"), f(turns[1], ".1f"), f(tokens[1], ".1f"),
            signed(min(corr), 2), signed(max(corr), 2), str(len(corr)), signed(statistics.fmean(corr), 2))  # fmt: skip


CLAIMS: list[tuple[str, str, Callable[[], tuple[str, ...]]]] = [
    (SMOLLM2_STUDY, "both runs ended their online curve at {} and {}, at or above", _design1_last_points),
    (SMOLLM2_STUDY, "At the pilot's paired s.d. of {} points on the primary metric, the paired t test needs n = {} "
     "pairs for 80 % power against {} points: {} h of machine time with the pilot, against the {} h this design "
     "was given", _design2_refusal),
    (SMOLLM2_STUDY, "The pilot's runs took {} to {} minutes", _design2_minutes),
    (SMOLLM2_STUDY, "(versions 0 and 8 of its six runs, {} episodes) a success took {} turns and {} response tokens on "
     "average and a failure {} turns and {} tokens; in its training batches the length of a trajectory and its "
     "advantage correlated at r = {} to {} over the {} updates (mean {})", _design2_coupling),
    (SMOLLM2_STUDY, "at the fastest run's time the {} pairs would still take {} h, more than the {} h the budget "
     "left after the pilot", _design2_fastest),
    (README, "on the toy model no cell's difference survives Holm's correction over the {} cells", _no_cell_survives),
    (README, "rerun on one cell, the paired s.d. of Δ area fell from {} to {} points",
     lambda: (f(_crn("before")["delta_sd"], ".2f"), f(_crn("after")["delta_sd"], ".2f"))),
    (README, "the action-token measure's mean differences are {}–{} points, with a sign that depends on the cell and "
     "no interval clear of zero)", _readme_token),
    (README, "seeds per cell fixed by a pilot ({} minutes here;", _readme_map_minutes),
    (RESULTS_MD, "the normalization ablation's differences are all within about one s.d. of zero.", _ablation_small),
    (RESULTS_MD, "SPO++ is behind by {} ± {} points ([{}, {}], n = {}, t p = {}).", _behind),
    (RESULTS_MD, "It does not survive Holm's correction for the {} cells (Holm p = {})", _behind_holm),
    (RESULTS_MD, "the cell's two pilot pairs went the other way ({} and {} points)", _pilot_pairs),
    (RESULTS_MD, "{} of {} has a two-sided sign test p of {}.", _coupling0_pooled),
    (RESULTS_MD, "SPO++ is ahead by {} ± {} ([{}, {}], {} of {} pairs won, sign p = {}, t p = {}, Holm p = {})",
     _ahead),
    (RESULTS_MD, "Fisher's combination of the {} cells' t p gives p = {}:", _fisher_total),
    (RESULTS_MD, "The action-token measure's mean difference has the same sign as the total's in every cell",
     _token_same_sign),
    (RESULTS_MD, "Its size is {} to {} points, the largest of the three steps in {} of the {} cells: at coupling {} "
     "and latency {}, Dual-Clip 2's {} is larger than its {}.", _token_size),
    (RESULTS_MD, "(t p {} to {}, Holm p {} or more)", _token_tests),
    (RESULTS_MD, "Fisher's combination over the cells gives p = {} (exploratory)", _pooled(TOKEN)),
    (RESULTS_MD, "within a point of zero everywhere (at most {} and {} points), with {} and {} of {} pairs won "
     "(Fisher p = {} and {})", _small_steps),
    (RESULTS_MD, "(late outcomes {}–{} without it, {}–{} with it; reorder distance {}–{} against {}–{})", _latency_did),
    (RESULTS_MD, "is at least {} in absolute value in every cell, coupling 0 included ({} and {}:", _coupling_measured),
    (RESULTS_MD, "interval excludes zero, and the pooled p is {}.", _pooled(TOKEN)),
    (RESULTS_MD, "positive at {} and {}, negative at {} (latency 0; the same pattern at latency 1.5)",
     _token_sign_by_coupling),
    (RESULTS_MD, "the paper's formula on the map's {}-point curves, labelled \"C10 ({} points)\"", _c10_points),
    (RESULTS_MD, "(`make map`: {} runs, the pilot's {} and {} main runs of {} s on average)", _map_times),
    (RESULTS_MD, "The arms' areas correlate at r = {} over the seeds, against {} before, and the paired s.d. of Δ "
     "area falls from {} to {} points. The same standard error now takes about ({} / {})² ≈ {} times fewer pairs.",
     _crn_pairing),
    (RESULTS_MD, "≈ {} times fewer pairs. That is a ratio of two variances, each estimated from {} pairs, and its 95 % "
     "interval is {} to {} (F with {} and {} degrees of freedom, taking the two sides' runs as independent "
     "samples): {} is the point estimate of a factor this measurement places anywhere from about {} to about {}.",
     _crn_ratio_interval),
    (RESULTS_MD, "(a binomial s.e. of about {} reward points instead of {} at a success rate of 0.55). Pairing by "
     "seed was meant to cancel much of that noise, and in this map it did not: a difference cancels the noise its "
     "two arms share only where their areas correlate positively, and SPO's and SPO++'s per-seed areas correlate "
     "negatively in {} of the {} cells (r = {} to {}) and positively in one (r = {}, coupling {} at latency {}, "
     "over {} seeds).", _map_pairing),
    (RESULTS_MD, "reward in {} of {} seeds, against {} of {} before.", _crn_batches),
    (RESULTS_MD, "It went from {} to {}–{} points because every run used to share the evaluator's seed 0.", _crn_spread),
    (RESULTS_MD, "Δ area is {} ± {} before and {} ± {} after.", _crn_deltas),
    (RESULTS_MD, "A main run took {} s on average", lambda: (f(_map()["times"]["main"]["mean_s"], ".1f"),)),
    (RESULTS_MD, "held-out reward from {} at version 0 to an end reward of {}–{})", _demo_learns),
    (RESULTS_MD, "(SPO++ lost all {} pairs, {} ± {} area points) and they are even on seeds 3–5 ({} ± {}, {} of {} "
     "pairs won)", _demo_tables),
    (RESULTS_MD, "the paired difference of their means is within two standard errors of zero", _agent_within_two_se),
    (MODELS, "The rise from version 0 to 8 is {} ± {}, {} standard errors (version 4: {} ± {}, {}).", _cpu_rise),
    (MODELS, "| held-out success (T = 1) | {} ± {} | {} ± {} | {} ± {} |",
     lambda: tuple(x for cell_ in _cpu_table() for x in cell_.split(" ± "))),
    (MODELS, "Training batches were right {} % of the time at version 0 and {}–{} % from version 1 on ({} % in {} of "
     "those {} batches, {} % at version {})", _batches),
    (MODELS, "took {}–{} s ({}–{} tokens/s) in updates {} and {}, while only the run's own processes shared the two "
     "cores, and {}–{} s in the other six", _learner_steps),
    (MODELS, "took {} s at version 0 ({} generated tokens/s) and up to {} minutes", _cpu_eval),
    (MODELS, "| SPO++ | {} ± {} | {} ± {} | {} ± {} | {} ± {} ({} s.e.) |",
     lambda: tuple(x for c in _cuda_row("spopp")() for x in c.split(" ± "))),
    (MODELS, "| SPO | {} ± {} | {} ± {} | {} ± {} | {} ± {} ({} s.e.) |",
     lambda: tuple(x for c in _cuda_row("spo")() for x in c.split(" ± "))),
    (MODELS, "per update {} s and {} s of wall time (the learner's own step {} s; the rest is the next batch's rollouts "
     "and the swap); learner {} and {} tokens/s ({} and {} of them the model's own); the replica generated {} and {} "
     "tokens/s.", _cuda_costs),
    (MODELS, "Version 0 is {} here against {} on the CPU run", _cuda_v0),
    (MODELS, "held-out success rose from {}–{} at version 0 to {}–{} at version 4", _study_rise),
    (MODELS, "SPO Δ area is {} ± {} points (mean ± s.e. over the pairs; 95 % t interval [{}, {}], t p = {})",
     _study_diff),
    (MODELS, "SPO++ lost all {} pairs, by {} to {} points (sign p = {}, the smallest", _study_pairs),
    (MODELS, "3 main pairs on seeds 0, 1 and 2, fixed before the first main run; the {} is the protocol's floor, "
     "since the pilot's s.d. asked for {})", _study_n),
    (MODELS, "(sign p = {}, the smallest a sign test over {} pairs can give; it needs {} pairs to go under 0.05)",
     _study_sign_floor),
    (MODELS, "The interval holds both signs: the study cannot say which method trains this model better.",
     _study_both_signs),
    (MODELS, "The paper's Δ ({} on Math-TIR, {} on ALFWorld) is the normalized area under the *online training-reward* "
     "curve, each update's batch mean, over a common budget of 50 (ALFWorld) or 100 (Math-TIR) plotted steps; this "
     "study's Δ is the area under held-out success measured at {} versions of a {}-update run.", _study_metric),
    (MODELS, "every run was at {} or more by version 4, and the most SPO++ could have gained over SPO in a pair, at "
     "success 1 from version {} on, was {} to {} area points, under the size of the ALFWorld effect.", _study_headroom),
    (STOPPED_PILOT, "At lr 2e-4 held-out success at version 4 was {}–{} in the pilot's {} runs and {}–{} in the {} main "
     "runs ([the study's page](../data/README.md)): in the main runs only {} to {} of the {} held-out tasks were still "
     "failed at version 4", _stopped_pilot_wrong),
    (MODELS, "(each arm answers {} of the {} held-out tasks right, {} of them right in both; {} of the {} answers are "
     "the same text)", _cuda_ceiling),
    (DEMO_PADDING, "| spo-s0 | {} | {}% | {}% | {}% |", _demo_padding_row("spo-s0")),
    (DEMO_PADDING, "| spopp-s0 | {} | {}% | {}% | {}% |", _demo_padding_row("spopp-s0")),
    (DEMO_PADDING, "1 / (1 - s) faster: {}x and {}x here.", _demo_padding_ceiling),
    (LEARNER, "(SPO and SPO++, seed 0) averaged {}% and {}%", _demo_padding_means),
    (LEARNER, "16,384-token micro-batches under ZeRO 2 the plan says {} GiB with liger, {} without.", _liger_plan),
    (LEARNER, "I intermediate), {}% of a Qwen2 layer's at 1.5B and {}% at 7B.", _liger_layer_share),
    (BENCH, "({} of {} pairs won on area, by {} to {} points); by the clock it publishes each version about {} times "
     "sooner", _staleness),
    (BENCH, "| pilot (SPO, SPO++; seeds 1000, 1001; 6 cells) | {} | {} s | {} min | | main (4 arms; 3 to 10 seeds per "
     "cell) | {} | {} s | {} min |", _map_times_table),
]  # fmt: skip


@cache
def _page(name: str) -> str:
    return (ROOT / name).read_text()


@pytest.mark.parametrize(
    "page,sentence,compute", CLAIMS, ids=[f"{p}:{s[:40]}" for p, s, _c in CLAIMS]
)  # fmt: skip
def test_the_prose_quotes_the_committed_data(page, sentence, compute):
    found = pattern(sentence).findall(_page(page))
    assert len(found) == 1, (
        f"{page}: the sentence {sentence!r} is {'not there' if not found else 'there twice'}"
    )
    quoted = found[0] if isinstance(found[0], tuple) else (found[0],) if sentence.count("{}") else ()
    assert tuple(quoted) == compute(), f"{page}: {sentence!r} quotes {quoted}, the data gives {compute()}"


def test_the_matcher_fails_an_edited_number_and_an_edited_sentence():
    """The check has teeth: a changed number is caught by its compute, a reworded sentence by its regex."""
    p = pattern("is ahead by {} ± {} ([{}, {}], {} of {} pairs")
    assert p.findall("is ahead\n  by 1.7 ± 0.8 ([−0.1, +3.4], 8 of 10 pairs") == [
        ("1.7", "0.8", "−0.1", "+3.4", "8", "10")
    ]
    assert p.findall("is ahead by 1.7 ± 0.8 ([−0.1, +3.4], 8 of 10 seeds") == []
    assert signed(-0.74462890625, 2) == "−0.74" and signed(0.0) == "0.0" and signed(0.97) == "+1.0"
