"""Per-token log-probabilities of a sequence under a causal LM: log p(token_{t+1} | tokens_{<=t}),
for padded rows (an attention mask) or a packed row (position ids restarting at 0 per sequence:
services/learner/batch.py), and beside them, where asked, each position's entropy.

The softmax runs in float32 at least whatever the model's dtype: a bf16 log-softmax over a large vocabulary
loses about three significant digits, and these values feed exp(logp - old_logp), where an error
of 1e-2 already moves the ratio by a percent and can flip a clip decision. The log-prob is formed
as logit - logsumexp(logits).

Chunked over tokens. The [tokens, V] float32 logits are the largest tensor of the whole pass: at
16k tokens and Qwen's 152k vocabulary, 10 GB, and autograd kept them for backward with their
gradient beside them. Here they never exist whole: the model's output layer is asked, for the
duration of one call, for the log-probs of the targets instead of logits, and computes them
`chunk_tokens` tokens at a time (lm_head -> float -> gather - logsumexp). With gradients enabled
each chunk runs under torch.utils.checkpoint, so autograd keeps only the chunk's hidden states and
backward recomputes its logits: at most one chunk's logits, with their gradient, exist at once.

Why through the output layer rather than calling the decoder body and lm_head ourselves: the model's
own forward stays in charge, so every wrapper's bookkeeping still runs. DeepSpeed 0.19's
engine.forward registers the hooks on the outputs that start its backward (the ZeRO optimizer's
backward prologue and accumulation boundary: runtime/engine.py, register_output_backward_hooks;
engine.backward does not run that prologue itself), and ZeRO-3 gathers the output layer's
weight (tied or not) once in its pre-forward hook and keeps it through every chunk, and again in
its backward hooks around the recomputation. PEFT's forward and Hugging Face's are unchanged.

On CUDA, where liger-kernel applies (services/learner/kernels.py), the output layer's log-probs
come from its fused linear cross-entropy instead of the chunks: the same function, its own chunks,
no logits kept, the gradient formed in its backward.

A model whose forward transforms the logits after its output layer (Gemma's soft-capping,
Cohere's and Granite's scaling) would turn the log-probs into something else; such a model is
detected by the output not sharing the layer's result (wrappers' hooks return aliases of it:
ZeRO-3's `detach()`) and goes the unchunked way from then on.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

# Tokens per chunk. Its fp32 logits are 4 x 512 x 151,936 B = 311 MB at Qwen's vocabulary (524 MB
# at Gemma's 256k), and a chunk's backward holds about four such tensors (services/learner/memory_plan.py,
# HEAD_TRANSIENT: 1.2 GB), small beside the activations of a 16k-token micro-batch (tens of GB at
# 1.5 B parameters), while a [512, hidden] x [hidden, V] matmul is still large enough to keep a
# GPU's tensor cores busy. The price: backward recomputes each chunk's output-layer matmul, one more
# forward of that layer (about 4% of the FLOPs of an update at Qwen2-1.5B's shape, 7% at 0.5B's).
CHUNK_TOKENS = 512

# Output layers of models that post-process their logits: they take the unchunked path.
_UNCHUNKABLE: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def token_logprobs(
    model: Callable[..., object],
    input_ids: Tensor,
    attention_mask: Tensor | None,
    *,
    position_ids: Tensor | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
) -> Tensor:
    """[n, T-1] float32: column t is log p(input_ids[:, t+1] | the tokens of its sequence up to t).

    `model` is a Hugging Face causal LM, a PEFT model of one, or a DeepSpeed engine holding either
    (`.module`); gradients flow when called outside no_grad. Padded rows give `attention_mask`;
    a packed row gives `position_ids` restarting at 0 per sequence and no mask (batch.collate).
    Columns whose target is padding or a sequence's first token are 0: mask them.
    """
    return _run(model, input_ids, attention_mask, position_ids, chunk_tokens, entropy=False)[0]


def token_logprobs_entropy(
    model: Callable[..., object],
    input_ids: Tensor,
    attention_mask: Tensor | None,
    *,
    position_ids: Tensor | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
) -> tuple[Tensor, Tensor]:
    """token_logprobs and, beside it, [n, T-1] float32 the entropy of each position's next-token
    distribution (nats), from the same chunks of logits. Without gradients only: it is a statistic
    (the learner reports it from the pass before an update's first step)."""
    if torch.is_grad_enabled():
        raise RuntimeError("token_logprobs_entropy is a statistic: call it under torch.no_grad()")
    logp, entropy = _run(model, input_ids, attention_mask, position_ids, chunk_tokens, entropy=True)
    assert entropy is not None
    return logp, entropy


def _run(
    model: Callable[..., object],
    input_ids: Tensor,
    attention_mask: Tensor | None,
    position_ids: Tensor | None,
    chunk_tokens: int,
    *,
    entropy: bool,
) -> tuple[Tensor, Tensor | None]:
    layout = attention_mask if attention_mask is not None else position_ids
    if layout is None:
        raise ValueError("give attention_mask (padded rows) or position_ids (a packed row)")
    if input_ids.ndim != 2 or input_ids.shape != layout.shape:
        raise ValueError(
            f"input_ids and {'attention_mask' if attention_mask is not None else 'position_ids'} must "
            f"both be [n, T], got {tuple(input_ids.shape)} and {tuple(layout.shape)}"
        )
    if input_ids.shape[1] < 2:
        raise ValueError("need at least 2 tokens per row to predict one")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    scored = _scored(input_ids, attention_mask, position_ids)
    head = _output_layer(model)
    if head is None or head in _UNCHUNKABLE:
        return _unchunked(model, inputs, scored, entropy)
    n, t = input_ids.shape
    # Only positions whose target is scored get vocabulary-sized work. Their indices are found
    # here, before the forward: nonzero() waits for the device, and here nothing of this pass is queued.
    pos = scored.nonzero()
    where = _Positions(
        src=pos[:, 0] * t + pos[:, 1],  # the hidden state that predicts it, in [n * T]
        dst=pos[:, 0] * (t - 1) + pos[:, 1],  # its column in the [n, T-1] answer
        targets=input_ids.reshape(-1).index_select(0, pos[:, 0] * t + pos[:, 1] + 1),
        shape=(n, t),
    )
    fused = _fused_head(head, input_ids.device)
    with _head_computes_logprobs(head, where, chunk_tokens, entropy, fused) as produced:
        # use_cache=False also matters for packed rows: with a cache, transformers does not look
        # for sequence starts in position_ids and the sequences would attend to each other.
        out = model(**inputs, use_cache=False)
    logits = out.logits
    if produced and logits.shape == produced[0].shape and logits.data_ptr() == produced[0].data_ptr():
        return logits, (produced[1] if entropy else None)
    # The forward changed what its output layer returned: this model's logits are not lm_head's.
    _UNCHUNKABLE.add(head)
    return _unchunked(model, inputs, scored, entropy)


class _Positions(NamedTuple):
    src: Tensor
    dst: Tensor
    targets: Tensor
    shape: tuple[int, int]


def _output_layer(model: object) -> torch.nn.Module | None:
    """The module that maps the last hidden states to logits, or None where there is none to find."""
    inner = getattr(model, "module", None)  # DeepSpeed's engine (and DDP) hold the model as .module
    if isinstance(inner, torch.nn.Module):
        model = inner
    get = getattr(model, "get_output_embeddings", None)  # PEFT models forward this to the base model
    head = get() if callable(get) else None
    return head if isinstance(head, torch.nn.Module) else None


@contextmanager
def _head_computes_logprobs(
    head: torch.nn.Module,
    where: _Positions,
    chunk_tokens: int,
    entropy: bool,
    fused: Callable[[Tensor, Tensor], Tensor] | None,
) -> Iterator[list[Tensor]]:
    """While open, `head(hidden)` answers the [n, T-1] log-probs of the targets instead of logits
    (its hooks, ZeRO-3's among them, still run around the call); the list it yields receives what
    it answered (and the entropy, where asked), so the caller can check that the model passed it
    through unchanged."""
    own = head.__dict__.get("forward")  # an instance-level forward (accelerate's hooks set one)
    layer = head.forward  # the layer's own computation, without its module hooks
    produced: list[Tensor] = []

    def forward(hidden: Tensor) -> Tensor:
        if tuple(hidden.shape[:2]) != where.shape:
            raise ValueError(
                f"the output layer got hidden states {tuple(hidden.shape)}, not {where.shape} x H"
            )
        if fused is not None:
            # The same kernel in the old-log-probs pass as in training: ratio 1 at the first step.
            out = _scatter(_select(hidden, where), where, fused)
            ent = _chunked(layer, hidden, where, chunk_tokens, True)[1] if entropy else None
        else:
            out, ent = _chunked(layer, hidden, where, chunk_tokens, entropy)
        produced.append(out)
        if entropy:
            produced.append(ent)
        return out

    head.forward = forward
    try:
        yield produced
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own


def _select(hidden: Tensor, where: _Positions) -> Tensor:
    """One copy of the hidden states that predict a scored token ([tokens, H], the model's dtype):
    what the chunks read, and with gradients what their checkpoints hold for the recomputation."""
    n, t = where.shape
    return hidden.reshape(n * t, hidden.shape[-1]).index_select(0, where.src)


def _scatter(
    flat: Tensor, where: _Positions, compute: Callable[[Tensor, Tensor], Tensor] | None = None
) -> Tensor:
    """[n, T-1] with the scored columns filled from `flat` (or from compute(flat, targets))."""
    n, t = where.shape
    if compute is not None:
        flat = compute(flat, where.targets)
    return flat.new_zeros(n * (t - 1)).index_copy(0, where.dst, flat).view(n, t - 1)


def _chunked(
    layer: Callable[[Tensor], Tensor], hidden: Tensor, where: _Positions, chunk: int, entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """The log-probs (and the entropy, where asked) from `hidden` [n, T, H], `chunk` tokens at a
    time: [n, T-1], 0 where the target is not scored."""
    states = _select(hidden, where)
    parts, ents = [], []
    for s in range(0, where.src.numel(), chunk):
        args = (layer, states[s : s + chunk], where.targets[s : s + chunk])
        if entropy:
            lp, ent = _logprobs_entropy(*args)
            parts.append(lp)
            ents.append(ent)
        elif torch.is_grad_enabled():
            # The output layer draws no random numbers: nothing to stash for the recomputation.
            parts.append(checkpoint(_logprobs, *args, use_reentrant=False, preserve_rng_state=False))
        else:
            parts.append(_logprobs(*args))
    empty = _upcast(hidden.new_zeros(0))
    logp = _scatter(torch.cat(parts) if parts else empty, where)
    return logp, (_scatter(torch.cat(ents) if ents else empty, where) if entropy else None)


def _upcast(logits: Tensor) -> Tensor:
    """Logits in float32 at least (a float64 model, the tests' truth, keeps its precision)."""
    return logits if logits.dtype == torch.float64 else logits.float()


def _target_logp(logits: Tensor, targets: Tensor) -> Tensor:
    """log p of the targets, as logit - logsumexp: ONE formula for every path, so that the old
    log-probs and the training pass's agree to the bit on the same weights (ratio 1)."""
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _logprobs(layer: Callable[[Tensor], Tensor], states: Tensor, targets: Tensor) -> Tensor:
    return _target_logp(_upcast(layer(states)), targets)


def _logprobs_entropy(
    layer: Callable[[Tensor], Tensor], states: Tensor, targets: Tensor
) -> tuple[Tensor, Tensor]:
    return _from_logits(_upcast(layer(states)), targets)


def _from_logits(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """(log p of the targets, entropy) of float32 logits [..., V]."""
    lse = torch.logsumexp(logits, dim=-1)
    p = torch.exp(logits - lse.unsqueeze(-1))
    return _target_logp(logits, targets), lse - (p * logits).sum(-1)


def _fused_head(head: torch.nn.Module, device: torch.device) -> Callable[[Tensor, Tensor], Tensor] | None:
    """Liger's fused linear cross-entropy for `head` where it applies (services/learner/kernels.py):
    the chosen tokens' log-probs straight from the hidden states, no logits kept."""
    from .kernels import fused_logprobs

    return fused_logprobs(head, device)


def whole_vocabulary_logprobs(
    model: Callable[..., object],
    input_ids: Tensor,
    attention_mask: Tensor | None,
    *,
    position_ids: Tensor | None = None,
) -> Tensor:
    """token_logprobs computed from the whole [n, T-1, V] logits at once: the path of models whose
    forward post-processes its logits, and the reference the chunked and fused paths are held to."""
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    return _unchunked(model, inputs, _scored(input_ids, attention_mask, position_ids), entropy=False)[0]


def _scored(input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None) -> Tensor:
    """[n, T-1] bool: the targets that are scored, those real and not the first of their sequence."""
    if attention_mask is not None:
        scored = attention_mask[:, 1:] != 0
    else:
        scored = torch.ones_like(input_ids[:, 1:], dtype=torch.bool)
    if position_ids is not None:
        scored = scored & (position_ids[:, 1:] != 0)
    return scored


def _unchunked(
    model: Callable[..., object], inputs: dict[str, Tensor | None], scored: Tensor, entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """The whole [n, T-1, V] logits at once: for models whose forward post-processes its logits."""
    out = model(**inputs, use_cache=False)
    # The last position predicts past the end; dropping it before the cast saves [n, V] floats.
    logits = _upcast(out.logits[:, :-1, :])
    targets = inputs["input_ids"][:, 1:]
    if entropy:
        logp, ent = _from_logits(logits, targets)
        return logp.masked_fill(~scored, 0.0), ent.masked_fill(~scored, 0.0)
    logp = _target_logp(logits, targets)
    # Unscored targets answer 0, as on the chunked path.
    return logp.masked_fill(~scored, 0.0), None
