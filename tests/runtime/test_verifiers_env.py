"""`env: verifiers` (runtime/envs/verifiers_env.py): verifiers tasksets defined here, played by the
policy through the real agent endpoint and the real `openai` client, scored by their own rewards.

The model is a scripted engine over the tiny model's tokenizer (tests/scripted.py): what it writes is
fixed so that each path (a plain answer, a tool call, a second turn, a stop hook) is taken for sure;
everything after the engine is real: the endpoint's rendering and parsing, the MCP server objects of
the toolsets, verifiers' own Task.score.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
import textwrap

import pytest

from runtime.agent import run_episode
from runtime.engines.base import SamplingConfig
from runtime.envs.base import Task
from runtime.envs.verifiers_env import META_KEY, VerifiersEnv, write_verifiers_tasks
from runtime.episode import Budget
from runtime.tasks import load_tasks as read_jsonl
from tests.scripted import ScriptedEngine

# A user's verifiers package, as it would be installed: a module exporting its Taskset via __all__
# (verifiers loads a taskset id by importing the module of that name).
TASKSETS = textwrap.dedent('''
    import verifiers.v1 as vf

    class SumData(vf.TaskData):
        a: int
        b: int

    class Calc(vf.Toolset):
        @vf.tool
        async def add(self, a: int, b: int) -> str:
            """Add two integers."""
            return str(a + b)

        @vf.tool
        async def explode(self) -> str:
            """Always fails."""
            raise RuntimeError("the tool broke")

    class SumTask(vf.Task[SumData]):
        @vf.reward
        async def correct(self, task, trace) -> float:
            return float(trace.last_reply == str(task.a + task.b))

        @vf.reward(weight=0.0)
        async def short(self, trace) -> float:
            return 1.0

        @vf.stop
        async def gave_up(self, trace) -> bool:
            return "GIVE UP" in trace.last_reply

        @classmethod
        def toolsets(cls, config):
            return [Calc(vf.ToolsetConfig())]

    class SumConfig(vf.TasksetConfig):
        n: int = 6

    SETUPS = []

    class Clock(vf.Toolset):
        """Shared by every task of the taskset: set up once per process."""

        TOOL_PREFIX = None

        async def setup(self):
            SETUPS.append(1)

        @vf.tool
        async def now(self) -> str:
            """The time."""
            return "noon"

    class SumTaskset(vf.Taskset[SumTask, SumConfig]):
        @classmethod
        def toolsets(cls, config):
            return [Clock(vf.ToolsetConfig())]

        def load(self):
            for i in range(self.config.n):
                data = SumData(prompt=f"What is {i}+{i + 2}?", system_prompt="Reply with the number.", a=i, b=i + 2)
                yield SumTask(data, self.config.task)

    class DoubleTask(vf.Task[SumData]):
        """A reward out of range: two full rewards of weight 1 sum to 2."""

        @vf.reward
        async def one(self, trace) -> float:
            return 1.0

        @vf.reward
        async def two(self, trace) -> float:
            return 1.0

    class DoubleTaskset(vf.Taskset[DoubleTask]):
        def load(self):
            yield DoubleTask(SumData(prompt="Hi", a=0, b=0), self.config.task)

    class GuessConfig(vf.EnvConfig):
        player: vf.AgentConfig = vf.AgentConfig()

    class Guess(vf.Env[GuessConfig]):
        """Multi-turn: the env says higher or lower until the reply is the sum, at most 3 replies."""

        async def run(self, task, agents):
            target = task.data.a + task.data.b
            async with agents.player.interaction(task) as talk:
                reply = await talk.turn()
                for _ in range(2):
                    if reply.terminated or reply.last_reply == str(target):
                        break
                    guess = int(reply.last_reply) if reply.last_reply.lstrip("-").isdigit() else 0
                    reply = await talk.turn("higher" if guess < target else "lower")

        async def finalize(self, task, episode):
            episode.traces[0].record_metric("finalized", 1.0)

    class DuelConfig(vf.EnvConfig):
        """Two seats: a second model spopp does not run."""

        player: vf.AgentConfig = vf.AgentConfig()
        user: vf.AgentConfig = vf.AgentConfig()

    class WithUser(vf.Env[DuelConfig]):
        async def run(self, task, agents):
            async with agents.user.interaction(task) as talk:
                await talk.turn()

    __all__ = ["SumTaskset"]
''')

BUDGET = Budget(8, 160, 4096)  # a tool call is about 60 of the tiny tokenizer's tokens


@pytest.fixture(scope="module")
def tasksets(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plugins")
    (folder / "vf_sum_tasks.py").write_text(TASKSETS)
    sys.path.insert(0, str(folder))
    importlib.invalidate_caches()
    yield folder
    sys.path.remove(str(folder))
    sys.modules.pop("vf_sum_tasks", None)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def first_task(env: VerifiersEnv, index: int = 1) -> Task:
    vtask = list(env.taskset)[index]
    return Task(
        "t", vtask.data.prompt_text, meta={META_KEY: vtask.data.model_dump(mode="json", exclude_none=True)}
    )


def play(tokenizer, env, script, task=None):
    """An episode of `env` on its second task with the model writing `script`; (episode, engine)."""
    engine = ScriptedEngine(tokenizer, list(script))
    sampling = SamplingConfig(max_tokens=BUDGET.max_tokens_per_turn, seed=0)
    episode = asyncio.run(run_episode(engine, env, task or first_task(env), BUDGET, sampling))
    return episode, engine


def text_of(tokenizer, ids) -> str:
    return tokenizer.decode(ids)


def test_a_taskset_by_id_writes_task_files_that_round_trip(tasksets, tmp_path):
    train, heldout = write_verifiers_tasks(tmp_path, "vf-sum-tasks", {"n": 6}, n_heldout=2, seed=3)
    train_tasks, held_tasks = read_jsonl(train), read_jsonl(heldout)
    assert (len(train_tasks), len(held_tasks)) == (4, 2)
    assert not {t.task_id for t in train_tasks} & {t.task_id for t in held_tasks}
    # The same arguments write the same split; the meta rebuilds the verifiers task exactly.
    again = read_jsonl(write_verifiers_tasks(tmp_path / "again", "vf-sum-tasks", {"n": 6}, 2, 3)[0])
    assert [t.task_id for t in again] == [t.task_id for t in train_tasks]
    env = VerifiersEnv(taskset="vf-sum-tasks", config={"n": 6})
    keys = {t.key for t in env.taskset}
    for t in train_tasks + held_tasks:
        vtask = env.task_of(t)
        assert vtask.key in keys and t.prompt == vtask.data.prompt_text
        assert t.task_id == f"vf-{vtask.key[:20]}"


def test_the_cli_writes_the_task_files(tasksets, tmp_path):
    from click.testing import CliRunner

    from runtime.tasks_cli import group

    runner = CliRunner()
    r = runner.invoke(group, ["verifiers", "vf_sum_tasks:SumTaskset", "--out", str(tmp_path),
                             "--config", '{"n": 3}', "--heldout", "1"])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert len(read_jsonl(tmp_path / "train.jsonl")) == 2
    # Bad input: a config field the taskset lacks, more held out than there are tasks, not JSON.
    for args, says in [
        (["--config", '{"nope": 1}'], "bad config"),
        (["--heldout", "9"], "cannot hold out 9"),
        (["--config", "{"], "not JSON"),
    ]:
        r = runner.invoke(
            group, ["verifiers", "vf_sum_tasks:SumTaskset", "--out", str(tmp_path / "x"), *args]
        )
        assert r.exit_code != 0 and says in r.output, r.output
    assert not (tmp_path / "x").exists()  # nothing half written


def test_single_turn_answers_are_scored_by_the_tasks_rewards(tasksets, tokenizer):
    env = VerifiersEnv(taskset="vf-sum-tasks")
    right, engine = play(tokenizer, env, ["4"])  # task 1: 1+3
    assert right.finish_reason == "agent", right.info
    assert right.reward == 1.0 and right.info["calls"] == 1
    prompt = text_of(tokenizer, engine.prompts[0])
    assert "Reply with the number." in prompt and "What is 1+3?" in prompt
    # The tools were offered (the template has no tool support: spopp's Hermes preamble carries them).
    assert "calc_add" in prompt and "Add two integers." in prompt
    # What is trained is what the engine wrote: the reply's tokens and only they are actions.
    written = tokenizer.encode("4", add_special_tokens=False)
    actions = [t for t, m in zip(right.token_ids, right.action_mask, strict=True) if m]
    assert actions == written and right.token_ids[: len(engine.prompts[0])] == engine.prompts[0]
    wrong, _ = play(tokenizer, env, ["5"])
    assert wrong.reward == 0.0


def test_a_tool_call_runs_in_the_toolsets_server_and_its_reply_reaches_the_model(tasksets, tokenizer):
    env = VerifiersEnv(taskset="vf-sum-tasks")
    call = '<tool_call>\n{"name": "calc_add", "arguments": {"a": 1, "b": 3}}\n</tool_call>'
    episode, engine = play(tokenizer, env, [call, "4"])
    assert episode.reward == 1.0 and episode.info["calls"] == 2
    second = text_of(tokenizer, engine.prompts[1])
    assert second.count("4") > text_of(tokenizer, engine.prompts[0]).count("4")  # the tool's "4"
    # Bad calls are observations, not failures: a tool that raises, arguments that are not JSON, a
    # tool nobody serves; each error text reaches the model and the episode goes on to its answer.
    bad = [
        '<tool_call>\n{"name": "calc_explode", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "calc_nothing", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "calc_add", "arguments": {"a": "x"}}\n</tool_call>',
    ]
    episode, engine = play(tokenizer, env, [*bad, "4"])
    assert episode.reward == 1.0 and episode.info["calls"] == 4
    seen = text_of(tokenizer, engine.prompts[-1])
    assert "the tool broke" in seen and "no tool named 'calc_nothing'" in seen and "error" in seen


def test_a_stop_hook_and_max_turns_end_the_exchange(tasksets, tokenizer):
    call = '<tool_call>\n{"name": "calc_add", "arguments": {"a": 1, "b": 3}}\n</tool_call>'
    env = VerifiersEnv(taskset="vf-sum-tasks")
    episode, engine = play(tokenizer, env, [f"GIVE UP {call}", "4"])
    assert episode.info["calls"] == 1 and engine.script == ["4"]  # stopped before the second call
    assert episode.reward == 0.0
    env = VerifiersEnv(taskset="vf-sum-tasks", max_turns=2)
    episode, engine = play(tokenizer, env, [call, call, "4"])
    assert episode.info["calls"] == 2 and episode.reward == 0.0 and engine.script == ["4"]


def test_a_multi_turn_env_drives_the_turns_and_finalizes(tasksets, tokenizer):
    env = VerifiersEnv(taskset="vf-sum-tasks", env="vf_sum_tasks:Guess")
    assert env.seat_name == "player"
    episode, engine = play(tokenizer, env, ["2", "9", "4"])  # lower than 4, higher, then right
    assert episode.reward == 1.0 and episode.info["calls"] == 3
    assert "higher" in text_of(tokenizer, engine.prompts[1]) and "lower" in text_of(
        tokenizer, engine.prompts[2]
    )
    # Never right within its three replies: 0.
    episode, _ = play(tokenizer, env, ["2", "9", "7"])
    assert episode.reward == 0.0 and episode.info["calls"] == 3


def test_rewards_out_of_range_and_tasks_without_verifiers_data_earn_zero(tasksets, tokenizer):
    env = VerifiersEnv(taskset="vf_sum_tasks:DoubleTaskset")
    episode, _ = play(tokenizer, env, ["hello"], task=first_task(env, 0))
    assert episode.reward == 0.0 and episode.info["answer_check"] == "out_of_range"
    env = VerifiersEnv(taskset="vf-sum-tasks")
    episode, engine = play(tokenizer, env, ["4"], task=Task("plain", "What is 1+3?", "4"))
    assert episode.reward == 0.0 and episode.finish_reason == "agent_error"
    assert "spopp tasks verifiers" in episode.info["agent_error"] and engine.prompts == []


@pytest.mark.parametrize(
    "options, says",
    [
        ({"taskset": "no-such-taskset"}, "not found"),
        ({"taskset": "vf_sum_tasks:SumData"}, "not a vf.Taskset subclass"),
        ({"taskset": "vf_sum_tasks:Nothing"}, "no attribute"),
        ({"taskset": "vf-sum-tasks", "config": {"n": "many"}}, "bad config"),
        ({"taskset": "vf-sum-tasks", "env": "vf_sum_tasks:SumTask"}, "not a vf.Env subclass"),
        ({"taskset": "vf-sum-tasks", "env": "vf_sum_tasks:WithUser"}, "say which one"),
        ({"taskset": "vf-sum-tasks", "env": "vf_sum_tasks:Guess", "seat": "judge"}, "no seat 'judge'"),
        ({"taskset": "vf-sum-tasks", "max_turns": 0}, "max_turns"),
        ({"taskset": "vf-sum-tasks", "tool_timeout_s": -1}, "tool_timeout_s"),
        ({"taskset": ""}, "taskset must be"),
    ],
)
def test_bad_options_fail_at_start_up_with_what_is_wrong(tasksets, options, says):
    with pytest.raises(ValueError, match=says):
        VerifiersEnv.prepare(options)


def test_an_env_asking_for_a_second_model_is_refused(tasksets, tokenizer):
    env = VerifiersEnv(taskset="vf-sum-tasks", env="vf_sum_tasks:WithUser", seat="player")
    episode, engine = play(tokenizer, env, ["4"])
    assert episode.finish_reason == "agent_error" and "runs no second model" in episode.info["agent_error"]
    assert episode.reward == 0.0 and engine.prompts == []


def test_the_environment_is_registered_and_checked_by_name(tasksets, tmp_path, tiny_model):
    from click.testing import CliRunner

    from runtime.envs import env_factory
    from runtime.envs.cli import group

    assert isinstance(env_factory("verifiers", {"taskset": "vf-sum-tasks"})(), VerifiersEnv)
    train, _ = write_verifiers_tasks(tmp_path, "vf-sum-tasks", {"n": 2})
    r = CliRunner().invoke(group, ["check", "verifiers", "--model", str(tiny_model), "--tasks", str(train),
                                  "--episodes", "1", "--env-options", json.dumps({"taskset": "vf-sum-tasks"})])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "verifiers" in r.output


def test_the_tasksets_shared_tools_are_set_up_once_per_process(tasksets, tokenizer):
    import vf_sum_tasks

    call = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    before = len(vf_sum_tasks.SETUPS)
    for _ in range(2):  # a replica makes an environment object per episode
        episode, engine = play(tokenizer, VerifiersEnv(taskset="vf-sum-tasks", config={"n": 5}), [call, "4"])
        assert episode.reward == 1.0 and "noon" in text_of(tokenizer, engine.prompts[1])
    assert len(vf_sum_tasks.SETUPS) - before == 1
