"""Task files for the rollout service, and a generator of tool-use arithmetic tasks.

`load_tasks(path)` reads JSONL (`.jsonl`, `.json`, `.ndjson`: one object a line) or Parquet
(`.parquet`, `.pq`) rows with:

* `prompt`: the problem text (str);
* `answer`: the reference answer (str; numbers are turned into their string);
* `task_id` (optional): when absent, a stable id, the first 16 hex digits of the prompt's sha1;
* any other columns go to `Task.meta`.

DAPO-Math-17K's layout is read too: `prompt` is a list of chat messages (the user message's
content is taken), the answer is `reward_model.ground_truth`, and `extra_info` goes to meta. Its
prompts wrap each problem in an instruction to end with "Answer: $Answer"; our Math-TIR
environment asks for `\\boxed{}` instead, so that wrapper is stripped (exactly as DAPO writes it;
the original text is kept in `meta["original_prompt"]`). The released DAPO-Math-17K parquet
repeats each problem many times: pass `dedupe=True` to keep the first copy of rows whose
(derived) id, prompt and answer are identical; a repeated id with a different prompt or answer
is always an error.

Bad rows raise ValueError naming the file and the line (JSONL) or row (Parquet, 1-based).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from .envs.base import Task

__all__ = ["generate_arithmetic_tasks", "load_tasks", "prompt_task_id", "write_jsonl"]

DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the "
    "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'

_JSONL_SUFFIXES = {".jsonl", ".json", ".ndjson"}
_PARQUET_SUFFIXES = {".parquet", ".pq"}


def prompt_task_id(prompt: str) -> str:
    return hashlib.sha1(prompt.encode("utf-8")).hexdigest()[:16]


def _iter_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open("r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {lineno}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON: {e}") from None


def _iter_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises its own error types for broken files
        raise ValueError(f"{path}: cannot read as parquet: {e}") from e
    for i, row in enumerate(table.to_pylist(), start=1):
        yield f"{path}, row {i}", row


def _dapo_user_content(messages: list, where: str) -> str:
    for m in messages:
        if isinstance(m, dict) and m.get("role") == "user" and isinstance(m.get("content"), str):
            return m["content"]
    raise ValueError(f"{where}: `prompt` is a list of messages but none is a user message with text")


def _row_to_task(row: Any, where: str) -> Task:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected an object with `prompt` and `answer`, got {type(row).__name__}")
    meta = {k: v for k, v in row.items() if k not in ("prompt", "answer", "task_id")}
    prompt = row.get("prompt")
    answer = row.get("answer")
    if isinstance(prompt, list):  # DAPO-Math-17K: chat messages, answer in reward_model.ground_truth
        original = _dapo_user_content(prompt, where)
        prompt = original
        if prompt.startswith(DAPO_PREFIX) and prompt.endswith(DAPO_SUFFIX):
            prompt = prompt[len(DAPO_PREFIX) : len(prompt) - len(DAPO_SUFFIX)]
            meta["original_prompt"] = original
        reward_model = row.get("reward_model")
        if answer is None and isinstance(reward_model, dict):
            answer = reward_model.get("ground_truth")
        meta.pop("reward_model", None)
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"{where}: missing or empty `prompt`")
    if isinstance(answer, bool) or answer is None:
        raise ValueError(f"{where}: missing `answer` (or `reward_model.ground_truth`)")
    if isinstance(answer, int | float):
        answer = str(answer)
    if not isinstance(answer, str) or not answer.strip():
        raise ValueError(f"{where}: `answer` must be a non-empty string, got {answer!r}")
    task_id = row.get("task_id")
    if task_id is None:
        task_id = prompt_task_id(prompt)
    elif isinstance(task_id, int) and not isinstance(task_id, bool):
        task_id = str(task_id)
    if not isinstance(task_id, str) or not task_id:
        raise ValueError(f"{where}: `task_id` must be a non-empty string, got {task_id!r}")
    return Task(task_id=task_id, prompt=prompt, answer=answer, meta=meta)


def load_tasks(path: str | Path, *, dedupe: bool = False) -> list[Task]:
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in _JSONL_SUFFIXES:
        rows = _iter_jsonl(path)
    elif suffix in _PARQUET_SUFFIXES:
        rows = _iter_parquet(path)
    else:
        raise ValueError(f"{path}: unknown task file type {suffix!r} (use .jsonl or .parquet)")
    tasks: list[Task] = []
    seen: dict[str, tuple[str, Task]] = {}
    for where, row in rows:
        task = _row_to_task(row, where)
        if task.task_id in seen:
            first_where, first = seen[task.task_id]
            same = first.prompt == task.prompt and first.answer == task.answer
            if dedupe and same:
                continue
            hint = " (pass dedupe=True to drop identical repeats)" if same else ""
            raise ValueError(f"{where}: duplicate task_id {task.task_id!r}, first at {first_where}{hint}")
        seen[task.task_id] = (where, task)
        tasks.append(task)
    return tasks


def write_jsonl(tasks: Iterable[Task], path: str | Path) -> None:
    """One JSON object a line: task_id, prompt, answer and the meta's keys (the latter as columns)."""
    path = Path(path)
    with path.open("w", encoding="utf-8") as f:
        for t in tasks:
            row = {"task_id": t.task_id, "prompt": t.prompt, "answer": t.answer, **t.meta}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def _arith_item(rng: random.Random) -> tuple[str, str, str]:
    """(kind, Python expression, the question asked)."""
    kind = rng.choice(["mul_add", "sum_mul_sub", "floordiv", "mod", "mul3_sub"])
    if kind == "mul_add":
        a, b = rng.randint(10_000, 999_999), rng.randint(10_000, 999_999)
        c = rng.randint(1_000, 99_999)
        return kind, f"{a} * {b} + {c}", f"Compute ${a} \\times {b} + {c}$."
    if kind == "sum_mul_sub":
        a, b = rng.randint(10_000, 999_999), rng.randint(1_000, 99_999)
        c, d = rng.randint(1_000, 99_999), rng.randint(10_000, 999_999)
        return kind, f"({a} + {b}) * {c} - {d}", f"Compute $({a} + {b}) \\times {c} - {d}$."
    if kind == "floordiv":
        a, b = rng.randint(10**11, 10**13), rng.randint(1_000, 99_999)
        question = (
            f"Compute $\\left\\lfloor {a} / {b} \\right\\rfloor$, the integer part of {a} divided by {b}."
        )
        return kind, f"{a} // {b}", question
    if kind == "mod":
        a, b = rng.randint(10**11, 10**13), rng.randint(1_000, 99_999)
        return kind, f"{a} % {b}", f"What is the remainder when {a} is divided by {b}?"
    a, b, c = rng.randint(1_000, 99_999), rng.randint(1_000, 99_999), rng.randint(100, 9_999)
    d = rng.randint(10_000, 999_999)
    return kind, f"{a} * {b} * {c} - {d}", f"Compute ${a} \\times {b} \\times {c} - {d}$."


def _eval_int(expr: str) -> int:
    """Evaluate one of our generated expressions (integers, + - * // % and parentheses only)."""
    if not set(expr) <= set("0123456789+-*/%() "):
        raise ValueError(f"not an arithmetic expression: {expr!r}")
    return int(eval(expr, {"__builtins__": {}}, {}))  # noqa: S307 - digits and operators only


def generate_arithmetic_tasks(n: int, seed: int = 0) -> list[Task]:
    """`n` exact-integer arithmetic tasks where running code helps; the same (n, seed), the same tasks.

    Ids are `arith-{seed}-{i}`; `meta` keeps the Python expression (`expression`) and its `kind`.
    """
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        kind, expr, question = _arith_item(rng)
        answer = _eval_int(expr)
        prompt = (
            f"{question} Give the exact integer; you may run Python. Put the final answer in \\boxed{{}}."
        )
        tasks.append(
            Task(
                task_id=f"arith-{seed}-{i}",
                prompt=prompt,
                answer=str(answer),
                meta={"expression": expr, "kind": kind},
            )
        )
    return tasks
