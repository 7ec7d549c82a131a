"""`spopp learner plan`: will this model train on these GPUs? Per-GPU memory from config.json alone.

No weights are read: the model is built on PyTorch's meta device from its config, which gives the
exact parameter count (tied embeddings once) and the largest layer, for any architecture that
transformers knows. Then, per GPU, in bytes:

Model states. P parameters, N GPUs. bf16 training keeps bf16 weights and gradients and, per
DeepSpeed's bf16 ZeRO optimizer, fp32 gradients, master weights and AdamW's two moments of its
partition (16 bytes per parameter); fp32 training has the weights, gradients and moments alone.

    bf16    weights      gradients    fp32 grad + master + m + v
    ZeRO-1  2P           2P           16P / N
    ZeRO-2  2P           2P / N       16P / N          (DeepSpeed's estimate: 2P + 18P/N, the same)
    ZeRO-3  2P / N       2P / N       16P / N          + the layer being gathered, 4 x its params

    fp32    weights      gradients    m + v
    ZeRO-0  4P           4P           8P
    ZeRO-1  4P           4P           8P / N
    ZeRO-2  4P           4P / N       8P / N
    ZeRO-3  4P / N       4P / N       8P / N           + the layer being gathered

offload_optimizer moves the last column to CPU memory; offload_params (ZeRO-3) moves the weights
too, leaving the gathered layer on the GPU.

Activations, for a micro-batch of T tokens (micro_batch_tokens), b = 2 bytes (bf16) or 4:
what autograd keeps for backward in the Hugging Face decoder layers (Llama, Qwen2/3, Mistral:
RMSNorm in fp32, rotary attention through sdpa, a SwiGLU MLP), per token and layer

    8H + b x (4H + 2 q + 2 kv + 4I) + 4 x (2 + heads)     [+ (4 + b)(q + kv) with Qwen3's q/k norms]

(H hidden, q = heads x head_dim, kv = key-value heads x head_dim, I intermediate; each RMSNorm keeps
its input in fp32, 4H, and its normalised output and the scaled one in the model's dtype, 2bH), plus,
once, (4 + 2b)H + 40: the final norm's (4 + b)H, the copy of the hidden states that the learner's
chunked log-probs read (bH: services/learner/logprobs.py; the [T, V] logits are never kept), and
the int64 token ids, targets and indices. With gradient checkpointing a layer keeps only its input
(bH per token) and one layer's activations exist at a time while it is recomputed. Before any layer
is recomputed, the backward of the log-probs recomputes one chunk of C tokens (CHUNK_TOKENS) at a
time and holds about 16 bytes per token and vocabulary entry meanwhile (HEAD_TRANSIENT), so the
peak adds the larger of that and the layer being recomputed. The constants were measured on real
models with autograd's saved-tensor hooks (`saved_bytes`), and tests/learner/test_learner_memory_plan.py checks
the formula against that measurement on several shapes.

T is what the forward computes: the real tokens of a packed micro-batch (the learner's default),
rows x the longest row of a padded one.

With liger-kernel (services/learner/kernels.py: on CUDA, for the families it patches) the layers keep
less. What its autograd functions save, read from liger-kernel 0.8.5's source: RMSNorm keeps its
input in the model's dtype and an fp32 rstd per row (LigerRMSNormFunction: X, W, RSTD), where
transformers' keeps an fp32 copy of the input and the normalised output, so 4H less per norm (the
scaled output is the next matmul's input in both); SwiGLU keeps gate and up and recomputes SiLU in
backward (LigerSiLUMulFunction: a, b), bI less; rotary keeps cos and sin in both; Qwen3's q/k norms
keep b(q + kv) and their rstd. Per token and layer, 8H + bI less, and 4H less once (the final
norm). Below ZeRO-3 the output layer's log-probs are liger's fused linear cross-entropy, whose
backward re-runs its forward with the per-token gradient: a gradient of the states (bTH), the
weight's gradient accumulated in fp32 and cast to the model's dtype ((4 + b)VH), and about three
[C', V] tensors in the model's dtype for its own chunk C' = min(T, next power of 2 of T / ceil(V / H)),
in place of HEAD_TRANSIENT's chunks (`liger_head_transient`).

A plan fits when its total stays under the GPU's memory less a reserve (10%: the CUDA context,
NCCL's buffers, the allocator's fragmentation).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

GIB = 1 << 30
RESERVE = 0.10  # share of a GPU's memory kept for the CUDA context, NCCL and fragmentation
# Bytes per token and vocabulary entry while one chunk of the log-probs goes through backward: its
# fp32 logits (recomputed, kept by logsumexp), the gradient from gather, and logsumexp's backward,
# which forms logits - logsumexp and its exp before scaling it: four fp32 [C, V] tensors at once.
# Measured with the CPU allocator's statistics (BENCHMARKS.md, "Learner: chunked log-probs on the
# CPU"): 16.1 per token without chunking, in bf16 and in fp32; with chunks, 16-18 per chunk token,
# the rest being the output layer's weight gradient (counted with the gradients).
HEAD_TRANSIENT = 16


@dataclass(frozen=True)
class ModelShape:
    architecture: str
    model_type: str
    params: int
    largest_layer: int  # parameters of the module with the most of its own (ZeRO-3 gathers it)
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    qk_norm: bool


def read_config(path: str | Path) -> dict[str, Any]:
    """config.json of a model folder, or the file itself."""
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    if not file.is_file():
        raise FileNotFoundError(f"no config.json at {path}: give a model folder or its config.json")
    try:
        config = json.loads(file.read_text())
    except ValueError as e:
        raise ValueError(f"{file} is not JSON: {e}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ValueError(f"{file} has no model_type: not a Hugging Face model config")
    return config


def model_shape(config: dict[str, Any]) -> ModelShape:
    """The shape and exact parameter count of a causal LM config, built on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict(config)
    model_type = values.pop("model_type")
    try:
        cfg = AutoConfig.for_model(model_type, **values)
    except ValueError as e:
        raise ValueError(f"transformers does not know model_type {model_type!r}: {e}") from None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    # Tied weights are one tensor seen twice: count each parameter object once.
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    names = {n for n, _ in model.named_modules()}
    return ModelShape(
        architecture=type(model).__name__,
        model_type=model_type,
        params=params,
        largest_layer=largest,
        layers=int(text.num_hidden_layers),
        hidden=int(text.hidden_size),
        intermediate=int(text.intermediate_size),
        heads=heads,
        kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=head_dim,
        vocab=int(text.vocab_size),
        qk_norm=any(n.endswith("self_attn.q_norm") for n in names),
    )


def saved_per_token(shape: ModelShape, dtype: str = "bf16", liger: bool = False) -> tuple[float, float]:
    """(bytes autograd keeps per token per layer, bytes per token once for the whole model);
    `liger`: with liger-kernel's RMSNorm and SwiGLU (the module's docstring)."""
    b = 2 if dtype == "bf16" else 4
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    # Two RMSNorms of 4H + 2bH each, the attention's inputs and outputs, the MLP's, sdpa's logsumexp.
    layer = (
        8 * shape.hidden
        + b * (4 * shape.hidden + 2 * q + 2 * kv + 4 * shape.intermediate)
        + 4 * (2 + shape.heads)
    )
    if shape.qk_norm:
        # Qwen3's q and k norms, each an RMSNorm: its input in fp32 and its normalised output.
        layer += (4 + b) * (q + kv)
    # The final norm (4 + b)H, the log-probs' copy of the hidden states bH; the token ids, targets and
    # the chunks' indices (int64, 8 bytes each: 32), the norm's rsqrt and the log-prob (fp32: 8).
    once = (4 + 2 * b) * shape.hidden + 40
    if liger:
        # Each norm keeps its input in the model's dtype, not an fp32 copy and the normalised
        # output (4H less), SwiGLU recomputes SiLU (bI less); a q/k norm keeps b(q + kv) and an
        # fp32 rstd per head, where transformers' keeps (4 + b)(q + kv); the final norm 4H less.
        layer -= 8 * shape.hidden + b * shape.intermediate
        if shape.qk_norm:
            layer -= 4 * (q + kv) - 4 * (shape.heads + shape.kv_heads)
        once -= 4 * shape.hidden
    return layer, once


def liger_head_transient(shape: ModelShape, tokens: int, dtype: str = "bf16") -> float:
    """Bytes the backward of liger's fused linear cross-entropy holds at once (the module's
    docstring): the states' gradient, the weight's fp32 accumulator and its cast, and its chunk's
    logits, their gradient and that scaled by the per-token gradient."""
    b = 2 if dtype == "bf16" else 4
    inc = -(-shape.vocab // shape.hidden)
    chunk = min(tokens, 1 << max(0, (-(-tokens // inc) - 1).bit_length()))
    return b * tokens * shape.hidden + (4 + b) * shape.vocab * shape.hidden + 3 * b * chunk * shape.vocab


def activation_bytes(
    shape: ModelShape,
    tokens: int,
    dtype: str = "bf16",
    checkpointing: bool = False,
    chunk_tokens: int | None = None,
    liger: bool = False,
    fused_head: bool = False,
) -> dict[str, float]:
    """Activations of one micro-batch of `tokens` padded tokens: what backward keeps (`saved`)
    and the peak while backward recomputes a chunk of the log-probs or a layer (`peak`).
    `chunk_tokens`: the log-probs' chunk (default: the learner's, logprobs.CHUNK_TOKENS).
    `liger`: liger-kernel's layers; `fused_head`: its fused linear cross-entropy for the log-probs
    (the learner uses it with liger below ZeRO-3)."""
    if chunk_tokens is None:
        from .logprobs import CHUNK_TOKENS as chunk_tokens
    b = 2 if dtype == "bf16" else 4
    layer, once = saved_per_token(shape, dtype, liger)
    if fused_head:
        head = liger_head_transient(shape, tokens, dtype)
    else:
        head = HEAD_TRANSIENT * min(tokens, chunk_tokens) * shape.vocab
    if checkpointing:
        saved = tokens * (shape.layers * b * shape.hidden + once)
        # The chunks' backward is over before the last layer is recomputed: one or the other.
        transient = max(head, tokens * layer)
    else:
        saved = tokens * (shape.layers * layer + once)
        transient = head
    return {"saved": saved, "peak": saved + transient}


def state_bytes(
    shape: ModelShape,
    gpus: int,
    zero: int,
    dtype: str = "bf16",
    offload_optimizer: bool = False,
    offload_params: bool = False,
) -> dict[str, float]:
    """Per-GPU model states (weights, gradients, optimizer) and what offloading puts in CPU memory."""
    p, n = shape.params, gpus
    if dtype == "bf16":
        w, g, opt = 2.0 * p, 2.0 * p, 16.0 * p
    else:
        w, g, opt = 4.0 * p, 4.0 * p, 8.0 * p
    if zero >= 1:
        opt /= n
    if zero >= 2:
        g /= n
    gathered = 0.0
    if zero == 3:
        w /= n
        gathered = 4.0 * shape.largest_layer
    cpu = 0.0
    if offload_optimizer:
        cpu, opt = cpu + opt, 0.0
    if offload_params:
        cpu, w = cpu + w, 0.0
    return {"weights": w + gathered, "gradients": g, "optimizer": opt, "cpu": cpu}


def deepspeed_estimate(
    shape: ModelShape, gpus: int, zero: int, offload_optimizer: bool, offload_params: bool
) -> float | None:
    """DeepSpeed's own per-GPU estimate of the model states (bf16), where it has one (ZeRO 2, 3)."""
    try:
        if zero == 2:
            from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

            return float(estimate_zero2_model_states_mem_needs(shape.params, gpus, 1, offload_optimizer)[1])
        if zero == 3:
            from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

            return float(
                estimate_zero3_model_states_mem_needs(
                    shape.params, shape.largest_layer, gpus, 1, offload_optimizer, offload_params
                )[1]
            )
    except ImportError:
        return None
    return None


@dataclass(frozen=True)
class PlanRow:
    zero: int
    checkpointing: bool
    offload: str  # none | optimizer | optimizer+params
    weights: float
    gradients: float
    optimizer: float
    activations: float
    total: float
    cpu_per_node: float
    deepspeed: float | None
    fits: bool


def plan(
    shape: ModelShape,
    *,
    gpus: int,
    gpu_memory_gib: float,
    tokens: int,
    dtype: str = "bf16",
    zero: int | None = None,
    liger: bool = False,
) -> list[PlanRow]:
    """Every setting worth trying (ZeRO stage, checkpointing, offload), with its per-GPU memory;
    `liger`: with liger-kernel's kernels, as the learner applies them (kernels.py)."""
    if gpus < 1 or tokens < 1 or gpu_memory_gib <= 0:
        raise ValueError("gpus, micro-batch tokens and GPU memory must be positive")
    usable = gpu_memory_gib * GIB * (1 - RESERVE)
    stages = [zero] if zero is not None else ([1, 2, 3] if dtype == "bf16" else [0, 1, 2, 3])
    rows = []
    for z in stages:
        offloads = ["none"] + (["optimizer"] if z >= 1 else []) + (["optimizer+params"] if z == 3 else [])
        for ckpt in (False, True):
            for off in offloads:
                opt_off, par_off = off != "none", off == "optimizer+params"
                st = state_bytes(shape, gpus, z, dtype, opt_off, par_off)
                # The learner fuses the output layer with liger below ZeRO-3 only (kernels.enable).
                fused = liger and z < 3
                act = activation_bytes(shape, tokens, dtype, ckpt, liger=liger, fused_head=fused)["peak"]
                total = st["weights"] + st["gradients"] + st["optimizer"] + act
                rows.append(PlanRow(
                    zero=z, checkpointing=ckpt, offload=off, weights=st["weights"], gradients=st["gradients"],
                    optimizer=st["optimizer"], activations=act, total=total, cpu_per_node=st["cpu"] * gpus,
                    deepspeed=deepspeed_estimate(shape, gpus, z, opt_off, par_off) if dtype == "bf16" else None,
                    fits=total <= usable,
                ))  # fmt: skip
    return rows


def render(
    shape: ModelShape,
    rows: list[PlanRow],
    *,
    gpus: int,
    gpu_memory_gib: float,
    tokens: int,
    dtype: str,
    liger: bool = False,
) -> str:
    gib = lambda x: f"{x / GIB:7.1f}"  # noqa: E731
    out = [
        f"model: {shape.architecture} ({shape.model_type}), {shape.params / 1e9:.2f} B parameters "
        f"(largest layer {shape.largest_layer / 1e6:.1f} M), {shape.layers} layers, hidden {shape.hidden}, "
        f"intermediate {shape.intermediate}, heads {shape.heads}/{shape.kv_heads} kv, vocabulary {shape.vocab}",
        f"plan: {gpus} GPU(s) x {gpu_memory_gib:g} GiB ({gpu_memory_gib * (1 - RESERVE):.1f} usable), {dtype}, "
        f"micro-batches of {tokens} tokens",
        "kernels: "
        + (
            "liger-kernel's RMSNorm, SwiGLU and rotary; its fused linear cross-entropy below ZeRO-3"
            if liger
            else "transformers' own"
        ),
        "",
        "per GPU, GiB    ckpt  offload            weights  grads  optim  activ.   total   CPU/node  DeepSpeed  fits",
    ]
    for r in rows:
        ds = gib(r.deepspeed) if r.deepspeed is not None else "      -"
        out.append(
            f"  ZeRO-{r.zero}        {'on ' if r.checkpointing else 'off'}   {r.offload:17s} {gib(r.weights)}{gib(r.gradients)}"
            f"{gib(r.optimizer)}{gib(r.activations)} {gib(r.total)}  {gib(r.cpu_per_node)}    {ds}   {'yes' if r.fits else 'no'}"
        )
    fitting = [r for r in rows if r.fits]
    out.append("")
    if fitting:
        # Least machinery first: no offload, no checkpointing, the lowest stage.
        best = min(
            fitting,
            key=lambda r: (r.offload != "none", r.offload == "optimizer+params", r.checkpointing, r.zero),
        )
        out.append(
            f"fits: zero_stage {best.zero}, gradient_checkpointing {str(best.checkpointing).lower()}, "
            f"offload_optimizer {str(best.offload != 'none').lower()}, offload_params "
            f"{str(best.offload == 'optimizer+params').lower()} ({best.total / GIB:.1f} GiB per GPU)"
        )
    else:
        out.append("nothing fits: more GPUs, a smaller micro_batch_tokens, or a smaller model")
    out.append(
        "(DeepSpeed: its own estimate of the model states alone, where it has one: ZeRO 2 and 3, bf16)"
    )
    return "\n".join(out)


def as_json(shape: ModelShape, rows: list[PlanRow], **settings: Any) -> str:
    return json.dumps(
        {"model": asdict(shape), "settings": settings, "rows": [asdict(r) for r in rows]}, indent=2
    )


def saved_bytes(forward: Callable[[], Any], exclude: Any = ()) -> int:
    """Bytes of the tensors autograd keeps for backward while `forward()` runs (each storage once,
    leaving out the storages of `exclude`, e.g. the parameters): the activations measured."""
    import torch

    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    skip = {p.untyped_storage().data_ptr() for p in exclude}
    return sum(n for ptr, n in seen.items() if ptr not in skip)
