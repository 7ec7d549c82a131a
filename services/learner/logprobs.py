"""Per-token log-probabilities of a sequence under a causal LM: log p(token_{t+1} | tokens_{<=t}).

The softmax runs in float32 whatever the model's dtype: a bf16 log-softmax over a large vocabulary
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
# at Gemma's 256k), and a chunk's backward holds about four such tensors (services/learner/plan.py,
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
    attention_mask: Tensor,
    *,
    chunk_tokens: int = CHUNK_TOKENS,
) -> Tensor:
    """[n, T-1] float32: column t is log p(input_ids[:, t+1] | input_ids[:, :t+1]).

    `model` is a Hugging Face causal LM, a PEFT model of one, or a DeepSpeed engine holding either
    (`.module`); gradients flow when called outside no_grad. Columns whose target is padding
    (attention_mask 0) are 0: mask them.
    """
    if input_ids.ndim != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids and attention_mask must both be [n, T], got {tuple(input_ids.shape)} "
            f"and {tuple(attention_mask.shape)}"
        )
    if input_ids.shape[1] < 2:
        raise ValueError("need at least 2 tokens per row to predict one")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    head = _output_layer(model)
    if head is None or head in _UNCHUNKABLE:
        return _unchunked(model, input_ids, attention_mask)
    n, t = input_ids.shape
    # Only positions whose target is real get vocabulary-sized work. Their indices are found here,
    # before the forward: nonzero() waits for the device, and here nothing of this pass is queued.
    pos = (attention_mask[:, 1:] != 0).nonzero()
    where = _Positions(
        src=pos[:, 0] * t + pos[:, 1],  # the hidden state that predicts it, in [n * T]
        dst=pos[:, 0] * (t - 1) + pos[:, 1],  # its column in the [n, T-1] answer
        targets=input_ids.reshape(-1).index_select(0, pos[:, 0] * t + pos[:, 1] + 1),
        shape=(n, t),
    )
    with _head_computes_logprobs(head, where, chunk_tokens) as produced:
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    logits = out.logits
    if produced and logits.shape == produced[0].shape and logits.data_ptr() == produced[0].data_ptr():
        return logits
    # The forward changed what its output layer returned: this model's logits are not lm_head's.
    _UNCHUNKABLE.add(head)
    return _unchunked(model, input_ids, attention_mask)


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
    head: torch.nn.Module, where: _Positions, chunk_tokens: int
) -> Iterator[list[Tensor]]:
    """While open, `head(hidden)` answers the [n, T-1] log-probs of the targets instead of logits
    (its hooks, ZeRO-3's among them, still run around the call); the list it yields receives what
    it answered, so the caller can check that the model passed it through unchanged."""
    own = head.__dict__.get("forward")  # an instance-level forward (accelerate's hooks set one)
    layer = head.forward  # the layer's own computation, without its module hooks
    produced: list[Tensor] = []

    def forward(hidden: Tensor) -> Tensor:
        if tuple(hidden.shape[:2]) != where.shape:
            raise ValueError(
                f"the output layer got hidden states {tuple(hidden.shape)}, not {where.shape} x H"
            )
        out = _chunked(layer, hidden, where, chunk_tokens)
        produced.append(out)
        return out

    head.forward = forward
    try:
        yield produced
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own


def _chunked(layer: Callable[[Tensor], Tensor], hidden: Tensor, where: _Positions, chunk: int) -> Tensor:
    """The log-probs from `hidden` [n, T, H], `chunk` tokens at a time: [n, T-1], 0 where the
    target is padding."""
    n, t = where.shape
    # One copy of the hidden states that predict a real token ([tokens, H], the model's dtype):
    # what the chunks read, and with gradients what their checkpoints hold for the recomputation.
    states = hidden.reshape(n * t, hidden.shape[-1]).index_select(0, where.src)
    parts = []
    for s in range(0, where.src.numel(), chunk):
        args = (layer, states[s : s + chunk], where.targets[s : s + chunk])
        if torch.is_grad_enabled():
            # The output layer draws no random numbers: nothing to stash for the recomputation.
            parts.append(checkpoint(_logprobs, *args, use_reentrant=False, preserve_rng_state=False))
        else:
            parts.append(_logprobs(*args))
    flat = torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)
    return flat.new_zeros(n * (t - 1)).index_copy(0, where.dst, flat).view(n, t - 1)


def _logprobs(layer: Callable[[Tensor], Tensor], states: Tensor, targets: Tensor) -> Tensor:
    logits = layer(states).float()
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _unchunked(model: Callable[..., object], input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """The whole [n, T-1, V] logits at once: for models whose forward post-processes its logits."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    # The last position predicts past the end; dropping it before the cast saves [n, V] floats.
    logits = out.logits[:, :-1, :].float()
    targets = input_ids[:, 1:].unsqueeze(-1)
    logp = logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    # Padded targets answer 0, as on the chunked path.
    return logp.masked_fill(attention_mask[:, 1:] == 0, 0.0)
