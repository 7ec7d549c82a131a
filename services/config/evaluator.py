"""The evaluator's settings (`spopp evaluator run --help`; env `SPOPP_EVALUATOR_<FIELD>`; a YAML file).

`run` follows a training run at the tracker (EvaluatorSettings: the run binding and what following
takes); `score` scores model folders given on its command line (ScoreSettings: the tasks, engine
and sampling settings, no tracker). No torch or vLLM import here, so `--help` stays instant.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from runtime.envs.choice import EnvChoice
from runtime.episode_settings import EpisodeTuning, with_default
from services.shell.http_settings import HttpServerSettings
from spopp.files.snapshots import HOLDER_PATTERN
from spopp.settings.base import Settings
from spopp.settings.claim_settings import ClaimSettings
from spopp.settings.fields import Seed
from spopp.settings.run_binding import RunBinding


class EvaluatorEpisodes(EpisodeTuning):
    """How the evaluator and `spopp prior` play episodes: as the replicas do (runtime/episode_settings.py),
    by default on the transformers engine and with more episodes in flight (held-out tasks are all known
    at once)."""

    engine: Literal["vllm", "transformers"] = with_default("engine", "transformers")
    concurrency: int = with_default("concurrency", 32)


class EpisodeSettings(EvaluatorEpisodes, EnvChoice, Settings):
    """The episode settings of a command of its own (`spopp prior`)."""


class EvaluatorTuning(EvaluatorEpisodes, ClaimSettings, HttpServerSettings):
    """What an evaluator's operator tunes: which versions, how episodes are played and sampled, its
    server and claim (also the `evaluator:` section of a launch file). ScoreSettings adds what it
    scores with (model, held-out tasks, environment, records), EvaluatorSettings the run it follows
    (the run binding, snapshots, the last version, the hold's name)."""

    every: int = Field(1, ge=1, le=1_000_000, description="score policy version v when v % every == 0")
    at_start: bool = Field(True, description="also score policy version 0, the base model")
    poll_seconds: float = Field(
        5.0, gt=0, le=3600, description="wait between reads of the tracker's policy clock"
    )
    hold_seconds: float = Field(
        600.0,
        ge=1,
        le=7 * 24 * 3600,
        description="lifetime of the hold on snapshots still to score, refreshed every third of "
        "it; a dead evaluator's hold ends after this long",
    )
    host: str = Field(
        "127.0.0.1", min_length=1, max_length=255, description="address of /healthz and /metrics"
    )
    port: int = Field(8300, ge=0, le=65535, description="port of /healthz and /metrics (0: any free port)")
    max_tasks: int | None = Field(
        None, ge=1, le=10_000_000, description="score only the first N tasks of the file"
    )
    greedy: bool = Field(True, description="one temperature-0 episode per task")
    samples: int = Field(4, ge=0, le=1024, description="sampled episodes per task (avg@k, pass@k); 0: none")
    temperature: float = Field(1.0, gt=0.0, le=10.0, description="temperature of the sampled episodes")
    seed: Seed | None = Field(
        None,
        description="base of the sampled episodes' seeds (fixed per task and sample); unset: the run's seed "
        "at the tracker for the evaluator of a run, 0 for `spopp eval score`",
    )

    @model_validator(mode="after")
    def _something_to_play(self) -> EvaluatorSettings:
        if not self.greedy and self.samples == 0:
            raise ValueError("nothing to score: set greedy: true or samples >= 1")
        return self


class ScoreSettings(EvaluatorTuning, EnvChoice, Settings):
    """What scoring model folders takes (`spopp evaluator score`, and the episodes of `spopp prior`):
    held-out tasks, the base model, where the records go. Nothing here talks to a tracker."""

    env_prefix: ClassVar[str] = "SPOPP_EVALUATOR_"

    model: Path | None = Field(
        None,
        description="model folder of policy version 0 (the base model); unset: the run's "
        "base_snapshot at the tracker (`run`), the first --snapshot (`score`)",
    )
    out_dir: Path = Field(
        Path("spopp-data/eval"),
        description="records: evals.jsonl, episodes/vNNNNNN.jsonl, tb/ (TensorBoard)",
    )
    tasks: Path = Field(..., description="held-out tasks (JSONL/parquet: prompt, answer, task_id)")


class EvaluatorSettings(RunBinding, ScoreSettings):
    """`spopp evaluator run`: scoring bound to a run (RunBinding), following its policy clock and
    holding the snapshots it has still to score. RunBinding comes first: its variables are the
    shared ones (SPOPP_RUN, SPOPP_TRACKER_URL)."""

    snapshots: Path | None = Field(
        None,
        description="root of the shared snapshot folder (vNNNNNN/, .holds/); unset: the parent "
        "folder of the policy's snapshot path",
    )
    until_version: int | None = Field(
        None,
        ge=0,
        description="exit once every version up to this one is scored or skipped; unset: follow "
        "the run until stopped",
    )
    holder: str | None = Field(
        None,
        pattern=HOLDER_PATTERN,
        description="id of this evaluator's hold file (.holds/<holder>.json); unset: evaluator-<run>",
    )

    def holder_id(self) -> str:
        """The hold file's id: `holder`, or evaluator-<run> with characters a file name cannot
        carry replaced by `_`."""
        if self.holder is not None:
            return self.holder
        return ("evaluator-" + re.sub(r"[^A-Za-z0-9_.-]", "_", self.run))[:200]
