"""The launcher's child processes: started from one config file each, logged to a file, never orphaned.

Each child runs `python -m services.cli <service> <command> --config <file>` in a session of its
own (services/shell/child.py), so a Ctrl-C at the terminal reaches only the launcher, which then
stops the children in order (replicas before the tracker they report to). A launcher that dies
without that chance (SIGKILL, the OOM killer) takes them with it through the kernel's parent-death
signal; each service's own children (the embedded redis-server, torchrun's ranks, vLLM's engine
core) already die with their parent, so nothing is left holding a port, a folder or a GPU.
Children are stopped by their own pid, never by name.
"""

from __future__ import annotations

from pathlib import Path

from services.shell.child import Child
from spopp.settings.base import API_TOKEN_ENV, environ_without_settings


def child_env(token: str | None, devices: str) -> dict[str, str]:
    """The launcher's environment minus SPOPP_* (each child reads its config file, nothing else),
    plus the shared token and the child's devices."""
    env = environ_without_settings()
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = devices
    if token:
        env[API_TOKEN_ENV] = token
    return env


def launch_child(name: str, args: list[str], log_path: Path, env: dict[str, str]) -> Child:
    """One of the run's processes: `python args...`, logged to `log_path`, dying with the launcher."""
    return Child(
        name, args, env, log_path=log_path, with_parent=True, banner=f"spopp launch: {' '.join(args[2:])}"
    )
