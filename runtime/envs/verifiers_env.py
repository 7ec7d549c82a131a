"""`env: verifiers`: a verifiers taskset (prime-rl's environment standard, `verifiers.v1`) played by
the policy through the agent endpoint, its rewards as the reward.

A verifiers environment is a *taskset* (tasks, their rewards, stop conditions and tool servers) and
a *harness* (the agent program that plays a task, launched in a sandbox runtime, often installed
with uv from the network). spopp keeps the first and replaces the second with its own loop: every
model call goes through the episode's OpenAI client (`runtime.chat_endpoint`), so the trajectory is
the engine's tokens, token-exact, whatever the taskset.

    env: verifiers
    env_options:
      taskset: my_tasks                   # an installed taskset id, or package.module:MyTaskset
      config: {difficulty: 2}             # the taskset's config fields (vf.TasksetConfig)
      env: my_tasks:Dialogue              # optional: a vf.Env subclass whose run() drives the turns

What runs, per episode (one spopp task = one verifiers task, rebuilt from the task file's meta,
written by `spopp tasks verifiers`):

* **single-turn**: the task's system prompt and prompt, one reply, the task's `@vf.reward`s;
* **tools**: the tools of the task's and the taskset's `vf.Toolset`s are offered to the model
  (OpenAI `tools`), its calls run in this process through the toolset's own MCP server object
  (`mcp.server.mcpserver.MCPServer`, no socket), and the model is called again until it answers
  without a call, a `@vf.stop` hook says stop, or `max_turns` replies were sampled;
* **multi-turn**: a `vf.Env` subclass's `run(task, agents)` holds the conversation: its seat's
  `interaction(task)` gives `turn(message)`, which answers one user turn as above and returns a
  `vf.Segment`. spopp trains one seat, so an env that asks for a second model (a simulated user, a
  judge agent) is refused with that reason; its `finalize(task, episode)` runs, as in verifiers.

The reward is the trace's (`vf.Trace.reward`: the sum of each reward's score times its weight),
after `Task.score`; as for every environment it must be a finite number in [0, 1], else the episode
scores 0 and says why. Signals that need a sandbox runtime are skipped (there is none), as
verifiers does when scoring offline. What a taskset brings runs in the replica's process, as an
Environment class does: tasksets, rewards and tools are the user's own code, trusted like it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from importlib.metadata import version as _version
from pathlib import Path
from typing import Any

from .agent import AgentEnv
from .base import Task
from .import_path import import_object, is_import_path

META_KEY = "verifiers"  # a spopp task's meta field holding the verifiers task's wire data
NO_ANSWER = "[scored by the taskset's rewards]"  # a task file's answer when the task has no `answer` field
MAX_TOOL_OUTPUT_CHARS = 16_000
# The tasksets' shared tool servers (Taskset.toolsets), set up once per process: by taskset and config.
_SHARED_SERVERS: dict[str, list] = {}  # a tool's reply, cut here: the episode's token budget is smaller


def _vf():
    try:
        import verifiers.v1 as vf
    except ImportError:
        raise ValueError(
            "env: verifiers needs the verifiers package: pip install 'spopp[verifiers]'"
        ) from None
    return vf


def load_taskset(spec: str, config: dict[str, Any] | None = None):
    """The taskset `spec` names (an installed verifiers taskset id, or package.module:Class of a
    `vf.Taskset` subclass), built with `config`; ValueError saying what is wrong."""
    vf = _vf()
    from pydantic import ValidationError
    from verifiers.v1.utils.generic import concrete_type

    config = dict(config or {})
    try:
        if is_import_path(spec):
            cls = import_object(spec, f"verifiers taskset {spec}")
            if not (isinstance(cls, type) and issubclass(cls, vf.Taskset)):
                raise ValueError(f"verifiers taskset {spec}: not a vf.Taskset subclass")
            config_cls = concrete_type(cls, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
            return cls(config_cls(**config))
        config_cls = vf.taskset_config_type(spec)
        return vf.load_taskset(config_cls(**{**config, "id": spec}))
    except ValidationError as e:
        raise ValueError(f"verifiers taskset {spec}: bad config: {e}") from None
    except (ImportError, AttributeError, TypeError) as e:
        raise ValueError(f"verifiers taskset {spec}: {e}") from None


def task_records(taskset, limit: int | None = None) -> Iterator[Task]:
    """spopp tasks of `taskset`'s tasks (at most `limit`; an infinite taskset needs one): the
    prompt's text for reading, the answer left to the rewards, the wire data in meta."""
    if not taskset.bounded and limit is None:
        raise ValueError("this taskset is infinite: give how many tasks to write")
    tasks = iter(taskset) if limit is None else iter(taskset.take(limit))
    for vtask in tasks:
        data = vtask.data.model_dump(mode="json", exclude_none=True)
        # A task file's prompt and answer must be text; here they are for reading (the tracker's
        # samples, the evaluator's tables): the episode is the verifiers task in meta.
        prompt = vtask.data.prompt_text or f"[{vtask.data.name or 'opened by the env'}]"
        answer = data.get("answer")
        answer = str(answer) if isinstance(answer, str | int | float) and str(answer).strip() else NO_ANSWER
        yield Task(task_id=f"vf-{vtask.key[:20]}", prompt=prompt, answer=answer, meta={META_KEY: data})


def write_verifiers_tasks(
    out: str | Path, spec: str, config: dict | None = None, n_heldout: int = 0, seed: int = 0,
    limit: int | None = None,
) -> tuple[Path, Path]:  # fmt: skip
    """train.jsonl and heldout.jsonl in `out`: the taskset's tasks shuffled with `seed`, the last
    `n_heldout` held out (none is both: tasks are told apart by their key)."""
    import random

    from ..tasks import write_jsonl

    records = list(task_records(load_taskset(spec, config), limit))
    unique = list({t.task_id: t for t in records}.values())
    if len(unique) < len(records):
        raise ValueError(
            f"verifiers taskset {spec}: {len(records) - len(unique)} tasks repeat another's data"
        )
    if not 0 <= n_heldout < len(unique):
        raise ValueError(f"verifiers taskset {spec}: {len(unique)} tasks, cannot hold out {n_heldout}")
    random.Random(seed).shuffle(unique)
    cut = len(unique) - n_heldout
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(unique[:cut], out / "train.jsonl")
    write_jsonl(unique[cut:], out / "heldout.jsonl")
    return out / "train.jsonl", out / "heldout.jsonl"


class VerifiersEnv(AgentEnv):
    """A verifiers taskset's episodes, played by `AgentEnv.play` with `self.function` (its `solve`)."""

    name = "verifiers"

    def __init__(
        self,
        *,
        taskset: str,
        config: dict | None = None,
        env: str | None = None,
        seat: str | None = None,
        max_turns: int = 8,
        tool_timeout_s: float = 30.0,
        max_calls: int = 16,
        max_wall_s: float = 600.0,
    ) -> None:
        if not isinstance(taskset, str) or not taskset:
            raise ValueError(
                f"taskset must be a verifiers taskset id or package.module:Class, got {taskset!r}"
            )
        if config is not None and not isinstance(config, dict):
            raise ValueError(f"config must be a mapping of the taskset's config fields, got {config!r}")
        if env is not None and not is_import_path(env):
            raise ValueError(f"env must be an import path package.module:MyEnv, got {env!r}")
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or not 1 <= max_turns <= 1000:
            raise ValueError(f"max_turns must be an integer in [1, 1000], got {max_turns!r}")
        if (
            isinstance(tool_timeout_s, bool)
            or not isinstance(tool_timeout_s, int | float)
            or not 0 < tool_timeout_s <= 3600
        ):
            raise ValueError(f"tool_timeout_s must be in (0, 3600], got {tool_timeout_s!r}")
        self._set_bounds(max_calls, max_wall_s)
        self.taskset_spec, self.taskset_config = taskset, dict(config or {})
        self.env_spec, self.seat = env, seat
        self.max_turns, self.tool_timeout_s = max_turns, float(tool_timeout_s)
        self._taskset: Any = None
        self._env_cls: Any = None

    @classmethod
    def prepare(cls, options: dict[str, Any]) -> None:
        env = cls(**options)
        env.taskset  # noqa: B018 - loads it: a bad taskset fails at start-up, with what is wrong
        env.env_class  # noqa: B018
        env.seat_name  # noqa: B018
        import openai  # noqa: F401 - a dependency of spopp[rollout]: the client the loop calls

    @property
    def taskset(self):
        if self._taskset is None:
            self._taskset = load_taskset(self.taskset_spec, self.taskset_config)
        return self._taskset

    @property
    def env_class(self):
        """The `vf.Env` subclass of option `env`, or None (the plain single-agent episode)."""
        if self.env_spec is not None and self._env_cls is None:
            vf = _vf()
            cls = import_object(self.env_spec, f"verifiers env {self.env_spec}")
            if not (isinstance(cls, type) and issubclass(cls, vf.Env)):
                raise ValueError(f"verifiers env {self.env_spec}: not a vf.Env subclass")
            self._env_cls = cls
        return self._env_cls

    @property
    def seat_name(self) -> str:
        """The seat the policy plays: option `seat`, or the env's only seat ("agent" without one)."""
        if self.env_class is None:
            return self.seat or "agent"
        from verifiers.v1.configs.agent import agent_config_fields
        from verifiers.v1.utils.generic import concrete_type

        vf = _vf()
        config_cls = concrete_type(self.env_class, vf.EnvConfig, origin=vf.Env) or vf.EnvConfig
        seats = list(agent_config_fields(config_cls.model_construct()))
        if self.seat is not None:
            if self.seat not in seats:
                raise ValueError(f"verifiers env {self.env_spec}: no seat {self.seat!r} (its seats: {seats})")
            return self.seat
        if len(seats) != 1:
            raise ValueError(
                f"verifiers env {self.env_spec}: seats {seats}; say which one the policy plays (option seat)"
            )
        return seats[0]

    @property
    def author(self) -> str:
        return f"verifiers taskset {self.taskset_spec}" + (f" (env {self.env_spec})" if self.env_spec else "")

    @property
    def function(self):
        return self.solve

    def task_of(self, task: Task):
        """The verifiers task a spopp task carries (written by `spopp tasks verifiers`)."""
        data = task.meta.get(META_KEY) if isinstance(task.meta, dict) else None
        if not isinstance(data, dict):
            raise ValueError(
                f"task {task.task_id}: no verifiers task in its meta (write the task file with `spopp tasks verifiers`)"
            )
        task_cls = self.taskset.task_type()
        return task_cls(task_cls.data_type().model_validate(data), self.taskset.config.task)

    async def shared_servers(self) -> list:
        """The taskset's tool servers (`Taskset.toolsets`): set up once per process and taskset, as
        verifiers shares them (a replica makes an environment object per episode, so they live in
        a module-level table, not on `self`). Two first episodes at once may both set them up; the
        first to finish is kept."""
        key = json.dumps([self.taskset_spec, self.taskset_config], sort_keys=True, default=str)
        if key not in _SHARED_SERVERS:
            servers = []
            for toolset in type(self.taskset).toolsets(self.taskset.config):
                await toolset.setup()
                servers.append(toolset)
            _SHARED_SERVERS.setdefault(key, servers)
        return _SHARED_SERVERS[key]

    async def solve(self, client, task: Task) -> float:
        """One episode: the task played by the policy through `client`; the trace's reward."""
        vf = _vf()
        vtask = self.task_of(task)
        async with _Tools.open(self, vtask) as tools:
            seat = _Seat(self.seat_name, client, tools, self)
            env_cls = self.env_class
            if env_cls is None:
                await seat.run(vtask)
                trace = seat.trace_of_run
            else:
                env = _bare_env(env_cls, self)
                agents = _Agents(seat)
                await env.setup(agents)
                if not seat.trainable:
                    raise ValueError(
                        f"verifiers env {self.env_spec}: setup made seat {seat.name!r} untrainable"
                    )
                await env.run(vtask, agents)
                if seat.trace_of_run is None:
                    raise ValueError(f"verifiers env {self.env_spec}: run() never played seat {seat.name!r}")
                trace = seat.trace_of_run
                episode = vf.Episode(
                    env=vf.EnvInfo(id=self.env_spec),
                    task=vf.TraceTask(
                        type=type(vtask).__name__, data=vtask.data, key=vtask.key, hash=vtask.hash
                    ),
                    traces=[trace],
                )
                await env.finalize(vtask, episode)
        return float(trace.reward)


def _bare_env(env_cls, owner: VerifiersEnv):
    """An instance of a `vf.Env` subclass for its hooks (setup, run, finalize) alone: verifiers'
    constructor loads harnesses and tool-server machinery that spopp's loop replaces."""
    vf = _vf()
    from verifiers.v1.utils.generic import concrete_type

    config_cls = concrete_type(env_cls, vf.EnvConfig, origin=vf.Env) or vf.EnvConfig
    env = object.__new__(env_cls)
    env.config = config_cls.model_construct()
    env.taskset = owner.taskset
    return env


class _Tools:
    """The tools of one episode: the taskset's shared servers and the task's own, each an in-process
    MCP server; `specs` in OpenAI's shape, `call` runs one by its advertised name."""

    def __init__(self, servers: dict[str, Any], specs: list[dict], timeout_s: float) -> None:
        self._servers, self.specs, self._timeout_s = servers, specs, timeout_s

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, owner: VerifiersEnv, vtask) -> AsyncIterator[_Tools]:
        from mcp.server.mcpserver import MCPServer

        own = type(vtask).toolsets(vtask.config)
        started = []
        try:
            for toolset in own:
                await toolset.setup()
                started.append(toolset)
                await toolset.setup_task(vtask)
            servers: dict[str, Any] = {}
            specs: list[dict] = []
            for toolset in [*await owner.shared_servers(), *own]:
                if getattr(toolset.config, "url", None):
                    raise ValueError(
                        f"toolset {type(toolset).__name__}: remote tool servers (config.url) are not run by spopp"
                    )
                server = MCPServer(toolset.server_name or type(toolset).__name__)
                toolset.register(server)
                for tool in await server.list_tools():
                    # verifiers' harnesses advertise a server's tools as `<server>_<tool>`.
                    name = f"{toolset.server_name}_{tool.name}" if toolset.server_name else tool.name
                    if name in servers:
                        raise ValueError(f"two tools are named {name!r}: give a toolset its own TOOL_PREFIX")
                    servers[name] = (server, tool.name)
                    function = {
                        "name": name,
                        "description": tool.description or "",
                        "parameters": tool.input_schema,
                    }
                    specs.append({"type": "function", "function": function})
            yield cls(servers, specs, owner.tool_timeout_s)
        finally:
            for toolset in reversed(started):
                await toolset._exit_stack.aclose()  # what its setup entered (verifiers' own teardown)

    async def call(self, name: str, arguments: str) -> str:
        """The text of a tool's reply; a bad call gets an error text, as an MCP client would show."""
        if name not in self._servers:
            return f"error: no tool named {name!r}"
        try:
            args = json.loads(arguments or "{}")
        except json.JSONDecodeError as e:
            return f"error: the arguments are not JSON: {e}"
        if not isinstance(args, dict):
            return "error: the arguments must be a JSON object"
        server, tool = self._servers[name]
        try:
            result = await asyncio.wait_for(server.call_tool(tool, args), self._timeout_s)
        except TimeoutError:
            return f"error: the tool took longer than {self._timeout_s:g} s"
        except Exception as e:  # noqa: BLE001 - a failing tool is an observation, as over MCP
            return f"error: {type(e).__name__}: {e}"[:MAX_TOOL_OUTPUT_CHARS]
        texts = [getattr(c, "text", None) for c in getattr(result, "content", [])]
        text = "\n".join(t if t is not None else "[non-text content]" for t in texts)
        if getattr(result, "is_error", False):  # mcp 2's CallToolResult
            text = f"error: {text}"
        return text[:MAX_TOOL_OUTPUT_CHARS]


class _Seat:
    """The seat the policy plays: `interaction(task)` and `run(task)`, the subset of verifiers'
    `Agent` that an env's `run()` uses, answered by the episode's client."""

    def __init__(self, name: str, client, tools: _Tools, owner: VerifiersEnv) -> None:
        self.name, self.client, self.tools, self.owner = name, client, tools, owner
        self.trainable = True
        self.trace_of_run = None

    @contextlib.asynccontextmanager
    async def interaction(self, task) -> AsyncIterator[_Interaction]:
        if self.trace_of_run is not None:
            raise ValueError(f"seat {self.name!r} played twice: spopp scores one trace per episode")
        interaction = _Interaction(self, task)
        self.trace_of_run = interaction.trace
        try:
            yield interaction
        finally:
            await interaction.close()

    async def run(self, task):
        async with self.interaction(task) as interaction:
            if task.data.prompt is not None:
                await interaction.turn()
        return self.trace_of_run


class _Agents:
    """`agents` as an env's hooks see it: the one seat spopp plays, by name."""

    def __init__(self, seat: _Seat) -> None:
        self._seat = seat

    def __getattr__(self, name: str) -> _Seat:
        if name.startswith("_"):
            raise AttributeError(name)
        if name != self._seat.name:
            raise ValueError(
                f"this env asks for seat {name!r}; spopp trains one seat per episode ({self._seat.name!r}) "
                "and runs no second model (a simulated user, a judge agent)"
            )
        return self._seat


class _Interaction:
    """One seat's conversation on a task, turn by turn, kept as a `vf.Trace` for the task's hooks."""

    def __init__(self, seat: _Seat, task) -> None:
        vf = _vf()
        self.seat, self.task, self._vf = seat, task, vf
        self.trace = vf.Trace(
            task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            agent=vf.AgentInfo(config=vf.AgentConfig(), name=seat.name),
            # Given, not defaulted: the default asks git for verifiers' commit, a blocking process.
            verifiers=vf.VersionInfo(version=_version("verifiers")),
        )
        self.messages: list[dict] = []  # the conversation, in OpenAI's shape, as the client sends it
        if task.data.system_prompt:
            self._add({"role": "system", "content": task.data.system_prompt})
        self._started = False
        self._closed = False

    def _add(self, message: dict, sampled: bool = False) -> None:
        from verifiers.v1.dialects.chat import parse_message

        self.messages.append(message)
        parent = len(self.trace.nodes) - 1 if self.trace.nodes else None
        self.trace.nodes.append(
            self._vf.MessageNode(message=parse_message(message), parent=parent, sampled=sampled)
        )

    async def turn(self, message=None):
        vf = self._vf
        if self._closed or self.trace.is_completed:
            return vf.Segment(messages=[], terminated=True)
        prompted = not self._started and self.task.data.prompt is not None
        if message is None and not prompted:
            raise ValueError("a bare turn() takes a prompted task's opening reply; this turn needs a message")
        if message is not None and prompted:
            raise ValueError("the task's prompt opens the exchange: take its first reply with a bare turn()")
        if prompted:
            prompt = self.task.data.prompt
            for m in [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt:
                self._add(m if isinstance(m, dict) else m.model_dump(exclude_none=True))
        elif isinstance(message, str):
            self._add({"role": "user", "content": message})
        else:
            for m in message:
                self._add(m if isinstance(m, dict) else m.model_dump(exclude_none=True))
        self._started = True
        start = len(self.trace.nodes)
        if not await self._segment():
            return vf.Segment(messages=[], terminated=True)
        new = [n.message for n in self.trace.nodes[start:]]
        return vf.Segment(messages=new)

    async def _segment(self) -> bool:
        """Model replies (and their tool calls) until one calls no tool; False when the exchange
        ended before any reply (a limit or a stop hook had ended it)."""
        from verifiers.v1.utils.decorators import invoke_all

        replied = False
        while not self.trace.is_completed:
            if self.trace.num_turns >= self.seat.owner.max_turns:
                self.trace.stop("max_turns")
                break
            kwargs: dict[str, Any] = {"model": "policy", "messages": self.messages}
            if self.seat.tools.specs:
                kwargs["tools"] = self.seat.tools.specs
            reply = await self.seat.client.chat.completions.create(**kwargs)
            choice = reply.choices[0]
            calls = list(choice.message.tool_calls or [])
            message: dict[str, Any] = {"role": "assistant", "content": choice.message.content or ""}
            if calls:
                message["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": c.function.arguments},
                    }
                    for c in calls
                ]
            self._add(message, sampled=True)
            replied = True
            if choice.finish_reason == "length":
                self.trace.stop("max_output_tokens")
                break
            for call in calls:
                out = await self.seat.tools.call(call.function.name, call.function.arguments)
                self._add(
                    {"role": "tool", "tool_call_id": call.id, "content": out, "name": call.function.name}
                )
            stops = self.task.hooks("stop")
            verdicts = await invoke_all(stops, {"task": self.task.data, "trace": self.trace})
            for fn, verdict in zip(stops, verdicts, strict=True):
                if verdict:
                    self.trace.stop(fn.__name__)
                    break
            if not calls:
                break
        return replied

    async def close(self):
        """The exchange over: the task's rewards scored on its trace (once)."""
        if not self._closed:
            self._closed = True
            self.trace.stop("user_closed")
            await self.task.score(self.trace)
        return self.trace
