"""One agent-driven episode: OpenAI-style chat requests in, a token-exact trajectory out.

An agent (the user's code, `runtime.envs.agent`) calls the model through the replica's
`POST /v1/chat/completions` as often as it likes; each call lands in the episode's session here.
What the session records is what the engine did, never a re-tokenization:

* the first call's messages are rendered with the chat template (`tools` included), the engine
  continues those ids, and its ids and log-probs are appended as they came (mask 1);
* a later call whose messages are the previous call's messages, then the assistant message this
  session returned, then new messages (tool results, a user turn) *extends* the segment: the turn
  is closed after the generated ids and only the new messages are rendered (`ChatRenderer`, the
  same incremental rendering as built-in environments, so a template that rewrites earlier turns
  cannot change what was sampled);
* any other call (the agent rewrote, cut or summarised its history) starts a new *segment*: its
  messages are rendered afresh. Every segment is trained with the episode's advantage; the
  learner trains each apart (`Trajectory.segment_starts`), and the episode records how many.

Bounds, per episode: calls (`max_calls`), tokens over all segments (`Budget.max_total_tokens`,
the model's context included), tokens per call (`Budget.max_tokens_per_turn`). A call past a bound
is refused with a 400 whose code names it, and the episode is cut: its reward is 0 whatever the
agent returns, as a built-in episode cut by a budget earns nothing. Sampling is the run's (the
learner's importance weights need the behaviour policy): a request may repeat the run's
temperature and top_p but not change them.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from .agent import Budget, _Sequence
from .chat import ChatRenderer
from .engines.base import Engine, Generation, SamplingConfig
from .tool_calls import ToolFormat, arguments_value, calls_as_text, parse, preamble, tool_format

MAX_MESSAGES = 4096
MAX_STOP = 4
MAX_STOP_CHARS = 256
ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatRequestError(Exception):
    """A request the session refuses: `status` and `code` go into the OpenAI-style error body."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def _text_of(content: Any, where: str) -> str:
    """A message content as text: a string, None, or OpenAI's list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise ChatRequestError(
                    400, "unsupported_content", f"{where}: only text parts are supported", "messages"
                )
            out.append(part["text"])
        return "".join(out)
    raise ChatRequestError(
        400, "invalid_content", f"{where}: content must be a string or text parts", "messages"
    )


def _canonical_calls(calls: Any, where: str) -> tuple:
    if calls is None:
        return ()
    if not isinstance(calls, list):
        raise ChatRequestError(400, "invalid_tool_calls", f"{where}: tool_calls must be a list", "messages")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ChatRequestError(
                400, "invalid_tool_calls", f"{where}: a tool call needs function.name", "messages"
            )
        arguments = fn.get("arguments", "")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        out.append((fn["name"], arguments))
    return tuple(out)


@dataclass(frozen=True)
class Message:
    """A chat message as far as the session compares and renders it (ids and extras ignored)."""

    role: str
    content: str
    tool_calls: tuple = ()  # ((name, arguments JSON text), ...)
    name: str | None = None

    def for_template(self, fmt: ToolFormat) -> dict:
        m: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.content,
        }
        if self.tool_calls:
            if fmt.native:
                m["tool_calls"] = [
                    {
                        "type": "function",
                        "function": {"name": n, "arguments": arguments_value(a)},
                    }
                    for n, a in self.tool_calls
                ]
            else:  # the template would drop them: written as the model writes calls
                text = calls_as_text([{"function": {"name": n, "arguments": a}} for n, a in self.tool_calls])
                m["content"] = (self.content + "\n" + text) if self.content else text
        if self.name and self.role == "tool":
            m["name"] = self.name
        return m


def parse_messages(raw: Any) -> list[Message]:
    if not isinstance(raw, list) or not raw:
        raise ChatRequestError(400, "invalid_messages", "messages must be a non-empty list", "messages")
    if len(raw) > MAX_MESSAGES:
        raise ChatRequestError(400, "too_many_messages", f"at most {MAX_MESSAGES} messages", "messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ChatRequestError(
                400, "invalid_role", f"{where}: role must be one of {', '.join(ROLES)}", "messages"
            )
        name = m.get("name") if isinstance(m.get("name"), str) else None
        calls = _canonical_calls(m.get("tool_calls"), where) if m["role"] == "assistant" else ()
        out.append(Message(m["role"], _text_of(m.get("content"), where), calls, name))
    if out[-1].role == "assistant":
        raise ChatRequestError(
            400, "assistant_last", "the last message is the assistant's: nothing to answer", "messages"
        )
    return out


@dataclass
class CallOptions:
    max_tokens: int | None
    stop: tuple[str, ...]
    tools: list[dict] | None
    logprobs: bool
    model: str
    keep_stop: bool = False  # vLLM's include_stop_str_in_output: the stop string stays in the content


def parse_options(body: dict, sampling: SamplingConfig) -> CallOptions:
    for key, run_value in (("temperature", sampling.temperature), ("top_p", sampling.top_p)):
        value = body.get(key)
        if value is not None and (not isinstance(value, int | float) or abs(float(value) - run_value) > 1e-9):
            raise ChatRequestError(
                400, "sampling_is_the_run's",
                f"{key} is the run's ({run_value:g}): the learner's importance weights need the policy that sampled",
                key,
            )  # fmt: skip
    if body.get("n") not in (None, 1):
        raise ChatRequestError(400, "unsupported_n", "n must be 1 (one episode, one sample per call)", "n")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise ChatRequestError(
            400, "invalid_max_tokens", "max_tokens must be a positive integer", "max_tokens"
        )
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if (
        not isinstance(stop, list)
        or len(stop) > MAX_STOP
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop)
    ):
        raise ChatRequestError(400, "invalid_stop", f"stop: at most {MAX_STOP} non-empty strings", "stop")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise ChatRequestError(400, "invalid_tools", "tools must be a list of function specs", "tools")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise ChatRequestError(
            400, "unsupported_tool_choice", "tool_choice must be auto or none", "tool_choice"
        )
    if choice == "none":
        tools = None
    if body.get("top_logprobs"):
        raise ChatRequestError(
            400, "unsupported_top_logprobs", "top_logprobs is not supported", "top_logprobs"
        )
    model = body.get("model")
    return CallOptions(
        max_tokens=max_tokens,
        stop=tuple(stop),
        tools=tools or None,
        logprobs=bool(body.get("logprobs")),
        model=model if isinstance(model, str) else "policy",
        keep_stop=body.get("include_stop_str_in_output") is True,
    )


@dataclass
class _Segment:
    seq: _Sequence
    history: list[Message]  # the messages the segment stands for, ending with our assistant reply
    last_generated: list[int] | None = None  # ids of the last generation, until its turn is closed
    cut: bool = False  # the last generation ended at its token limit


@dataclass
class SessionRecord:
    """What an agent episode generated, as the agent loop's Episode wants it."""

    token_ids: list[int]
    action_mask: list[int]
    rollout_logprobs: list[float]
    token_versions: list[int | None]
    segment_starts: list[int]
    prompt_tokens: int
    calls: int
    cut: str | None  # the budget that cut the episode (its reward is then 0), else None
    generate_s: float
    endpoint_s: float = 0.0


class AgentSession:
    """The calls of one episode, serialised (a call waits for the previous one to end)."""

    def __init__(
        self,
        engine: Engine,
        renderer: ChatRenderer,
        budget: Budget,
        sampling: SamplingConfig,
        max_calls: int = 16,
    ) -> None:
        self.engine = engine
        self.renderer = renderer
        self.budget = budget
        self.sampling = sampling
        self.max_calls = max_calls
        self.token = "ep-" + secrets.token_urlsafe(24)
        self.format = tool_format(getattr(engine.tokenizer, "chat_template", None))
        self.segments: list[_Segment] = []
        self.calls = 0
        self.cut: str | None = None
        self.closed = False
        self.generate_s = 0.0
        self.call_s = 0.0  # whole calls, rendering and response included
        self._lock = asyncio.Lock()

    # -- accounting ---------------------------------------------------------------------------
    def tokens(self) -> int:
        return sum(len(s.seq.ids) for s in self.segments)

    def _refuse(self, code: str, message: str) -> ChatRequestError:
        self.cut = self.cut or code
        return ChatRequestError(400, code, message)

    # -- a call -------------------------------------------------------------------------------
    async def complete(self, body: Any) -> dict:
        """The chat completion (a JSON-ready dict) for one request body; ChatRequestError if refused."""
        if not isinstance(body, dict):
            raise ChatRequestError(400, "invalid_body", "the body must be a JSON object")
        messages = parse_messages(body.get("messages"))
        options = parse_options(body, self.sampling)
        async with self._lock:
            if self.closed:
                raise ChatRequestError(410, "episode_over", "this episode has ended")
            started = time.perf_counter()
            try:
                return await self._complete(messages, options)
            finally:
                self.call_s += time.perf_counter() - started

    async def _complete(self, messages: list[Message], options: CallOptions) -> dict:
        segment, per_call = self._admit(messages, options)
        # The episode's seed is kept for every call, as the agent loop keeps it for every turn: one
        # seed and one conversation sample the same tokens through the endpoint as in the loop.
        sampling = replace(
            self.sampling, max_tokens=per_call, stop=tuple(dict.fromkeys(self.sampling.stop + options.stop))
        )
        gen = await self._generate(segment, sampling)
        content, calls, finish = self._read_reply(gen, sampling.stop, options)
        reply = Message("assistant", content or "", _canonical_calls(calls, "reply") if calls else ())
        segment.history = [*messages, reply]
        return self._response(segment, gen, content, calls, finish, options)

    def _admit(self, messages: list[Message], options: CallOptions) -> tuple[_Segment, int]:
        """Refuse a call past a bound, else add its prompt ids to its segment: (segment, tokens allowed)."""
        if self.calls >= self.max_calls:
            raise self._refuse("max_calls", f"this episode has made its {self.max_calls} calls")
        segment, new_ids = self._place(messages, options.tools)
        per_call = self._tokens_allowed(segment, new_ids, options.max_tokens)
        if not self.segments or segment is not self.segments[-1]:  # a new segment
            self.segments.append(segment)
        segment.seq.add(new_ids)
        segment.last_generated = None
        self.calls += 1
        return segment, per_call

    def _tokens_allowed(self, segment: _Segment, new_ids: list[int], max_tokens: int | None) -> int:
        # Every segment's tokens count against the episode's budget (each is trained on).
        room = self.budget.max_total_tokens - self.tokens() - len(new_ids)
        context = getattr(self.engine, "context_tokens", None)
        if context is not None:
            room = min(room, context - len(segment.seq.ids) - len(new_ids))
        if room < 1:
            raise self._refuse(
                "max_total_tokens", f"no room left under the episode's {self.budget.max_total_tokens} tokens"
            )
        return min(self.budget.max_tokens_per_turn, room, max_tokens or room)

    async def _generate(self, segment: _Segment, sampling: SamplingConfig) -> Generation:
        s = time.perf_counter()
        gen = await self.engine.generate(segment.seq.ids, sampling)
        self.generate_s += time.perf_counter() - s
        segment.seq.add(gen.token_ids, gen.logprobs, gen.version)
        # A turn cut by its length is left open, as the agent loop leaves a cut turn: only a turn
        # the model ended gets the template's turn end after it.
        segment.last_generated = list(gen.token_ids)
        segment.cut = gen.finish_reason == "length"
        return gen

    def _read_reply(
        self, gen: Generation, stops: tuple[str, ...], options: CallOptions
    ) -> tuple[str, list, str]:
        """The generation as (content, tool calls, finish reason) for the response."""
        text = self.engine.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        finish = gen.finish_reason
        if finish == "stop" and not options.keep_stop:
            for stop in stops:  # as OpenAI's API: the stop string is not in the content
                if text.endswith(stop):
                    text = text[: -len(stop)]
                    break
        content, calls = parse(text, self.format) if options.tools else (text, [])
        if calls and finish == "stop":
            finish = "tool_calls"
        return content, calls, finish

    def _response(
        self, segment: _Segment, gen: Generation, content: str, calls: list, finish: str, options: CallOptions
    ) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        if options.logprobs:
            pieces = [self.engine.tokenizer.decode([t]) for t in gen.token_ids]
            choice["logprobs"] = {
                "content": [
                    {"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
                    for p, lp in zip(pieces, gen.logprobs, strict=True)
                ]
            }
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": options.model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(segment.seq.ids) - len(gen.token_ids),
                "completion_tokens": len(gen.token_ids),
                "total_tokens": len(segment.seq.ids),
            },
        }

    def _place(self, messages: list[Message], tools: list[dict] | None) -> tuple[_Segment, list[int]]:
        """The segment this call continues (or a new one) and the ids to add before generating."""
        current = self.segments[-1] if self.segments else None
        if (
            current is not None
            and current.last_generated is not None
            and len(messages) > len(current.history)
            and messages[: len(current.history)] == current.history
        ):
            tail = [m.for_template(self.format) for m in messages[len(current.history) :]]
            try:
                more = self.renderer.close_turn(current.last_generated) + self.renderer.continuation(tail)
            except ValueError as e:
                raise ChatRequestError(400, "template_error", str(e), "messages") from None
            return current, more
        rendered = [m.for_template(self.format) for m in messages]
        native_tools = tools if (tools and self.format.native) else None
        if tools and not self.format.native:
            text = preamble(tools)
            if rendered[0]["role"] == "system":
                rendered[0] = {**rendered[0], "content": rendered[0]["content"] + "\n\n" + text}
            else:
                rendered.insert(0, {"role": "system", "content": text})
        try:
            ids = self.renderer.prompt(rendered, tools=native_tools)
        except ValueError as e:
            raise ChatRequestError(400, "template_error", str(e), "messages") from None
        except Exception as e:  # noqa: BLE001 - jinja raises its own errors for messages a template refuses
            raise ChatRequestError(
                400, "template_error", f"the chat template refused the messages: {e}", "messages"
            ) from None
        return _Segment(seq=_Sequence(), history=[]), ids

    # -- the end ------------------------------------------------------------------------------
    def close(self) -> SessionRecord:
        """End the episode: no call is taken after this; the record of what was generated."""
        self.closed = True
        ids: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        versions: list[int | None] = []
        starts: list[int] = []
        prompt_tokens = 0
        for i, segment in enumerate(self.segments):
            if segment.last_generated is not None and not segment.cut:  # as the agent loop closes it
                segment.seq.add(self.renderer.close_turn(segment.last_generated))
                segment.last_generated = None
            if i == 0:
                prompt_tokens = segment.seq.mask.index(1) if 1 in segment.seq.mask else len(segment.seq.ids)
            starts.append(len(ids))
            ids += segment.seq.ids
            mask += segment.seq.mask
            logprobs += segment.seq.logprobs
            versions += segment.seq.versions
        return SessionRecord(
            token_ids=ids,
            action_mask=mask,
            rollout_logprobs=logprobs,
            token_versions=versions,
            segment_starts=starts,
            prompt_tokens=prompt_tokens,
            calls=self.calls,
            cut=self.cut,
            generate_s=self.generate_s,
            endpoint_s=max(0.0, self.call_s - self.generate_s),
        )


@dataclass
class AgentSessions:
    """The open sessions of a process, by token; at most `max_sessions` at once."""

    max_sessions: int = 1024
    _open: dict[str, AgentSession] = field(default_factory=dict)

    def open(self, session: AgentSession) -> None:
        if len(self._open) >= self.max_sessions:
            raise ChatRequestError(503, "too_many_sessions", f"{self.max_sessions} agent episodes are open")
        self._open[session.token] = session

    def get(self, token: str | None) -> AgentSession:
        session = self._open.get(token or "")
        if session is None:
            raise ChatRequestError(401, "invalid_api_key", "no open episode has this token")
        return session

    def close(self, session: AgentSession) -> SessionRecord:
        self._open.pop(session.token, None)
        return session.close()

    def __len__(self) -> int:
        return len(self._open)
