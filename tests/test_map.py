"""`spopp map`: toy-calc's two knobs, what is measured of them, and the map's summary.

The knobs are checked on the environment itself (the padded turns of the coupled side, the
lognormal delay); the summary on run folders written here with known curves, so that every
difference and standard error is computed by hand.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from runtime.envs import env_factory
from runtime.envs.toy_calc import ToyCalcEnv, make_task
from services.launch.map import cell_name, markdown, summarize, write
from services.learner.update import length_advantage_corr

TASK = make_task(123, 45, 67)  # 5602
RIGHT, WRONG = "<ans>5602</ans>", "<ans>1</ans>"


def play(env: ToyCalcEnv, first: str) -> tuple[float, int, dict]:
    """An episode answering `first`, then anything: (reward, turns, last info)."""
    env.reset(TASK)
    result, turns = env.step(first), 1
    while not result.done:
        assert result.messages == [{"role": "tool", "content": "<out>again</out>"}]
        result, turns = env.step("<code>1+1</code>"), turns + 1
    return result.reward, turns, result.info


@pytest.mark.parametrize(
    "coupling,right_turns,wrong_turns",
    [(0.0, 1, 1), (-1.0, 1, 4), (1.0, 4, 1), (-0.5, 1, 3)],  # -0.5: round(1.5) = 2 extra turns
)
def test_coupling_pads_the_coupled_side_and_keeps_the_reward(coupling, right_turns, wrong_turns):
    env = ToyCalcEnv(coupling=coupling, extra_turns=3)
    assert play(env, RIGHT)[:2] == (1.0, right_turns)
    reward, turns, info = play(env, WRONG)
    assert (reward, turns) == (0.0, wrong_turns)
    assert info["padded_turns"] == wrong_turns - 1 and info["finish"] == "answer"
    # A malformed turn is a failure too, padded on the same side.
    assert play(env, "no block")[:2] == (0.0, wrong_turns)


def test_padded_turns_carry_the_settled_reward_for_a_budget_cut():
    """While padding, every step says the reward already decided (the agent loop keeps it when a
    budget cuts the padding); before and after, none does."""
    env = ToyCalcEnv(coupling=1.0, extra_turns=3)
    env.reset(TASK)
    result = env.step(RIGHT)
    assert not result.done and result.info["decided_reward"] == 1.0
    assert env.step("x").info["decided_reward"] == 1.0
    env = ToyCalcEnv(coupling=-1.0, extra_turns=3)
    env.reset(TASK)
    assert "decided_reward" not in env.step("<code>1+1</code>").info
    assert env.step(WRONG).info["decided_reward"] == 0.0


def test_latency_is_lognormal_with_the_given_median_and_sigma_and_zero_is_none():
    import random
    import statistics

    env = ToyCalcEnv(latency_sigma=1.5, latency_median_s=0.02)
    env._rng = random.Random(7)  # a fixed stream: the figures below are exact for it
    logs = [math.log(env.latency()) for _ in range(4000)]
    assert math.exp(statistics.median(logs)) == pytest.approx(0.02, rel=0.1)
    assert statistics.stdev(logs) == pytest.approx(1.5, rel=0.05)
    assert ToyCalcEnv().latency() == 0.0
    # The step really waits: a median of 40 ms with a tiny spread.
    slow = ToyCalcEnv(latency_sigma=0.01, latency_median_s=0.04)
    slow.reset(TASK)
    t0 = time.perf_counter()
    slow.step("<code>1+1</code>")
    assert time.perf_counter() - t0 >= 0.035


@pytest.mark.parametrize(
    "options,message",
    [
        ({"coupling": 1.5}, "coupling must lie in"),
        ({"extra_turns": 17}, "extra_turns must lie in"),
        ({"latency_sigma": -1}, "latency_sigma must lie in"),
        ({"latency_median_s": 0}, "latency_median_s must lie in"),
    ],
)
def test_bad_knobs_are_refused_at_start_up(options, message):
    with pytest.raises(ValueError, match=message):
        env_factory("toy-calc", options)


def test_length_advantage_correlation_by_hand():
    # lengths 1, 2, 3 and advantages -1, 0, 1: perfectly correlated; reversed: -1.
    assert length_advantage_corr([1, 2, 3], [-1.0, 0.0, 1.0]) == pytest.approx(1.0)
    assert length_advantage_corr([1, 2, 3], [1.0, 0.0, -1.0]) == pytest.approx(-1.0)
    # (2, 4, 6, 8) against (1, 0, 1, 0): cov = -2 (x-deviations -3,-1,1,3 times y-deviations ±0.5),
    # sd products sqrt(20 * 1) -> -2 / sqrt(20).
    assert length_advantage_corr([2, 4, 6, 8], [1.0, 0.0, 1.0, 0.0]) == pytest.approx(-2 / math.sqrt(20))
    assert length_advantage_corr([5, 5, 5], [0.1, 0.2, 0.3]) == 0.0  # no spread: no correlation
    assert length_advantage_corr([5], [0.1]) == 0.0


# -- the summary, on run folders with known curves -------------------------------------------------
def write_run(
    root: Path, cell: str, arm: str, seed: int, rewards: list[float], corr: float, late: int
) -> None:
    folder = root / "cells" / cell / "runs" / f"{arm}-s{seed}"
    (folder / "eval").mkdir(parents=True)
    (folder / "learner").mkdir()
    record = {"run": folder.name, "arm": arm, "recipe": "spo" if arm == "spo" else "spopp", "seed": seed,
              "status": "finished",
              "tracker_counts": {"outcomes": 100, "late_outcomes": late, "overtaken_outcomes": 2 * late,
                                 "reorder_distance": 5 * late}}  # fmt: skip
    (folder / "run.json").write_text(json.dumps(record))
    evals = [{"policy_version": 2 * i, "step": 2 * i or None, "time": 1.7e9 + i, "eval/sampled/reward_mean": r}
             for i, r in enumerate(rewards)]  # fmt: skip
    (folder / "eval" / "evals.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    steps = [
        {"step": s, "time": 1.7e9 + s, "policy_version": s - 1, "length_advantage_corr": corr} for s in (1, 2)
    ]
    (folder / "learner" / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in steps))


def test_summary_pairs_by_seed_with_standard_errors_by_hand(tmp_path):
    cell = cell_name(-1.0, 1.5)
    assert cell == "coupling-1-latency1.5"
    # Areas (trapezoid over 3 points = mean of the two segment means):
    # spo s0 [0, .2, .4] -> 0.2; s1 [0, .2, .2] -> 0.15; spopp s0 [0, .4, .4] -> 0.3; s1 [0, .2, .4] -> 0.2
    # trajnorm s0 [0, .2, .6] -> 0.25; s1 [0, .2, .2] -> 0.15
    curves = {
        ("spo", 0): [0, 0.2, 0.4], ("spo", 1): [0, 0.2, 0.2], ("spopp", 0): [0, 0.4, 0.4],
        ("spopp", 1): [0, 0.2, 0.4], ("spopp-trajnorm", 0): [0, 0.2, 0.6], ("spopp-trajnorm", 1): [0, 0.2, 0.2],
    }  # fmt: skip
    for (arm, seed), rewards in curves.items():
        write_run(
            tmp_path, cell, arm, seed, rewards, corr=-0.4 if arm == "spo" else -0.2, late=10 * (seed + 1)
        )
    result = summarize(tmp_path, [-1.0], [1.5], ["spo", "spopp-trajnorm", "spopp"], [0, 1])
    [c] = result["cells"]
    assert c["points"] == 3 and c["arms"]["spo"]["area"] == pytest.approx(0.175)
    d = c["diffs"]["spopp-spo"]  # per seed 100 * (0.3 - 0.2) = 10 and 100 * (0.2 - 0.15) = 5
    assert d["per_seed"] == pytest.approx([10.0, 5.0]) and d["mean"] == pytest.approx(7.5)
    assert d["sd"] == pytest.approx(math.sqrt(12.5)) and d["se"] == pytest.approx(2.5) and d["won"] == 2
    assert c["diffs"]["trajnorm-spo"]["per_seed"] == pytest.approx([5.0, 0.0])
    assert c["diffs"]["spopp-trajnorm"]["per_seed"] == pytest.approx([5.0, 5.0])
    assert c["diffs"]["spopp-trajnorm"]["se"] == pytest.approx(0.0)
    # Measured: the correlation averaged over every run's updates, late = late / outcomes.
    assert c["measured"]["length_advantage_corr"] == pytest.approx((2 * -0.4 + 4 * -0.2) / 6)
    assert c["measured"]["late_fraction"] == pytest.approx(0.15)  # 10/100 and 20/100 in every arm
    assert c["measured"]["overtaken_fraction"] == pytest.approx(0.30)
    assert c["measured"]["reorder_distance"] == pytest.approx(0.75)  # 50/100 and 100/100
    assert result["largest_se"] == pytest.approx(2.5)  # SPO++ − SPO's
    assert result["largest_se_parts"] == pytest.approx(2.5)  # event-time alone: [5, 0]
    md = markdown(result)
    assert (
        "| -1 | 1.5 | -0.27 | 0.15 | 0.30 | 0.8 | 0.175 | 0.250 | +7.5 ± 2.5 | 2/2 | +2.5 ± 2.5 | +5.0 ± 0.0 |"
        in md
    )
    assert (
        "Largest standard error of a cell's paired difference (SPO++ − SPO): 2.50 area points (target ≤ 1.5)."
        in md
    )
    assert "Largest standard error of its parts (each change alone): 2.50 area points." in md
    write(tmp_path / "out", result)
    assert json.loads((tmp_path / "out" / "map.json").read_text())["cells"][0]["cell"] == cell
    assert (tmp_path / "out" / "map.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_missing_run_names_its_folder(tmp_path):
    write_run(tmp_path, cell_name(0.0, 0.0), "spo", 0, [0.1, 0.2], corr=0.0, late=0)
    with pytest.raises(ValueError, match=r"spopp-s0.*run.json"):
        summarize(tmp_path, [0.0], [0.0], ["spo", "spopp"], [0])


def test_a_cell_is_the_base_with_the_two_knobs_set_and_nothing_else():
    from services.launch.config import LaunchSettings
    from services.launch.map import cell_settings, plan_runs

    base = LaunchSettings.model_validate(
        {
            "model": "m",
            "tasks": "t.jsonl",
            "env": "toy-calc",
            "env_options": {"latency_median_s": 0.1},
            "updates": 8,
        }
    )
    cell = cell_settings(base, -1.0, 1.5)
    assert cell.env_options == {"latency_median_s": 0.1, "coupling": -1.0, "latency_sigma": 1.5}
    assert cell.model_dump(exclude={"env_options"}) == base.model_dump(exclude={"env_options"})
    runs = plan_runs(base, [-1.0, 0.0], [0.0], ["spo", "spopp"], [3], Path("out"))
    assert [(c, s.run, str(s.run_dir)) for c, s in runs] == [
        ("coupling-1-latency0", "spo-s3", "out/cells/coupling-1-latency0/runs/spo-s3"),
        ("coupling-1-latency0", "spopp-s3", "out/cells/coupling-1-latency0/runs/spopp-s3"),
        ("coupling+0-latency0", "spo-s3", "out/cells/coupling+0-latency0/runs/spo-s3"),
        ("coupling+0-latency0", "spopp-s3", "out/cells/coupling+0-latency0/runs/spopp-s3"),
    ]
    with pytest.raises(ValueError, match="needs env toy-calc"):
        cell_settings(
            LaunchSettings.model_validate({"model": "m", "tasks": "t.jsonl", "env": "math-tir"}), 0.0, 0.0
        )


def test_the_map_command_refuses_bad_options_by_name(tmp_path):
    from click.testing import CliRunner

    from services.launch.cli import map_command

    config = tmp_path / "base.yaml"
    config.write_text("model: m\ntasks: t.jsonl\nenv: toy-calc\n")
    for args, message in (
        (["--coupling=a"], "--coupling 'a': expected numbers"),
        (["--latency=0,0"], "--latency '0,0': give distinct values"),
        (["--arms", "grpo"], "--arms: choose from spo, spopp, spopp-trajnorm"),
        (["--seeds", "x"], "--seeds 'x': expected integers"),
    ):
        r = CliRunner().invoke(map_command, [str(config), "--out", str(tmp_path / "out"), *args])
        assert r.exit_code == 2 and message in r.output, (args, r.output)
        assert not (tmp_path / "out").exists()
