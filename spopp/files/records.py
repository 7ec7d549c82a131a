"""The records a run leaves in its folder: the launcher's `run.json` and the evaluator's `evals.jsonl`.

Both are written by one service and read by others (the launcher's resume, `spopp report`, the
launcher's progress line), which may not import each other, so their models live here. Readers
need only some fields and files written by earlier versions lack later ones, so every field a
reader can do without is optional; keys a later writer adds are kept (extra="allow").

    run.json     {"run", "arm", "recipe", "normalization", "seed", "max_updates", "final_version",
                  "identity": {...}, "env", "env_options": {...}, "status", "started", "launches", "updates_done", "finished",
                  "running_s",
                  "code": {"commit", "dirty", "lock_sha256", ...}, "machine": {...}}  (spopp/files/provenance.py)
    evals.jsonl  {"policy_version", "step", "snapshot", "time", "eval/...": ...} when scored,
                 {"policy_version", "skipped": "<reason>", "time"} when not; one line a version
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, StrictInt

from spopp.files.jsonfile import to_text

__all__ = ["EvalRecord", "RunRecord"]


class RunRecord(BaseModel):
    """run.json: what a launched run is (arm, recipe, seed, identity) and its status."""

    model_config = ConfigDict(extra="allow")

    run: str | None = Field(None, description="the run's name at the tracker")
    arm: str = Field(
        min_length=1,
        description="the comparison arm: spo, spopp, spopp-trajnorm; -k<N> under max_staleness N",
    )
    recipe: str | None = Field(None, description="spopp or spo")
    normalization: str | None = Field(None, description="the learner's advantage normalization")
    seed: StrictInt = Field(description="the run's seed")
    # Records written before the rename carry the budget as "updates" (docs/map/data, docs/results).
    max_updates: StrictInt | None = Field(
        None,
        ge=1,
        validation_alias=AliasChoices("max_updates", "updates"),
        description="the budget in learner updates",
    )
    final_version: StrictInt | None = Field(None, ge=0, description="the budget's last policy version")
    identity: dict[str, Any] = Field(
        default_factory=dict, description="what a resume may not change (see launch's ProcessPlan.identity)"
    )
    env: str | None = Field(None, description="the environment (math-tir, toy-calc, alfworld)")
    env_options: dict[str, Any] | None = Field(
        None,
        description="every option the environment ran with, its defaults included (identity keeps "
        "env_options as given, which a resume compares)",
    )
    status: str | None = Field(None, description="running, finished, stopped or failed")
    started: float | None = Field(None, description="unix time of the first launch")
    launches: StrictInt = Field(0, ge=0, description="launches of this folder so far")
    updates_done: StrictInt | None = Field(None, ge=0, description="learner updates when it last stopped")
    finished: float | None = Field(None, description="unix time it finished")
    running_s: float | None = Field(
        None, ge=0, description="seconds its launches ran, summed: its wall time without the gaps between "
        "launches (absent in runs launched before run.json recorded it)",
    )  # fmt: skip
    restarts: dict[str, StrictInt] = Field(
        default_factory=dict,
        description="restarts per process by the launcher's supervision, over every launch",
    )
    metrics_url: str | None = Field(None, description="the last launcher's /metrics (spopp_restarts_total)")
    replicas: StrictInt | None = Field(
        None, ge=0, description="rollout replicas now (spopp scale changes it)"
    )
    tracker_counts: dict[str, StrictInt] | None = Field(
        None, description="the tracker's run counts at the end (dispatches, outcomes, releases, ...)"
    )
    workers: dict[str, dict[str, Any]] | None = Field(
        None, description="the tracker's per-worker counts at the end (leases, outcomes, ...)"
    )
    code: dict[str, Any] | None = Field(
        None,
        description="the code that made the run (spopp/files/provenance.py: commit, dirty, lock_sha256, earlier "
        "launches on other code); absent in runs launched before run.json recorded it",
    )
    protocol: str | None = Field(
        None, description="the sha256 of the study's pre-registered protocol.json (spopp study compare)"
    )
    machine: dict[str, Any] | None = Field(
        None,
        description="the machine of its last launch (spopp/files/provenance.py: platform, CPU, cores, GPUs)",
    )

    @property
    def seconds(self) -> float | None:
        """How long the run ran: its launches' seconds summed, or, for a run launched before those
        were recorded, first launch to finish; None when it never finished and recorded neither."""
        if self.running_s is not None:
            return self.running_s
        if self.started and self.finished:
            return self.finished - self.started
        return None

    def to_text(self, where: str) -> str:
        """The file's text: the keys set, in order, two-space indented (as earlier launchers wrote)."""
        return to_text(self.model_dump(mode="json", exclude_unset=True), where)


class EvalRecord(BaseModel):
    """One line of evals.jsonl: a scored version (metrics as extra `eval/...` keys) or a skipped one."""

    model_config = ConfigDict(extra="allow")

    policy_version: StrictInt = Field(ge=0, description="the policy version handled")
    step: StrictInt | None = Field(
        None, ge=0, description="the learner's updates behind it, from its manifest"
    )
    snapshot: str | None = Field(None, description="the folder scored")
    skipped: str | None = Field(None, description="why the version was not scored (only then)")
    time: float | None = Field(None, description="unix time of the record")

    @property
    def metrics(self) -> dict[str, Any]:
        """The scores (every key the fields above do not name)."""
        return dict(self.model_extra or {})

    def to_line(self) -> str:
        """The line's text, newline included: the keys given, in order. A NaN score is written as
        today's evaluator always wrote it (JSON's NaN extension), rather than failing the version."""
        return json.dumps(self.model_dump(exclude_unset=True)) + "\n"
