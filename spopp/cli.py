"""The `spopp` command: one sub-command group per service.

Service modules are imported inside the commands, so `spopp --help` stays instant and the CLI
works where only some services' dependencies are installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(help="spopp: asynchronous single-stream RL (SPO++ and SPO).", no_args_is_help=True)
tracker_app = typer.Typer(
    help="The tracker: prompt evidence, leases, sampler and policy clock.", no_args_is_help=True
)
app.add_typer(tracker_app, name="tracker")
learner_app = typer.Typer(help="The learner: DeepSpeed updates, snapshots.", no_args_is_help=True)
app.add_typer(learner_app, name="learner")
rollout_app = typer.Typer(help="Rollout replicas: engine, agent loop, environments.", no_args_is_help=True)
app.add_typer(rollout_app, name="rollout")


@tracker_app.command("serve")
def tracker_serve(
    host: Annotated[str, typer.Option(help="address to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to bind")] = 8000,
    redis_url: Annotated[
        str | None,
        typer.Option(
            envvar="SPOPP_REDIS_URL", help="Redis holding all state; omit to start an embedded redis-server"
        ),
    ] = None,
    data_dir: Annotated[Path, typer.Option(help="AOF folder of the embedded Redis")] = Path(
        "spopp-data/tracker"
    ),
    log_level: Annotated[str, typer.Option(help="uvicorn log level")] = "info",
) -> None:
    """Serve the tracker's REST API (OpenAPI at /docs). SPOPP_API_TOKEN turns on bearer auth."""
    try:
        from services.tracker.config import TrackerSettings
        from services.tracker.serve import serve
    except ImportError as exc:
        raise typer.BadParameter(
            f"the tracker needs its extras: pip install 'spopp[tracker]' ({exc})"
        ) from exc
    # Flags override the SPOPP_* environment; the token only ever comes from the environment.
    settings = TrackerSettings(
        host=host, port=port, redis_url=redis_url, data_dir=data_dir, log_level=log_level
    )
    serve(settings)


def _given(**options) -> dict:
    """Flags the user gave; the rest come from SPOPP_* variables or the settings' defaults."""
    return {k: v for k, v in options.items() if v is not None}


@rollout_app.command("serve")
def rollout_serve(
    model: Annotated[Path, typer.Option(help="model folder of policy version 0")],
    tracker: Annotated[str | None, typer.Option(help="tracker URL")] = None,
    learner: Annotated[str | None, typer.Option(help="learner URL")] = None,
    run: Annotated[str | None, typer.Option(help="run name at the tracker")] = None,
    engine: Annotated[str | None, typer.Option(help="vllm | transformers")] = None,
    env: Annotated[str | None, typer.Option(help="environment: math-tir")] = None,
    tasks: Annotated[Path | None, typer.Option(help="task file (JSONL or parquet)")] = None,
    generated_tasks: Annotated[int | None, typer.Option(help="N generated arithmetic tasks")] = None,
    worker_id: Annotated[str | None, typer.Option(help="name of this replica")] = None,
    concurrency: Annotated[int | None, typer.Option(help="episodes in flight")] = None,
    drain: Annotated[str | None, typer.Option(help="finish | abort, on a new policy")] = None,
    max_turns: Annotated[int | None, typer.Option(help="turns per episode")] = None,
    max_tokens_per_turn: Annotated[int | None, typer.Option(help="tokens per model turn")] = None,
    max_total_tokens: Annotated[int | None, typer.Option(help="tokens per episode, prompt included")] = None,
    temperature: Annotated[float | None, typer.Option(help="sampling temperature")] = None,
    seed: Annotated[int | None, typer.Option(help="base of per-episode seeds")] = None,
    host: Annotated[str | None, typer.Option(help="address of /healthz and /metrics")] = None,
    port: Annotated[int | None, typer.Option(help="port of /healthz and /metrics")] = None,
    max_episodes: Annotated[
        int | None, typer.Option(help="stop after N episodes (tests, smoke runs)")
    ] = None,
) -> None:
    """Run a rollout replica: dispatch from the tracker, run episodes, report, push trajectories."""
    import asyncio
    import logging

    from services.rollout.config import RolloutSettings
    from services.rollout.serve import serve

    settings = RolloutSettings(
        **_given(
            model=model,
            tracker=tracker,
            learner=learner,
            run=run,
            engine=engine,
            env=env,
            tasks=tasks,
            generated_tasks=generated_tasks,
            worker_id=worker_id,
            concurrency=concurrency,
            drain=drain,
            max_turns=max_turns,
            max_tokens_per_turn=max_tokens_per_turn,
            max_total_tokens=max_total_tokens,
            temperature=temperature,
            seed=seed,
            host=host,
            port=port,
        )
    )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(serve(settings, max_episodes=max_episodes))


_LAUNCHER_PID = "SPOPP_LAUNCHER_PID"


def _die_with_launcher() -> None:
    """A rank under torchrun: die with torchrun, even when it is SIGKILLed.

    torchrun starts each rank in a session of its own, so a SIGKILL of torchrun (or of its process
    group) never reaches the ranks, and nothing would stop them: rank 0 would keep the trajectory
    intake's port and train on, and a restarted learner could not bind it. torchrun forks the
    ranks from its main thread, which lives as long as torchrun, so the death signal does not fire
    early. A kill that lands before prctl is caught by the parent check: the rank has been
    reparented by then. The expected parent is only known when this CLI launched torchrun itself
    (--nproc); under a torchrun started by hand, only the prctl applies.
    """
    import os
    import signal
    import sys

    from spopp.lifetime import die_with_parent

    die_with_parent(signal.SIGKILL)
    launcher = os.environ.get(_LAUNCHER_PID)
    if launcher and os.getppid() != int(launcher):
        sys.exit(f"spopp learner: the launcher (pid {launcher}) is gone; rank exits")


@learner_app.command("eval")
def learner_eval(
    config: Annotated[Path, typer.Option(help="learner YAML with an `eval:` block")],
    snapshot: Annotated[
        list[Path] | None,
        typer.Option(help="model or snapshot folder to score (repeatable); default: the config's model"),
    ] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="override a config setting, KEY=VALUE (repeatable)")
    ] = None,
    out: Annotated[Path | None, typer.Option(help="episodes folder; default: log_dir/eval-offline")] = None,
) -> None:
    """Score snapshots on the held-out tasks, outside training: one JSON line of metrics each."""
    import json
    import logging

    from services.learner.config import LearnerConfig
    from services.learner.evaluate import evaluate_folders

    cfg = LearnerConfig.from_yaml(config, set_ or ())
    if cfg.eval is None:
        raise typer.BadParameter("the config has no `eval:` block (held-out tasks, episodes per task)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    folders = list(snapshot or [cfg.model])
    results = evaluate_folders(cfg.eval, cfg.model, folders, out or cfg.log_dir / "eval-offline")
    for folder, r in zip(folders, results, strict=True):
        print(json.dumps({"snapshot": str(folder), "policy_version": r.version, **r.metrics}), flush=True)


@learner_app.command("run")
def learner_run(
    config: Annotated[Path, typer.Option(help="learner YAML (see deploy/learner.example.yaml)")],
    nproc: Annotated[int, typer.Option(help="processes on this node (relaunches under torchrun)")] = 1,
    max_updates: Annotated[int | None, typer.Option(help="stop after N updates")] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help="override a config setting, KEY=VALUE (repeatable; dotted keys for nested settings: "
            "eval.every=5; VALUE is read as YAML)",
        ),
    ] = None,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="continue from the newest checkpoint under the config's `checkpoints` (weights, "
            "optimizer, step, policy version, RNG, buffered trajectories); with no checkpoint there, "
            "start fresh. Fails if the tracker's policy is ahead of the checkpoint (publishes after "
            "it); checkpoint_every = updates_per_publish avoids that",
        ),
    ] = False,
) -> None:
    """Train on the first trajectories of each policy version; publish snapshots to the tracker."""
    import logging
    import os
    import sys

    if "LOCAL_RANK" in os.environ:
        _die_with_launcher()
    if nproc > 1 and "LOCAL_RANK" not in os.environ:
        # One process per rank under torchrun, which also sets one torch thread per process.
        args = [
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "-m",
            "spopp.cli",
            "learner",
            "run",
            "--config",
            str(config),
        ]
        if max_updates is not None:
            args += ["--max-updates", str(max_updates)]
        for item in set_ or ():
            args += ["--set", item]
        if resume:
            args.append("--resume")
        # execv keeps the pid: this is the pid of torchrun, the ranks' parent.
        os.environ[_LAUNCHER_PID] = str(os.getpid())
        os.execv(sys.executable, [sys.executable, *args])
    from services.learner.config import LearnerConfig
    from services.learner.trainer import Learner

    overrides = {"max_updates": max_updates} if max_updates is not None else {}
    cfg = LearnerConfig.from_yaml(config, set_ or (), **overrides)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    Learner(cfg, resume=resume).run()


if __name__ == "__main__":
    app()
