"""One whole run on this machine: check, start in order, watch, stop at the budget, leave one folder.

    run_dir/
      run.json              what this run is (arm, recipe, seed, identity) and its status
      launch.yaml           the resolved launch config (secrets left out)
      config/<child>.yaml   the exact settings each process was started with
      logs/<child>.log      every process's output, appended across resumes
      tracker/              the embedded Redis (append-only file): evidence, leases, policy clock
      snapshots/ checkpoints/
      learner/              metrics.jsonl and tb/ (TensorBoard), one record per update
      eval/                 evals.jsonl (the evaluation curve), episodes/, tb/
      export.jsonl          the tracker's per-task evidence at the end

Everything is checked before the first process starts: every section against its service's
settings, the model folder, the task and prior files (and that every prior task is a training
task), the GPUs and the ports. Then: tracker → run and prior at the tracker → learner → replicas →
evaluator, each waited for on its health route. A second launch on the same folder resumes: the
tracker finds its Redis file, the learner its checkpoint, the evaluator its records; the run's
identity (recipe, seed, model, tasks, prior, run config) must not have changed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from spopp.client import TrackerClient
from spopp.jsonfile import read_model, write_text
from spopp.net import free_port, port_free
from spopp.records import RunRecord
from spopp.registration import RegistrationError, register, task_bodies
from spopp.settings import SettingsError
from spopp.wait import WaitTimeout, wait_until

from . import gpus as gpu
from .children import Child, ChildFailed, child_env
from .config import LaunchSettings, Plan, plan, port_requests, rollout_settings
from .metrics import LaunchMetrics
from .progress import Progress, eval_points, last_line
from .supervise import GaveUp, RestartBudget, describe_exit


def _check_env(name: str, options: dict) -> None:
    """The environment and its options, as every replica will build them (a bad option, a missing
    package), before any process starts rather than in each replica's log."""
    from runtime.envs import env_factory

    try:
        env_factory(name, options)
    except Exception as exc:  # each environment raises its own kind for a missing dependency
        message = str(exc)
        if not message.startswith(f"environment {name}"):
            message = f"environment {name}: {message}"
        raise LaunchError(message) from None


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


# `spopp scale` writes the wanted replica count here; the running launcher reads it each tick.
SCALE_FILE = "replicas"
MAX_REPLICAS = 256


def parse_replicas(text: str, gpu_slots: int) -> int:
    """The replica count in a scale file: a whole number from 1 (a run without replicas would
    stall) up to MAX_REPLICAS, and up to the replicas gpus.rollout has devices for (when given)."""
    try:
        n = int(text.strip())
    except ValueError:
        raise ValueError(f"expected a whole number of replicas, got {text.strip()[:40]!r}") from None
    if not 1 <= n <= MAX_REPLICAS:
        raise ValueError(f"replicas must be 1..{MAX_REPLICAS}, got {n}")
    if gpu_slots and n > gpu_slots:
        raise ValueError(f"gpus.rollout has devices for {gpu_slots} replicas, not {n}")
    return n


class LaunchError(RuntimeError):
    """A launch that cannot start or go on; the message says why."""


class Interrupted(Exception):
    """SIGINT or SIGTERM reached the launcher."""


def _interrupt(signum, _frame) -> None:
    raise Interrupted(signal.Signals(signum).name)


def _resolve_ports(s: LaunchSettings) -> dict[str, int]:
    ports, taken = {}, set()
    for name, port in port_requests(s).items():
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise LaunchError(f"{name}: port must be an integer in 0..65535, got {port!r}")
        if port:
            if port in taken or not port_free(port):
                raise LaunchError(f"port {port} ({name}) is in use: pick another or 0 for any free port")
        else:
            port = free_port(taken=taken)
        taken.add(port)
        ports[name] = port
    return ports


def _check_model(folder: Path) -> None:
    cfg = Path(folder) / "config.json"
    try:
        data = json.loads(cfg.read_text())
    except FileNotFoundError:
        raise LaunchError(f"model {folder} is not a model folder: no config.json") from None
    except (OSError, ValueError) as exc:
        raise LaunchError(f"model {folder}: config.json is unreadable: {exc}") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise LaunchError(f"model {folder}: config.json has no model_type, so it is not a model's config")
    if not any((Path(folder) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise LaunchError(f"model {folder} has no tokenizer (tokenizer.json or tokenizer_config.json)")


def _task_ids(path: Path, what: str) -> list[str]:
    from runtime.tasks import load_tasks

    try:
        tasks = load_tasks(path)
    except FileNotFoundError:
        raise LaunchError(f"{what} file {path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise LaunchError(f"{what} file {path}: {exc}") from None
    if not tasks:
        raise LaunchError(f"{what} file {path} holds no tasks")
    return [t.task_id for t in tasks]


def _read_record(path: Path) -> RunRecord | None:
    try:
        return read_model(path, RunRecord)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise LaunchError(
            f"{exc}\n(the run folder's record is unreadable: move the folder aside to start over)"
        ) from None


def _write_record(path: Path, record: RunRecord) -> None:
    write_text(path, record.to_text(str(path)))


class Launcher:
    """`prepare()` checks everything and answers the plan; `run()` starts, watches and stops."""

    def __init__(self, s: LaunchSettings, echo=print) -> None:
        self.s = s
        self.echo = echo
        self.children: dict[str, Child] = {}
        self.plan: Plan | None = None
        self.record: RunRecord | None = None  # run.json, once read or written
        self.bodies: list[dict] = []
        self.tracker_finished = False  # the tracker said the run is finished (it stays so)
        # Supervision: how each child is started again, which are due for a restart (when),
        # which are starting (until when), which are done for good, restarts per child.
        self.commands: dict[str, tuple[str, str, tuple[str, ...]]] = {}
        self.pending: dict[str, float] = {}
        self.starting: dict[str, float] = {}
        self.done: set[str] = set()
        self.restarts: dict[str, int] = {}
        self.down_since: dict[str, float] = {}  # when a child being restarted was found dead
        self.budget = RestartBudget(s.supervision)
        self.metrics = LaunchMetrics({})
        self.scale_seen: int | None = None  # the scale file's mtime last read

    # -- before anything starts ------------------------------------------------------------------
    def prepare(self) -> Plan:
        s = self.s
        try:
            p = plan(s, _resolve_ports(s))
        except SettingsError as exc:
            raise LaunchError(str(exc)) from None
        _check_model(s.model)
        _check_env(s.env, s.env_options)
        train_ids = _task_ids(s.tasks, "tasks")
        if s.heldout is not None and p.evaluator is not None:
            held = set(_task_ids(s.heldout, "heldout"))
            overlap = held & set(train_ids)
            if overlap:
                raise LaunchError(
                    f"{len(overlap)} held-out tasks are also training tasks (e.g. {sorted(overlap)[0]}): "
                    "the evaluation would not be held out"
                )
        try:
            self.bodies = task_bodies(train_ids, s.prior, f"the training tasks {s.tasks}")
        except RegistrationError as exc:
            raise LaunchError(str(exc)) from None
        if s.wandb:
            try:
                import wandb  # noqa: F401
            except ImportError:
                raise LaunchError("wandb: true needs the wandb package: pip install 'spopp[wandb]'") from None
        problems = gpu.check(s.gpus, len(p.rollouts), gpu.count_gpus() if s.gpus.used() else 0)
        if problems:
            raise LaunchError("gpus: " + "; ".join(problems))
        self.record = self._resume_record(p)
        self.plan = p
        return p

    def _resume_record(self, p: Plan) -> RunRecord | None:
        record = _read_record(p.run_dir / "run.json")
        if record is None:
            return None
        mine = p.identity()
        theirs = record.identity
        changed = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        if changed:
            diff = "; ".join(f"{k}: {theirs.get(k)!r} in the folder, {mine.get(k)!r} now" for k in changed)
            raise LaunchError(
                f"{p.run_dir} holds another run ({diff}). A launch on an existing folder resumes its "
                "run and cannot change what defines it: use another run_dir"
            )
        return record

    # -- the run ---------------------------------------------------------------------------------
    def finished_already(self) -> bool:
        """The run folder holds this run finished with the whole budget: nothing to do."""
        p = self.plan or self.prepare()
        return (
            self.record is not None
            and self.record.status == "finished"
            and self._finished_updates(p) >= self.s.updates
        )

    def run(self) -> int:
        """Answers the exit code: 0 finished (or had finished), 1 failed, 130 interrupted."""
        p = self.plan or self.prepare()
        done = self._finished_updates(p)
        if self.finished_already():
            self.echo(
                f"run {self.s.run} in {p.run_dir} finished already ({done} updates of {self.s.updates}); "
                "nothing to do. Raise `updates` to train further, or use another run_dir."
            )
            return 0
        resuming = self.record is not None
        self.restarts = dict(self.record.restarts) if resuming else {}
        stale = p.run_dir / SCALE_FILE
        if stale.is_file():
            # A count set for an earlier launch of this folder: this one starts from its config.
            stale.unlink()
            self.echo(
                f"removed {stale} of an earlier launch: replicas start at rollout.replicas ({len(p.rollouts)})"
            )
        self.metrics = LaunchMetrics(self.restarts)
        server = self.metrics.serve(self.s.metrics_port)
        self._write_folder(p, resuming, metrics_url=server.url + "/metrics")
        old = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
        status, code = "failed", 1
        try:
            self.echo(
                f"{'resuming' if resuming else 'starting'} run {self.s.run} ({p.arm()}, seed {self.s.seed}) "
                f"in {p.run_dir}: {len(p.rollouts)} replica(s), learner x{p.nproc}"
                + (", evaluator" if p.evaluator else "")
                + f", budget {self.s.updates} updates"
                + (f", from update {done}" if resuming and done else "")
            )
            self._start(p)
            self._watch(p)
            self._finish(p)
            status, code = "finished", 0
        except Interrupted as exc:
            self.echo(f"{exc.args[0]}: stopping every process of run {self.s.run}")
            status, code = "stopped", 130
        except ChildFailed as exc:
            self.echo(f"run {self.s.run} failed: {exc}")
        except LaunchError as exc:
            self.echo(f"run {self.s.run} failed: {exc}")
        finally:
            # A second Ctrl-C must not cut the stop short and leave children behind.
            for sig in old:
                signal.signal(sig, signal.SIG_IGN)
            self._stop_all()
            for sig, handler in old.items():
                signal.signal(sig, handler)
            server.stop()
            self._set_status(p, status)
        self._summary(p, status)
        return code

    def _write_folder(self, p: Plan, resuming: bool, metrics_url: str) -> None:
        from runtime.envs import resolved_env_options

        p.run_dir.mkdir(parents=True, exist_ok=True)
        (p.run_dir / "launch.yaml").write_text(
            yaml.safe_dump({k: v for k, v in self.s.model_dump(mode="json").items() if k != "api_token"},
                           sort_keys=False)
        )  # fmt: skip
        for name, settings in self._child_settings(p).items():
            settings.to_file(p.run_dir / "config" / f"{name}.yaml")
        now = time.time()
        old = self.record
        self.record = RunRecord.model_validate({
            **(old.model_dump(exclude_unset=True) if old else {}),
            "run": self.s.run, "arm": p.arm(), "recipe": self.s.recipe,
            "normalization": p.learner.normalization, "seed": self.s.seed, "updates": self.s.updates,
            "final_version": p.final_version, "identity": p.identity(), "status": "running",
            "env": self.s.env, "env_options": resolved_env_options(self.s.env, self.s.env_options),
            "started": old.started if old and old.started is not None else now,
            "launches": (old.launches if old else 0) + 1, "metrics_url": metrics_url,
            "replicas": len(p.rollouts),
        })  # fmt: skip
        _write_record(p.run_dir / "run.json", self.record)

    def _set_status(self, p: Plan, status: str) -> None:
        update: dict[str, Any] = {"status": status, "updates_done": self._finished_updates(p)}
        if status == "finished":
            update["finished"] = time.time()
        self._update_record(p, **update)

    def _update_record(self, p: Plan, **changes: Any) -> None:
        """run.json with `changes`, validated again (model_copy would not): the record on disk is
        always one that reads back."""
        self.record = RunRecord.model_validate({**self.record.model_dump(exclude_unset=True), **changes})
        _write_record(p.run_dir / "run.json", self.record)

    def _child_settings(self, p: Plan) -> dict[str, Any]:
        out: dict[str, Any] = {"tracker": p.tracker, "learner": p.learner}
        for r in p.rollouts:
            out[r.worker_id] = r
        if p.evaluator is not None:
            out["evaluator"] = p.evaluator
        return out

    def _spawn(self, p: Plan, name: str, service: str, command: str, extra: tuple[str, ...] = ()) -> Child:
        devices = gpu.assignment(self.s.gpus, len(p.rollouts)).get(name, [])
        args = [
            "-m",
            "services.cli",
            service,
            command,
            "--config",
            str(p.run_dir / "config" / f"{name}.yaml"),
            *extra,
        ]
        child = Child(
            name,
            args,
            p.run_dir / "logs" / f"{name}.log",
            child_env(self.s.api_token, gpu.visible_devices(devices)),
        )
        self.children[name] = child
        self.commands[name] = (service, command, extra)
        return child

    def _start(self, p: Plan) -> None:
        tracker = self._spawn(p, "tracker", "tracker", "serve")
        tracker.wait_http(self._health_url(p, "tracker"), self.s.start_seconds)
        self._register(p)
        # The rest start together: a replica waits for the learner's /healthz before its first
        # dispatch, so nothing here waits on the learner's start-up (the longest).
        self._spawn(p, "learner", "learner", "run", ("--nproc", str(p.nproc), "--resume"))
        for r in p.rollouts:
            self._spawn(p, r.worker_id, "rollout", "serve")
        if p.evaluator is not None:
            self._spawn(p, "evaluator", "evaluator", "run")
        deadline = time.monotonic() + self.s.start_seconds
        self.starting.update({name: deadline for name in self.children if name != "tracker"})
        # Supervised from the first start: a replica that dies while the learner loads is
        # restarted like one that dies later. A learner that exits 0 at once found the run
        # finished at the tracker (a launch killed after its last update): nothing to wait for.
        while (self.starting or self.pending) and not self._tend(p):
            time.sleep(0.2)
        self.echo(f"every process is up: {', '.join(f'{n} (pid {c.pid})' for n, c in self.children.items())}")

    def _health_url(self, p: Plan, name: str) -> str:
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

    def _run_finished(self, p: Plan) -> bool:
        """Whether the tracker says the run is finished (remembered once it does: it stays so)."""
        if not self.tracker_finished:
            with self._client(p) as c:
                run = c.get_run(self.s.run)
            if run.status == "finished":
                self.echo(f"run {self.s.run} is finished at the tracker (version {run.final_version})")
                self.tracker_finished = True
        return self.tracker_finished

    def _client(self, p: Plan, retry_seconds: float = 30) -> TrackerClient:
        return TrackerClient(
            f"http://127.0.0.1:{p.tracker.port}", token=self.s.api_token, retry_seconds=retry_seconds
        )

    def _register(self, p: Plan) -> None:
        """Create the run (or find it unchanged) and load its tasks with their prior."""
        with self._client(p) as c:
            try:
                # A launch is the explicit operator: its `updates` becomes the run's budget, either way.
                register(
                    c,
                    self.s.run,
                    p.run_config.model_dump(mode="json"),
                    self.bodies,
                    self.echo,
                    change_budget=True,
                )
            except RegistrationError as exc:
                raise LaunchError(str(exc)) from None
            run = c.get_run(self.s.run)
            if run.status == "finished" and run.final_version < p.final_version:
                # The budget grew since the run finished: it trains on.
                c.reopen(self.s.run, run.final_version)
                self.echo(
                    f"run {self.s.run} had finished at version {run.final_version}; reopened for the "
                    f"budget's last version {p.final_version}"
                )

    # -- supervision -----------------------------------------------------------------------------
    def _tend(self, p: Plan) -> bool:
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
                self._died(p, name, code, now)
        return "learner" in self.done

    def _check_started(self, p: Plan, name: str, now: float) -> None:
        url = self._health_url(p, name)
        if _answers(url):
            del self.starting[name]
            if name in self.down_since:
                down = now - self.down_since.pop(name)
                self.echo(f"{name} is up again (pid {self.children[name].pid}; down {down:.1f} s)")
        elif now > self.starting[name]:
            self.echo(f"{name} did not answer {url} within {self.s.start_seconds:.0f} s: killing it")
            self.children[name].kill()
            del self.starting[name]
            self._died(p, name, self.children[name].poll(), now)

    def _died(self, p: Plan, name: str, code: int | None, now: float) -> None:
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

    def _restart(self, p: Plan, name: str) -> None:
        old = self.children[name]
        old.stop(0)  # dead already: this closes its log
        if name == "tracker":
            self._wait_for_old_redis(p)
        service, command, extra = self.commands[name]
        child = self._spawn(p, name, service, command, extra)
        self.restarts[name] = self.restarts.get(name, 0) + 1
        self.metrics.restarts.labels(process=name).inc()
        self._update_record(p, restarts=dict(self.restarts))
        self.starting[name] = time.monotonic() + self.s.start_seconds
        self.echo(f"restarted {name} (pid {child.pid}; restart {self.restarts[name]} of it in this run)")

    # -- replicas while the run goes on ------------------------------------------------------
    def _rescale(self, p: Plan) -> None:
        """Apply a new count from <run_dir>/replicas: start rollout-N.. or stop the highest ones
        (SIGTERM: a replica drains and gives back its leases). A bad file changes nothing."""
        path = p.run_dir / SCALE_FILE
        try:
            mtime = path.stat().st_mtime_ns
            if mtime == self.scale_seen:
                return
            self.scale_seen = mtime
            want = parse_replicas(path.read_text(), len(self.s.gpus.rollout))
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            self.echo(f"{path}: {exc}; the run keeps its {len(p.rollouts)} replica(s)")
            return
        have = len(p.rollouts)
        for i in range(have, want):
            self._add_replica(p, i)
        for r in reversed(p.rollouts[want:]):
            self.pending.pop(r.worker_id, None)
            self.starting.pop(r.worker_id, None)
            self.children[r.worker_id].stop(self.s.stop_seconds)
            self.done.add(r.worker_id)
            p.rollouts.remove(r)
        if want != have:
            self.echo(f"replicas {have} -> {want} ({path})")
        self._update_record(p, replicas=want)

    def _add_replica(self, p: Plan, i: int) -> None:
        taken = {p.tracker.port, p.learner.port, *(r.port for r in p.rollouts)}
        if p.evaluator is not None:
            taken.add(p.evaluator.port)
        r = rollout_settings(
            self.s, i, f"http://127.0.0.1:{p.tracker.port}", f"http://127.0.0.1:{p.learner.port}",
            free_port(taken=taken),
        )  # fmt: skip
        r.to_file(p.run_dir / "config" / f"{r.worker_id}.yaml")
        p.rollouts.append(r)
        self.done.discard(r.worker_id)
        child = self._spawn(p, r.worker_id, "rollout", "serve")
        self.starting[r.worker_id] = time.monotonic() + self.s.start_seconds
        self.echo(f"started {r.worker_id} (pid {child.pid})")

    def _wait_for_old_redis(self, p: Plan) -> None:
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

    def _watch(self, p: Plan) -> None:
        progress = Progress(
            p, self._client(p, retry_seconds=0), self.echo, self.restarts,
            tracker_up=lambda: "tracker" not in self.pending and "tracker" not in self.starting,
        )  # fmt: skip
        try:
            while not self._tend(p):
                self._rescale(p)
                progress.tick()
                time.sleep(0.5)
            progress.tick(force=True)
            # Training is over: the replicas' work has nowhere to go. The evaluator goes on.
            for r in p.rollouts:
                if r.worker_id not in self.done:
                    self.children[r.worker_id].stop(self.s.stop_seconds)
                    self.done.add(r.worker_id)
                self.pending.pop(r.worker_id, None)
            # The evaluator (and the tracker it reads) stay supervised until it has scored the end.
            while "evaluator" in self.children and "evaluator" not in self.done:
                self._tend(p)
                progress.tick(waiting="evaluating the last versions")
                time.sleep(0.5)
            # The export below needs the tracker: one that is coming back is waited for.
            while "tracker" in self.pending or "tracker" in self.starting:
                self._tend(p)
                time.sleep(0.2)
            progress.tick(force=True)
        finally:
            progress.close()

    def _normal_exit(self, p: Plan, name: str, code: int) -> bool:
        """An exit that is no failure: the evaluator's 0 (it scored up to the end), a replica's 0
        once the run is finished at the tracker (the learner marks it so after its last update,
        and replicas then stop). A replica's 0 on a running run is a failure all the same."""
        if code != 0:
            return False
        return name == "evaluator" or (name.startswith("rollout") and self._run_finished(p))

    def _finish(self, p: Plan) -> None:
        """The tracker's per-task evidence, and its run counts and per-worker counts in run.json
        (what a reader checks a run against once its tracker is gone: every dispatch ended as one
        outcome, release, expiry or lease still in flight), then the tracker stops (in _stop_all)."""
        with self._client(p) as c:
            rows = c.export(self.s.run)
            run = c.get_run(self.s.run)
        tmp = p.run_dir / "export.jsonl.tmp"
        with tmp.open("w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        os.replace(tmp, p.run_dir / "export.jsonl")
        self._update_record(
            p,
            tracker_counts=run.counts.model_dump(mode="json"),
            workers={k: v.model_dump(mode="json") for k, v in run.workers.items()},
        )

    def _stop_all(self) -> None:
        # Replicas and the evaluator first (they report to the tracker), the learner, the tracker last.
        order = [n for n in self.children if n.startswith("rollout")] + ["evaluator", "learner", "tracker"]
        for name in order:
            child = self.children.get(name)
            if child is not None:
                child.stop(self.s.stop_seconds)

    def _finished_updates(self, p: Plan) -> int:
        line = last_line(p.run_dir / "learner" / "metrics.jsonl")
        return int(line.get("step", 0)) if line else 0

    def _summary(self, p: Plan, status: str) -> None:
        points = eval_points(p.run_dir / "eval" / "evals.jsonl")
        if points:
            first, last = points[0], points[-1]
            self.echo(
                f"evaluation ({points[0][2]}): version {first[0]} {first[1]:.3f} -> version {last[0]} "
                f"{last[1]:.3f} over {len(points)} points"
            )
        if self.restarts:
            listed = ", ".join(f"{k} {v}" for k, v in sorted(self.restarts.items()))
            self.echo(f"restarts by supervision over this run: {listed} (run.json, spopp report)")
        self.echo(f"run {self.s.run}: {status}; folder {p.run_dir}")
