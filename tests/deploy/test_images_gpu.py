"""`make images-gpu` (deploy/images_gpu.py): what it requires of a GPU image, judged on the record of
the images it built here (docs/results/images-gpu.json, written by `make images-gpu`)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "docs" / "results" / "images-gpu.json"


def images_gpu():
    sys.path.insert(0, str(ROOT / "deploy"))
    try:
        spec = importlib.util.spec_from_file_location("images_gpu", ROOT / "deploy" / "images_gpu.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "deploy"))


def test_a_gpu_runs_the_newest_cubin_of_its_major_at_or_below_its_minor():
    m = images_gpu()
    archs = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]  # PyPI's torch 2.13.0 (CUDA 13.0)
    assert {name: m.runs_on(archs, cc) for name, cc in m.NEEDED_GPUS.items()} == {
        "Ampere": "sm_80", "Ada": "sm_86", "Hopper": "sm_90"
    }  # fmt: skip
    assert m.runs_on(["sm_75", "sm_90"], (8, 0)) is None  # no Ampere code: Turing's does not run there
    assert m.runs_on(["sm_90a"], (9, 0)) == "sm_90a"


def test_what_a_gpu_image_lacks_is_named():
    m = images_gpu()
    good = {"python": "3.12.3", "torch": "2.13.0+cu130", "cuda": "13.0", "archs": ["sm_80", "sm_86", "sm_90"],
            "missing_libs": ["libcuda.so.1"], "vllm": "0.32.0"}  # fmt: skip
    assert m.problems("rollout", good) == []  # the driver's library comes from the node
    bad = {**good, "python": "3.11.2", "cuda": None, "archs": ["sm_75"], "missing_libs": ["libcudart.so.13"],
           "vllm": "import failed: ImportError: x"}  # fmt: skip
    why = " | ".join(m.problems("rollout", bad))
    for part in (
        "Python 3.11.2",
        "not a CUDA build",
        "Ampere, Ada, Hopper",
        "libcudart.so.13",
        "vllm: import failed",
    ):
        assert part in why, why
    assert m.problems("tracker", {"python": "3.12.3", "torch": "2.13.0"}) == ["the tracker image has torch"]


def test_the_images_built_here_passed_their_checks():
    record = json.loads(RECORD.read_text())
    m = images_gpu()
    assert set(record["images"]) == {"tracker", "learner", "rollout"}
    for target, found in record["images"].items():
        assert m.problems(target, found) == [], target
    assert record["images"]["rollout"]["cuda"] == record["images"]["learner"]["cuda"] == "13.0"
    assert "libcudart.so.13" in record["images"]["rollout"]["cuda_libs"]
