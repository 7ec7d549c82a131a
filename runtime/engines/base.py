"""The engine interface: one async request in, the sampled token ids and their log-probs out.

Engines batch concurrent requests themselves (both continuously: a request joins the running
batch whenever it comes), so the agent loop simply awaits one generation per turn. Log-probs are
those of the distribution the tokens were sampled from (temperature applied, no top-p/top-k
renormalization when those are off), because the learner uses them as the behaviour policy in
its importance weights.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal


@dataclass(frozen=True)
class SamplingConfig:
    """Decoding for one turn. Defaults follow the paper: T = 1, top-p 1, top-k off."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    # Generation ends after any of these tokens or strings; the stop token/string is kept in the
    # output so that the trajectory holds exactly what the engine produced.
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]
    text: str = ""
    # Engine-side timings in seconds, for metrics.
    timings: dict[str, float] = field(default_factory=dict)
    # The policy version of the weights that generated it, where the caller tracks versions
    # (services/rollout/swap.py); None elsewhere.
    version: int | None = None


class Engine(ABC):
    """A loaded model that generates and can swap its weights in place."""

    #: Hugging Face tokenizer of the model (chat template included).
    tokenizer: object
    #: Positions one sequence may hold, prompt and generation together (the model's context, or
    #: vLLM's max_model_len); None where unknown. The agent loop keeps episodes within it.
    context_tokens: int | None = None
    #: The device the model computes on, as torch names it ("cpu", "cuda:0"); what a replica's and
    #: the evaluator's /healthz and start-up log line report. None where an engine cannot tell.
    device_name: str | None = None

    @abstractmethod
    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig) -> Generation:
        """Continue `prompt_ids`; returns the new tokens only."""

    @abstractmethod
    async def load_weights(self, snapshot_dir: str | Path) -> None:
        """Swap in the weights of a snapshot folder (safetensors) without restarting the engine."""

    @abstractmethod
    async def close(self) -> None:
        """Release the model and any worker threads."""


def settle_threadsafe(loop: asyncio.AbstractEventLoop, future: asyncio.Future, outcome) -> None:
    """Resolve `future` from another thread (an engine's worker or reader thread): an exception
    `outcome` is raised to the waiter, anything else is its result. A future already done
    (cancelled) or a loop already closed is left alone: nobody waits any more."""

    def settle() -> None:
        if future.done():
            return
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the loop has closed
        pass
