"""`spopp init`: the init step of a deployment: create the run at the tracker, load its tasks and prior.

Compose and Kubernetes run it once before the learner, the replicas and the evaluator start (they
wait for it to complete). It waits for the tracker, then registers through the same code as
`spopp launch` (`spopp.api.registration`): the same settings again change nothing, so every `up`
may run it; a run that exists with another recipe, prior or budget (max_updates) is refused before
anything trains. Init never grows a budget: a stack's settings are fixed with its run.
"""

from __future__ import annotations

from pydantic import ValidationError

from services.config.init import InitSettings
from spopp.api.tracker_api import RunConfig
from spopp.machine.wait import WaitTimeout, wait_http


def run_init(s: InitSettings, echo=print) -> None:
    from runtime.tasks import load_tasks
    from spopp.api.client import TrackerClient
    from spopp.api.registration import register, task_bodies

    for key in ("recipe", "seed", "base_snapshot", "max_updates"):
        if key in s.run_config:
            raise ValueError(f"run_config.{key}: give it as its own setting ({key})")
    try:
        config = RunConfig.model_validate(
            {
                **s.run_config,
                "recipe": s.recipe,
                "seed": s.seed,
                "base_snapshot": s.base_snapshot,
                "max_updates": s.max_updates,
            }  # fmt: skip
        )
    except ValidationError as exc:
        raise ValueError(
            "run_config: " + "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        ) from None
    try:
        ids = [t.task_id for t in load_tasks(s.tasks)]
    except FileNotFoundError:
        raise ValueError(f"tasks file {s.tasks} does not exist") from None
    if not ids:
        raise ValueError(f"tasks file {s.tasks} holds no tasks")
    bodies = task_bodies(ids, s.prior, f"the training tasks {s.tasks}")
    _wait_ready(s.tracker, s.wait_seconds, echo)
    with TrackerClient(s.tracker, token=s.api_token, retry_seconds=min(60.0, s.wait_seconds)) as client:
        register(client, s.run, config.model_dump(mode="json"), bodies, echo)
        run = client.get_run(s.run)
    if run.status == "finished":
        # Nothing to train: the learner, the replicas and the evaluator will each say so and exit 0.
        echo(f"run {s.run} is finished (version {run.final_version}, {run.finished_at}): "
             "nothing to train; a new run needs another run name or fresh volumes")  # fmt: skip


def _wait_ready(url: str, seconds: float, echo) -> None:
    try:
        wait_http(
            url.rstrip("/") + "/readyz", seconds, f"the tracker at {url}", interval=1.0, request_timeout=5,
            on_wait=lambda: echo(f"waiting for the tracker at {url} ..."),
        )  # fmt: skip
    except WaitTimeout:
        raise RuntimeError(f"the tracker at {url} was not ready within {seconds:.0f} s") from None
