"""The running batch of the transformers engine: its rows' shared KV cache and the forward passes
over it.

Rows are left-padded to a common width, so every row's newest token sits in the last column and
one decode step serves them all; the attention mask hides the padding, and position ids count
only a row's real tokens, so a row computes what it would alone. Batches merge by padding the
narrower cache on the left, and shrink by dropping rows and the columns only they used.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Batch:
    """The running rows: their KV cache, the attention mask over its columns (left padding is 0)
    and each row's next input token. Row i of every tensor is rows[i]."""

    rows: list  # sequence.Row
    cache: object  # transformers.DynamicCache
    mask: object  # LongTensor (rows, cache columns)
    next_ids: object  # LongTensor (rows,)


def merges_rows(model) -> bool:
    """Whether rows can join a running batch: only if every cache layer is a plain growing key/value
    store, which left padding can align (not sliding windows, not linear attention)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    layers = DynamicCache(config=model.config).layers
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def prefill(model, prompts: list[list[int]], pad_id: int, device):
    """One forward pass over `prompts`, left-padded to a common width: the new cache, its mask and
    each row's next-token logits (float32)."""
    import torch
    from transformers import DynamicCache

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    cache = DynamicCache(config=model.config)
    logits = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    ).logits[:, -1, :]
    return cache, mask, logits.float()


def step(model, batch: Batch):
    """One decode step: every row's next token in; each row's next-token logits (float32) out."""
    import torch

    mask = torch.cat([batch.mask, batch.mask.new_ones((len(batch.rows), 1))], dim=1)
    logits = model(
        input_ids=batch.next_ids.unsqueeze(1),
        attention_mask=mask,
        # A row's next position is the number of real tokens before it.
        position_ids=batch.mask.sum(-1, keepdim=True),
        past_key_values=batch.cache,
        use_cache=True,
        logits_to_keep=1,
    ).logits[:, -1, :]
    batch.mask = mask
    return logits.float()


def merge(a: Batch | None, b: Batch) -> Batch:
    """One batch of both, `a`'s rows first: the narrower cache is padded on the left (masked out)
    to the wider."""
    import torch
    import torch.nn.functional as F

    if a is None or not a.rows:
        return b
    width = max(a.mask.shape[1], b.mask.shape[1])
    for x in (a, b):
        pad = width - x.mask.shape[1]
        if pad:
            x.mask = F.pad(x.mask, (pad, 0))
            for layer in x.cache.layers:
                layer.keys = F.pad(layer.keys, (0, 0, pad, 0))
                layer.values = F.pad(layer.values, (0, 0, pad, 0))
    for la, lb in zip(a.cache.layers, b.cache.layers, strict=True):
        la.keys = torch.cat([la.keys, lb.keys])
        la.values = torch.cat([la.values, lb.values])
    return Batch(a.rows + b.rows, a.cache, torch.cat([a.mask, b.mask]), torch.cat([a.next_ids, b.next_ids]))


def keep_rows(batch: Batch, keep: list[int]) -> None:
    """Keep only rows `keep` (ascending indices), and trim the cache columns that only the departed
    rows used."""
    import torch

    index = torch.tensor(keep, device=batch.mask.device)
    batch.cache.batch_select_indices(index)
    batch.rows = [batch.rows[k] for k in keep]
    batch.mask, batch.next_ids = batch.mask[index], batch.next_ids[index]
    # Left padding is 0 in every row; columns where all rows are 0 hold nothing anyone reads.
    first = int(batch.mask.any(0).int().argmax())
    if first:
        batch.mask = batch.mask[:, first:]
        for layer in batch.cache.layers:
            layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
