"""The environment interface: `reset(task) -> messages`, `step(action) -> StepResult`.

Messages are chat messages ({"role", "content"}) that the agent loop renders with the model's
chat template; everything an environment returns is masked out of the loss. Environments are
synchronous (the agent loop runs them in a worker thread) and hold the state of one episode.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Task:
    task_id: str
    prompt: str
    answer: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepResult:
    messages: list[dict]  # what the environment says next (tool output, observation); may be empty
    done: bool
    reward: float = 0.0  # read when done; in [0, 1]
    info: dict[str, Any] = field(default_factory=dict)


class Environment(ABC):
    """One episode at a time. `stop` lists strings that end a model turn (e.g. a code block's end)."""

    name: str = "base"
    stop: tuple[str, ...] = ()
    # Whether services may open every task at start-up to find openings that fill the budget
    # (`runtime.agent.prompts_over_budget`). False where an opening costs real time (an ALFWorld
    # game loads in about 0.5 s); an episode whose opening fills the budget still ends at once with
    # reward 0 and finish "max_total_tokens".
    cheap_reset: bool = True

    @abstractmethod
    def reset(self, task: Task) -> list[dict]:
        """Start an episode: the opening messages (system prompt, the task)."""

    @abstractmethod
    def step(self, action: str) -> StepResult:
        """Take the model's turn (decoded text) and answer."""

    def close(self) -> None:
        """Free what the episode holds (sandbox folders, games)."""
