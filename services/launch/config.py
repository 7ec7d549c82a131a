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
`process_plan()` turns the file into the exact settings each child process will be started with, so
every error of every service's settings is found before anything starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    model_serializer,
    model_validator,
)

from runtime.envs.registry import ENV_HELP, EnvName, EnvOptions
from services.evaluator.config import EvaluatorSettings, EvaluatorTuning
from services.learner.config import LearnerSettings, LearnerTuning
from services.rollout.config import RolloutSettings, RolloutTuning
from services.tracker.config import TrackerSettings, TrackerTuning
from spopp.api.tracker_api import RunConfig
from spopp.compare.arms import arm_of
from spopp.settings.base import Settings, SettingsError
from spopp.settings.fields import ApiToken, Id, MaxStaleness, Recipe, RunId, Seed
from spopp.settings.recipes import RECIPE_DEFAULTS
from spopp.settings.run_binding import RunBinding

from .gpus import GpuPlan
from .supervision_settings import SupervisionSettings

SECTIONS = ("tracker", "rollout", "learner", "evaluator")
SERVICES: dict[str, type[Settings]] = {
    "tracker": TrackerSettings,
    "rollout": RolloutSettings,
    "learner": LearnerSettings,
    "evaluator": EvaluatorSettings,
}
_HELP = {
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
            return f"{section}.{key}: unknown setting (see `spopp {_HELP[section]} --help`)"
        return super().explain_nested(err)

    @model_validator(mode="after")
    def _defaults(self) -> LaunchSettings:
        if self.run is None:
            self.run = f"{self.recipe}-s{self.seed}"
        if self.run_dir is None:
            self.run_dir = Path("runs") / self.run
        return self


@dataclass
class ProcessPlan:
    """The processes of one run, what will be started: every child's settings, already validated
    (not the learner's memory plan, services/learner/memory_plan.py)."""

    launch: LaunchSettings
    run_config: RunConfig
    binding: RunBinding  # the one every child bound to the run is given: the run, its tracker, the token
    tracker: TrackerSettings
    rollouts: list[RolloutSettings]
    learner: LearnerSettings
    nproc: int
    evaluator: EvaluatorSettings | None
    final_version: int

    @property
    def run_dir(self) -> Path:
        return Path(self.launch.run_dir)

    def identity(self) -> dict[str, Any]:
        """What makes this the same run: a resume must not change any of it."""
        s = self.launch
        return {
            "run": s.run,
            "recipe": s.recipe,
            "normalization": self.learner.normalization,
            "seed": s.seed,
            "model": str(Path(s.model).resolve()),
            "tasks": str(Path(s.tasks).resolve()),
            "prior": str(Path(s.prior).resolve()) if s.prior else None,
            "env": s.env,
            # As the tracker compares it: a run launched before max_staleness existed still resumes.
            # The budget is left out: `spopp launch` changes it (max_updates), the run stays the same.
            "run_config": {k: v for k, v in self.run_config.canonical().items() if k != "max_updates"},
            # Only when set, so that runs launched before env_options existed still resume.
            **({"env_options": s.env_options} if s.env_options else {}),
            **({"protocol": s.protocol} if s.protocol else {}),
        }

    def arm(self) -> str:
        """The comparison arm (spopp/compare/arms.py) of this run's recipe and learner settings, with -k<N> under
        bounded staleness max_staleness N > 0."""
        arm = arm_of(self.launch.recipe, self.learner.normalization, self.learner.dual_clip)
        k = self.launch.max_staleness
        return f"{arm}-k{k}" if k else arm


def _build(cls: type[Settings], section: str, values: dict) -> Settings:
    """The service's settings from `values`; SettingsError naming `section.field` of each problem."""
    try:
        return cls.model_validate(values)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"]) or "settings"
            if err["type"] == "extra_forbidden":
                lines.append(f"{section}.{field}: unknown setting (see `spopp {_HELP[section]} --help`)")
            else:
                lines.append(f"{section}.{field}: {err['msg']}")
        raise SettingsError("invalid launch config:\n  " + "\n  ".join(lines)) from None


def _run_config(s: LaunchSettings) -> RunConfig:
    """The tracker run's config: the file's run_config and the top-level recipe, seed and model."""
    for key in ("recipe", "seed", "study", "base_snapshot", "max_staleness", "max_updates"):
        if key in s.run_config:
            raise SettingsError(f"run_config.{key} is set by spopp launch (from the top-level settings)")
    base = str(Path(s.model).resolve())
    try:
        return RunConfig.model_validate(
            {
                **s.run_config,
                "recipe": s.recipe,
                "seed": s.seed,
                "study": s.study,
                "base_snapshot": base,
                "max_staleness": s.max_staleness,
                "max_updates": s.max_updates,  # the run's budget, fixed at creation, changed by a launch
            }  # fmt: skip
        )
    except ValidationError as exc:
        raise SettingsError(
            "invalid launch config:\n  "
            + "\n  ".join(f"run_config.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        ) from None


def _tracker(s: LaunchSettings, run_dir: Path, port: int, redis_port: int) -> TrackerSettings:
    values = {"port": 0, "log_level": "warning", **s.tracker.given()}
    values.update(data_dir=run_dir / "tracker", api_token=s.api_token, port=port, log_format=s.log_format)
    if redis_port:
        values["redis_port"] = redis_port
    return _build(TrackerSettings, "tracker", values)


def _learner(s: LaunchSettings, run_dir: Path, binding: RunBinding, port: int) -> tuple[LearnerSettings, int]:
    """The learner's settings (the recipe's defaults under the section's) and its rank count."""
    values = {**RECIPE_DEFAULTS[s.recipe], **s.learner.given()}
    values.update(
        **binding.model_dump(), model=Path(s.model).resolve(),
        snapshots=run_dir / "snapshots", checkpoints=run_dir / "checkpoints", log_dir=run_dir / "learner",
        seed=s.seed, port=port, host="127.0.0.1", log_format=s.log_format,
    )  # fmt: skip
    # recipe, max_staleness and the budget are the tracker run's (_run_config), which the learner
    # reads at start (services/learner/run_terms.py): one way in, not a second copy to reconcile.
    learner = _build(LearnerSettings, "learner", values)
    # One rank per learner GPU unless said otherwise; on a CPU machine, one rank.
    nproc = s.learner.nproc or len(s.gpus.learner) or 1
    if s.gpus.learner and nproc > len(s.gpus.learner):
        raise SettingsError(
            f"learner.nproc {nproc} needs {nproc} devices but gpus.learner gives {len(s.gpus.learner)}"
        )
    if s.max_updates % learner.updates_per_publish:
        raise SettingsError(
            f"max_updates {s.max_updates} must be a multiple of learner.updates_per_publish "
            f"{learner.updates_per_publish}: the run ends on a published version"
        )
    return learner, nproc


def with_lora_rank(s: LaunchSettings, section: str, given: dict) -> dict:
    """`given` (a section's values) with lora_rank set to the learner's when the learner publishes
    adapters: vLLM must know the rank at start-up, and the learner section's is all a user gives.
    A smaller lora_rank given by hand is refused."""
    learner = s.learner.given()
    rank = learner.get("lora_rank", 0)
    if not rank or learner.get("lora_publish", "adapter") != "adapter":
        return given
    if given.get("lora_rank", rank) < rank:
        raise SettingsError(
            f"{section}.lora_rank {given['lora_rank']} is below learner.lora_rank {rank}: the engine could "
            "not load the learner's adapters (leave it out; the launcher sets it)"
        )
    return {**given, "lora_rank": given.get("lora_rank", rank)}


def rollout_settings(
    s: LaunchSettings, i: int, binding: RunBinding, learner_url: str, port: int
) -> RolloutSettings:
    """Replica i's settings (rollout-i): at launch, and when `spopp scale` adds it to a running run."""
    # Short: a replica stops when training is over, and its in-flight work has nowhere to go.
    values = {"shutdown_seconds": 2.0, **with_lora_rank(s, "rollout", s.rollout.given())}
    values.update(
        **binding.model_dump(), model=Path(s.model).resolve(), learner=learner_url,
        env=s.env, env_options=s.env_options,
        tasks=Path(s.tasks).resolve(), worker_id=f"rollout-{i}",
        port=port, host="127.0.0.1", log_format=s.log_format,
    )  # fmt: skip
    return _build(RolloutSettings, "rollout", values)


def _rollouts(
    s: LaunchSettings, binding: RunBinding, learner_url: str, ports: dict[str, int]
) -> list[RolloutSettings]:
    return [
        rollout_settings(s, i, binding, learner_url, ports[f"rollout-{i}"]) for i in range(s.rollout.replicas)
    ]


def _evaluator(
    s: LaunchSettings, run_dir: Path, binding: RunBinding, final_version: int, port: int
) -> EvaluatorSettings | None:
    """The evaluator's settings, None when there is no held-out set or the section disables it."""
    if s.heldout is None or not s.evaluator.enabled:
        if s.heldout is None and s.evaluator.enabled and s.evaluator.model_fields_set:
            raise SettingsError(
                "evaluator settings are given but heldout is not: the evaluator needs held-out tasks"
            )
        return None
    values = {"poll_seconds": 1.0, **with_lora_rank(s, "evaluator", s.evaluator.given())}
    values.update(
        **binding.model_dump(), model=Path(s.model).resolve(),
        snapshots=run_dir / "snapshots", out_dir=run_dir / "eval", tasks=Path(s.heldout).resolve(),
        env=s.env, env_options=s.env_options, until_version=final_version, holder=f"evaluator-{s.run}",
        port=port, host="127.0.0.1", log_format=s.log_format,
    )  # fmt: skip
    evaluator = _build(EvaluatorSettings, "evaluator", values)
    if final_version % evaluator.every:
        raise SettingsError(
            f"the last version {final_version} (max_updates / learner.updates_per_publish) must be a multiple of "
            f"evaluator.every {evaluator.every}, so that the curve ends at the end of the run"
        )
    return evaluator


def process_plan(s: LaunchSettings, ports: dict[str, int]) -> ProcessPlan:
    """Every child's settings for a run of `s`, with the ports in `ports` (tracker, learner,
    evaluator, rollout-<i>, and redis for the tracker's embedded Redis). Raises SettingsError
    naming the section and field of every problem."""
    run_dir = Path(s.run_dir).resolve()
    run_config = _run_config(s)
    tracker = _tracker(s, run_dir, ports["tracker"], ports.get("redis", 0))
    # Launch's run name and token are validated narrower than the binding's, so this cannot fail.
    binding = RunBinding(run=s.run, tracker=f"http://127.0.0.1:{tracker.port}", api_token=s.api_token)
    learner, nproc = _learner(s, run_dir, binding, ports["learner"])
    final_version = s.max_updates // learner.updates_per_publish
    rollouts = _rollouts(s, binding, f"http://127.0.0.1:{learner.port}", ports)
    evaluator = _evaluator(s, run_dir, binding, final_version, ports["evaluator"])
    return ProcessPlan(s, run_config, binding, tracker, rollouts, learner, nproc, evaluator, final_version)


def port_requests(s: LaunchSettings) -> dict[str, int]:
    """The ports the config asks for (0: any free port), per process name; replicas take
    consecutive ports from rollout.port when it is set. Only ports the file gives count: a
    service's own default port is no request (the launcher picks a free one). The tracker's
    embedded Redis is drawn here with the others, so that it cannot draw a port the launcher has
    handed to a child that has not bound it yet."""

    def given(section: Section, field: str = "port") -> int:
        return section.given().get(field) or 0

    base = given(s.rollout)
    out = {"tracker": given(s.tracker), "learner": given(s.learner), "evaluator": given(s.evaluator)}
    if not s.tracker.given().get("redis_url"):
        out["redis"] = given(s.tracker, "redis_port")
    for i in range(s.rollout.replicas):
        out[f"rollout-{i}"] = base + i if base else 0
    return out
