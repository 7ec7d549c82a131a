"""The agent loop on the real tiny model: mask and log-prob alignment, readable chat, budgets."""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from runtime.agent import run_episode
from runtime.chat import ChatRenderer
from runtime.engines.base import SamplingConfig
from runtime.engines.hf import TransformersEngine
from runtime.envs.base import Environment, StepResult, Task
from runtime.episode import Budget


class CountdownEnv(Environment):
    """Answers every turn with a tool message until `turns` turns have passed (0: never ends)."""

    name = "countdown"
    stop = ("</code>",)

    def __init__(self, turns: int) -> None:
        self.turns, self.seen = turns, []

    def reset(self, task: Task) -> list[dict]:
        return [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": task.prompt}]

    def step(self, action: str) -> StepResult:
        self.seen.append(action)
        if self.turns and len(self.seen) >= self.turns:
            return StepResult([], done=True, reward=1.0)
        return StepResult(
            [{"role": "tool", "content": f"<output>\n{len(self.seen) * 111}\n</output>"}], done=False
        )


TASK = Task("t1", "What is 123*45+6?", "5541")


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = TransformersEngine(tiny_model)
    yield eng
    asyncio.run(eng.close())


@pytest.fixture(scope="module")
def model(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float64).eval()


def _episode(engine, env, budget=Budget(4, 64, 2048), seed=1):
    sampling = SamplingConfig(max_tokens=budget.max_tokens_per_turn, temperature=1.0, seed=seed)
    return asyncio.run(run_episode(engine, env, TASK, budget, sampling))


def test_mask_and_logprobs_align_with_a_forward_pass(engine, model):
    ep = _episode(engine, CountdownEnv(turns=3))
    assert ep.finish_reason == "done" and ep.num_turns == 3 and ep.reward == 1.0
    n = len(ep.token_ids)
    assert len(ep.action_mask) == len(ep.rollout_logprobs) == n
    assert ep.action_mask[: ep.prompt_tokens] == [0] * ep.prompt_tokens
    # Three generated spans separated by masked observation tokens.
    spans = sum(1 for i in range(1, n) if ep.action_mask[i] and not ep.action_mask[i - 1])
    assert spans == 3
    with torch.no_grad():
        logits = model(torch.tensor([ep.token_ids])).logits[0]
    logp = torch.log_softmax(logits, -1)
    for i in range(1, n):
        if ep.action_mask[i]:
            assert ep.rollout_logprobs[i] == pytest.approx(float(logp[i - 1, ep.token_ids[i]]), abs=2e-4)
        else:
            assert ep.rollout_logprobs[i] == 0.0


def test_decoded_sequence_is_the_chat_a_person_reads(engine):
    env = CountdownEnv(turns=3)
    ep = _episode(engine, env, seed=7)
    tok = engine.tokenizer
    messages = env.reset(TASK)
    for k, action in enumerate(env.seen):
        messages.append({"role": "assistant", "content": action})
        if k < len(env.seen) - 1:
            messages.append({"role": "tool", "content": f"<output>\n{(k + 1) * 111}\n</output>"})
    expected = tok.apply_chat_template(messages, tokenize=False)
    assert tok.decode(ep.token_ids) == expected


class Recording:
    """The real engine, with every generation it returns kept for comparison."""

    def __init__(self, engine):
        self.engine, self.tokenizer, self.outputs = engine, engine.tokenizer, []

    async def generate(self, prompt_ids, sampling):
        gen = await self.engine.generate(prompt_ids, sampling)
        self.outputs.append(gen)
        return gen


def test_generated_ids_are_appended_as_the_engine_returned_them(engine):
    rec = Recording(engine)
    ep = _episode(rec, CountdownEnv(turns=3), seed=3)
    spans, cur = [], []
    for tid, m, lp in zip(ep.token_ids, ep.action_mask, ep.rollout_logprobs, strict=True):
        if m:
            cur.append((tid, lp))
        elif cur:
            spans.append(cur)
            cur = []
    if cur:
        spans.append(cur)
    assert len(spans) == len(rec.outputs) == 3
    for span, gen in zip(spans, rec.outputs, strict=True):
        assert [t for t, _ in span] == gen.token_ids
        assert [lp for _, lp in span] == gen.logprobs


@pytest.mark.parametrize(
    "budget,env_turns,finish",
    [
        (Budget(max_turns=2, max_tokens_per_turn=64, max_total_tokens=4096), 0, "max_turns"),
        (Budget(max_turns=4, max_tokens_per_turn=1, max_total_tokens=4096), 0, "max_tokens_per_turn"),
        (Budget(max_turns=8, max_tokens_per_turn=64, max_total_tokens=30), 0, "max_total_tokens"),
    ],
)
def test_budgets_cut_episodes_with_reward_zero(engine, budget, env_turns, finish):
    if finish == "max_total_tokens":  # leave room for a turn or two after the prompt
        prompt = len(ChatRenderer(engine.tokenizer).prompt(CountdownEnv(0).reset(TASK)))
        budget = Budget(budget.max_turns, budget.max_tokens_per_turn, prompt + budget.max_total_tokens)
    ep = _episode(engine, CountdownEnv(turns=env_turns), budget=budget)
    assert ep.finish_reason == finish and ep.reward == 0.0
    assert ep.num_turns <= budget.max_turns
    assert len(ep.token_ids) <= budget.max_total_tokens
    if finish == "max_turns":
        assert ep.num_turns == 2


class SettledEnv(CountdownEnv):
    """Settles reward 1 on the first turn, then keeps the episode going (toy-calc's padded turns)."""

    def step(self, action: str) -> StepResult:
        self.seen.append(action)
        return StepResult([{"role": "tool", "content": "<out>again</out>"}], done=False,
                          info={"decided_reward": 1.0})  # fmt: skip


@pytest.mark.parametrize(
    "budget,finish",
    [
        (Budget(max_turns=2, max_tokens_per_turn=64, max_total_tokens=4096), "max_turns"),
        (Budget(max_turns=8, max_tokens_per_turn=64, max_total_tokens=30), "max_total_tokens"),
    ],
)
def test_a_settled_reward_survives_a_budget_cut(engine, budget, finish):
    """A cut after the environment settled the outcome keeps it (and still says what cut it)."""
    if finish == "max_total_tokens":
        prompt = len(ChatRenderer(engine.tokenizer).prompt(SettledEnv(0).reset(TASK)))
        budget = Budget(budget.max_turns, budget.max_tokens_per_turn, prompt + 100)
    ep = _episode(engine, SettledEnv(0), budget=budget)
    assert ep.finish_reason == finish and ep.reward == 1.0 and ep.num_turns >= 1


def test_budget_rejects_nonsense():
    with pytest.raises(ValueError):
        Budget(max_turns=0)


def test_an_episode_ends_at_the_engines_context_not_with_a_refused_turn(engine):
    """A budget larger than the model's context (the tiny model's 1024 positions, the replicas'
    default budget 4096) ends the episode as max_total_tokens within the context, instead of a
    next turn the engine would refuse for leaving no room."""
    assert engine.context_tokens == 1024
    ep = _episode(engine, CountdownEnv(turns=0), budget=Budget(1000, 64, 4096), seed=3)
    assert ep.finish_reason == "max_total_tokens" and ep.num_turns > 3
    assert 1024 - 64 < len(ep.token_ids) <= 1024
