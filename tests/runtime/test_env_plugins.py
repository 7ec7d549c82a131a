"""Environments as plug-ins (runtime/envs/registry.py): a user's package, outside the repository,
named by import path or by the entry point it registers; the single-turn reward function run out
of process (runtime/envs/single_turn.py); what each bad spec gets at start-up."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from runtime.envs import EnvSpecError, env_factory, installed, resolved_env_options
from runtime.envs.base import Task
from runtime.envs.registry import check_spec

BUILT_IN = {"math-tir", "toy-calc", "alfworld", "single-turn", "agent"}

GUESS = '''
from runtime.envs.base import Environment, StepResult

class Guess(Environment):
    """Guess the task's answer in at most `tries` turns; reward 1 for a right guess."""

    name = "guess"

    def __init__(self, *, tries: int = 2):
        if tries < 1:
            raise ValueError(f"tries must be >= 1, got {tries}")
        self.tries = tries

    def reset(self, task):
        self.task, self.left = task, self.tries
        return [{"role": "user", "content": task.prompt}]

    def step(self, action):
        self.left -= 1
        if action.strip() == self.task.answer:
            return StepResult([], done=True, reward=1.0)
        if self.left == 0:
            return StepResult([], done=True, reward=0.0)
        return StepResult([{"role": "user", "content": "no, again"}], done=False)
'''

REWARDS = """
import time

def exact(answer_text, task):
    return float(answer_text.strip() == task.answer)

def by_meta(answer_text, task):
    return task.meta["weight"] * (answer_text == task.answer)

def sleeps(answer_text, task):
    time.sleep(60)
    return 1.0

def raises(answer_text, task):
    raise RuntimeError("the scorer broke")

def too_big(answer_text, task):
    return 2.0

def nan(answer_text, task):
    return float("nan")

def text(answer_text, task):
    return "1"

def one_argument(answer_text):
    return 1.0

def prints_a_reply(answer_text, task):
    print('{"id": 1, "value": 1.0}')
    return 0.0
"""


@pytest.fixture
def userpkg(tmp_path, monkeypatch) -> Path:
    """A package `guesspkg` in a temporary folder, on the path, that registers `guess` as an entry
    point of `spopp.environments` (a .dist-info beside it, as pip would install it)."""
    root = tmp_path / "site"
    pkg = root / "guesspkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "envs.py").write_text(textwrap.dedent(GUESS))
    (pkg / "rewards.py").write_text(textwrap.dedent(REWARDS))
    (pkg / "broken.py").write_text("import not_a_module_anywhere\n")
    info = root / "guesspkg-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: guesspkg\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[spopp.environments]\nguess = guesspkg.envs:Guess\nexact = guesspkg.rewards:exact\n"
    )
    monkeypatch.syspath_prepend(str(root))
    yield root
    for name in [m for m in sys.modules if m == "guesspkg" or m.startswith("guesspkg.")]:
        del sys.modules[name]


def test_the_built_ins_are_registered_like_any_plugin():
    assert BUILT_IN <= set(installed())
    assert type(env_factory("toy-calc")()).__name__ == "ToyCalcEnv"


def test_a_users_environment_by_import_path_and_by_entry_point(userpkg):
    assert "guess" in installed()
    for spec in ("guesspkg.envs:Guess", "guess"):
        env = env_factory(spec, {"tries": 1})()
        assert env.reset(Task("t", "say 7", "7")) == [{"role": "user", "content": "say 7"}]
        r = env.step("7")
        assert (r.done, r.reward) == (True, 1.0)
    assert resolved_env_options("guess") == {"tries": 2}


@pytest.mark.parametrize(
    "spec, options, expect",
    [
        ("nothing-here", {}, "unknown environment 'nothing-here'; installed: agent, alfworld"),
        ("nopkg.envs:Guess", {}, "no module named 'nopkg'"),
        ("guesspkg.envs:Nope", {}, "module guesspkg.envs has no attribute 'Nope'"),
        (
            "guesspkg.broken:X",
            {},
            "importing guesspkg.broken failed: No module named 'not_a_module_anywhere'",
        ),
        ("guesspkg.envs:StepResult", {}, "is a class but not a runtime.envs.base.Environment"),
        ("guesspkg.rewards:time", {}, "names a module, not an Environment class"),
        ("guesspkg.envs:Guess", {"tries": 0}, "environment guesspkg.envs:Guess: tries must be >= 1"),
        ("guesspkg.envs:Guess", {"colour": "red"}, "bad env_options {'colour': 'red'}"),
        ("guesspkg.rewards:one_argument", {}, "must take two arguments (answer_text, task)"),
        ("guesspkg.rewards:exact", {"reward_timeout_s": 0}, "reward_timeout_s must be in (0, 600]"),
        ("single-turn", {}, "bad env_options"),
        (
            "single-turn",
            {"reward": "nopkg:f"},
            "environment single-turn: reward nopkg:f: no module named 'nopkg'",
        ),
        ("agent", {"agent": "guesspkg.rewards:exact"}, "must be an async function"),
    ],
)
def test_a_bad_spec_fails_at_start_up_naming_what_is_wrong(userpkg, spec, options, expect):
    with pytest.raises(EnvSpecError) as e:
        env_factory(spec, options)
    assert expect in str(e.value)


@pytest.mark.parametrize("spec", ["", "two words", "a:b:c", "pkg.mod:", ":Cls", "-lead", "pkg/mod:Cls"])
def test_a_spec_of_the_wrong_shape_is_refused_without_importing(spec):
    with pytest.raises(EnvSpecError, match="expected a registered name"):
        check_spec(spec)


def test_settings_take_any_spec_and_refuse_a_malformed_one():
    from pydantic import ValidationError

    from services.config.launch import LaunchSettings

    ok = LaunchSettings(model="m", tasks="t.jsonl", env="mypkg.envs:Guess")
    assert ok.env == "mypkg.envs:Guess"
    with pytest.raises(ValidationError, match="expected a registered name"):
        LaunchSettings(model="m", tasks="t.jsonl", env="my pkg")


# -- single-turn tasks with a reward function ---------------------------------------------------------
TASK = Task("t1", "What is 6*7?", "42", meta={"weight": 0.5})


def _score(spec: str, answer: str, **options):
    env = env_factory(spec, options)()
    assert env.reset(TASK)[-1] == {"role": "user", "content": TASK.prompt}
    return env.step(answer)


@pytest.mark.process  # the reward runs in a worker process
def test_a_reward_function_scores_the_answer_out_of_process(userpkg):
    r = _score("guesspkg.rewards:exact", "42")
    assert (r.done, r.reward, r.messages) == (True, 1.0, [])
    assert "answer_check" not in r.info
    assert _score("exact", "41").reward == 0.0  # by its entry point
    assert _score("guesspkg.rewards:by_meta", "42").reward == 0.5  # the task's meta reaches it
    env = env_factory("single-turn", {"reward": "guesspkg.rewards:exact", "system_prompt": "Be brief."})()
    assert env.reset(TASK)[0] == {"role": "system", "content": "Be brief."}


@pytest.mark.process
@pytest.mark.parametrize(
    "fn, reason",
    [
        ("raises", "error"),
        ("too_big", "out_of_range"),
        ("nan", "not_finite"),
        ("text", "not_a_number"),  # "1": a string, not a number
        ("prints_a_reply", None),  # what it prints is not read as its reply: its 0.0 stands
    ],
)
def test_a_bad_reward_scores_zero_with_its_reason(userpkg, fn, reason):
    r = _score(f"guesspkg.rewards:{fn}", "42")
    assert (r.done, r.reward) == (True, 0.0)
    assert r.info.get("answer_check") == reason, r.info


@pytest.mark.process
def test_a_reward_that_does_not_return_is_killed_at_its_limit(userpkg):
    import time

    t0 = time.monotonic()
    r = _score("guesspkg.rewards:sleeps", "42", reward_timeout_s=1.0)
    # 1 s limit, plus the 0.2 s wait for the killed worker and scheduling slack on a loaded machine.
    assert time.monotonic() - t0 < 10
    assert (r.reward, r.info["answer_check"]) == (0.0, "timeout")


# -- spopp env check ----------------------------------------------------------------------------------
BROKEN = '''
import random
from runtime.envs.base import Environment, StepResult

class Broken(Environment):
    """Each fault spopp env check looks for, chosen by `fault`."""

    stop = (" ", "\\n", ".")  # a turn of the tiny model ends within a few tokens

    def __init__(self, *, fault: str = "none"):
        self.fault = fault

    def reset(self, task):
        self.turns = 0
        return [{"role": "user", "content": task.prompt}]

    def step(self, action):
        self.turns += 1
        if self.fault == "raises":
            raise ZeroDivisionError("the environment's own bug")
        if self.fault == "endless":
            return StepResult([{"role": "user", "content": "go on"}], done=False)
        if self.fault == "reward":
            return StepResult([], done=True, reward=5.0)
        if self.fault == "random":  # the module's random, not the episode's seeded self.rng
            return StepResult([], done=True, reward=random.random())
        return StepResult([], done=True, reward=float(self.rng.random() < 0.5))
'''


@pytest.fixture
def brokenpkg(userpkg) -> Path:
    (userpkg / "guesspkg" / "broken_env.py").write_text(textwrap.dedent(BROKEN))
    return userpkg


def _check(engine_model, spec, options, episodes=3):
    from runtime.envs.check import probe_tasks, run_check
    from runtime.episode import Budget

    return run_check(spec, options, engine_model, probe_tasks(3), episodes, Budget(3, 32, 512), seed=0)


@pytest.mark.parametrize(
    "fault, row, says",
    [
        ("none", None, ""),
        ("raises", "exceptions", "ZeroDivisionError: the environment's own bug"),
        ("endless", "ends", "3 episodes hit max_turns=3"),
        ("reward", "rewards", "3 checks failed: out_of_range"),
        ("random", "deterministic", "two plays with one seed differ"),
    ],
)
def test_env_check_names_each_fault(tiny_model, brokenpkg, fault, row, says):
    report = _check(tiny_model, "guesspkg.broken_env:Broken", {"fault": fault})
    failed = {f.check: f.detail for f in report.findings if not f.ok}
    if row is None:
        assert report.ok, report.table()
        return
    assert list(failed) == [row], report.table()
    assert says in failed[row]


@pytest.mark.process
def test_spopp_env_check_exits_zero_only_when_the_contract_holds(tiny_model, brokenpkg, model_cache_env):
    import os
    import subprocess

    env = {**os.environ, **model_cache_env,
           "PYTHONPATH": f"{brokenpkg}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}  # fmt: skip
    args = ["--model", str(tiny_model), "--episodes", "2", "--max-turns", "3", "--max-tokens-per-turn", "32"]
    good = subprocess.run([sys.executable, "-m", "services.cli", "env", "check", "guess", *args],
                          capture_output=True, text=True, timeout=240, env=env)  # fmt: skip
    assert good.returncode == 0, good.stdout + good.stderr
    assert "environment guess: the contract holds" in good.stdout
    # No --model: the tiny test model, from the model cache (the session's, as model_cache_env says).
    bad = subprocess.run(
        [sys.executable, "-m", "services.cli", "env", "check", "guesspkg.broken_env:Broken", *args[2:],
         "--env-options", '{"fault": "reward"}'],
        capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert bad.returncode == 1
    assert "rewards" in bad.stdout and "FAIL" in bad.stdout and "out_of_range" in bad.stdout
