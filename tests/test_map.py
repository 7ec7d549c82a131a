"""`spopp map`: toy-calc's two knobs, what is measured of them, and the map's summary.

The knobs are checked on the environment itself (the padded turns of the coupled side, the
lognormal delay); the summary on run folders written here with known curves, so that every
difference and standard error is computed by hand.
"""

from __future__ import annotations

import json
import math
import re
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
    import statistics

    env = ToyCalcEnv(latency_sigma=1.5, latency_median_s=0.02)
    env.seed_episode(7)  # a fixed stream: the figures below are exact for it
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


def test_time_neutral_makes_the_other_side_wait_out_the_padding():
    """With time_neutral the uncoupled side waits, at its end, about as long as a padded episode
    spent padding (here 3 turns of a 20 ms delay), so the coupled side no longer arrives later;
    without it, or with no padding, it ends at once."""
    import runtime.envs.toy_calc as toy

    toy._PADDING_SECONDS.clear()

    def seconds(env: ToyCalcEnv, first: str) -> float:
        t0 = time.perf_counter()
        play(env, first)
        return time.perf_counter() - t0

    slow = {"extra_turns": 3, "latency_sigma": 0.01, "latency_median_s": 0.02}
    neutral = ToyCalcEnv(coupling=1.0, time_neutral=True, **slow)
    assert seconds(neutral, WRONG) < 0.05  # nothing measured yet: no wait (a wait would be >= 0.06 more)
    padded = seconds(neutral, RIGHT)  # 4 steps of 20 ms, 3 of them padding
    assert padded >= 0.075
    waited = seconds(neutral, WRONG)  # 1 step of 20 ms + a drawn padding time of about 60 ms
    assert 0.07 <= waited <= padded + 0.05
    [recorded] = toy._PADDING_SECONDS[3]  # the 3 padded steps of the success, not its first
    assert 0.055 <= recorded <= padded - 0.015
    # The wait is the other side's only: a coupled episode is not slowed by it.
    assert seconds(neutral, RIGHT) < padded + 0.05
    assert seconds(ToyCalcEnv(coupling=1.0, **slow), WRONG) < 0.05  # off by default
    # No padding, nothing to wait for: coupling 0 with time_neutral changes nothing.
    assert not ToyCalcEnv(coupling=0.0, time_neutral=True).time_neutral
    toy._PADDING_SECONDS.clear()


@pytest.mark.parametrize(
    "options,message",
    [
        ({"time_neutral": "yes"}, "time_neutral must be true or false"),
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
        {"step": s, "time": 1.7e9 + s, "policy_version": s - 1, "length_advantage_corr": corr,
         "reward_mean": 0.1 * (s + 1)}
        for s in (1, 2)
    ]  # fmt: skip
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
    assert c["measured"]["batch_reward"] == pytest.approx(0.25)  # updates' 0.2 and 0.3 in every run
    assert c["start"] == 0.0 and c["seeds"] == [0, 1]
    assert result["largest_se"] == pytest.approx(2.5)  # SPO++ − SPO's
    assert result["largest_se_parts"] == pytest.approx(2.5)  # event-time alone: [5, 0]
    md = markdown(result)
    assert (
        "| -1 | 1.5 | -0.27 | 0.15 | 0.30 | 0.8 | 0.25 / 0.00 | 2 | 0.175 | 0.250 | +7.5 ± 2.5 | 2/2 | +2.5 ± 2.5 "
        "| +5.0 ± 0.0 |" in md
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


# -- seeds added where a cell's standard error is over the target ---------------------------------
def test_seeds_needed_and_the_cell_chosen_by_hand():
    from services.launch.map import choose_cell, seeds_needed

    # sd 3 over 3 seeds: se 1.73 > 1.5; (3 / 1.5)^2 = 4 seeds, one more. sd 6: 16 seeds, 13 more.
    assert seeds_needed({"sd": 3.0, "n": 3}, 1.5) == 1
    assert seeds_needed({"sd": 6.0, "n": 3}, 1.5) == 13
    assert seeds_needed({"sd": 1.0, "n": 3}, 1.5) == 0
    assert seeds_needed({"sd": None, "n": 1}, 1.5) == math.inf

    def cell(name, sd, n):
        return {"cell": name, "diffs": {"spopp-spo": {"sd": sd, "n": n, "se": sd / math.sqrt(n)}}}

    result = {"cells": [cell("a", 6.0, 3), cell("b", 3.0, 3), cell("c", 1.0, 3)]}
    assert choose_cell(result, 1.5)["cell"] == "b"  # the one a single seed may bring under
    assert choose_cell(result, 4.0) is None  # every se (3.46, 1.73, 0.58) within 4
    one_seed = {"cells": [{"cell": "d", "diffs": {"spopp-spo": {"sd": None, "n": 1, "se": None}}}]}
    assert choose_cell(one_seed, 1.5)["cell"] == "d"  # an unknown standard error is over any target


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _fake_runner(curves: dict, ran: list, clock: Clock | None = None):
    """Stands in for compare.run_in_turn (launching is what tests/test_map_run.py runs for real):
    each planned run's folder gets the curve `curves[(cell, arm, seed)]`, a run of 60 s on `clock`."""

    def runner(planned, echo, what):
        for cell, s in planned:
            if (s.run_dir / "run.json").exists():
                continue
            arm, seed = s.run.rsplit("-s", 1)
            write_run(s.run_dir.parent.parent.parent.parent, cell, arm, int(seed),
                      curves[(cell, arm, int(seed))], corr=0.0, late=0)  # fmt: skip
            record = json.loads((s.run_dir / "run.json").read_text())
            record.update(started=1000.0, finished=1060.0)
            (s.run_dir / "run.json").write_text(json.dumps(record))
            ran.append((cell, s.run))
            if clock is not None:
                clock.now += 60.0
        return [], 0

    return runner


def test_the_target_adds_seeds_to_the_cell_over_it_and_a_resume_keeps_them(tmp_path):
    from services.launch.config import LaunchSettings
    from services.launch.map import read_extra, run_map

    base = LaunchSettings.model_validate({"model": "m", "tasks": "t.jsonl", "env": "toy-calc", "updates": 2})
    quiet, noisy = cell_name(-1.0, 0.0), cell_name(1.0, 0.0)
    # SPO++ − SPO per seed, in area points: the quiet cell 5, 5, 5 (se 0); the noisy one 0, 10,
    # 20, then 10 for every added seed (se 5.8 over 3 seeds, 3.3 over 4, 2.4 over 5, 1.9 over 6).
    curves = {}
    for seed in range(12):
        gap = 0.05 if seed < 3 else 0.0
        curves[(quiet, "spo", seed)], curves[(quiet, "spopp", seed)] = (
            [0, 0.2, 0.2],
            [0, 0.2 + gap, 0.2 + gap],
        )
        step = [0.0, 0.1, 0.2][seed] if seed < 3 else 0.1
        curves[(noisy, "spo", seed)], curves[(noisy, "spopp", seed)] = (
            [0, 0.2, 0.2],
            [0, 0.2 + step, 0.2 + step],
        )
    ran: list = []
    lines: list[str] = []
    # The 12 common runs take 12 min; the budget leaves room for three more seeds of two 60 s runs
    # (and a little): 3 added, all to the noisy cell.
    clock = Clock()
    code = run_map(base, [-1.0, 1.0], [0.0], ["spo", "spopp"], [0, 1, 2], tmp_path, echo=lines.append,
                   target_se=1.5, budget_s=12 * 60 + 3 * 120 + 30, runner=_fake_runner(curves, ran, clock),
                   clock=clock)  # fmt: skip
    assert code == 0
    # The i-th seed of a cell runs the arms rotated by i, the added seeds too (by their place).
    assert [r for c, r in ran if c == quiet] == [
        "spo-s0",
        "spopp-s0",
        "spopp-s1",
        "spo-s1",
        "spo-s2",
        "spopp-s2",
    ]
    assert [r for c, r in ran if c == noisy][6:] == [
        "spopp-s3",
        "spo-s3",
        "spo-s4",
        "spopp-s4",
        "spopp-s5",
        "spo-s5",
    ]
    assert read_extra(tmp_path) == {noisy: [3, 4, 5]}
    assert any("adding seed 3" in line for line in lines)
    assert any("the budget is spent" in line and noisy in line for line in lines), lines
    result = json.loads((tmp_path / "map.json").read_text())
    by = {c["cell"]: c for c in result["cells"]}
    assert by[quiet]["seeds"] == [0, 1, 2] and by[noisy]["seeds"] == [0, 1, 2, 3, 4, 5]
    assert by[noisy]["arm_order"] == {
        str(seed): ["spo", "spopp"] if seed % 2 == 0 else ["spopp", "spo"] for seed in range(6)
    }
    d = by[noisy]["diffs"]["spopp-spo"]
    # Areas: spo 0.15, spopp 0.15 + step / 2 ... in points: 100 * step / 2 + ... -> 0, 5, 10, 5, 5, 5.
    assert d["per_seed"] == pytest.approx([0.0, 7.5, 15.0, 7.5, 7.5, 7.5])
    assert d["se"] == pytest.approx(math.sqrt(sum((x - 7.5) ** 2 for x in d["per_seed"]) / 5) / math.sqrt(6))
    assert result["largest_se"] == pytest.approx(d["se"])
    # A resume with more budget finishes nothing twice, keeps the added seeds and adds the next.
    ran.clear()
    code = run_map(base, [-1.0, 1.0], [0.0], ["spo", "spopp"], [0, 1, 2], tmp_path, echo=lines.append,
                   target_se=1.5, budget_s=None, runner=_fake_runner(curves, ran))  # fmt: skip
    assert code == 0 and ran and all(c == noisy for c, _r in ran)
    assert read_extra(tmp_path)[noisy][:4] == [3, 4, 5, 6]
    final = {c["cell"]: c for c in json.loads((tmp_path / "map.json").read_text())["cells"]}
    assert final[noisy]["diffs"]["spopp-spo"]["se"] <= 1.5 < d["se"]


@pytest.mark.parametrize(
    "content,message",
    [("{not json", "is not JSON"), ('{"coupling+1-latency0": ["3"]}', "should map each cell to a list of seeds"),
     ('{"coupling+7-latency0": [3]}', "cells not in this grid: coupling+7-latency0")],
)  # fmt: skip
def test_a_bad_seed_file_is_refused_by_name_and_left_as_it_was(tmp_path, content, message):
    from services.launch.config import LaunchSettings
    from services.launch.map import run_map

    (tmp_path / "extra-seeds.json").write_text(content)
    base = LaunchSettings.model_validate({"model": "m", "tasks": "t.jsonl", "env": "toy-calc"})
    ran: list = []
    with pytest.raises(ValueError, match=re.escape(message)):
        run_map(base, [1.0], [0.0], ["spo", "spopp"], [0], tmp_path, echo=lambda _l: None, target_se=1.5,
                runner=_fake_runner({}, ran))  # fmt: skip
    assert ran == [] and (tmp_path / "extra-seeds.json").read_text() == content


# -- counterbalanced arm order, recorded environment options ---------------------------------------
def test_each_seed_runs_the_arms_rotated_by_its_place():
    from services.launch.config import LaunchSettings
    from services.launch.map import arm_order, plan_runs

    arms = ["spo", "spopp-trajnorm", "spopp"]
    assert [arm_order(arms, i) for i in range(4)] == [
        ["spo", "spopp-trajnorm", "spopp"],
        ["spopp-trajnorm", "spopp", "spo"],
        ["spopp", "spo", "spopp-trajnorm"],
        ["spo", "spopp-trajnorm", "spopp"],
    ]
    base = LaunchSettings.model_validate({"model": "m", "tasks": "t.jsonl", "env": "toy-calc", "updates": 2})
    runs = plan_runs(base, [0.0], [0.0], arms, [5, 6, 7], Path("out"), {cell_name(0.0, 0.0): [8]})
    assert [s.run for _c, s in runs] == [
        "spo-s5", "spopp-trajnorm-s5", "spopp-s5",
        "spopp-trajnorm-s6", "spopp-s6", "spo-s6",
        "spopp-s7", "spo-s7", "spopp-trajnorm-s7",
        "spo-s8", "spopp-trajnorm-s8", "spopp-s8",
    ]  # fmt: skip


def test_the_map_records_every_environment_option_and_the_arm_order(tmp_path):
    """map.json's cell has the env_options its runs had (run.json's, defaults included; for a run
    written before, its identity's with the defaults filled in) and each seed's arm order; map.md
    and the figure say the options; runs that disagree are a warning."""
    from runtime.envs import resolved_env_options
    from services.launch.map import options_line

    cell = cell_name(1.0, 0.5)
    given = {"coupling": 1.0, "latency_sigma": 0.5, "time_neutral": True}
    for arm in ("spo", "spopp"):
        for seed in (0, 1):
            write_run(tmp_path, cell, arm, seed, [0, 0.1], corr=0.0, late=0)
            path = tmp_path / "cells" / cell / "runs" / f"{arm}-s{seed}" / "run.json"
            record = json.loads(path.read_text())
            if arm == "spo":  # as the launcher writes it now
                record.update(env="toy-calc", env_options=resolved_env_options("toy-calc", given))
            else:  # as an earlier launcher wrote it: the identity's options only
                record["identity"] = {"env": "toy-calc", "env_options": given}
            path.write_text(json.dumps(record))
    result = summarize(tmp_path, [1.0], [0.5], ["spo", "spopp"], [0, 1])
    [c] = result["cells"]
    assert c["env_options"] == {
        "coupling": 1.0, "describe_tool": False, "extra_turns": 3, "latency_median_s": 0.02, "latency_sigma": 0.5,
        "max_tool_calls": 2, "shots": 0, "system_prompt": None, "time_neutral": True,
    }  # fmt: skip
    assert c["arm_order"] == {"0": ["spo", "spopp"], "1": ["spopp", "spo"]} and c["warnings"] == []
    line = options_line(result)
    assert line is not None and "time_neutral=true" in line and "extra_turns=3" in line
    assert "coupling=" not in line and "latency_sigma=" not in line  # the cell's own columns
    md = markdown(result)
    assert f"besides its coupling and latency σ: {line}." in md
    assert "seed 0: spo → spopp; seed 1: spopp → spo." in md
    write(tmp_path / "out", result)
    saved = json.loads((tmp_path / "out" / "map.json").read_text())["cells"][0]
    assert saved["env_options"]["time_neutral"] is True and saved["arm_order"]["1"] == ["spopp", "spo"]
    # One run with another option: no common options for the cell, and a warning that says so.
    path = tmp_path / "cells" / cell / "runs" / "spo-s1" / "run.json"
    record = json.loads(path.read_text())
    record["env_options"] = {**record["env_options"], "time_neutral": False}
    path.write_text(json.dumps(record))
    [c] = summarize(tmp_path, [1.0], [0.5], ["spo", "spopp"], [0, 1])["cells"]
    assert c["env_options"] is None and any("different env_options" in w for w in c["warnings"])
