"""How episodes are played, declared once: the engine and its options, the LoRA rank it is sized
for, nucleus sampling, the episodes in flight, and the budgets of one episode (turns, tokens per
turn, tokens per episode, prompt included).

The rollout replica (services/config/rollout.py), the evaluator and `spopp prior`
(services/config/evaluator.py) take these fields from here, with one set of bounds; a service
whose default differs (the evaluator's engine and concurrency) changes the default alone
(`with_default`), and a test holds every service's fields to this declaration. `budget()` is the
episode's `Budget`; `spopp env check` takes its bounds from here too. Torch-free, so that the
settings modules import it at once (`--help` stays instant).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator
from pydantic.fields import FieldInfo

from spopp.settings.base import SettingsGroup

from .engines.options import check_engine_options
from .episode import Budget


class EpisodeTuning(SettingsGroup):
    """How a service plays its episodes: what its operator tunes alike in every service that plays."""

    engine: Literal["vllm", "transformers"] = Field(
        "vllm",
        description="generation engine (transformers: on the CPU unless engine_options.device, in a process "
        "of its own unless {process: false})",
    )
    engine_options: dict = Field(
        default_factory=dict,
        description="extra engine arguments, a mapping: {max_model_len: 4096}, {gpu_memory_utilization: 0.8} "
        "(vllm); {device: cuda:1}, {process: false} (transformers)",
    )

    @field_validator("engine_options")
    @classmethod
    def _engine_options(cls, v: dict) -> dict:
        return check_engine_options(v)

    lora_rank: int = Field(
        0,
        ge=0,
        le=1024,
        description="the learner's LoRA rank when it publishes adapters (vLLM sizes its adapter buffers "
        "at start-up); 0: full-weight snapshots",
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass")
    concurrency: int = Field(8, ge=1, le=1024, description="episodes in flight on the engine")
    max_turns: int = Field(8, ge=1, le=1000, description="model turns per episode")
    max_tokens_per_turn: int = Field(1024, ge=1, le=1_000_000, description="tokens per model turn")
    max_total_tokens: int = Field(
        4096, ge=1, le=10_000_000, description="tokens per episode, prompt included"
    )

    def budget(self) -> Budget:
        """The budget of one episode."""
        return Budget(self.max_turns, self.max_tokens_per_turn, self.max_total_tokens)


def with_default(name: str, default: Any) -> FieldInfo:
    """EpisodeTuning's field `name` with a service's own default: its type's bounds and its
    description stay the declaration's (redeclare the field as `name: <type> = with_default(...)`)."""
    return FieldInfo.merge_field_infos(EpisodeTuning.model_fields[name], default=default)


def bounds(name: str) -> tuple[int | None, int | None]:
    """(ge, le) of an integer field of EpisodeTuning: what a command line that takes it bounds it by."""
    lo = hi = None
    for m in EpisodeTuning.model_fields[name].metadata:
        lo = getattr(m, "ge", lo)
        hi = getattr(m, "le", hi)
    return lo, hi
