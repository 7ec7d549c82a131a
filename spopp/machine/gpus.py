"""The machine's NVIDIA GPUs, as nvidia-smi lists them: the one place that asks.

`spopp launch` checks its GPU plan against them (services/launch/gpus.py) and a replica's
`devices: auto` claims among them (spopp/machine/claim.py). No CUDA library is loaded: the launcher and
the claim run before, and without, torch.
"""

from __future__ import annotations

import shutil
import subprocess

QUERY = ["--query-gpu=index", "--format=csv,noheader"]


class GpuListError(RuntimeError):
    """nvidia-smi is missing, failed, timed out or printed something else than indices."""


class NoNvidiaSmi(GpuListError):
    """nvidia-smi is not on PATH: a machine without NVIDIA's driver tools, or a PATH without them."""


def run_nvidia_smi(args: list[str], timeout: float = 60.0) -> str:
    """nvidia-smi's output for `args`; GpuListError (NoNvidiaSmi when it is not on PATH) says why none."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        raise NoNvidiaSmi("nvidia-smi is not on PATH")
    try:
        done = subprocess.run([smi, *args], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise GpuListError(f"nvidia-smi did not answer within {timeout:g} s") from None
    except OSError as exc:
        raise GpuListError(f"nvidia-smi could not run: {exc}") from None
    if done.returncode != 0:
        raise GpuListError(
            f"nvidia-smi failed (exit {done.returncode}): {(done.stderr or done.stdout).strip()[:500]}"
        )
    return done.stdout


def list_gpus(timeout: float = 60.0) -> list[int]:
    """The GPU indices nvidia-smi lists (possibly none). GpuListError says why there is no list."""
    out = run_nvidia_smi(QUERY, timeout)
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    if not all(line.isdigit() for line in lines):
        raise GpuListError(f"unexpected nvidia-smi output {out.strip()[:200]!r}")
    return [int(line) for line in lines]


def count_gpus(timeout: float = 30.0) -> int:
    """How many GPUs this machine has: 0 where nvidia-smi is missing or fails (a CPU machine)."""
    try:
        return len(list_gpus(timeout))
    except GpuListError:
        return 0
