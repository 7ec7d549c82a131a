"""The learner on a real pretrained model: SmolLM2-135M-Instruct (imported by `spopp model import`),
cut to its first 2 layers so that an update takes seconds. Its own weights, BPE vocabulary of 49,152
with tied embeddings, grouped-query attention (9 heads, 3 key/value heads), and its tokenizer.

One update under ZeRO 1 and 2, and with LoRA adapters, against the plain-PyTorch reference of
tests/learner/test_learner_update.py, bounded by the fp32 noise of the same computation measured in the same
run (that module's docstring): nothing here is a tolerance of its own. `spopp learner plan` answers
for the whole model from its config.json alone.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from learner_worker import make_batch, run_task
from test_learner_update import _cfg, _dist_env, agree, bounded_reference, check_against_reference, peft_model

pytestmark = pytest.mark.process  # the model's first import runs pip (tests/fixtures_model.py)

__all__ = ["_dist_env"]  # the restored process-group environment, test_learner_update's fixture

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"], "seed": 0}
LORA_SETTINGS = {"lora_rank": 4, "lora_alpha": 8.0, "lora_target_modules": LORA["target_modules"]}


# Trajectories are cut to this many tokens: the cost of every pass here is the 49,152-way output
# layer per token, and 64 keeps 8 to 45 action tokens in each of the 8 (the update's paths are the
# same at any length).
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def batch(smollm2_truncated):
    # Chats tokenized by SmolLM2's own tokenizer, rollout log-probs from its own forward pass.
    trajs, adv = make_batch(smollm2_truncated, n=8, seed=0)
    cut = [
        t.model_copy(update={
            "token_ids": t.token_ids[:MAX_TOKENS], "action_mask": t.action_mask[:MAX_TOKENS],
            "rollout_logprobs": t.rollout_logprobs[:MAX_TOKENS],
        })
        for t in trajs
    ]  # fmt: skip
    assert all(sum(t.action_mask) >= 8 for t in cut)
    return cut, adv


@pytest.fixture(scope="module")
def initial(smollm2_truncated):
    from safetensors.torch import load_file

    return load_file(smollm2_truncated / "model.safetensors")


@pytest.fixture(scope="module")
def reference(smollm2_truncated, batch):
    trajs, adv = batch
    return bounded_reference(smollm2_truncated, trajs, adv, _cfg(1, 2, 2))


def test_the_cut_model_is_smollm2s_own_first_layers(smollm2, smollm2_truncated, initial, batch):
    from safetensors import safe_open

    config = json.loads((smollm2_truncated / "config.json").read_text())
    assert (config["num_hidden_layers"], config["vocab_size"], config["tie_word_embeddings"]) == (
        2,
        49152,
        True,
    )
    with safe_open(smollm2 / "model.safetensors", "pt") as full:
        for name in ("model.embed_tokens.weight", "model.layers.1.self_attn.k_proj.weight"):
            assert torch.equal(full.get_tensor(name), initial[name])
    trajs, _ = batch
    # The batch uses the real vocabulary, far above the tiny model's 400 ids.
    assert max(max(t.token_ids) for t in trajs) > 1000


@pytest.mark.parametrize("stage", [1, 2])
def test_one_update_under_zero_matches_the_reference(smollm2_truncated, batch, reference, initial, stage):
    trajs, adv = batch
    result = run_task(smollm2_truncated, trajs, adv, {"cfg": _cfg(stage, 2, 2), "grads": True})
    check_against_reference(result, reference, initial)


def test_packed_and_padded_agree_on_smollm2(smollm2_truncated, batch, reference, initial):
    """Packed rows (the default: the test above) and padded rows give SmolLM2 the same update,
    through its real grouped-query attention and tied 49,152-way output layer."""
    trajs, adv = batch
    cfg = {**_cfg(3, 2, 2), "packing": False}
    packed = run_task(smollm2_truncated, trajs, adv, {"cfg": {**cfg, "packing": True}, "grads": True})
    padded = run_task(smollm2_truncated, trajs, adv, {"cfg": cfg, "grads": True})
    check_against_reference(padded, reference, initial)
    agree(packed, padded, reference)


def test_lora_matches_a_plain_peft_loop(smollm2_truncated, batch):
    from transformers import AutoModelForCausalLM

    trajs, adv = batch
    model = peft_model(AutoModelForCausalLM.from_pretrained(smollm2_truncated, dtype=torch.float32), LORA)
    initial = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    ref = bounded_reference(smollm2_truncated, trajs, adv, _cfg(1, 2, 2), lora=LORA)
    result = run_task(
        smollm2_truncated, trajs, adv, {"cfg": {**_cfg(2, 2, 2), **LORA_SETTINGS}, "grads": True}
    )
    assert result["trainable"] == sorted(initial)
    check_against_reference({**result, "state": {n: result["state"][n] for n in initial}}, ref, initial)


def test_the_plan_answers_for_smollm2(smollm2):
    from services.learner.cli import group as main

    runner = CliRunner()
    out = runner.invoke(
        main, ["plan", "--model", str(smollm2), "--gpus", "1", "--gpu-memory", "24", "--json"]
    )
    assert out.exit_code == 0, out.output
    plan = json.loads(out.output)
    manifest = json.loads((smollm2 / "spopp_import.json").read_text())
    # Counted from config.json alone, tied embeddings once: the parameters the import counted.
    assert plan["model"]["params"] == manifest["parameters"] == 134_515_008
    assert any(row["fits"] for row in plan["rows"])
    text = runner.invoke(main, ["plan", "--model", str(smollm2), "--gpus", "1"])
    assert text.exit_code == 0 and "fits: zero_stage" in text.output
