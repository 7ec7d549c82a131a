"""The pretrained-model study's pilot (tools/pretrained_pilot.py), its pure parts: the candidates fit
their environments' options, the pilot's seed can draw no main-study task, the table renders from
the JSON. No model runs here."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from runtime.envs.registry import resolve
from tools import pretrained_pilot as pp
from tools.demo_real import BUDGET


def test_candidates_fit_their_environments_options():
    assert len({c.family for c in pp.CANDIDATES}) == len(pp.CANDIDATES)
    assert {c.env for c in pp.CANDIDATES} == {"toy-calc", "reasoning-gym"}
    for c in pp.CANDIDATES:
        json.dumps([c.env_options, c.task_options])  # written to pilot.json as they are
        r = resolve(c.env, c.env_options)
        r.cls(**r.options).close()  # the environment's own checks (no process: not its prepare)
        assert (c.dataset is None) == (c.env == "toy-calc")


def test_candidates_make_their_held_out_tasks(tmp_path: Path):
    pytest.importorskip("reasoning_gym")
    for c in pp.CANDIDATES:
        tasks = pp.pilot_tasks(c, 4, pp.PILOT_SEED)  # a family option it does not have raises here
        assert len({t.task_id for t in tasks}) == 4
        assert all(t.answer for t in tasks)
        assert 0 < pp.question_pool(c, 64) <= 64
        assert 0 < pp.constant_share(tasks) <= 1
        s = pp.score_settings(c, tmp_path / "heldout.jsonl", tmp_path, pp.PILOT_SEED)
        # One episode per task, sampled at T = 1, under the demo's budget.
        assert (s.greedy, s.samples, s.temperature, s.env, s.seed) == (
            False, 1, 1.0, c.env, pp.PILOT_SEED
        )  # fmt: skip
        assert (s.max_turns, s.max_tokens_per_turn, s.max_total_tokens) == tuple(BUDGET.values())
    # The toy-calc candidates are scored on the same tasks (paired).
    toy = [c for c in pp.CANDIDATES if c.env == "toy-calc"]
    assert len({tuple(t.prompt for t in pp.pilot_tasks(c, 8, pp.PILOT_SEED)) for c in toy}) == 1


def test_the_pilot_seed_draws_no_main_study_task():
    assert pp.PILOT_SEED not in pp.MAIN_SEEDS
    for env in ("toy-calc", "reasoning-gym"):
        assert pp.seed_rule_holds(env)
        assert pp.seed_rule_holds(env, pp.PILOT_SEED, 1000)
        for main_seed in (0, 999):  # the demo's data seed and the last a main study may use
            main = pp.streams(env, main_seed, pp.MAIN_MAX_TASKS, pp.MAIN_MAX_TASKS)
            assert not pp.overlap(pp.streams(env, pp.PILOT_SEED, 1, pp.PILOT_TASKS), main)
        assert not pp.seed_rule_holds(env, 7)  # a main-study seed
    # reasoning-gym draws item i of seed s from Random(s + i): a "pilot" on seed 2000 would reuse
    # the held-out items of a main study on seed 0 with 640 held-out tasks.
    assert not pp.seed_rule_holds("reasoning-gym", 2000)
    assert pp.overlap(pp.streams("reasoning-gym", 2000, 1, 64), pp.streams("reasoning-gym", 0, 512, 640))
    assert not pp.overlap(pp.streams("toy-calc", 2000, 1, 64), pp.streams("toy-calc", 0, 512, 640))


def test_overlap_is_per_stream_and_half_open():
    assert pp.overlap([("a", 0, 10)], [("a", 9, 20)])
    assert not pp.overlap([("a", 0, 10)], [("a", 10, 20)])
    assert not pp.overlap([("a", 0, 10)], [("b", 0, 10)])
    with pytest.raises(ValueError, match="no seed rule"):
        pp.streams("math-tir", 0, 1, 1)


def test_the_standard_error_is_the_curves():
    assert pp.standard_error(32, 64) == pytest.approx(math.sqrt(0.25 / 63))
    assert pp.standard_error(0, 64) == 0.0


def _row(family: str, successes: int, **extra) -> dict:
    n = 64
    return {
        "family": family, "env": "reasoning-gym", "env_options": {"shots": 2}, "dataset": family,
        "task_options": {}, "seed": pp.PILOT_SEED, "n": n, "successes": successes,
        "success_rate": successes / n, "se": pp.standard_error(successes, n), "partial": successes + 1,
        "reward_mean": successes / n, "truncated_rate": 0.0, "answer_checks_failed": 0,
        "generated_tokens_per_episode": 9.0, "tokens_per_episode": 152.4, "turns_per_episode": 1.0,
        "seconds": 40.0, "seconds_per_episode": 0.625, "pool": 2048, "constant_share": 0.25,
        **extra,
    }  # fmt: skip


def test_render_gives_the_table_from_the_json(tmp_path: Path, capsys):
    doc = {
        "seed": pp.PILOT_SEED,
        "n": 64,
        "rows": [
            _row("chain_sum", 24),
            _row("products", 5),
            {"family": "slow", "env": "reasoning-gym", "cut": "over 300 s (10 of 64 episodes done)"},
        ],
    }
    table = pp.render(doc).splitlines()
    assert "data seed 2000000" in table[0]
    assert table[2].startswith("| family | env | success |")
    assert table[4] == (
        "| chain_sum | reasoning-gym | 24/64 = 0.375 | 0.061 | 25/64 | yes | 0.00 | 0 | 152 (9.0) | 0.62 | 40"
        " | 2048 | 0.25 |"
    )
    assert "| products | reasoning-gym | 5/64 = 0.078 |" in table[5] and "| no |" in table[5]
    assert table[6].startswith("| slow | reasoning-gym | cut: over 300 s")
    assert [pp.in_range(r) for r in doc["rows"]] == [True, False, False]
    path = tmp_path / "pilot.json"
    path.write_text(json.dumps(doc))
    assert pp.main(["--render", str(path)]) == 0
    assert capsys.readouterr().out.splitlines() == table


def test_a_rerun_keeps_the_rows_of_unchanged_candidates_only(tmp_path: Path):
    toy2, toy1 = pp.CANDIDATES[0], pp.CANDIDATES[1]
    kept = {**_row(toy2.family, 33), "env": toy2.env, "env_options": toy2.env_options, "dataset": None}
    stale = {**_row(toy1.family, 0), "env": toy1.env, "env_options": {"describe_tool": True, "shots": 0}}
    out = tmp_path / "pilot.json"
    out.write_text(json.dumps({"seed": pp.PILOT_SEED, "n": 64, "rows": [kept, stale]}))
    # Nothing left to measure for toy2: no engine starts, and the stale row is dropped.
    doc = pp.measure(tmp_path, [toy2], 64, pp.PILOT_SEED, out, tmp_path / "work", pp.LIMIT_S)
    assert [r["family"] for r in doc["rows"]] == [toy2.family]
    assert json.loads(out.read_text())["rows"] == [kept]
