"""Per-token log-probabilities of a sequence under a causal LM: log p(token_{t+1} | tokens_{<=t}).

The softmax runs in float32 whatever the model's dtype: a bf16 log-softmax over a large vocabulary
loses about three significant digits, and these values feed exp(logp - old_logp), where an error
of 1e-2 already moves the ratio by a percent and can flip a clip decision. The log-prob is formed
as logit - logsumexp(logits), which needs no second [n, T, V] tensor beside the logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def token_logprobs(model: Callable[..., object], input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """[n, T-1] float32: column t is log p(input_ids[:, t+1] | input_ids[:, :t+1]).

    `model` is a Hugging Face causal LM or a wrapper that forwards keyword arguments to one (a
    DeepSpeed engine); gradients flow when called outside no_grad. Columns past a sequence's end
    hold finite but meaningless values: mask them.
    """
    if input_ids.ndim != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids and attention_mask must both be [n, T], got {tuple(input_ids.shape)} "
            f"and {tuple(attention_mask.shape)}"
        )
    if input_ids.shape[1] < 2:
        raise ValueError("need at least 2 tokens per row to predict one")
    out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    # The last position predicts past the end; dropping it before the cast saves [n, V] floats.
    logits = out.logits[:, :-1, :].float()
    targets = input_ids[:, 1:].unsqueeze(-1)
    return logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)
