"""The demo path at its smallest: data, cold start, prior, paired runs through `spopp launch`, report.

Every stage runs for real (a few updates); the test checks each stage's output and recomputes the
report's numbers from the evaluator's logs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from spopp.files.priors import read_prior
from spopp.settings.base import environ_without_settings

pytestmark = pytest.mark.process  # starts processes: the process tier (tests/conftest.py)


def _trapezoid(r: list[float]) -> float:
    return (
        r[0] if len(r) == 1 else sum((a + b) / 2 for a, b in zip(r[:-1], r[1:], strict=True)) / (len(r) - 1)
    )


def _end(r: list[float]) -> float:
    return sum(r[-5:]) / len(r[-5:])


# The demo's own limit; the test's (pytest-timeout) is a minute more, so that a slow machine fails
# with this limit's message and the demo's output rather than with a bare timeout.
DEMO_LIMIT_S = 900


def run_demo(module: str, out) -> subprocess.CompletedProcess:
    """`python -m <module> --tiny --out <out>`, which must succeed within DEMO_LIMIT_S."""
    env = environ_without_settings()
    r = subprocess.run(
        [sys.executable, "-m", module, "--tiny", "--out", str(out)],
        capture_output=True, text=True, timeout=DEMO_LIMIT_S, env={**env, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return r


def check_runs_and_report(out, stdout: str, *, updates: int, versions: list[int]) -> dict[str, list[dict]]:
    """Stages 4 and 5 of a demo with one pair at seed 0: both runs finished after `updates` updates
    and evaluated at `versions`, the report's numbers recomputed from the evaluator's logs, the last
    lines naming the output. Returns each arm's scored evaluation lines."""
    curves, scored = {}, {}
    for arm in ("spo", "spopp"):
        run_dir = out / "runs" / f"{arm}-s0"
        state = json.loads((run_dir / "run.json").read_text())
        assert state["status"] == "finished" and state["arm"] == arm and state["updates_done"] == updates
        lines = [json.loads(x) for x in (run_dir / "eval" / "evals.jsonl").read_text().splitlines()]
        scored[arm] = [x for x in lines if "eval/sampled/reward_mean" in x]
        curves[arm] = (
            [x["policy_version"] for x in scored[arm]],
            [x["eval/sampled/reward_mean"] for x in scored[arm]],
        )
        assert curves[arm][0] == versions
        assert (run_dir / "learner" / "metrics.jsonl").is_file() and (run_dir / "export.jsonl").is_file()
    # 5. report: the numbers are those of the logs
    report = json.loads((out / "report.json").read_text())
    by_arm = {run["arm"]: run for run in report["runs"]}
    for arm, (v, rewards) in curves.items():
        assert by_arm[arm]["versions"] == v and by_arm[arm]["rewards"] == rewards
        assert by_arm[arm]["seed"] == 0
    (pair,) = report["pairs"]
    n = min(len(curves["spo"][1]), len(curves["spopp"][1]))
    spo, spopp = curves["spo"][1][:n], curves["spopp"][1][:n]
    assert pair["spo"]["area"] == _trapezoid(spo) and pair["spopp"]["area"] == _trapezoid(spopp)
    assert pair["spo"]["end"] == _end(spo) and pair["spopp"]["end"] == _end(spopp)
    assert abs(pair["d_area"] - 100 * (_trapezoid(spopp) - _trapezoid(spo))) < 1e-9
    assert abs(report["table"]["d_area"]["mean"] - pair["d_area"]) < 1e-9
    assert (out / "report.md").read_text().count("|") > 10
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The last lines name the output folder and its files.
    tail = stdout.strip().splitlines()[-4:]
    assert tail[0] == f"demo output: {out}" and tail[1].strip().endswith("report.md")
    return scored


@pytest.mark.slow  # every stage of the demo, two launched runs (the stages' commands are in make test alone)
@pytest.mark.timeout(DEMO_LIMIT_S + 60)
def test_demo_smallest_path_every_stage(tmp_path):
    out = tmp_path / "demo"
    r = run_demo("tools.demo", out)

    # 1. data: disjoint training and held-out tasks
    train = [json.loads(x)["task_id"] for x in (out / "data" / "train.jsonl").read_text().splitlines()]
    held = [json.loads(x)["task_id"] for x in (out / "data" / "heldout.jsonl").read_text().splitlines()]
    assert len(train) == 32 and len(held) == 16 and not set(train) & set(held)
    # 2. cold start: a model folder with its training report
    assert (out / "cold-start" / "config.json").is_file()
    assert json.loads((out / "cold-start" / "cold_start.json").read_text())["steps"] == 60
    # 3. prior: one entry per training task, 8 rollouts each, mass 8
    prior = read_prior(out / "prior.json")
    assert [t.task_id for t in prior.tasks] == train
    assert all(t.rollouts == 8 and abs(t.alpha0 + t.beta0 - 8.0) < 1e-9 for t in prior.tasks)
    # 4. runs: one pair, both finished, each with its curve; 5. the report
    check_runs_and_report(out, r.stdout, updates=4, versions=[0, 2, 4])
