"""Session fixtures: `tiny_model`, the folder of tools.tiny_model's model, built once per session;
`perturbed_model`, a copy with perturbed weights; `reference`, float64 models of model folders.

With SPOPP_TEST_CACHE set, the folder is kept there across sessions, under a key that changes
when the builder's source or the transformers version does.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest

import tools.tiny_model


def _cache_key() -> str:
    import transformers

    src = Path(tools.tiny_model.__file__).read_bytes()
    return hashlib.sha256(src + transformers.__version__.encode()).hexdigest()[:16]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    cache = os.environ.get("SPOPP_TEST_CACHE")
    if not cache:
        return tools.tiny_model.build_tiny_model(tmp_path_factory.mktemp("tiny-model") / "model")
    target = Path(cache) / f"tiny-model-{_cache_key()}"
    if not target.is_dir():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build aside and rename, so a concurrent or interrupted session never sees half a folder.
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".building-"))
        try:
            tools.tiny_model.build_tiny_model(staging / "model")
            try:
                (staging / "model").rename(target)
            except OSError:
                if not target.is_dir():  # lost a race to an equal folder otherwise
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


@pytest.fixture(scope="session")
def perturbed_model(tiny_model, tmp_path_factory):
    return tools.tiny_model.perturb_weights(
        tiny_model, tmp_path_factory.mktemp("perturbed") / "model", scale=0.05, seed=1
    )


@pytest.fixture(scope="session")
def reference(tiny_model):
    """model folder -> float64 transformers model of its weights (loaded once)."""
    import torch
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(folder):
        if folder not in cache:
            cache[folder] = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
        return cache[folder]

    return get


@pytest.fixture(scope="session")
def model_limits(tiny_model):
    """The learner's intake limits read from the tiny model (SPO++), and the model's config."""
    from transformers import AutoModelForCausalLM

    from services.learner.ingest import IntakeLimits

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    return IntakeLimits.for_model(model, "spopp"), model.config
