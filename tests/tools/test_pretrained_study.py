"""The pretrained-model study (tools/pretrained_study.py): the protocol decided from a known pilot
s.d. within a budget, a changed study refused on resume, the n that detects the paper's effects
against a hand-computed value, the page rendered from a small fake report, the light copy; and,
slow, the whole path at its tiny size (the tiny model, two pilot seeds, a budget that caps n).

    python -m tools.pretrained_study --out pretrained-study-out --family toy-calc-shots2 [--arms spo,spopp] [--device cpu|cuda] [--budget-minutes M]
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from services.config.launch import LaunchSettings
from services.study import protocol as map_protocol
from spopp.settings.base import environ_without_settings
from tools import pretrained_study as ps


def _grid(family="toy-calc-shots2", arms=("spo", "spopp")):
    return ps.grid(family, list(arms), dict(ps.FULL), 0)


def test_the_usage_line_is_the_modules():
    usage = [line.strip() for line in ps.__doc__.splitlines() if line.strip().startswith("python -m")]
    assert usage[0] in __doc__


def test_the_protocol_is_decided_from_the_pilots_sd():
    # Pilot differences +1 and +7: s.d. sqrt(18) = 4.243, so n = ceil((4.243 / 1.5)^2) = ceil(8) = 8.
    p = ps.decide([1.0, 7.0], [1000, 1001], _grid(), [100.0, 100.0, 100.0, 100.0], 1.5, 3, None)
    assert p["pilot_sd"] == {"toy-calc-shots2": pytest.approx(math.sqrt(18))}
    assert p["wanted"] == {"toy-calc-shots2": 8} and p["seeds"]["toy-calc-shots2"] == list(range(8))
    assert p["capped"] == [] and p["run_seconds"] == 100.0 and p["pilot_seeds"] == [1000, 1001]
    assert p["grid"]["family"] == "toy-calc-shots2" and "primary" in p["tests"] and p["decided"]
    assert p["pilot"]["d_area"] == {"1000": 1.0, "1001": 7.0}
    # A budget of 40 minutes: 400 s spent, 2000 s left, a main seed is 2 arms x 100 s: room for 10, 8
    # wanted; 30 minutes: room for 7, capped; 10 minutes: room for 1, but never fewer than n_min.
    p = ps.decide([1.0, 7.0], [1000, 1001], _grid(), [100.0] * 4, 1.5, 3, 40)
    assert p["seeds"]["toy-calc-shots2"] == list(range(8)) and p["capacity_seeds"] == 10 and p["capped"] == []
    p = ps.decide([1.0, 7.0], [1000, 1001], _grid(), [100.0] * 4, 1.5, 3, 30)
    assert p["seeds"]["toy-calc-shots2"] == list(range(7)) and p["capped"] == ["toy-calc-shots2"]
    p = ps.decide([1.0, 7.0], [1000, 1001], _grid(), [100.0] * 4, 1.5, 3, 10)
    assert p["seeds"]["toy-calc-shots2"] == [0, 1, 2] and p["capacity_seeds"] == 1
    # Three arms: a main seed costs three runs, 2000 s leave room for 6.
    three = _grid(arms=("spo", "spopp-trajnorm", "spopp"))
    p = ps.decide([1.0, 7.0], [1000, 1001], three, [100.0] * 4, 1.5, 3, 40)
    assert p["capacity_seeds"] == 6 and p["seeds"]["toy-calc-shots2"] == list(range(6))
    with pytest.raises(ValueError, match="two pairs"):
        ps.decide([1.0], [1000], _grid(), [100.0, 100.0], 1.5, 3, None)


def test_a_resumed_study_is_the_same_study(tmp_path):
    protocol = ps.decide([1.0, 2.0], [1000, 1001], _grid(), [10.0] * 4, 1.5, 3, None)
    map_protocol.write(tmp_path, protocol)
    assert map_protocol.read(tmp_path) == protocol  # the map's reader takes it back
    ps.check_resume(protocol, _grid(), [1000, 1001], tmp_path)  # the same: no complaint
    with pytest.raises(ValueError, match="family"):
        ps.check_resume(protocol, _grid(family="letter-counting-shots2"), [1000, 1001], tmp_path)
    with pytest.raises(ValueError, match="arms"):
        ps.check_resume(protocol, _grid(arms=("spo", "spopp-trajnorm", "spopp")), [1000, 1001], tmp_path)
    with pytest.raises(ValueError, match="pilot on seeds"):
        ps.check_resume(protocol, _grid(), [1000, 1002], tmp_path)
    # Through the command line, refused before anything runs (no model import, no data).
    for args in (
        ["--family", "letter-counting-shots2"],
        ["--pilot-seeds", "7,8"],
        ["--arms", "spo,spopp-trajnorm,spopp"],
    ):
        with pytest.raises(SystemExit, match="pretrained-study: .*protocol.json"):
            ps.main(["--out", str(tmp_path), *args])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["protocol.json"]


def test_the_budget_is_part_of_the_study(tmp_path):
    a = ps._parser().parse_args(["--max-updates", "4", "--eval-every", "2", "--lr", "2e-4"])
    assert (a.max_updates, a.eval_every, a.lr) == (4, 2, 2e-4)
    protocol = ps.decide([1.0, 2.0], [1000, 1001], _grid(), [10.0] * 4, 1.5, 3, None)
    map_protocol.write(tmp_path, protocol)
    with pytest.raises(SystemExit, match="fixed the study for size"):
        ps.main(["--out", str(tmp_path), "--max-updates", "6"])
    with pytest.raises(SystemExit, match="fixed the study for size"):  # the learning rate is the size's too
        ps.main(["--out", str(tmp_path), "--lr", "5e-4"])


def test_a_study_decided_before_the_budget_was_named_max_updates_is_the_same_study(tmp_path):
    # Its protocol.json (and the study.json copying it) names the size's budget "updates".
    protocol = ps.decide([1.0, 2.0], [1000, 1001], _grid(), [10.0] * 4, 1.5, 3, None)
    old = json.loads(json.dumps(protocol))
    old["grid"]["size"] = {
        ("updates" if k == "max_updates" else k): v for k, v in old["grid"]["size"].items()
    }
    assert ps.upgraded(old) == json.loads(json.dumps(protocol)) and ps.upgraded(protocol) is protocol
    ps.check_resume(ps.upgraded(old), _grid(), [1000, 1001], tmp_path)
    map_protocol.write(tmp_path, old)
    with pytest.raises(SystemExit, match="fixed the study for size"):  # read upgraded, then compared
        ps.main(["--out", str(tmp_path), "--max-updates", "6"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["protocol.json"]


def test_a_study_that_cannot_be_sized_is_refused_before_it_runs(tmp_path):
    for args, why in ((["--pilot-seeds", "1000"], "two seeds"), (["--arms", "spo,spopp,bogus"], "unknown arm"),
                      (["--arms", "spo,spopp-trajnorm"], "need spo and spopp"), (["--family", "nope"], "choose one of")):  # fmt: skip
        with pytest.raises(SystemExit, match=why):
            ps.main(["--out", str(tmp_path / "out"), *args])
    assert not (tmp_path / "out" / "model").exists()


def _t_power(n: int, effect: float, sd: float) -> float:
    """The two-sided paired t test's power at 5 % over n pairs, by quadrature over the s.d.'s
    chi-square (T = (Z + d) / sqrt(V / df), V ~ chi2(df), d = effect / sd * sqrt(n)): another route
    than scipy's noncentral t, which spopp.compare.stats uses (and which gives nan at 1 d.f. for large d)."""
    from scipy import integrate, stats

    df, d = n - 1, effect / sd * math.sqrt(n)
    c = stats.t.ppf(0.975, df)

    def given(v: float) -> float:
        scale = c * math.sqrt(v / df)
        return (stats.norm.sf(scale - d) + stats.norm.cdf(-scale - d)) * stats.chi2.pdf(v, df)

    return integrate.quad(given, 0, math.inf, limit=200)[0]


@pytest.mark.parametrize("sd,effect", [(5.0, 2.5), (5.0, 19.0), (1.64, 2.5), (1.381, 2.5), (1.381, 19.0)])
def test_the_n_that_detects_the_papers_effects_is_the_t_tests(sd, effect):
    # The fewest pairs from 2 (a t test needs one degree of freedom) whose power reaches 80 %.
    n = ps.detect_n(sd, effect)
    assert n >= 2 and _t_power(n, effect, sd) >= 0.8
    assert n == 2 or _t_power(n - 1, effect, sd) < 0.8
    # The normal approximation the page once used asks for fewer pairs than the t test does.
    normal = math.ceil(((1.959964 + 0.841621) * sd / effect) ** 2)
    assert n > normal


def test_no_sd_detects_nothing():
    assert ps.detect_n(None, 2.5) is None


def _fake_study(tmp_path, arms=("spo", "spopp")):
    protocol = ps.decide([1.0, 3.0], [1000, 1001], _grid(arms=arms), [60.0] * 4, 1.5, 3, None)
    curves = {"spo": [[0.4, 0.5, 0.6], [0.4, 0.6, 0.6], [0.4, 0.5, 0.5]],
              "spopp": [[0.4, 0.6, 0.7], [0.4, 0.6, 0.7], [0.4, 0.5, 0.5]],
              "spopp-trajnorm": [[0.4, 0.5, 0.7], [0.4, 0.6, 0.6], [0.4, 0.6, 0.5]]}  # fmt: skip
    runs = [
        {
            "run": f"{arm}-s{s}",
            "arm": arm,
            "seed": s,
            "versions": [0, 4, 8],
            "rewards": curves[arm][s],
            "dir": "x",
        }
        for s in range(3)
        for arm in arms
    ]
    (tmp_path / "main").mkdir(parents=True)
    report = {"runs": runs, "warnings": [], "code": {"codes": [{"recorded": True, "commit": "abc123def4567890",
              "dirty": False, "lock_sha256": "feed" * 16, "runs": len(runs)}]}}  # fmt: skip
    (tmp_path / "main" / "report.json").write_text(json.dumps(report))
    return protocol


def test_the_page_renders_from_a_fake_report(tmp_path):
    protocol = _fake_study(tmp_path)
    study = ps.build_study(tmp_path, protocol)
    ps.write_page(tmp_path, study)
    (d,) = study["diffs"]
    # Trapezoid areas over 3 points: ((a + b) / 2 + (b + c) / 2) / 2; Δ x100: +5, 0... by hand:
    # seed 0: spo 0.5, spopp 0.575 -> +7.5; seed 1: 0.55, 0.575 -> +2.5; seed 2: 0.475, 0.475 -> 0.
    assert [round(r["d_area"], 9) for r in d["pairs"]] == [7.5, 2.5, 0.0]
    assert d["mean"] == pytest.approx(10 / 3) and d["n"] == 3
    sd = math.sqrt(((7.5 - 10 / 3) ** 2 + (2.5 - 10 / 3) ** 2 + (10 / 3) ** 2) / 2)
    assert d["sd"] == pytest.approx(sd) and d["se"] == pytest.approx(sd / math.sqrt(3))
    half = 4.302652729911275 * sd / math.sqrt(3)  # t_{0.975, 2}
    assert (d["lo"], d["hi"]) == (pytest.approx(10 / 3 - half), pytest.approx(10 / 3 + half))
    assert (d["won"], d["lost"], d["tied"]) == (2, 0, 1) and d["sign_p"] == pytest.approx(0.5)
    assert study["detect"][1] == {"from": "main (3 pairs)", "sd": pytest.approx(sd),
                                  "n": {"Math-TIR": ps.detect_n(sd, 2.5), "ALFWorld": ps.detect_n(sd, 19.0)}}  # fmt: skip
    page = (tmp_path / "README.md").read_text()
    assert "commit abc123def456" in page and "s.e." in page
    # The protocol's lines, every field rendered (a missing f-prefix once printed its expression).
    # The pilot's +1 and +3 have s.d. sqrt(2): (1.41 / 1.5)^2 = 0.89 asks for 1 pair, under n_min 3.
    ask = math.ceil((math.sqrt(2) / 1.5) ** 2)
    assert ask == 1 < protocol["n_min"] and "_f(" not in page
    assert (
        f"Where n came from: the pilot's s.d. asks for ceil((1.41 / 1.5)^2) = {ask} pair for an s.e. of 1.5,"
        " under the floor n_min = 3, so n = 3 came from the floor, not from the s.d. No budget was given."
        in page
    )
    assert f"| spopp − spo | 3 | +3.33 ± {sd / math.sqrt(3):.2f} |" in page
    assert f"[{10 / 3 - half:+.2f}, {10 / 3 + half:+.2f}]" in page
    assert (
        "| 0 | 3 | 0.500 | 0.575 | +7.50 |" in page
        and "| spo-s2 | spo | 2 | v0 0.400, v4 0.500, v8 0.500 |" in page
    )
    assert f"| main (3 pairs) | {sd:.2f} | {ps.detect_n(sd, 2.5)} | {ps.detect_n(sd, 19.0)} |" in page
    assert (
        "A sign test needs at least 6 pairs to reach p < 0.05" in page and "0.25 over this study's 3" in page
    )
    # The most SPO++ could gain: its curve at 1 after version 0 (from 0.4): area (0.7 + 1) / 2 = 0.85
    # against SPO's 0.5, 0.55 and 0.475: 35, 30 and 37.5 points, all above ALFWorld's +19.
    assert "is 30.00 to 37.50 area points over the 3 pairs." in page and "cannot occur" not in page
    # --render redraws the same page from study.json alone.
    (tmp_path / "main" / "report.json").unlink()
    (tmp_path / "README.md").unlink()
    assert ps.main(["--render", str(tmp_path)]) == 0
    assert (tmp_path / "README.md").read_text() == page
    # A study decided before the budget was named max_updates: its size says "updates", same page.
    old = json.loads((tmp_path / "study.json").read_text())
    old["protocol"]["grid"]["size"]["updates"] = old["protocol"]["grid"]["size"].pop("max_updates")
    assert ps.render(old) == page
    # Runs from different code let through by --mixed-code flag: the page says so.
    study["code"] = {**study["code"], "flagged": True, "problem": "different code: x"}
    assert "**Mixed code, let through by `--mixed-code flag`:** different code: x." in ps.render(study)
    with pytest.raises(SystemExit, match="no study.json"):
        ps.main(["--render", str(tmp_path / "main")])


def test_the_page_says_where_n_came_from_under_a_budget():
    # The pilot +1 and +7 (s.d. sqrt(18): 8 pairs wanted), 4 pilot runs of 100 s, 2 arms a seed: 40
    # minutes leave room for 10 seeds, 30 for 7 (capped), 10 for 1 (under the floor of 3).
    lines = {}
    for minutes in (40, 30, 10):
        protocol = ps.decide([1.0, 7.0], [1000, 1001], _grid(), [100.0] * 4, 1.5, 3, minutes)
        lines[minutes] = ps._where_n(protocol, "toy-calc-shots2", len(protocol["seeds"]["toy-calc-shots2"]))
    assert "= 8 pairs for an s.e. of 1.5, so n = 8." in lines[40] and "room for 10 main seeds" in lines[40]
    assert lines[40].endswith(": n fits it.")
    assert "room for 7 main seeds after the pilot, so n was capped at 7." in lines[30]
    assert "room for 1 main seed after the pilot, so n was cut to the floor, 3, which goes over" in lines[10]
    # The committed study's case: the s.d. asks for fewer than the floor, and the floor is over budget.
    protocol = ps.decide([1.0, 3.0], [1000, 1001], _grid(), [100.0] * 4, 1.5, 3, 10)
    line = ps._where_n(protocol, "toy-calc-shots2", 3)
    assert (
        "so n = 3 came from the floor" in line
        and "n never goes under n_min, so the main runs went over" in line
    )


def test_the_headroom_names_an_effect_the_design_cannot_produce(tmp_path):
    protocol = _fake_study(tmp_path)
    study = ps.build_study(tmp_path, protocol)
    # SPO near the top: at 0.4, 0.95, 0.99 its area is (0.675 + 0.97) / 2 = 0.8225, and SPO++'s best
    # (0.85) is 2.75 points above it, under both paper effects.
    for r in study["runs"]:
        if r["arm"] == "spo":
            r["rewards"] = [0.4, 0.95, 0.99]
    for row in study["diffs"][0]["pairs"]:
        row["spo"] = 0.8225
    page = ps.render(study)
    assert "is 2.75 to 2.75 area points over the 3 pairs: an effect of Math-TIR (+2.50)" not in page
    assert "is 2.75 to 2.75 area points over the 3 pairs: an effect of ALFWorld (+19.00) cannot occur" in page


def test_three_arms_give_each_step_and_the_total(tmp_path):
    protocol = _fake_study(tmp_path, arms=("spo", "spopp-trajnorm", "spopp"))
    study = ps.build_study(tmp_path, protocol)
    keys = [(d["arm"], d["against"]) for d in study["diffs"]]
    assert keys == [("spopp-trajnorm", "spo"), ("spopp", "spopp-trajnorm"), ("spopp", "spo")]
    assert all(d["holm_p"] is None or d["holm_p"] >= d["t_p"] for d in study["diffs"])
    assert "spopp − spopp-trajnorm" in ps.render(study)


@pytest.mark.parametrize("family", sorted(ps.FAMILIES))
def test_each_family_writes_tasks_and_a_config_the_launcher_accepts(tmp_path, family):
    f = ps.FAMILIES[family]
    f.generator(tmp_path / "data", 0, 4, 3, f.task_options)
    assert [
        len((tmp_path / "data" / n).read_text().splitlines()) for n in ("train.jsonl", "heldout.jsonl")
    ] == [4, 3]
    for device, tiny in (("cpu", False), ("cuda", False), ("cpu", True)):
        s = ps.base_settings(tmp_path, tmp_path / "model", family, ps.TINY if tiny else ps.FULL, device, tiny)
        assert isinstance(s, LaunchSettings) and s.env == f.env and s.study == f"pretrained-{family}"
        assert s.learner.lora_rank == 8 and s.evaluator.samples == 1 and not s.evaluator.greedy
        assert s.rollout.engine == ("vllm" if (device, tiny) == ("cpu", False) else "transformers")
        # One batch in flight: more would make each batch the quickest episodes (the failures).
        assert s.rollout.concurrency == (ps.TINY if tiny else ps.FULL)["batch_size"]
    # The held-out count states its s.e.: at most 3.1 points per version.
    assert math.sqrt(0.25 / (ps.N_HELDOUT - 1)) <= 0.0314


def test_the_light_copy_goes_and_comes_back(tmp_path):
    out, copy, back = tmp_path / "out", tmp_path / "copy", tmp_path / "back"
    run = out / "main" / "runs" / "spo-s0"
    (run / "eval").mkdir(parents=True)
    (run / "learner").mkdir()
    (run / "run.json").write_text(json.dumps({"status": "finished"}))
    (run / "eval" / "evals.jsonl").write_text("{}\n")
    (run / "learner" / "metrics.jsonl").write_text("{}\n")
    (run / "weights.safetensors").write_text("heavy")
    unfinished = out / "main" / "runs" / "spopp-s0"
    unfinished.mkdir(parents=True)
    (unfinished / "run.json").write_text(json.dumps({"status": "running"}))
    (out / "data").mkdir()
    (out / "data" / "train.jsonl").write_text("{}\n")
    (out / "model").mkdir()
    (out / "model" / "config.json").write_text("{}")
    (out / "protocol.json").write_text("{}")
    (out / "study.json").write_text("{}")
    assert ps.main(["--out", str(out), "--pack", str(copy)]) == 0
    held = sorted(str(p.relative_to(copy)) for p in copy.rglob("*") if p.is_file())
    assert held == ["data/train.jsonl", "main/runs/spo-s0/eval/evals.jsonl", "main/runs/spo-s0/learner/metrics.jsonl",
                    "main/runs/spo-s0/run.json", "protocol.json", "study.json"]  # fmt: skip
    assert ps.main(["--out", str(back), "--unpack", str(copy)]) == 0
    assert (back / "main/runs/spo-s0/run.json").read_text() == (run / "run.json").read_text()
    with pytest.raises(SystemExit, match="no protocol.json, no finished pilot run"):
        ps.main(["--out", str(back), "--unpack", str(tmp_path / "nothing")])


def test_a_pilot_longer_than_a_session_packs_its_finished_runs(tmp_path):
    # Before the protocol exists, a pilot's finished runs are the light copy (the unfinished one is
    # run again on resume); an OUT with neither is refused, naming both.
    out, copy, back = tmp_path / "out", tmp_path / "copy", tmp_path / "back"
    with pytest.raises(SystemExit, match="no protocol.json, no finished pilot run"):
        ps.main(["--out", str(out), "--pack", str(copy)])
    for name, status in (("spo-s1000", "finished"), ("spopp-s1000", "running")):
        run = out / "pilot" / "runs" / name
        run.mkdir(parents=True)
        (run / "run.json").write_text(json.dumps({"status": status}))
    (out / "launch.yaml").write_text("seed: 0\n")
    assert ps.main(["--out", str(out), "--pack", str(copy)]) == 0
    held = sorted(str(p.relative_to(copy)) for p in copy.rglob("*") if p.is_file())
    assert held == ["launch.yaml", "pilot/runs/spo-s1000/run.json"]
    assert ps.main(["--out", str(back), "--unpack", str(copy)]) == 0
    assert json.loads((back / "pilot/runs/spo-s1000/run.json").read_text())["status"] == "finished"


# The study's own limit; the test's a minute more, so that a slow machine fails with its output.
STUDY_LIMIT_S = 840


@pytest.mark.slow  # 6 launched runs, 35-70 s each on 2 cores (mostly the four processes' start-up)
@pytest.mark.process
@pytest.mark.timeout(STUDY_LIMIT_S + 60)
def test_the_tiny_study_runs_end_to_end(tmp_path, tiny_model):
    out = tmp_path / "study"
    # n_min 1 and a budget of 0.1 minutes: whatever the pilot's s.d., the main runs get one seed.
    args = [sys.executable, "-m", "tools.pretrained_study", "--tiny", "--out", str(out), "--model", str(tiny_model),
            "--budget-minutes", "0.1", "--n-min", "1"]  # fmt: skip
    # Mixed code let through, flagged: in a shared checkout a commit or an edit between two runs is
    # someone else's (the refusal itself is spopp.files.provenance's, tested there).
    env = {**environ_without_settings(), "OMP_NUM_THREADS": "1", "SPOPP_MIXED_CODE": "flag"}
    r = subprocess.run(args, capture_output=True, text=True, timeout=STUDY_LIMIT_S, env=env)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    protocol = json.loads((out / "protocol.json").read_text())
    assert protocol["pilot_seeds"] == [1000, 1001] and protocol["seeds"] == {"toy-calc-shots2": [0]}
    assert protocol["capped"] == ["toy-calc-shots2"] or protocol["wanted"]["toy-calc-shots2"] == 1
    assert len(protocol["pilot"]["run_seconds"]) == 4 and protocol["tiny"] is True
    # The protocol was written before the first main run started.
    first_main = min(json.loads(p.read_text())["started"] for p in (out / "main").glob("runs/*/run.json"))
    assert (out / "protocol.json").stat().st_mtime <= first_main
    study = json.loads((out / "study.json").read_text())
    assert sorted((x["arm"], x["seed"]) for x in study["runs"]) == [("spo", 0), ("spopp", 0)]
    (d,) = study["diffs"]
    report = json.loads((out / "main" / "report.json").read_text())
    assert [p["d_area"] for p in report["pairs"]] == pytest.approx([x["d_area"] for x in d["pairs"]])
    assert d["se"] is None and "Code: commit" in (out / "README.md").read_text()
    # Run again: every stage is found done, nothing runs, the protocol is not decided again.
    r = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "the protocol of" in r.stdout and json.loads((out / "protocol.json").read_text()) == protocol
