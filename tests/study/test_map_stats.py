"""The map's tests over its cells (Holm's adjustment, Fisher's pooled test), the protocol that names
them before the main runs, and C10 labelled with its points where a curve has fewer than ten.

Every expected value is computed by hand in the comments; Student's t with 2 degrees of freedom
and chi-square with an even number of degrees of freedom have closed forms:
P(|T| > t) = 1 − t / sqrt(2 + t²), and P(X > x) = exp(−x/2) · Σ_{j<k} (x/2)^j / j! for 2k d.f.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest

from services.study.protocol import PLANNED_TESTS, decide, fixed
from services.study.render import markdown, p_value
from services.study.summary import across_cells
from spopp.compare.stats import fisher, holm, t_p
from spopp.metrics import c10_label

ROOT = Path(__file__).resolve().parents[2]


def test_holm_by_hand():
    # Sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1: 0.02, 0.03, 0.06, 0.04; the last is raised to
    # 0.06, since an adjusted p never falls below the one before it.
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    # A None is not in the family: m = 2, so 0.2 x 2 = 0.4 and 0.5 x 1 = 0.5.
    assert holm([None, 0.5, 0.2]) == [None, pytest.approx(0.5), pytest.approx(0.4)]
    assert holm([0.6, 0.7]) == [1.0, 1.0]  # 1.2 capped at 1, then 0.7 raised to it
    assert holm([0.3]) == [0.3] and holm([]) == []


def test_fisher_by_hand():
    # One p: X = −2 ln p with 2 d.f., whose tail exp(−x/2) is p again.
    assert fisher([0.2])["p"] == pytest.approx(0.2)
    # Two p's of 0.5: X = 4 ln 2 with 4 d.f.: exp(−2 ln 2) (1 + 2 ln 2) = (1 + 2 ln 2) / 4 = 0.5966.
    both = fisher([0.5, None, 0.5])
    assert both["k"] == 2 and both["df"] == 4 and both["statistic"] == pytest.approx(4 * math.log(2))
    assert both["p"] == pytest.approx((1 + 2 * math.log(2)) / 4)
    assert fisher([1.0, 1.0])["p"] == pytest.approx(1.0)
    assert fisher([0.0, 0.5]) == {"k": 2, "statistic": None, "df": 4, "p": 0.0}  # no infinite X in map.json
    assert fisher([None])["p"] is None


def test_the_t_tests_p_by_hand():
    # Mean 3, s.e. sqrt(3), 2 d.f.: t = sqrt(3), p = 1 − sqrt(3) / sqrt(5).
    assert t_p({"mean": 3.0, "se": math.sqrt(3.0), "df": 2}) == pytest.approx(1 - math.sqrt(3 / 5))
    assert t_p({"mean": -3.0, "se": math.sqrt(3.0), "df": 2}) == pytest.approx(1 - math.sqrt(3 / 5))
    assert t_p({"mean": 0.0, "se": 0.0, "df": 2}) == 1.0 and t_p({"mean": 6.0, "se": 0.0, "df": 2}) == 0.0
    assert t_p({"mean": 1.0, "se": None, "df": 0}) is None  # one pair: no test


def test_across_cells_adjusts_per_comparison_and_pools_it():
    key, other = "spopp vs spo", "spopp vs spopp-trajnorm"
    cells = [
        {"diffs": {key: {"label": "SPO++ − SPO", "mean": 3.0, "se": math.sqrt(3.0), "df": 2},
                   other: {"label": "+ action-token measure", "mean": 1.0, "se": None, "df": 0}}},
        {"diffs": {key: {"label": "SPO++ − SPO", "mean": 0.0, "se": 1.0, "df": 2},
                   other: {"label": "+ action-token measure", "mean": 0.0, "se": 0.0, "df": 2}}},
    ]  # fmt: skip
    pooled = across_cells(cells)
    a, b = cells[0]["diffs"][key], cells[1]["diffs"][key]
    p = 1 - math.sqrt(3 / 5)  # 0.2254, and b's t of 0 has p 1
    assert (a["t_p"], b["t_p"]) == pytest.approx((p, 1.0))
    assert (a["holm_p"], b["holm_p"]) == pytest.approx((2 * p, 1.0))  # m = 2 cells
    # Fisher over (p, 1): X = −2 ln p, 4 d.f.: p (1 − ln p).
    assert pooled[key]["p"] == pytest.approx(p * (1 - math.log(p))) and pooled[key]["label"] == "SPO++ − SPO"
    # The other comparison is its own family: one cell has no test, so the other is alone (m = 1).
    assert cells[0]["diffs"][other]["holm_p"] is None and cells[1]["diffs"][other]["holm_p"] == 1.0
    assert pooled[other]["k"] == 1 and pooled[other]["p"] == pytest.approx(1.0)


def test_a_p_value_never_prints_as_the_level_it_misses():
    # Three decimals under 0.1 would print 0.0502 and 0.0496 as 0.050, which reads as the 5 % level.
    assert p_value(0.0502) == "0.0502" and p_value(0.0496) == "0.0496" and p_value(0.05) == "0.050"
    assert p_value(0.008366) == "0.008" and p_value(0.073) == "0.073" and p_value(0.2991) == "0.30"
    assert p_value(0.0004) == "<0.001" and p_value(None) == "n/a"
    assert p_value(0.05 + 1e-12) == "0.05000000"  # the digits stop at 8; no endless loop


def test_the_committed_maps_correction_and_pooled_tests():
    """The numbers the issue's audit gave: the one cell whose interval excludes zero has a Holm p
    over the 6 cells just above 0.05 (printed with the digit that shows it), and the action-token
    step's pooled test p 0.07."""
    result = json.loads((ROOT / "docs" / "map" / "map.json").read_text())
    [c] = [c for c in result["cells"] if c["coupling"] == 0.0 and c["latency_sigma"] == 1.5]
    total = c["diffs"]["spopp vs spo"]
    assert total["hi"] < 0 and total["t_p"] < 0.05 < total["holm_p"] < 0.051
    assert p_value(total["holm_p"]) == f"{total['holm_p']:.4f}" and float(p_value(total["holm_p"])) > 0.05
    assert p_value(total["t_p"]) == f"{total['t_p']:.3f}"
    assert 0.07 <= result["pooled"]["spopp vs spopp-trajnorm"]["p"] < 0.08
    assert "tests" not in result["protocol"]  # decided before the tests were named: exploratory


def test_the_protocol_names_the_tests_before_the_main_runs():
    assert fixed(["a"], [0, 1, 2], 1.5)["tests"] == PLANNED_TESTS
    protocol = decide({"a": 1.0}, [1000, 1001], 1.5, 3, 0, math.inf, 40.0, None)
    assert protocol["tests"] == PLANNED_TESTS and set(PLANNED_TESTS) == {"per_cell", "multiplicity", "pooled"}
    assert "Holm" in PLANNED_TESTS["multiplicity"] and "Fisher" in PLANNED_TESTS["pooled"]


def test_c10_is_labelled_with_its_points():
    assert c10_label([5, 5, 5]) == "C10 (5 points)"
    assert c10_label([3, 5]) == "C10 (3–5 points)"
    assert c10_label([5, 12]) == "C10 (5–10 points)"  # C10 reads ten points at most
    assert c10_label([10, 11]) == "C10" and c10_label([]) == "C10"


def test_the_map_page_shows_holm_beside_p_the_pooled_tests_and_c10s_points():
    result = json.loads((ROOT / "docs" / "map" / "map.json").read_text())
    md = markdown(result)
    assert "| won | sign p | t p | Holm p |" in md
    [c] = [c for c in result["cells"] if c["coupling"] == 0.0 and c["latency_sigma"] == 1.5]
    total = c["diffs"]["spopp vs spo"]
    assert f"| 0/3 | 0.25 | {p_value(total['t_p'])} | {p_value(total['holm_p'])} |" in md
    assert "over the map's 6 cells, one family per comparison" in md
    assert "+ action-token measure: p = 0.073" in md and "so they are exploratory" in md
    assert "| C10 (5 points) spo / spo-eventtime" in md and "C10 (5 points) = ½" in md
    # A map with ten-point curves says C10; one whose protocol named the tests says so.
    ten = copy.deepcopy(result)
    for c in ten["cells"]:
        c["points"] = 10
    ten["protocol"]["tests"] = PLANNED_TESTS
    md = markdown(ten)
    assert "| C10 spo / spo-eventtime" in md and "C10 (" not in md
    assert "The protocol named these tests before the main runs." in md and "exploratory" not in md


def test_the_reports_table_2_labels_a_short_c10():
    from services.report.tables import _table2_lines

    rows = {"SPO++ vs SPO": {"text": "+1.0 ± 0.5"}}
    short = {"ablation": {"seeds": [1], "per_seed": [{"points": 5}], "rows": rows}, "points": None}
    text = "\n".join(_table2_lines(short))
    assert "## Table 2: normalization ablation (C10, 5 points)" in text
    assert (
        "not the paper's C10 of ten points" in text
        and "| comparison | Δ C10 (5 points) in percentage points |" in text
    )
    full = {"ablation": {"seeds": [1], "per_seed": [{"points": 10}], "rows": rows}, "points": None}
    text = "\n".join(_table2_lines(full))
    assert "(C10)" in text and "C10 = ½ (AUC of points 1–10 + mean of points 6–10)" in text
    assert "| comparison | Δ C10 (points) |" in text
