"""The common-random-numbers measurement as published: docs/results/crn/crn.json is what
tools/crn_measure computes from the committed runs, and docs/results.md shows its table.

The areas are recomputed from each run's evals.jsonl and learner/metrics.jsonl (the map's and the
CRN runs' light copies): the same arithmetic on the same files in the same order, so the
recomputation equals the committed JSON exactly, on any machine."""

from __future__ import annotations

import json
from pathlib import Path

from tools.crn_measure import main, measure, render

ROOT = Path(__file__).resolve().parents[2]
CRN = ROOT / "docs" / "results" / "crn"


def test_the_committed_measurement_is_the_runs_measurement():
    committed = json.loads((CRN / "crn.json").read_text())
    protocol = json.loads((CRN / "protocol.json").read_text())
    again = measure(ROOT / "docs" / "map" / "data", CRN / "data", protocol, committed["after_commit"])
    assert json.loads(json.dumps(again)) == committed
    # What the protocol fixed is what was measured: its cell, arms and seeds, every run.
    assert (committed["cell"], committed["arms"], committed["seeds"]) == (
        protocol["cell"], protocol["arms"], protocol["seeds"])  # fmt: skip
    for side in ("before", "after"):
        assert all(len(v) == len(protocol["seeds"]) for v in committed[side]["areas"].values())


def test_the_page_shows_the_table_of_the_committed_measurement(capsys):
    table = render(json.loads((CRN / "crn.json").read_text()))
    page = (ROOT / "docs" / "results.md").read_text()
    assert f"<!-- crn:begin -->\n{table}\n<!-- crn:end -->" in page
    assert main(["--render", str(CRN / "crn.json")]) == 0 and capsys.readouterr().out.strip() == table
