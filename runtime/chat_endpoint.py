"""`POST /v1/chat/completions` (OpenAI's chat API) on the open agent sessions of a process.

The bearer token of a request is its episode's (`AgentSession.token`, made when the episode
starts and dropped when it ends), never the cluster's API token: an agent can reach its own
episode's model calls and nothing else (no tracker, no learner, no other episode). A finished
episode's token answers 401 like any unknown one.

Errors come in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`) so that the
`openai` client raises its own exceptions (BadRequestError, AuthenticationError) for them.
`stream: true` is answered as server-sent events of `chat.completion.chunk`s after the
generation ends (the engine returns a turn whole): clients that stream work unchanged.

The replica serves these routes over HTTP beside /healthz (agents in other processes may use
them with the episode's token); an agent function run by spopp gets an `openai.AsyncOpenAI`
bound to its episode (`episode_client`), which reaches the same routes in-process.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from functools import cache

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from spopp.api.json_keys import RepeatedKey, loads_unique

from .agent_session import AgentSession, AgentSessions, ChatRequestError

# Bound on a request body (a long agent history): the replica's HTTP server refuses bigger ones
# before they are read, and bounds what all requests in flight hold together
# (services.shell.middleware.BodyLimit).
MAX_CHAT_BODY_BYTES = 8 * 1024 * 1024
# Bodies parsed on the event loop at most (about a millisecond); larger ones in a worker thread.
ON_LOOP_BODY_BYTES = 64 * 1024

log = logging.getLogger("spopp.agents")


def _error(exc: ChatRequestError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def _token(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def parse_body(raw: bytes) -> object:
    """A request body as JSON; ChatRequestError when it is none, or when an object in it has a key
    twice (Python's parser keeps the last one silently: `{"messages": A, "messages": B}` would be
    read as B here and as A by a parser that keeps the first)."""
    try:
        return loads_unique(raw)
    except RepeatedKey as exc:
        key = str(exc)[:64]
        raise ChatRequestError(
            400, "duplicate_key", f"JSON key {key!r} appears twice in one object"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, ValueError):
        raise ChatRequestError(400, "invalid_json", "the body is not JSON") from None


def _chunks(result: dict) -> AsyncIterator[bytes]:
    """The completion as the chunks a streaming client reads: role, content, tool calls, finish."""
    choice = result["choices"][0]
    message = choice["message"]
    base = {
        "id": result["id"],
        "object": "chat.completion.chunk",
        "created": result["created"],
        "model": result["model"],
    }

    def event(delta: dict, finish: str | None = None) -> bytes:
        body = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    async def gen() -> AsyncIterator[bytes]:
        yield event({"role": "assistant", "content": ""})
        if message.get("content"):
            yield event({"content": message["content"]})
        for i, call in enumerate(message.get("tool_calls") or []):
            yield event({"tool_calls": [{"index": i, **call}]})
        yield event({}, choice["finish_reason"])
        yield b"data: [DONE]\n\n"

    return gen()


def add_chat_routes(app: FastAPI, sessions: AgentSessions) -> None:
    @app.post("/v1/chat/completions", tags=["agents"])
    async def chat_completions(request: Request):
        # The token first, and the request counted toward the episode's calls, before a byte of
        # the body is read: a caller without a live episode's token, or past its calls, gets its
        # refusal with nothing of its body read or held.
        try:
            session: AgentSession = sessions.get(_token(request))
            session.begin_call()
            # Read as a stream, not request.body(), which keeps the bytes on the request until the
            # answer: once parsed, the call (its wait for the session, its generation) keeps the
            # parsed body only.
            raw = b"".join([chunk async for chunk in request.stream()])
            body = (
                parse_body(raw)
                if len(raw) <= ON_LOOP_BODY_BYTES
                else await asyncio.to_thread(parse_body, raw)
            )
            del raw
            result = await session.complete(body, counted=True)
        except ChatRequestError as exc:
            return _error(exc)
        except ClientDisconnect:
            # The client left mid-body, or the server stopped reading it (its body limit answered
            # 413, or 503 when the bodies in flight hold the server's budget for them): no one to
            # answer here, and nothing to log as an error. A 503 is the server's "not now", which
            # a client retries as it was: that request does not count toward the episode's calls.
            if request.scope.get("spopp.body_refused") == 503:
                session.uncount_call()
            log.debug("a chat call's client left before its body was read")
            return Response(status_code=400)
        if isinstance(body, dict) and body.get("stream"):
            return StreamingResponse(_chunks(result), media_type="text/event-stream")
        return JSONResponse(result)

    @app.get("/v1/models", tags=["agents"])
    async def models(request: Request):
        try:
            sessions.get(_token(request))
        except ChatRequestError as exc:
            return _error(exc)
        return {
            "object": "list",
            "data": [{"id": "policy", "object": "model", "created": int(time.time()), "owned_by": "spopp"}],
        }


def chat_app(sessions: AgentSessions) -> FastAPI:
    """An app with only the chat routes: what an in-process agent client talks to."""
    app = FastAPI(title="spopp agent endpoint", docs_url=None, redoc_url=None, openapi_url=None)
    add_chat_routes(app, sessions)
    return app


class _QuietEpisodeCalls(logging.Filter):
    """Drops httpx's INFO line for each in-process model call (`http://episode/...`): a user's code
    that sets logging to INFO (verifiers' does) would otherwise get one per call of every episode
    (nine in an 8-episode `spopp env check`). Its other requests are logged as before."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno <= logging.INFO and _EPISODE_ORIGIN in str(record.args))


_EPISODE_ORIGIN = "http://episode/"
_quiet = _QuietEpisodeCalls()


def episode_client(endpoint: Endpoint, session: AgentSession, timeout_s: float):
    """An `openai.AsyncOpenAI` bound to `session`: its requests reach the endpoint's app in-process
    (no socket), with the episode's token; retries off (a refused call is the agent's to handle).
    Its `subprocess_env` is the same binding for a child process, over HTTP (`Endpoint.url`)."""
    import httpx

    logging.getLogger("httpx").addFilter(_quiet)  # once: a filter added twice is kept once

    http = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=endpoint.app), base_url="http://episode", timeout=timeout_s
    )
    client = _client_class()(
        base_url="http://episode/v1",
        api_key=session.token,
        http_client=http,
        max_retries=0,
        timeout=timeout_s,
    )
    client._spopp_endpoint = endpoint
    return client


# What a child process must not inherit from a service: the run's token reaches the tracker and
# the learner, which an agent's code has no business calling (docs/security.md).
_WITHHELD = ("SPOPP_API_TOKEN", "OPENAI_ORG_ID", "OPENAI_PROJECT_ID")
MODEL_NAME = "policy"


@cache
def _client_class():
    import openai

    class EpisodeClient(openai.AsyncOpenAI):
        """openai's client for one episode, in-process; `subprocess_env` hands the episode to a child."""

        _spopp_endpoint: Endpoint

        @property
        def subprocess_env(self) -> dict[str, str]:
            """The environment for a child process that plays this episode's model calls: this
            process's variables less the run's token, plus what the OpenAI SDK and compatible tools
            read: OPENAI_BASE_URL (this process's chat routes over HTTP, `.../v1`), OPENAI_API_KEY
            (the episode's token: it reaches this episode's calls and nothing else) and
            OPENAI_MODEL (the model name to ask for). Pass it whole: `subprocess.run(..., env=...)`.
            Read it inside the agent: outside a running event loop there is no server to name."""
            env = {k: v for k, v in os.environ.items() if k not in _WITHHELD}
            env.update(
                OPENAI_BASE_URL=self._spopp_endpoint.url(),
                OPENAI_API_KEY=self.api_key,
                OPENAI_MODEL=MODEL_NAME,
            )
            return env

    return EpisodeClient


class Endpoint:
    """A process's agent sessions and the app that serves their calls.

    `base_url`: where the process serves the app over HTTP (a replica or the evaluator sets it to
    its own port); unset, `url()` starts a loopback server for the app on the running loop."""

    def __init__(self) -> None:
        self.sessions = AgentSessions()
        self.app = chat_app(self.sessions)
        self.base_url: str | None = None
        self._local = None

    def url(self) -> str:
        """The chat routes' URL for a child process (`http://host:port/v1`)."""
        if self.base_url is not None:
            return self.base_url
        from .local_server import LocalServer

        loop = asyncio.get_running_loop()
        if self._local is None or self._local.loop is not loop:  # one server per loop (asyncio.run twice)
            if self._local is not None:  # the last loop's: its socket would otherwise stay open
                self._local.close()
            self._local = LocalServer(self.app, loop, MAX_CHAT_BODY_BYTES)
        return self._local.url


def served_url(host: str, port: int) -> str:
    """The URL by which a child process on this machine reaches a service listening on host:port."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}/v1" if ":" in host else f"http://{host}:{port}/v1"


_default: Endpoint | None = None


def default_endpoint() -> Endpoint:
    """The process's endpoint where no service made its own (the evaluator, `spopp env check`)."""
    global _default
    if _default is None:
        _default = Endpoint()
    return _default
