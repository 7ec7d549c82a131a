"""A launched run's children: spawned, watched, and when one dies, restarted after a backoff,
within a budget, or given up on.

The pieces of recovery are the services' own (leases expire or are given back, outcome reports
are idempotent, the learner resumes bit-exactly from its checkpoint, the evaluator catches up
from its records, the tracker's Redis keeps an append-only file); this module only decides
*when* a dead child starts again and when to stop trying (`RestartBudget`), and does it
(`Supervisor`: one look at every child per tick).

The budget is per process and per sliding window: a process may die `max_restarts` times within
`window_seconds` and be restarted each time; one more death within the window ends the run. A
process that dies at once on every start (a broken config, a missing file) thus spends its
budget in about the sum of its backoffs and the run stops with its log, while a process that
dies now and then over a week-long run is restarted for as long as the deaths stay apart.

The delay before restart k within the window is `backoff_seconds * 2**(k-1)`, at most
`max_backoff_seconds` (spopp.machine.retry's schedule, without jitter: one process, nobody to fall in
step with). Deaths older than the window are forgotten, so after a quiet window the delay is
short again.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from services.config.supervision import SupervisionSettings
from services.shell.child import Child, ChildFailed
from spopp.machine.restarts import RestartWindow
from spopp.machine.retry import backoff
from spopp.machine.wait import WaitTimeout, wait_until

from . import gpus as gpu
from .children import child_env, launch_child

if TYPE_CHECKING:
    from services.config.launch import LaunchSettings
    from services.launch.process_plan import ProcessPlan


def describe_exit(code: int | None) -> str:
    """`code 3`, or `SIGKILL` for a process killed by a signal (Popen's negative code)."""
    if code is None:
        return "no exit (still running)"
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


class GaveUp(RuntimeError):
    """A process's restart budget is spent; the message (after the name) says how often it died and its last exit."""


class RestartBudget:
    """Per-process restart decisions. `death(name, code, now)` answers the delay before the
    restart, or raises GaveUp when this death is one too many within the window."""

    def __init__(self, settings: SupervisionSettings) -> None:
        self.s = settings
        self._windows: dict[str, RestartWindow] = {}  # per process

    def death(self, name: str, code: int | None, now: float) -> float:
        window = self._windows.setdefault(name, RestartWindow(self.s.max_restarts, self.s.window_seconds))
        if not window.spend(now):
            raise GaveUp(
                f"died {window.count + 1} times in {window.since_oldest(now):.0f} s, more than the "
                f"{self.s.max_restarts} restarts that supervision allows within {self.s.window_seconds:g} s; "
                f"its last exit: {describe_exit(code)}"
            )
        return backoff(self.s.backoff_seconds, self.s.max_backoff_seconds, window.count - 1)


def health_url(p: ProcessPlan, name: str) -> str:
    """The route that says a child is up: the tracker's /readyz (Redis answers), /healthz of
    the others (the learner's once rank 0 has the model and serves the intake)."""
    if name == "tracker":
        return f"http://127.0.0.1:{p.tracker.port}/readyz"
    if name == "learner":
        port = p.learner.port
    elif name == "evaluator":
        port = p.evaluator.port
    else:
        port = next(r.port for r in p.rollouts if r.worker_id == name)
    return f"http://127.0.0.1:{port}/healthz"


def _answers(url: str) -> bool:
    """Whether `url` answers 200 now (a short timeout: the supervisor asks every tick)."""
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def _redis_pid(pidfile: Path) -> int | None:
    """The pid in a Redis pidfile while that process is a live redis-server, else None."""
    try:
        pid = int(pidfile.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    return pid if b"redis-server" in cmdline else None


class Supervisor:
    """The children of one launch. `tend(p)` is one look at all of them; `run_finished(p)` says
    whether the tracker has the run finished (a replica's exit 0 is normal then), and
    `on_restart(p, name)` is told of each restart (counted, recorded in run.json)."""

    def __init__(
        self,
        s: LaunchSettings,
        echo,
        run_finished: Callable[[ProcessPlan], bool],
        on_restart: Callable[[ProcessPlan, str], None],
    ) -> None:
        self.s = s
        self.echo = echo
        self.run_finished = run_finished
        self.on_restart = on_restart
        self.children: dict[str, Child] = {}
        # How each child is started again, which are due for a restart (when), which are
        # starting (until when), which are done for good, restarts per child.
        self.commands: dict[str, tuple[str, str, tuple[str, ...]]] = {}
        self.pending: dict[str, float] = {}
        self.starting: dict[str, float] = {}
        self.done: set[str] = set()
        self.restarts: dict[str, int] = {}
        self.down_since: dict[str, float] = {}  # when a child being restarted was found dead
        self.budget = RestartBudget(s.supervision)

    def spawn(
        self, p: ProcessPlan, name: str, service: str, command: str, extra: tuple[str, ...] = ()
    ) -> Child:
        devices = gpu.assignment(self.s.gpus, len(p.rollouts)).get(name, [])
        config = str(p.run_dir / "config" / f"{name}.yaml")
        child = launch_child(
            name,
            ["-m", "services.cli", service, command, "--config", config, *extra],
            p.run_dir / "logs" / f"{name}.log",
            child_env(self.s.api_token, gpu.visible_devices(devices)),
        )
        self.children[name] = child
        self.commands[name] = (service, command, extra)
        return child

    def wait_started(self, names) -> None:
        """`names` are starting: each must answer its health route within start_seconds."""
        deadline = time.monotonic() + self.s.start_seconds
        self.starting.update({name: deadline for name in names})

    def recovering(self, name: str) -> bool:
        """Whether `name` is due for a restart or starting again."""
        return name in self.pending or name in self.starting

    def retire(self, name: str) -> None:
        """Stop `name` for good (SIGTERM: a replica drains and gives back its leases)."""
        self.pending.pop(name, None)
        self.starting.pop(name, None)
        if name not in self.done:
            self.children[name].stop(self.s.stop_seconds)
            self.done.add(name)

    def stop_all(self) -> None:
        # Replicas and the evaluator first (they report to the tracker), the learner, the tracker last.
        order = [n for n in self.children if n.startswith("rollout")] + ["evaluator", "learner", "tracker"]
        for name in order:
            child = self.children.get(name)
            if child is not None:
                child.stop(self.s.stop_seconds)

    def tend(self, p: ProcessPlan) -> bool:
        """One look at every child: start what is due for a restart, see who came up, decide on
        who exited. Answers whether the learner has finished (exit 0: training is over)."""
        now = time.monotonic()
        for name, child in list(self.children.items()):
            if name in self.done:
                continue
            if name in self.pending:
                if now >= self.pending[name]:
                    del self.pending[name]
                    self._restart(p, name)
                continue
            code = child.poll()
            if code is None:
                if name in self.starting:
                    self._check_started(p, name, now)
                continue
            self.starting.pop(name, None)
            if (name == "learner" and code == 0) or self._normal_exit(p, name, code):
                self.done.add(name)
            elif code == 0:  # stopped by someone (SIGTERM) while the run goes on: not a crash
                raise ChildFailed(child, f"exited with code {code}")
            else:
                self._died(name, code, now)
        return "learner" in self.done

    def _normal_exit(self, p: ProcessPlan, name: str, code: int) -> bool:
        """An exit that is no failure: the evaluator's 0 (it scored up to the end), a replica's 0
        once the run is finished at the tracker (the learner marks it so after its last update,
        and replicas then stop). A replica's 0 on a running run is a failure all the same."""
        if code != 0:
            return False
        return name == "evaluator" or (name.startswith("rollout") and self.run_finished(p))

    def _check_started(self, p: ProcessPlan, name: str, now: float) -> None:
        url = health_url(p, name)
        if _answers(url):
            del self.starting[name]
            if name in self.down_since:
                down = now - self.down_since.pop(name)
                self.echo(f"{name} is up again (pid {self.children[name].pid}; down {down:.1f} s)")
        elif now > self.starting[name]:
            self.echo(f"{name} did not answer {url} within {self.s.start_seconds:.0f} s: killing it")
            self.children[name].kill()
            del self.starting[name]
            self._died(name, self.children[name].poll(), now)

    def _died(self, name: str, code: int | None, now: float) -> None:
        child = self.children[name]
        sup = self.s.supervision
        if not sup.enabled:
            raise ChildFailed(child, f"exited with code {code}")
        try:
            delay = self.budget.death(name, code, now)
        except GaveUp as exc:
            raise ChildFailed(child, str(exc)) from None
        self.echo(
            f"{name} (pid {child.pid}) exited with {describe_exit(code)}; restarting it in {delay:g} s "
            f"(supervision: {sup.max_restarts} restarts per {sup.window_seconds:g} s)"
        )
        self.pending[name] = now + delay
        self.down_since.setdefault(name, now)

    def _restart(self, p: ProcessPlan, name: str) -> None:
        old = self.children[name]
        old.stop(0)  # dead already: this closes its log
        if name == "tracker":
            self._wait_for_old_redis(p)
        service, command, extra = self.commands[name]
        child = self.spawn(p, name, service, command, extra)
        self.restarts[name] = self.restarts.get(name, 0) + 1
        self.on_restart(p, name)
        self.wait_started([name])
        self.echo(f"restarted {name} (pid {child.pid}; restart {self.restarts[name]} of it in this run)")

    def _wait_for_old_redis(self, p: ProcessPlan) -> None:
        """A tracker's embedded Redis gets SIGTERM when the tracker dies and flushes its append-only
        file as it exits; the new tracker's Redis must not open that file before then. Its pid
        is in <data_dir>/redis.pid until it exits. Past stop_seconds it is killed by that pid."""
        if p.tracker.redis_url is not None:
            return
        pidfile = Path(p.tracker.data_dir) / "redis.pid"
        try:
            wait_until(
                lambda: _redis_pid(pidfile) is None, self.s.stop_seconds, "the old tracker's Redis to exit"
            )
        except WaitTimeout:
            pid = _redis_pid(pidfile)
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                self.echo(
                    f"the dead tracker's Redis (pid {pid}) did not exit within {self.s.stop_seconds:g} s: killed"
                )
