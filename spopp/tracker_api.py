"""Typed bodies of the tracker's REST API (v1), shared by the service and the client.

Validation lives here so that the service answers 422 before it touches Redis and the client
fails before it sends: finite numbers, rewards in [0, 1], positive priors, bounded batch sizes.
Batch-size caps answered with 413 (tasks per call; see the README's route table) are checked by the
service, not here.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Id = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9_.:@/+=-]+$")]
Finite = Annotated[float, Field(allow_inf_nan=False)]
Reward = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
Positive = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]

MAX_TASKS_PER_CALL = 10_000
MAX_BATCH = 10_000


class _Body(BaseModel):
    # Unknown fields are a typo on the caller's side: say so rather than ignore them.
    model_config = ConfigDict(extra="forbid")


class RunConfig(_Body):
    """A run: one recipe, its prior mass, its retention and leases. Only `recipe` is required."""

    recipe: Literal["spopp", "spo"]
    base_snapshot: str | None = Field(None, max_length=4096, description="snapshot of policy version 0")
    retention: float = Field(0.875, gt=0.0, lt=1.0, description="rho per policy event (spopp)")
    prior_mass: Positive = Field(8.0, description="total Beta mass of the offline prior")
    lease_seconds: float = Field(900.0, gt=0.0, le=7 * 24 * 3600.0, allow_inf_nan=False)
    seed: int = Field(0, ge=0, lt=2**63, description="seed of the sampler's draws")
    d_half: Positive = Field(0.06, description="SPO drift half-life")
    rho_min: float = Field(0.875, gt=0.0, le=1.0)
    rho_max: float = Field(0.96, gt=0.0, le=1.0)

    @model_validator(mode="after")
    def _rho_order(self) -> RunConfig:
        if self.rho_min > self.rho_max:
            raise ValueError("rho_min must be <= rho_max")
        return self


class RunCounts(BaseModel):
    tasks: int
    idle: int
    in_flight: int
    dispatches: int
    outcomes: int
    releases: int
    expirations: int
    consumed_updates: int


class Run(BaseModel):
    run: str
    config: RunConfig
    policy_version: int
    snapshot: str | None
    counts: RunCounts


class TaskPrior(_Body):
    """A task with an explicit prior (alpha0, beta0) or with offline 0/1 outcomes (Jeffreys init)."""

    task_id: Id
    alpha0: Positive | None = None
    beta0: Positive | None = None
    outcomes: list[Annotated[int, Field(ge=0, le=1)]] | None = Field(None, max_length=100_000)

    @model_validator(mode="after")
    def _one_form(self) -> TaskPrior:
        explicit = self.alpha0 is not None or self.beta0 is not None
        if explicit == (self.outcomes is not None):
            raise ValueError("give either alpha0 and beta0, or outcomes, not both and not neither")
        if explicit and (self.alpha0 is None or self.beta0 is None):
            raise ValueError("alpha0 and beta0 go together")
        return self


class PutTasks(_Body):
    tasks: list[TaskPrior]


class PutTasksResult(BaseModel):
    created: int
    unchanged: int


class TaskState(BaseModel):
    task_id: str
    alpha: float
    beta: float
    value: float
    in_flight: bool
    dispatches: int
    outcomes: int


class DispatchBody(_Body):
    worker_id: Id
    policy_version: int = Field(ge=0)
    max_requests: int = Field(ge=1, le=1024)
    idempotency_key: Id | None = None


class Lease(BaseModel):
    request_id: str
    task_id: str
    value: float
    policy_version: int
    lease_expires_at: str


class Dispatched(BaseModel):
    policy_version: int
    snapshot: str | None
    requests: list[Lease]


class Outcome(_Body):
    request_id: Id
    reward: Reward


class OutcomesBody(_Body):
    outcomes: list[Outcome] = Field(min_length=1, max_length=MAX_BATCH)


class OutcomeResult(BaseModel):
    request_id: str
    value: float
    advantage: float | None


class OutcomesResult(BaseModel):
    results: list[OutcomeResult]


class RequestState(BaseModel):
    request_id: str
    task_id: str
    state: Literal["leased", "reported", "released", "expired"]
    policy_version: int
    lease_expires_at: str


class ValuesBody(_Body):
    task_ids: list[Id] = Field(min_length=1, max_length=MAX_BATCH)


class TaskValue(BaseModel):
    task_id: str
    alpha: float
    beta: float
    value: float


class ValuesResult(BaseModel):
    values: list[TaskValue]


class ConsumeItem(_Body):
    task_id: Id
    reward: Reward
    drift: float = Field(ge=0.0, allow_inf_nan=False)


class ConsumeBody(_Body):
    update_id: Id
    items: list[ConsumeItem] = Field(min_length=1, max_length=MAX_BATCH)


class ConsumeResult(BaseModel):
    task_id: str
    rho: float
    alpha: float
    beta: float
    value: float


class PolicyBody(_Body):
    version: int = Field(ge=1)
    snapshot: str = Field(min_length=1, max_length=4096)


class Policy(BaseModel):
    version: int
    z: float
    snapshot: str | None
