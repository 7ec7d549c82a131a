"""Adapter swaps in the replicas' engines: a LoRA snapshot (PEFT's layout, as the learner publishes
it) loads beside the base, which stays loaded, and the next version replaces it in place; and the
folder `spopp lora merge` writes loads in every engine as the same model.

Every engine's log-probs after a swap are checked against a float64 forward pass of the base with
the adapter merged by hand (W + alpha / r B A), to the tolerance the full-weight swap meets in
tests/runtime/test_engines.py; then against a second version; then bad input, which changes nothing.
"""

# ruff: noqa: F811  (test_engines' fixtures, imported, are the tests' arguments)

from __future__ import annotations

import json
import shutil

import pytest
import torch

# The tests' prompts and event loop are test_engines' fixtures.
from test_engines import LOGPROB_TOL, check_against_reference, prompts, run_all, runner, transformers_engine  # noqa: F401  (fixtures)

from runtime.engines.base import SamplingConfig
from runtime.engines.factory import make_engine
from tools.tiny_model import random_adapter

TARGETS = ["q_proj", "v_proj", "down_proj"]
RANK, ALPHA = 4, 8.0


def make_adapter(base, folder, seed: int, targets=TARGETS, rank=RANK):
    """A trained-looking adapter (tools.tiny_model.random_adapter) and the manifest a learner would
    write beside it."""
    random_adapter(base, folder, seed=seed, rank=rank, alpha=ALPHA, targets=targets, scale=0.2)
    manifest = {
        "version": seed,
        "step": seed,
        "base_model": str(base),
        "lora": {"rank": rank, "alpha": ALPHA},
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def merged_reference(base, adapter):
    """float64 transformers model of `base` with `adapter` merged by hand."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64).eval()
    tensors = load_file(adapter / "adapter_model.safetensors")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key in tensors:
            if ".lora_A." in key:
                stem = key[len("base_model.model.") : -len(".lora_A.weight")]
                a, b = tensors[key].double(), tensors[key.replace("lora_A", "lora_B")].double()
                params[f"{stem}.weight"] += (ALPHA / RANK) * (b @ a)
    return model


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    v1 = make_adapter(tiny_model, root / "v000001", seed=1)
    v2 = make_adapter(tiny_model, root / "v000002", seed=2)
    return {1: (v1, merged_reference(tiny_model, v1)), 2: (v2, merged_reference(tiny_model, v2))}


# Each engine built for this module: swaps change its weights for good.
@pytest.fixture(scope="module")
def lora_engine(request, tiny_model, runner):  # noqa: F811
    kind = request.param

    async def start():
        if kind == "vllm":
            return make_engine("vllm", tiny_model, max_model_len=1024, kv_cache_gib=1, seed=0, lora_rank=RANK)
        return make_engine("transformers", tiny_model, process=kind == "process", lora_rank=RANK)

    engine = runner.run(start())
    yield kind, engine
    runner.run(engine.close())


ENGINES = ["transformers", *(pytest.param(k, marks=pytest.mark.process) for k in ("process", "vllm"))]


@pytest.mark.parametrize("lora_engine", ENGINES, indirect=True)
def test_adapter_swaps_match_the_merged_model_and_keep_the_base(
    lora_engine,
    runner,
    prompts,
    adapters,
    reference,
    tiny_model,
    tmp_path,  # noqa: F811
):
    kind, engine = lora_engine
    temperatures = [0.0, 1.0] * 3
    requests = [p for p in prompts[:3] for _ in range(2)]
    configs = [SamplingConfig(max_tokens=32, temperature=t, seed=5) for t in temperatures]
    before = run_all(runner, engine, requests, configs)
    for g, p, t in zip(before, requests, temperatures, strict=True):
        check_against_reference(g, p, reference(tiny_model), t, LOGPROB_TOL[kind])
    # `spopp lora merge`'s folder is a plain model: loaded as full weights, it is the adapted model.
    from spopp.files.adapters import merge_adapter_folder

    merged = merge_adapter_folder(adapters[1][0], tmp_path / "merged", tiny_model)
    runner.run(engine.load_weights(merged))
    for g, p, t in zip(run_all(runner, engine, requests, configs), requests, temperatures, strict=True):
        check_against_reference(g, p, adapters[1][1], t, LOGPROB_TOL[kind])
    runner.run(engine.load_weights(tiny_model))
    base_q = None
    if kind == "transformers":
        base_q = engine.model.model.layers[0].self_attn.q_proj.weight.detach().clone()
        model_object = engine.model
    seen = []
    for version in (1, 2):
        folder, ref = adapters[version]
        runner.run(engine.load_weights(folder))
        after = run_all(runner, engine, requests, configs)
        for g, p, t in zip(after, requests, temperatures, strict=True):
            check_against_reference(g, p, ref, t, LOGPROB_TOL[kind])
        seen.append([g.logprobs for g in after])
    assert seen[0] != seen[1] != [g.logprobs for g in before]
    if kind == "transformers":
        # In place: the same model object, its base weights untouched, PEFT's layers added.
        assert engine.model is model_object
        layer = engine.model.model.layers[0].self_attn.q_proj
        assert torch.equal(layer.base_layer.weight, base_q)
    # An adapter over the engine's rank (vLLM sized its buffers for it) or of another layout: refused,
    # and the engine keeps version 2.
    bigger = make_adapter(tiny_model, tmp_path / "rank8", seed=3, rank=8)
    with pytest.raises(
        ValueError, match="over this engine's lora_rank" if kind == "vllm" else "the engine holds"
    ):
        runner.run(engine.load_weights(bigger))
    # (Compared with the reference, not with the earlier log-probs: a batch made up otherwise may
    # differ in the last float bits.)
    for g, p, t in zip(run_all(runner, engine, requests, configs), requests, temperatures, strict=True):
        check_against_reference(g, p, adapters[2][1], t, LOGPROB_TOL[kind])


def test_bad_adapters_are_refused_and_change_nothing(tiny_model, runner, prompts, adapters, tmp_path):  # noqa: F811
    engine = make_engine("transformers", tiny_model)
    try:
        runner.run(engine.load_weights(adapters[1][0]))
        want = runner.run(engine.generate(prompts[0], SamplingConfig(max_tokens=24, temperature=0.0)))

        other_rank = make_adapter(tiny_model, tmp_path / "rank8", seed=3, rank=8)
        other_targets = make_adapter(tiny_model, tmp_path / "targets", seed=3, targets=["k_proj"])
        no_weights = tmp_path / "no-weights"
        shutil.copytree(adapters[2][0], no_weights)
        (no_weights / "adapter_model.safetensors").unlink()
        bad_json = tmp_path / "bad-json"
        shutil.copytree(adapters[2][0], bad_json)
        (bad_json / "adapter_config.json").write_text("{not json")
        wrong_shape = tmp_path / "wrong-shape"
        shutil.copytree(adapters[2][0], wrong_shape)
        cfg = json.loads((wrong_shape / "adapter_config.json").read_text())
        (wrong_shape / "adapter_config.json").write_text(json.dumps({**cfg, "r": 2}))
        cases = [
            (other_rank, "the engine holds"),  # a different layout than the adapter loaded
            (other_targets, "the engine holds"),
            (no_weights, "no adapter_model.safetensors"),
            (bad_json, "not JSON"),
            (tiny_model, "holds full weights but this engine runs LoRA adapters"),
        ]
        for folder, message in cases:
            with pytest.raises(ValueError, match=message):
                runner.run(engine.load_weights(folder))
        got = runner.run(engine.generate(prompts[0], SamplingConfig(max_tokens=24, temperature=0.0)))
        assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
    finally:
        runner.run(engine.close())
    # Before any adapter: one whose shapes do not fit its rank is refused before PEFT is injected.
    fresh = make_engine("transformers", tiny_model)
    try:
        with pytest.raises(ValueError, match="does not fit the model"):
            runner.run(fresh.load_weights(wrong_shape))
        assert not any("lora_" in n for n, _ in fresh.model.named_parameters())
    finally:
        runner.run(fresh.close())
    with pytest.raises(ValueError, match="lora_rank must be >= 0"):
        make_engine("transformers", tiny_model, lora_rank=-1)
