"""The CPU demo's groundwork: toy-calc environment, character tokenizer, task files, cold start.

Episodes run through the real agent loop (`runtime.agent.run_episode`) with the real chat template
of the toy tokenizer; a scripted engine plays fixed turns so that wins and losses are exact.
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from scripted import ScriptedEngine

from runtime.agent import run_episode
from runtime.chat import ChatRenderer
from runtime.engines.base import SamplingConfig
from runtime.envs import env_factory
from runtime.envs.base import Task
from runtime.envs.toy_calc import (
    SHOTS,
    TOOL_PROMPT,
    ToolError,
    ToyCalcEnv,
    evaluate_tool_code,
    generate_toy_calc_tasks,
    heldout_expression,
    make_task,
    write_toy_calc_tasks,
)
from runtime.episode import Budget
from runtime.tasks import load_tasks
from tools.toy_model import build_toy_tokenizer

TASK = make_task(123, 45, 67)  # 123*45+67 = 5602


@pytest.fixture(scope="module")
def tok():
    return build_toy_tokenizer()


# -- the calculator tool ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "code, value",
    [
        ("print(123*45+67)", 5602),
        ("123*45+67", 5602),
        (" print( 2 + 3 * 4 ) ", 14),
        ("(2+3)*4", 20),
        ("-3*-2", 6),
        ("10-2-3", 5),
        ("007", 7),
    ],
)
def test_tool_evaluates_integer_arithmetic(code, value):
    assert evaluate_tool_code(code) == value


@pytest.mark.parametrize(
    "code",
    [
        "__import__('os').system('ls')",
        "print(open('/etc/passwd').read())",
        "2**3",
        "7/2",
        "1+",
        "(1+2",
        "print(1)+1",
        "",
        "(" * 20 + "1" + ")" * 20,
        "9" * 70,
        "99999999999999999999*99999999999999999999*9999",
    ],
)
def test_tool_refuses_everything_else(code):
    with pytest.raises(ToolError):
        evaluate_tool_code(code)


# -- the environment ----------------------------------------------------------------------------


def test_registered_and_tool_then_exact_answer():
    env = env_factory("toy-calc")()
    assert env.reset(TASK) == [{"role": "user", "content": "123*45+67"}]
    r = env.step("<code>print(123*45+67)</code>")
    assert not r.done and r.messages == [{"role": "tool", "content": "<out>5602</out>"}]
    r = env.step("<ans>5602</ans>")
    assert r.done and r.reward == 1.0 and r.info["finish"] == "answer" and r.info["tool_calls"] == 1


def test_non_arithmetic_code_is_an_error_observation():
    env = ToyCalcEnv()
    env.reset(TASK)
    r = env.step("<code>__import__('os')</code>")
    assert not r.done and r.messages[0]["content"] == "<out>error</out>" and r.info["tool_errors"] == 1


@pytest.mark.parametrize(
    "answer, reward",
    [("5602", 1.0), (" 5602 ", 1.0), ("5603", 0.0), ("56O2", 0.0), ("", 0.0), ("5602.0", 0.0)],
)
def test_reward_only_on_the_exact_answer(answer, reward):
    env = ToyCalcEnv()
    env.reset(TASK)
    r = env.step(f"<ans>{answer}</ans>")
    assert r.done and r.reward == reward and r.info["finish"] == "answer"


@pytest.mark.parametrize(
    "action",
    [
        "5602",
        "<ans>5602",
        "<code>1+1",
        "x<ans>5602</ans>",
        "<ans>5602</ans><ans>5602</ans>",
        "<code><ans>1</ans></code>",
        "",
    ],
)
def test_malformed_turn_ends_with_zero(action):
    env = ToyCalcEnv()
    env.reset(TASK)
    r = env.step(action)
    assert r.done and r.reward == 0.0 and r.info["finish"] == "malformed"


def test_tool_budget():
    env = ToyCalcEnv(max_tool_calls=2)
    env.reset(TASK)
    assert not env.step("<code>1</code>").done
    assert not env.step("<code>2</code>").done
    r = env.step("<code>3</code>")
    assert r.done and r.reward == 0.0 and r.info["finish"] == "tool_budget"
    with pytest.raises(RuntimeError):
        env.step("<ans>5602</ans>")


# -- tokenizer and chat template ----------------------------------------------------------------


def test_tokenizer_round_trip_and_chat_template(tok, tmp_path):
    from transformers import AutoTokenizer

    text = "<code>print(123*45+67)</code><out>5602</out><ans>-5602</ans>error"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert len(ids) == 14 + 6 + 7 + 1  # one token per tag, word and character
    msgs = [
        {"role": "user", "content": "123*45+67"},
        {"role": "assistant", "content": "<code>print(123*45+67)</code>"},
        {"role": "tool", "content": "<out>5602</out>"},
    ]
    rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|user|>123*45+67<|end|><|assistant|><code>print(123*45+67)</code><|end|>"
        "<|tool|><out>5602</out><|end|><|assistant|>"
    )
    # Chat markers are special: skipped on decode, so the environment sees only the turn's text.
    assert tok.decode(tok.encode(rendered, add_special_tokens=False), skip_special_tokens=True) == (
        "123*45+67<code>print(123*45+67)</code><out>5602</out>"
    )
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.encode(rendered, add_special_tokens=False) == tok.encode(rendered, add_special_tokens=False)
    assert loaded.eos_token == "<|end|>" and loaded.pad_token == "<pad>"
    r = ChatRenderer(loaded)
    assert r.turn_end == "<|end|>" and len(r.prompt([{"role": "user", "content": "123*45+67"}])) == 12


# -- tasks --------------------------------------------------------------------------------------


def test_task_generator_disjoint_deterministic_and_loadable(tmp_path):
    train = {t.prompt for s in range(3) for t in generate_toy_calc_tasks(300, s, "train")}
    held = {t.prompt for s in range(3) for t in generate_toy_calc_tasks(300, s, "heldout")}
    assert not train & held
    a, b = generate_toy_calc_tasks(50, 7, "train"), generate_toy_calc_tasks(50, 7, "train")
    assert a == b and len({t.task_id for t in a}) == 50
    assert a != generate_toy_calc_tasks(50, 8, "train")
    for t in a:
        x, y, z = map(int, t.prompt.replace("*", "+").split("+"))
        assert 100 <= x <= 999 and 10 <= y <= 99 and 10 <= z <= 99 and t.answer == str(x * y + z)
    train_path, held_path = write_toy_calc_tasks(tmp_path, seed=3, n_train=40, n_heldout=20)
    loaded = load_tasks(train_path)
    assert [(t.task_id, t.prompt, t.answer) for t in loaded] == [
        (t.task_id, t.prompt, t.answer) for t in generate_toy_calc_tasks(40, 3, "train")
    ]
    assert {t.meta["split"] for t in load_tasks(held_path)} == {"heldout"}


# -- episodes through the real agent loop -------------------------------------------------------


def _play(tok, turns: list[str], task: Task = TASK):
    engine = ScriptedEngine(tok, turns)
    budget = Budget(max_turns=3, max_tokens_per_turn=32, max_total_tokens=128)
    return asyncio.run(run_episode(engine, env_factory("toy-calc")(), task, budget, SamplingConfig(32)))


def test_scripted_episode_wins_and_matches_cold_start_traces(tok):
    from tools.cold_start import encode_episode

    call, answer = "<code>print(123*45+67)</code>", "<ans>5602</ans>"
    ep = _play(tok, [call, answer])
    assert ep.reward == 1.0 and ep.num_turns == 2 and ep.finish_reason == "answer"
    assert ep.prompt_tokens == 12 and ep.generated_tokens == 14 + 6
    text = tok.decode(ep.token_ids)
    assert text == (
        "<|user|>123*45+67<|end|><|assistant|><code>print(123*45+67)</code><|end|>"
        "<|tool|><out>5602</out><|end|><|assistant|><ans>5602</ans><|end|>"
    )
    # Tool output and markers are masked: the generated tokens are exactly the two turns.
    gen = [i for i, m in zip(ep.token_ids, ep.action_mask, strict=True) if m]
    assert tok.decode(gen) == call + answer
    # The cold start's teacher traces are tokenized exactly like this trajectory.
    turns = [(call, [{"role": "tool", "content": "<out>5602</out>"}]), (answer, [])]
    assert encode_episode(ChatRenderer(tok), [{"role": "user", "content": TASK.prompt}], turns) == (
        ep.token_ids,
        ep.action_mask,
    )


def test_scripted_episodes_that_lose(tok):
    ep = _play(tok, ["<code>print(123*46+67)</code>", "<ans>5647</ans>"])  # miscopied expression
    assert ep.reward == 0.0 and ep.finish_reason == "answer" and ep.num_turns == 2
    ep = _play(tok, ["<ans>5567</ans>"])  # guessed without the tool
    assert ep.reward == 0.0 and ep.num_turns == 1 and ep.generated_tokens == 6
    ep = _play(tok, ["<code>__import__('os')</code>", "<ans>0</ans>"])
    assert ep.reward == 0.0 and "<out>error</out>" in tok.decode(ep.token_ids)


# -- cold start ---------------------------------------------------------------------------------


def test_teacher_is_imperfect_and_failures_are_shorter():
    from tools.cold_start import teacher_episode

    rng = random.Random(0)
    eps = [teacher_episode(t, rng) for t in generate_toy_calc_tasks(2000, 0, "train")]
    success = sum(r for _, _, r in eps) / len(eps)
    assert 0.35 < success < 0.44  # 0.7 * 0.75 * 0.75 = 0.394
    n_turns = {1: [], 2: []}
    for _, turns, r in eps:
        n_turns[len(turns)].append(r)
    assert 0.25 < len(n_turns[1]) / len(eps) < 0.35  # the teacher skips the tool 30% of the time
    assert sum(n_turns[1]) / len(n_turns[1]) < 0.02  # its guess is exact only when 100 divides a


def test_cold_start_smoke_writes_a_loadable_model_and_seeded_evaluation_ignores_batching(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from runtime.engines.hf import TransformersEngine
    from tools.cold_start import evaluate, main, run_episodes

    threads = torch.get_num_threads()
    try:
        report = main(
            ["--out", str(tmp_path / "m"), "--steps", "5", "--batch-size", "8", "--eval-tasks", "8"]
        )
    finally:
        torch.set_num_threads(threads)
    assert report["steps"] == 5 and 0.0 <= report["heldout_T1"]["success"] <= 1.0
    assert json.loads((tmp_path / "m" / "cold_start.json").read_text())["parameters"] == report["parameters"]
    assert 200_000 < report["parameters"] < 500_000
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    assert model.config.vocab_size == len(tok) and tok.chat_template
    engine = TransformersEngine(tmp_path / "m")
    try:
        r = evaluate(engine, generate_toy_calc_tasks(4, 0, "heldout"), temperature=1.0, seed=0)
        # Seeded per task and sample: the same episodes whether they share the batch or run alone.
        tasks = generate_toy_calc_tasks(6, 1, "heldout")
        together = asyncio.run(run_episodes(engine, tasks, seed=3, samples=2))
        alone = asyncio.run(run_episodes(engine, tasks, seed=3, samples=2, concurrency=1))
        other = asyncio.run(run_episodes(engine, tasks, seed=4, samples=2))
    finally:
        asyncio.run(engine.close())
    assert r["episodes"] == 4
    assert len(together) == 12 and [e.token_ids for e in together] == [e.token_ids for e in alone]
    assert [e.token_ids for e in together] != [e.token_ids for e in other]


# -- for instruct models: the tool described, worked episodes before the task --------------------


def test_describe_tool_and_shots_open_the_chat_with_worked_episodes():
    env = ToyCalcEnv(describe_tool=True, shots=2)
    messages = env.reset(Task("t", "518*40+73", "20793"))
    assert messages[0] == {"role": "system", "content": TOOL_PROMPT}
    assert [m["role"] for m in messages[1:]] == ["user", "assistant", "tool", "assistant"] * 2 + ["user"]
    assert messages[-1] == {"role": "user", "content": "518*40+73"}
    for k, (expr, value) in enumerate(SHOTS):
        user, call, out, ans = messages[1 + 4 * k : 5 + 4 * k]
        assert (user["content"], call["content"]) == (expr, f"<code>{expr}</code>")
        # Each worked episode is one the environment itself scores as a win, through the tool.
        demo = ToyCalcEnv()
        demo.reset(Task("shot", expr, str(value)))
        assert demo.step(call["content"]).messages == [out]
        assert demo.step(ans["content"]).reward == 1.0
    # The examples come from the training split: no held-out task is shown with its answer.
    for expr, _ in SHOTS:
        a, rest = expr.split("*")
        b, c = rest.split("+")
        assert not heldout_expression(int(a), int(b), int(c)), expr
    # The episode itself is scored as before: the examples are context, not turns of its own.
    assert env.step("<code>518*40+73</code>").messages == [{"role": "tool", "content": "<out>20793</out>"}]
    assert env.step("<ans>20793</ans>").reward == 1.0


def test_shots_alone_keep_the_models_own_system_prompt():
    messages = ToyCalcEnv(shots=1).reset(Task("t", "1*2+3", "5"))
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "user"]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"shots": 3}, "shots must be an integer in 0..2"),
        ({"shots": -1}, "shots must be an integer in 0..2"),
        ({"shots": True}, "shots must be an integer"),
        ({"shots": "2"}, "shots must be an integer"),
        ({"describe_tool": "yes"}, "describe_tool must be true or false"),
        ({"describe_tool": True, "system_prompt": "x"}, "not both"),
    ],
)
def test_bad_instruct_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        ToyCalcEnv(**options)
