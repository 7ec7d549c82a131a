"""A build of DeepSpeed's CPU op killed midway never blocks a later start (services/learner/op_build.py).

torch's extension builder guards a build with a `lock` file (FileBaton) that a killed build leaves
behind; a learner start used to wait on it without end. Now the build runs under an flock beside
it, which dies with its holder: a start that can take the flock and finds no process of a build
at work removes the stale file and builds. A live build is waited for, never broken into.

The starts here are the learner's own first step (services.learner.deepspeed_engine.init_distributed, a
world of one) in a fresh process, on a copy of the session's built op, so that loading it takes
seconds; one slow test kills a real build from scratch.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from services.learner.op_build import FLOCK, TORCH_LOCK, build_lock
from spopp.settings.base import environ_without_settings

pytestmark = pytest.mark.process  # starts processes: the process tier (tests/conftest.py)

OP = "deepspeed_shm_comm"  # DeepSpeed's ShareMemCommBuilder.NAME
ROOT = Path(__file__).resolve().parents[2]
# A start on a built op took 3-6 s here (importing DeepSpeed, on 2 loaded cores); one that waits on
# a stale lock never ends. 120 s tells the two apart with room for a much slower machine.
START_S = 120

# A builder as torch's is while it builds: the flock (when it takes ours), then FileBaton's lock
# file, created and kept open; then it works until it is killed.
BUILDER = f"""
import fcntl, sys
from torch.utils.file_baton import FileBaton
folder, flock = sys.argv[1], sys.argv[2] == "flock"
if flock:
    held = open(folder + "/{FLOCK}", "a+")
    fcntl.flock(held, fcntl.LOCK_EX)
baton = FileBaton(folder + "/{TORCH_LOCK}")
assert baton.try_acquire()
print("building", flush=True)
sys.stdin.readline()  # told to finish: release as torch does (the file removed), then the flock
baton.release()
"""

START = "from services.learner.deepspeed_engine import init_distributed; init_distributed(); print('joined')"


def _env(ext: Path) -> dict:
    # A world of one of its own: no launcher's variables (a test's in-process engine may leave some).
    dist = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in environ_without_settings().items() if k not in dist}
    return {**env, "TORCH_EXTENSIONS_DIR": str(ext), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def built_op(tmp_path_factory) -> Path:
    """A folder holding the built op: the session's (TORCH_EXTENSIONS_DIR, as `make test` builds
    it first, or torch's default), else built here once (a minute or two of one core)."""
    roots = [Path(os.environ["TORCH_EXTENSIONS_DIR"])] if os.environ.get("TORCH_EXTENSIONS_DIR") else []
    roots.append(
        Path.home() / ".cache" / "torch_extensions" / f"py{sys.version_info[0]}{sys.version_info[1]}_cpu"
    )
    for root in roots:
        if (root / OP / f"{OP}.so").is_file():
            return root / OP
    fresh = tmp_path_factory.mktemp("built")
    subprocess.run([sys.executable, "-m", "services.learner.op_build"], env=_env(fresh), cwd=ROOT, check=True)
    return fresh / OP


def _copy_op(built: Path, ext: Path) -> None:
    """The built op copied with its files' times, so that ninja finds nothing to do; not the lock
    files, which a start loading the session's op may hold for a moment."""
    shutil.copytree(built, ext / OP, ignore=shutil.ignore_patterns(TORCH_LOCK, FLOCK))


def _builder(folder: Path, flock: bool) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-c", BUILDER, str(folder), "flock" if flock else "baton"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout.readline().strip() == "building"
    assert (folder / TORCH_LOCK).exists()
    return p


@pytest.mark.parametrize("flock", [True, False], ids=["flock-builder", "torch-only-builder"])
def test_a_start_after_a_build_killed_midway_removes_its_lock_and_builds(tmp_path, built_op, flock):
    """Killed with SIGKILL mid-build (a learner of today, or DeepSpeed's own build_shm_op run by
    hand, which takes torch's lock only), the builder leaves torch's lock file; the next start
    removes it and joins, within seconds. Before the flock, this start waited forever."""
    ext = tmp_path / "ext"
    _copy_op(built_op, ext)
    builder = _builder(ext / OP, flock)
    builder.send_signal(signal.SIGKILL)
    builder.wait(10)
    assert (ext / OP / TORCH_LOCK).exists()  # what a killed build leaves

    t0 = time.monotonic()
    try:
        start = subprocess.run(
            [sys.executable, "-c", START],
            env=_env(ext),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=START_S,
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(
            f"the start hung on the stale lock for {START_S} s: {exc.stderr!s:.2000}"
        ) from None
    took = time.monotonic() - t0
    out = start.stdout + start.stderr
    assert start.returncode == 0 and "joined" in start.stdout, out[-3000:]
    assert "a build killed midway left it" in out, out[-3000:]
    assert not (ext / OP / TORCH_LOCK).exists()
    print(f"start after a killed build ({'flock' if flock else 'torch lock only'}): {took:.1f} s")


@pytest.mark.parametrize("flock", [True, False], ids=["flock-builder", "torch-only-builder"])
def test_a_live_build_is_waited_for_never_broken_into(tmp_path, flock):
    """While a builder lives (holding the flock, or only torch's lock file, open) a start waits
    and leaves its lock file alone; once the builder ends, finished or killed, the start goes on."""
    folder = tmp_path / "ext" / OP
    folder.mkdir(parents=True)
    builder = _builder(folder, flock)
    entered = threading.Event()

    def start() -> None:
        with build_lock(folder):
            entered.set()

    waiter = threading.Thread(target=start, daemon=True)
    waiter.start()
    try:
        assert not entered.wait(2.0), "a start broke into a live build"
        assert (folder / TORCH_LOCK).exists()
        if flock:  # finishes as torch's builder does: its lock file removed, then its flock
            builder.stdin.write("\n")
            builder.stdin.close()
            assert builder.wait(10) == 0
        else:  # killed: its open lock file closes with it and is left behind
            builder.send_signal(signal.SIGKILL)
            builder.wait(10)
        assert entered.wait(10), "the start did not go on once the build was over"
        assert not (folder / TORCH_LOCK).exists()
    finally:
        if builder.poll() is None:
            builder.kill()
            builder.wait(10)
    waiter.join(10)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_real_build_killed_midway_then_started_again_finishes(tmp_path):
    """The real thing, once: the learner's start builds the op from nothing and is SIGKILLed as
    soon as torch's lock file appears; the next start must finish (measured 2026-11-28 on 2 loaded
    cores: a build is about 2 min of one core)."""
    ext = tmp_path / "ext"
    folder = ext / OP
    first = subprocess.Popen([sys.executable, "-c", START], env=_env(ext), cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not (folder / TORCH_LOCK).exists():
            assert first.poll() is None, "the first start ended before its build began"
            assert time.monotonic() < deadline, "no build began"
            time.sleep(0.05)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    assert (folder / TORCH_LOCK).exists()
    t0 = time.monotonic()
    second = subprocess.run(
        [sys.executable, "-c", START], env=_env(ext), cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    took = time.monotonic() - t0
    assert second.returncode == 0 and "joined" in second.stdout, (second.stdout + second.stderr)[-3000:]
    assert (folder / f"{OP}.so").is_file() and not (folder / TORCH_LOCK).exists()
    print(f"start after a real build killed midway: {took:.1f} s")
