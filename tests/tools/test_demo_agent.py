"""`make demo-agent`'s arithmetic and its published section (tools/demo_agent.py): the comparison
of two arms paired by seed, and docs/results.md as the rendering of the committed summary."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tools.demo_agent import compare, render_page

ROOT = Path(__file__).resolve().parents[2]


def _report(curves: dict[int, list[float]]) -> dict:
    return {
        "runs": [
            {"seed": s, "arm": "spopp", "versions": [4 * i for i in range(len(r))], "rewards": r}
            for s, r in curves.items()
        ]
    }


def test_the_comparison_pairs_runs_by_seed():
    built_in = _report({0: [0.4, 0.5, 0.6], 1: [0.4, 0.6, 0.8], 2: [0.4, 0.4, 0.4]})
    agent = _report({0: [0.4, 0.5, 0.9], 1: [0.4, 0.6, 0.8], 5: [0.0, 0.0, 0.0]})  # seed 5 has no partner
    c = compare(built_in, agent)
    assert c["seeds"] == [0, 1]
    # Per seed, the difference of the curves' means: seed 0 (0.9 - 0.6) / 3 = 0.1, seed 1 0.
    assert c["paired_difference"]["per_seed"] == pytest.approx([0.1, 0.0])
    assert c["paired_difference"]["mean"] == pytest.approx(0.05)
    # s.e. of two values 0.1 and 0: s.d. 0.0707 / sqrt(2) = 0.05.
    assert c["paired_difference"]["se"] == pytest.approx(0.05)
    points = c["curves"]["agent"]["points"]
    assert [p["version"] for p in points] == [0, 4, 8]
    assert points[2]["mean"] == pytest.approx(0.85)
    assert c["curves"]["built_in"]["rise"]["mean"] == pytest.approx(0.3)


def test_one_seed_has_no_standard_error():
    c = compare(_report({0: [0.1, 0.2]}), _report({0: [0.1, 0.3]}))
    assert math.isnan(c["paired_difference"]["se"])


def test_the_results_page_is_the_rendering_of_the_committed_summary():
    page = (ROOT / "docs" / "results.md").read_text()
    assert render_page(page, ROOT) == page, "run `python -m tools.demo_agent --render docs/results.md`"
