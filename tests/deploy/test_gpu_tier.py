"""`make test-gpu` on a machine without a GPU: one clear line, exit 0, nothing collected, nothing
installed, also where no venv exists and the machine's python3 has the dependencies (a cluster
image, or the GPU wheelhouse); with SPOPP_GPU_TIER=1 the tier's tests import and collect, and
without it `make test` never sees them (their CUDA work is for a GPU machine)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.process
ROOT = Path(__file__).resolve().parents[2]
SKIPPED = "make test-gpu: skipped, no CUDA GPU here (torch.cuda.is_available() is False)"


def make_test_gpu(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "-s", "test-gpu", *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: make test-gpu runs the tier")
def test_make_test_gpu_says_it_skips_in_one_line():
    out = make_test_gpu()
    assert out.returncode == 0, out.stderr
    assert [line for line in out.stdout.splitlines() if line.strip()] == [SKIPPED]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: make test-gpu runs the tier")
def test_without_a_venv_make_test_gpu_uses_the_python3_that_has_the_dependencies(tmp_path):
    """No venv where VENV points, and `python3` on PATH is one that imports torch and the rest (here
    this interpreter; on a GPU machine the image's, or the wheelhouse's on PYTHONPATH): the target
    runs with it and creates nothing, so it never builds a venv or asks an index."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python3 = bin_dir / "python3"
    # A wrapper, not a symlink: a venv's python finds its packages from where it is run.
    python3.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python3.chmod(0o755)
    absent = tmp_path / "no-venv"
    out = make_test_gpu(f"VENV={absent}", env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    assert out.returncode == 0, out.stderr
    assert [line for line in out.stdout.splitlines() if line.strip()] == [SKIPPED]
    assert not absent.exists()
    # And where that python3 lacks torch, it says so rather than skipping as if there were no GPU.
    python3.write_text("#!/bin/sh\nexit 1\n")
    out = make_test_gpu(f"VENV={absent}", env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    assert out.returncode != 0 and "cannot import torch" in out.stderr and SKIPPED not in out.stdout


def test_the_gpu_tier_collects_only_when_asked(request):
    def collect(env: dict, where: str) -> str:
        cmd = [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:xdist", where]
        return subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **env}, timeout=120
        ).stdout

    asked = collect({"SPOPP_GPU_TIER": "1"}, "tests/gpu")
    for test in (
        "test_learner_gpu.py::test_the_process_group_is_nccl_on_cuda",
        "test_memory_gpu.py::test_optimizer_offload_lowers_the_peak_by_the_optimizer_states",
        "test_memory_gpu.py::test_checkpointing_lowers_the_peak_by_the_activations_it_drops",
        "test_memory_gpu.py::test_parameter_offload_lowers_the_peak_by_the_parameters",
        "test_launch_gpu.py::test_a_launched_run_learns_on_cuda",
        "test_launch_gpu.py::test_a_launched_lora_run_swaps_adapters_on_cuda",
    ):
        assert test in asked, asked[-3000:]
    # `make test` collects tests/ as a whole: the GPU tier is not in it. This session is such a
    # collection (collecting tests/ again in a child would cost half a minute of imports).
    collected = [item.nodeid for item in request.session.items]
    assert request.node.nodeid in collected
    assert not [x for x in collected if x.startswith("tests/gpu/")], collected
