"""An agent whose model calls come from a child process (examples/plugins/subprocess_agent.py):
the child finds its episode's endpoint the way the OpenAI SDK and compatible tools do
(OPENAI_BASE_URL, OPENAI_API_KEY, OPENAI_MODEL, from `client.subprocess_env`), over real HTTP, and
the episode it plays is token for token the one an in-process agent plays on the same seed."""

from __future__ import annotations

import asyncio
import importlib
import os
import sys
from pathlib import Path

import pytest

from runtime.agent import run_episode
from runtime.chat_endpoint import Endpoint, served_url
from runtime.engines.base import SamplingConfig
from runtime.envs.agent import AgentEnv
from runtime.envs.base import Task
from runtime.episode import Budget

PLUGINS = Path(__file__).resolve().parents[2] / "examples" / "plugins"
TASK = Task("t1", "What is 2 + 3?", "5")
BUDGET = Budget(max_turns=4, max_tokens_per_turn=24, max_total_tokens=1024)

pytestmark = pytest.mark.process  # the child process


async def in_process(client, task) -> float:
    """The same call as chat_child.py's, made with spopp's own client."""
    reply = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": task.prompt}]
    )
    return float((reply.choices[0].message.content or "").strip() == task.answer)


async def reports_environment(client, task) -> float:
    """What a child would be handed: 1.0 only if the run's token is withheld and the episode's given."""
    env = client.subprocess_env
    return float(
        "SPOPP_API_TOKEN" not in env
        and env["OPENAI_API_KEY"] == client.api_key
        and env["OPENAI_MODEL"] == "policy"
        and env["OPENAI_BASE_URL"].startswith("http://127.0.0.1:")
        and env["OPENAI_BASE_URL"].endswith("/v1")
        and env["PATH"] == os.environ["PATH"]
    )


@pytest.fixture(scope="module")
def example():
    sys.path.insert(0, str(PLUGINS))
    importlib.invalidate_caches()
    try:
        yield importlib.import_module("subprocess_agent")
    finally:
        sys.path.remove(str(PLUGINS))
        sys.modules.pop("subprocess_agent", None)


def play(runner, engine, endpoint, fn, seed: int):
    env = AgentEnv(agent="tests.agents:placeholder", max_wall_s=120)
    env._fn = fn
    sampling = SamplingConfig(max_tokens=BUDGET.max_tokens_per_turn, seed=seed)
    return runner.run(run_episode(engine, env, TASK, BUDGET, sampling, endpoint=endpoint))


@pytest.mark.parametrize("seed", [0, 7])
def test_a_child_process_plays_the_episode_token_exact(seed, runner, tiny_engine, example):
    endpoint = Endpoint()  # serves no HTTP of its own: the child gets a loopback server's URL
    mine = play(runner, tiny_engine, endpoint, in_process, seed)
    child = play(runner, tiny_engine, endpoint, example.solve, seed)
    assert child.finish_reason == "agent", child.info
    assert child.info["calls"] == 1 and mine.info["calls"] == 1
    assert child.token_ids == mine.token_ids
    assert child.action_mask == mine.action_mask
    assert child.rollout_logprobs == mine.rollout_logprobs
    assert child.reward == mine.reward
    assert len(endpoint.sessions) == 0  # the episode's token is gone with it


def test_the_child_is_not_handed_the_runs_token(runner, tiny_engine, monkeypatch):
    monkeypatch.setenv("SPOPP_API_TOKEN", "the-runs-own-token")
    ep = play(runner, tiny_engine, Endpoint(), reports_environment, 0)
    assert ep.reward == 1.0, ep.info


def test_a_service_that_serves_the_routes_hands_out_its_own_url(runner, tiny_engine):
    """A replica sets its URL (from its host and bound port): no second server is started."""
    endpoint = Endpoint()
    endpoint.base_url = served_url("0.0.0.0", 8201)

    async def url_of(client, task) -> float:
        return float(client.subprocess_env["OPENAI_BASE_URL"] == "http://127.0.0.1:8201/v1")

    assert play(runner, tiny_engine, endpoint, url_of, 0).reward == 1.0
    assert endpoint._local is None
    assert served_url("::", 9) == "http://[::1]:9/v1" and served_url("10.1.2.3", 9) == "http://10.1.2.3:9/v1"


def test_the_loopback_server_refuses_a_call_without_the_episodes_token(runner, tiny_engine):
    """The URL a child is handed is as closed as the replica's routes: another token gets 401."""
    import httpx

    endpoint = Endpoint()

    async def probe(client, task) -> float:
        url = client.subprocess_env["OPENAI_BASE_URL"]
        async with httpx.AsyncClient(timeout=30) as http:
            body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
            stranger = await http.post(
                f"{url}/chat/completions", json=body, headers={"Authorization": "Bearer x"}
            )
            anonymous = await http.get(f"{url}/models")
        # A body announced over the bound is refused on its head, before a byte of it is sent.
        host, port = url.removeprefix("http://").removesuffix("/v1").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 9437184\r\n"
            + f"Authorization: Bearer {client.api_key}\r\n\r\n".encode()
        )
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 30)
        writer.close()
        huge = httpx.Response(int(status_line.split()[1]))
        return float((stranger.status_code, anonymous.status_code, huge.status_code) == (401, 401, 413))

    ep = play(runner, tiny_engine, endpoint, probe, 0)
    assert ep.reward == 1.0, ep.info


def test_a_new_event_loop_gets_a_new_server_and_the_old_socket_is_closed():
    """`spopp env check` runs asyncio.run once per check: a server of a closed loop can answer no
    one, so the next loop gets its own and the old socket is let go (not one descriptor per run)."""
    import asyncio as aio

    endpoint = Endpoint()

    async def url() -> str:
        return endpoint.url()

    aio.run(url())
    old = endpoint._local
    second = aio.run(url())
    assert second.startswith("http://127.0.0.1:") and endpoint._local is not old
    assert old.sock.fileno() == -1  # closed
