"""`spopp study compare`: the t test's sizing, each design check refusing its case, protocol.json
fixed after the first main run, and the page's sentences following the statistics (fixed data
for each case). The command itself on the tiny model is in tests/study/test_study_compare_run.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from services.study import design, registration
from services.study.analysis import analyse
from services.study.conclusions import conclude
from services.study.measures import RunMeasures, StudyDataError, online_curve
from spopp.compare.stats import paired, pairs_for_power, sign_floor, t_p, t_power


@pytest.fixture
def toy_config(toy_study):
    toy = toy_study

    def make(folder: Path, **over) -> Path:
        cfg = {"model": str(toy["model"]), "tasks": str(toy["train"]), "heldout": str(toy["heldout"]),
               "prior": str(toy["prior"]), "env": "toy-calc", "max_updates": 4,
               "learner": {"batch_size": 4, "mini_batches": 2, "micro_batch_size": 2}, **over}  # fmt: skip
        path = folder / "launch.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    return make


# -- sizing ---------------------------------------------------------------------------------------


def test_n_comes_from_the_t_test_not_the_normal_approximation():
    # At the paper's Math-TIR effect (+2.50 points) and an s.d. of 5: the normal approximation's
    # ((1.96 + 0.84) * 5 / 2.5)^2 = 31.4 -> 32 pairs gives the t test less than 80 % power.
    normal = math.ceil(((1.959964 + 0.841621) * 5.0 / 2.5) ** 2)
    n = pairs_for_power(2.5, 5.0)
    assert normal == 32 and n == 34
    assert t_power(n - 1, 2.5, 5.0) < 0.8 <= t_power(n, 2.5, 5.0)


def test_the_power_is_what_simulated_t_tests_find():
    # 20,000 simulated studies of 34 pairs: the share the t test rejects has a binomial s.e. of
    # sqrt(0.8 * 0.2 / 20000) = 0.0028; 4 s.e. (0.012) holds whatever CPU draws the numbers.
    from scipy.stats import ttest_1samp

    rng = np.random.default_rng(20261202)
    rejected = ttest_1samp(rng.normal(2.5, 5.0, (20_000, 34)), 0.0, axis=1).pvalue < 0.05
    assert abs(rejected.mean() - t_power(34, 2.5, 5.0)) < 0.012


def test_never_fewer_pairs_than_a_sign_test_needs_to_answer():
    assert sign_floor(5) > 0.05 > sign_floor(6)
    assert pairs_for_power(2.5, 0.01) == 6 and pairs_for_power(2.5, 0.0) == 6
    with pytest.raises(ValueError, match="two pairs or more"):
        pairs_for_power(2.5, None)
    with pytest.raises(ValueError, match="non-zero"):
        pairs_for_power(0.0, 1.0)


# -- design checks --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "check, setting",
    [
        (lambda: design.prior_check(None), "spopp prior"),
        (lambda: design.headroom_check([0.05, 0.1], "held-out"), "easier tasks"),
        (lambda: design.headroom_check([0.8, 0.9], "held-out"), "harder tasks"),
        (lambda: design.ceiling_check([0.9, 0.95]), "max_updates"),
        (lambda: design.outcomes_check([1.28, 1.3]), "tasks:"),
    ],
    ids=["no prior", "v0 too low", "v0 too high", "ceiling", "outcomes per prompt"],
)
def test_each_design_check_refuses_its_case_naming_the_setting_to_change(check, setting):
    c = check()
    assert not c.ok and setting in c.fix and c.line().startswith("FAIL")


def test_the_design_checks_pass_inside_their_bounds():
    assert design.prior_check("prior.json").ok
    assert design.headroom_check([0.15, 0.70], "held-out").ok  # the band's ends are inside
    assert design.ceiling_check([0.89]).ok
    assert design.outcomes_check([8.0, 9.0]).ok


# -- the runs' measures ---------------------------------------------------------------------------


def _learner(folder: Path, rewards: list) -> Path:
    (folder / "learner").mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"step": i + 1, "reward_mean": r}) for i, r in enumerate(rewards)]
    (folder / "learner" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_the_online_curve_is_every_update_in_order(tmp_path):
    assert online_curve(_learner(tmp_path / "a", [0.25, 0.5, 0.75])) == [0.25, 0.5, 0.75]


@pytest.mark.parametrize(
    "text, said",
    [
        ('{"step": 1, "reward_mean": 0.5}\n{"step": 3, "reward_mean": 0.5}\n', "without a gap"),
        ('{"step": 1, "reward_mean": NaN}\n', "not finite"),
        ('{"step": 1, "reward_mean": 0.5}\n{"step": 1, "reward_mean": 0.5}\n', "repeated"),
        ('{"step": 1}\n', "reward_mean"),
        ("", "without a gap"),
    ],
    ids=["gap", "NaN", "repeated step", "no reward", "empty"],
)
def test_a_learner_log_the_study_cannot_trust_is_refused_naming_the_line(tmp_path, text, said):
    (tmp_path / "learner").mkdir()
    (tmp_path / "learner" / "metrics.jsonl").write_text(text)
    with pytest.raises(StudyDataError, match=said):
        online_curve(tmp_path)


@pytest.mark.parametrize(
    "times, seconds",
    [({"running_s": 600.0}, 600.0), ({}, 3600.0), ({"running_s": 600.0, "finished": None}, None)],
    ids=["its launches' seconds", "recorded before running_s: start to finish", "not finished"],
)
def test_a_runs_time_is_what_its_launches_ran_not_the_gaps_between_them(tmp_path, times, seconds):
    from services.study.measures import measure

    folder = _learner(tmp_path / "r", [0.5])
    record = {
        "run": "r",
        "arm": "spopp",
        "seed": 0,
        "status": "finished",
        "started": 1000.0,
        "finished": 4600.0,
    }
    (folder / "run.json").write_text(json.dumps({**record, **times}))
    assert measure(folder).seconds == seconds


# -- the analysis and its sentences ---------------------------------------------------------------


def _run(arm: str, seed: int, online: list[float]) -> RunMeasures:
    return RunMeasures(folder=Path(f"{arm}-s{seed}"), arm=arm, seed=seed, online=online, heldout=[],
                       heldout_versions=[], outcomes_per_prompt=10.0, seconds=60.0, time_parts={}, code={},
                       protocol=None)  # fmt: skip


def _study(gains: list[float], level: float = 0.4) -> dict:
    """Runs whose online curves are flat at `level` for spo and `level + gain` for spopp, so that
    each pair's area difference is exactly gain (x100 points)."""
    runs = []
    for seed, gain in enumerate(gains):
        runs += [_run("spo", seed, [level] * 6), _run("spopp", seed, [level + gain] * 6)]
    return analyse(runs, ("spo", "spopp"), "trapezoid", heldout=False)


def test_the_analysis_pairs_by_seed_and_adjusts_over_the_planned_metrics():
    result = _study([0.03, 0.05, 0.04, 0.06, 0.02, 0.05])
    d = result["diffs"]["area (trapezoid)"]
    assert d["n"] == 6 and d["won"] == 6 and math.isclose(d["mean"], 4.1666666, rel_tol=1e-6)
    # Holm over two metrics: the smaller p doubled, never below the other.
    ps = sorted(result["diffs"][m]["t_p"] for m in result["metrics"])
    assert math.isclose(min(x["holm_p"] for x in result["diffs"].values()), min(1.0, 2 * ps[0]))


def test_a_clear_result_is_claimed_with_its_numbers():
    said = conclude(_study([0.03, 0.05, 0.04, 0.06, 0.02, 0.05]), 2.5, [])
    assert any("spopp is higher than spo on area (trapezoid)" in s for s in said["can"])
    assert any("6 of 6 pairs favour spopp" in s for s in said["can"])
    assert not any("both signs" in s for s in said["cannot"])


def test_an_interval_holding_both_signs_claims_no_direction():
    said = conclude(_study([0.05, -0.04, 0.03, -0.05, 0.04, -0.02]), 2.5, [])
    assert not any("is higher" in s or "is lower" in s for s in said["can"])
    assert any("holds both signs" in s and "area (trapezoid)" in s for s in said["cannot"])
    assert any("0 or as large as the planned +2.50" in s for s in said["cannot"])


def test_a_sign_test_at_its_floor_is_said_to_decide_nothing():
    said = conclude(_study([0.03, 0.05, 0.04, 0.06, 0.05]), 2.5, [])  # 5 pairs: floor 0.0625
    assert any("sign test decides nothing" in s and "0.0625" in s for s in said["cannot"])
    assert not any("sign test p" in s for s in said["can"])


def test_a_ceiling_and_every_forced_check_are_stated_as_limits():
    forced = [design.outcomes_check([1.28]).as_dict(), design.prior_check(None).as_dict()]
    said = conclude(_study([0.01, 0.02, 0.01, 0.03, 0.02, 0.01], level=0.93), 2.5, forced)
    cannot = " ".join(said["cannot"])
    assert "below the ceiling" in cannot and "0.9" in cannot
    assert "'outcomes per prompt' failed" in cannot and "does not test SPO++'s mechanism" in cannot
    assert "'prior' failed" in cannot


def test_an_effect_the_interval_stops_short_of_is_excluded():
    said = conclude(_study([0.001, 0.002, -0.001, 0.0, 0.001, 0.002]), 2.5, [])
    assert any(
        "as large as the planned +2.50 points on area (trapezoid) is excluded" in s for s in said["can"]
    )


def test_a_refused_study_says_what_n_needs_and_claims_no_direction():
    from services.study.conclusions import refused

    checks = [design.prior_check("p.json").as_dict(), design.ceiling_check([0.95]).as_dict()]
    found = {"checks": checks, "pilot_sd": 7.25, "n": 70, "pilot": {"seeds": [1000, 1001, 1002]}}
    said = refused(found, 2.5, ("spo", "spopp"), 49.04)
    assert said["can"][0].startswith("This design fails the check 'ceiling' (the pilot's last point 0.950")
    assert "learner.lr" in said["can"][0]  # the setting to change
    assert said["can"][1] == (
        "At the pilot's paired s.d. of 7.25 points on the primary metric (3 pairs), a two-sided paired t test "
        "needs n = 70 pairs for 80 % power against +2.5 points, 49.0 h of machine time with the pilot at its "
        "run time."
    )
    assert (
        len(said["cannot"]) == 1
        and "Whether spopp beats spo on this config: no main run" in said["cannot"][0]
    )
    # Nothing about which arm did better in the pilot is said: its pairs size the study.
    assert not any(w in s for s in said["can"] + said["cannot"] for w in ("is higher", "is lower", "favour"))


def test_the_sentences_match_the_library_statistics():
    # The page's numbers are spopp.compare.stats' own: the t test's p, the interval.
    result = _study([0.03, -0.01, 0.04, 0.02, 0.0, 0.05])
    d = result["diffs"]["area (trapezoid)"]
    again = paired([3.0, -1.0, 4.0, 2.0, 0.0, 5.0])
    assert math.isclose(d["t_p"], t_p(again), rel_tol=1e-9) and math.isclose(
        d["lo"], again["lo"], rel_tol=1e-9
    )


# -- the protocol --------------------------------------------------------------------------------


def test_a_protocol_is_written_once_and_its_hash_is_the_files(tmp_path):
    digest = registration.write(tmp_path, {"n": 6})
    assert digest == registration.sha256(tmp_path / "protocol.json")
    with pytest.raises(registration.ProtocolError, match="written once"):
        registration.write(tmp_path, {"n": 7})
    assert json.loads((tmp_path / "protocol.json").read_text())["n"] == 6


def test_a_run_under_another_protocol_hash_is_refused(tmp_path):
    registration.check_runs("a" * 64, {"spo-s0": "a" * 64}, tmp_path)
    with pytest.raises(registration.ProtocolError, match="cannot change after the first main run"):
        registration.check_runs("b" * 64, {"spo-s0": "a" * 64, "spopp-s0": "b" * 64}, tmp_path)


def test_the_cli_refuses_a_config_without_a_prior_before_anything_runs(tmp_path, toy_config):
    from services.study.cli import compare_command

    out = tmp_path / "study"
    r = CliRunner().invoke(compare_command, [str(toy_config(tmp_path, prior=None)), "--out", str(out)])
    assert r.exit_code == 1 and "FAIL prior" in r.output and "spopp prior" in r.output
    assert not out.exists()  # no pilot ran, nothing was written


def test_protocol_json_cannot_be_changed_after_the_first_main_run(tmp_path, toy_config):
    from services.launch.cli import resolve
    from services.study.cli import compare_command
    from services.study.registered import Request

    config, out = toy_config(tmp_path), tmp_path / "study"
    req = Request(base=resolve(config, ()), out=out)
    digest = registration.write(out, {**req.options(), "n": 6, "seeds": list(range(6)), "metrics": []})
    # The first main run started under this protocol: its run.json carries the hash.
    (out / "runs" / "spo-s0").mkdir(parents=True)
    record = {"run": "spo-s0", "arm": "spo", "seed": 0, "protocol": digest}
    (out / "runs" / "spo-s0" / "run.json").write_text(json.dumps(record))
    protocol = json.loads((out / "protocol.json").read_text())
    (out / "protocol.json").write_text(json.dumps({**protocol, "n": 3, "seeds": [0, 1, 2]}))
    r = CliRunner().invoke(compare_command, [str(config), "--out", str(out)])
    assert r.exit_code == 1 and "cannot change after the first main run" in r.output and "spo-s0" in r.output
    # Nothing started: the run folder holds only the record written above.
    assert sorted(p.name for p in (out / "runs" / "spo-s0").iterdir()) == ["run.json"]


@pytest.mark.parametrize(
    "args, option",
    [(["--effect", "5"], "effect"), (["--arms", "spo,spopp-trajnorm"], "arms"),
     (["--set", "max_updates=8"], "config_sha256"), (["--pilot-seeds", "7,8"], "pilot_seeds")],
    ids=["effect", "arms", "config", "pilot seeds"],
)  # fmt: skip
def test_a_registered_study_resumes_only_as_registered(tmp_path, toy_config, args, option):
    from services.launch.cli import resolve
    from services.study.cli import compare_command
    from services.study.registered import Request

    config, out = toy_config(tmp_path), tmp_path / "study"
    req = Request(base=resolve(config, ()), out=out)
    registration.write(out, {**req.options(), "n": 6, "seeds": list(range(6)), "metrics": []})
    r = CliRunner().invoke(compare_command, [str(config), "--out", str(out), *args])
    assert r.exit_code == 1 and "registered another study" in r.output and option in r.output


def test_the_power_holds_where_scipys_noncentral_t_fails():
    # At one degree of freedom and a large noncentrality scipy's nct answers NaN; 200,000 simulated
    # pairs of two (binomial s.e. 0.00075; 4 s.e. = 0.003) check the integral that replaces it.
    from scipy.stats import ttest_1samp

    rng = np.random.default_rng(7)
    simulated = (ttest_1samp(rng.normal(19.0, 1.38, (200_000, 2)), 0.0, axis=1).pvalue < 0.05).mean()
    assert abs(t_power(2, 19.0, 1.38) - simulated) < 0.003
    assert pairs_for_power(19.0, 1.38, n_min=2) == 2


def test_the_page_says_what_study_json_holds_and_only_that(tmp_path):
    from services.study.registered import summarize, write_study

    runs = []
    for seed, gain in enumerate([0.03, 0.05, 0.04, 0.06, 0.02, 0.05]):
        runs += [_run("spo", seed, [0.4] * 6), _run("spopp", seed, [0.4 + gain] * 6)]
    checks = [design.prior_check("p.json").as_dict(), design.outcomes_check([2.0]).as_dict()]
    protocol = {
        "hypothesis": registration.hypothesis("spo", "spopp", "trapezoid"), "arms": ["spo", "spopp"],
        "primary": "trapezoid", "metrics": ["area (trapezoid)", "final five"], "analysis": registration.ANALYSIS,
        "effect": 2.5, "power": 0.8, "n": 6, "seeds": list(range(6)), "pilot_seeds": [1000, 1001],
        "stopping_rule": registration.STOPPING_RULE, "design_checks": checks, "forced": ["outcomes per prompt"],
        "pilot": {"pilot_sd": 2.0, "pilot_mean": 3.0, "mean_run_s": 60.0, "pilot_s": 240.0, "heldout_why": "none"},
        "registered": "2026-12-02T00:00:00Z",
    }  # fmt: skip
    study = summarize(protocol, "f" * 64, runs, [])
    write_study(tmp_path, study)
    page = (tmp_path / "README.md").read_text()
    for sentence in study["conclusions"]["can"] + study["conclusions"]["cannot"]:
        assert f"- {sentence}" in page
    assert "FAILED, run past with --force" in page and "f" * 64 in page
    assert "| spopp | 0 | 0.430 | 0.430 |" in page  # area and final five of a flat 0.43 curve
    assert (
        json.loads((tmp_path / "study.json").read_text())["result"]["diffs"]["area (trapezoid)"]["won"] == 6
    )


def test_render_redraws_the_page_from_study_json_alone(tmp_path):
    from services.study.cli import compare_command
    from services.study.registered import summarize, write_study

    runs = []
    for seed, gain in enumerate([0.03, 0.05, 0.04, 0.06, 0.02, 0.05]):
        runs += [_run("spo", seed, [0.4] * 6), _run("spopp", seed, [0.4 + gain] * 6)]
    protocol = {
        "hypothesis": "h", "arms": ["spo", "spopp"], "primary": "trapezoid", "metrics": ["area (trapezoid)"],
        "analysis": "a", "effect": 2.5, "power": 0.8, "n": 6, "seeds": list(range(6)), "pilot_seeds": [9, 10],
        "stopping_rule": "s", "design_checks": [], "forced": [], "registered": "r",
        "pilot": {"pilot_sd": 1.0, "pilot_mean": 1.0, "mean_run_s": None, "pilot_s": 0.0, "heldout_why": "none"},
    }  # fmt: skip
    write_study(tmp_path, summarize(protocol, "e" * 64, runs, []))
    drawn = (tmp_path / "README.md").read_text()
    (tmp_path / "README.md").write_text("edited by hand")
    r = CliRunner().invoke(compare_command, ["--render", str(tmp_path)])
    assert r.exit_code == 0 and (tmp_path / "README.md").read_text() == drawn
    # --render takes no config: what it redraws comes from study.json alone.
    r = CliRunner().invoke(compare_command, ["x.yaml", "--render", str(tmp_path)])
    assert r.exit_code == 2 and "give no CONFIG" in r.output
