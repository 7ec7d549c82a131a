"""Attention over packed rows: each sequence attends to itself only, at the cost of its own length.

A packed micro-batch is one row of several sequences whose `position_ids` restart at 0 at each
sequence start (services/learner/batch.py). transformers 5 recognises that layout when the model
is called with `attention_mask=None` and `use_cache=False`, and keeps the sequences apart with a
block-diagonal causal mask: correct, but for `sdpa` and `eager` the mask is dense, so attention
still costs (row length)^2, not the sum of each sequence's length^2. On a CPU that is comparable
to the row's matmuls at a few thousand tokens (BENCHMARKS.md, "Learner: packed micro-batches").

`PACKED_SDPA` is registered with transformers as an attention implementation of its own. Given a
packed row it cuts the queries, keys and values at the sequence starts and runs causal attention
per sequence (varlen): `torch.nn.attention.varlen.varlen_attn` on CUDA where this torch has it,
else one `scaled_dot_product_attention(is_causal=True)` per sequence (what runs on a CPU). Its
mask function builds no mask for a row without padding. Given anything else (a padded batch with
its attention mask: the reference path, or evaluation), it is transformers' own sdpa, unchanged.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch
from torch import Tensor

# The name the learner loads its model with where the setting says sdpa (engine.load_model).
PACKED_SDPA = "spopp_packed_sdpa"

_registered = False


def register() -> None:
    """Make PACKED_SDPA known to transformers (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED_SDPA, packed_sdpa_forward)

    def mask(*args: Any, attention_mask: Tensor | None = None, **kwargs: Any) -> Tensor | None:
        # No padding: the attention below reads the sequence starts from position_ids itself, so
        # the (row length)^2 block-diagonal mask is never built. With padding: sdpa's own mask.
        if attention_mask is None:
            return None
        return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)

    AttentionMaskInterface.register(PACKED_SDPA, mask)
    _registered = True


def model_attention(setting: str) -> str:
    """The attention implementation a model is loaded with for the learner's setting."""
    if setting == "sdpa":
        register()
        return PACKED_SDPA
    return setting


# Every layer is given the same position_ids tensor: its starts are found once per forward (on a
# GPU, reading them back waits for the device). The cache holds the tensor weakly: a later tensor
# that happens to get the same address and shape is not it.
_last: tuple[weakref.ref[Tensor], int, list[int] | None] | None = None


def sequence_starts(position_ids: Tensor) -> list[int] | None:
    """The sequence starts of a single packed row (its positions restarting at 0), with the row's
    length appended; None where the input is not one packed row of several sequences."""
    global _last
    if position_ids.ndim != 2 or position_ids.shape[0] != 1:
        return None
    if _last is not None and _last[0]() is position_ids and _last[1] == position_ids._version:
        return _last[2]
    starts = _starts(position_ids)
    _last = (weakref.ref(position_ids), position_ids._version, starts)
    return starts


def _starts(position_ids: Tensor) -> list[int] | None:
    pos = position_ids[0]
    # A new sequence starts wherever the position does not follow its predecessor (as transformers
    # reads packed rows: masking_utils.find_packed_sequence_indices).
    breaks = (pos[1:] != pos[:-1] + 1).nonzero().flatten() + 1
    if breaks.numel() == 0:
        return None
    return [0, *breaks.tolist(), int(pos.numel())]


def packed_sdpa_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    position_ids: Tensor | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention interface: query [1, heads, L, d], key/value [1, kv_heads, L, d]
    -> ([1, L, heads, d], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    starts = None
    if attention_mask is None and position_ids is not None and query.shape[2] == key.shape[2]:
        starts = sequence_starts(position_ids)
    if starts is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    lengths = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    window = kwargs.get("sliding_window")
    if window is not None and max(lengths) > window:
        raise ValueError(
            f"a packed sequence is longer than the model's sliding window ({window} tokens): this "
            "attention does not apply the window; set packing false or attn_implementation flex_attention"
        )
    kwargs.pop("is_causal", None)
    if query.is_cuda and _VARLEN is not None:
        return _varlen(module, query, key, value, starts, max(lengths), scaling), None
    # Elsewhere: causal attention per sequence (sdpa's flash kernel for the CPU, no mask), on views
    # that split() cut: its backward concatenates the gradients, where a slice per sequence would
    # fill a zero gradient of the whole row per sequence. Measured against one masked call on the
    # sequences padded into a batch: faster for 16 short sequences as for 5 long ones
    # (BENCHMARKS.md, "Learner: packed micro-batches").
    parts = [
        sdpa_attention_forward(module, q, k, v, None, dropout=dropout, scaling=scaling, is_causal=True, **kwargs)[0]
        for q, k, v in zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2), strict=True)
    ]  # fmt: skip
    return torch.cat(parts, dim=1), None


def _find_varlen() -> Any:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10
        return None
    return varlen_attn


_VARLEN = _find_varlen()
# Its signature changed across torch versions (causality by flag in 2.10 and 2.11, by window
# later; grouped-query attention by flag or not at all): read once, not at every layer's call.
_VARLEN_PARAMS = frozenset(inspect.signature(_VARLEN).parameters) if _VARLEN is not None else frozenset()


def _varlen(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    starts: list[int],
    longest: int,
    scale: Any,
) -> Tensor:
    """Causal attention per sequence in one flash-attention call (CUDA)."""
    groups = getattr(module, "num_key_value_groups", 1)
    q = query[0].transpose(0, 1)  # [L, heads, d]
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    cu = torch.tensor(starts, dtype=torch.int32, device=query.device)
    options: dict[str, Any] = {"scale": scale}
    if "is_causal" in _VARLEN_PARAMS:
        options["is_causal"] = True
    else:
        options["window_size"] = (-1, 0)
    if groups > 1:
        if "enable_gqa" in _VARLEN_PARAMS:
            options["enable_gqa"] = True
        else:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = _VARLEN(q, k, v, cu, cu, longest, longest, **options)
    return out.unsqueeze(0)  # [1, L, heads, d]
