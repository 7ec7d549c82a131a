"""`spopp study compare` through its command on the tiny model's config.

- Fixed pilots: each pilot run's folder is prepared by the real launcher and given fixed data
  (run.json finished, the learner's rewards, the evaluator's version 0, the tracker's counts), so
  that the command finds the pilot finished and goes on from it: each design check refuses its
  case, the budget refuses an n it cannot pay (naming n), and nothing is registered.
- A main run's folder is bound to its protocol's hash (part of the run's identity).
- A registered study's last pair for real (slow tier): launched by the command with the
  protocol's hash, then the page from all six pairs.
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from procs import cli

from services.launch.cli import resolve
from services.study.compare import arm_settings
from spopp.compare.stats import pairs_for_power, summarize
from spopp.metrics import POINTS, area

pytestmark = pytest.mark.process  # the launcher's checks and git (provenance): the process tier

BUDGET = {"max_turns": 3, "max_tokens_per_turn": 16, "max_total_tokens": 128}
PILOT = (1000, 1001)
# One code for every fixed run: not this checkout's, which counts only for runs still to come.
CODE = {"commit": "0" * 40, "dirty": False, "lock_sha256": "1" * 64, "source": "git"}


def _config(toy: dict, folder: Path, max_updates: int = 4, evaluator: bool = True) -> Path:
    cfg = {
        "model": str(toy["model"]), "tasks": str(toy["train"]), "heldout": str(toy["heldout"]),
        "prior": str(toy["prior"]), "env": "toy-calc", "max_updates": max_updates, "progress_seconds": 5,
        "rollout": {"engine": "transformers", "concurrency": 8, **BUDGET},
        "learner": {"batch_size": 4, "mini_batches": 1, "micro_batch_size": 4, "lr": 1e-4, "keep_snapshots": 2},
        "evaluator": {"every": 1, "greedy": False, "samples": 1, **BUDGET},
    }  # fmt: skip
    if not evaluator:
        cfg["evaluator"] = {"enabled": False}
    path = folder / "study.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _finished(
    settings, online: list[float], v0: float, outcomes: int, seconds: float = 60.0, code: dict = CODE
) -> None:
    """A pilot run's folder as the launcher would leave it finished, holding fixed data."""
    from services.launch.run import Launcher

    p = Launcher(settings, echo=lambda _line: None).prepare()
    folder = p.run_dir
    (folder / "learner").mkdir(parents=True, exist_ok=True)
    (folder / "eval").mkdir(exist_ok=True)
    # 10 s an update and 2 s waiting for each batch: where the time went, as the learner records it.
    lines = [json.dumps({"step": i + 1, "reward_mean": r, "update_seconds": 10.0, "batch_wait_s": 2.0})
             for i, r in enumerate(online)]  # fmt: skip
    (folder / "learner" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "eval" / "evals.jsonl").write_text(
        json.dumps({"policy_version": 0, "step": 0, "eval/sampled/reward_mean": v0}) + "\n"
    )
    now = time.time()
    record = {
        "run": settings.run, "arm": p.arm(), "seed": settings.seed, "max_updates": settings.max_updates,
        "identity": p.identity(), "status": "finished", "launches": 1, "started": now - seconds, "finished": now,
        "tracker_counts": {"tasks": 8, "outcomes": outcomes}, "code": code,
        **({"protocol": settings.protocol} if settings.protocol else {}),
    }  # fmt: skip
    (folder / "run.json").write_text(json.dumps(record))


# Flat curves: spo at 0.40 on both seeds; spopp 1 and 5 points above it (a pilot s.d. of 2.83 points).
GOOD = {"spo": [0.40] * 4, "spopp": [[0.41] * 4, [0.45] * 4]}


def _pilot(
    config: Path, out: Path, v0: float = 0.4, outcomes: int = 80, end: float | None = None, code: dict = CODE
) -> None:
    base = resolve(config, ())
    for i, seed in enumerate(PILOT):
        for arm in ("spo", "spopp"):
            online = list(GOOD["spo"] if arm == "spo" else GOOD["spopp"][i])[: base.max_updates]
            if end is not None:
                online[-1] = end
            _finished(arm_settings(base, arm, seed, out / "pilot"), online, v0, outcomes, code=code)


def _compare(config: Path, out: Path, *args: str):
    from services.study.cli import compare_command

    return CliRunner().invoke(
        compare_command, [str(config), "--out", str(out), "--pilot-seeds", ",".join(map(str, PILOT)), *args]
    )


@pytest.mark.parametrize(
    "pilot, check, setting",
    [
        ({"v0": 0.05}, "headroom", "easier tasks"),
        ({"v0": 0.85}, "headroom", "harder tasks"),
        ({"end": 0.95}, "ceiling", "max_updates"),
        ({"outcomes": 20}, "outcomes per prompt", "fewer prompts"),
    ],
    ids=["version 0 too low", "version 0 too high", "ceiling", "2.5 outcomes per prompt"],
)
def test_each_design_check_refuses_its_case_after_the_pilot(toy_study, tmp_path, pilot, check, setting):
    config, out = _config(toy_study, tmp_path), tmp_path / "study"
    _pilot(config, out, **pilot)
    r = _compare(config, out)
    assert r.exit_code == 1, r.output
    assert r.output.count("(finished)") == 4  # the pilot was found finished, not run again
    assert "the design cannot answer (1 check failed)" in r.output
    assert f"FAIL {check}" in r.output and setting in r.output and "--force" in r.output
    assert not (out / "protocol.json").exists() and not (out / "runs").exists()
    found = json.loads((out / "pilot" / "design.json").read_text())
    assert [c["name"] for c in found["checks"] if not c["ok"]] == [check]
    # The refusal is the study's result: its page says which check failed and what to change.
    study = json.loads((out / "study.json").read_text())
    assert study["status"] == "refused" and study["design"] == found and f"FAIL {check}" in study["refusal"]
    page = (out / "README.md").read_text()
    assert "Refused after its pilot" in page and f"| {check} | FAILED |" in page
    assert any(f"fails the check '{check}'" in s and setting in s for s in study["conclusions"]["can"])
    assert all(f"- {s}" in page for s in study["conclusions"]["can"] + study["conclusions"]["cannot"])


def test_a_budget_that_cannot_pay_for_n_is_refused_naming_n(toy_study, tmp_path):
    config, out = _config(toy_study, tmp_path), tmp_path / "study"
    _pilot(config, out)
    # The pilot's paired area differences, recomputed here: 1 and 5 points.
    diffs = [POINTS * (area(GOOD["spopp"][i]) - area(GOOD["spo"])) for i in range(2)]
    n = pairs_for_power(2.5, summarize(diffs).sd)
    r = _compare(config, out, "--budget-hours", "0.1")  # 6 minutes: 4 spent on the pilot, 60 s a run
    assert r.exit_code == 1, r.output
    assert f"n = {n} pairs" in r.output and f"need {n * 2 * 60 / 3600:.2f} h" in r.output
    assert not (out / "protocol.json").exists()
    # Where a pilot run's 60 s went: 4 updates of 10 s, 4 waits of 2 s, 12 s for the rest.
    parts = json.loads((out / "pilot" / "design.json").read_text())["time_parts"]
    assert parts == {"updates": 40.0, "waiting for batches": 8.0, "publishing": 0.0, "checkpoints": 0.0,
                     "other": pytest.approx(12.0, abs=1e-6)}  # fmt: skip
    assert "a pilot run's time, on average: updates 0.7 min, waiting for batches 0.1 min" in r.output
    # Its page: the refusal, n, the hours n pairs and the pilot take (4 runs and 2n runs of 60 s),
    # and the command that runs it with a budget that pays for them.
    study = json.loads((out / "study.json").read_text())
    hours = (2 * n + 4) * 60 / 3600
    assert study["status"] == "refused" and study["needed_hours"] == pytest.approx(hours, rel=1e-9)
    assert study["machine_hours"] == pytest.approx(4 * 60 / 3600, rel=1e-9) and study["forced"] == []
    page = (out / "README.md").read_text()
    assert f"n = {n} pairs" in page and "the budget given was 0.1 h" in page
    assert f"--budget-hours {math.ceil(hours * 10) / 10:g}" in page and str(config) in page
    assert any(f"n = {n} pairs for 80 % power against +2.5 points" in s for s in study["conclusions"]["can"])
    assert any("no main run was made" in s for s in study["conclusions"]["cannot"])
    # --render redraws the refusal's page from study.json alone.
    (out / "README.md").write_text("edited")
    from services.study.cli import compare_command

    assert CliRunner().invoke(compare_command, ["--render", str(out)]).exit_code == 0
    assert (out / "README.md").read_text() == page
    # Run past a failed check, the budget still holds.
    forced = tmp_path / "forced"
    _pilot(config, forced, v0=0.9)
    r = _compare(config, forced, "--budget-hours", "0.1", "--force")
    assert r.exit_code == 1 and "FAIL headroom" in r.output and f"n = {n} pairs" in r.output
    study = json.loads((forced / "study.json").read_text())
    assert study["forced"] == ["headroom"]
    assert "| headroom | FAILED, run past with --force |" in (forced / "README.md").read_text()


def test_a_pilot_of_runs_without_their_code_is_refused(toy_study, tmp_path):
    config, out = _config(toy_study, tmp_path), tmp_path / "study"
    _pilot(config, out)
    path = out / "pilot" / "runs" / "spo-s1000" / "run.json"
    record = json.loads(path.read_text())
    del record["code"]
    path.write_text(json.dumps(record))
    r = _compare(config, out)
    assert r.exit_code == 1 and "do not come from one code" in r.output


def test_a_main_run_is_bound_to_its_protocols_hash(toy_study, tmp_path):
    from services.launch.run import Launcher, LaunchError

    base = resolve(_config(toy_study, tmp_path), ())
    s = arm_settings(base, "spopp", 0, tmp_path, protocol="a" * 64)
    p = Launcher(s, echo=lambda _line: None).prepare()
    assert p.identity()["protocol"] == "a" * 64
    p.run_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "run": s.run,
        "arm": p.arm(),
        "seed": 0,
        "identity": p.identity(),
        "status": "stopped",
        "launches": 1,
    }
    (p.run_dir / "run.json").write_text(json.dumps(record))
    # The same run under another protocol is another run: its folder refuses it.
    with pytest.raises(LaunchError, match="protocol"):
        Launcher(
            arm_settings(base, "spopp", 0, tmp_path, protocol="b" * 64), echo=lambda _line: None
        ).prepare()


@pytest.mark.slow  # two launched runs of the tiny model (a minute or two each on 2 cores)
@pytest.mark.timeout(1800)
def test_a_registered_study_runs_its_last_pair_for_real_and_writes_its_page(toy_study, tmp_path):
    """The main-run path for real at the cost of one pair: the pilot and five pairs are fixed data
    made under the protocol the command's own code registers from that pilot (this checkout's
    code, as a launch records it); the sixth pair is launched by the command, carries the
    protocol's hash, and the page is written from all six."""
    from services.study.measures import measure
    from services.study.registered import Request, pilot_design, register
    from spopp.files import provenance

    config, out = _config(toy_study, tmp_path, max_updates=2, evaluator=False), tmp_path / "study"
    code = provenance.code()
    _pilot(config, out, code=code)
    req = Request(base=resolve(config, ()), out=out, pilot_seeds=list(PILOT), effect=100.0)
    runs = [measure(out / "pilot" / "runs" / f"{arm}-s{seed}") for seed in PILOT for arm in ("spo", "spopp")]
    protocol, digest = register(req, pilot_design(req, runs), [], None)
    assert protocol["n"] == 6 and protocol["seeds"] == list(range(6))
    for seed in range(5):
        for arm, online in (("spo", [0.4, 0.4]), ("spopp", [0.4, 0.4 + 0.01 * (seed + 1)])):
            _finished(arm_settings(req.base, arm, seed, out, digest), online, 0.4, 80, code=code)
    r = subprocess.run(
        cli("study", "compare", str(config), "--out", str(out), "--pilot-seeds", "1000,1001", "--effect", "100"),
        capture_output=True, text=True, timeout=1700,
    )  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert r.stdout.count("(finished)") == 10  # the fixed pairs, not run again
    for arm in ("spo", "spopp"):
        record = json.loads((out / "runs" / f"{arm}-s5" / "run.json").read_text())
        assert record["protocol"] == digest and record["status"] == "finished"
        assert provenance.label(record["code"]) == provenance.label(code)
    study = json.loads((out / "study.json").read_text())
    assert study["result"]["seeds"] == list(range(6)) and study["protocol_sha256"] == digest
    page = (out / "README.md").read_text()
    assert all(f"- {s}" in page for s in study["conclusions"]["can"] + study["conclusions"]["cannot"])
