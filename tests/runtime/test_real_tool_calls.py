"""A real model's tool calls, end to end: SmolLM2-135M-Instruct writes a call that nobody scripted,
the endpoint parses it into `tool_calls`, the agent (examples/plugins/calculator_agent.py) runs the
tool and sends the result back as a `tool` message, and the next call extends the same trajectory
token for token.

The other tool-call tests parse scripted text (tests/runtime/test_agent_endpoint.py); this one is the only
place where the text is the model's own, so it checks the parse on what a small model really writes.
Greedy decoding makes it deterministic: greedy, SmolLM2 called `calculate` with the task's
expression and then answered right on 64 of 64 held-out tasks (docs/results/tool-calls/), this
one among them."""

from __future__ import annotations

import asyncio
import copy
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from runtime.agent import run_episode
from runtime.engines.base import SamplingConfig
from runtime.envs.agent import AgentEnv
from runtime.envs.toy_calc import generate_toy_calc_tasks
from runtime.episode import Budget

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "plugins"))
import calculator_agent  # noqa: E402 - a user's plug-in folder, put on the path above

BUDGET = Budget(3, 48, 1024)


class Recorded:
    """The real engine, with the ids of every call's prompt and what it generated kept: the test
    compares the second call's prompt with the first call's prompt and generation."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.calls: list[tuple[list[int], object]] = []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    async def generate(self, ids, sampling):
        gen = await self.engine.generate(ids, sampling)
        self.calls.append((list(ids), gen))
        return gen


class Seen:
    """The episode's OpenAI client, with each request's messages and each reply kept."""

    def __init__(self, client) -> None:
        self.client = client
        self.requests: list[list[dict]] = []
        self.replies: list = []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    async def create(self, **request):
        self.requests.append(copy.deepcopy(request["messages"]))
        reply = await self.client.chat.completions.create(**request)
        self.replies.append(reply)
        return reply


@pytest.mark.process  # the model's first import runs pip (tests/fixtures_model.py)
def test_smollm2s_own_call_comes_back_runs_and_extends_the_trajectory(smollm2):
    from runtime.engines.hf import TransformersEngine

    task = generate_toy_calc_tasks(1, seed=1000, split="heldout")[0]  # 845*28+70, a held-out task
    engine = Recorded(TransformersEngine(smollm2))
    seen: list[Seen] = []

    async def agent(client, task):
        seen.append(Seen(client))
        return await calculator_agent.solve(seen[0], task)

    env = AgentEnv(agent="calculator_agent:solve", max_calls=3)
    env._fn = agent  # the plug-in's own solve, through a client that keeps what it saw
    sampling = SamplingConfig(max_tokens=BUDGET.max_tokens_per_turn, temperature=0.0, seed=0)
    try:
        ep = asyncio.run(run_episode(engine, env, task, BUDGET, sampling))
    finally:
        asyncio.run(engine.engine.close())
    tok = engine.tokenizer
    client = seen[0]

    # The model wrote a call; the endpoint gave it back as tool_calls, not content.
    first = client.replies[0].choices[0]
    assert first.finish_reason == "tool_calls"
    (call,) = first.message.tool_calls
    assert call.function.name == "calculate"
    assert json.loads(call.function.arguments) == {"expression": task.prompt}
    (prompt0, gen0), (prompt1, gen1) = engine.calls
    written = tok.decode(gen0.token_ids, skip_special_tokens=True)
    assert written.startswith("<tool_call>") and written.endswith("</tool_call>")  # generated, not scripted
    # The agent ran the tool and answered the call by its id.
    tool_message = client.requests[1][-1]
    assert tool_message == {"role": "tool", "tool_call_id": call.id, "content": task.answer}
    # Then the model answered from the tool's output.
    second = client.replies[1].choices[0]
    assert second.finish_reason == "stop" and not second.message.tool_calls
    assert calculator_agent.final_answer(second.message.content) == int(task.answer)
    assert (ep.reward, ep.finish_reason, ep.num_turns) == (1.0, "agent", 2)

    # Token-exact: the second call's prompt is the first call's prompt and generation, as the engine
    # produced them, then only the turn's end, the tool message and the next assistant header.
    n = len(prompt0) + len(gen0.token_ids)
    assert prompt1[:n] == prompt0 + gen0.token_ids
    assert (
        tok.decode(prompt1[n:])
        == f"<|im_end|>\n<|im_start|>tool\n{task.answer}<|im_end|>\n<|im_start|>assistant\n"
    )
    # The episode's record is that one sequence: one segment, the engine's two generations trained
    # (mask 1) with the log-probs the engine reported, everything else masked.
    assert ep.segment_starts == [0] and ep.info["segments"] == 1
    assert ep.token_ids[: len(prompt1) + len(gen1.token_ids)] == prompt1 + gen1.token_ids
    assert tok.decode(ep.token_ids[len(prompt1) + len(gen1.token_ids) :]) in ("", "\n", "<|im_end|>\n")
    generated = {*range(len(prompt0), n), *range(len(prompt1), len(prompt1) + len(gen1.token_ids))}
    assert [i for i, m in enumerate(ep.action_mask) if m] == sorted(generated)
    assert [ep.rollout_logprobs[i] for i in sorted(generated)] == gen0.logprobs + gen1.logprobs
    assert ep.prompt_tokens == len(prompt0)
    # The worked examples and the tools reached the model in the prompt it continued.
    opening = tok.decode(prompt0)
    assert (
        '<tool_call>\n{"name": "calculate", "arguments": {"expression": "123*45+6"}}\n</tool_call>' in opening
    )
    assert '<tools>\n{"type": "function", "function": {"name": "calculate"' in opening


def test_the_tool_answers_every_call_and_never_raises():
    def call(name, arguments):
        return SimpleNamespace(function=SimpleNamespace(name=name, arguments=arguments))

    run = calculator_agent.run_tool
    assert run(call("calculate", '{"expression": "845*28 + 70"}')) == "23730"
    assert run(call("add", '{"expression": "1+1"}')) == "error: no tool named 'add'"
    assert run(call("calculate", '{"expression": 7')) == "error: the arguments are not JSON"
    assert run(call("calculate", '{"expr": "1+1"}')) == "error: expression must be a string"
    assert run(call("calculate", '["1+1"]')) == "error: expression must be a string"
    assert run(call("calculate", '{"expression": "__import__(\\"os\\")"}')).startswith("error: ")
    assert calculator_agent.final_answer("The answer is 23,730.") == 23730
    assert calculator_agent.final_answer("true") is None


def test_the_results_page_is_the_rendering_of_its_data():
    """docs/results/tool-calls/README.md is what tools/tool_calls_study.py renders from the committed
    episodes and run records: its numbers cannot drift from the data."""
    from tools.tool_calls_study import render

    folder = Path(__file__).resolve().parents[2] / "docs" / "results" / "tool-calls"
    assert (folder / "README.md").read_text() == render(folder)
