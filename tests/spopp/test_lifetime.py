"""Children that must not outlive a SIGKILLed parent: the guard_children watchdog, and vLLM's engine
core under it (which otherwise survives the replica or learner that started it, memory and all)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from procs import kill_unless_reused

from spopp.machine.lifetime import guard_children

pytestmark = pytest.mark.process  # starts processes: the process tier (tests/conftest.py)


def _gone(processes: list[psutil.Process], within: float) -> bool:
    """Whether each process has ended (a zombie counts as ended) within `within` s; a pid the
    kernel has handed to a new process meanwhile is not mistaken for the old one (is_running
    compares start times)."""

    def alive(p: psutil.Process) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(alive(p) for p in processes):
            return True
        time.sleep(0.1)
    return False


def _parent(script: str) -> tuple[subprocess.Popen, list[psutil.Process]]:
    """A python parent running `script`, which prints the pids to guard then READY; answers those
    processes, taken while they live (so neither the checks nor the cleanup can mistake a reused
    pid for them)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    pids = []
    for line in proc.stdout:
        if line.startswith("READY"):
            return proc, [psutil.Process(p) for p in pids]
        if line.startswith("PID "):
            pids.append(int(line.split()[1]))
    raise AssertionError(f"parent exited early with {proc.wait()}")


def test_guarded_children_die_with_a_killed_parent_and_only_then():
    proc, kids = _parent(
        """
        import subprocess, time
        from spopp.machine.lifetime import guard_children
        # New sessions: nothing else would stop them when this process dies.
        kids = [subprocess.Popen(["sleep", "300"], start_new_session=True) for _ in range(2)]
        guard_children([k.pid for k in kids], poll_s=0.1)
        for k in kids:
            print("PID", k.pid, flush=True)
        print("READY", flush=True)
        time.sleep(300)
        """
    )
    try:
        assert len(kids) == 2
        assert not _gone(kids, within=1.0)  # the parent lives: the children are left alone
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert _gone(kids, within=5.0), "guarded children outlived the SIGKILLed parent"
    finally:
        kill_unless_reused(kids)  # a failed check must not leave them behind


def test_the_watchdog_leaves_when_its_charges_have_ended():
    kid = subprocess.Popen(["sleep", "0.5"])
    guard = guard_children([kid.pid], poll_s=0.05)
    kid.wait()
    assert guard.wait(5) == 0
    assert guard_children([]) is None


@pytest.mark.slow
def test_vllm_engine_core_dies_with_a_killed_owner(tiny_model):
    proc, kids = _parent(
        f"""
        import asyncio, psutil
        from runtime.engines.factory import make_engine

        async def main():
            engine = make_engine("vllm", {str(tiny_model)!r}, max_model_len=512, kv_cache_gib=1, seed=0)
            for child in psutil.Process().children(recursive=True):
                if child.pid != engine._guard.pid:
                    print("PID", child.pid, flush=True)
            print("READY", flush=True)
            await asyncio.sleep(300)

        if __name__ == "__main__":
            asyncio.run(main())
        """
    )
    try:
        names = [p.name() for p in kids]
        assert any("EngineCore" in n for n in names), names
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert _gone(kids, within=10.0), f"vLLM processes outlived their owner: {names}"
    finally:
        kill_unless_reused(kids)  # a failed check must not leave them behind
