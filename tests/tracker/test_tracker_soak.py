"""A bounded soak: steady dispatch + outcome (+ release, + SPO consume) load on a real tracker and
a real redis-server keeps Redis's key count and memory flat once the idempotency TTL has passed,
and every acknowledged outcome is counted."""

from __future__ import annotations

import time

import pytest
import redis as redis_sync

from services.tracker.embedded import EmbeddedRedis
from spopp.api.client import TrackerClient
from tools.tracker_process import TrackerProcess

pytestmark = pytest.mark.process  # starts processes: the process tier (tests/conftest.py)

TTL_SECONDS = 4  # the tracker's idempotency_ttl_seconds here: expiry shows within the test
LOAD_SECONDS = 45  # 12 s of warm-up, then thirds of 11 s: each near three TTLs
SAMPLE_EVERY = 2.0
WARM_UP = 12.0  # > TTL: by then as many records expire as are made
ROUNDS_PER_SECOND = 75  # paced (4 leases a round: 300 leases/s), so the load is steady
MAX_ROUNDS = ROUNDS_PER_SECOND * LOAD_SECONDS  # the loop ends at this count or at LOAD_SECONDS
N_TASKS = 64
# A lease leaves one expiring record, and each dispatch call of 4 one idempotency key: 1.25 keys a
# lease live for TTL_SECONDS. The bound allows 1.5 over a window a second longer than the TTL.
WINDOW = TTL_SECONDS + 1.0
KEYS_PER_LEASE = 1.5


def live_keys(r: redis_sync.Redis) -> tuple[int, int]:
    """(keys without an expiry, keys with one) among the live keys. DBSIZE would also count keys
    whose TTL has passed but that Redis's background expiry has not reached yet, which lags when
    the machine is loaded (a CI run saw DBSIZE double that way); SCAN drops every expired key it
    visits, so what it returns is what the tracker keeps."""
    keys = list(r.scan_iter(count=5000))
    with r.pipeline(transaction=False) as p:
        for k in keys:
            p.ttl(k)
        ttls = p.execute()
    persistent = sum(1 for t in ttls if t == -1)  # -2: expired between SCAN and TTL
    return persistent, sum(1 for t in ttls if t >= 0)


@pytest.mark.slow
def test_steady_load_keeps_redis_keys_and_memory_flat(tmp_path, run_name):
    redis = EmbeddedRedis(tmp_path / "redis").start()  # AOF on, as the embedded one runs
    tracker = TrackerProcess(redis.url, env={"SPOPP_TRACKER_IDEMPOTENCY_TTL_SECONDS": str(TTL_SECONDS)})
    spo = f"{run_name}-spo"
    try:
        with (
            TrackerClient(tracker.url, retry_seconds=30) as c,
            redis_sync.Redis.from_url(redis.url) as r,
        ):
            c.put_run(run_name, {"recipe": "spopp", "seed": 1})
            c.put_tasks(run_name, [{"task_id": f"q{i}", "outcomes": [i % 2, 1, 0]} for i in range(N_TASKS)])
            c.put_run(spo, {"recipe": "spo"})
            c.put_tasks(spo, [{"task_id": f"q{i}", "alpha0": 1, "beta0": 1} for i in range(N_TASKS)])
            dispatched = reported = released = consumed = 0
            # (seconds since start, live keys with an expiry, used_memory, keys without one, leases in
            # the last WINDOW seconds)
            samples = []
            leases_at = []  # (seconds since start, leases so far), once a round
            t0 = time.monotonic()
            next_sample = next_consume = 0.0
            for rounds in range(MAX_ROUNDS):
                now = time.monotonic() - t0
                if now >= LOAD_SECONDS:
                    break
                if rounds / ROUNDS_PER_SECOND > now:
                    time.sleep(rounds / ROUNDS_PER_SECOND - now)
                    now = time.monotonic() - t0
                if now >= next_sample:
                    persistent, expiring = live_keys(r)  # before INFO: SCAN frees the expired ones
                    recent = dispatched - next((d for t, d in reversed(leases_at) if t <= now - WINDOW), 0)
                    samples.append((now, expiring, r.info("memory")["used_memory"], persistent, recent))
                    next_sample += SAMPLE_EVERY
                if now >= next_consume:  # SPO's learner: one update a second
                    items = [(f"q{(consumed * 7 + i) % N_TASKS}", float(i % 2), 0.01) for i in range(16)]
                    c.consume(spo, f"u{consumed}", items)
                    consumed += 1
                    next_consume += 1.0
                reqs = c.dispatch(run_name, "w", 0, 4).requests
                dispatched += len(reqs)
                leases_at.append((now, dispatched))
                keep = [x for i, x in enumerate(reqs) if (rounds + i) % 10]
                for x in reqs:
                    if x not in keep:
                        c.release(run_name, x.request_id)
                        released += 1
                if keep:
                    c.outcomes(run_name, [(x.request_id, float(rounds % 3 == 0)) for x in keep])
                    reported += len(keep)
            counts = c.get_run(run_name).counts
            spo_counts = c.get_run(spo).counts

        steady = [s for s in samples if s[0] >= WARM_UP]
        third = len(steady) // 3
        first, last = steady[:third], steady[-third:]
        keys_first, keys_last = max(s[1] for s in first), max(s[1] for s in last)
        mem_first, mem_last = max(s[2] for s in first), max(s[2] for s in last)
        kept_first, kept_last = max(s[3] for s in first), max(s[3] for s in last)
        print(
            f"\nsoak: {rounds + 1} rounds, {dispatched} leases ({dispatched / LOAD_SECONDS:.0f}/s), {reported} outcomes,"
            f" {released} releases, {consumed} consumes in {LOAD_SECONDS} s; TTL {TTL_SECONDS} s\n"
            f"live keys with an expiry: after warm-up {steady[0][1]}, first third max {keys_first},"
            f" last third max {keys_last}, end {samples[-1][1]}; most per lease of the last {WINDOW:.0f} s"
            f" {max(s[1] / max(1, s[4]) for s in steady):.2f}\n"
            f"keys without an expiry: start {samples[0][3]}, first third max {kept_first}, last third max {kept_last}\n"
            f"used_memory: start {samples[0][2]}, after warm-up {steady[0][2]}, first third max {mem_first},"
            f" last third max {mem_last}, end {samples[-1][2]}"
        )
        assert dispatched > 20 * LOAD_SECONDS, "too little load to show anything"
        # What would leak: keys with no expiry. Without expiry the keys grow by about 1.25 a lease,
        # thousands per sample here.
        assert kept_last <= kept_first + 10, samples
        # The expiring keys follow the recent load (a loaded machine stalls the loop, which then
        # catches up in a burst), never the total: each sample is bounded by its last WINDOW.
        for t, expiring, _, _, recent in steady:
            assert expiring <= KEYS_PER_LEASE * recent + 50, (t, expiring, recent, samples)
        # Memory follows the live keys: it may grow by the first third's bytes a key for any key more.
        per_key = (mem_first - samples[0][2]) / max(1, keys_first)
        assert mem_last <= mem_first * 1.10 + 512 * 1024 + max(0, keys_last - keys_first) * per_key * 1.2, (
            samples
        )
        # Nothing acknowledged was lost or counted twice.
        assert counts.outcomes == reported and counts.releases == released
        assert counts.dispatches == dispatched and counts.in_flight == 0 and counts.idle == N_TASKS
        assert counts.expirations == 0
        assert spo_counts.consumed_updates == consumed
    finally:
        tracker.stop()
        redis.stop()
