"""`make test-gpu` on a machine without a GPU: one clear line, exit 0, nothing collected; with
SPOPP_GPU_TIER=1 the tier's tests import and collect, and without it `make test` never sees them (their CUDA work is for a GPU machine)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.process
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: make test-gpu runs the tier")
def test_make_test_gpu_says_it_skips_in_one_line():
    out = subprocess.run(["make", "-s", "test-gpu"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    assert lines[-1] == "make test-gpu: skipped, no CUDA GPU here (torch.cuda.is_available() is False)"


def test_the_gpu_tier_collects_only_when_asked():
    def collect(env: dict, where: str) -> str:
        cmd = [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:xdist", where]
        return subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **env}, timeout=120
        ).stdout

    asked = collect({"SPOPP_GPU_TIER": "1"}, "tests/gpu")
    assert "test_learner_gpu.py::test_the_process_group_is_nccl_on_cuda" in asked
    assert "test_memory_settings_on_cuda_keep_the_update_and_lower_the_peak" in asked
    # `make test` collects tests/ as a whole: the GPU tier is not in it.
    plain = collect({"SPOPP_GPU_TIER": "0"}, "tests")
    assert "test_learner_gpu.py" not in plain and "test_gpu_tier.py" in plain
