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
from services.learner.update import length_advantage_corr
from services.study.map import cell_name, summarize
from services.study.render import markdown, write

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


FOUR = ["spo", "spo-eventtime", "spopp-trajnorm", "spopp"]


def by_cell(seeds: list[int], *cells: str) -> dict[str, list[int]]:
    return {cell: seeds for cell in cells}


def test_the_chain_pairs_each_arm_with_the_one_before_it_and_names_the_change():
    from services.study.summary import pairs
    from spopp.compare.arms import step_label

    assert pairs(FOUR) == [("spo-eventtime", "spo"), ("spopp-trajnorm", "spo-eventtime"),
                           ("spopp", "spopp-trajnorm"), ("spopp", "spo")]  # fmt: skip
    assert pairs(["spopp", "spo"]) == [("spopp", "spo")]  # the one step is the total: not twice
    assert pairs(["spo", "spopp-trajnorm", "spopp"]) == [
        ("spopp-trajnorm", "spo"), ("spopp", "spopp-trajnorm"), ("spopp", "spo")
    ]  # fmt: skip
    assert step_label("spo-eventtime", "spo") == "+ event-time evidence"
    assert step_label("spopp-trajnorm", "spo-eventtime") == "+ Dual-Clip 2"
    assert step_label("spopp", "spopp-trajnorm") == "+ action-token measure"
    assert step_label("spopp-trajnorm", "spo") == "+ event-time evidence + Dual-Clip 2"
    assert step_label("spopp", "spo") == "SPO++ − SPO"


def test_the_sign_test_and_the_t_quantile_by_hand():
    from spopp.compare.stats import sign_test, t_quantile

    # Two-sided exact: 2 * P(X <= min(won, lost)), X ~ Binomial(won + lost, 1/2).
    assert sign_test(3, 0) == pytest.approx(2 / 8)
    assert sign_test(6, 0) == pytest.approx(2 / 64)  # the 6-of-6 columns of the first map: p = 0.03
    assert sign_test(5, 1) == pytest.approx(2 * 7 / 64)
    assert sign_test(1, 1) == 1.0 and sign_test(0, 0) == 1.0
    # Student's t with 2 degrees of freedom has the closed form (2p - 1) / sqrt(2p(1 - p)).
    assert t_quantile(0.975, 2) == pytest.approx(0.95 / math.sqrt(2 * 0.975 * 0.025), rel=1e-12)
    assert t_quantile(0.975, 1) == pytest.approx(math.tan(math.pi * 0.475), rel=1e-12)  # Cauchy


def test_summary_of_four_arms_with_t_intervals_and_sign_tests_by_hand(tmp_path):
    cell = cell_name(-1.0, 1.5)
    assert cell == "coupling-1-latency1.5"
    # Curves [0, a, a]: trapezoid area (a + a/2) / 2 = 0.75 a. Areas per seed 0, 1, 2:
    # spo .15 .15 .15; spo-eventtime .15 .18 .12; spopp-trajnorm .18 .18 .18; spopp .21 .21 .21.
    heights = {
        "spo": [0.2] * 3,
        "spo-eventtime": [0.2, 0.24, 0.16],
        "spopp-trajnorm": [0.24] * 3,
        "spopp": [0.28] * 3,
    }
    for arm, hs in heights.items():
        for seed, h in enumerate(hs):
            write_run(
                tmp_path,
                cell,
                arm,
                seed,
                [0, h, h],
                corr=-0.4 if arm == "spo" else -0.2,
                late=10 * (seed + 1),
            )
    result = summarize(tmp_path, [-1.0], [1.5], FOUR, by_cell([0, 1, 2], cell))
    [c] = result["cells"]
    assert c["points"] == 3 and c["arms"]["spo-eventtime"]["area"] == pytest.approx(0.15)
    assert c["arms"]["spo-eventtime"]["per_seed"] == pytest.approx({"0": 0.15, "1": 0.18, "2": 0.12})
    t2 = 0.95 / math.sqrt(2 * 0.975 * 0.025)  # t quantile, 2 degrees of freedom
    event = c["diffs"]["spo-eventtime vs spo"]  # 0, +3, -3 points
    assert event["label"] == "+ event-time evidence" and event["per_seed"] == pytest.approx([0.0, 3.0, -3.0])
    assert event["mean"] == pytest.approx(0.0) and event["sd"] == pytest.approx(3.0)
    assert event["se"] == pytest.approx(math.sqrt(3.0)) and event["df"] == 2
    assert (event["lo"], event["hi"]) == pytest.approx((-t2 * math.sqrt(3.0), t2 * math.sqrt(3.0)))
    assert (event["won"], event["lost"], event["tied"]) == (1, 1, 1) and event["sign_p"] == 1.0
    clip = c["diffs"]["spopp-trajnorm vs spo-eventtime"]  # +3, 0, +6
    assert clip["label"] == "+ Dual-Clip 2" and clip["mean"] == pytest.approx(3.0)
    assert (clip["won"], clip["tied"]) == (2, 1) and clip["sign_p"] == pytest.approx(0.5)
    token = c["diffs"]["spopp vs spopp-trajnorm"]  # +3 on every seed: s.e. 0, interval [3, 3]
    assert token["se"] == pytest.approx(0.0, abs=1e-12) and token["lo"] == pytest.approx(3.0)
    total = c["diffs"]["spopp vs spo"]  # +6 on every seed
    assert total["label"] == "SPO++ − SPO" and total["mean"] == pytest.approx(6.0)
    assert total["won"] == 3 and total["sign_p"] == pytest.approx(0.25)
    # Measured: the correlation averaged over every run's updates, late = late / outcomes.
    assert c["measured"]["length_advantage_corr"] == pytest.approx((3 * -0.4 + 9 * -0.2) / 12)
    assert c["measured"]["late_fraction"] == pytest.approx(0.2)  # 10, 20 and 30 of 100 in every arm
    assert c["measured"]["overtaken_fraction"] == pytest.approx(0.4)
    assert c["measured"]["reorder_distance"] == pytest.approx(1.0)
    assert c["measured"]["batch_reward"] == pytest.approx(0.25)  # updates' 0.2 and 0.3 in every run
    assert c["start"] == 0.0 and c["seeds"] == [0, 1, 2]
    assert result["largest_se"] == pytest.approx(0.0, abs=1e-12)  # SPO++ − SPO's
    md = markdown(result)
    assert "| -1 | 1.5 | 3 | 0–2 | 0.150 | 0.210 | +6.0 ± 0.0 | [+6.0, +6.0] | 3/3 | 0.25 |" in md
    half = t2 * math.sqrt(3.0)
    # One cell: Holm's family is that cell alone, so holm_p = t_p. Event-time's t is 0 (p 1); with 2
    # degrees of freedom P(|T| > t) = 1 - t / sqrt(2 + t^2), and Dual-Clip's t = 3 / sqrt(3) = sqrt(3).
    assert event["t_p"] == pytest.approx(1.0) and event["holm_p"] == event["t_p"]
    assert clip["t_p"] == pytest.approx(1 - math.sqrt(3 / 5)) and clip["holm_p"] == clip["t_p"]
    assert f"| -1 | 1.5 | +0.0 ± 1.7 [{-half:+.1f}, {half:+.1f}] 1/3; p 1.00, Holm 1.00 | +3.0 ± 1.7 " in md
    assert "± is one standard error (s.e.)" in md and "95 % t interval with n − 1 degrees of freedom" in md
    write(tmp_path / "out", result)
    assert json.loads((tmp_path / "out" / "map.json").read_text())["cells"][0]["cell"] == cell
    assert (tmp_path / "out" / "map.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_missing_run_names_its_folder(tmp_path):
    write_run(tmp_path, cell_name(0.0, 0.0), "spo", 0, [0.1, 0.2], corr=0.0, late=0)
    with pytest.raises(ValueError, match=r"spopp-s0.*run.json"):
        summarize(tmp_path, [0.0], [0.0], ["spo", "spopp"], by_cell([0], cell_name(0.0, 0.0)))


def test_a_cell_is_the_base_with_the_two_knobs_set_and_nothing_else():
    from services.config.launch import LaunchSettings
    from services.study.map import cell_settings, plan_runs

    base = LaunchSettings.model_validate(
        {"model": "m", "tasks": "t.jsonl", "env": "toy-calc", "env_options": {"latency_median_s": 0.1}, "max_updates": 8}
    )  # fmt: skip
    cell = cell_settings(base, -1.0, 1.5)
    assert cell.env_options == {"latency_median_s": 0.1, "coupling": -1.0, "latency_sigma": 1.5}
    assert cell.model_dump(exclude={"env_options"}) == base.model_dump(exclude={"env_options"})
    seeds = by_cell([3], "coupling-1-latency0", "coupling+0-latency0")
    runs = plan_runs(base, [-1.0, 0.0], [0.0], ["spo", "spopp"], seeds, Path("out"))
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


def test_each_arm_sets_its_one_change_and_the_run_is_named_for_it(tmp_path):
    from services.config.launch import LaunchSettings
    from services.launch.process_plan import port_requests, process_plan
    from services.study.compare import arm_settings

    base = LaunchSettings.model_validate(
        {"model": "m", "tasks": "t.jsonl", "env": "toy-calc", "max_updates": 2}
    )
    want = {  # arm: (tracker recipe, normalization, Dual-Clip)
        "spo": ("spo", "trajectory", 10.0), "spo-eventtime": ("spopp", "trajectory", 10.0),
        "spopp-trajnorm": ("spopp", "trajectory", 2.0), "spopp": ("spopp", "token", 2.0),
    }  # fmt: skip
    for arm, (recipe, norm, clip) in want.items():
        s = arm_settings(base, arm, 0, tmp_path)
        p = process_plan(s, {name: 20000 + i for i, name in enumerate(port_requests(s))})
        assert (p.run_config.recipe, p.learner.normalization, p.learner.dual_clip) == (recipe, norm, clip), (
            arm
        )
        assert p.arm() == arm


def test_the_map_command_refuses_bad_options_by_name(tmp_path):
    from click.testing import CliRunner

    from services.study.cli import map_command

    config = tmp_path / "base.yaml"
    config.write_text("model: m\ntasks: t.jsonl\nenv: toy-calc\n")
    out = ["--out", str(tmp_path / "out")]
    for args, message in (
        ([str(config), *out, "--coupling=a"], "--coupling 'a': expected numbers"),
        ([str(config), *out, "--latency=0,0"], "--latency '0,0': give distinct values"),
        (
            [str(config), *out, "--arms", "grpo"],
            "--arms: choose from spo, spo-eventtime, spopp-trajnorm, spopp",
        ),
        ([str(config), *out, "--seeds", "x"], "--seeds 'x': expected integers"),
        ([str(config), *out, "--pilot-seeds", "1,1"], "--pilot-seeds '1,1': give distinct values"),
        ([str(config), *out, "--seeds", "0", "--pilot-seeds", "9,10"], "not both"),
        ([str(config), "--render", str(tmp_path)], "give no CONFIG or --out"),
        ([str(config)], "give CONFIG and --out"),
    ):
        r = CliRunner().invoke(map_command, args)
        assert r.exit_code == 2 and message in r.output, (args, r.output)
        assert not (tmp_path / "out").exists()
    r = CliRunner().invoke(map_command, ["--render", str(tmp_path)])
    assert r.exit_code == 1 and "no map.json to render" in r.output


# -- the protocol: n per cell fixed from a pilot before the main runs -------------------------------
def test_n_per_cell_from_the_pilot_and_the_budget_by_hand():
    from services.study.protocol import fit, wanted

    # (s.d. / 1.5)^2 seeds: s.d. 3 -> 4; 1 -> 0.44, raised to the least, 3; 6 -> 16.
    assert wanted(3.0, 1.5, 3) == 4 and wanted(1.0, 1.5, 3) == 3 and wanted(6.0, 1.5, 3) == 16
    assert wanted(0.0, 1.5, 3) == 3
    with pytest.raises(ValueError, match="two seeds or more"):
        wanted(None, 1.5, 3)
    want = {"a": 16, "b": 4, "c": 3}
    assert fit(want, math.inf, 3) == want and fit(want, 23, 3) == want
    # 12 seeds: the cap c = 5 fits (5 + 4 + 3 = 12), 6 would not (13).
    assert fit(want, 12, 3) == {"a": 5, "b": 4, "c": 3}
    # Under n_min per cell: every cell still gets n_min (the map says it is over the budget).
    assert fit(want, 8, 3) == {"a": 3, "b": 3, "c": 3}
    # What the common cap leaves goes a seed at a time to the capped cells wanting most, then by name.
    assert fit({"a": 16, "b": 16, "c": 3}, 12, 3) == {"a": 5, "b": 4, "c": 3}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _fake_runner(curves: dict, ran: list, clock: Clock | None = None, seen: list | None = None):
    """Stands in for compare.run_in_turn (launching is what tests/tools/test_map_run.py runs for real):
    each planned run's folder gets the curve `curves[(cell, arm, seed)]`, a run of 60 s on `clock`;
    `seen` gets, per call, whether protocol.json existed when the runs started."""

    def runner(planned, echo, what):
        if seen is not None and planned:
            root = planned[0][1].run_dir.parents[3]
            seen.append((what, root.name, (root / "protocol.json").exists()))
        for cell, s in planned:
            if (s.run_dir / "run.json").exists():
                continue
            arm, seed = s.run.rsplit("-s", 1)
            write_run(
                s.run_dir.parents[3], cell, arm, int(seed), curves[(cell, arm, int(seed))], corr=0.0, late=0
            )
            record = json.loads((s.run_dir / "run.json").read_text())
            record.update(started=1000.0, finished=1060.0)
            (s.run_dir / "run.json").write_text(json.dumps(record))
            ran.append((what, cell, s.run))
            if clock is not None:
                clock.now += 60.0
        return [], 0

    return runner


def _two_cells():
    """A quiet cell (SPO++ − SPO 7.5 points on every seed: s.d. 0) and a noisy one (0, 15, 7.5,
    ...: pilot s.d. 10.6 on seeds 1000, 1001), curves [0, h, h] with area 0.75 h."""
    quiet, noisy = cell_name(-1.0, 0.0), cell_name(1.0, 0.0)
    curves = {}
    for seed in [*range(20), 1000, 1001]:
        curves[(quiet, "spo", seed)], curves[(quiet, "spopp", seed)] = [0, 0.2, 0.2], [0, 0.3, 0.3]
        gap = {1000: 0.0, 1001: 0.2}.get(seed, 0.1)
        curves[(noisy, "spo", seed)], curves[(noisy, "spopp", seed)] = (
            [0, 0.2, 0.2],
            [0, 0.2 + gap, 0.2 + gap],
        )
        for cell in (quiet, noisy):
            curves[(cell, "spo-eventtime", seed)] = [0, 0.25, 0.25]
    return quiet, noisy, curves


THREE = ["spo", "spo-eventtime", "spopp"]


def test_the_pilot_fixes_n_per_cell_before_the_main_runs_and_a_resume_keeps_it(tmp_path):
    from services.config.launch import LaunchSettings
    from services.study.map import run_map

    base = LaunchSettings.model_validate(
        {"model": "m", "tasks": "t.jsonl", "env": "toy-calc", "max_updates": 2}
    )
    quiet, noisy, curves = _two_cells()
    ran, seen, lines = [], [], []
    clock = Clock()
    # Pilot: SPO and SPO++ only, 2 cells x 2 arms x 2 seeds = 8 runs of 60 s. Noisy pilot
    # differences 0 and 15: s.d. 10.61, wanted ceil((10.61 / 1.5)^2) = 50 seeds; quiet: s.d. 0,
    # wanted n_min = 3. A budget of 8 runs + 11 x 3 (a main seed of a cell runs the 3 arms, 60 s
    # each) and 30 s pays for 11 main seeds: quiet 3, noisy 8.
    code = run_map(base, [-1.0, 1.0], [0.0], THREE, tmp_path, pilot_seeds=[1000, 1001], budget_s=(8 + 33) * 60 + 30,
                   echo=lines.append, runner=_fake_runner(curves, ran, clock, seen), clock=clock)  # fmt: skip
    assert code == 0
    # The pilot ran into pilot/ with no protocol yet; the main runs started with it written.
    assert seen == [("map pilot", "pilot", False), ("map", tmp_path.name, True)]
    assert sorted({r for w, _c, r in ran if w == "map pilot"}) == [
        "spo-s1000",
        "spo-s1001",
        "spopp-s1000",
        "spopp-s1001",
    ]
    protocol = json.loads((tmp_path / "protocol.json").read_text())
    assert protocol["rule"] == "pilot" and protocol["pilot_seeds"] == [1000, 1001]
    assert protocol["pilot_sd"][noisy] == pytest.approx(15 / math.sqrt(2))  # differences 0 and 15
    # (10.61 / 1.5)^2 = 112.5 / 2.25 = 50, exactly (not 51 from the float's last bit).
    assert protocol["wanted"] == {quiet: 3, noisy: 50}
    assert protocol["seeds"] == {quiet: [0, 1, 2], noisy: list(range(8))} and protocol["capped"] == [noisy]
    assert protocol["run_seconds"] == 60.0 and protocol["capacity_seeds"] == 11
    assert any(f"{noisy}: n = 8 (pilot s.d. " in line and "capped by the budget" in line for line in lines), (
        lines
    )
    # The i-th main seed of a cell runs the arms rotated by i.
    assert [r for w, c, r in ran if w == "map" and c == quiet] == [
        "spo-s0", "spo-eventtime-s0", "spopp-s0", "spo-eventtime-s1", "spopp-s1", "spo-s1",
        "spopp-s2", "spo-s2", "spo-eventtime-s2",
    ]  # fmt: skip
    result = json.loads((tmp_path / "map.json").read_text())
    by = {c["cell"]: c for c in result["cells"]}
    assert by[noisy]["seeds"] == list(range(8)) and by[noisy]["diffs"]["spopp vs spo"]["n"] == 8
    assert by[noisy]["diffs"]["spopp vs spo"]["per_seed"] == pytest.approx([7.5] * 8)
    assert result["protocol"]["seeds"] == protocol["seeds"] and result["pilot"]["cells"][1]["seeds"] == [
        1000,
        1001,
    ]
    assert result["times"]["main"]["runs"] == 33 and result["times"]["pilot"]["runs"] == 8
    assert result["pilot"]["arms"] == ["spo", "spopp"] and result["arms"] == THREE
    assert result["machine"]["cpus"] >= 1
    md = (tmp_path / "map.md").read_text()
    assert (
        "a pilot on seeds 1000, 1001 (never reused)" in md and f"could not pay for the aim in {noisy}" in md
    )
    assert "| +1 | 0 | 8 (wanted " in md
    # A resume (even with no budget now) reads the protocol back: nothing runs, nothing changes.
    ran.clear()
    code = run_map(base, [-1.0, 1.0], [0.0], THREE, tmp_path, pilot_seeds=[1000, 1001], echo=lines.append,
                   runner=_fake_runner(curves, ran))  # fmt: skip
    assert code == 0 and ran == [] and json.loads((tmp_path / "protocol.json").read_text()) == protocol
    # Another grid, other pilot seeds or fixed seeds: refused by name, the protocol left as it was.
    for kwargs, message in (
        ({"couplings": [-1.0], "pilot_seeds": [1000, 1001]}, "fixed the map for"),
        ({"pilot_seeds": [5, 6]}, "ran the pilot on seeds [1000, 1001], not [5, 6]"),
        ({"seeds": [0, 1, 2]}, "fixed the seeds per cell as"),
    ):
        args = {"couplings": [-1.0, 1.0], **kwargs}
        with pytest.raises(ValueError, match=re.escape(message)):
            run_map(base, args.pop("couplings"), [0.0], THREE, tmp_path, echo=lines.append,
                    runner=_fake_runner(curves, ran), **args)  # fmt: skip
    assert ran == [] and json.loads((tmp_path / "protocol.json").read_text()) == protocol


@pytest.mark.parametrize(
    "kwargs,message",
    [({"pilot_seeds": [1000]}, "two seeds or more"), ({"pilot_seeds": [0, 1]}, "main seeds [0, 1] are also pilot seeds"),
     ({"pilot_seeds": [7, 8], "arms": ["spo", "spo-eventtime"]}, "the arms need spo and spopp"),
     ({"pilot_seeds": [7, 8], "seeds": [0]}, "not both")],
)  # fmt: skip
def test_a_pilot_that_cannot_size_the_cells_is_refused(tmp_path, kwargs, message):
    from services.config.launch import LaunchSettings
    from services.study.map import run_map

    base = LaunchSettings.model_validate(
        {"model": "m", "tasks": "t.jsonl", "env": "toy-calc", "max_updates": 2}
    )
    _quiet, _noisy, curves = _two_cells()
    curves |= {(c, a, s): [0, 0.2, 0.2] for c, a, s in list(curves) for s in (7, 8)}
    arms = kwargs.pop("arms", ["spo", "spopp"])
    with pytest.raises(ValueError, match=re.escape(message)):
        run_map(
            base,
            [-1.0, 1.0],
            [0.0],
            arms,
            tmp_path,
            echo=lambda _l: None,
            runner=_fake_runner(curves, []),
            **kwargs,
        )
    assert not (tmp_path / "protocol.json").exists()


@pytest.mark.parametrize(
    "content,message", [("{not json", "is not JSON"), ('{"rule": "pilot"}', "is not a map protocol")]
)
def test_a_bad_protocol_file_is_refused_by_name_and_left_as_it_was(tmp_path, content, message):
    from services.config.launch import LaunchSettings
    from services.study.map import run_map

    (tmp_path / "protocol.json").write_text(content)
    base = LaunchSettings.model_validate({"model": "m", "tasks": "t.jsonl", "env": "toy-calc"})
    ran: list = []
    with pytest.raises(ValueError, match=re.escape(message)):
        run_map(
            base,
            [1.0],
            [0.0],
            ["spo", "spopp"],
            tmp_path,
            seeds=[0],
            echo=lambda _l: None,
            runner=_fake_runner({}, ran),
        )
    assert ran == [] and (tmp_path / "protocol.json").read_text() == content


# -- counterbalanced arm order, recorded environment options ---------------------------------------
def test_each_seed_runs_the_arms_rotated_by_its_place():
    from services.config.launch import LaunchSettings
    from services.study.map import arm_order, plan_runs

    arms = ["spo", "spopp-trajnorm", "spopp"]
    assert [arm_order(arms, i) for i in range(4)] == [
        ["spo", "spopp-trajnorm", "spopp"],
        ["spopp-trajnorm", "spopp", "spo"],
        ["spopp", "spo", "spopp-trajnorm"],
        ["spo", "spopp-trajnorm", "spopp"],
    ]
    base = LaunchSettings.model_validate(
        {"model": "m", "tasks": "t.jsonl", "env": "toy-calc", "max_updates": 2}
    )
    runs = plan_runs(base, [0.0], [0.0], arms, by_cell([5, 6, 7, 8], cell_name(0.0, 0.0)), Path("out"))
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
    from services.study.render import options_line

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
    result = summarize(tmp_path, [1.0], [0.5], ["spo", "spopp"], by_cell([0, 1], cell))
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
    [c] = summarize(tmp_path, [1.0], [0.5], ["spo", "spopp"], by_cell([0, 1], cell))["cells"]
    assert c["env_options"] is None and any("different env_options" in w for w in c["warnings"])


# -- published numbers redrawn from map.json alone --------------------------------------------------
def test_render_redraws_the_map_and_the_pages_section_from_map_json_alone(tmp_path):
    from click.testing import CliRunner

    from services.study.cli import map_command
    from services.study.render import BEGIN, END

    cell = cell_name(0.0, 0.0)
    for arm in ("spo", "spopp"):
        for seed in (0, 1):
            write_run(
                tmp_path, cell, arm, seed, [0, 0.1 + 0.1 * (arm == "spopp") + 0.05 * seed], corr=0.0, late=0
            )
    result = summarize(tmp_path, [0.0], [0.0], ["spo", "spopp"], by_cell([0, 1], cell))
    folder = tmp_path / "published"
    write(folder, result)
    drawn = (folder / "map.md").read_text()
    (folder / "map.md").write_text("edited by hand\n")
    page = tmp_path / "results.md"
    page.write_text(f"# Results\n\nbefore\n\n{BEGIN}\nold table\n{END}\n\nafter\n")
    r = CliRunner().invoke(map_command, ["--render", str(folder), "--page", str(page)])
    assert r.exit_code == 0, r.output
    assert (folder / "map.md").read_text() == drawn  # the hand edit is gone: map.json decides
    text = page.read_text()
    assert text.startswith("# Results\n\nbefore\n\n" + BEGIN + "\n") and text.endswith(END + "\n\nafter\n")
    assert "old table" not in text and drawn.split("\n\n", 1)[1] in text  # map.md's body, title aside
    # A page without its section is refused and left as it was.
    page.write_text("no markers\n")
    r = CliRunner().invoke(map_command, ["--render", str(folder), "--page", str(page)])
    assert r.exit_code == 1 and "needs one map section" in r.output and page.read_text() == "no markers\n"


def test_the_arms_of_a_comparison_share_a_study_and_the_evaluator_follows_the_run_seed(tmp_path):
    """Common random numbers (spopp.compare.streams): every arm of a comparison runs in one study (its
    folder's name: a map cell's, an ablation's), which the tracker run carries; two cells are two
    studies; a study in the base config wins; the evaluator's seed is left to the run's."""
    from services.config.launch import LaunchSettings
    from services.launch.process_plan import port_requests, process_plan
    from services.study.compare import arm_settings
    from spopp.settings.base import SettingsError

    base = LaunchSettings.model_validate(
        {"model": "m", "tasks": "t.jsonl", "heldout": "h.jsonl", "env": "toy-calc", "max_updates": 2}
    )
    cell = tmp_path / "cells" / "coupling+1-latency1.5"
    plans = []
    for arm in ("spo", "spopp"):
        s = arm_settings(base, arm, 4, cell)
        plans.append(process_plan(s, {name: 20000 + i for i, name in enumerate(port_requests(s))}))
    assert [p.run_config.study for p in plans] == ["coupling+1-latency1.5"] * 2
    assert plans[0].binding.run != plans[1].binding.run and {p.run_config.seed for p in plans} == {4}
    assert all(p.evaluator.seed is None for p in plans)  # the evaluator takes the run's seed
    assert (
        arm_settings(base, "spo", 4, tmp_path / "cells" / "coupling-1-latency0").study
        != plans[0].run_config.study
    )
    named = LaunchSettings.model_validate({**base.model_dump(), "study": "mine"})
    assert arm_settings(named, "spo", 4, cell).study == "mine"
    # A plain launch has none (its draws are keyed on its run name); the file may not set it twice.
    assert (
        process_plan(base, {n: 20000 + i for i, n in enumerate(port_requests(base))}).run_config.study is None
    )
    with pytest.raises(SettingsError, match="run_config.study is set by spopp launch"):
        bad = LaunchSettings.model_validate({**base.model_dump(), "run_config": {"study": "x"}})
        process_plan(bad, {n: 20000 + i for i, n in enumerate(port_requests(bad))})
