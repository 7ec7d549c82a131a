"""Before a replica's first dispatch: the run's record, its status, this worker id's previous life,
the learner.

The run's record is read before the Worker is built (`read_run`), and the Worker is built from
it. A replica waits for the learner's /healthz (bounded by `retry_seconds`) so that no lease waits on
a learner that is still loading its model. A run already finished ends the replica at once
(RunFinished, as a dispatch would answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import httpx

from services.config.rollout import RolloutSettings
from spopp.api.client import AsyncTrackerClient, RunFinished
from spopp.api.tracker_api import Run
from spopp.machine.wait import WaitTimeout, wait_until_async

log = logging.getLogger("spopp.rollout")

# How often the learner's /healthz is tried before the first dispatch.
LEARNER_WAIT_POLL_S = 1.0


async def read_run(s: RolloutSettings) -> Run:
    """The run's record at the tracker, read before the replica's Worker is built from it: what
    the run fixes at creation (max_staleness, lease length, seed and study), its status, and what
    the tracker has of this worker id. Retried for up to `retry_seconds`, as every tracker call."""
    async with AsyncTrackerClient(s.tracker, token=s.api_token, retry_seconds=s.retry_seconds) as tracker:
        return await tracker.get_run(s.run)


def run_finished(run: Run) -> RunFinished:
    """The refusal a dispatch would get, made from the run as the tracker reads it."""
    message = f"run {run.run} finished at version {run.final_version}: no new leases"
    return RunFinished(409, {"code": "run_finished", "message": message, "policy_version": run.final_version})


async def release_previous_life(s: RolloutSettings, tracker: AsyncTrackerClient) -> None:
    """A restarted replica's previous life's leases have no episode behind them now: give them back
    at once rather than keep their tasks out of the race until the leases expire."""
    back = await tracker.release_worker(s.run, s.worker_id)
    if back.released or back.expired:
        log.info(
            "gave back %d leases of this worker's previous life (%d found expired)",
            len(back.released), back.expired,
        )  # fmt: skip


async def wait_for_learner(
    s: RolloutSettings, learner: httpx.AsyncClient, tracker: AsyncTrackerClient, stopping: asyncio.Event
) -> None:
    """Wait until the learner's /healthz answers before the first dispatch: leases taken while
    the learner starts (its model load is the slowest start of all) would only wait on it,
    their prompt values frozen early. Bounded by retry_seconds, then the replica goes on (its
    POSTs retry by themselves); the run's status is read meanwhile, so that a run finished
    during the wait ends it (RunFinished)."""
    waited = False

    async def answers() -> bool:
        nonlocal waited
        if stopping.is_set():
            return True
        with contextlib.suppress(httpx.HTTPError):
            if (await learner.get("/healthz", timeout=5.0)).status_code == 200:
                if waited:
                    log.info("the learner answers at %s: dispatching", s.learner)
                return True
        waited = True
        # A run finished while the learner was away ends the wait (and the replica).
        run = await tracker.get_run(s.run)
        if run.status == "finished":
            raise run_finished(run)
        return False

    try:
        await wait_until_async(
            answers, s.retry_seconds, f"the learner at {s.learner}", interval=LEARNER_WAIT_POLL_S,
            on_wait=lambda: log.info("waiting for the learner at %s before the first dispatch", s.learner),
        )  # fmt: skip
    except WaitTimeout:
        log.warning(
            "the learner at %s did not answer /healthz within %.0f s; dispatching anyway",
            s.learner, s.retry_seconds,
        )  # fmt: skip
