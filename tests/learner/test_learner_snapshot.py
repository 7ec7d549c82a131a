"""publish_snapshot: folder layout, manifest, atomicity, pruning, re-publish, and that engines load it.

The learner here is an in-process ZeRO-1 engine after one update (a world of one); ZeRO-3 is
published once in process and once from two ranks under torchrun. A snapshot is good when an
ordinary from_pretrained loads it without missing or unexpected keys and when both rollout
engines, after load_weights, sample with the learner's own log-probs (token_logprobs on the
learner's module): the tokens they return must score, under the learner, what they reported.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
from pathlib import Path

import pytest
import torch
from learner_worker import dist_env_restored, launch, make_batch, run_task
from safetensors.torch import load_file

from runtime.engines.base import SamplingConfig
from tools.tiny_model import sample_chat

pytestmark = pytest.mark.process  # starts processes: the process tier (tests/conftest.py)

CFG = {
    "zero_stage": 1,
    "batch_size": 8,
    "mini_batches": 2,
    "micro_batch_size": 2,
    "lr": 1e-3,
    "weight_decay": 0.1,
    "grad_clip": 1.0,
}
# Absolute log-prob tolerance per engine (as in test_engines: vLLM's CPU kernels differ more).
LOGPROB_TOL = {"transformers": 1e-4, "vllm": 1e-3}
AUX = {
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
}

_dist_env = pytest.fixture(scope="module", autouse=True)(dist_env_restored)


@pytest.fixture(scope="module")
def batch(tiny_model):
    return make_batch(tiny_model, n=8, seed=1)


@pytest.fixture(scope="module")
def learner(tiny_model, batch):
    """(ZeRO-1 engine after one update, its config) in this process."""
    from services.config.learner import LearnerSettings
    from services.learner.backend import DeepSpeedBackend
    from services.learner.deepspeed_engine import build_engine, release_engine
    from services.learner.update import run_update

    cfg = LearnerSettings(run="test", model=tiny_model, **CFG)
    engine, _ = build_engine(cfg)
    run_update(DeepSpeedBackend(engine), *batch, cfg)
    yield engine
    release_engine(engine)


def learner_weights(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def publish(engine, tiny_model, root, version, keep=3):
    from services.learner.snapshot import publish_snapshot

    return publish_snapshot(engine, tiny_model, root, version, keep=keep)


@pytest.fixture(scope="module")
def snapshot(learner, tiny_model, tmp_path_factory) -> Path:
    return publish(learner, tiny_model, tmp_path_factory.mktemp("snapshots"), 1)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_layout_manifest_and_weights(snapshot, learner, tiny_model):
    assert snapshot.name == "v000001"
    assert [p.name for p in snapshot.parent.iterdir()] == ["v000001"]  # no .tmp left behind
    files = {p.name for p in snapshot.iterdir()}
    assert files == AUX | {"model.safetensors", "manifest.json"}
    for name in AUX:
        assert (snapshot / name).read_bytes() == (tiny_model / name).read_bytes()
    manifest = json.loads((snapshot / "manifest.json").read_text())
    assert manifest["version"] == 1
    assert manifest["base_model"] == str(Path(tiny_model).resolve())
    assert manifest["created_at"]
    weights = snapshot / "model.safetensors"
    assert manifest["files"] == {
        "model.safetensors": {"sha256": sha256(weights), "bytes": weights.stat().st_size}
    }
    # The learner's weights exactly, the tied lm_head stored once (under the embedding's name).
    saved, expected = load_file(weights), learner_weights(learner)
    assert set(saved) == set(expected) and "lm_head.weight" not in saved
    for name, t in expected.items():
        assert torch.equal(saved[name], t), name
    # ... and they are the updated weights, not the base model's.
    base = load_file(tiny_model / "model.safetensors")
    assert not torch.equal(base["model.embed_tokens.weight"], saved["model.embed_tokens.weight"])


def test_loads_as_an_ordinary_hf_model(snapshot, learner, batch):
    from transformers import AutoModelForCausalLM

    from services.learner.batch import collate
    from services.learner.logprobs import token_logprobs

    model, info = AutoModelForCausalLM.from_pretrained(
        snapshot, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    b = collate(*batch)
    with torch.no_grad():
        want = token_logprobs(learner.module, b.input_ids, b.attention_mask)
        got = token_logprobs(model.eval(), b.input_ids, b.attention_mask)
    assert torch.equal(got[b.loss_mask], want[b.loss_mask])


def test_keep_newest_and_clean_leftovers(learner, tiny_model, tmp_path):
    # What a crash leaves: a half-written publish and a half-deleted old snapshot.
    (tmp_path / "v000009.tmp").mkdir()
    (tmp_path / "v000009.tmp" / "model.safetensors").write_bytes(b"partial")
    (tmp_path / "v000000.del").mkdir()
    (tmp_path / "unrelated.txt").write_text("kept")
    for version in (3, 4, 5, 6):
        path = publish(learner, tiny_model, tmp_path, version, keep=2)
        assert path == tmp_path / f"v{version:06d}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["unrelated.txt", "v000005", "v000006"]


def test_republish_same_weights_is_idempotent_other_weights_refused(learner, tiny_model, tmp_path):
    first = publish(learner, tiny_model, tmp_path, 7)
    manifest = (first / "manifest.json").read_text()
    (tmp_path / "v000007.tmp").mkdir()  # the crashed attempt's leftovers
    assert publish(learner, tiny_model, tmp_path, 7) == first
    assert (first / "manifest.json").read_text() == manifest  # the existing folder is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000007"]

    param = learner.module.model.norm.weight
    saved = param.detach().clone()
    try:
        with torch.no_grad():
            param.add_(1e-3)
        with pytest.raises(FileExistsError, match="other weights"):
            publish(learner, tiny_model, tmp_path, 7)
    finally:
        with torch.no_grad():
            param.copy_(saved)
    assert (first / "manifest.json").read_text() == manifest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000007"]


def test_zero3_single_process_publish(learner, tiny_model, batch, tmp_path):
    """ZeRO-3 gathers partitioned weights; the same update as the ZeRO-1 learner's."""
    result = run_task(
        tiny_model,
        *batch,
        {"cfg": {**CFG, "zero_stage": 3}, "publish": {"root": str(tmp_path), "version": 2, "keep": 1}},
    )
    folder = Path(result["published"])
    assert folder == tmp_path / "v000002" and sorted(p.name for p in tmp_path.iterdir()) == ["v000002"]
    check_zero3_snapshot(folder, result["state"], learner)


def learner_base(learner) -> str:
    return learner.module.config._name_or_path


def check_zero3_snapshot(folder: Path, gathered: dict, learner) -> None:
    from transformers import AutoModelForCausalLM

    saved = load_file(folder / "model.safetensors")
    base = load_file(Path(learner_base(learner)) / "model.safetensors")
    assert set(saved) == set(dict(learner.module.named_parameters()))
    for name, t in saved.items():
        assert torch.equal(t, gathered[name]), name
        # The same update as the ZeRO-1 learner's: the changes agree (up to Adam's amplification
        # of fp32 noise in gradients of size ~eps, see test_learner_update), base != updated.
        want = learner.module.get_parameter(name).detach() - base[name]
        assert float((t - base[name] - want).norm() / want.norm()) < 1e-3, name
    _, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))


def test_zero3_two_process_publish(learner, tiny_model, batch, tmp_path):
    trajs, adv = batch
    root = tmp_path / "snapshots"
    job = {
        "model": str(tiny_model),
        "trajectories": [t.model_dump() for t in trajs],
        "advantages": adv,
        "tasks": [
            {
                "name": "z3",
                "cfg": {**CFG, "zero_stage": 3},
                "publish": {"root": str(root), "version": 11, "keep": 2},
            }
        ],
    }
    rank0, rank1 = (r["z3"] for r in launch(job, tmp_path / "run", nproc=2))
    assert rank0["published"] == str(root / "v000011") and rank1["published"] is None
    assert sorted(p.name for p in root.iterdir()) == ["v000011"]
    check_zero3_snapshot(root / "v000011", rank0["state"], learner)


# -- rollout engines load the snapshot and sample with the learner's log-probs ---------------------


@pytest.fixture(scope="module")
def runner():
    with asyncio.Runner() as r:
        yield r


@pytest.fixture(scope="module")
def prompts(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    rng = random.Random(3)
    chats = [sample_chat(rng) for _ in range(4)]
    texts = [tok.apply_chat_template(c[:-3], add_generation_prompt=True, tokenize=False) for c in chats]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def learner_logprobs(learner, prompt: list[int], generated: list[int]) -> torch.Tensor:
    from services.learner.logprobs import token_logprobs

    ids = torch.tensor([list(prompt) + list(generated)])
    with torch.no_grad():
        lp = token_logprobs(learner.module, ids, torch.ones_like(ids))[0]
    return lp[len(prompt) - 1 :]


def base_logprobs(tiny_model, prompt, generated) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from services.learner.logprobs import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    ids = torch.tensor([list(prompt) + list(generated)])
    with torch.no_grad():
        return token_logprobs(model, ids, torch.ones_like(ids))[0][len(prompt) - 1 :]


def check_engine(kind, engine, runner, snapshot, learner, tiny_model, prompts) -> None:
    runner.run(engine.load_weights(snapshot))

    async def sample():
        configs = [SamplingConfig(max_tokens=24, temperature=1.0, seed=10 + i) for i in range(len(prompts))]
        return await asyncio.gather(*(engine.generate(p, c) for p, c in zip(prompts, configs, strict=True)))

    gens = runner.run(sample())
    tol = LOGPROB_TOL[kind]
    moved = 0.0
    for prompt, gen in zip(prompts, gens, strict=True):
        assert gen.token_ids and len(gen.logprobs) == len(gen.token_ids)
        want = learner_logprobs(learner, prompt, gen.token_ids)
        got = torch.tensor(gen.logprobs)
        assert float((got - want).abs().max()) <= tol
        moved = max(moved, float((base_logprobs(tiny_model, prompt, gen.token_ids) - want).abs().max()))
    # The update moved these log-probs well beyond the tolerance, so the engine really swapped.
    assert moved > 10 * tol


def test_transformers_engine_loads_snapshot(snapshot, learner, tiny_model, prompts, runner):
    from runtime.engines.hf import TransformersEngine

    engine = TransformersEngine(tiny_model)
    try:
        check_engine("transformers", engine, runner, snapshot, learner, tiny_model, prompts)
    finally:
        runner.run(engine.close())


def test_vllm_engine_loads_snapshot(snapshot, learner, tiny_model, prompts, runner):
    from runtime.engines.vllm import VllmEngine

    async def start():
        return VllmEngine(tiny_model, max_model_len=1024, kv_cache_gib=1, seed=0)

    engine = runner.run(start())
    try:
        check_engine("vllm", engine, runner, snapshot, learner, tiny_model, prompts)
    finally:
        runner.run(engine.close())
