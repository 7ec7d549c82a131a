"""Fused CUDA kernels from liger-kernel: RMSNorm, SwiGLU and rotary in the decoder layers, and the
output layer's log-probs without logits (fused linear cross-entropy).

The setting `liger` is `auto` (on where liger-kernel imports, the device is CUDA and the model's
family is one it patches), `on` (the same, but an error where it cannot be), or `off`. On a CPU
it is always off: the kernels are Triton programs.

What it changes, and why it is safe to change:
- the decoder's elementwise kernels (RMSNorm's fp32 upcasts, SiLU x gate, rotary) become one
  Triton kernel each: the same functions, computed in fp32 inside the kernel;
- the log-probs of the chosen tokens come from liger's fused linear cross-entropy with
  `reduction="none"`: chunk by chunk, hidden states x output weight -> logits -> -log p, the
  logits never kept; liger 0.8.5 defers the gradient to backward when the loss is per token, so
  each token's upstream gradient scales its own row before the weight's gradient is summed.
  Under ZeRO-3 the output layer's weight is gathered only for its forward and its backward
  hooks, while liger's backward recomputes from the weight it saved: the PyTorch chunked path
  (logprobs.py) is used there instead.
"""

from __future__ import annotations

import importlib
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

# transformers' model_type -> liger's patch for that family.
FAMILIES = {"llama": "apply_liger_kernel_to_llama", "qwen2": "apply_liger_kernel_to_qwen2",
            "qwen3": "apply_liger_kernel_to_qwen3", "mistral": "apply_liger_kernel_to_mistral"}  # fmt: skip

# Output layers whose log-probs liger computes (set by enable(); read by logprobs.py).
_FUSED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def liger_module() -> Any | None:
    """liger_kernel.transformers, or None where it does not import (no package, no Triton)."""
    try:
        return importlib.import_module("liger_kernel.transformers")
    except Exception:  # noqa: BLE001 - ImportError, or Triton failing to find a GPU at import
        return None


def family_not_patched(model_type: str | None) -> str | None:
    """Why liger does not apply to a model of `model_type`, or None where it has its patch
    (`spopp learner plan` asks this without a model or a device)."""
    if model_type not in FAMILIES:
        return f"liger has no patch for model_type {model_type!r} (it has {', '.join(sorted(FAMILIES))})"
    return None


def why_not(model: Any, device: torch.device | str) -> str | None:
    """Why liger cannot apply to `model` on `device`, or None where it can."""
    if torch.device(device).type != "cuda":
        return f"the device is {torch.device(device).type}, and liger's kernels are Triton (CUDA) programs"
    reason = family_not_patched(getattr(getattr(model, "config", None), "model_type", None))
    if reason is not None:
        return reason
    if liger_module() is None:
        return "liger-kernel does not import here (pip install liger-kernel; it needs triton)"
    return None


def enable(model: Any, setting: str, device: torch.device | str, zero_stage: int) -> bool:
    """Patch `model` (before DeepSpeed wraps it) as `setting` says; answers whether it did.
    Raises ValueError for `on` where it cannot apply, with the reason."""
    if setting == "off":
        return False
    reason = why_not(model, device)
    if reason is not None:
        if setting == "on":
            raise ValueError(f"liger: on, but {reason}")
        return False
    patch = getattr(liger_module(), FAMILIES[model.config.model_type])
    # Our own output layer computes the log-probs (logprobs.py), so liger's loss patch stays off.
    patch(
        rope=True,
        rms_norm=True,
        swiglu=True,
        cross_entropy=False,
        fused_linear_cross_entropy=False,
        model=model,
    )
    head = model.get_output_embeddings()
    if zero_stage < 3 and isinstance(head, torch.nn.Linear):
        _FUSED.add(head)
    return True


def fused_logprobs(head: torch.nn.Module, device: torch.device) -> Callable[[Tensor, Tensor], Tensor] | None:
    """(states [N, H], targets [N]) -> log p [N] float32 by liger's fused linear cross-entropy, for
    an output layer enable() chose; None for any other (the chunked PyTorch path then)."""
    if head not in _FUSED or device.type != "cuda":
        return None
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    def logp(states: Tensor, targets: Tensor) -> Tensor:
        nll = liger_fused_linear_cross_entropy(
            states, head.weight, targets, bias=head.bias, reduction="none", accum_dtype=torch.float32
        )
        return -nll.float()

    return logp
