"""`make chaos`'s own arithmetic (tools/chaos.py): who is killed, what each kill cost, what counts
as lost or doubled. The run itself is `make chaos`; the launcher's supervision is tested with real
processes in tests/launch/test_supervision_restarts.py."""

from __future__ import annotations

import json
import random

from tools.chaos import KINDS, check, plan_kills, training_lost


def test_every_kind_is_a_victim_and_a_replica_victim_names_a_replica():
    for seed in range(20):
        victims = plan_kills(random.Random(seed), 6, 3)
        assert len(victims) == 6
        kinds = {"rollout" if v.startswith("rollout-") else v for v in victims}
        assert kinds == set(KINDS)
        assert all(
            v in KINDS[:1] + KINDS[1:2] + KINDS[3:] or v in {"rollout-0", "rollout-1", "rollout-2"}
            for v in victims
        )


def test_a_stall_is_put_on_the_first_kill_in_it_and_less_the_median_gap():
    records = [{"time": t} for t in (0.0, 1.0, 2.0, 3.0, 13.0, 14.0, 15.0)]
    kills = [{"victim": "rollout-0", "time": 1.5}, {"victim": "learner", "time": 3.5},
             {"victim": "evaluator", "time": 8.0}, {"victim": "tracker", "time": 99.0}]  # fmt: skip
    assert training_lost(records, kills) == [
        {"victim": "rollout-0", "lost_seconds": 0.0},
        {"victim": "learner", "lost_seconds": 9.0},
        {"victim": "evaluator", "lost_seconds": 0.0, "during": "learner"},
        {"victim": "tracker", "lost_seconds": None},  # after the last update: no stall to measure
    ]


def _run_dir(tmp_path, counts: dict, workers: dict, export_outcomes: list[int], steps: int = 4):
    run = tmp_path / "run"
    (run / "learner").mkdir(parents=True)
    (run / "eval").mkdir()
    (run / "logs").mkdir()
    (run / "logs" / "learner.log").write_text("ok\n")
    (run / "learner" / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"step": i + 1, "policy_version": i, "time": float(i)}) + "\n" for i in range(steps)
        )
    )
    (run / "eval" / "evals.jsonl").write_text(
        "".join(json.dumps({"policy_version": v}) + "\n" for v in (0, 2, 4))
    )
    (run / "export.jsonl").write_text("".join(json.dumps({"outcomes": n}) + "\n" for n in export_outcomes))
    state = {"status": "finished", "restarts": {"learner": 1}, "tracker_counts": counts, "workers": workers}
    (run / "run.json").write_text(json.dumps(state))
    return run


def test_a_whole_run_counts_nothing_lost_or_doubled(tmp_path):
    counts = {"dispatches": 10, "outcomes": 7, "releases": 2, "expirations": 1, "in_flight": 0}
    run = _run_dir(tmp_path, counts, {"rollout-0": {"outcomes": 4}, "rollout-1": {"outcomes": 3}}, [3, 4])
    got = check(run, 4, "learner is up again (pid 7; down 12.5 s)\n")
    assert (got["lost"], got["doubled"], got["published_once"]) == (0, 0, True)
    assert got["downtime_seconds"] == {"learner": [12.5]}


def test_a_dispatch_unaccounted_for_is_lost_and_evidence_beyond_the_count_is_doubled(tmp_path):
    counts = {"dispatches": 11, "outcomes": 7, "releases": 2, "expirations": 1, "in_flight": 0}
    run = _run_dir(tmp_path, counts, {"rollout-0": {"outcomes": 7}}, [4, 4])
    got = check(run, 4, "")
    assert (got["lost"], got["doubled"]) == (1, 1)


def test_a_repeated_step_is_not_published_once(tmp_path):
    counts = {"dispatches": 1, "outcomes": 1, "releases": 0, "expirations": 0, "in_flight": 0}
    run = _run_dir(tmp_path, counts, {"rollout-0": {"outcomes": 1}}, [1], steps=4)
    path = run / "learner" / "metrics.jsonl"
    path.write_text(path.read_text() + json.dumps({"step": 4, "policy_version": 3, "time": 9.0}) + "\n")
    assert check(run, 4, "")["published_once"] is False
