"""A `spopp launch` without a token of the user's makes one for its run (issue 61): every service asks
for it, it is kept in the run folder for its owner only, a resume uses it again, nothing prints it,
and a token the user sets wins over it. A service started on its own without a token says that it
is open.

Real processes: the launcher with the tracker (embedded Redis), the learner, a transformers replica
and the evaluator on tests/launch/test_launch.py's toy model; requests over HTTP as any other program on the
machine would send them.
"""

from __future__ import annotations

import logging
import secrets
import signal
import stat
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml
from procs import cli
from test_launch import _start, _wait_for, config, toy, updates  # noqa: F401  (toy: the module's fixture)

from spopp.machine.wait import wait_until
from spopp.settings.base import API_TOKEN_ENV, environ_without_settings
from tools.tracker_process import TrackerProcess

RUN = "spopp-s0"


def _url(run_dir: Path, name: str) -> str:
    """The base URL of the launch's process `name`, from the config file it was started with."""
    port = yaml.safe_load((run_dir / "config" / f"{name}.yaml").read_text())["port"]
    return f"http://127.0.0.1:{port}"


def _bearer(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _status(method: str, url: str, token: str | None, **kw) -> int:
    return httpx.request(method, url, headers=_bearer(token), timeout=30, **kw).status_code


def _tracker_answers(tracker: str, token: str | None) -> tuple[int, int]:
    """What the tracker answers `token` (None: no Authorization header): reading the run, and a
    dispatch whose body is empty (422 once past authentication; nothing is leased)."""
    return (
        _status("GET", f"{tracker}/v1/runs/{RUN}", token),
        _status("POST", f"{tracker}/v1/runs/{RUN}/dispatch", token, json={}),
    )


def _stop(proc: subprocess.Popen, log: Path) -> None:
    proc.send_signal(signal.SIGINT)
    assert proc.wait(120) == 130, log.read_text()[-3000:]


def _launched_until(path: Path, log: Path, text: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`spopp launch path`, running once `text` is in its output (the caller stops it)."""
    if env is None:
        proc = _start(path, log)
    else:
        proc = subprocess.Popen(
            cli("launch", str(path)), stdout=log.open("w"), stderr=subprocess.STDOUT, env=env
        )
    try:
        _wait_for(log, text, proc)
    except BaseException:
        proc.kill()
        proc.wait(30)
        raise
    return proc


@pytest.mark.process
def test_a_launch_without_a_token_makes_one_that_every_service_asks_for_and_its_resume_keeps(toy, tmp_path):  # noqa: F811
    """Under the default launch (no SPOPP_API_TOKEN): a request without the run's token (none, or
    another, as an agent's child process holding its episode's token would send) is refused by the
    tracker and the learner's intake before its body is read; the run's token, read from the run
    folder, is let through; the processes hold it (the run trains and is evaluated). The file is
    0600 and nothing the launch writes or prints holds the token. A second launch of the folder
    resumes with the same token."""
    path = config(toy, tmp_path, max_updates=1000)
    run_dir, log = tmp_path / "run", tmp_path / "launch.log"
    proc = _launched_until(path, log, "every process is up")
    try:
        token_file = run_dir / "api-token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        assert len(token) >= 32
        tracker, learner = _url(run_dir, "tracker"), _url(run_dir, "learner")
        episodes = "episode-" + secrets.token_urlsafe(24)  # any token but the run's
        for other in (None, episodes):
            assert _tracker_answers(tracker, other) == (401, 401)
            assert _status("POST", f"{learner}/v1/trajectories", other, json={}) == 401
        assert _tracker_answers(tracker, token) == (200, 422)
        assert _status("POST", f"{learner}/v1/trajectories", token, json={}) == 422
        # Every process holds it: the replica reports and posts, the learner updates, the evaluator
        # follows the policy clock and scores version 0.
        evals = run_dir / "eval" / "evals.jsonl"
        wait_until(lambda: updates(run_dir) >= 1 and evals.is_file() and evals.stat().st_size, 240,
                   "an update and an evaluation", proc=proc)  # fmt: skip
    finally:
        _stop(proc, log)
    written = [log, *run_dir.glob("logs/*.log"), *run_dir.glob("config/*.yaml"), run_dir / "launch.yaml"]
    written.append(run_dir / "run.json")
    assert [str(f) for f in written if token in f.read_text(errors="replace")] == []
    assert f"the run's bearer token, kept in {token_file}" in log.read_text()

    again = tmp_path / "launch2.log"
    proc = _launched_until(path, again, f"tracker: run {RUN} ready")
    try:
        assert "resuming run" in again.read_text()
        assert token_file.read_text().strip() == token
        tracker = _url(run_dir, "tracker")
        assert _tracker_answers(tracker, token) == (200, 422)
        assert _tracker_answers(tracker, None) == (401, 401)
    finally:
        _stop(proc, again)


@pytest.mark.process
def test_a_token_the_user_sets_wins_over_the_run_folders(toy, tmp_path):  # noqa: F811
    """SPOPP_API_TOKEN given: every service asks for it, the folder's token opens nothing and its
    file is left as it was."""
    path = config(toy, tmp_path, max_updates=1000)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    kept = secrets.token_urlsafe(32)
    (run_dir / "api-token").write_text(kept + "\n")
    (run_dir / "api-token").chmod(0o600)
    before = (run_dir / "api-token").stat()
    mine = "users-own-token-" + secrets.token_urlsafe(16)
    log = tmp_path / "launch.log"
    proc = _launched_until(
        path, log, f"tracker: run {RUN} ready", {**environ_without_settings(), API_TOKEN_ENV: mine}
    )
    try:
        assert "every service asks for your bearer token (SPOPP_API_TOKEN or api_token)" in log.read_text()
        tracker = _url(run_dir, "tracker")
        assert _tracker_answers(tracker, mine) == (200, 422)
        assert _tracker_answers(tracker, kept) == (401, 401)
        assert _tracker_answers(tracker, None) == (401, 401)
    finally:
        _stop(proc, log)
    after = (run_dir / "api-token").stat()
    assert (run_dir / "api-token").read_text() == kept + "\n" and after.st_mtime_ns == before.st_mtime_ns
    assert mine not in log.read_text()


@pytest.mark.process
def test_print_config_shows_the_token_masked_and_writes_none(toy, tmp_path):  # noqa: F811
    """--print-config shows the launch as it would run: with a token, masked, whether the run
    folder keeps one, the folder is new (no file is written) or the user sets one."""
    path = config(toy, tmp_path)
    env = environ_without_settings()

    def printed(environ: dict[str, str]) -> str:
        r = subprocess.run(cli("launch", str(path), "--print-config"), capture_output=True, text=True,
                           timeout=120, env=environ)  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert yaml.safe_load(r.stdout)["api_token"] == "***", r.stdout
        return r.stdout + r.stderr

    printed(env)
    assert not (tmp_path / "run").exists()
    (tmp_path / "run").mkdir()
    kept = secrets.token_urlsafe(32)
    (tmp_path / "run" / "api-token").write_text(kept)
    (tmp_path / "run" / "api-token").chmod(0o600)
    assert kept not in printed(env)
    mine = "users-own-token-" + secrets.token_urlsafe(16)
    assert mine not in printed({**env, API_TOKEN_ENV: mine})


@pytest.mark.process
def test_a_tracker_started_alone_without_a_token_says_it_is_open(redis_server):
    open_one = TrackerProcess(redis_server.url)
    try:
        assert "no api_token (SPOPP_API_TOKEN) is set: every /v1 route on 127.0.0.1" in open_one.output()
    finally:
        open_one.stop()
    guarded = TrackerProcess(redis_server.url, env={API_TOKEN_ENV: "tracker-token-for-tests-0123456789"})
    try:
        assert "no api_token" not in guarded.output()
    finally:
        guarded.stop()


def test_a_learner_intake_without_a_token_says_it_is_open(caplog):
    from services.learner.ingest import TrajectoryBuffer, ingest_app

    with caplog.at_level(logging.WARNING, logger="spopp.learner"):
        ingest_app(TrajectoryBuffer("r", 4), 1 << 20)
        assert "the intake (POST /v1/trajectories) is open" in caplog.text
        caplog.clear()
        ingest_app(TrajectoryBuffer("r", 4), 1 << 20, token="learner-token-for-tests-0123456789")
        assert "is open" not in caplog.text
