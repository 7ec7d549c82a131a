"""The environment contract over every built-in environment, as tests/runtime/test_engines.py runs the engine
contract over every engine.

The contract is the one `spopp env check` applies (runtime/envs/check.py: builds, template,
prompts, exceptions, rewards, ends, deterministic), called in this process through
`check_environment` with the transformers engine on the tiny model. The environments are the ones
spopp's own package registers in the entry-point group `spopp.environments` (read from the
installed metadata, and held to pyproject.toml's list below), so a new built-in is checked here
the moment it is registered: with the options and tasks of SETUPS, or else as `spopp env check
NAME` checks it (no options, a few arithmetic questions).

Where an environment starts processes, its check is in the process tier (tests/conftest.py refuses
child processes elsewhere) but still runs in this process: math-tir runs the model's code in a
bubblewrap sandbox and its answer check in a worker process; single-turn and reasoning-gym score
out of process (runtime/sandbox/check_pool.py). The others (toy-calc, agent, verifiers, alfworld with its
engine in this process: `workers: 0`) run in the default tier.
"""

from __future__ import annotations

import importlib
import logging
import re
import sys
import textwrap
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest

from runtime.envs.base import Task
from runtime.envs.check import check_environment, probe_tasks
from runtime.envs.registry import installed
from runtime.episode import Budget

ROOT = Path(__file__).resolve().parents[2]
# spopp's own registrations: the built-ins.
BUILT_INS = sorted(
    name for name, ep in installed().items() if ep.dist is not None and ep.dist.name == "spopp"
)
# Those whose episodes start processes (the sandbox, a reward or answer-check worker): the process tier.
STARTS_PROCESSES = {"math-tir", "single-turn", "reasoning-gym"}

TASKS = 2  # tasks per environment; EPISODES episodes over them, and the first replayed
EPISODES = 2
# Short turns: the tiny model's context is 1024 tokens, and the contract is about the environment.
BUDGET = Budget(max_turns=6, max_tokens_per_turn=24, max_total_tokens=1024)

# A user's plug-ins, as a folder on the path (a single-turn reward and an agent) ...
PLUGINS = textwrap.dedent("""
    def exact(answer_text, task):
        return float(answer_text.strip() == task.answer)

    async def ask_once(client, task):
        reply = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": task.prompt}]
        )
        return float((reply.choices[0].message.content or "").strip() == task.answer)
""")
# ... the same paths broken in the user's code: an agent that raises after one call, one that never
# returns, a reward function that raises, and a verifiers reward written as a plain `def` (verifiers
# awaits it) ...
BROKEN_PLUGINS = textwrap.dedent("""
    import asyncio

    async def divides(client, task):
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task.prompt}])
        return 1 / 0

    async def stalls(client, task):
        await asyncio.sleep(3600)

    def raising_reward(answer_text, task):
        return {"a": 1}[answer_text]
""")
BROKEN_TASKSET = textwrap.dedent("""
    import verifiers.v1 as vf

    class SumData(vf.TaskData):
        a: int

    class SumTask(vf.Task[SumData]):
        @vf.reward
        def correct(self, task, trace) -> float:
            return 1.0

    class PlainDefTaskset(vf.Taskset[SumTask]):
        def load(self):
            for i in range(2):
                yield SumTask(SumData(prompt=f"What is {i}+1?", a=i), self.config.task)
""")
# ... a verifiers taskset (two sums, one reward) ...
TASKSET = textwrap.dedent("""
    import verifiers.v1 as vf

    class SumData(vf.TaskData):
        a: int
        b: int

    class SumTask(vf.Task[SumData]):
        @vf.reward
        async def correct(self, task, trace) -> float:
            return float(trace.last_reply.strip() == str(task.a + task.b))

    class SumTaskset(vf.Taskset[SumTask]):
        def load(self):
            for i in range(2):
                prompt = f"What is {i}+{i + 2}?"
                yield SumTask(SumData(prompt=prompt, system_prompt="Reply with the number.", a=i, b=i + 2),
                              self.config.task)
""")
# ... and toy-calc broken in each way the contract looks for, chosen by `fault`.
BROKEN = textwrap.dedent("""
    import random

    from runtime.envs.base import StepResult
    from runtime.envs.toy_calc import ToyCalcEnv

    class BrokenCalc(ToyCalcEnv):
        def __init__(self, *, fault, **options):
            super().__init__(**options)
            self.fault = fault

        def step(self, action):
            if self.fault == "raises":
                raise ZeroDivisionError("the environment's own bug")
            if self.fault == "endless":
                return StepResult([{"role": "user", "content": "go on"}], done=False)
            result = super().step(action)
            if self.fault == "reward" and result.done:
                return StepResult(result.messages, done=True, reward=5.0, info=result.info)
            if self.fault == "random" and result.done:  # the module's random, not the episode's self.rng
                return StepResult(result.messages, done=True, reward=random.random(), info=result.info)
            return result
""")


MODULES = {
    "contract_plugins": PLUGINS,
    "contract_vf": TASKSET,
    "contract_broken": BROKEN,
    "contract_broken_plugins": BROKEN_PLUGINS,
    "contract_broken_vf": BROKEN_TASKSET,
}


@pytest.fixture(scope="module")
def plugins(tmp_path_factory):
    """The folder of the modules above, on the path (the reward workers inherit it)."""
    folder = tmp_path_factory.mktemp("contract-plugins")
    for name, text in MODULES.items():
        (folder / f"{name}.py").write_text(text)
    sys.path.insert(0, str(folder))
    importlib.invalidate_caches()
    yield folder
    sys.path.remove(str(folder))
    for name in MODULES:
        sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine


# -- each built-in's options and tasks: (options, tasks) from a scratch folder -----------------------
def _toy_calc(tmp: Path) -> tuple[dict, list[Task]]:
    from runtime.envs.toy_calc import generate_toy_calc_tasks

    return {}, generate_toy_calc_tasks(TASKS, seed=0)


def _alfworld(tmp: Path) -> tuple[dict, list[Task]]:
    from runtime.envs.alfworld.games import write_alfworld_tasks
    from runtime.envs.alfworld.generate import generate_games

    # Small unplanned games (the construction makes them solvable; planning them is slower), short
    # enough for the tiny model's context; two steps each, so that every episode ends by the game.
    generate_games(tmp, seed=11, per_type=1, split="train", check=False, max_receptacles=2, max_distractors=0)
    tasks = write_alfworld_tasks(tmp, tmp / "train_seed11.txt", tmp / "tasks.jsonl")
    return {"max_steps": 2}, tasks[:TASKS]


def _single_turn(tmp: Path) -> tuple[dict, list[Task]]:
    return {"reward": "contract_plugins:exact"}, probe_tasks(TASKS)


def _agent(tmp: Path) -> tuple[dict, list[Task]]:
    return {"agent": "contract_plugins:ask_once"}, probe_tasks(TASKS)


def _reasoning_gym(tmp: Path) -> tuple[dict, list[Task]]:
    from runtime.envs.reasoning_gym import generate_tasks

    train, _ = generate_tasks(
        "chain_sum", TASKS, 0, seed=0, options={"min_terms": 2, "max_terms": 2, "max_digits": 1}
    )
    return {}, train


def _verifiers(tmp: Path) -> tuple[dict, list[Task]]:
    from runtime.envs.verifiers_env import load_taskset, task_records

    spec = "contract_vf:SumTaskset"
    return {"taskset": spec}, list(task_records(load_taskset(spec), limit=TASKS))


def _as_env_check_does(tmp: Path) -> tuple[dict, list[Task]]:
    """`spopp env check NAME` without --tasks or --env-options."""
    return {}, probe_tasks(TASKS)


SETUPS: dict[str, Callable[[Path], tuple[dict, list[Task]]]] = {
    "math-tir": _as_env_check_does,
    "toy-calc": _toy_calc,
    "alfworld": _alfworld,
    "single-turn": _single_turn,
    "agent": _agent,
    "reasoning-gym": _reasoning_gym,
    "verifiers": _verifiers,
}


def check(runner, engine, spec: str, options: dict, tasks: list[Task]):
    return runner.run(check_environment(spec, options, engine, tasks, EPISODES, BUDGET, seed=0))


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.process] if n in STARTS_PROCESSES else []) for n in BUILT_INS]
)
def test_every_built_in_environment_keeps_the_contract(name, runner, engine, plugins, tmp_path):
    options, tasks = SETUPS.get(name, _as_env_check_does)(tmp_path)
    report = check(runner, engine, name, options, tasks)
    assert report.ok, report.table()
    assert [f.check for f in report.findings] == [
        "builds", "template", "prompts", "exceptions", "rewards", "ends", "deterministic",
    ]  # fmt: skip
    assert len(report.episodes) == EPISODES


def test_the_suite_covers_what_pyproject_registers():
    """The installed registrations are pyproject.toml's (a stale install would hide a new built-in
    from the suite), and every built-in's setup here names one that exists."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert BUILT_INS == sorted(declared["spopp.environments"])
    assert set(SETUPS) <= set(BUILT_INS)


@pytest.mark.parametrize(
    "fault, row",
    [("raises", "exceptions"), ("reward", "rewards"), ("endless", "ends"), ("random", "deterministic")],
)
def test_the_contract_fails_an_environment_that_breaks_it(fault, row, runner, engine, plugins):
    """The same check, on toy-calc broken in one way: that row, and only it, fails."""
    _, tasks = _toy_calc(Path())
    report = check(runner, engine, "contract_broken:BrokenCalc", {"fault": fault}, tasks)
    assert not report.ok
    assert [f.check for f in report.findings if not f.ok] == [row], report.table()


def _line_of(module: str, text: str) -> str:
    """`module.py:N`, N the line of `text` in the module's source as the fixture writes it."""
    lines = MODULES[module].splitlines()
    return f"{module}.py:{next(i for i, line in enumerate(lines, 1) if text in line)}"


def _reasoning_gym_on_foreign_tasks(tmp: Path) -> tuple[dict, list[Task]]:
    """reasoning-gym given tasks that are not its own (no rg_dataset in their meta): its scorer raises."""
    return {}, probe_tasks(TASKS)


def _broken_verifiers(tmp: Path) -> tuple[dict, list[Task]]:
    from runtime.envs.verifiers_env import load_taskset, task_records

    spec = "contract_broken_vf:PlainDefTaskset"
    return {"taskset": spec}, list(task_records(load_taskset(spec), limit=TASKS))


# Each path that plays episodes, broken in the user's code: (spec, options, tasks, what the
# `exceptions` row must name: the exception and the user's file and line, or None where the line
# raising is not the user's), and whether a reward check failed too (the `rewards` row).
BROKEN_TWINS = {
    "agent raises": (
        "agent",
        lambda t: ({"agent": "contract_broken_plugins:divides"}, probe_tasks(TASKS)),
        [
            "agent contract_broken_plugins:divides",
            "ZeroDivisionError: division by zero",
            _line_of("contract_broken_plugins", "1 / 0"),
        ],
        False,
    ),
    "agent never returns": (
        "agent",
        lambda t: ({"agent": "contract_broken_plugins:stalls", "max_wall_s": 0.5}, probe_tasks(TASKS)),
        [
            "TimeoutError: the agent did not return within max_wall_s=0.5 s",
            _line_of("contract_broken_plugins", "asyncio.sleep(3600)"),
        ],
        False,
    ),
    "reward function raises": (
        "single-turn",
        lambda t: ({"reward": "contract_broken_plugins:raising_reward"}, probe_tasks(TASKS)),
        [
            "reward function contract_broken_plugins:raising_reward",
            "KeyError",
            _line_of("contract_broken_plugins", '{"a": 1}[answer_text]'),
        ],
        True,
    ),
    "reasoning-gym on tasks not its own": (
        "reasoning-gym",
        _reasoning_gym_on_foreign_tasks,
        ["reasoning-gym's scorer", "ValueError: task check-0 is not a reasoning-gym task"],
        True,
    ),
    "verifiers reward as a plain def": (
        "verifiers",
        _broken_verifiers,
        ["verifiers taskset contract_broken_vf:PlainDefTaskset", "TypeError", "awaitable"],
        False,
    ),
}


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(k, marks=[pytest.mark.process] if v[0] in STARTS_PROCESSES else [])
        for k, v in BROKEN_TWINS.items()
    ],
)
def test_a_broken_user_code_fails_the_exceptions_row_naming_it(case, runner, engine, plugins, tmp_path):
    """Every path that plays episodes, with the user's code broken: each episode still ends (reward
    0), but the `exceptions` row fails, naming the episode, the exception and where it was raised;
    a reward check that raised fails the `rewards` row too, naming the same exception. Before, an
    agent failing every episode passed with `ends ok agent_error 8`."""
    spec, setup, expected, reward_row = BROKEN_TWINS[case]
    options, tasks = setup(tmp_path)
    report = check(runner, engine, spec, options, list(tasks))
    rows = {f.check: f for f in report.findings}
    assert not report.ok and not rows["exceptions"].ok, report.table()
    detail = rows["exceptions"].detail
    # Episode 0 reaches the user's code (a turn cut at the token budget never reaches a scorer,
    # so a later episode may end before it).
    assert re.match(rf"[12] episodes? of {EPISODES} failed: episode 0 \(", detail), detail
    for text in expected:
        assert text in detail, (text, detail)
    failed = sorted(f.check for f in report.findings if not f.ok)
    assert failed == sorted(["exceptions", "rewards"] if reward_row else ["exceptions"]), report.table()
    if reward_row:
        assert expected[1] in rows["rewards"].detail, rows["rewards"].detail
    assert all(ep.reward == 0.0 for _, ep in report.episodes)


def test_a_check_at_info_logging_prints_no_line_per_model_call(runner, engine, plugins, caplog):
    """A user's code that sets logging to INFO (verifiers' does) got one httpx block per in-process
    model call of every episode; those lines are dropped, other httpx requests are not."""
    caplog.set_level(logging.INFO)
    report = check(runner, engine, "agent", {"agent": "contract_plugins:ask_once"}, probe_tasks(TASKS))
    assert report.ok, report.table()
    assert not [r for r in caplog.records if r.name == "httpx"], [r.getMessage() for r in caplog.records]

    other = logging.LogRecord(
        "httpx", logging.INFO, __file__, 1, "HTTP Request: %s %s", ("GET", "http://other/"), None
    )
    assert logging.getLogger("httpx").filter(other), "a request of the user's own is still logged"


def test_one_episode_is_counted_as_one(runner, engine, plugins):
    """`1 episode played`, not `1 episodes played`; and an environment that writes its own openings
    (an agent) is said not to be probed, rather than to fit a budget nobody measured."""
    _, tasks = _toy_calc(Path())
    report = runner.run(check_environment("toy-calc", {}, engine, tasks, 1, BUDGET, seed=0))
    rows = {f.check: f.detail for f in report.findings}
    assert rows["exceptions"] == "1 episode played", report.table()
    agent = check(runner, engine, "agent", {"agent": "contract_plugins:ask_once"}, probe_tasks(TASKS))
    assert {f.check: f.detail for f in agent.findings}["prompts"].startswith("not probed: AgentEnv"), (
        agent.table()
    )
