"""The environment interface: `reset(task) -> messages`, `step(action) -> StepResult`.

Messages are chat messages ({"role", "content"}) that the agent loop renders with the model's
chat template; everything an environment returns is masked out of the loss. Environments are
synchronous (the agent loop runs them in a worker thread) and hold the state of one episode.

Randomness. An environment that draws at random (toy-calc's latency and time-neutral waits) draws
only from `self.rng`, a `random.Random` that `seed_episode(seed)` sets before the episode's
`reset`; the seed comes from `episode_seed(run_seed, *identity)`, so that one run seed and one
episode identity give one stream in every process and on every machine. Callers: the rollout
replica (identity: the task and the tracker's request id), the evaluator (the task and the job).
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

# The environments' seed of one episode's stream lives beside the engine's sampling seed (spopp.streams:
# one module holds every stream of a run that is not the method's); environments import it from here.
from spopp.streams import episode_seed


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


def reward_verdict(value: Any) -> tuple[float, str | None]:
    """(reward, None) for a finite number in [0, 1]; otherwise (0, why): what a user's environment,
    reward function or agent returned is never passed on unchecked (the tracker refuses anything
    else, and the episode would be lost)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0, "not_a_number"
    if not math.isfinite(value):
        return 0.0, "not_finite"
    if not 0.0 <= value <= 1.0:
        return 0.0, "out_of_range"
    return float(value), None


# The stream of an episode nobody seeded (tools, tests, `prompts_over_budget`'s probes): fixed, so
# that even those are reproducible, never OS entropy.
UNSEEDED = episode_seed(0, "unseeded")


class Environment(ABC):
    """One episode at a time. `stop` lists strings that end a model turn (e.g. a code block's end)."""

    name: str = "base"
    stop: tuple[str, ...] = ()
    # Whether services may open every task at start-up to find openings that fill the budget
    # (`runtime.agent.prompts_over_budget`). False where an opening costs real time (an ALFWorld
    # game loads in about 0.5 s); an episode whose opening fills the budget still ends at once with
    # reward 0 and finish "max_total_tokens".
    cheap_reset: bool = True
    # True for an environment whose episodes an agent drives through the chat endpoint instead of
    # reset/step (runtime/envs/agent.py); `runtime.agent.run_episode` plays either.
    driven_by_agent: bool = False

    # The episode's random stream (see the module's docstring); built on first use, so that
    # subclasses need not call a base __init__.
    _rng: random.Random | None = None

    @property
    def rng(self) -> random.Random:
        if self._rng is None:
            self._rng = random.Random(UNSEEDED)
        return self._rng

    @classmethod
    def prepare(cls, options: dict[str, Any]) -> None:
        """Check, once at start-up and before any episode is built, what the machine must have for
        this environment with these options (a sandbox, a package, a data folder); raise naming what
        is missing. Bad options need no check here: building one with them is the check."""

    def seed_episode(self, seed: int) -> None:
        """Draw the next episode's randomness from `seed` (`episode_seed(...)`); call before reset."""
        self._rng = random.Random(seed)

    @abstractmethod
    def reset(self, task: Task) -> list[dict]:
        """Start an episode: the opening messages (system prompt, the task)."""

    @abstractmethod
    def step(self, action: str) -> StepResult:
        """Take the model's turn (decoded text) and answer."""

    def close(self) -> None:
        """Free what the episode holds (sandbox folders, games)."""
