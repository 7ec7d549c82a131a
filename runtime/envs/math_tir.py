"""Math with tool-integrated reasoning: the model may run Python in a sandbox before it answers.

An episode: `reset(task)` gives [system, user]. Each model turn either

* ends in a Python tool call (the LAST `<code>...</code>` block or ```python fenced block of the
  turn, with no `\\boxed{}` after it): the code runs in a fresh bubblewrap sandbox and the
  environment answers with a `tool` message `<output>\\n...\\n</output>` (stdout, then stderr and
  any limit that stopped the run, truncated); the episode goes on; or
* has no tool call (or a boxed answer after its last code block): the episode ends and the reward
  is `check_answer(turn, task.answer)`, 1.0 or 0.0 (a check killed at its deadline or out of
  memory is 0.0, with `info["answer_check"]` saying why: `runtime.verify`).

A tool call beyond `max_tool_calls` ends the episode with reward 0 (`info["finish"] ==
"tool_budget"`), without running it. Only complete blocks count: a `<code>` the turn never closed
(a turn cut by the token limit) is not run.

Stop strings (`MathTIREnv.stop`): `"</code>"` and `"```\\n"`, so that the model's turn ends right
after a tool call and the model cannot write (hallucinate) the output itself. The engine keeps the
stop string in the turn's text. "```\\n" matches the closing fence of a ```python block (the
opening fence "```python\\n" does not contain it); it also ends the turn after the closing fence of
any other fenced block, and after a bare opening fence "```\\n". Such a turn holds no Python block,
so it counts as the final answer (usually without a box, reward 0): the system prompt asks for
`<code>` tags to keep this rare. A ReTool-style `<code>```python ...```</code>` stops at the inner
fence, whose block is then run.
"""

from __future__ import annotations

import re
from typing import Any

from runtime.sandbox.bubblewrap import SandboxConfig, SandboxResult, run_python

from ..verify import check_answer
from .base import Environment, StepResult, Task

DEFAULT_SYSTEM_PROMPT = (
    "You are a careful mathematician. You can run Python code to compute and check your work: write "
    "the code between <code> and </code> and end your turn right after </code>. The printed output "
    "comes back between <output> and </output>. Each run is a fresh Python process (the standard "
    "library and sympy are available; no network, no files from earlier runs, a few seconds of "
    "time), so print() what you need to see. When you are done, give the final answer in "
    "\\boxed{}."
)

_CODE_TAG_RE = re.compile(r"<code>(.*?)</code>", re.DOTALL)
_FENCE_RE = re.compile(r"```(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_INNER_FENCE_RE = re.compile(r"^\s*```(?:python3?|py)?[ \t]*\n(.*?)\n?```\s*$", re.DOTALL | re.IGNORECASE)


def find_tool_call(text: str) -> tuple[str, int] | None:
    """The code of the last complete tool-call block in `text` and where that block ends."""
    best: tuple[str, int] | None = None
    for m in _CODE_TAG_RE.finditer(text):
        code = m.group(1)
        inner = _INNER_FENCE_RE.match(code)
        if inner:
            code = inner.group(1)
        best = (code, m.end())
    for m in _FENCE_RE.finditer(text):
        if best is None or m.end() > best[1]:
            # A fence inside a <code> block ends before its </code>: the tag block wins then.
            best = (m.group(1), m.end())
    return best


def format_observation(res: SandboxResult, config: SandboxConfig) -> str:
    parts = []
    if res.stdout:
        parts.append(res.stdout.rstrip("\n"))
    if res.stderr:
        parts.append(res.stderr.rstrip("\n"))
    reason = res.killed_reason
    if reason == "wall_timeout":
        parts.append(f"[killed: wall-clock limit of {config.wall_seconds:g} s exceeded]")
    elif reason == "cpu_limit":
        parts.append(f"[killed: CPU time limit of {config.cpu_seconds} s exceeded]")
    elif reason == "memory_limit":
        parts.append(f"[memory limit of {config.memory_bytes // 2**20} MiB exceeded]")
    elif reason == "sandbox_memory_limit":
        parts.append(f"[killed: the run's memory limit of {config.total_memory_bytes // 2**20} MiB exceeded]")
    elif reason == "workdir_full":
        parts.append(f"[no space left: files are limited to {config.workdir_bytes // 2**20} MiB]")
    elif reason is not None:
        parts.append(f"[{reason.replace('_', ' ')}]")
    elif res.exit_code not in (0, None):
        parts.append(f"[exit code {res.exit_code}]")
    if not parts:
        parts.append("[no output: use print() to see values]")
    return "<output>\n" + "\n".join(parts) + "\n</output>"


class MathTIREnv(Environment):
    name = "math-tir"
    stop = ("</code>", "```\n")

    def __init__(
        self,
        sandbox_config: SandboxConfig | None = None,
        *,
        max_tool_calls: int = 8,
        strict: bool = False,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        verify_timeout_s: float = 5.0,
    ):
        self.sandbox_config = sandbox_config or SandboxConfig()
        self.max_tool_calls = max_tool_calls
        self.strict = strict
        self.system_prompt = system_prompt
        self.verify_timeout_s = verify_timeout_s
        self.task: Task | None = None
        self.tool_calls = 0
        self.sandbox_failures = 0
        self.turns = 0
        self.done = False

    @classmethod
    def prepare(cls, options: dict[str, Any]) -> None:
        """The sandbox must work here (bubblewrap, its namespaces): checked by running it once; the
        answer checks' first worker starts now, not in the first episode."""
        import logging

        from runtime.sandbox.bubblewrap import bounds, check_sandbox
        from runtime.sandbox.check_pool import shared_pool

        if "sandbox_config" in options:
            raise ValueError("sandbox_config is not an env_option (the sandbox's bounds are the machine's)")
        check_sandbox(SandboxConfig())
        logging.getLogger("spopp.sandbox").info(bounds(SandboxConfig()))
        shared_pool().warm()

    def reset(self, task: Task) -> list[dict]:
        self.task = task
        self.tool_calls = 0
        self.sandbox_failures = 0
        self.turns = 0
        self.done = False
        messages = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.append({"role": "user", "content": task.prompt})
        return messages

    def _info(self, **extra: Any) -> dict[str, Any]:
        return {
            "tool_calls": self.tool_calls,
            "sandbox_failures": self.sandbox_failures,
            "turns": self.turns,
            **extra,
        }

    def step(self, action: str) -> StepResult:
        if self.task is None or self.done:
            raise RuntimeError("step() needs a reset() first, and the episode is over")
        self.turns += 1
        call = find_tool_call(action)
        if call is not None and action.rfind("\\boxed", call[1]) != -1:
            call = None  # an answer after the last block: the model is done
        if call is None:
            self.done = True
            verdict = check_answer(
                action, self.task.answer, strict=self.strict, timeout_s=self.verify_timeout_s
            )
            info = self._info(finish="answer")
            if verdict.reason is not None:  # the check was killed or failed: scored as wrong
                info["answer_check"] = verdict.reason
            return StepResult([], done=True, reward=verdict.reward, info=info)
        if self.tool_calls >= self.max_tool_calls:
            self.done = True
            return StepResult([], done=True, reward=0.0, info=self._info(finish="tool_budget"))
        self.tool_calls += 1
        res = run_python(call[0], self.sandbox_config)
        if res.failed:
            self.sandbox_failures += 1
        tool = {
            "exit_code": res.exit_code,
            "timed_out": res.timed_out,
            "killed_reason": res.killed_reason,
            "duration_s": res.duration_s,
            "output_truncated": res.output_truncated,
        }
        message = {"role": "tool", "content": format_observation(res, self.sandbox_config)}
        return StepResult([message], done=False, reward=0.0, info=self._info(tool=tool))

    def close(self) -> None:
        self.task = None
        self.done = True
