"""A run's record as the tracker answers `GET /v1/runs/{run}`, made without a tracker: for tests
that build a replica's Worker (which takes its run at construction) where nothing is contacted."""

from __future__ import annotations

from spopp.api.tracker_api import Run

NO_COUNTS = dict(tasks=0, idle=0, in_flight=0, dispatches=0, outcomes=0, releases=0, expirations=0,
                 consumed_updates=0)  # fmt: skip


def run_record(name: str, recipe: str = "spopp", *, workers: dict | None = None, **config) -> Run:
    """A running run `name` at version 0 with `config` (RunConfig's fields) over its defaults, and
    `workers` ({worker id: WorkerStats' fields}) as the tracker's stats of the workers it has seen."""
    return Run.model_validate(
        {
            "run": name,
            "config": {"recipe": recipe, **config},
            "policy_version": 0,
            "snapshot": None,
            "counts": NO_COUNTS,
            "workers": workers or {},
        }
    )
