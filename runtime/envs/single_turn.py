"""Single-turn tasks scored by a user's reward function (`single-turn`, or a function as the spec).

The most common custom task: the model reads the task's prompt once and answers; a function the
user writes, `score(answer_text, task) -> float`, says how good the answer is, in [0, 1]. `task`
is the `runtime.envs.base.Task` of the episode (task_id, prompt, answer, meta: every extra column
of the task file).

The reward function is untrusted in the same way as the answer check (it reads what the model
wrote, and may parse it with a library that does not return): it runs in a worker process of a
`runtime.sandbox.check_pool.CheckPool`, one pool per reward function per process, with a wall-clock limit
(`reward_timeout_s`) and an address-space cap (`reward_memory_mb`). A call killed at its limit, one
that raised, or a value that is not a finite number in [0, 1] scores the answer 0, with the reason
in the step's `info["answer_check"]` (counted by the replica's and the evaluator's metrics, and
reported by `spopp env check`): a bad reward never reaches the tracker, and never stops a run.
"""

from __future__ import annotations

import inspect
import numbers
import threading
from dataclasses import asdict
from typing import Any

from runtime.sandbox.check_pool import CheckPool

from ..episode import reward_verdict
from ..faults import Fault
from .base import Environment, StepResult, Task
from .import_path import import_object, is_import_path

MiB = 1024**2

_pools: dict[tuple[str, int], CheckPool] = {}
_pools_lock = threading.Lock()


def reward_pool(reward: str, memory_mb: int) -> CheckPool:
    """The process's pool for `reward`: its workers import the function's module once, at start."""
    key = (reward, memory_mb)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            import atexit

            module = reward.partition(":")[0]
            pool = CheckPool(
                size=2, memory_bytes=memory_mb * MiB, preload=("runtime.envs.single_turn", module)
            )
            atexit.register(pool.close)
            _pools[key] = pool
        return pool


def score_in_worker(reward: str, answer_text: str, task: dict) -> Any:
    """Run in the worker: the user's function on the episode's answer and task. A number goes back
    as a float (numpy's too); anything else as it is, for the caller's `reward_verdict` to name."""
    value = import_object(reward)(answer_text, Task(**task))
    return float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else value


class SingleTurnEnv(Environment):
    """One model turn: the task's prompt (after an optional system prompt) in, the reward out."""

    name = "single-turn"

    def __init__(
        self,
        *,
        reward: str,
        system_prompt: str | None = None,
        reward_timeout_s: float = 5.0,
        reward_memory_mb: int = 1024,
    ) -> None:
        if not is_import_path(reward):
            raise ValueError(f"reward must be an import path package.module:function, got {reward!r}")
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise ValueError(f"system_prompt must be a string, got {type(system_prompt).__name__}")
        if (
            isinstance(reward_timeout_s, bool)
            or not isinstance(reward_timeout_s, int | float)
            or not 0 < reward_timeout_s <= 600
        ):
            raise ValueError(f"reward_timeout_s must be in (0, 600], got {reward_timeout_s!r}")
        if (
            isinstance(reward_memory_mb, bool)
            or not isinstance(reward_memory_mb, int)
            or not 64 <= reward_memory_mb <= 65536
        ):
            raise ValueError(f"reward_memory_mb must be an integer in [64, 65536], got {reward_memory_mb!r}")
        self.reward = reward
        self.system_prompt = system_prompt
        self.reward_timeout_s = float(reward_timeout_s)
        self.reward_memory_mb = reward_memory_mb
        self.task: Task | None = None

    @property
    def scorer_label(self) -> str:
        """Whose code scores the answer, as a failure names it."""
        return f"reward function {self.reward}"

    @classmethod
    def prepare(cls, options: dict[str, Any]) -> None:
        """The reward function must import here and be a plain function of two arguments; its
        pool's first worker starts now."""
        reward = options.get("reward")
        SingleTurnEnv(**options)  # the options' own checks first, with their messages
        fn = import_object(reward, f"reward {reward}")
        if not callable(fn) or inspect.iscoroutinefunction(fn) or inspect.isclass(fn):
            raise ValueError(f"reward {reward}: not a plain function score(answer_text, task) -> float")
        try:
            inspect.signature(fn).bind("answer", None)
        except TypeError:
            raise ValueError(f"reward {reward}: must take two arguments (answer_text, task)") from None
        except ValueError:  # a builtin without a signature: called as it is
            pass
        reward_pool(reward, options.get("reward_memory_mb", 1024)).warm()

    def reset(self, task: Task) -> list[dict]:
        self.task = task
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return messages + [{"role": "user", "content": task.prompt}]

    def step(self, action: str) -> StepResult:
        if self.task is None:
            raise RuntimeError("step() needs a reset() first, and the episode is over")
        task, self.task = self.task, None
        pool = reward_pool(self.reward, self.reward_memory_mb)
        outcome = pool.call(
            "runtime.envs.single_turn:score_in_worker", self.reward, action, asdict(task),
            timeout_s=self.reward_timeout_s,
        )  # fmt: skip
        info: dict[str, Any] = {"finish": "answer"}
        if not outcome.ok:
            info["answer_check"] = outcome.reason
            info["answer_check_detail"] = outcome.detail[:200]
            if outcome.reason == "error":  # it raised: the user's bug, named with its line
                kind, _, message = outcome.detail.partition(": ")
                info["fault"] = Fault(self.scorer_label, kind, message, outcome.where).as_info()
            return StepResult([], done=True, reward=0.0, info=info)
        reward, why = reward_verdict(outcome.value)
        if why is not None:
            info["answer_check"] = why
            info["answer_check_detail"] = f"the reward function returned {outcome.value!r}"[:200]
        return StepResult([], done=True, reward=reward, info=info)

    def close(self) -> None:
        self.task = None
