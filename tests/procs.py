"""Service processes for tests: the real CLI in a subprocess, its output shown when a test fails,
killed by its own pid if still running at the end."""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

from spopp.settings.base import environ_without_settings


@contextlib.contextmanager
def held_port():
    """A port on 127.0.0.1 that another program holds (listening) until the block ends."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


@contextlib.contextmanager
def running(args: list[str], log_path, env: dict | None = None):
    base = environ_without_settings()
    log = open(log_path, "w+")
    proc = subprocess.Popen(
        args, env={**base, "OMP_NUM_THREADS": "1", **(env or {})}, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        yield proc
    except BaseException as exc:
        log.seek(0)
        tail, name = log.read()[-5000:], " ".join(args[3:5])
        print(f"{name} output (tail):\n" + tail)
        # Also on the exception itself: CI keeps the traceback and cuts captured output, and "the
        # process had exited with -9" (a SIGKILL: the OOM killer, a stray kill) or its last log
        # lines are what tells a crash from a slow answer.
        code = proc.poll()
        state = "still running" if code is None else f"exited with {code}"
        last = "\n".join(tail.splitlines()[-12:])
        exc.add_note(f"{name} (pid {proc.pid}) {state}{_oom_kill(proc.pid)}; its last lines:\n{last}")
        raise
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()


def oom_kills(since: float = 0.0) -> list[str]:
    """The kernel log's OOM-killer lines ("Killed process PID (name) ...") stamped after `since`
    seconds of uptime; [] where dmesg cannot be read (nothing is claimed then)."""
    try:
        log = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    found = []
    for line in log.splitlines():
        m = re.match(r"\[\s*([0-9.]+)\]\s*(.*Killed process \d+ .*)", line)
        if m and float(m[1]) >= since:
            found.append(m[2].strip())
    return found


def uptime() -> float:
    """Seconds since boot: the clock of the kernel log's stamps."""
    return float(Path("/proc/uptime").read_text().split()[0])


def _oom_kill(pid: int) -> str:
    hits = [x for x in oom_kills() if f"Killed process {pid} " in x]
    return f", killed by the kernel's OOM killer ({hits[-1]})" if hits else ""


def kill_unless_reused(processes: list) -> None:
    """SIGKILL each `psutil.Process` that is still the process it was when taken. psutil compares
    start times, so a pid the kernel has since handed to another process is left alone: pid_max
    is 32768 on these machines and a suite starts tens of thousands of processes and threads, so a
    cleanup by bare pid of a process that already ended can kill another test's service."""
    import psutil

    for p in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


def learner_config(tmp: Path, tracker_url: str, model, run: str, **settings) -> tuple[Path, int]:
    """A learner YAML under `tmp` (snapshots, checkpoints and logs beside it) on a free port."""
    from spopp.machine.net import free_port

    port = free_port()
    cfg = {
        "run": run, "tracker": tracker_url, "model": str(model), "port": port,
        "snapshots": str(tmp / "snapshots"), "checkpoints": str(tmp / "ckpt"), "log_dir": str(tmp / "logs"),
        "batch_size": 8, "mini_batches": 2, "micro_batch_size": 2, "zero_stage": 1, "keep_snapshots": 2,
        **settings,
    }  # fmt: skip
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "learner.yaml").write_text(yaml.safe_dump(cfg))
    return tmp / "learner.yaml", port


def send_raw(url: str, pieces, timeout: float = 10) -> tuple[bytes, float]:
    """Send `pieces` on one connection, then read until the server closes it: (what came back,
    seconds from the first byte sent to the close). A reset while sending is the server closing
    early; what it answered before is still read."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    t0 = time.monotonic()
    try:
        for piece in pieces:
            sock.sendall(piece)
    except (BrokenPipeError, ConnectionResetError):
        pass
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    finally:
        sock.close()
    return out, time.monotonic() - t0


def wait_learner(url: str, learner: subprocess.Popen) -> None:
    """Until the learner process at `url` answers /healthz (its model loaded), or it exits."""
    from spopp.machine.wait import wait_http

    wait_http(
        url + "/healthz", 180, "the learner intake", ok=None, interval=0.2, request_timeout=5, proc=learner
    )
