"""`spopp launch`'s config: one file describes a whole run; each service's section is its own settings.

    run: spopp-s0            # name at the tracker (default: <recipe>-s<seed>)
    run_dir: runs/spopp-s0   # everything the run writes (default: runs/<run>)
    recipe: spopp            # spopp | spo: the tracker's mode and the learner's recipe
    seed: 0                  # the tracker's sampler, the replicas' sampling, the learner's torch
    model: models/cold-start # policy version 0 (a Hugging Face folder)
    tasks: data/train.jsonl  # training tasks, read by the replicas
    prior: data/prior.json   # `spopp prior`'s file; unset: a flat Jeffreys prior per task
    heldout: data/heldout.jsonl  # the evaluator's tasks; unset: no evaluator
    env: toy-calc
    max_updates: 40          # the budget: learner updates
    max_staleness: 0         # k: trajectories up to k policy versions old train (0: the paper's protocol)
    run_config: {retention: 0.875, lease_seconds: 900}   # the tracker run's other fields
    tracker:   {...}         # TrackerSettings fields
    rollout:   {replicas: 2, concurrency: 8, ...}         # RolloutSettings fields
    learner:   {nproc: 1, batch_size: 32, lr: 1e-4, ...}  # LearnerSettings fields
    evaluator: {every: 4, samples: 4, ...}                # EvaluatorSettings fields
    gpus:      {learner: [0], rollout: [[1], [2]], evaluator: [3]}

A section is its service's tuning model (`RolloutTuning`, ...: what an operator tunes) with the
launcher's own keys (`replicas`, `nproc`, `enabled`). What binds a service to a run (the run,
tracker, model, tasks, environment, seed, folders, names) is its settings' rest, set by the
launcher from the top level and its own wiring: given in a section, it is refused by name, so
that a section can never point a service at something other than this run. A wrong type or an
unknown key is refused with `rollout.concurrency: ...` when the file is read. The recipe sets its own defaults
(normalization token and Dual-Clip 2 for spopp, trajectory and 10 for spo); a section may still
override them, which is how `spopp ablate` builds SPO++ with trajectory normalization.
services/launch/process_plan.py turns the file into the exact settings each child process will be
started with, so that every error of every service's settings is found before anything starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    model_serializer,
    model_validator,
)

from runtime.envs.registry import ENV_HELP, EnvName, EnvOptions
from services.config.evaluator import EvaluatorSettings, EvaluatorTuning
from services.config.learner import LearnerSettings, LearnerTuning
from services.config.rollout import RolloutSettings, RolloutTuning
from services.config.supervision import SupervisionSettings
from services.config.tracker import TrackerSettings, TrackerTuning
from spopp.settings.base import Settings
from spopp.settings.fields import ApiToken, Id, MaxStaleness, Recipe, RunId, Seed

SECTIONS = ("tracker", "rollout", "learner", "evaluator")
SERVICES: dict[str, type[Settings]] = {
    "tracker": TrackerSettings,
    "rollout": RolloutSettings,
    "learner": LearnerSettings,
    "evaluator": EvaluatorSettings,
}
SERVICE_HELP = {
    "tracker": "tracker serve",
    "rollout": "rollout serve",
    "learner": "learner run",
    "evaluator": "evaluator run",
}
# The one service setting the launch file sets under another top-level key: the evaluator's tasks
# are `heldout`, since the top-level `tasks` are the training tasks (every replica's).
_TOP_LEVEL_KEY_OF = {("evaluator", "tasks"): "heldout"}


def _set_by_launch(section: str, key: str) -> str:
    """Why a service's setting outside its tuning model (its section) is the launcher's."""
    top = _TOP_LEVEL_KEY_OF.get((section, key), key)
    if top in LaunchSettings.model_fields:
        return f"use the top-level {top}: every process of the run shares it"
    return "the run's wiring: URLs, ports, names and folders under run_dir are the launcher's"


class GpuPlan(BaseModel):
    """Which GPUs each launched process sees (services/launch/gpus.py checks and assigns them)."""

    model_config = ConfigDict(extra="forbid")

    learner: list[int] = Field(default_factory=list, description="devices of the learner's ranks")
    rollout: list[list[int]] = Field(
        default_factory=list, description="devices of each replica, one list per replica"
    )
    evaluator: list[int] = Field(default_factory=list, description="devices of the evaluator")
    share: bool = Field(False, description="allow two processes on one device")

    def used(self) -> bool:
        return bool(self.learner or self.evaluator or any(self.rollout))


class Section(BaseModel):
    """A service's section of the launch file, mixed with that service's tuning model: the
    launcher's own keys (declared by each subclass) and the tuning fields, typed and checked as
    the service checks them.

    Only what the file gives is kept (`given()`, and what a dump writes back), so that the recipe's
    defaults and the launcher's values fill the rest in `process_plan()`, where the service's own model
    checks the whole. A setting of the service outside its tuning model is refused by name.
    """

    model_config = ConfigDict(extra="forbid")

    name: ClassVar[str]
    launch_keys: ClassVar[frozenset[str]] = frozenset()

    def given(self) -> dict[str, Any]:
        """The service's settings the file gives (the launcher's own keys left out)."""
        return {k: getattr(self, k) for k in self.model_fields_set if k not in self.launch_keys}

    def __contains__(self, key: str) -> bool:
        return key in self.model_fields_set

    def __repr_args__(self) -> Any:
        # The service's defaults are not this section's values: the repr shows what the file gives.
        return [(k, v) for k, v in super().__repr_args__() if k in self.model_fields_set]

    @model_serializer(mode="wrap")
    def _only_given(self, handler: Any) -> dict[str, Any]:
        # A dump is the section as written (launch.yaml, a base config copied per arm): a default
        # written out would override the recipe's defaults when the dump is read back.
        return {k: v for k, v in handler(self).items() if k in self.model_fields_set}


class TrackerSection(Section, TrackerTuning):
    name = "tracker"


class RolloutSection(Section, RolloutTuning):
    name = "rollout"
    launch_keys = frozenset({"replicas"})

    replicas: StrictInt = Field(1, ge=1, description="replicas to start (rollout-0, rollout-1, ...)")


class LearnerSection(Section, LearnerTuning):
    name = "learner"
    launch_keys = frozenset({"nproc"})

    nproc: StrictInt | None = Field(
        None, ge=1, description="learner ranks; unset: one per gpus.learner device, else one"
    )


class EvaluatorSection(Section, EvaluatorTuning):
    name = "evaluator"
    launch_keys = frozenset({"enabled"})

    enabled: StrictBool = Field(True, description="false: no evaluator even when heldout is given")


class LaunchSettings(Settings):
    env_prefix: ClassVar[str] = "SPOPP_LAUNCH_"
    renamed: ClassVar[dict[str, str]] = {"updates": "max_updates (the run's budget in learner updates)"}

    run: RunId | None = Field(None, description="run name at the tracker; unset: <recipe>-s<seed>")
    run_dir: Path | None = Field(None, description="folder of everything the run writes; unset: runs/<run>")
    recipe: Recipe = Field("spopp", description="spopp (SPO++) or spo")
    seed: Seed = Field(0, description="seed of the sampler, the sampling and the learner")
    study: Id | None = Field(
        None,
        description="with the seed, the key of the draws that are not the method's (prompts dispatched, "
        "sampling, environment streams): runs of one seed and study draw alike (common random numbers "
        "across the arms of a comparison; spopp ablate and spopp map set it); unset: the run name",
    )  # fmt: skip
    protocol: str | None = Field(
        None,
        pattern="^[0-9a-f]{64}$",
        description="the sha256 of the pre-registered protocol.json this run belongs to (spopp study compare "
        "sets it): written to run.json and part of the run's identity, so a changed protocol is caught",
    )  # fmt: skip
    model: Path = Field(..., description="policy version 0: a Hugging Face model folder")
    tasks: Path = Field(..., description="training tasks (JSONL/parquet: prompt, answer, task_id)")
    prior: Path | None = Field(
        None, description="task prior from `spopp prior`; unset: a flat Jeffreys prior for every task"
    )
    heldout: Path | None = Field(None, description="held-out tasks of the evaluator; unset: no evaluator")
    env: EnvName = Field("math-tir", description=ENV_HELP)
    env_options: EnvOptions = Field(
        default_factory=dict,
        description="the environment's arguments for every replica, the evaluator and the prior, a mapping: {max_steps: 50, action_format: tag} (alfworld)",
    )
    max_updates: int = Field(100, ge=1, le=10_000_000, description="budget: learner updates")
    max_staleness: MaxStaleness = Field(
        0,
        description="k: train on trajectories up to k policy versions old (the tracker run's and the "
        "learner's); 0: the current version only, the paper's protocol",
    )
    api_token: ApiToken | None = Field(
        None, description="bearer token of every service (prefer SPOPP_API_TOKEN)"
    )
    run_config: dict = Field(
        default_factory=dict,
        description="the tracker run's fields besides recipe, seed and base_snapshot: retention, "
        "prior_mass, lease_seconds, d_half, rho_min, rho_max",
    )
    tracker: TrackerSection = Field(default_factory=TrackerSection, description="TrackerTuning fields")
    rollout: RolloutSection = Field(
        default_factory=RolloutSection, description="RolloutTuning fields, and replicas: N"
    )
    learner: LearnerSection = Field(
        default_factory=LearnerSection, description="LearnerTuning fields, and nproc: N"
    )
    evaluator: EvaluatorSection = Field(
        default_factory=EvaluatorSection,
        description="EvaluatorTuning fields, and enabled: false to skip it",
    )
    gpus: GpuPlan = Field(default_factory=GpuPlan, description="device indices per process")
    progress_seconds: float = Field(10.0, gt=0, le=3600, description="seconds between progress lines")
    start_seconds: float = Field(
        300.0, gt=0, le=86_400, description="how long each service may take to come up"
    )
    stop_seconds: float = Field(
        30.0, gt=0, le=3600, description="how long a service may take to stop before it is killed"
    )
    supervision: SupervisionSettings = Field(
        default_factory=SupervisionSettings,
        description="restarts of children that die: enabled, max_restarts per window_seconds, "
        "backoff_seconds doubling up to max_backoff_seconds",
    )
    metrics_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="port of the launcher's /healthz and /metrics (restarts); 0: a free port",
    )
    wandb: bool = Field(False, description="also log to Weights & Biases (offline unless WANDB_MODE says)")
    wandb_project: str = Field("spopp", min_length=1, description="W&B project name")

    @classmethod
    def explain_nested(cls, err: Any) -> str:
        """A section's unknown key, or one the launcher sets, by name and with where to look."""
        section, key = str(err["loc"][0]), str(err["loc"][1])
        if err["type"] == "extra_forbidden" and len(err["loc"]) == 2 and section in SERVICES:
            if key in SERVICES[section].model_fields:
                return f"{section}: {key} is set by spopp launch ({_set_by_launch(section, key)})"
            return f"{section}.{key}: unknown setting (see `spopp {SERVICE_HELP[section]} --help`)"
        return super().explain_nested(err)

    @model_validator(mode="after")
    def _defaults(self) -> LaunchSettings:
        if self.run is None:
            self.run = f"{self.recipe}-s{self.seed}"
        if self.run_dir is None:
            self.run_dir = Path("runs") / self.run
        return self
