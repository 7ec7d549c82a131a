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
agent returns, as a built-in episode cut by a budget earns nothing, and every later call is
refused with the same code (nothing it generated could count). Sampling is the run's (the
learner's importance weights need the behaviour policy): a request may repeat the run's
temperature, top_p and top_k but not change them, and parameters that would change what is sampled
without the engine being told (seed, logit_bias, penalties, response_format) are refused unless at
their defaults.

What a request can cost is bounded before the work is done. Every request to the episode counts
toward `max_calls`, answered or refused, and is counted before its body is read (`begin_call`), so
an episode's token buys at most `max_calls` bodies read, parsed and checked. The text a call would
render is measured against the tokens left before anything is rendered: a token stands for at most
`chars_per_token(tokenizer)` characters of the rendered text (the longest token of the vocabulary,
times what normalization can fold into one character), so text longer than that many characters
per token left cannot fit and is refused at the cost of counting it, never tokenized (a 7 MiB
message was tokenized on the event loop for 9-12 s and 1 GB before the budget refused it). What
passes is rendered and tokenized in a worker thread (the tokenizer's batch call, which releases
the GIL), so other episodes' calls and the replica's probes are answered meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field, replace
from typing import Any

from .chat import ChatRenderer
from .engines.base import Engine, Generation, SamplingConfig
from .episode import Budget
from .token_sequence import TokenSequence
from .tool_calls import ToolFormat, arguments_value, calls_as_text, parse, preamble, tool_format

MAX_MESSAGES = 4096
MAX_STOP = 4
MAX_STOP_CHARS = 256
ROLES = ("system", "developer", "user", "assistant", "tool")
# A call of at most this many characters and messages to render is rendered on the event loop (a
# few milliseconds of work at most); a larger one in a worker thread. Messages count apart: the
# renderer's cost grows faster than their number (4,096 one-character messages: about 1 s).
ON_LOOP_CHARS = 16 * 1024
ON_LOOP_MESSAGES = 64
# OpenAI parameters that change what is sampled, refused unless at these defaults: the engine is
# not told them, and the learner's importance weights need the policy that did the sampling.
# (temperature, top_p and top_k may repeat the run's values: parse_options.)
NEUTRAL = {
    "seed": (None,),
    "logit_bias": (None, {}),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "min_p": (None, 0, 0.0),
    "response_format": (None, {"type": "text"}),
}


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


# -- how many characters a token can stand for ----------------------------------------------------
# Normalizers that never drop a character, with how many characters they can fold into one:
# canonical composition (NFC, NFKC) joins a base and its marks, at most 4 code points into one (the
# longest canonical decomposition in Unicode is 4, e.g. U+1F8F); the others only map or add.
_NORMALIZERS = {"NFC": 4, "NFKC": 4, "NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1}
# Pre-tokenizers that split the text without dropping any of it (Whitespace, WhitespaceSplit and
# BERT's drop whitespace; Split and Punctuation may be told to drop what they split on).
_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}


def _folds(normalizer: dict | None) -> int | None:
    """How many characters a normalizer turns into one at most; None when it may drop text."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for part in normalizer.get("normalizers", []):
            f = _folds(part)
            if f is None:
                return None
            factor *= f
        return factor
    if kind == "Replace":  # a literal replaced by a shorter (non-empty) one folds by their ratio
        literal, content = normalizer.get("pattern", {}).get("String"), normalizer.get("content", "")
        if not literal or not content:
            return None
        return max(1, math.ceil(len(literal) / len(content)))
    return _NORMALIZERS.get(kind)


def _keeps_text(pre: dict | None) -> bool:
    if pre is None:
        return True
    if pre.get("type") == "Sequence":
        return all(_keeps_text(part) for part in pre.get("pretokenizers", []))
    return pre.get("type") in _PRE_TOKENIZERS and pre.get("behavior", "Isolated") != "Removed"


def _chars_per_token(tokenizer) -> int | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    model = backend.model
    kind = type(model).__name__
    # A model that can stand one token for a run of text it does not know (BPE fusing unknown
    # characters, Unigram's unknown runs, WordPiece's unknown words) has no bound per token.
    if kind == "BPE":
        if model.unk_token is not None and model.fuse_unk and not model.byte_fallback:
            return None
    elif kind != "Unigram" or not json.loads(model.__getstate__()).get("byte_fallback"):
        return None

    def spec(part) -> dict | None:
        return None if part is None else json.loads(part.__getstate__())

    folds = _folds(spec(backend.normalizer))
    if folds is None or not _keeps_text(spec(backend.pre_tokenizer)):
        return None
    # A token's text in the vocabulary is at least as long as the characters it stands for: a
    # byte-level vocabulary writes one character per byte (and a character is a byte or more), a
    # SentencePiece one a character per character (a byte-fallback token, <0x41>, six for one).
    longest = max(len(t) for t in backend.get_vocab(with_added_tokens=True))
    return longest * folds


_RATIOS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_RATIOS_LOCK = threading.Lock()


def chars_per_token(tokenizer) -> int | None:
    """The most characters of rendered text one token of `tokenizer` can stand for; None when it
    has no such bound (no Rust backend, a normalizer or pre-tokenizer that drops text, a model that
    stands one token for unknown text of any length): then nothing is refused by length, and the
    token count decides, off the event loop. Per tokenizer, computed once (the vocabulary is read)."""
    with _RATIOS_LOCK:
        size = len(tokenizer)
        cached = _RATIOS.get(tokenizer)
        if cached is None or cached[0] != size:
            cached = _RATIOS[tokenizer] = (size, _chars_per_token(tokenizer))
        return cached[1]


@dataclass
class CallOptions:
    max_tokens: int | None
    stop: tuple[str, ...]
    tools: list[dict] | None
    logprobs: bool
    model: str
    keep_stop: bool = False  # vLLM's include_stop_str_in_output: the stop string stays in the content


def _same_number(key: str, value: Any, run_value: float) -> bool:
    """Whether `value` is the run's: a finite number (not a boolean) equal to it; for top_k, any
    value that turns it off (0 or below, as vLLM reads it) is the same as the run's off."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        return False
    if key == "top_k":
        return isinstance(value, int) and (value == run_value or (value <= 0 and run_value <= 0))
    return abs(float(value) - run_value) <= 1e-9


def parse_options(body: dict, sampling: SamplingConfig) -> CallOptions:
    run_values = (("temperature", sampling.temperature), ("top_p", sampling.top_p), ("top_k", sampling.top_k))
    for key, run_value in run_values:
        value = body.get(key)
        if value is not None and not _same_number(key, value, run_value):  # NaN and true are no run's value
            raise ChatRequestError(
                400, "sampling_is_the_run's",
                f"{key} is the run's ({run_value:g}): the learner's importance weights need the policy that sampled",
                key,
            )  # fmt: skip
    for key, neutral in NEUTRAL.items():
        value = body.get(key)
        # ==, but type-exact: 0 == False, and False is no penalty of 0.
        if not any(value == n and type(value) is type(n) for n in neutral):
            raise ChatRequestError(
                400, "unsupported_parameter",
                f"{key} is not supported (the run's sampling decides every token); leave it out",
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
    seq: TokenSequence
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


class _Render:
    """The ids one call adds to its segment before generating, as a job that may run in a worker
    thread: its inputs are its own (frozen messages, copies), and the renderer only reads shared
    state. `render(bound)` answers None, without rendering, when the text to render is longer than
    `bound` characters (then it cannot fit in the tokens left: see chars_per_token)."""

    def __init__(self, renderer: ChatRenderer, fmt: ToolFormat, messages: list[Message],
                 tools: list[dict] | None, after: list[int] | None) -> None:  # fmt: skip
        self.renderer, self.format, self.messages, self.tools = renderer, fmt, messages, tools
        self.after = after  # extending a segment: the ids last generated, whose turn is closed first
        # A first, cheap measure (no copies): whether the rendering may stay on the event loop. A
        # tool schema's size is known only once serialised: any goes to a thread.
        chars = sum(len(m.content) for m in messages) + sum(
            len(n) + len(a) for m in messages for n, a in m.tool_calls
        )
        self.small = chars <= ON_LOOP_CHARS and len(messages) <= ON_LOOP_MESSAGES and not tools

    def _rendered(self) -> tuple[list[dict], list[dict] | None, int]:
        """The messages as the template gets them, the tools it renders itself, and the characters
        of text the rendering certainly holds: every content as written or trimmed (ChatRenderer
        refuses a template that writes them otherwise), and the tools a template renders as JSON,
        at least as long as their compact form (a template that renders less of them is held to
        the same bound: a schema that could not fit as JSON is refused)."""
        rendered = [m.for_template(self.format) for m in self.messages]
        native = None
        extra = 0
        if self.after is None and self.tools:
            if self.format.native:
                native = self.tools
                extra = len(json.dumps(self.tools, ensure_ascii=False, separators=(",", ":")))
            else:  # the template would drop them: a system message in the Hermes format says them
                text = preamble(self.tools)
                if rendered[0]["role"] == "system":
                    rendered[0] = {**rendered[0], "content": rendered[0]["content"] + "\n\n" + text}
                else:
                    rendered.insert(0, {"role": "system", "content": text})
        chars = sum(len(m["content"].strip()) for m in rendered) + extra
        return rendered, native, chars

    def render(self, bound: int | None) -> list[int] | None:
        rendered, native, chars = self._rendered()
        if bound is not None and chars > bound:
            return None
        try:
            if self.after is not None:
                return self.renderer.close_turn(self.after) + self.renderer.continuation(rendered)
            return self.renderer.prompt(rendered, tools=native)
        except ValueError as e:
            raise ChatRequestError(400, "template_error", str(e), "messages") from None
        except Exception as e:  # noqa: BLE001 - jinja raises its own errors for messages a template refuses
            raise ChatRequestError(
                400, "template_error", f"the chat template refused the messages: {e}", "messages"
            ) from None


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
        self.calls = 0  # calls answered (the episode's turns)
        self.requests = 0  # requests taken, answered or refused: what max_calls bounds
        # Characters of rendered text one token stands for at most (None: no bound, the token
        # count decides): what lets a call too long for the tokens left be refused unrendered.
        self.chars_per_token = chars_per_token(engine.tokenizer)
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

    def _room(self, segment: _Segment) -> int:
        """Tokens `segment` may still grow by: under the episode's budget (every segment's tokens
        count against it, each is trained on) and the model's context."""
        room = self.budget.max_total_tokens - self.tokens()
        context = getattr(self.engine, "context_tokens", None)
        if context is not None:
            room = min(room, context - len(segment.seq.ids))
        return room

    def _no_room(self) -> ChatRequestError:
        return self._refuse(
            "max_total_tokens", f"no room left under the episode's {self.budget.max_total_tokens} tokens"
        )

    # -- a call -------------------------------------------------------------------------------
    def begin_call(self) -> None:
        """Count a request toward `max_calls` before anything of it is read; ChatRequestError when
        the episode takes no more (ended, cut by a bound, or its calls made). Every request counts,
        answered or refused: a refused one cost its body's reading and checking all the same."""
        if self.closed:
            raise ChatRequestError(410, "episode_over", "this episode has ended")
        if self.cut is not None:
            raise ChatRequestError(
                400,
                self.cut,
                f"this episode was cut by its {self.cut} bound: it earns 0 and takes no more calls",
            )
        if self.requests >= self.max_calls:
            raise self._refuse("max_calls", f"this episode has made its {self.max_calls} calls")
        self.requests += 1

    def uncount_call(self) -> None:
        """Take back begin_call's count for a request the server did not read for its own reasons
        (busy: the client is told to retry it as it was)."""
        self.requests = max(0, self.requests - 1)

    async def complete(self, body: Any, counted: bool = False) -> dict:
        """The chat completion (a JSON-ready dict) for one request body; ChatRequestError if refused.
        `counted`: begin_call was called for this request already (the route calls it before it
        reads the body)."""
        if not counted:
            self.begin_call()
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
        segment, per_call = await self._admit(messages, options)
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

    async def _admit(self, messages: list[Message], options: CallOptions) -> tuple[_Segment, int]:
        """Refuse a call past a bound, else add its prompt ids to its segment: (segment, tokens allowed).
        The text to render is measured first and refused if it cannot fit (never rendered); what
        may fit is rendered off the event loop when it is long."""
        segment, plan = self._plan(messages, options.tools)
        room = self._room(segment)
        # The new ids must leave a token to generate: room - 1 at most. A token stands for at most
        # chars_per_token characters, so text longer than that times room - 1 needs more tokens.
        bound = None if self.chars_per_token is None else self.chars_per_token * max(room - 1, 0)
        if plan.small:
            new_ids = plan.render(bound)
        else:
            new_ids = await asyncio.to_thread(plan.render, bound)
            if self.closed:  # the episode ended while the call was rendered
                raise ChatRequestError(410, "episode_over", "this episode has ended")
        if new_ids is None or room - len(new_ids) < 1:
            raise self._no_room()
        per_call = min(self.budget.max_tokens_per_turn, room - len(new_ids), options.max_tokens or room)
        if not self.segments or segment is not self.segments[-1]:  # a new segment
            self.segments.append(segment)
        segment.seq.add(new_ids)
        segment.last_generated = None
        self.calls += 1
        return segment, per_call

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

    def _plan(self, messages: list[Message], tools: list[dict] | None) -> tuple[_Segment, _Render]:
        """The segment this call continues (or a new one) and the rendering of the ids to add before
        generating: decided here, on the event loop (comparisons, no rendering), so that the
        rendering works on values of its own only."""
        current = self.segments[-1] if self.segments else None
        if (
            current is not None
            and current.last_generated is not None
            and len(messages) > len(current.history)
            and messages[: len(current.history)] == current.history
        ):
            tail = messages[len(current.history) :]
            return current, _Render(self.renderer, self.format, tail, None, list(current.last_generated))
        return _Segment(seq=TokenSequence(), history=[]), _Render(
            self.renderer, self.format, messages, tools, None
        )

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
