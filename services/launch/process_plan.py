"""What `spopp launch` will start for a config: every child's settings, built from the launch file
(services/config/launch.py) and validated before anything starts, and the ports the file asks for.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from services.config.evaluator import EvaluatorSettings
from services.config.launch import SERVICE_HELP, LaunchSettings, Section
from services.config.learner import LearnerSettings
from services.config.rollout import RolloutSettings
from services.config.tracker import TrackerSettings
from spopp.api.tracker_api import RunConfig
from spopp.compare.arms import arm_of
from spopp.settings.base import Settings, SettingsError
from spopp.settings.recipes import RECIPE_DEFAULTS
from spopp.settings.run_binding import RunBinding


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
                lines.append(
                    f"{section}.{field}: unknown setting (see `spopp {SERVICE_HELP[section]} --help`)"
                )
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
