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

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import yaml

from spopp.client import TrackerClient
from spopp.jsonfile import read_model, write_text
from spopp.net import free_port, port_free
from spopp.records import RunRecord
from spopp.registration import RegistrationError, register, task_bodies
from spopp.settings import SettingsError

from . import gpus as gpu
from .children import Child, ChildFailed, child_env
from .config import LaunchSettings, Plan, plan, port_requests
from .progress import Progress, eval_points, last_line


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
    def run(self) -> int:
        """Answers the exit code: 0 finished (or had finished), 1 failed, 130 interrupted."""
        p = self.plan or self.prepare()
        done = self._finished_updates(p)
        if self.record is not None and self.record.status == "finished" and done >= self.s.updates:
            self.echo(
                f"run {self.s.run} in {p.run_dir} finished already ({done} updates of {self.s.updates}); "
                "nothing to do. Raise `updates` to train further, or use another run_dir."
            )
            return 0
        resuming = self.record is not None
        self._write_folder(p, resuming)
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
            self._set_status(p, status)
        self._summary(p, status)
        return code

    def _write_folder(self, p: Plan, resuming: bool) -> None:
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
            "started": old.started if old and old.started is not None else now,
            "launches": (old.launches if old else 0) + 1,
        })  # fmt: skip
        _write_record(p.run_dir / "run.json", self.record)

    def _set_status(self, p: Plan, status: str) -> None:
        update: dict[str, Any] = {"status": status, "updates_done": self._finished_updates(p)}
        if status == "finished":
            update["finished"] = time.time()
        # Validated again (model_copy would not): the record on disk is always one that reads back.
        self.record = RunRecord.model_validate({**self.record.model_dump(exclude_unset=True), **update})
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
        return child

    def _start(self, p: Plan) -> None:
        wait = self.s.start_seconds
        tracker = self._spawn(p, "tracker", "tracker", "serve")
        tracker.wait_http(f"http://127.0.0.1:{p.tracker.port}/readyz", wait)
        self._register(p)
        # The rest start together: a replica waits for the learner's /healthz before its first
        # dispatch, so nothing here waits on the learner's start-up (the longest).
        self._spawn(p, "learner", "learner", "run", ("--nproc", str(p.nproc), "--resume"))
        for r in p.rollouts:
            self._spawn(p, r.worker_id, "rollout", "serve")
        if p.evaluator is not None:
            self._spawn(p, "evaluator", "evaluator", "run")
        # /healthz answers (open, token or not) once rank 0 has the model and serves the intake.
        self._wait_up(p, "learner", p.learner.port)
        for r in p.rollouts:
            self._wait_up(p, r.worker_id, r.port)
        if p.evaluator is not None:
            self._wait_up(p, "evaluator", p.evaluator.port)
        self.echo(f"every process is up: {', '.join(f'{n} (pid {c.pid})' for n, c in self.children.items())}")

    def _wait_up(self, p: Plan, name: str, port: int) -> None:
        """Wait for a child's /healthz. On a run the tracker holds finished already (a launch killed
        after the learner's last update), the learner and the replicas exit 0 at once: not a failure."""
        child = self.children[name]
        try:
            child.wait_http(f"http://127.0.0.1:{port}/healthz", self.s.start_seconds)
        except ChildFailed:
            if child.poll() != 0 or not self._run_finished(p):
                raise

    def _run_finished(self, p: Plan) -> bool:
        """Whether the tracker says the run is finished (remembered once it does: it stays so)."""
        if not self.tracker_finished:
            with self._client(p) as c:
                run = c.get_run(self.s.run)
            if run.status == "finished":
                self.echo(f"run {self.s.run} is finished at the tracker (version {run.final_version})")
                self.tracker_finished = True
        return self.tracker_finished

    def _client(self, p: Plan) -> TrackerClient:
        return TrackerClient(f"http://127.0.0.1:{p.tracker.port}", token=self.s.api_token, retry_seconds=30)

    def _register(self, p: Plan) -> None:
        """Create the run (or find it unchanged) and load its tasks with their prior."""
        with self._client(p) as c:
            try:
                register(c, self.s.run, p.run_config.model_dump(mode="json"), self.bodies, self.echo)
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

    def _watch(self, p: Plan) -> None:
        progress = Progress(p, self._client(p), self.echo)  # opens the W&B run when wandb is on
        learner = self.children["learner"]
        try:
            while True:
                code = learner.poll()
                if code is not None:
                    if code != 0:
                        raise ChildFailed(learner, f"exited with code {code}")
                    break
                for name, child in self.children.items():
                    code = child.poll()
                    if name != "learner" and code is not None and not self._normal_exit(p, name, code):
                        raise ChildFailed(child, f"exited with code {code}")
                progress.tick()
                time.sleep(0.5)
            progress.tick(force=True)
            # Training is over: the replicas' work has nowhere to go. The evaluator goes on.
            for r in p.rollouts:
                self.children[r.worker_id].stop(self.s.stop_seconds)
            ev = self.children.get("evaluator")
            while ev is not None and ev.poll() is None:
                progress.tick(waiting="evaluating the last versions")
                time.sleep(0.5)
            if ev is not None and ev.poll() != 0:
                raise ChildFailed(ev, f"exited with code {ev.poll()}")
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
        """The tracker's per-task evidence, then the tracker stops (in _stop_all)."""
        with self._client(p) as c:
            rows = c.export(self.s.run)
        tmp = p.run_dir / "export.jsonl.tmp"
        with tmp.open("w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        os.replace(tmp, p.run_dir / "export.jsonl")

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
        self.echo(f"run {self.s.run}: {status}; folder {p.run_dir}")
