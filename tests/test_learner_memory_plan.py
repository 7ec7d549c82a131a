"""`spopp learner plan`: parameter counts from config.json alone, model states against DeepSpeed's
own estimators, activations against what autograd really keeps on real models, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from services.learner import memory_plan

QWEN2_7B = Path(__file__).parent / "data" / "qwen2-7b-config.json"


def _qwen2_7b_by_hand() -> int:
    h, i, v, layers, kv = 3584, 18944, 152064, 28, 4 * 128
    attention = h * h + h + 2 * (h * kv + kv) + h * h  # q (with bias), k and v (with bias), o
    layer = attention + 3 * h * i + 2 * h  # gate, up, down; two RMSNorms
    return 2 * v * h + layers * layer + h  # embeddings and lm_head (untied), final norm


@pytest.fixture(scope="module")
def qwen2_7b():
    return memory_plan.model_shape(memory_plan.read_config(QWEN2_7B))


def test_a_7b_qwen2_is_counted_exactly_without_weights(qwen2_7b):
    assert qwen2_7b.params == _qwen2_7b_by_hand()
    assert 7.6e9 < qwen2_7b.params < 7.63e9  # the published 7.62 B
    assert qwen2_7b.largest_layer == 152064 * 3584  # the embedding (or lm_head): ZeRO-3 gathers it whole
    assert (qwen2_7b.layers, qwen2_7b.heads, qwen2_7b.kv_heads, qwen2_7b.head_dim) == (28, 28, 4, 128)
    assert not qwen2_7b.qk_norm


def test_the_cli_answers_for_a_7b_qwen2():
    runner = CliRunner()
    from services.learner.cli import group as main

    out = runner.invoke(main, ["plan", "--model", str(QWEN2_7B), "--gpus", "8"])
    assert out.exit_code == 0, out.output
    assert "7.62 B parameters" in out.output
    # ZeRO-1: 2P + 2P + 16P/8 = 42.6 GiB of states, and 4096 tokens of activations (25.3 GiB, the
    # log-probs chunked, so no [4096, V] logits) stay under the 72 GiB usable.
    assert "fits: zero_stage 1, gradient_checkpointing false" in out.output
    # One 16 GiB GPU (14.4 usable): even with the weights and the optimizer offloaded and
    # checkpointing, the bf16 gradients (2P = 14.2 GiB) and the gathered layer (2.0 GiB) do not fit.
    out = runner.invoke(main, ["plan", "--model", str(QWEN2_7B), "--gpus", "1", "--gpu-memory", "16"])
    assert out.exit_code == 0 and "nothing fits" in out.output
    out = runner.invoke(main, ["plan", "--model", str(QWEN2_7B), "--gpus", "2", "--zero", "3", "--json"])
    rows = json.loads(out.output)["rows"]
    assert {r["zero"] for r in rows} == {3} and len(rows) == 6
    # Checkpointing only lowers activations; offload only moves states to the CPU.
    by = {(r["checkpointing"], r["offload"]): r for r in rows}
    assert by[(True, "none")]["activations"] < by[(False, "none")]["activations"] / 3
    assert by[(False, "optimizer")]["optimizer"] == 0 and by[(False, "optimizer")]["cpu_per_node"] > 0


@pytest.mark.parametrize("gpus", [1, 8, 64])
def test_model_states_agree_with_deepspeeds_estimators(qwen2_7b, gpus):
    z2 = memory_plan.state_bytes(qwen2_7b, gpus, 2)
    assert sum(z2[k] for k in ("weights", "gradients", "optimizer")) == pytest.approx(
        memory_plan.deepspeed_estimate(qwen2_7b, gpus, 2, False, False), rel=1e-9
    )
    # ZeRO-3: DeepSpeed counts 18 bytes per partitioned parameter where we count 20 (it leaves out
    # the bf16 weights' own partition); within 12%.
    # With the optimizer offloaded, DeepSpeed keeps the bf16 weights on the GPU, as we do.
    z2off = memory_plan.state_bytes(qwen2_7b, gpus, 2, "bf16", True)
    assert (
        z2off["weights"] == memory_plan.deepspeed_estimate(qwen2_7b, gpus, 2, True, False)
        and z2off["optimizer"] == 0
    )
    z3 = memory_plan.state_bytes(qwen2_7b, gpus, 3)
    assert sum(z3[k] for k in ("weights", "gradients", "optimizer")) == pytest.approx(
        memory_plan.deepspeed_estimate(qwen2_7b, gpus, 3, False, False), rel=0.12
    )
    z3off = memory_plan.state_bytes(qwen2_7b, gpus, 3, "bf16", True, True)
    assert z3off["weights"] == memory_plan.deepspeed_estimate(
        qwen2_7b, gpus, 3, True, True
    )  # the gathered layer


SHAPES = [
    {"model_type": "qwen2"},
    {"model_type": "qwen2", "num_hidden_layers": 4, "intermediate_size": 512},
    {"model_type": "llama", "head_dim": 64, "num_key_value_heads": 1},
    {"model_type": "qwen3", "head_dim": 32, "hidden_size": 256},
    {"model_type": "mistral", "vocab_size": 1200},
]


def _small(values: dict) -> dict:
    base = {
        "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "vocab_size": 400, "max_position_embeddings": 1024,
    }  # fmt: skip
    return {**base, **values}


@pytest.mark.parametrize("values", SHAPES, ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()))
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_activations_match_what_autograd_keeps(values, dtype, checkpointing):
    """The formula against the bytes autograd keeps for backward in a real forward (the learner's
    own log-prob function), per token: within 10%."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from services.learner.logprobs import token_logprobs

    config = _small(values)
    shape = memory_plan.model_shape(config)
    cfg = AutoConfig.for_model(**config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        cfg, attn_implementation="sdpa", dtype=torch.bfloat16 if dtype == "bf16" else torch.float32
    )
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(1, 300, (2, 96))

    def forward():
        token_logprobs(model, ids, torch.ones_like(ids)).sum()

    measured = memory_plan.saved_bytes(forward, exclude=list(model.parameters()))
    predicted = memory_plan.activation_bytes(shape, ids.numel(), dtype, checkpointing)["saved"]
    assert predicted == pytest.approx(measured, rel=0.10)


@pytest.mark.parametrize(
    "content,message",
    [
        (None, "no config.json"),
        ("{not json", "is not JSON"),
        ('{"hidden_size": 8}', "has no model_type"),
        ('{"model_type": "no-such-model"}', "does not know model_type"),
    ],
)
def test_bad_configs_get_clear_errors(tmp_path, content, message):
    from services.learner.cli import group as main

    target = tmp_path / "m"
    if content is not None:
        target.mkdir()
        (target / "config.json").write_text(content)
    out = CliRunner().invoke(main, ["plan", "--model", str(target), "--gpus", "1"])
    assert out.exit_code != 0 and message in out.output
    out = CliRunner().invoke(main, ["plan", "--model", str(QWEN2_7B), "--gpus", "1", "--zero", "0"])
    assert out.exit_code != 0 and "ZeRO 0 with bf16" in out.output
