"""One whole run on this machine: check, start in order, watch, stop at the budget, leave one folder.

    run_dir/
      run.json              what this run is (arm, recipe, seed, identity) and its status
      api-token             the services' bearer token when the user sets none (0600; run_token.py)
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
import signal
import time
from pathlib import Path

from services.config.launch import LaunchSettings
from services.launch.process_plan import ProcessPlan, port_requests, process_plan
from services.shell.child import Child, ChildFailed
from spopp.api.client import TrackerClient
from spopp.api.registration import RegistrationError, register, task_bodies
from spopp.files import provenance
from spopp.files.records import RunRecord
from spopp.machine import cuda_driver
from spopp.machine.gpus import count_gpus
from spopp.machine.net import free_port, port_free
from spopp.settings.base import SettingsError

from . import gpus as gpu
from .metrics import LaunchMetrics
from .progress import Progress, eval_points
from .run_folder import RunFolder, RunFolderError
from .run_token import RunTokenError, save_run_token, token_path, use_run_token
from .scale import SCALE_FILE, Scaler, parse_replicas
from .supervise import Supervisor, health_url

__all__ = ["SCALE_FILE", "LaunchError", "Launcher", "parse_replicas"]


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


# The signals taken during this launch's run, kept because the handler's exception can be lost: one
# raised inside an at-fork handler (logging's lock release while a child is spawned) is printed as
# "Exception ignored" and dropped, and the Ctrl-C with it. _pause raises it again.
_signals: list[str] = []


def _interrupt(signum, _frame) -> None:
    _signals.append(signal.Signals(signum).name)
    raise Interrupted(_signals[-1])


def _pause(seconds: float) -> None:
    """time.sleep, then Interrupted for a signal whose first raise was dropped."""
    time.sleep(seconds)
    if _signals:
        raise Interrupted(_signals[-1])


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


def _check_tasks(s: LaunchSettings, p: ProcessPlan) -> list[dict]:
    """The training tasks' bodies with their prior; held-out tasks must not be training tasks."""
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
        return task_bodies(train_ids, s.prior, f"the training tasks {s.tasks}")
    except RegistrationError as exc:
        raise LaunchError(str(exc)) from None


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


class Launcher:
    """`prepare()` checks everything and answers the plan; `run()` starts, watches and stops.

    It composes the run folder (run_folder.py: run.json, identity, export), the supervision of
    the children (supervise.py: spawning, health, restarts) and rescaling (scale.py)."""

    def __init__(self, s: LaunchSettings, echo=print) -> None:
        self.s = s
        self.echo = echo
        self.plan: ProcessPlan | None = None
        self.bodies: list[dict] = []
        self.tracker_finished = False  # the tracker said the run is finished (it stays so)
        self.folder = RunFolder(s)
        self.sup = Supervisor(s, echo, run_finished=self._run_finished, on_restart=self._restarted)
        self.scaler = Scaler(s, self.sup, self.folder.update, echo)
        self.metrics = LaunchMetrics({})
        # Whose token the services ask for: "yours" (SPOPP_API_TOKEN, api_token), the run folder's
        # ("kept"), or one made for this run ("made", written to the folder when the run starts).
        self.token: str | None = None

    @property
    def record(self) -> RunRecord | None:
        """run.json, once read or written."""
        return self.folder.record

    @property
    def children(self) -> dict[str, Child]:
        return self.sup.children

    @property
    def restarts(self) -> dict[str, int]:
        return self.sup.restarts

    # -- before anything starts ------------------------------------------------------------------
    def prepare(self) -> ProcessPlan:
        s = self.s
        if self.token is None:  # before the plan: every child's settings carry the token
            try:
                self.token = use_run_token(s) or "yours"
            except RunTokenError as exc:
                raise LaunchError(str(exc)) from None
        try:
            p = process_plan(s, _resolve_ports(s))
        except SettingsError as exc:
            raise LaunchError(str(exc)) from None
        _check_model(s.model)
        _check_env(s.env, s.env_options)
        self.bodies = _check_tasks(s, p)
        if s.wandb:
            try:
                import wandb  # noqa: F401
            except ImportError:
                raise LaunchError("wandb: true needs the wandb package: pip install 'spopp[wandb]'") from None
        problems = gpu.check(s.gpus, len(p.rollouts), count_gpus() if s.gpus.used() else 0)
        if problems:
            raise LaunchError("gpus: " + "; ".join(problems))
        if s.gpus.used() and (why := cuda_driver.refusal()) is not None:
            raise LaunchError(f"gpus: {why}")  # before any process starts, as the images' entrypoint
        try:
            self.folder.resume(p)
        except RunFolderError as exc:
            raise LaunchError(str(exc)) from None
        self.plan = p
        return p

    # -- the run ---------------------------------------------------------------------------------
    def finished_already(self) -> bool:
        """The run folder holds this run finished with the whole budget: nothing to do."""
        p = self.plan or self.prepare()
        return (
            self.record is not None
            and self.record.status == "finished"
            and self.folder.finished_updates(p) >= self.s.max_updates
        )

    def run(self) -> int:
        """Answers the exit code: 0 finished (or had finished), 1 failed, 130 interrupted."""
        p = self.plan or self.prepare()
        done = self.folder.finished_updates(p)
        if self.finished_already():
            self.echo(
                f"run {self.s.run} in {p.run_dir} finished already ({done} updates of {self.s.max_updates}); "
                "nothing to do. Raise `max_updates` to train further, or use another run_dir."
            )
            return 0
        if self.token == "made":  # kept before any child is given it, so a resume finds it
            try:
                save_run_token(p.run_dir, self.s.api_token)
            except (RunTokenError, OSError) as exc:
                self.echo(f"run {self.s.run} failed: {exc}")
                return 1
            self.token = "kept"
        resuming = self.record is not None
        self.restarts.update(self.record.restarts if resuming else {})
        self.scaler.forget_earlier(p)
        self.metrics = LaunchMetrics(self.restarts)
        server = self.metrics.serve(self.s.metrics_port)
        self.folder.write(p, metrics_url=server.url + "/metrics")
        self._say_code()
        _signals.clear()  # an earlier launch's in this process (spopp ablate runs them in turn)
        old = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
        status, code = "failed", 1
        try:
            self.echo(
                f"{'resuming' if resuming else 'starting'} run {self.s.run} ({p.arm()}, seed {self.s.seed}) "
                f"in {p.run_dir}: {len(p.rollouts)} replica(s), learner x{p.nproc}"
                + (", evaluator" if p.evaluator else "")
                + f", budget {self.s.max_updates} updates"
                + (f", from update {done}" if resuming and done else "")
            )
            self.echo(
                "every service asks for your bearer token (SPOPP_API_TOKEN or api_token)"
                if self.token == "yours"
                else f"every service asks for the run's bearer token, kept in {token_path(p.run_dir)} "
                "(readable by you only; set SPOPP_API_TOKEN to use your own)"
            )
            self._start(p)
            self._watch(p)
            with self._client(p) as c:  # the tracker's evidence; the tracker stops in stop_all
                self.folder.export(p, c)
            status, code = "finished", 0
        except Interrupted as exc:
            self.echo(f"{exc.args[0]}: stopping every process of run {self.s.run}")
            status, code = "stopped", 130
        except (ChildFailed, LaunchError) as exc:
            self.echo(f"run {self.s.run} failed: {exc}")
        finally:
            # A second Ctrl-C must not cut the stop short and leave children behind.
            for sig in old:
                signal.signal(sig, signal.SIG_IGN)
            self.sup.stop_all()
            for sig, handler in old.items():
                signal.signal(sig, handler)
            server.stop()
            self.folder.set_status(p, status)
        self._summary(p, status)
        return code

    def _say_code(self) -> None:
        """What run.json says of the code when it cannot tie the run to one clean commit: at the
        start, rather than first in a report."""
        code = self.record.code or {}
        if code.get("dirty"):
            files = ", ".join(code.get("dirty_files", []))
            self.echo(
                f"note: {provenance.label(code)} ({files[:300]}): run.json records it and the hash of the "
                "changes; spopp map, ablate and report compare this run only with runs of the same changes"
            )
        elif code.get("why"):
            self.echo(f"note: run.json records no commit: {code['why']}")

    def _start(self, p: ProcessPlan) -> None:
        tracker = self.sup.spawn(p, "tracker", "tracker", "serve")
        tracker.wait_http(health_url(p, "tracker"), self.s.start_seconds)
        self._register(p)
        # The rest start together: a replica waits for the learner's /healthz before its first
        # dispatch, so nothing here waits on the learner's start-up (the longest).
        self.sup.spawn(p, "learner", "learner", "run", ("--nproc", str(p.nproc), "--resume"))
        for r in p.rollouts:
            self.sup.spawn(p, r.worker_id, "rollout", "serve")
        if p.evaluator is not None:
            self.sup.spawn(p, "evaluator", "evaluator", "run")
        self.sup.wait_started([name for name in self.children if name != "tracker"])
        # Supervised from the first start: a replica that dies while the learner loads is
        # restarted like one that dies later. A learner that exits 0 at once found the run
        # finished at the tracker (a launch killed after its last update): nothing to wait for.
        while (self.sup.starting or self.sup.pending) and not self.sup.tend(p):
            _pause(0.2)
        self.echo(f"every process is up: {', '.join(f'{n} (pid {c.pid})' for n, c in self.children.items())}")

    def _run_finished(self, p: ProcessPlan) -> bool:
        """Whether the tracker says the run is finished (remembered once it does: it stays so)."""
        if not self.tracker_finished:
            with self._client(p) as c:
                run = c.get_run(self.s.run)
            if run.status == "finished":
                self.echo(f"run {self.s.run} is finished at the tracker (version {run.final_version})")
                self.tracker_finished = True
        return self.tracker_finished

    def _restarted(self, p: ProcessPlan, name: str) -> None:
        self.metrics.restarts.labels(process=name).inc()
        self.folder.update(p, restarts=dict(self.restarts))

    def _client(self, p: ProcessPlan, retry_seconds: float = 30) -> TrackerClient:
        return TrackerClient(
            f"http://127.0.0.1:{p.tracker.port}", token=self.s.api_token, retry_seconds=retry_seconds
        )

    def _register(self, p: ProcessPlan) -> None:
        """Create the run (or find it unchanged) and load its tasks with their prior."""
        with self._client(p) as c:
            try:
                # A launch is the explicit operator: its `max_updates` becomes the run's budget, either way.
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

    def _watch(self, p: ProcessPlan) -> None:
        progress = Progress(
            p, self._client(p, retry_seconds=0), self.echo, self.restarts,
            tracker_up=lambda: not self.sup.recovering("tracker"),
        )  # fmt: skip
        try:
            while not self.sup.tend(p):
                self.scaler.rescale(p)
                progress.tick()
                _pause(0.5)
            progress.tick(force=True)
            # Training is over: the replicas' work has nowhere to go. The evaluator goes on.
            for r in p.rollouts:
                self.sup.retire(r.worker_id)
            # The evaluator (and the tracker it reads) stay supervised until it has scored the end.
            while "evaluator" in self.children and "evaluator" not in self.sup.done:
                self.sup.tend(p)
                progress.tick(waiting="evaluating the last versions")
                _pause(0.5)
            # The export after this needs the tracker: one that is coming back is waited for.
            while self.sup.recovering("tracker"):
                self.sup.tend(p)
                _pause(0.2)
            progress.tick(force=True)
        finally:
            progress.close()

    def _summary(self, p: ProcessPlan, status: str) -> None:
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
