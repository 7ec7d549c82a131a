"""The GPU tier's setup: the CPU tests' helpers (tests/) and the learner's equality tests
(tests/learner/test_learner_update.py, whose references the tier reruns on CUDA) are importable from here, and what the
tier measures (peak memory against what the model's sizes predict, a launched run's rewards and
devices) is printed at the end of the run, passed or not, through the `gpu_report` fixture."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "learner"))

# test_memory_gpu.py asks for torch's deterministic kernels; cuBLAS is deterministic only with a
# fixed workspace per stream, which it reads when its first handle is made, so before any CUDA work.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

# Lines the tests add; pytest_terminal_summary prints them under their own heading.
_REPORT: list[str] = []


@pytest.fixture(scope="session")
def gpu_report() -> list[str]:
    """Append a line to have it printed in the tier's summary (pytest captures a passing test's
    own output, and these numbers are what a GPU run is for)."""
    return _REPORT


def pytest_terminal_summary(terminalreporter) -> None:
    if _REPORT:
        terminalreporter.section("GPU tier: measured")
        for line in _REPORT:
            terminalreporter.write_line(line)
