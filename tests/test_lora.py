"""LoRA in the learner: PEFT adapters on a frozen base under DeepSpeed ZeRO 1-3, against a plain
PEFT loop in PyTorch (the reference of tests/test_learner_update.py on a PEFT model), and the
merged snapshot the replicas load.

The adapters' B starts at zero, so the first mini-batch moves B only; the second step sees a
nonzero B and moves both (two mini-batches here, so both are compared).
"""

from __future__ import annotations

import pytest
import torch
from learner_worker import run_task
from test_learner_update import (
    _cfg,
    _dist_env,
    batch,
    check_against_reference,
    peft_model,
    reference_update,
    rel_err,
)

pytestmark = pytest.mark.process

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"], "seed": 0}
SETTINGS = {
    "lora_rank": LORA["rank"], "lora_alpha": LORA["alpha"], "lora_target_modules": LORA["target_modules"],
}  # fmt: skip

# The batch and the restored process-group environment are test_learner_update's fixtures.
__all__ = ["_dist_env", "batch"]


@pytest.fixture(scope="module")
def initial(tiny_model):
    """The adapters as the learner and the reference both start them."""
    from transformers import AutoModelForCausalLM

    model = peft_model(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), LORA)
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def reference(tiny_model, batch):
    trajs, adv = batch
    return reference_update(tiny_model, trajs, adv, _cfg(1, 2, 2), lora=LORA)


def test_the_reference_trains_adapters_only(reference, initial):
    names = set(reference["state"])
    assert names == set(initial) and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert len(names) == 2 * 3 * 2  # A and B of 3 modules in each of 2 layers
    # B starts at zero and is what the first step moves; A moves from the second step on.
    b_names = [n for n in names if ".lora_B." in n]
    assert all(float(initial[n].abs().max()) == 0.0 for n in b_names)
    assert all(
        float(reference["grads"][0][n.replace("lora_B", "lora_A")].abs().max()) == 0.0 for n in b_names
    )
    assert all(float(reference["grads"][1][n.replace("lora_B", "lora_A")].abs().max()) > 0.0 for n in b_names)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_lora_under_zero_matches_a_plain_peft_loop(tiny_model, batch, reference, initial, stage):
    trajs, adv = batch
    result = run_task(tiny_model, trajs, adv, {"cfg": {**_cfg(stage, 2, 2), **SETTINGS}, "grads": True})
    assert result["trainable"] == sorted(initial)
    # The optimizer holds the adapters alone (ZeRO's flat partition may pad a little).
    adapters = sum(v.numel() for v in initial.values())
    assert adapters <= result["optimizer_elements"] <= adapters + 64
    state = {n: result["state"][n] for n in initial}
    check_against_reference({**result, "state": state}, reference, initial)


def test_the_snapshot_is_the_merged_model(tiny_model, batch, tmp_path):
    """A published LoRA snapshot is a plain Hugging Face folder whose log-probs are the trained
    PEFT model's, and its base weights outside the adapted modules are the base's."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from services.learner.logprobs import token_logprobs

    trajs, adv = batch
    task = {"cfg": {**_cfg(2, 2, 2), **SETTINGS}, "publish": {"root": str(tmp_path), "version": 1, "keep": 2}}
    result = run_task(tiny_model, trajs, adv, task)
    folder = tmp_path / "v000001"
    merged = load_file(folder / "model.safetensors")
    base = load_file(tiny_model / "model.safetensors")
    assert set(merged) == set(base)  # the base's own names, no adapter left
    assert torch.equal(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    assert (
        rel_err(
            merged["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"]
        )
        > 0
    )
    assert torch.equal(
        merged["model.layers.0.self_attn.k_proj.weight"], base["model.layers.0.self_attn.k_proj.weight"]
    )

    # The trained PEFT model, rebuilt from the learner's state, against the snapshot.
    peft = peft_model(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), LORA).eval()
    peft.load_state_dict(result["state"])
    plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([trajs[0].token_ids])
    with torch.no_grad():
        want = token_logprobs(peft, ids, torch.ones_like(ids))
        got = token_logprobs(plain, ids, torch.ones_like(ids))
    assert float((got - want).abs().max()) < 1e-5


def test_bad_lora_settings_are_refused(tiny_model):
    from services.learner.config import LearnerSettings
    from services.learner.engine import build_engine

    with pytest.raises(ValueError, match="lora_rank"):
        LearnerSettings(run="r", model=tiny_model, lora_rank=-1)
    with pytest.raises(ValueError, match="lora_target_modules"):
        LearnerSettings(run="r", model=tiny_model, lora_rank=4, lora_target_modules=[])
    cfg = LearnerSettings(run="r", model=tiny_model, lora_rank=4, lora_target_modules=["no_such_proj"])
    with pytest.raises(ValueError, match=r"lora_target_modules \['no_such_proj'\]"):
        build_engine(cfg)
