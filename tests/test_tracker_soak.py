"""A bounded soak: steady dispatch + outcome (+ release, + SPO consume) load on a real tracker and
a real redis-server keeps Redis's key count and memory flat once the idempotency TTL has passed,
and every acknowledged outcome is counted."""

from __future__ import annotations

import time

import pytest
import redis as redis_sync

from services.tracker.embedded import EmbeddedRedis
from services.tracker.launcher import TrackerProcess
from spopp.client import TrackerClient

pytestmark = pytest.mark.process  # starts processes: the process tier (tests/conftest.py)

TTL_SECONDS = 4  # the tracker's idempotency_ttl_seconds here: expiry shows within the test
LOAD_SECONDS = 45  # 12 s of warm-up, then thirds of 11 s: each near three TTLs
SAMPLE_EVERY = 2.0
WARM_UP = 12.0  # > TTL: by then as many records expire as are made
ROUNDS_PER_SECOND = 75  # paced (4 leases a round: 300 leases/s), so the load is steady
MAX_ROUNDS = ROUNDS_PER_SECOND * LOAD_SECONDS  # the loop ends at this count or at LOAD_SECONDS
N_TASKS = 64


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
            samples = []  # (seconds since start, keys, used_memory)
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
                    samples.append((now, r.dbsize(), r.info("memory")["used_memory"]))
                    next_sample += SAMPLE_EVERY
                if now >= next_consume:  # SPO's learner: one update a second
                    items = [(f"q{(consumed * 7 + i) % N_TASKS}", float(i % 2), 0.01) for i in range(16)]
                    c.consume(spo, f"u{consumed}", items)
                    consumed += 1
                    next_consume += 1.0
                reqs = c.dispatch(run_name, "w", 0, 4).requests
                dispatched += len(reqs)
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
        print(
            f"\nsoak: {rounds + 1} rounds, {dispatched} leases ({dispatched / LOAD_SECONDS:.0f}/s), {reported} outcomes,"
            f" {released} releases, {consumed} consumes in {LOAD_SECONDS} s; TTL {TTL_SECONDS} s\n"
            f"keys: start {samples[0][1]}, after warm-up {steady[0][1]}, first third max {keys_first},"
            f" last third max {keys_last}, end {samples[-1][1]}\n"
            f"used_memory: start {samples[0][2]}, after warm-up {steady[0][2]}, first third max {mem_first},"
            f" last third max {mem_last}, end {samples[-1][2]}"
        )
        assert dispatched > 20 * LOAD_SECONDS, "too little load to show anything"
        # Without expiry the keys grow by about 1.25 per lease: thousands per sample here.
        assert keys_last <= keys_first * 1.10 + 50, samples
        assert mem_last <= mem_first * 1.10 + 512 * 1024, samples
        # Nothing acknowledged was lost or counted twice.
        assert counts.outcomes == reported and counts.releases == released
        assert counts.dispatches == dispatched and counts.in_flight == 0 and counts.idle == N_TASKS
        assert counts.expirations == 0
        assert spo_counts.consumed_updates == consumed
    finally:
        tracker.stop()
        redis.stop()
