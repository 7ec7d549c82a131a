"""What DeepSpeed's ZeRO-3 keeps in module-level state, and putting it right (deepspeed 0.19.8).

- parameter_offload.FWD_MODULE_STACK: every ZeRO-3 engine pushes its model when it is made and
  never pops it; each submodule's forward pushes it and its post-forward hook pops it. Under
  non-reentrant gradient checkpointing, torch stops a recomputation early once it has what the
  backward needs, so the hooks of the modules it cut short never pop: on the 2-layer smoke model
  the stack grew by 36 entries per update (37, 73, 109 after three updates). The list only grows,
  and it keeps the model alive after the engine is gone.
- PartitionedParameterCoordinator.__params_to_release is a functools.lru_cache on the class, keyed by
  the coordinator and the modules: it keeps every coordinator and model it saw.
- partition_parameters replaces torch.nn.functional.linear with its own and leaves it ("This will
  persist unless manually reset").

On an H200 a destroyed 1.5B ZeRO-3 engine left 23 GiB allocated through these. Each fix acts only
where the attribute exists, so another DeepSpeed version loses nothing but the clean-up.
"""

from __future__ import annotations

from typing import Any


def _stack() -> list | None:
    try:
        from deepspeed.runtime.zero import parameter_offload
    except ImportError:  # pragma: no cover - DeepSpeed is the learner's dependency
        return None
    stack = getattr(parameter_offload, "FWD_MODULE_STACK", None)
    return stack if isinstance(stack, list) else None


def forward_stack_depth() -> int:
    """How deep ZeRO-3's forward-module stack is now (0 without DeepSpeed)."""
    stack = _stack()
    return len(stack) if stack is not None else 0


def trim_forward_stack(depth: int) -> None:
    """Drop what was pushed above `depth` and never popped. Call it only between forwards (no
    forward is running then, so every entry above the engines' own is stale)."""
    stack = _stack()
    if stack is not None and len(stack) > depth:
        del stack[depth:]


def forget_model(model: Any) -> None:
    """Drop every reference ZeRO-3's module-level state holds to `model` (a destroyed engine's
    module) or its submodules, and put torch's linear back."""
    import torch

    stack = _stack()
    if stack is not None and model is not None:
        owned = {id(m) for m in model.modules()}
        stack[:] = [m for m in stack if id(m) not in owned]
    try:
        from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
    except ImportError:  # pragma: no cover
        return
    # The cache sits under DeepSpeed's nvtx wrapper (a closure), not under a functools.wraps one.
    method = getattr(
        PartitionedParameterCoordinator, "_PartitionedParameterCoordinator__params_to_release", None
    )
    inner = [method, getattr(method, "__wrapped__", None)]
    inner += [
        c.cell_contents for c in getattr(method, "__closure__", None) or () if callable(c.cell_contents)
    ]
    for f in inner:
        if hasattr(f, "cache_clear"):
            f.cache_clear()
    original = getattr(InsertPostInitMethodToModuleSubClasses, "linear_bk", None)
    if original is not None:
        torch.nn.functional.linear = original
