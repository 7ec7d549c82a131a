"""One learner process per rank: the torchrun relaunch, and ranks that die with their launcher.

`spopp learner run --nproc N` resolves its settings once, writes them as a file (secrets stay in
the environment) and replaces itself with torchrun, which starts N ranks that read that file.
`execv` keeps the pid, so the pid users and supervisors hold is torchrun's, the ranks' parent.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from services.config.learner import LearnerSettings
from spopp.settings.base import API_TOKEN_ENV

LAUNCHER_PID_ENV = "SPOPP_LAUNCHER_PID"


def is_rank() -> bool:
    """Whether this process was started by torchrun as one rank of a group."""
    return "LOCAL_RANK" in os.environ


def relaunch(settings: LearnerSettings, nproc: int, resume: bool) -> None:
    """Replace this process with torchrun running `nproc` ranks of the same settings."""
    resolved = settings.to_file(Path(settings.log_dir) / "learner.resolved.yaml")
    if settings.api_token:
        os.environ[API_TOKEN_ENV] = settings.api_token
    args = [
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "services.learner.cli",
        "run",
        "--config",
        str(resolved),
    ]
    if resume:
        args.append("--resume")
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    os.execv(sys.executable, [sys.executable, *args])


def die_with_launcher() -> None:
    """A rank under torchrun: die with torchrun, even when it is SIGKILLed.

    torchrun starts each rank in a session of its own, so a SIGKILL of torchrun (or of its process
    group) never reaches the ranks, and nothing would stop them: rank 0 would keep the trajectory
    intake's port and train on, and a restarted learner could not bind it. torchrun forks the
    ranks from its main thread, which lives as long as torchrun, so the death signal does not fire
    early. A kill that lands before prctl is caught by the parent check: the rank has been
    reparented by then. The expected parent is only known when our CLI launched torchrun itself
    (--nproc); under a torchrun started by hand, only the prctl applies.
    """
    from spopp.machine.lifetime import die_with_parent

    die_with_parent(signal.SIGKILL)
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher and os.getppid() != int(launcher):
        sys.exit(f"spopp learner: the launcher (pid {launcher}) is gone; rank exits")
