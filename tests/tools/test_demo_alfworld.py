"""The ALFWorld demo at its smallest: games, cold start, prior, paired runs through `spopp launch`, report.

Every stage runs for real on ALFWorld's engine (a few games, a few updates); the test checks each
stage's output and recomputes the report's numbers from the evaluator's logs."""

from __future__ import annotations

import json

import pytest
import yaml
from test_demo import DEMO_LIMIT_S, check_runs_and_report, run_demo

from spopp.files.priors import read_prior

pytestmark = pytest.mark.process  # starts processes: the process tier (tests/conftest.py)

pytest.importorskip("alfworld")
pytest.importorskip("textworld")


@pytest.mark.slow  # every demo stage on ALFWorld's engine
@pytest.mark.timeout(DEMO_LIMIT_S + 60)
def test_alfworld_demo_smallest_path_every_stage(tmp_path):
    out = tmp_path / "demo"
    r = run_demo("tools.alfworld_demo", out)

    # 1. data: one game per task type in each set; training, cold-start and held-out games disjoint
    def rows(name: str) -> list[dict]:
        return [json.loads(x) for x in (out / "data" / name).read_text().splitlines()]

    train, held, cold = rows("train.jsonl"), rows("heldout.jsonl"), rows("cold-start.jsonl")
    assert len(train) == 6 and len(held) == 6 and len(cold) == 6
    for tasks in (train, held, cold):
        assert len({t["task_type"] for t in tasks}) == 6

    def trials(tasks: list[dict]) -> set[str]:
        return {t["answer"].rsplit("/", 1)[1] for t in tasks}

    assert not trials(train) & trials(held) and not trials(cold) & (trials(train) | trials(held))
    # 2. cold start: a model folder whose positions cover the episode budget, and its report
    config = json.loads((out / "cold-start" / "config.json").read_text())
    launch = yaml.safe_load((out / "launch.yaml").read_text())
    assert config["max_position_embeddings"] >= launch["rollout"]["max_total_tokens"]
    report_cs = json.loads((out / "cold-start" / "cold_start.json").read_text())
    assert report_cs["steps"] == 20 and report_cs["teacher_episodes"] == len(cold)
    assert launch["env"] == "alfworld" and launch["env_options"]["max_steps"] == 12
    # 3. prior: one entry per training task, mass 8
    prior = read_prior(out / "prior.json")
    assert [t.task_id for t in prior.tasks] == [t["task_id"] for t in train]
    assert all(t.rollouts == 1 and abs(t.alpha0 + t.beta0 - 8.0) < 1e-9 for t in prior.tasks)
    # 4. runs: one pair, both finished, each with its curve over the 6 held-out games; 5. the report
    scored = check_runs_and_report(out, r.stdout, updates=2, versions=[0, 1, 2])
    assert all(x["eval/tasks"] == 6 for lines in scored.values() for x in lines)
