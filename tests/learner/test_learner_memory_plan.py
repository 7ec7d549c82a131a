"""`spopp learner plan`: parameter counts from config.json alone, model states against DeepSpeed's
own estimators, activations against what autograd really keeps on real models, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from services.learner import memory_plan

QWEN2_7B = Path(__file__).resolve().parents[1] / "data" / "qwen2-7b-config.json"


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

    out = runner.invoke(main, ["plan", "--model", str(QWEN2_7B), "--gpus", "8", "--liger", "off"])
    assert out.exit_code == 0, out.output
    assert "7.62 B parameters" in out.output and "kernels: transformers' own" in out.output
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


def test_the_cli_plans_for_liger_where_the_learner_would_use_it(tmp_path):
    from services.learner.cli import group as main

    def rows(*extra):
        out = CliRunner().invoke(main, ["plan", "--model", str(QWEN2_7B), "--gpus", "8", "--json", *extra])
        assert out.exit_code == 0, out.output
        got = json.loads(out.output)
        return got["settings"]["liger"], {
            (r["zero"], r["checkpointing"], r["offload"]): r for r in got["rows"]
        }

    # auto: Qwen2 is a family liger patches, so the plan is liger's, as `on` is.
    (auto, on), (off, plain) = rows(), rows("--liger", "off")
    assert auto is True and off is False and rows("--liger", "on")[1] == on
    shape = memory_plan.model_shape(memory_plan.read_config(QWEN2_7B))
    layers = shape.layers * (8 * shape.hidden + 2 * shape.intermediate) + 4 * shape.hidden  # bf16: b = 2
    head = memory_plan.HEAD_TRANSIENT * 512 * shape.vocab
    for key, r in plain.items():
        assert on[key]["weights"] == r["weights"] and on[key]["optimizer"] == r["optimizer"]
        zero, ckpt, _ = key
        if not ckpt:
            # No checkpointing: the layers keep 8H + bI less per token, and below ZeRO-3 the head's
            # transient is liger's fused cross-entropy's in place of the chunks'.
            fused = memory_plan.liger_head_transient(shape, 4096) - head if zero < 3 else 0
            assert r["activations"] - on[key]["activations"] == pytest.approx(4096 * layers - fused)
    out = CliRunner().invoke(main, ["plan", "--model", str(QWEN2_7B), "--gpus", "8"])
    assert "kernels: liger-kernel's RMSNorm, SwiGLU and rotary" in out.output
    # A family the learner does not patch: auto plans without liger; on is refused, saying why.
    (tmp_path / "config.json").write_text(json.dumps(_small({"model_type": "stablelm"})))
    out = CliRunner().invoke(main, ["plan", "--model", str(tmp_path), "--gpus", "1"])
    assert out.exit_code == 0 and "kernels: transformers' own" in out.output, out.output
    out = CliRunner().invoke(main, ["plan", "--model", str(tmp_path), "--gpus", "1", "--liger", "on"])
    assert out.exit_code != 0 and "no patch for model_type 'stablelm'" in out.output


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


class _RMSNormKeeps(torch.autograd.Function):
    """An RMSNorm that saves what liger-kernel 0.8.5's LigerRMSNormFunction saves for backward
    (read from its source): the input in its own dtype, the weight, and an fp32 rstd per row. The
    kernel is Triton (CUDA only); this stand-in lets the plan's liger figures be checked here,
    and the GPU tier checks them against the kernel itself."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        rstd = torch.rsqrt(x.float().pow(2).mean(-1) + eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.eps = eps
        return (x.float() * rstd[..., None]).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, dy):
        x, weight, _ = ctx.saved_tensors
        with torch.enable_grad():
            x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
            xf = x.float()
            y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + ctx.eps)).to(x.dtype) * weight
            dx, dw = torch.autograd.grad(y, (x, weight), dy)
        return dx, dw, None


class _SiLUMulKeeps(torch.autograd.Function):
    """SiLU(gate) x up, saving what LigerSiLUMulFunction saves: gate and up (SiLU is recomputed)."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return torch.nn.functional.silu(gate) * up

    @staticmethod
    def backward(ctx, dc):
        gate, up = ctx.saved_tensors
        with torch.enable_grad():
            gate, up = gate.detach().requires_grad_(), up.detach().requires_grad_()
            return torch.autograd.grad(torch.nn.functional.silu(gate) * up, (gate, up), dc)


def _liger_standins(model) -> None:
    """Every RMSNorm and SwiGLU of `model` as liger patches them (its rotary keeps cos and sin
    only, as transformers' does: left as it is)."""
    base = model.get_decoder()
    norms = [base.norm]
    for layer in base.layers:
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [
            m
            for m in (getattr(layer.self_attn, "q_norm", None), getattr(layer.self_attn, "k_norm", None))
            if m
        ]
        mlp = layer.mlp
        mlp.forward = lambda x, mlp=mlp: mlp.down_proj(_SiLUMulKeeps.apply(mlp.gate_proj(x), mlp.up_proj(x)))
    for norm in norms:
        eps = getattr(norm, "variance_epsilon", None) or norm.eps
        norm.forward = lambda x, norm=norm, eps=eps: _RMSNormKeeps.apply(x, norm.weight, eps)


@pytest.mark.parametrize("values", SHAPES, ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()))
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_liger_activations_match_what_its_kernels_keep(values, dtype):
    """The plan's liger figures against autograd's saved bytes with stand-ins that save what
    liger's functions save, within 10% as above; and the saving against transformers' kernels
    is the one the formula derives (8H + bI per layer, 4H once)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from services.learner.logprobs import token_logprobs

    config = _small(values)
    shape = memory_plan.model_shape(config)
    ids = torch.randint(1, 300, (2, 96))
    measured = {}
    for liger in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(**config), attn_implementation="sdpa",
            dtype=torch.bfloat16 if dtype == "bf16" else torch.float32,
        )  # fmt: skip
        model.train()
        if liger:
            _liger_standins(model)
        measured[liger] = memory_plan.saved_bytes(
            lambda model=model: token_logprobs(model, ids, torch.ones_like(ids)).sum(),
            exclude=list(model.parameters()),
        )
    predicted = memory_plan.activation_bytes(shape, ids.numel(), dtype, liger=True)["saved"]
    assert predicted == pytest.approx(measured[True], rel=0.10)
    saving = memory_plan.activation_bytes(shape, ids.numel(), dtype)["saved"] - predicted
    assert saving > 0
    # The saving is exact arithmetic but for the q/k norms' rstd (4 bytes a head), which the figure for
    # transformers' kernels leaves out: under 1% of it on these shapes.
    assert measured[False] - measured[True] == pytest.approx(saving, rel=0.01)


def test_the_stand_ins_compute_what_transformers_modules_do():
    """The stand-ins change what is saved, not the function: log-probs and gradients equal."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from services.learner.logprobs import token_logprobs

    config = _small({"model_type": "qwen3", "head_dim": 32})
    ids = torch.randint(1, 300, (2, 24))
    out = []
    for liger in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float64)
        if liger:
            _liger_standins(model)
        logp = token_logprobs(model, ids, torch.ones_like(ids))
        logp.sum().backward()
        out.append((logp.detach(), [p.grad for p in model.parameters()]))
    # float64 on both sides: the two orders of the same operations differ by a few units of 1e-16.
    torch.testing.assert_close(out[0][0], out[1][0], rtol=1e-12, atol=1e-12)
    for a, b in zip(out[0][1], out[1][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_liger_head_transient_follows_its_chunking():
    """liger's chunk is the power of 2 at or above T / ceil(V / H), never above T; Qwen2-1.5B's
    shape (H 1536, V 151,936: ceil(V / H) = 99) at 16,384 tokens: 16384 / 99 = 165.5 -> 256."""
    shape = memory_plan.model_shape(
        {"model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960, "num_attention_heads": 12,
         "num_key_value_heads": 2, "num_hidden_layers": 28, "vocab_size": 151936}
    )  # fmt: skip
    h, v = 1536, 151936
    assert memory_plan.liger_head_transient(shape, 16384) == 2 * 16384 * h + 6 * v * h + 3 * 2 * 256 * v
    assert memory_plan.liger_head_transient(shape, 50) == 2 * 50 * h + 6 * v * h + 3 * 2 * 1 * v
    assert (
        memory_plan.liger_head_transient(shape, 99 * 64, "fp32")
        == 4 * 99 * 64 * h + 8 * v * h + 3 * 4 * 64 * v
    )


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
