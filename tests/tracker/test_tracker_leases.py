"""Leases: duplicates count once, conflicts are 409, expired leases return their task."""

import time

import pytest

from spopp.api.client import TrackerError


def test_duplicate_outcome_counts_once(client, make_run):
    run = make_run(tasks=[{"task_id": "q", "alpha0": 1.0, "beta0": 1.0}])
    r = client.dispatch(run, "w", 0, 1).requests[0]
    first = client.outcomes(run, [(r.request_id, 1.0)])
    before = client.export(run)
    assert client.outcomes(run, [(r.request_id, 1.0)]) == first
    # Twice in one batch is also one outcome.
    r2 = client.dispatch(run, "w", 0, 1).requests[0]
    client.outcomes(run, [(r2.request_id, 0.0), (r2.request_id, 0.0)])
    t = client.get_task(run, "q")
    assert t.outcomes == 2 and (t.alpha, t.beta) == (2.0, 2.0)
    assert before[0]["outcomes"] == 1 and client.get_run(run).counts.outcomes == 2


def test_conflicting_outcome_is_409_and_changes_nothing(client, make_run):
    run = make_run(tasks=[{"task_id": "q", "alpha0": 1.0, "beta0": 1.0}])
    r = client.dispatch(run, "w", 0, 1).requests[0]
    client.outcomes(run, [(r.request_id, 1.0)])
    before = client.export(run)
    with pytest.raises(TrackerError) as err:
        client.outcomes(run, [(r.request_id, 0.0)])
    assert err.value.status == 409 and err.value.code == "outcome_conflict"
    assert err.value.detail["request_ids"] == [r.request_id]
    # Two different rewards for one live lease in one batch: also a conflict, nothing applied.
    r2 = client.dispatch(run, "w", 0, 1).requests[0]
    with pytest.raises(TrackerError) as err:
        client.outcomes(run, [(r2.request_id, 1.0), (r2.request_id, 0.0)])
    assert err.value.status == 409
    after = client.export(run)
    assert [{**x, "in_flight": False, "dispatches": 0} for x in after] == [
        {**x, "in_flight": False, "dispatches": 0} for x in before
    ]
    assert after[0]["outcomes"] == 1


def test_expired_lease_returns_task_and_late_outcome_is_rejected(client, make_run):
    run = make_run(tasks=[{"task_id": "q", "alpha0": 1.0, "beta0": 3.0}], lease_seconds=0.3)
    r = client.dispatch(run, "w", 0, 1).requests[0]
    assert client.dispatch(run, "w", 0, 1).requests == []
    time.sleep(0.45)
    assert not client.get_task(run, "q").in_flight
    assert client.get_run(run).counts.in_flight == 0
    before = client.export(run)
    with pytest.raises(TrackerError) as err:
        client.outcomes(run, [(r.request_id, 1.0)])
    assert err.value.status == 409 and err.value.code == "lease_not_live"
    with pytest.raises(TrackerError):
        client.renew(run, r.request_id)
    assert client.export(run) == before
    again = client.dispatch(run, "w2", 0, 1).requests
    assert [x.task_id for x in again] == ["q"] and again[0].request_id != r.request_id
    assert client.get_run(run).counts.expirations == 1
    with pytest.raises(TrackerError) as err:  # still rejected after the task was leased again
        client.outcomes(run, [(r.request_id, 1.0)])
    assert err.value.status == 409
    assert client.get_task(run, "q").outcomes == 0


def test_renew_keeps_a_long_episode_alive(client, make_run):
    run = make_run(tasks=[{"task_id": "q", "alpha0": 1.0, "beta0": 1.0}], lease_seconds=0.4)
    r = client.dispatch(run, "w", 0, 1).requests[0]
    for _ in range(4):
        time.sleep(0.2)
        client.renew(run, r.request_id)
    [res] = client.outcomes(run, [(r.request_id, 1.0)])
    assert res.advantage == 0.5


def test_release_of_an_expired_lease_is_a_no_op_that_reclaims(client, make_run):
    run = make_run(tasks=[{"task_id": "q", "alpha0": 1.0, "beta0": 1.0}], lease_seconds=0.2)
    r = client.dispatch(run, "w", 0, 1).requests[0]
    time.sleep(0.3)
    assert client.release(run, r.request_id).state == "expired"
    assert client.release(run, r.request_id).state == "expired"
    counts = client.get_run(run).counts
    assert (counts.idle, counts.expirations, counts.releases) == (1, 1, 0)


def test_release_worker_gives_back_that_workers_live_leases_and_nothing_else(client, make_run):
    """A restarted replica's call: its live leases go back at once, another worker's stay, an
    outcome already reported stays counted, and a repeat (or an unknown worker) gives back none."""
    tasks = [{"task_id": f"q{i}", "alpha0": 1.0, "beta0": 1.0} for i in range(4)]
    run = make_run(tasks=tasks)
    mine = client.dispatch(run, "w", 0, 2).requests
    theirs = client.dispatch(run, "w2", 0, 1).requests
    client.outcomes(run, [(mine[0].request_id, 1.0)])
    before = client.get_run(run).counts
    assert (before.in_flight, before.releases, before.outcomes) == (2, 0, 1)

    back = client.release_worker(run, "w")
    assert back.worker_id == "w" and back.released == [mine[1].request_id] and back.expired == 0
    after = client.get_run(run).counts
    assert (after.in_flight, after.releases, after.outcomes, after.idle) == (1, 1, 1, 3)
    assert not client.get_task(run, mine[1].task_id).in_flight
    assert client.get_task(run, theirs[0].task_id).in_flight
    # The old life's report, arriving late, is refused and counts nothing.
    with pytest.raises(TrackerError) as err:
        client.outcomes(run, [(mine[1].request_id, 1.0)])
    assert err.value.status == 409 and err.value.code == "lease_not_live"
    assert client.release_worker(run, "w").released == []
    assert client.release_worker(run, "never-seen").released == []
    assert client.get_run(run).counts == after


def test_release_worker_expires_what_is_past_its_expiry(client, make_run):
    run = make_run(tasks=[{"task_id": "q", "alpha0": 1.0, "beta0": 1.0}], lease_seconds=0.2)
    client.dispatch(run, "w", 0, 1)
    time.sleep(0.3)
    back = client.release_worker(run, "w")
    assert (back.released, back.expired) == ([], 1)
    counts = client.get_run(run).counts
    assert (counts.idle, counts.expirations, counts.releases) == (1, 1, 0)
