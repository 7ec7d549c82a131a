"""The suite's tiers, its fixtures (a real redis-server, the tracker in this process or as a
process over HTTP) and each xdist worker's own ports.

Three tiers. A test marked `process` starts processes (services over real HTTP, the sandbox,
torchrun, vLLM's engine core): the seams. Every other test stays in this process: pure functions,
FastAPI apps through TestClient (httpx over the ASGI app), a real redis-server where the store needs
one; `make test-fast` runs those. A test marked `slow` shows what only a long run can (the
demo-sized runs, processes killed in turn mid-run, resumes across launches, the soak): `make
test-slow` runs those, and CI runs both `make test` (everything else, on every core) and `make
test-slow`. A test outside the process tier that starts a process fails (`pytest_runtest_protocol`), so the
fast tier stays fast as tests are added.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
import uuid
from pathlib import Path

import httpx
import pytest
from fixtures_model import (  # noqa: F401  (session fixtures)
    learned_model,
    model_cache_env,
    model_limits,
    perturbed_model,
    reference,
    runner,
    smollm2,
    smollm2_truncated,
    tiny_engine,
    tiny_model,
    toy_study,
)
from procs import oom_kills, uptime

from services.tracker.embedded import EmbeddedRedis
from spopp.api.client import TrackerClient
from spopp.machine.net import PORT_RANGE_ENV, port_range
from tools.tracker_process import TrackerProcess

os.environ.setdefault("OMP_NUM_THREADS", "1")
# DeepSpeed's shared-memory op, built once where `make test` builds it (Makefile: ops); a plain
# `pytest` would otherwise compile it again in every learner test's own folder (a minute each).
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "torch_extensions")
)


def _worker_port_range() -> str:
    """This pytest-xdist worker's share of the ports below the ephemeral range (all of it without
    xdist): every port a test or a process it starts draws (spopp.machine.net.free_port) comes from it, so
    two workers never pick the same port however their tests interleave."""
    lo, hi = port_range()
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    width = (hi - lo + 1) // count
    return f"{lo + index * width}-{lo + (index + 1) * width - 1}"


# Set before any test or fixture draws a port; a range given from outside is split, not replaced.
os.environ[PORT_RANGE_ENV] = _worker_port_range()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    with EmbeddedRedis(tmp_path_factory.mktemp("redis"), appendonly=False) as server:
        yield server


@pytest.fixture(scope="session")
def tracker(redis_server):
    proc = TrackerProcess(redis_server.url)
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def tracker_http(redis_server):
    """The tracker's app in this process, no server and no socket (FastAPI's TestClient: httpx
    over the ASGI app, lifespan included), on the session's real Redis: the fast tier's way to
    the routes. Answers an httpx client whose paths are the API's (`tracker_http.get("/healthz")`)."""
    from fastapi.testclient import TestClient

    from services.config.tracker import TrackerSettings
    from services.tracker.app import create_app

    app = create_app(TrackerSettings(redis_url=redis_server.url))
    # As a server would: an exception in a route is a 500 answer, not an exception in the test.
    with TestClient(app, raise_server_exceptions=False) as http:
        yield http


def _process_tier(request) -> bool:
    return request.node.get_closest_marker("process") is not None


@pytest.fixture
def client(request):
    """A TrackerClient: over HTTP to the session's tracker process for the process tier, on the
    tracker's app in this process for every other test."""
    if not _process_tier(request):
        http = request.getfixturevalue("tracker_http")  # the session's: not closed here
        yield TrackerClient(str(http.base_url), http=http)
    else:
        with TrackerClient(request.getfixturevalue("tracker").url) as c:
            yield c


@pytest.fixture
def api(request):
    """An httpx client for raw calls to the tracker (bodies a TrackerClient would never send),
    paths from the root (`api.get("/healthz")`): the session's tracker process for the process
    tier, the app in this process otherwise."""
    if not _process_tier(request):
        yield request.getfixturevalue("tracker_http")
    else:
        with httpx.Client(base_url=request.getfixturevalue("tracker").url, timeout=30) as http:
            yield http


# The test now running when it is outside the process tier (its setup, call and teardown, module
# and session fixtures included), else None; the guards below consult it.
_guarded: str | None = None


def _refuse(what: str) -> AssertionError:
    return AssertionError(
        f"{_guarded} started {what} but is not marked `process`: mark it (@pytest.mark.process, "
        "the process tier) or keep it in this process"
    )


_popen_init = subprocess.Popen.__init__
_process_start = multiprocessing.process.BaseProcess.start


def _guarded_popen_init(self, args, *rest, **kwargs):
    if _guarded is not None:
        program = os.path.basename(str(args[0] if isinstance(args, list | tuple) else args).split()[0])
        # A real Redis is allowed where the store needs one; fc-list is matplotlib building its
        # font cache on its first figure on a fresh machine (once, whichever test draws first).
        if program not in ("redis-server", "fc-list"):
            raise _refuse(f"a process ({program})")
    _popen_init(self, args, *rest, **kwargs)


def _guarded_process_start(self):
    if _guarded is not None:
        raise _refuse(f"a multiprocessing process ({self.name})")
    _process_start(self)


subprocess.Popen.__init__ = _guarded_popen_init
multiprocessing.process.BaseProcess.start = _guarded_process_start


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Outside the process tier a test may start a real redis-server, nothing else: no subprocess
    and no multiprocessing child, from the test or from any fixture it sets up."""
    global _guarded
    if item.get_closest_marker("process") is None:
        _guarded = item.nodeid
    try:
        return (yield)
    finally:
        _guarded = None


@pytest.fixture(autouse=True)
def _no_tracker_process_outside_the_process_tier(request):
    """The session's tracker process may be running already (no process to start): refuse it too."""
    if not _process_tier(request) and "tracker" in request.fixturenames:
        raise _refuse("the session's tracker process (fixture `tracker`)")


@pytest.fixture
def run_name():
    return "t-" + uuid.uuid4().hex[:12]


@pytest.fixture
def make_run(client, run_name):
    """A fresh run with tasks; answers its name. Runs are namespaced, so tests do not collide."""

    def make(recipe="spopp", tasks=None, **config):
        client.put_run(run_name, {"recipe": recipe, **config})
        if tasks:
            client.put_tasks(run_name, tasks)
        return run_name

    return make


# The longest tests, started first: the suite cannot end before its longest test does, so that one
# must not start last. (`make test` uses xdist's worksteal: the first worker starts on these while
# the others take the rest, stealing from its queue's far end when theirs runs dry.)
LONGEST_FIRST = (
    # the slow tier's
    "test_learning.py", "test_map_run.py", "test_demo_alfworld.py", "test_learner_resume.py", "test_launch.py",
    "test_supervision_restarts.py", "test_kill_under_load.py", "test_rollout_outages.py", "test_claim.py",
    # `make test`'s (measured with pytest --durations=0)
    "test_demo.py", "test_learner_screen.py", "test_alfworld_generate.py", "test_run_lifecycle.py",
    "test_learner_e2e.py", "test_engines.py", "test_evaluator.py", "test_learner_kernels.py",
)  # fmt: skip


# The GPU tier (tests/gpu/) runs under `make test-gpu` only, which sets SPOPP_GPU_TIER=1 once it has
# found a CUDA GPU; `make test` never collects it, so it has nothing to skip.
collect_ignore = [] if os.environ.get("SPOPP_GPU_TIER") == "1" else ["gpu"]


def pytest_collection_modifyitems(config, items):

    def rank(item) -> tuple[int, int]:
        name = item.path.name
        if name in LONGEST_FIRST:
            return (0, LONGEST_FIRST.index(name))
        if item.get_closest_marker("slow"):
            return (1, 0)
        # Then the process tier, then the in-process tests: what a worker steals late is cheap.
        return (2 if item.get_closest_marker("process") else 3, 0)

    items.sort(key=rank)  # stable: the order within each rank is collection order


_started_at_uptime = 0.0


def pytest_sessionstart(session):
    global _started_at_uptime
    _started_at_uptime = uptime()


def pytest_terminal_summary(terminalreporter):
    """Processes the kernel's OOM killer ended during the run, at the end of the report (the part
    CI keeps): a service that died of it otherwise shows only as a refused connection."""
    if hasattr(terminalreporter.config, "workerinput"):  # an xdist worker: the controller reports
        return
    kills = oom_kills(since=_started_at_uptime)
    if kills:
        terminalreporter.write_sep(
            "=", f"the kernel's OOM killer ended {len(kills)} process(es) during the run"
        )
        for line in kills:
            terminalreporter.write_line(line)
