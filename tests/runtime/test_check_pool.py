"""Answer checks out of process (runtime.sandbox.check_pool): a hostile answer cannot freeze the caller.

Issue 48, finding 1: sympy evaluated `\\boxed{9^{9^{9}}}` in C holding the GIL, in a thread of the
replica's own process, so the thread's "limit" could not stop it and the event loop (health route,
SIGTERM) stalled with it. Each test here starts real worker processes.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time

import pytest

from runtime.envs.base import Task
from runtime.envs.math_tir import MathTIREnv
from runtime.sandbox.check_pool import CheckPool
from runtime.verify import check_answer

pytestmark = pytest.mark.process  # starts processes: the process tier (tests/conftest.py)

TOWER = r"The answer is \boxed{9^{9^{9}}}."  # 9^387420489: ~370 million digits, minutes of sympy


@pytest.fixture
def pool():
    p = CheckPool(size=1, preload=("sympy", "math_verify"))
    yield p
    p.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (killed, not yet reaped by its parent) is gone for our purpose.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1][0] != "Z"


def test_a_tower_of_powers_is_killed_at_its_deadline_and_scored_wrong(pool):
    t0 = time.monotonic()
    verdict = check_answer(TOWER, "3", timeout_s=1.0, pool=pool)
    elapsed = time.monotonic() - t0
    assert verdict.reward == 0.0 and verdict.reason == "timeout"
    # The first worker's start (imports, ~1-3 s on a slow machine) comes before the 1 s deadline;
    # the old in-process check had not returned after 60 s.
    assert elapsed < 20, elapsed
    assert pool.failures["timeout"] == 1


def test_a_killed_worker_is_replaced_and_the_next_check_is_right(pool):
    pool.call("runtime.verify:math_equivalent", "1", "1", timeout_s=30)  # the first worker, ready
    (first,) = pool._idle
    assert check_answer(TOWER, "3", timeout_s=0.5, pool=pool).reason == "timeout"
    assert not _alive(first.proc.pid)  # SIGKILLed, not left computing
    # A value-equal answer that only math-verify can match (the exact-match fast path misses it).
    right = check_answer(r"\boxed{\frac{1}{2}}", "0.5", timeout_s=30, pool=pool)
    assert right.reward == 1.0 and right.reason is None
    (second,) = pool._idle
    assert second.proc.pid != first.proc.pid


def test_the_event_loop_runs_while_a_hostile_check_is_in_a_thread(pool):
    """What a replica does (environments run in `asyncio.to_thread`): its loop must keep ticking."""
    pool.call("runtime.verify:math_equivalent", "1", "1", timeout_s=30)

    async def main() -> tuple[float, float]:
        gaps, last = [], time.monotonic()
        check = asyncio.ensure_future(asyncio.to_thread(check_answer, TOWER, "3", timeout_s=2.0, pool=pool))
        while not check.done():
            await asyncio.sleep(0.02)
            now = time.monotonic()
            gaps.append(now - last)
            last = now
        assert (await check).reason == "timeout"
        return max(gaps), len(gaps)

    worst, ticks = asyncio.run(main())
    # 20 ms ticks over a 2 s check: ~100 of them. A GIL held by sympy would stall every tick for the
    # whole check (the old code: one gap of minutes); 0.5 s leaves room for a loaded CI machine.
    assert worst < 0.5, worst
    assert ticks > 20


def _peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def test_an_answer_too_big_for_the_workers_memory_stays_in_the_worker():
    """`2^{2^{30}}` took 8 s and 792 MiB of the replica's own memory. In a worker capped at 300 MiB
    the allocation fails there (math-verify turns the MemoryError into "not equal": a wrong
    answer) and neither the worker nor the caller ever holds the 128 MiB integer's working set."""
    small = CheckPool(size=1, memory_bytes=300 * 2**20, preload=("sympy", "math_verify"))
    try:
        small.call("runtime.verify:math_equivalent", "1", "1", timeout_s=30)
        (worker,) = small._idle
        caller_before = _peak_rss_mib(os.getpid())
        verdict = check_answer(r"\boxed{2^{2^{30}}}", "2", timeout_s=60, pool=small)
        assert verdict.reward == 0.0
        if verdict.reason is None:  # it answered (6 s here): the worker lived within its cap
            assert _peak_rss_mib(worker.proc.pid) <= 300
        else:  # a slower machine: killed at the deadline, or a MemoryError math-verify let through
            assert verdict.reason in ("memory", "timeout"), verdict
        # The caller's peak did not take the answer's memory (in-process it rose by ~560 MiB).
        assert _peak_rss_mib(os.getpid()) - caller_before < 100
        assert check_answer(r"\boxed{\frac{1}{2}}", "0.5", timeout_s=30, pool=small).reward == 1.0
    finally:
        small.close()


def test_errors_and_bad_functions_are_wrong_answers_not_exceptions(pool):
    assert pool.call("runtime.verify:no_such_function", timeout_s=30).reason == "error"
    assert pool.call("runtime.verify:math_equivalent", "1", timeout_s=30).reason == "error"  # one arg short
    assert pool.call("runtime.verify:math_equivalent", "1", "1", timeout_s=30).value is True


def test_close_ends_the_workers_and_later_calls_are_unavailable(pool):
    pool.call("runtime.verify:math_equivalent", "1", "1", timeout_s=30)
    (worker,) = pool._idle
    pool.close()
    assert not _alive(worker.proc.pid)
    assert pool.call("runtime.verify:math_equivalent", "1", "1", timeout_s=30).reason == "unavailable"


def test_a_worker_outliving_its_pool_ends_on_its_own_cpu_budget():
    """A service SIGKILLed mid-check leaves its worker computing, with nobody to kill it: the CPU
    limit the worker set itself for that check ends it."""
    script = textwrap.dedent(
        """
        import os, sys, threading, time
        from runtime.sandbox.check_pool import CheckPool
        pool = CheckPool(size=1, preload=("sympy", "math_verify"))
        pool.call("runtime.verify:math_equivalent", "1", "1", timeout_s=60)
        worker = pool._idle[0]
        print(worker.proc.pid, flush=True)
        threading.Thread(target=pool.call, args=("runtime.verify:math_equivalent", "9^{9^{9}}", "3"),
                         kwargs={"timeout_s": 1.0}, daemon=True).start()
        time.sleep(0.3)
        os._exit(0)  # as a SIGKILL would: no atexit, no close
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    pid = int(out.stdout.split()[0])
    # Budget: ceil(CPU used so far + 1 s) + 1 s of CPU, then SIGXCPU; a worker's start uses ~1-3 s
    # of CPU, so it is gone within ~6 s of CPU time; 30 s of wall time for a loaded machine.
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pid)


def test_math_tir_records_why_a_check_gave_no_verdict():
    env = MathTIREnv(verify_timeout_s=0.5)
    env.reset(Task(task_id="t", prompt="What is 3?", answer="3"))
    result = env.step(TOWER)
    assert result.done and result.reward == 0.0
    assert result.info["answer_check"] == "timeout"
    # The next check runs in the replacement worker, whose first parse of LaTeX (lazy imports in
    # math-verify) can take longer than 0.5 s on a loaded 2-core machine: a deadline that only a
    # hung check reaches.
    env.verify_timeout_s = 30.0
    env.reset(Task(task_id="t", prompt="What is 1/2?", answer="0.5"))
    right = env.step(r"\boxed{\frac{1}{2}}")
    assert right.reward == 1.0 and "answer_check" not in right.info


def test_a_replica_episode_with_a_tower_ends_wrong_and_is_counted(tiny_model):
    """The agent loop as a replica runs it (env steps in a thread, the loop ticking beside it): the
    episode ends with reward 0, says why, and /metrics counts it."""
    from prometheus_client import generate_latest
    from transformers import AutoTokenizer

    from runtime.agent import run_episode
    from runtime.engines.base import SamplingConfig
    from runtime.episode import Budget
    from services.rollout.metrics import RolloutMetrics

    sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
    from scripted import ScriptedEngine

    engine = ScriptedEngine(AutoTokenizer.from_pretrained(tiny_model), [TOWER])
    env = MathTIREnv(verify_timeout_s=1.0)
    task = Task(task_id="t", prompt="What is 3?", answer="3")

    async def main():
        ticks = 0
        episode = asyncio.ensure_future(
            run_episode(engine, env, task, Budget(2, 256, 4096), SamplingConfig(max_tokens=256))
        )
        while not episode.done():
            await asyncio.sleep(0.02)
            ticks += 1
        return await episode, ticks

    ep, ticks = asyncio.run(main())
    assert ep.reward == 0.0 and ep.finish_reason == "answer" and ep.info["answer_check"] == "timeout"
    assert ticks > 10  # the loop ran through the 1 s check (a held GIL would leave it at ~1)
    metrics = RolloutMetrics()
    metrics.observe_episode(ep)
    text = generate_latest(metrics.registry).decode()
    assert 'spopp_rollout_answer_checks_failed_total{reason="timeout"} 1.0' in text


def test_what_a_checked_function_prints_never_passes_for_a_verdict(pool):
    """antlr4 (math-verify's LaTeX parser) prints to stdout; the replies have a descriptor of their
    own, and each carries its request's id, so printed text (even a forged reply) is never read as
    one, and the worker stays in step for the next check."""
    forged = '{"id": 2, "value": true}'
    printed = pool.call("builtins:print", forged, timeout_s=30)
    assert printed.ok and printed.value is None  # print's own return value
    assert check_answer(r"\boxed{\frac{1}{3}}", "0.5", timeout_s=30, pool=pool).reward == 0.0
    assert pool.call("runtime.verify:math_equivalent", "1", "1", timeout_s=30).value is True
