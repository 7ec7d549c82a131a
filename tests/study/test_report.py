"""`spopp report`: the curve summaries, pairing by seed, truncation, --points, ablation and errors.

Every expected number is computed by hand in the test (the arithmetic written out), not by the
report's own functions, so that a wrong formula fails here.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from services.report.cli import command
from services.report.plot import mean_band, trailing_mean
from spopp.compare.stats import summarize, wins
from spopp.metrics import area, c10, end_reward

ROOT = Path(__file__).resolve().parents[2]
METRIC = "eval/sampled/reward_mean"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---- the metrics, on small explicit curves -------------------------------------------------------


def test_area_trapezoid_and_step_mean_by_hand():
    assert area([0.0, 0.5, 1.0]) == pytest.approx(0.5)  # (0.25 + 0.75) / 2
    assert area([0.0, 0.5, 1.0], "mean") == pytest.approx(0.5)  # 1.5 / 3
    assert area([0.2, 0.4]) == pytest.approx(0.3)  # one trapezoid (0.2 + 0.4) / 2
    assert area([0.2, 0.4], "mean") == pytest.approx(0.3)
    # The rules differ when the curve is not symmetric: endpoints weigh half in the trapezoid.
    assert area([1.0, 0.0, 0.0]) == pytest.approx(0.25)  # (0.5 + 0) / 2
    assert area([1.0, 0.0, 0.0], "mean") == pytest.approx(1 / 3)
    assert area([0.7]) == 0.7 and area([0.7], "mean") == 0.7
    with pytest.raises(ValueError, match="unknown area rule"):
        area([0.1], "simpson")


def test_end_reward_is_the_mean_of_the_final_five_or_of_all():
    assert end_reward([0.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(3.0)  # (1+2+3+4+5)/5
    assert end_reward([0.2, 0.4]) == pytest.approx(0.3)
    assert end_reward([0.9]) == pytest.approx(0.9)


def test_c10_on_full_and_short_curves():
    # A step at point 6: AUC (0.5 + 4) / 9 = 0.5, mean of points 6..10 = 1, C10 = 0.75.
    assert c10([0.0] * 5 + [1.0] * 5) == pytest.approx(0.75)
    # Only the first ten points count.
    assert c10([0.0] * 5 + [1.0] * 5 + [0.0, 0.0]) == pytest.approx(0.75)
    # Ramp 0, 0.1, ..., 0.9: AUC 0.45, late mean (0.5 + ... + 0.9) / 5 = 0.7, C10 = 0.575.
    assert c10([t / 10 for t in range(10)]) == pytest.approx(0.575)
    # Fewer than ten points: 0.5 * (AUC + mean of the final five, or of all).
    assert c10([0.2, 0.4]) == pytest.approx(0.5 * (0.3 + 0.3))
    # Seven points: AUC (0.5 + 1) / 6 = 0.25, final five [0, 0, 0, 1, 1] mean 0.4 -> 0.325.
    assert c10([0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]) == pytest.approx(0.325)


def test_summary_uses_the_sample_sd_and_wins_count_strictly_positive():
    values = [20.0, 7.5, -8.0]
    mean = (20.0 + 7.5 - 8.0) / 3  # 6.5
    sd = math.sqrt(((20.0 - 6.5) ** 2 + (7.5 - 6.5) ** 2 + (-8.0 - 6.5) ** 2) / 2)  # sqrt(197.25)
    s = summarize(values)
    assert s.mean == pytest.approx(6.5) == pytest.approx(mean)
    assert s.sd == pytest.approx(sd) and s.sd == pytest.approx(statistics.stdev(values))
    assert s.n == 3
    assert summarize([4.0]).sd is None
    assert wins([1.0, 0.0, -1.0, 2.0]) == 2


def test_trailing_mean_and_the_mean_band():
    assert trailing_mean([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]) == pytest.approx([1, 1.5, 2, 2.5, 3, 4, 5])
    # Replicates on different versions: the mean covers the versions every replicate reaches
    # (0..2 here), each replicate interpolated between its own points.
    x, mean, se = mean_band([([0.0, 2.0], [0.0, 1.0]), ([0.0, 1.0, 4.0], [1.0, 1.0, 1.0])])
    assert x == [0.0, 1.0, 2.0]
    assert mean == pytest.approx([0.5, 0.75, 1.0])
    # At x = 0: values 0 and 1, s.d. sqrt(0.5), s.e. sqrt(0.5) / sqrt(2) = 0.5; at x = 1: 0.5 and 1,
    # s.d. sqrt(0.125), s.e. 0.25; at x = 2 both are 1.
    assert se == pytest.approx([0.5, 0.25, 0.0])
    assert mean_band([([0.0, 3.0], [0.2, 0.4])]) == ([0.0, 3.0], [0.2, 0.4], [0.0, 0.0])


# ---- run folders written by hand ----------------------------------------------------------------


def write_run(
    root: Path,
    arm: str,
    seed: int,
    rewards: list[float],
    *,
    skip: tuple[int, ...] = (),
    status: str = "finished",
    name: str | None = None,
) -> Path:
    """A run folder with points at versions 0, 2, 4, ...; a version in `skip` is written as skipped
    (and takes its slot, so the next scored point moves on by 2)."""
    folder = root / (name or f"{arm}-s{seed}")
    (folder / "eval").mkdir(parents=True)
    recipe = "spo" if arm == "spo" else "spopp"
    norm = "trajectory" if arm == "spopp-trajnorm" else "token"
    meta = {"run": folder.name, "arm": arm, "recipe": recipe, "normalization": norm, "seed": seed}
    (folder / "run.json").write_text(json.dumps({**meta, "status": status, "tracker": "http://x"}))
    lines, version, values = [], 0, list(rewards)
    while values:
        if version in skip:
            lines.append({"policy_version": version, "skipped": "pruned before scoring", "time": 1.7e9})
        else:
            r = values.pop(0)
            lines.append(
                {
                    "policy_version": version,
                    "step": None if version == 0 else version,
                    "snapshot": f"/snap/v{version:06d}",
                    "time": 1.7e9 + version,
                    METRIC: r,
                    "eval/greedy/reward_mean": 1.0 - r,
                    "eval/sampled/success_rate": r,
                }
            )
        version += 2
    (folder / "eval" / "evals.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return folder


# Three seeds x {spo, spopp}. Seed 0 has a skipped version in its spo run; seed 1's spopp run is one
# point longer than its spo run.
CURVES = {
    ("spo", 0): [0.0, 0.2, 0.4, 0.4],
    ("spopp", 0): [0.0, 0.4, 0.6, 0.8],
    ("spo", 1): [0.0, 0.1, 0.1],
    ("spopp", 1): [0.0, 0.2, 0.2, 0.9],
    ("spo", 2): [0.5, 0.5, 0.5, 0.5],
    ("spopp", 2): [0.5, 0.4, 0.4, 0.4],
}

# By hand, trapezoid areas at each pair's common length:
# seed 0 (4 points): spo (0.1 + 0.3 + 0.4) / 3 = 0.8/3, spopp (0.2 + 0.5 + 0.7) / 3 = 1.4/3
# seed 1 (3 points): spo (0.05 + 0.1) / 2 = 0.075,    spopp (0.1 + 0.2) / 2 = 0.15
# seed 2 (4 points): spo 0.5,                         spopp (0.45 + 0.4 + 0.4) / 3 = 1.25/3
AREAS = {0: (0.8 / 3, 1.4 / 3), 1: (0.075, 0.15), 2: (0.5, 1.25 / 3)}
# End rewards (fewer than five points: the mean of all): seed 0: 1.0/4, 1.8/4; seed 1 (3 points):
# 0.2/3, 0.4/3; seed 2: 0.5, 1.7/4.
ENDS = {0: (0.25, 0.45), 1: (0.2 / 3, 0.4 / 3), 2: (0.5, 0.425)}
D_AREA = [20.0, 7.5, -25.0 / 3]  # 100 * (spopp - spo): 60/3, 7.5, 100 * (1.25 - 1.5) / 3
D_END = [20.0, 20.0 / 3, -7.5]


@pytest.fixture
def runs_root(tmp_path):
    root = tmp_path / "runs"
    for (arm, seed), rewards in CURVES.items():
        write_run(root, arm, seed, rewards, skip=(6,) if (arm, seed) == ("spo", 0) else ())
    return root


def invoke(*args: str | Path) -> tuple[int, dict | str, str]:
    result = CliRunner().invoke(command, [str(a) for a in args])
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), (
        result.exception
    )
    if "--format" in args and result.exit_code == 0:
        return result.exit_code, json.loads(result.stdout), result.stderr
    return result.exit_code, result.stdout, result.stderr


def sample_sd(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def test_hand_computed_sample_sd_of_the_area_differences():
    # mean (20 + 7.5 - 8.3333) / 3 = 57.5 / 9 = 6.3889; deviations 13.6111, 1.1111, -14.7222.
    mean = (20.0 + 7.5 - 25.0 / 3) / 3
    assert mean == pytest.approx(57.5 / 9)
    by_hand = math.sqrt((13.6111111**2 + 1.1111111**2 + 14.7222222**2) / 2)
    assert sample_sd(D_AREA) == pytest.approx(by_hand, rel=1e-6)
    assert statistics.stdev(D_AREA) == pytest.approx(by_hand, rel=1e-6)


def test_table_one_numbers_from_three_paired_seeds(runs_root):
    code, report, _ = invoke(runs_root, "--format", "json")
    assert code == 0
    assert report["metric"] == METRIC and report["area"] == "trapezoid" and report["points"] is None
    assert report["ablation"] is None
    # The runs, with their curves: the skipped version is out, version 0's step is null.
    runs = {(r["arm"], r["seed"]): r for r in report["runs"]}
    assert len(runs) == 6
    spo0 = runs[("spo", 0)]
    assert spo0["versions"] == [0, 2, 4, 8] and spo0["steps"] == [None, 2, 4, 8]
    assert spo0["rewards"] == [0.0, 0.2, 0.4, 0.4] and spo0["skipped_versions"] == [6]
    assert spo0["run"] == "spo-s0" and spo0["status"] == "finished"
    assert spo0["dir"] == str(runs_root / "spo-s0")
    assert runs[("spopp", 1)]["rewards"] == [0.0, 0.2, 0.2, 0.9]

    pairs = report["pairs"]
    assert [p["seed"] for p in pairs] == [0, 1, 2]
    assert [p["points"] for p in pairs] == [4, 3, 4]
    for p in pairs:
        spo_area, spopp_area = AREAS[p["seed"]]
        spo_end, spopp_end = ENDS[p["seed"]]
        assert p["spo"]["area"] == pytest.approx(spo_area)
        assert p["spopp"]["area"] == pytest.approx(spopp_area)
        assert p["spo"]["end"] == pytest.approx(spo_end)
        assert p["spopp"]["end"] == pytest.approx(spopp_end)
    assert [p["d_area"] for p in pairs] == pytest.approx(D_AREA)
    assert [p["d_end"] for p in pairs] == pytest.approx(D_END)

    table = report["table"]
    assert table["d_area"]["mean"] == pytest.approx(57.5 / 9)
    assert table["d_area"]["sd"] == pytest.approx(sample_sd(D_AREA))
    assert table["d_end"]["mean"] == pytest.approx((20.0 + 20.0 / 3 - 7.5) / 3)
    assert table["d_end"]["sd"] == pytest.approx(statistics.stdev(D_END))
    assert table["spo_area"]["mean"] == pytest.approx((0.8 / 3 + 0.075 + 0.5) / 3)
    assert table["spopp_area"]["mean"] == pytest.approx((1.4 / 3 + 0.15 + 1.25 / 3) / 3)
    assert table["spo_end"]["mean"] == pytest.approx((0.25 + 0.2 / 3 + 0.5) / 3)
    assert table["spopp_end"]["mean"] == pytest.approx((0.45 + 0.4 / 3 + 0.425) / 3)
    assert table["pairs_won_area"] == {"won": 2, "n": 3}
    assert table["pairs_won_end"] == {"won": 2, "n": 3}
    assert table["pairs"] == 3
    rows = table["rows"]
    assert list(rows) == [
        "SPO area",
        "SPO++ area",
        "Δ area (points)",
        "Δ end reward (points)",
        "SPO end",
        "SPO++ end",
        "pairs won (area)",
        "pairs won (end)",
        "pairs",
    ]
    assert rows["Δ area (points)"] == f"+6.4 ± {sample_sd(D_AREA):.1f}"
    assert rows["pairs won (area)"] == "2/3" and rows["pairs"] == "3"

    warnings = report["warnings"]
    assert "pair seed 1: truncated to 3 common points (spo has 3, spopp has 4)" in warnings
    assert any("spo-s0" in w and "skipped versions" in w and w.endswith(": 6") for w in warnings)
    assert not any("pair seed 0: truncated" in w or "pair seed 2: truncated" in w for w in warnings)


def test_step_mean_area(runs_root):
    _, report, _ = invoke(runs_root, "--format", "json", "--area", "mean")
    seed0 = report["pairs"][0]
    assert seed0["spo"]["area"] == pytest.approx(0.25)  # 1.0 / 4
    assert seed0["spopp"]["area"] == pytest.approx(0.45)  # 1.8 / 4
    assert seed0["d_area"] == pytest.approx(20.0)
    # Seed 1 at 3 points: 0.2 / 3 vs 0.4 / 3.
    assert report["pairs"][1]["d_area"] == pytest.approx(100 * 0.2 / 3)


def test_points_leaves_out_short_pairs_and_cuts_the_others(runs_root):
    _, report, _ = invoke(runs_root, "--format", "json", "--points", "4")
    assert report["points"] == 4
    assert [p["seed"] for p in report["pairs"]] == [0, 2]
    assert all(p["points"] == 4 for p in report["pairs"])
    assert any(w.startswith("pair seed 1: left out") and "below --points 4" in w for w in report["warnings"])
    d = [20.0, -25.0 / 3]
    assert report["table"]["d_area"]["mean"] == pytest.approx((20.0 - 25.0 / 3) / 2)
    assert report["table"]["d_area"]["sd"] == pytest.approx(math.sqrt(2 * (d[0] - sum(d) / 2) ** 2))
    assert report["table"]["pairs_won_area"] == {"won": 1, "n": 2}
    _, report, _ = invoke(runs_root, "--format", "json", "--points", "5")
    assert report["pairs"] == [] and report["table"] is None
    assert "no SPO/SPO++ pair: every pair has fewer than 5 common points, so no Table 1" in report["warnings"]

    # --points 2 cuts every pair to its first two points: seed 0 spo (0 + 0.2)/2, spopp 0.2.
    _, report, _ = invoke(runs_root, "--format", "json", "--points", "2")
    assert [p["points"] for p in report["pairs"]] == [2, 2, 2]
    assert report["pairs"][0]["spo"]["area"] == pytest.approx(0.1)
    assert report["pairs"][0]["spopp"]["area"] == pytest.approx(0.2)
    assert report["pairs"][0]["spo"]["end"] == pytest.approx(0.1)


def test_a_report_written_before_points_was_named_so_renders_alike(runs_root):
    # report.json said "budget" for --points before the rename; committed pages render from it.
    from services.report.tables import to_markdown

    _, report, _ = invoke(runs_root, "--format", "json", "--points", "4")
    text = to_markdown(report)
    assert "every pair at 4 points" in text
    old = {("budget" if k == "points" else k): v for k, v in report.items()}
    assert to_markdown(old) == text


def test_an_unpaired_seed_is_warned_about_listed_and_left_out(runs_root):
    write_run(runs_root, "spopp", 7, [0.3, 0.6])
    _, report, _ = invoke(runs_root, "--format", "json")
    assert [p["seed"] for p in report["pairs"]] == [0, 1, 2]
    assert ("spopp", 7) in {(r["arm"], r["seed"]) for r in report["runs"]}
    assert any("spopp-s7" in w and "seed 7" in w and "no spo partner" in w for w in report["warnings"])


def test_one_pair_has_no_sd(tmp_path):
    write_run(tmp_path, "spo", 0, [0.2, 0.4])
    write_run(tmp_path, "spopp", 0, [0.2, 0.6])
    code, out, _ = invoke(tmp_path / "spo-s0", tmp_path / "spopp-s0")
    assert code == 0
    # 100 * ((0.2 + 0.6)/2 - (0.2 + 0.4)/2) = +10.0
    assert "| Δ area (points) | +10.0 ± n/a |" in out
    _, report, _ = invoke(tmp_path, "--format", "json")
    assert report["table"]["d_area"] == {"mean": pytest.approx(10.0), "sd": None, "n": 1}


def test_no_pair_at_all_still_reports_and_draws(tmp_path):
    write_run(tmp_path / "runs", "spo", 0, [0.1, 0.2])
    write_run(tmp_path / "runs", "spo", 1, [0.1, 0.3])
    out_dir = tmp_path / "out"
    code, text, _ = invoke(tmp_path / "runs", "--out", out_dir)
    assert code == 0
    assert "No SPO/SPO++ pair" in text
    report = json.loads((out_dir / "report.json").read_text())
    assert report["pairs"] == [] and report["table"] is None
    assert "no SPO/SPO++ pair: no seed has both an spo and an spopp run, so no Table 1" in report["warnings"]
    assert (out_dir / "curves.png").read_bytes()[:8] == PNG_MAGIC


def test_the_ablation_table(tmp_path):
    step, ramp = [0.0] * 5 + [1.0] * 5, [t / 10 for t in range(10)]
    # Seed 0: C10 spo 0.75, spopp 0.575, trajnorm 0.5 (constant; two extra points cut off).
    write_run(tmp_path, "spo", 0, step)
    write_run(tmp_path, "spopp", 0, ramp)
    write_run(tmp_path, "spopp-trajnorm", 0, [0.5] * 12)
    # Seed 1: constants 0.2, 0.6, 0.4.
    write_run(tmp_path, "spo", 1, [0.2] * 10)
    write_run(tmp_path, "spopp", 1, [0.6] * 11)
    write_run(tmp_path, "spopp-trajnorm", 1, [0.4] * 10)
    # Seed 2 has no trajectory-norm. run: in Table 1, not in Table 2.
    write_run(tmp_path, "spo", 2, [0.2] * 10)
    write_run(tmp_path, "spopp", 2, [0.3] * 10)
    code, report, _ = invoke(tmp_path, "--format", "json")
    assert code == 0
    ab = report["ablation"]
    assert ab["seeds"] == [0, 1]
    assert ab["per_seed"][0]["c10"] == pytest.approx({"spo": 0.75, "spopp": 0.575, "spopp-trajnorm": 0.5})
    assert ab["per_seed"][1]["c10"] == pytest.approx({"spo": 0.2, "spopp": 0.6, "spopp-trajnorm": 0.4})
    assert [e["points"] for e in ab["per_seed"]] == [10, 10]
    rows = ab["rows"]
    # trajnorm - spo: -25, +20; spopp - spo: -17.5, +40; spopp - trajnorm: +7.5, +20.
    expect = {
        "SPO++ (trajectory norm.) vs SPO": (-2.5, math.sqrt(2 * 22.5**2)),
        "SPO++ vs SPO": (11.25, math.sqrt(2 * 28.75**2)),
        "Action-token vs. trajectory (paired difference)": (13.75, math.sqrt(2 * 6.25**2)),
    }
    assert list(rows) == list(expect)
    for name, (mean, sd) in expect.items():
        assert rows[name]["mean"] == pytest.approx(mean)
        assert rows[name]["sd"] == pytest.approx(sd)
        assert rows[name]["n"] == 2
    assert rows["SPO++ (trajectory norm.) vs SPO"]["text"] == "-2.5 ± 31.8"
    assert report["pairs"][2]["seed"] == 2 and len(report["pairs"]) == 3
    _, text, _ = invoke(tmp_path)
    assert "## Table 2" in text and "| SPO++ (trajectory norm.) vs SPO | -2.5 ± 31.8 |" in text
    # The markdown order: Table 1, Table 2, then the warnings.
    assert text.index("## Table 1") < text.index("## Table 2")


def test_a_short_ablation_uses_the_short_c10_and_warns(tmp_path):
    write_run(tmp_path, "spo", 0, [0.2, 0.4])
    write_run(tmp_path, "spopp", 0, [0.2, 0.6, 0.6])
    write_run(tmp_path, "spopp-trajnorm", 0, [0.4, 0.4, 0.4])
    _, report, _ = invoke(tmp_path, "--format", "json")
    seed0 = report["ablation"]["per_seed"][0]
    assert seed0["points"] == 2
    # At two points: spo 0.5 * (0.3 + 0.3), spopp 0.5 * (0.4 + 0.4), trajnorm 0.4.
    assert seed0["c10"] == pytest.approx({"spo": 0.3, "spopp": 0.4, "spopp-trajnorm": 0.4})
    assert report["ablation"]["rows"]["SPO++ vs SPO"]["sd"] is None
    assert any(w.startswith("ablation seed 0: only 2 common points") for w in report["warnings"])


# ---- errors: one line, exit code 1 -------------------------------------------------------------


def error_of(*args: str | Path) -> str:
    result = CliRunner().invoke(command, [str(a) for a in args])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    message = result.stderr.strip()
    assert message.startswith("Error: ") and "\n" not in message
    return message


def test_two_runs_of_the_same_arm_and_seed_are_an_error_naming_both(tmp_path):
    a = write_run(tmp_path, "spo", 0, [0.1], name="first")
    b = write_run(tmp_path, "spo", 0, [0.2], name="second")
    message = error_of(tmp_path)
    assert str(a) in message and str(b) in message and "seed 0" in message


def test_the_same_folder_named_twice_counts_once(runs_root):
    _, report, _ = invoke(runs_root, runs_root / "spo-s0", "--format", "json")
    assert len(report["runs"]) == 6


def test_missing_folder_and_folder_without_runs(tmp_path):
    assert f"{tmp_path / 'nope'}: no such folder" in error_of(tmp_path / "nope")
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    assert "no run.json" in error_of(tmp_path / "empty")


def test_malformed_run_json(tmp_path):
    folder = write_run(tmp_path, "spo", 0, [0.1])
    (folder / "run.json").write_text("{not json")
    assert f"{folder / 'run.json'}: not JSON" in error_of(folder)
    (folder / "run.json").write_text(json.dumps({"arm": "spo", "seed": "zero"}))
    assert f"{folder / 'run.json'}: seed: Input should be a valid integer" in error_of(folder)
    (folder / "run.json").write_text(json.dumps({"seed": 0}))
    assert f"{folder / 'run.json'}: arm: missing" in error_of(folder)


def test_malformed_evals_line_names_file_and_line(tmp_path):
    folder = write_run(tmp_path, "spo", 0, [0.1, 0.2, 0.3])
    path = folder / "eval" / "evals.jsonl"
    lines = path.read_text().splitlines()
    lines[1] = '{"policy_version": 2, "step": 2,'
    path.write_text("\n".join(lines) + "\n")
    assert f"{path}:2: not valid JSON" in error_of(folder)


def test_a_partial_last_line_is_skipped_with_a_warning(tmp_path):
    folder = write_run(tmp_path, "spo", 0, [0.1, 0.2])
    path = folder / "eval" / "evals.jsonl"
    path.write_text(path.read_text() + '{"policy_version": 4, "st')
    _, report, _ = invoke(folder, "--format", "json")
    assert report["runs"][0]["rewards"] == [0.1, 0.2]
    assert any(w.startswith(f"{path}:3: skipped a partial last line") for w in report["warnings"])


def test_restarts_in_run_json_are_warned_about_and_a_bad_count_is_refused(tmp_path):
    folder = write_run(tmp_path, "spo", 0, [0.1, 0.2])
    meta = json.loads((folder / "run.json").read_text())
    (folder / "run.json").write_text(json.dumps({**meta, "restarts": {"rollout-1": 2, "learner": 1}}))
    _, report, _ = invoke(folder, "--format", "json")
    assert report["runs"][0]["rewards"] == [0.1, 0.2]  # the curve is whole: a warning, not an error
    assert "processes restarted by supervision during the run: learner 1, rollout-1 2" in " ".join(
        report["warnings"]
    )
    (folder / "run.json").write_text(json.dumps({**meta, "restarts": {"learner": "once"}}))
    assert f"{folder / 'run.json'}: restarts.learner: Input should be a valid integer" in error_of(folder)


def test_versions_must_increase(tmp_path):
    folder = write_run(tmp_path, "spo", 0, [0.1, 0.2])
    path = folder / "eval" / "evals.jsonl"
    path.write_text(path.read_text() + json.dumps({"policy_version": 2, METRIC: 0.3}) + "\n")
    assert f"{path}:3: policy version 2 after 2" in error_of(folder)


def test_missing_metric_key_names_file_key_and_the_keys_there(tmp_path):
    folder = write_run(tmp_path, "spo", 0, [0.1, 0.2])
    message = error_of(folder, "--metric", "eval/sampled/nope")
    path = folder / "eval" / "evals.jsonl"
    assert f"{path}:1: no key 'eval/sampled/nope'" in message
    assert "eval/greedy/reward_mean" in message and METRIC in message
    # Another metric that is there works, and is the one compared.
    _, report, _ = invoke(folder, "--format", "json", "--metric", "eval/greedy/reward_mean")
    assert report["runs"][0]["rewards"] == pytest.approx([0.9, 0.8])


def test_a_run_without_scored_points_is_an_error(tmp_path):
    folder = write_run(tmp_path, "spo", 0, [0.1], skip=(0,))
    path = folder / "eval" / "evals.jsonl"
    path.write_text(path.read_text().splitlines()[0] + "\n")  # only the skipped line
    assert f"{path}: no scored evaluation points" in error_of(folder)
    (path).unlink()
    assert f"{path}: no such file" in error_of(folder)


# ---- the files, and the real command line -------------------------------------------------------


def test_out_writes_json_markdown_and_png(runs_root, tmp_path):
    out_dir = tmp_path / "report"
    result = CliRunner().invoke(command, [str(runs_root), "--out", str(out_dir), "--title", "Demo"])
    assert result.exit_code == 0, result.output
    for name in ("report.json", "report.md", "curves.png"):
        assert f"wrote {out_dir / name}" in result.stdout
    md = (out_dir / "report.md").read_text()
    assert md.startswith("# Demo") and md in result.stdout
    assert "| SPO++ area |" in md and "## Warnings" in md
    assert (out_dir / "curves.png").read_bytes()[:8] == PNG_MAGIC
    report = json.loads((out_dir / "report.json").read_text())
    assert [p["d_area"] for p in report["pairs"]] == pytest.approx(D_AREA)
    # JSON on stdout stays parseable with --out: the list of files goes to stderr.
    result = CliRunner().invoke(command, [str(runs_root), "--out", str(out_dir), "--format", "json"])
    assert json.loads(result.stdout)["table"]["pairs"] == 3
    assert f"wrote {out_dir / 'curves.png'}" in result.stderr


def _run_cli(module: str, args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.process
def test_report_module_from_a_subprocess(runs_root, tmp_path):
    out_dir = tmp_path / "out"
    proc = _run_cli("services.report.cli", [str(runs_root), "--out", str(out_dir)])
    assert proc.returncode == 0, proc.stderr
    assert (out_dir / "curves.png").read_bytes()[:8] == PNG_MAGIC
    proc = _run_cli("services.report.cli", [str(tmp_path / "missing")])
    assert proc.returncode == 1 and "no such folder" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.process
def test_spopp_report_from_a_subprocess(runs_root, tmp_path):
    out_dir = tmp_path / "out"
    proc = _run_cli("services.cli", ["report", str(runs_root), "--out", str(out_dir)])
    assert proc.returncode == 0, proc.stderr
    for name in ("report.json", "report.md", "curves.png"):
        assert (out_dir / name).is_file()
    assert (out_dir / "curves.png").read_bytes()[:8] == PNG_MAGIC
    md = (out_dir / "report.md").read_text()
    assert "| Δ area (points) |" in md and "| pairs won (area) | 2/3 |" in md
    assert md in proc.stdout


def write_learner_log(folder: Path, seconds_per_version: float) -> None:
    """The learner's metrics.jsonl of a run whose versions come every `seconds_per_version`: the
    first update (waiting 2 s for its batch) starts the clock."""
    (folder / "learner").mkdir()
    lines = []
    for step in range(1, 9):
        when = 1.7e9 + step * seconds_per_version
        lines.append({"step": step, "time": when, "policy_version": step - 1, "publish_s": 0.1,
                      "batch_wait_s": 2.0 if step == 1 else 0.5, "update_seconds": seconds_per_version - 2.1})  # fmt: skip
    (folder / "learner" / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_staleness_table_pairs_k_against_k0_by_version_and_by_time(tmp_path):
    """Table 3: spopp-k1 against spopp of the same seed: areas and ends by hand, and the seconds
    to the last common version from the learners' logs (version v published v * T after a start
    that is T before the first record, with T = 10 s at k = 0 and 5 s at k = 1)."""
    root = tmp_path / "runs"
    for arm, rewards, period in (("spopp", [0.0, 0.2, 0.4], 10.0), ("spopp-k1", [0.0, 0.4, 0.4, 0.6], 5.0)):
        write_learner_log(write_run(root, arm, 0, rewards), period)
    code, report, _ = invoke(root, "--format", "json")
    assert code == 0
    [row] = report["staleness"]
    assert (row["arm"], row["base"], row["k"], row["points"]) == ("spopp-k1", "spopp", 1, 3)
    assert row["k0"]["area"] == pytest.approx((0.1 + 0.3) / 2) and row["stale"]["area"] == pytest.approx(
        (0.2 + 0.4) / 2
    )
    assert row["d_area"] == pytest.approx(10.0)
    # Points at versions 0, 2, 4: version 4 published at 4 * T after the start (first record T - T).
    assert row["k0"]["seconds"] == pytest.approx(40.0) and row["stale"]["seconds"] == pytest.approx(20.0)
    assert row["speedup"] == pytest.approx(2.0)
    assert not any("in no table" in w for w in report["warnings"])
    # Staleness arms alone: no run is missing an SPO partner, so nothing is warned about that.
    assert not any("partner" in w or "SPO/SPO++" in w for w in report["warnings"])
    agg = report["staleness_summary"]["spopp-k1"]
    assert agg["pairs"] == 1 and agg["won_area"] == 1 and agg["speedup"]["mean"] == pytest.approx(2.0)
    assert agg["d_area"] == {"mean": pytest.approx(10.0), "sd": None, "n": 1}
    _, md, _ = invoke(root)
    assert "spopp-k1 over 1 seeds: Δ area +10.0, Δ end" in md and "speed-up to the same version 2.00x." in md
    assert "## Table 3: bounded staleness against k = 0" in md and "| 0 | spopp-k1 vs spopp | 3 |" in md
    assert "2.00x" in md


def test_x_time_draws_against_minutes_and_needs_the_learners_log(tmp_path):
    root = tmp_path / "runs"
    write_learner_log(write_run(root, "spopp", 0, [0.0, 0.2, 0.4]), 10.0)
    bare = write_run(tmp_path / "other", "spopp-k1", 0, [0.0, 0.3])
    out = tmp_path / "report"
    code, _, _ = invoke(root, "--out", out, "--x", "time")
    assert code == 0 and (out / "curves.png").read_bytes()[:8] == PNG_MAGIC
    result = CliRunner().invoke(command, [str(root), str(bare), "--out", str(out), "--x", "time"])
    assert result.exit_code != 0 and "--x time needs the learner's metrics.jsonl" in result.output
    # Table 3 without times still compares by version, and says n/a for the clock.
    _, md, _ = invoke(root, bare)
    assert "| n/a | n/a |" in md


def test_a_page_section_is_redrawn_from_the_report_json_it_names(runs_root, tmp_path, monkeypatch):
    # docs publish report tables only as the rendering of a committed report.json
    # (services/report/published.py; tests/docs/test_published.py holds the project's own pages to it).
    from services.report.published import END, marker

    monkeypatch.chdir(tmp_path)
    code, _out, _err = invoke(runs_root, "--out", "rep")
    assert code == 0
    page = tmp_path / "page.md"
    head, tail = "# Results\n\nSome words.\n\n", "\nMore words.\n"
    page.write_text(head + marker("rep/report.json") + "\nstale table\n" + END + tail)
    code, out, _err = invoke("--render", page)
    assert (code, out) == (0, f"{page}: redrawn\n")
    text = page.read_text()
    assert text.startswith(head + marker("rep/report.json") + "\nMetric `eval/sampled/reward_mean`")
    assert "\n### Table 1: SPO++ vs SPO\n" in text and "\n#### Pairs\n" in text  # one level down
    assert text.endswith("\n" + END + tail) and "stale table" not in text
    assert "| 0 | " in text and "SPO++ vs SPO: held-out" not in text  # pairs kept, title dropped
    code, out, _err = invoke("--render", page)  # a rendering is its own rendering
    assert (code, out, page.read_text()) == (0, f"{page}: already the rendering of its reports\n", text)
    # A number edited by hand is put back.
    page.write_text(text.replace("| 0 | ", "| 9 | ", 1))
    assert invoke("--render", page)[0] == 0 and page.read_text() == text


def test_a_page_section_without_its_report_or_its_end_is_refused_and_the_page_kept(tmp_path, monkeypatch):
    from services.report.published import END, marker

    monkeypatch.chdir(tmp_path)
    page = tmp_path / "page.md"
    for body, why in [
        (marker("gone/report.json") + "\nx\n" + END + "\n", "gone/report.json: no such report"),
        (marker("gone/report.json") + "\nx\n", "its section has no end line"),
    ]:
        page.write_text(body)
        code, _out, err = invoke("--render", page)
        assert code == 1 and why in err and page.read_text() == body
    assert invoke("--render", page, tmp_path)[0] == 2  # RUN_DIRs and --render together
    assert invoke()[0] == 2  # neither
