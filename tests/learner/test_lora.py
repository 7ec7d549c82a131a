"""LoRA in the learner: PEFT adapters on a frozen base under DeepSpeed ZeRO 1-3, against a plain
PEFT loop in PyTorch (the reference of tests/learner/test_learner_update.py on a PEFT model), and the
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
    bounded_reference,
    check_against_reference,
    peft_model,
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
    return bounded_reference(tiny_model, trajs, adv, _cfg(1, 2, 2), lora=LORA)


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


def test_lora_packed_and_padded_agree(tiny_model, batch, reference, initial):
    """LoRA on packed rows (the default, the test above) and on padded rows: the same update."""
    from test_learner_update import agree

    trajs, adv = batch
    cfg = {**_cfg(2, 2, 2), **SETTINGS}
    packed = run_task(tiny_model, trajs, adv, {"cfg": cfg, "grads": True})
    padded = run_task(tiny_model, trajs, adv, {"cfg": {**cfg, "packing": False}, "grads": True})
    check_against_reference({**padded, "state": {n: padded["state"][n] for n in initial}}, reference, initial)
    agree(packed, padded, reference)
    assert packed["stats"]["padding_fraction"] == 0.0 < padded["stats"]["padding_fraction"]


def test_a_merged_snapshot_is_a_plain_model(tiny_model, batch, tmp_path):
    """With lora_publish: merged, a LoRA snapshot is a plain Hugging Face folder whose log-probs
    are the trained PEFT model's, and its base weights outside the adapted modules are the base's."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from services.learner.logprobs import token_logprobs

    trajs, adv = batch
    publish = {"root": str(tmp_path), "version": 1, "keep": 2, "lora": "merged"}
    task = {"cfg": {**_cfg(2, 2, 2), **SETTINGS}, "publish": publish}
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


def _logprobs(model, ids):
    from services.learner.logprobs import token_logprobs

    with torch.no_grad():
        return token_logprobs(model, ids, torch.ones_like(ids))


def test_an_adapter_snapshot_is_peft_layout_and_merges_to_the_same_model(tiny_model, batch, tmp_path):
    """By default (ZeRO 3 here: only the adapters are gathered) a LoRA snapshot holds the adapters
    alone in PEFT's layout: PEFT loads it on the base and gives the trained model's log-probs, and
    `spopp lora merge` turns it into a plain folder with the same log-probs."""
    import json

    from click.testing import CliRunner
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from services.cli import build
    from spopp.files.snapshots import read_manifest

    trajs, adv = batch
    task = {"cfg": {**_cfg(3, 2, 2), **SETTINGS}, "publish": {"root": str(tmp_path), "version": 1, "keep": 2}}
    result = run_task(tiny_model, trajs, adv, task)
    folder = tmp_path / "v000001"
    assert sorted(p.name for p in folder.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "manifest.json",
    ]  # fmt: skip
    manifest = read_manifest(folder)
    assert manifest.lora == {"rank": 4, "alpha": 8.0, "target_modules": ["down_proj", "q_proj", "v_proj"]}
    assert manifest.base_model == str(tiny_model.resolve()) and list(manifest.files) == [
        "adapter_model.safetensors"
    ]
    saved = load_file(folder / "adapter_model.safetensors")
    assert len(saved) == 12 and sum(t.numel() for t in saved.values()) == 6656
    assert all(k.startswith("base_model.model.") and ".default." not in k for k in saved)
    assert json.loads((folder / "adapter_config.json").read_text())["r"] == 4
    full = (tiny_model / "model.safetensors").stat().st_size
    assert (folder / "adapter_model.safetensors").stat().st_size * 20 < full

    trained = peft_model(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), LORA).eval()
    trained.load_state_dict(result["state"])
    loaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), folder
    )
    ids = torch.tensor([trajs[0].token_ids])
    want = _logprobs(trained, ids)
    assert float((_logprobs(loaded.eval(), ids) - want).abs().max()) < 1e-6

    out = tmp_path / "merged"
    r = CliRunner().invoke(build(), ["lora", "merge", str(folder), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert str(out) in r.output
    plain = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert float((_logprobs(plain, ids) - want).abs().max()) < 1e-5
    # A second merge into the same folder, a folder without an adapter, a base that is not one.
    again = CliRunner().invoke(build(), ["lora", "merge", str(folder), "--out", str(out)])
    assert again.exit_code != 0 and "exists" in again.output
    not_adapter = CliRunner().invoke(
        build(), ["lora", "merge", str(tiny_model), "--out", str(tmp_path / "x")]
    )
    assert not_adapter.exit_code != 0 and "not a LoRA adapter" in not_adapter.output
    no_base = CliRunner().invoke(
        build(), ["lora", "merge", str(folder), "--out", str(tmp_path / "y"), "--base", str(tmp_path)]
    )
    assert no_base.exit_code != 0 and "no config.json" in no_base.output
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_bad_lora_settings_are_refused(tiny_model):
    from services.config.learner import LearnerSettings
    from services.learner.deepspeed_engine import build_engine

    with pytest.raises(ValueError, match="lora_rank"):
        LearnerSettings(run="r", model=tiny_model, lora_rank=-1)
    with pytest.raises(ValueError, match="lora_target_modules"):
        LearnerSettings(run="r", model=tiny_model, lora_rank=4, lora_target_modules=[])
    cfg = LearnerSettings(run="r", model=tiny_model, lora_rank=4, lora_target_modules=["no_such_proj"])
    with pytest.raises(ValueError, match=r"lora_target_modules \['no_such_proj'\]"):
        build_engine(cfg)
