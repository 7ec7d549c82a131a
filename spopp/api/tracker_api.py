"""Typed bodies of the tracker's REST API (v1), shared by the service and the client.

Validation lives here so that the service answers 422 before it touches Redis and the client
fails before it sends: finite numbers, rewards in [0, 1], positive priors, bounded batch sizes.
Every list has a max_length, which pydantic checks before the list's items; the tasks-per-call cap
is answered 413 by the service (see the route table in docs/tracker.md), the others 422.

Every number has both bounds (the LIMITS below), chosen generous for real use and small enough
that nothing the tracker computes from them later overflows or turns into nan: prior masses and
(alpha0, beta0) up to 1e6 keep a + b finite, versions below 2^31 keep the event coordinate
z = version * -ln(retention) far from overflow, and the lower bounds keep a Jeffreys prior from
underflowing to 0 (which would make the value 0/0). The tracker's Lua scripts check the same
LIMITS again before their first write.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from spopp.settings.fields import ID_CHARS, MAX_ID_CHARS, Id, MaxStaleness, Recipe, Seed, WorkerId

# The prior file and `spopp prior` check task ids against TASK_ID, so no file carries a task PUT
# /tasks would refuse; the id types themselves are spopp.settings.fields' (an id is a path segment).
TASK_ID = re.compile(rf"^(?!\.{{1,2}}$)[{ID_CHARS}]{{1,{MAX_ID_CHARS}}}$")


Finite = Annotated[float, Field(allow_inf_nan=False)]
Reward = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
Positive = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]

MAX_TASKS_PER_CALL = 10_000
MAX_BATCH = 10_000
MAX_REQUESTS = 1024  # leases per dispatch
MAX_OUTCOMES_PER_TASK = 100_000  # offline outcomes of one task's Jeffreys prior
MIN_PRIOR, MAX_PRIOR = 1e-6, 1e6  # alpha0, beta0 and the prior mass
MAX_VERSION = 2**31 - 1  # policy versions
MIN_RETENTION = 1e-6
MIN_LEASE_SECONDS, MAX_LEASE_SECONDS = 0.001, 7 * 24 * 3600.0
MIN_D_HALF, MAX_D_HALF = 1e-6, 1e6
MIN_RHO = 1e-6
MAX_DRIFT = 1e6
MAX_SNAPSHOT_CHARS = 4096
MAX_WORKERS_PER_RUN = 4096  # workers a run keeps stats of (the tracker's default bound)
MAX_RUNS = 4096  # runs one tracker keeps (its default bound; a new run beyond it is 409)
MAX_COUNT = 2**53 - 1  # a worker's reported counts: exact in a double, as Lua keeps them
MAX_REASON_CHARS = 200

Prior = Annotated[float, Field(ge=MIN_PRIOR, le=MAX_PRIOR, allow_inf_nan=False)]

# What the Lua scripts check again before they write (names as the scripts see them).
LIMITS = {
    "MAX_TASKS_PER_CALL": MAX_TASKS_PER_CALL,
    "MAX_BATCH": MAX_BATCH,
    "MAX_REQUESTS": MAX_REQUESTS,
    "MIN_PRIOR_MASS": MIN_PRIOR,
    "MAX_PRIOR": MAX_PRIOR,
    "MAX_VERSION": MAX_VERSION,
    "MAX_LAM": -math.log(MIN_RETENTION),
    "MIN_LEASE_MS": 1,
    "MAX_LEASE_MS": round(MAX_LEASE_SECONDS * 1000),
    "MIN_D_HALF": MIN_D_HALF,
    "MAX_D_HALF": MAX_D_HALF,
    "MIN_RHO": MIN_RHO,
    "MAX_DRIFT": MAX_DRIFT,
    "MAX_SNAPSHOT_CHARS": MAX_SNAPSHOT_CHARS,
    "MAX_STREAM_CHARS": MAX_ID_CHARS,  # a stream key is a study or a run name, both ids
    "MAX_COUNT": MAX_COUNT,
    "MAX_REASON_CHARS": MAX_REASON_CHARS,
}


class _Body(BaseModel):
    # Unknown fields are a typo on the caller's side: say so rather than ignore them. Strict types:
    # JSON's true is no version or count, "0.25" no reward, 1.0 no integer (an integer is a float).
    model_config = ConfigDict(extra="forbid", strict=True)


class RunConfig(_Body):
    """A run: one recipe, its prior mass, its retention and leases. Only `recipe` is required."""

    recipe: Recipe
    base_snapshot: str | None = Field(
        None, max_length=MAX_SNAPSHOT_CHARS, description="snapshot of policy version 0 (up to 4096 chars)"
    )
    retention: float = Field(
        0.875, ge=MIN_RETENTION, lt=1.0, description="rho per policy event (spopp), in [1e-6, 1)"
    )
    prior_mass: Prior = Field(
        8.0, description="total Beta mass of the offline (outcomes-form) prior, in [1e-6, 1e6]"
    )
    lease_seconds: float = Field(
        900.0,
        ge=MIN_LEASE_SECONDS,
        le=MAX_LEASE_SECONDS,
        allow_inf_nan=False,
        description="lease length, renewable, in [0.001, 604800] (one week)",
    )
    seed: Seed = Field(0, description="seed of the sampler's draws, in [0, 2^63)")
    study: Id | None = Field(
        None,
        description="with the seed, the key of every draw that is not the method's (the sampler's, the "
        "replicas' sampling, the environments'): runs of one seed and study draw the same numbers, the "
        "common random numbers of a paired comparison; null: the run's name (runs stay independent)",
    )
    d_half: float = Field(
        0.06,
        ge=MIN_D_HALF,
        le=MAX_D_HALF,
        allow_inf_nan=False,
        description="SPO drift half-life, in [1e-6, 1e6]",
    )
    rho_min: float = Field(0.875, ge=MIN_RHO, le=1.0, description="SPO's smallest retention, in [1e-6, 1]")
    rho_max: float = Field(0.96, ge=MIN_RHO, le=1.0, description="SPO's largest retention, in [1e-6, 1]")
    max_staleness: MaxStaleness = Field(
        0,
        description="k: the learner trains on trajectories up to k policy versions older than its own "
        "(0: only the current version's, the paper's protocol); replicas keep generating across a "
        "swap when k > 0",
    )

    max_updates: StrictInt | None = Field(
        None,
        ge=1,
        le=MAX_VERSION,
        description="the run's budget in learner updates, fixed at creation and changed only by POST "
        "/runs/{run}/budget; a learner started with another max_updates refuses to start (null: not fixed)",
    )

    @model_validator(mode="after")
    def _rho_order(self) -> RunConfig:
        if self.rho_min > self.rho_max:
            raise ValueError("rho_min must be <= rho_max")
        return self

    def canonical(self) -> dict:
        """The config as the tracker stores and compares it (PUT of an existing run must match).
        max_staleness 0 and an unset max_updates are left out, so that a run stored before the
        fields existed and the same run PUT again by a newer client compare equal; reading it back
        fills the defaults in."""
        out = self.model_dump(mode="json")
        if not out["max_staleness"]:
            del out["max_staleness"]
        if out["max_updates"] is None:  # likewise for a run stored before budgets were fixed
            del out["max_updates"]
        if out["study"] is None:  # and for one stored before studies keyed the draws
            del out["study"]
        return out


class RunCounts(BaseModel):
    tasks: int
    idle: int
    in_flight: int
    dispatches: int
    outcomes: int
    # Outcomes reported after a newer policy version than their dispatch's was published.
    late_outcomes: int = 0
    # Outcomes reported after the outcome of a request dispatched later (out of dispatch order),
    # and the sum over them of how many dispatches the newest reported request was past each.
    overtaken_outcomes: int = 0
    reorder_distance: int = 0
    releases: int
    expirations: int
    consumed_updates: int


class WorkerStats(BaseModel):
    """What one worker did in a run. `trajectories` and `episodes` are the largest counts the
    worker has reported (monotone: a retried, reordered or restarted worker's lower count never
    lowers them); `leases` and `outcomes` are counted by the tracker itself."""

    leases: int
    outcomes: int
    trajectories: int
    episodes: int
    last_seen: str | None


class Run(BaseModel):
    run: str
    config: RunConfig
    policy_version: int
    snapshot: str | None
    counts: RunCounts
    status: Literal["running", "finished"] = "running"
    finished_at: str | None = None
    final_version: int | None = None
    finish_reason: str | None = None
    workers: dict[str, WorkerStats] = Field(default_factory=dict)


Reason = Annotated[str, Field(min_length=1, max_length=MAX_REASON_CHARS, pattern=r"^[ -~]+$")]


class FinishBody(_Body):
    version: int = Field(ge=0, le=MAX_VERSION, description="the run's current policy version, < 2^31")
    reason: Reason = Field("max_updates", description="why the run ends: printable ASCII, up to 200 chars")


class BudgetBody(_Body):
    max_updates: int = Field(
        ge=1, le=MAX_VERSION, description="the run's new budget in learner updates, < 2^31"
    )


class ReopenBody(_Body):
    version: int = Field(ge=0, le=MAX_VERSION, description="the version the run finished at, < 2^31")


Count = Annotated[StrictInt, Field(ge=0, le=MAX_COUNT)]


class HeartbeatBody(_Body):
    trajectories: Count = Field(description="trajectories the learner accepted from this worker, cumulative")
    episodes: Count = Field(description="episodes this worker finished, cumulative")


class WorkerBeat(WorkerStats):
    worker_id: str
    run_status: Literal["running", "finished"]


class WorkerReleased(BaseModel):
    """What POST /v1/runs/{run}/workers/{worker_id}/release gave back."""

    worker_id: str
    released: list[str] = Field(description="request ids whose live leases were released")
    expired: int = Field(description="leases of the worker found past their expiry, expired instead")


class TaskPrior(_Body):
    """A task with an explicit prior (alpha0, beta0) or with offline 0/1 outcomes (Jeffreys init)."""

    task_id: Id
    alpha0: Prior | None = Field(None, description="explicit prior's alpha, in [1e-6, 1e6]")
    beta0: Prior | None = Field(None, description="explicit prior's beta, in [1e-6, 1e6]")
    outcomes: list[Annotated[int, Field(ge=0, le=1)]] | None = Field(
        None,
        max_length=MAX_OUTCOMES_PER_TASK,
        description="offline 0/1 outcomes (up to 100,000) for a Jeffreys prior of the run's prior mass",
    )

    @model_validator(mode="after")
    def _one_form(self) -> TaskPrior:
        explicit = self.alpha0 is not None or self.beta0 is not None
        if explicit == (self.outcomes is not None):
            raise ValueError("give either alpha0 and beta0, or outcomes, not both and not neither")
        if explicit and (self.alpha0 is None or self.beta0 is None):
            raise ValueError("alpha0 and beta0 go together")
        return self


class PutTasks(_Body):
    # The cap is checked before any task is (the service answers it 413, as before).
    tasks: list[TaskPrior] = Field(max_length=MAX_TASKS_PER_CALL)


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
    worker_id: WorkerId
    policy_version: int = Field(ge=0, le=MAX_VERSION, description="the caller's policy version, < 2^31")
    max_requests: int = Field(ge=1, le=MAX_REQUESTS, description="leases wanted, 1 to 1024")
    idempotency_key: Id | None = Field(
        None,
        description="the same key answers the same leases; remembered for the tracker's "
        "idempotency_ttl_seconds (an hour by default), longer than any client retries",
    )


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


class LookupBody(_Body):
    request_ids: list[Id] = Field(min_length=1, max_length=MAX_BATCH)


class RequestInfo(BaseModel):
    """What the tracker knows of a request id: `unknown` when this run never issued it (or its
    record expired after the run's idempotency time)."""

    request_id: str
    state: Literal["leased", "reported", "released", "expired", "unknown"]
    task_id: str | None = None
    policy_version: int | None = None


class LookupResult(BaseModel):
    requests: list[RequestInfo]


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
    drift: float = Field(ge=0.0, le=MAX_DRIFT, allow_inf_nan=False, description="policy drift, in [0, 1e6]")


class ConsumeBody(_Body):
    update_id: Id = Field(
        description="applied once: a repeat within the tracker's idempotency_ttl_seconds (an hour by "
        "default) answers the first results"
    )
    items: list[ConsumeItem] = Field(min_length=1, max_length=MAX_BATCH)


class ConsumeResult(BaseModel):
    task_id: str
    rho: float
    alpha: float
    beta: float
    value: float


class PolicyBody(_Body):
    version: int = Field(ge=1, le=MAX_VERSION, description="the next policy version, in [1, 2^31)")
    snapshot: str = Field(min_length=1, max_length=MAX_SNAPSHOT_CHARS, description="up to 4096 chars")


class Policy(BaseModel):
    version: int
    z: float
    snapshot: str | None
