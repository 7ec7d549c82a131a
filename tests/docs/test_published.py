"""What the docs publish is the rendering of committed data, and that data is what its runs say.

- The map: docs/results.md's map section and docs/map/map.md are `spopp map --render docs/map/`'s
  drawing of the committed docs/map/map.json (`make map-render` redraws them), and map.json's
  grid is recomputed here from the committed light copy of its runs (docs/map/data: each run's
  run.json, learner metrics and evaluation records; tools/map_pack.py).
- Report tables: every page's report sections (services/report/published.py) are the rendering
  of the report.json each names.
- The pretrained-model study's page and the demo's padding measurement: their runs' own records.
- The map's and the common-random-numbers measurement's runs record no code: their pages say so.
- The SmolLM2 study (`spopp study compare`): its refusal after the pilot, recomputed from the pilot's
  committed runs.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from services.report.published import render_page
from services.study import render
from services.study.map import PILOT, summarize
from services.study.summary import TOTAL, diff_key, run_times

ROOT = Path(__file__).resolve().parents[2]
MAP = ROOT / "docs" / "map"
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]


def _map() -> dict:
    return json.loads((MAP / "map.json").read_text())


def test_the_map_section_and_map_md_are_the_rendering_of_the_committed_map():
    result = _map()
    page = (ROOT / "docs" / "results.md").read_text()
    assert render.section(page, result) == page, "docs/results.md's map section is stale: make map-render"
    assert (MAP / "map.md").read_text() == render.markdown(result), (
        "docs/map/map.md is stale: make map-render"
    )
    assert "](map/map.png)" in page and (MAP / "map.png").stat().st_size > 10_000


def test_the_committed_map_is_what_its_committed_runs_say():
    result, data = _map(), MAP / "data"
    grid, protocol = result["protocol"]["grid"], result["protocol"]
    again = summarize(data, grid["couplings"], grid["latencies"], grid["arms"], protocol["seeds"])
    assert again == {k: result[k] for k in again}
    pilot_seeds = {cell: protocol["pilot_seeds"] for cell in protocol["seeds"]}
    pilot_arms = [a for a in grid["arms"] if a in TOTAL]
    assert (
        summarize(data / PILOT, grid["couplings"], grid["latencies"], pilot_arms, pilot_seeds)
        == result["pilot"]
    )
    assert run_times(data) == result["times"]["main"] and run_times(data / PILOT) == result["times"]["pilot"]


def test_the_committed_map_kept_its_protocol():
    result = _map()
    protocol = result["protocol"]
    assert result["arms"] == ["spo", "spo-eventtime", "spopp-trajnorm", "spopp"]
    main = {s for seeds in protocol["seeds"].values() for s in seeds}
    assert main and not main & set(protocol["pilot_seeds"])  # the pilot's seeds are never main seeds
    for cell in result["cells"]:
        seeds = protocol["seeds"][cell["cell"]]
        total = cell["diffs"][diff_key(*TOTAL)]
        # Every main run reported, none added after the protocol; each difference with its t
        # interval and sign test.
        assert len(seeds) >= 3 and cell["seeds"] == seeds and total["n"] == len(seeds) == total["df"] + 1
        assert total["lo"] <= total["mean"] <= total["hi"] and total["won"] + total["lost"] + total[
            "tied"
        ] == len(seeds)
        assert 0 < total["sign_p"] <= 1 and len(total["per_seed"]) == len(seeds)


def test_every_page_is_the_rendering_of_the_report_json_files_it_names():
    for page in PAGES:
        text = page.read_text()
        assert render_page(text, ROOT) == text, (
            f"{page.name} is stale: spopp report --render {page.relative_to(ROOT)}"
        )


STUDY = ROOT / "docs" / "results" / "pretrained-study" / "data"


def test_the_pretrained_study_page_is_its_runs():
    """docs/results/pretrained-study/data: README.md is the rendering of study.json, study.json is
    what the protocol and the main report give, and each report row is its run's own evaluation
    records (the light copy's evals.jsonl), on the code its run.json names."""
    from tools import pretrained_study as ps

    study = json.loads((STUDY / "study.json").read_text())
    assert (STUDY / "README.md").read_text() == ps.render(study), (
        "the study's page is stale: python -m tools.pretrained_study --render " + str(STUDY.relative_to(ROOT))
    )
    protocol = json.loads((STUDY / "protocol.json").read_text())
    assert ps.build_study(STUDY, protocol) == study
    report = json.loads((STUDY / "main" / "report.json").read_text())
    assert {(r["arm"], r["seed"]) for r in report["runs"]} == {
        (arm, seed)
        for arm in protocol["grid"]["arms"]
        for seed in protocol["seeds"][protocol["grid"]["family"]]
    }
    for row in report["runs"]:
        folder = STUDY / "main" / "runs" / row["run"]
        evals = [json.loads(x) for x in (folder / "eval" / "evals.jsonl").read_text().splitlines()]
        assert [e["policy_version"] for e in evals] == row["versions"]
        assert [e["eval/sampled/reward_mean"] for e in evals] == row["rewards"]
        assert json.loads((folder / "run.json").read_text())["code"] == row["code"]


DEMO_PADDING = ROOT / "docs" / "results" / "demo-padding"


def test_the_demo_padding_runs_are_what_their_page_says():
    """The runs were made by the committed diff (its hash is in each run.json) with packing off."""
    diff = (DEMO_PADDING / "packing-off.diff").read_bytes()
    assert b'"packing": False' in diff
    for run in ("spo-s0", "spopp-s0"):
        record = json.loads((DEMO_PADDING / run / "run.json").read_text())
        assert record["code"]["diff_sha256"] == hashlib.sha256(diff).hexdigest()
        assert record["code"]["dirty_files"] == ["tools/demo.py"]
        assert "packing: false" in (DEMO_PADDING / run / "launch.yaml").read_text()


CRN = ROOT / "docs" / "results" / "crn"


def test_the_map_and_crn_runs_were_made_before_runs_recorded_their_code():
    """Every committed map run (pilot and main) and every common-random-numbers run has no `code` in
    its run.json, so nothing can check which commit made them; their pages must say so rather than
    name one. A run added with its code would fail here, and the pages would need rewriting."""
    from spopp.files import provenance

    result = _map()
    runs = sorted((MAP / "data").rglob("run.json"))
    assert len(runs) == result["times"]["main"]["runs"] + result["times"]["pilot"]["runs"]
    crn_protocol = json.loads((CRN / "protocol.json").read_text())
    crn_runs = sorted((CRN / "data").rglob("run.json"))
    assert len(crn_runs) == len(crn_protocol["arms"]) * len(crn_protocol["seeds"])
    for path in runs + crn_runs:
        assert json.loads(path.read_text()).get("code") is None, f"{path} records its code: rewrite its pages"
    # The map's pages say it in the sentence provenance gives for runs without code ...
    unrecorded = provenance.describe(None)
    assert all(not c["recorded"] for cell in result["cells"] for c in cell["code"]["codes"])
    page = (ROOT / "docs" / "results.md").read_text()
    assert unrecorded in render.section(page, result) and unrecorded in (MAP / "map.md").read_text()
    # ... and the common-random-numbers section says it by hand, naming no commit as the runs' own.
    crn_section = page[page.index("### Common random numbers") :]
    assert "They were made before runs recorded their code" in " ".join(crn_section.split())
    assert "clean checkout of commit" not in page


SMOLLM2 = ROOT / "docs" / "results" / "smollm2-study" / "design-2"


def test_the_smollm2_study_is_what_its_pilot_runs_say():
    """docs/results/smollm2-study/design-2/out is what `spopp study compare` wrote when its budget
    could not pay for the n its pilot asked: no protocol was registered and no main run made. The
    committed study.yaml is the config that ran (its hash is the one study.json records), and from
    it and the six committed pilot runs (their run.json, learner metrics and evaluation records) the
    command's own functions give design.json, the refusal's message and study.json whole; README.md
    is its rendering. One clean commit made every run."""
    from services.launch.cli import resolve
    from services.study.measures import measure
    from services.study.registered import Request, StudyRefused, _refuse_budget, pilot_design, refusal
    from services.study.study_page import render as render_study

    out = SMOLLM2 / "out"
    study = json.loads((out / "study.json").read_text())
    asked = study["request"]
    assert (
        study["status"] == "refused" and not (out / "protocol.json").exists() and not (out / "runs").exists()
    )
    # The command line in study.yaml's header is the one study.json records.
    header = " ".join((SMOLLM2 / "study.yaml").read_text().replace("#", " ").split())
    assert (
        f"spopp study compare {asked['config']} --out {asked['out']} --budget-hours {asked['budget_hours']:g}"
        in header
    )
    req = Request(
        base=resolve(SMOLLM2 / "study.yaml", ()), out=Path(asked["out"]), arms=tuple(asked["arms"]),
        pilot_seeds=asked["pilot_seeds"], first_seed=asked["first_seed"], effect=asked["effect"],
        primary=asked["primary"], budget_s=3600 * asked["budget_hours"], force=asked["force"],
        config=Path(asked["config"]),
    )  # fmt: skip
    assert (
        req.options()["config_sha256"] == asked["config_sha256"]
    )  # the committed config is the one that ran
    # In the order the command ran them: seed by seed, the control first.
    runs = [
        measure(out / "pilot" / "runs" / f"{arm}-s{seed}") for seed in req.pilot_seeds for arm in req.arms
    ]
    found = pilot_design(req, runs)
    assert json.loads((out / "pilot" / "design.json").read_text()) == json.loads(json.dumps(found))
    assert all(check["ok"] for check in found["checks"])  # the design can answer; the budget stopped it
    with pytest.raises(StudyRefused) as refused:
        _refuse_budget(req, found)
    assert json.loads(json.dumps(refusal(req, found, str(refused.value), runs))) == study
    assert study["needed_hours"] > asked["budget_hours"]
    assert len(study["code"]["codes"]) == 1 and study["code"]["problem"] is None
    assert all(r.code["source"] == "git" and not r.code["dirty"] for r in runs)
    assert (out / "README.md").read_text() == render_study(study), "the study's page is not its study.json"
