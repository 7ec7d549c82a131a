"""`spopp study compare` on the tiny model, for real: the pilot's runs launched, measured and
checked, the study refused before its main runs (a design check or the budget, naming n) with no
protocol registered; and a main run's folder bound to its protocol's hash."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from procs import cli

from services.launch.cli import resolve
from services.study.compare import arm_settings
from services.study.design import CEILING, MIN_OUTCOMES_PER_PROMPT, V0_BAND

pytestmark = pytest.mark.process  # starts processes: the process tier (tests/conftest.py)

BUDGET = {"max_turns": 3, "max_tokens_per_turn": 16, "max_total_tokens": 128}


@pytest.fixture(scope="module")
def study_config(tmp_path_factory, learned_model) -> Path:
    """The demo's learned toy model on 8 toy-calc tasks (so that each prompt sees several
    outcomes), a prior from 8 outcomes each, 2 updates of 4 trajectories, every version scored."""
    from runtime.envs.toy_calc import write_toy_calc_tasks
    from spopp.priors import build_prior, write_prior

    root = tmp_path_factory.mktemp("study-run")
    train, heldout = write_toy_calc_tasks(root / "data", seed=0, n_train=8, n_heldout=8)
    ids = [json.loads(line)["task_id"] for line in train.read_text().splitlines()]
    outcomes = {t: [float(i % 2 == j % 2) for j in range(8)] for i, t in enumerate(ids)}
    write_prior(root / "prior.json", build_prior(outcomes, 8.0, {"model": str(learned_model)}))
    cfg = {
        "model": str(learned_model), "tasks": str(train), "heldout": str(heldout), "prior": str(root / "prior.json"),
        "env": "toy-calc", "max_updates": 2, "progress_seconds": 5,
        "rollout": {"engine": "transformers", "concurrency": 8, **BUDGET},
        "learner": {"batch_size": 4, "mini_batches": 1, "micro_batch_size": 4, "lr": 1e-4, "keep_snapshots": 2},
        "evaluator": {"every": 1, "greedy": False, "samples": 1, **BUDGET},
    }  # fmt: skip
    path = root / "study.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _compare(config: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(cli("study", "compare", str(config), "--out", str(out), "--pilot-seeds", "1000,1001", *args),
                          capture_output=True, text=True, timeout=900)  # fmt: skip


def _expected_failures(pilot: Path) -> set[str]:
    """The checks the pilot's own files fail, read here without the study's code: version 0's
    held-out success (evals.jsonl), the last update's batch reward (metrics.jsonl), outcomes over
    tasks (run.json's tracker counts)."""
    v0, last, per_prompt = [], [], []
    for folder in sorted((pilot / "runs").iterdir()):
        evals = [json.loads(line) for line in (folder / "eval" / "evals.jsonl").read_text().splitlines()]
        v0.append(next(e["eval/sampled/reward_mean"] for e in evals if e["policy_version"] == 0))
        last.append(
            json.loads((folder / "learner" / "metrics.jsonl").read_text().splitlines()[-1])["reward_mean"]
        )
        counts = json.loads((folder / "run.json").read_text())["tracker_counts"]
        per_prompt.append(counts["outcomes"] / counts["tasks"])
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    failing = set()
    if not V0_BAND[0] <= mean(v0) <= V0_BAND[1]:
        failing.add("headroom")
    if mean(last) >= CEILING:
        failing.add("ceiling")
    if mean(per_prompt) < MIN_OUTCOMES_PER_PROMPT:
        failing.add("outcomes per prompt")
    return failing


@pytest.mark.timeout(1200)
def test_a_real_pilot_sizes_the_study_and_it_is_refused_before_any_main_run(study_config, tmp_path):
    out = tmp_path / "study"
    # A budget of 36 s cannot pay for 6 pairs of runs that take tens of seconds each.
    r = _compare(study_config, out, "--budget-hours", "0.01", "--force")
    assert r.returncode == 1, r.stdout + r.stderr
    found = json.loads((out / "pilot" / "design.json").read_text())
    assert f"n = {found['n']} pairs" in r.stderr and "--budget-hours" in r.stderr and found["n"] >= 6
    assert sorted(p.name for p in (out / "pilot" / "runs").iterdir()) == [
        "spo-s1000", "spo-s1001", "spopp-s1000", "spopp-s1001"]  # fmt: skip
    assert not (out / "protocol.json").exists() and not (out / "runs").exists()
    # The checks agree with the pilot's files read independently.
    failing = {c["name"] for c in found["checks"] if not c["ok"]}
    assert failing == _expected_failures(out / "pilot")
    # Again without --force: the finished pilot is not run again; a failed check refuses the design
    # (naming each), else the budget refuses as before.
    again = _compare(study_config, out, "--budget-hours", "0.01")
    assert again.returncode == 1 and again.stdout.count("(finished)") == 4
    if failing:
        assert "the design cannot answer" in again.stderr
        assert all(f"FAIL {name}" in again.stderr for name in failing)
    else:
        assert f"n = {found['n']} pairs" in again.stderr
    assert not (out / "protocol.json").exists()


def test_a_main_run_is_bound_to_its_protocols_hash(study_config, tmp_path):
    from services.launch.run import Launcher, LaunchError

    base = resolve(study_config, ())
    s = arm_settings(base, "spopp", 0, tmp_path, protocol="a" * 64)
    launcher = Launcher(s, echo=lambda _line: None)
    p = launcher.prepare()
    assert p.identity()["protocol"] == "a" * 64
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
