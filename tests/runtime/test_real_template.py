"""The agent loop on a real pretrained model's tokenizer and chat template (SmolLM2-135M-Instruct,
imported by `spopp model import`): a BPE vocabulary of 49,152, ChatML turns, its own special tokens.

What the learner trains on must be what the engine sampled: the episode's ids are the engine's ids
as they came (never decoded and encoded again, which on a BPE vocabulary can merge differently)
with the template's rendered turns between them, and the action mask covers exactly the engine's
ids. A scripted engine makes that checkable token by token (it answers in a deliberately
non-canonical tokenization); the real engine shows the model's own end-of-turn token stops a turn.
"""

from __future__ import annotations

import asyncio

import pytest
from scripted import ScriptedEngine

from runtime.agent import run_episode
from runtime.chat import ChatRenderer
from runtime.engines.base import SamplingConfig
from runtime.envs.base import Environment, StepResult, Task
from runtime.envs.toy_calc import ToyCalcEnv
from runtime.episode import Budget

pytestmark = pytest.mark.process  # the model's first import runs pip (tests/fixtures_model.py)

TASK = Task("t1", "123*45+6", "5541")


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


def _char_by_char(tokenizer, text: str) -> list[int]:
    """`text` as one token per character: what a model may sample, never what encode() gives."""
    return [i for ch in text for i in tokenizer.encode(ch, add_special_tokens=False)]


def test_the_episode_is_the_engines_ids_and_the_rendered_turns_and_nothing_else(tokenizer):
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    call = _char_by_char(tokenizer, "<code>123*45+6</code>")
    answer = tokenizer.encode("<ans>5541</ans>", add_special_tokens=False) + [end]
    assert call != tokenizer.encode("<code>123*45+6</code>", add_special_tokens=False)  # really non-canonical
    engine = ScriptedEngine(tokenizer, [call, answer])
    env = ToyCalcEnv()
    renderer = ChatRenderer(tokenizer)
    ep = asyncio.run(
        run_episode(engine, env, TASK, Budget(4, 64, 4096), SamplingConfig(max_tokens=64), renderer)
    )
    assert ep.finish_reason == "answer" and ep.reward == 1.0 and ep.num_turns == 2, ep

    opening = renderer.prompt(ToyCalcEnv().reset(TASK))
    tool_turn = renderer.close_turn(call) + renderer.continuation(
        [{"role": "tool", "content": "<out>5541</out>"}]
    )  # fmt: skip
    expected = opening + call + tool_turn + answer + renderer.close_turn(answer)
    assert ep.token_ids == expected
    assert ep.action_mask == [0] * len(opening) + [1] * len(call) + [0] * len(tool_turn) + [1] * len(
        answer
    ) + [0] * len(renderer.close_turn(answer))
    assert engine.prompts == [opening, opening + call + tool_turn]  # each turn continues the last
    # The template's own turns: ChatML, the tool's answer in a turn of its own, the next assistant header.
    text = tokenizer.decode(tool_turn)
    assert text.startswith("<|im_end|>\n<|im_start|>") and "<out>5541</out>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(opening).endswith("<|im_start|>user\n123*45+6<|im_end|>\n<|im_start|>assistant\n")


class Endless(Environment):
    """A tool that always answers: only a budget, here the model's context, ends the episode."""

    name = "endless"

    def reset(self, task: Task) -> list[dict]:
        return [{"role": "user", "content": task.prompt}]

    def step(self, action: str) -> StepResult:
        return StepResult([{"role": "tool", "content": "more"}], done=False)


def test_a_long_episode_stops_at_the_models_context(tokenizer, smollm2):
    from transformers import AutoConfig

    context = AutoConfig.from_pretrained(smollm2).max_position_embeddings  # 8192
    turn = tokenizer.encode(" again" * 999, add_special_tokens=False)[:999]
    engine = ScriptedEngine(tokenizer, [turn] * 20, context_tokens=context)
    budget = Budget(max_turns=20, max_tokens_per_turn=1000, max_total_tokens=100_000)
    ep = asyncio.run(run_episode(engine, Endless(), TASK, budget, SamplingConfig(max_tokens=1000)))
    assert ep.finish_reason == "max_total_tokens" and len(ep.token_ids) <= context
    assert all(len(p) < context for p in engine.prompts)  # no turn was asked past the context
    assert len(ep.token_ids) > context - 1000 - 20  # it used the context, up to a turn and its markers


def test_the_models_end_of_turn_token_stops_a_real_turn(smollm2):
    from runtime.engines.hf import TransformersEngine

    engine = TransformersEngine(smollm2)
    try:
        end = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert end in engine.eos_ids and engine.context_tokens == 8192
        renderer = ChatRenderer(engine.tokenizer)
        prompt = renderer.prompt([{"role": "user", "content": "Say hi."}])
        gen = asyncio.run(engine.generate(prompt, SamplingConfig(max_tokens=48, temperature=0.0)))
    finally:
        asyncio.run(engine.close())
    # Greedy, the instruct model answers briefly and ends its turn with its own token.
    assert gen.finish_reason == "stop" and gen.token_ids[-1] == end, engine.tokenizer.decode(gen.token_ids)
    assert end not in gen.token_ids[:-1] and renderer.close_turn(gen.token_ids) == renderer.turn_end_ids[1:]
