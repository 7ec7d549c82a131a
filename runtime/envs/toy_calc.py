"""Toy calculator tool use (`toy-calc`): the CPU demo's task family, where calling the tool really helps.

A task is `a*b+c` (a in 100-999, b and c in 10-99), the prompt is the bare expression and the
answer its value. An episode: `reset(task)` gives [user]; each model turn must be exactly one block:

* `<code>EXPR</code>` or `<code>print(EXPR)</code>`: the environment evaluates EXPR itself with a
  tiny integer evaluator (digits, + - *, parentheses, unary minus; never `eval`) and answers with a
  `tool` message `<out>VALUE</out>`, or `<out>error</out>` for anything else; the episode goes on;
* `<ans>N</ans>`: the episode ends, reward 1 iff N is the exact integer answer.

Anything else (text around a block, an unclosed block, two blocks) ends the episode with reward 0
(`finish == "malformed"`): a toy model's only way to earn reward is the clean format. Tool calls
beyond `max_tool_calls` end it with reward 0 (`finish == "tool_budget"`). Stop strings `</code>` and
`</ans>` end a turn right after its block, so the model never writes the tool output itself.

For a pretrained instruct model (env_options, both off by default): `describe_tool` opens the
conversation with a system message that describes the tool and the answer format (TOOL_PROMPT), and
`shots` (0-2) puts that many worked episodes before the task, as earlier turns of the same chat
(user: the expression; assistant: the tool call; tool: its output; assistant: the answer). A small
instruct model follows a demonstrated format far more often than a described one: SmolLM2-135M,
sampled at T = 1 on 32 held-out tasks, wrote the exact tool call for 0 of them with one example and
20 with two. The examples are fixed expressions of the training split, never a held-out task.

Two knobs for `spopp map` and a switch for the first (env_options; all off by default, and nothing
else changes with them):

* `coupling` in [-1, 1] couples a response's length with its success, signed like the correlation
  it makes: below 0 failures are longer, as in ALFWorld, where failures run on to the interaction
  cap; above 0 successes are. Once an episode's reward is decided (an answer, a malformed turn,
  the tool budget), an episode on the coupled side (failures for coupling < 0, successes for > 0)
  is not ended yet: the environment answers `<out>again</out>` for round(|coupling| * extra_turns)
  more turns, whatever the model writes, then ends with the reward already decided. Those turns
  are the model's own tokens, so failures (or successes) carry more action tokens. A budget that
  cuts a padded turn ends the episode, with the reward already decided (the steps' info carries it
  as `decided_reward`, which the agent loop keeps): the knob lengthens the coupled side and never
  changes an outcome.
* `time_neutral` (with coupling != 0) keeps the padding from also reordering outcomes: an episode
  on the other side waits, at its end, for the time a recent padded episode spent in its extra
  turns (one drawn at random from the last 64 that this process measured, none before the first).
  Without it the coupled side also finishes later, and a learner that trains on the first-completed
  trajectories of each version sees fewer of them (at coupling > 0, fewer successes), which is a
  change of which outcomes arrive when, the latency knob's business, not of length.
* `latency_sigma` > 0 delays every environment step by a lognormal time (median
  `latency_median_s`, log-s.d. latency_sigma), slept in the step's thread: a heavy tail of slow
  episodes whose outcomes come back after newer policies were published.

Both draws (the delays, and which recent padding time a time-neutral episode waits) come from the
episode's stream (`Environment.rng`, seeded per episode from the run's seed and the episode's
identity: base.py), so one seed and one episode give the same delays and the same draw. The pool a
time-neutral wait is drawn from holds padding times this process measured, wall-clock times that
include the model's generation, so the drawn position is reproducible and the seconds at it are as
reproducible as the timing of the run. The step's info carries both: `latency_s` (the episode's
delays so far, summed) and `neutral_wait_s` (the wait drawn at its end, when there was one).

Tasks: `generate_toy_calc_tasks(n, seed, split)`. The split is a function of the expression (a hash),
not of the seed, so train and held-out sets are disjoint for every pair of seeds; the same
(n, seed, split) gives the same tasks. `write_toy_calc_tasks` writes both as JSONL for `load_tasks`.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from ..tasks import write_jsonl
from .base import Environment, StepResult, Task

__all__ = [
    "ToyCalcEnv",
    "SHOTS",
    "TOOL_PROMPT",
    "ToolError",
    "evaluate_tool_code",
    "generate_toy_calc_tasks",
    "heldout_expression",
    "write_toy_calc_tasks",
]

SPLITS = ("train", "heldout")
# One expression in eight is held out: about 911k of the 7.29M expressions, far more than any run sees.
HELDOUT_EIGHTHS = 1

# The system message of `describe_tool`: the tool, the one-block-per-turn rule and both formats.
TOOL_PROMPT = (
    "You are a calculator assistant. To compute, write <code>EXPRESSION</code>; the tool replies "
    "<out>VALUE</out>. Then give the final answer as <ans>NUMBER</ans>."
)
# The worked episodes of `shots`, (expression, value): training-split expressions (checked by
# tests/runtime/test_toy_calc.py), so that no held-out task is ever shown with its answer.
SHOTS = (("123*45+6", 5541), ("402*17+88", 6922))

MAX_CODE_CHARS = 64
MAX_DEPTH = 16
MAX_ABS_VALUE = 10**30

_CODE_RE = re.compile(r"<code>(.*?)</code>", re.DOTALL)
_ANS_RE = re.compile(r"<ans>(.*?)</ans>", re.DOTALL)
_PRINT_RE = re.compile(r"print\((.*)\)", re.DOTALL)
_INT_RE = re.compile(r"-?[0-9]+")
_TOKEN_RE = re.compile(r"\s*(?:([0-9]+)|(.))", re.DOTALL)


class ToolError(ValueError):
    """The tool code is not an integer expression the calculator accepts."""


def _tokens(expr: str) -> list[str]:
    out = []
    for m in _TOKEN_RE.finditer(expr):
        number, char = m.groups()
        if number is not None:
            out.append(number)
        elif char.strip():
            if char not in "+-*()":
                raise ToolError(f"unexpected character {char!r}")
            out.append(char)
    return out


class _Parser:
    """Recursive descent over: expr = term (('+'|'-') term)*; term = unary ('*' unary)*;
    unary = '-' unary | atom; atom = INT | '(' expr ')'. Depth and magnitude are capped so that no
    input can make the environment spend real time or memory."""

    def __init__(self, tokens: list[str]) -> None:
        self.toks = tokens
        self.i = 0

    def _peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def _take(self) -> str:
        tok = self._peek()
        if tok is None:
            raise ToolError("unexpected end of expression")
        self.i += 1
        return tok

    @staticmethod
    def _bounded(v: int) -> int:
        if abs(v) > MAX_ABS_VALUE:
            raise ToolError("value too large")
        return v

    def parse(self) -> int:
        v = self._expr(0)
        if self._peek() is not None:
            raise ToolError(f"unexpected {self._peek()!r}")
        return v

    def _expr(self, depth: int) -> int:
        if depth > MAX_DEPTH:
            raise ToolError("nested too deeply")
        v = self._term(depth)
        while self._peek() in ("+", "-"):
            op = self._take()
            rhs = self._term(depth)
            v = self._bounded(v + rhs if op == "+" else v - rhs)
        return v

    def _term(self, depth: int) -> int:
        v = self._unary(depth)
        while self._peek() == "*":
            self._take()
            v = self._bounded(v * self._unary(depth))
        return v

    def _unary(self, depth: int) -> int:
        if self._peek() == "-":
            self._take()
            if depth > MAX_DEPTH:
                raise ToolError("nested too deeply")
            return -self._unary(depth + 1)
        return self._atom(depth)

    def _atom(self, depth: int) -> int:
        tok = self._take()
        if tok == "(":
            v = self._expr(depth + 1)
            if self._take() != ")":
                raise ToolError("expected ')'")
            return v
        if tok.isdigit():
            return self._bounded(int(tok))
        raise ToolError(f"unexpected {tok!r}")


def evaluate_tool_code(code: str) -> int:
    """The value of `EXPR` or `print(EXPR)`; raises ToolError for anything else."""
    code = code.strip()
    if len(code) > MAX_CODE_CHARS:
        raise ToolError(f"code longer than {MAX_CODE_CHARS} characters")
    m = _PRINT_RE.fullmatch(code)
    expr = m.group(1) if m else code
    toks = _tokens(expr)
    if not toks:
        raise ToolError("empty expression")
    return _Parser(toks).parse()


# Seconds that padded episodes spent in their extra turns, per padding count: shared by the
# process's episodes (each has its own env), which the time-neutral side draws from.
_PADDING_SECONDS: dict[int, deque[float]] = {}
_PADDING_LOCK = threading.Lock()


def _padding_seconds(padding: int) -> deque[float]:
    with _PADDING_LOCK:
        return _PADDING_SECONDS.setdefault(padding, deque(maxlen=64))


class ToyCalcEnv(Environment):
    name = "toy-calc"
    stop = ("</code>", "</ans>")

    def __init__(
        self,
        *,
        max_tool_calls: int = 2,
        system_prompt: str | None = None,
        describe_tool: bool = False,
        shots: int = 0,
        coupling: float = 0.0,
        extra_turns: int = 3,
        latency_sigma: float = 0.0,
        latency_median_s: float = 0.02,
        time_neutral: bool = False,
    ) -> None:
        if not -1.0 <= coupling <= 1.0:
            raise ValueError(f"coupling must lie in [-1, 1], got {coupling!r}")
        if not 0 <= extra_turns <= 16:
            raise ValueError(f"extra_turns must lie in 0..16, got {extra_turns!r}")
        if not 0.0 <= latency_sigma <= 4.0:
            raise ValueError(f"latency_sigma must lie in [0, 4], got {latency_sigma!r}")
        if not 0.0 < latency_median_s <= 10.0:
            raise ValueError(f"latency_median_s must lie in (0, 10], got {latency_median_s!r}")
        if not isinstance(describe_tool, bool):
            raise ValueError(f"describe_tool must be true or false, got {describe_tool!r}")
        if describe_tool and system_prompt is not None:
            raise ValueError("give system_prompt or describe_tool, not both")
        if isinstance(shots, bool) or not isinstance(shots, int) or not 0 <= shots <= len(SHOTS):
            raise ValueError(f"shots must be an integer in 0..{len(SHOTS)}, got {shots!r}")
        self.max_tool_calls = max_tool_calls
        self.system_prompt = TOOL_PROMPT if describe_tool else system_prompt
        self.shots = shots
        self.coupling = coupling
        self.padding = round(abs(coupling) * extra_turns)
        self.latency_sigma = latency_sigma
        self.latency_median_s = latency_median_s
        if not isinstance(time_neutral, bool):
            raise ValueError(f"time_neutral must be true or false, got {time_neutral!r}")
        self.time_neutral = time_neutral and self.padding > 0
        self._latency_s = 0.0  # this episode's drawn delays, summed
        self._neutral_wait_s: float | None = None  # the time-neutral wait drawn at its end
        self.task: Task | None = None
        self.tool_calls = 0
        self.tool_errors = 0
        self.turns = 0
        self.done = False
        self._decided: tuple[float, str] | None = None  # (reward, finish) while padding
        self._padded = 0
        self._decided_at = 0.0  # monotonic time the reward was decided, on the coupled side

    def reset(self, task: Task) -> list[dict]:
        self.task = task
        self.tool_calls = self.tool_errors = self.turns = self._padded = 0
        self._latency_s, self._neutral_wait_s = 0.0, None
        self.done = False
        self._decided = None
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        for expr, value in SHOTS[: self.shots]:
            messages += [
                {"role": "user", "content": expr},
                {"role": "assistant", "content": f"<code>{expr}</code>"},
                {"role": "tool", "content": f"<out>{value}</out>"},
                {"role": "assistant", "content": f"<ans>{value}</ans>"},
            ]
        return messages + [{"role": "user", "content": task.prompt}]

    def _info(self, **extra: Any) -> dict[str, Any]:
        info = {
            "tool_calls": self.tool_calls, "tool_errors": self.tool_errors, "turns": self.turns,
            "padded_turns": self._padded, **extra,
        }  # fmt: skip
        if self._decided is not None:
            info["decided_reward"] = self._decided[0]
        if self.latency_sigma > 0:
            info["latency_s"] = self._latency_s
        if self._neutral_wait_s is not None:
            info["neutral_wait_s"] = self._neutral_wait_s
        return info

    def _end(self, reward: float, finish: str) -> StepResult:
        coupled = (self.coupling < 0 and reward == 0.0) or (self.coupling > 0 and reward > 0.0)
        if coupled and self._padded < self.padding:
            # The reward is decided; the episode goes on for the coupled side's extra turns.
            if self._decided is None:
                self._decided_at = time.monotonic()
            self._decided = (reward, finish)
            return StepResult([{"role": "tool", "content": "<out>again</out>"}], done=False, reward=0.0,
                              info=self._info())  # fmt: skip
        if self.time_neutral:
            seconds = _padding_seconds(self.padding)
            if coupled:
                seconds.append(time.monotonic() - self._decided_at)
            elif seconds:
                # A deque indexes; full, its length stays 64. The index is the episode's draw.
                self._neutral_wait_s = self.rng.choice(seconds)
                time.sleep(self._neutral_wait_s)
        self.done = True
        return StepResult([], done=True, reward=reward, info=self._info(finish=finish))

    def latency(self) -> float:
        """The next step's delay in seconds: lognormal (median latency_median_s, log-s.d.
        latency_sigma), 0 when latency_sigma is 0."""
        if self.latency_sigma <= 0:
            return 0.0
        return self.latency_median_s * math.exp(self.latency_sigma * self.rng.gauss(0.0, 1.0))

    def _delay(self) -> None:
        if (seconds := self.latency()) > 0:
            self._latency_s += seconds
            time.sleep(seconds)

    def step(self, action: str) -> StepResult:
        if self.task is None or self.done:
            raise RuntimeError("step() needs a reset() first, and the episode is over")
        self.turns += 1
        self._delay()
        if self._decided is not None:  # a padded turn: whatever the model wrote, one more
            self._padded += 1
            return self._end(*self._decided)
        text = action.strip()
        ans = _ANS_RE.fullmatch(text)
        if ans is not None and "<" not in ans.group(1):
            return self._end(float(_is_exact(ans.group(1), self.task.answer)), "answer")
        code = _CODE_RE.fullmatch(text)
        if code is None or "<" in code.group(1):
            return self._end(0.0, "malformed")
        if self.tool_calls >= self.max_tool_calls:
            return self._end(0.0, "tool_budget")
        self.tool_calls += 1
        try:
            out = str(evaluate_tool_code(code.group(1)))
        except ToolError:
            self.tool_errors += 1
            out = "error"
        message = {"role": "tool", "content": f"<out>{out}</out>"}
        return StepResult([message], done=False, reward=0.0, info=self._info())

    def close(self) -> None:
        self.task = None
        self.done = True


def _is_exact(text: str, answer: str | None) -> bool:
    text = text.strip()
    if answer is None or not _INT_RE.fullmatch(text):
        return False
    return int(text) == int(answer)


# -- tasks ------------------------------------------------------------------------------------


def heldout_expression(a: int, b: int, c: int) -> bool:
    """Whether `a*b+c` belongs to the held-out split (a hash of the expression, whatever the seed)."""
    digest = hashlib.sha1(f"{a}*{b}+{c}".encode()).digest()
    return digest[0] % 8 < HELDOUT_EIGHTHS


def make_task(a: int, b: int, c: int) -> Task:
    expr = f"{a}*{b}+{c}"
    split = "heldout" if heldout_expression(a, b, c) else "train"
    return Task(
        task_id=f"toycalc-{a}-{b}-{c}",
        prompt=expr,
        answer=str(a * b + c),
        meta={"expression": expr, "split": split},
    )


def sample_operands(rng: random.Random, split: str) -> tuple[int, int, int]:
    """Operands of one expression of `split`, drawn uniformly from that split."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    want = split == "heldout"
    while True:
        a, b, c = rng.randint(100, 999), rng.randint(10, 99), rng.randint(10, 99)
        if heldout_expression(a, b, c) == want:
            return a, b, c


def generate_toy_calc_tasks(n: int, seed: int = 0, split: str = "train") -> list[Task]:
    """`n` distinct tasks of `split`; the same (n, seed, split), the same tasks in the same order."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    # A string seed is hashed deterministically by `random` (unlike hash() of a str across runs).
    rng = random.Random(f"toy-calc:{split}:{seed}")
    seen: set[tuple[int, int, int]] = set()
    tasks = []
    while len(tasks) < n:
        ops = sample_operands(rng, split)
        if ops not in seen:
            seen.add(ops)
            tasks.append(make_task(*ops))
    return tasks


def write_toy_calc_tasks(
    folder: str | Path, *, seed: int = 0, n_train: int = 512, n_heldout: int = 128
) -> tuple[Path, Path]:
    """Write `train.jsonl` and `heldout.jsonl` under `folder`; returns their paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    train, heldout = folder / "train.jsonl", folder / "heldout.jsonl"
    write_jsonl(generate_toy_calc_tasks(n_train, seed, "train"), train)
    write_jsonl(generate_toy_calc_tasks(n_heldout, seed, "heldout"), heldout)
    return train, heldout
