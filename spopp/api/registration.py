"""Creating a run at the tracker and loading its tasks with their prior: the one place that does it.

Used by `spopp launch` (before the learner starts) and by `spopp init`, the init step of
docker compose and Kubernetes. Both calls are idempotent at the tracker: the same run config
again answers 200, the same task prior again counts as unchanged, so a second `up` or a resumed
launch changes nothing. Anything else (the run exists with another recipe, a task with another
prior, another budget) is refused by the tracker with 409 and reported here as a RegistrationError
that says which and why, before any learner or replica could train on the wrong run. A budget
(max_updates) is fixed at creation and changes only when the caller asks (`spopp launch` does).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from spopp.api.client import TrackerClient, TrackerError
from spopp.api.tracker_api import RunConfig
from spopp.files.priors import read_prior

PUT_CHUNK = 10_000  # the tracker's per-call task limit


class RegistrationError(RuntimeError):
    """The run or its tasks could not be registered; the message says why."""


@dataclass(frozen=True)
class Registered:
    policy_version: int  # 0 for a new run; a resumed one may be further
    tasks_created: int
    tasks_unchanged: int


def task_bodies(
    train_ids: Iterable[str], prior: str | Path | None, tasks_name: str = "the training tasks"
) -> list[dict]:
    """The tracker's task entries: the prior file's (every one of its tasks must be a training
    task), or a flat Jeffreys prior (no outcomes) for every training task when there is none."""
    train_ids = list(train_ids)
    if prior is None:
        return [{"task_id": t, "outcomes": []} for t in train_ids]
    try:
        p = read_prior(prior)
    except (OSError, ValueError) as exc:
        raise RegistrationError(f"prior: {exc}") from None
    known = set(train_ids)
    unknown = [t.task_id for t in p.tasks if t.task_id not in known]
    if unknown:
        raise RegistrationError(
            f"prior {prior} names {len(unknown)} tasks that are not in {tasks_name} "
            f"(e.g. {', '.join(unknown[:3])}): was it computed on another task file?"
        )
    return p.task_bodies()


def _put_run(
    client: TrackerClient, run: str, run_config: dict, change_budget: bool, echo: Callable[[str], None]
):
    """PUT the run. A run that differs only by its budget (max_updates) has it changed first when
    `change_budget` says so (`spopp launch`, the explicit operator); any other difference, or
    another budget without it, is a RegistrationError."""
    try:
        return client.put_run(run, run_config)
    except TrackerError as exc:
        if exc.status != 409:
            raise RegistrationError(f"creating run {run!r} at the tracker: {exc}") from None
        held = dict((exc.detail or {}).get("config") or {})
    wanted = RunConfig.model_validate(run_config)
    ours, theirs = wanted.max_updates, held.get("max_updates")
    if held and RunConfig.model_validate({**held, "max_updates": ours}).canonical() == wanted.canonical():
        if change_budget and ours is not None:
            try:
                client.set_budget(run, ours)
            except TrackerError as exc:
                raise RegistrationError(f"changing the budget of run {run!r}: {exc}") from None
            echo(f"tracker: run {run}'s budget changed from {theirs or 'unset'} to {ours} updates")
            return client.put_run(run, run_config)
        raise RegistrationError(
            f"the budget of run {run!r} is {theirs} updates, fixed at its creation; this asks for {ours}. Start with "
            f"max_updates {theirs} (the stack's settings file keeps it), or change the budget explicitly "
            "(`spopp launch` does; POST /v1/runs/{run}/budget)"
        )
    raise RegistrationError(
        f"the tracker holds run {run!r} with another config ({held}); the recipe, seed, base snapshot or run "
        "config given now differ from the run's"
    )


def register(client: TrackerClient, run: str, run_config: dict, bodies: list[dict],
             echo: Callable[[str], None] = print, change_budget: bool = False) -> Registered:  # fmt: skip
    """PUT the run (changing its budget first with `change_budget`), then its tasks in chunks;
    RegistrationError on a conflict."""
    answer = _put_run(client, run, run_config, change_budget, echo)
    created = unchanged = 0
    for i in range(0, len(bodies), PUT_CHUNK):
        try:
            result = client.put_tasks(run, bodies[i : i + PUT_CHUNK])
        except TrackerError as exc:
            raise RegistrationError(
                f"loading the tasks at the tracker: {exc} (a task already there with another prior: "
                "the prior file changed since this run was created)"
            ) from None
        created += result.created
        unchanged += result.unchanged
    echo(f"tracker: run {run} ready, tasks {created} created, {unchanged} unchanged")
    return Registered(answer.policy_version, created, unchanged)
