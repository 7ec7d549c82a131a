"""The training backend as the PPO step (update.py) sees it, on DeepSpeed: score a micro-batch,
take one optimizer step over a mini-batch's micro-batches given the loss of each, add tensors up
across the ranks. Everything DeepSpeed asks of its caller is kept here, so that the step reads as
the method (log-probs, screen, loss, statistics) and another engine is one more class like this.

What DeepSpeed asks:
- engine.backward divides the loss by its configured gradient_accumulation_steps, and the
  reduction across ranks divides by world_size; the step's loss is a sum over the mini-batch
  (each micro-batch's token-sum / the mini-batch's token count), so the loss handed to backward
  is multiplied by world_size * gradient_accumulation_steps, which turns both means back into sums.
  (Checked against a single-process PyTorch reference in tests/learner/test_learner_update.py.)
- The step's boundary is marked, not counted: by tokens, steps differ in how many micro-batches
  they have, so `step` marks the last one itself; engine.step() is called after every backward
  (DeepSpeed counts micro-steps and only reduces, clips and steps at the boundary).
- Without ZeRO and in fp32 DeepSpeed clips with torch's clip_grad_norm_ and discards the norm:
  there every rank holds the whole reduced gradient before the step, so the norm is read then.
- ZeRO-3 under gradient checkpointing leaves entries on DeepSpeed's forward-module stack every
  backward (zero3_state.py): `training` puts it back as it was once an update is done.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from .batch import Batch
from .scoring import logprobs, logprobs_entropy
from .update import BeforeStep
from .zero3_state import forward_stack_depth, trim_forward_stack

Item = TypeVar("Item")


class DeepSpeedBackend:
    """A DeepSpeed engine (deepspeed_engine.build_engine) behind the calls the PPO step makes
    (update.Backend)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    @property
    def device(self) -> Any:
        return self.engine.device

    @property
    def rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank()

    @property
    def world(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size()

    def accumulation_steps(self) -> int:
        """Micro-batches per rank per optimizer step that the engine was built for."""
        return int(self.engine.gradient_accumulation_steps())

    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    @contextmanager
    def training(self) -> Iterator[None]:
        """The model in training mode for one update, DeepSpeed's module-level state as it was after."""
        self.engine.train()
        depth = forward_stack_depth()
        try:
            yield
        finally:
            trim_forward_stack(depth)

    def logprobs(self, b: Batch) -> torch.Tensor:
        """b's token log-probs under the current weights (gradients flow outside no_grad)."""
        return logprobs(self.engine, b)

    def logprobs_entropy(self, b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        return logprobs_entropy(self.engine, b)

    def step(
        self,
        micro: Sequence[Item],
        loss_fn: Callable[[Item], torch.Tensor],
        *,
        before_step: BeforeStep | None = None,
        index: int = 0,
    ) -> float | None:
        """One optimizer step over this rank's micro-batches `micro` of mini-batch `index`, whose
        summed `loss_fn` values are the mini-batch's loss. Answers the pre-clip gradient norm,
        None where neither DeepSpeed nor this class can read one."""
        engine = self.engine
        scale = float(self.world * self.accumulation_steps())
        steps_before = engine.global_steps
        own_norm: float | None = None
        for i, item in enumerate(micro):
            last = i == len(micro) - 1
            engine.set_gradient_accumulation_boundary(last)
            engine.backward(loss_fn(item) * scale)
            if last:
                if not engine.is_gradient_accumulation_boundary():
                    raise RuntimeError(
                        "DeepSpeed's accumulation boundary is out of step with the mini-batches"
                    )
                if before_step is not None:
                    before_step(engine, index)
                own_norm = self._own_grad_norm()
            engine.step()
        if engine.global_steps != steps_before + 1:
            raise RuntimeError(
                f"mini-batch {index} made {engine.global_steps - steps_before} optimizer steps, not 1"
            )
        return engine.get_global_grad_norm() if own_norm is None else own_norm

    def _own_grad_norm(self) -> float | None:
        """The global gradient norm where DeepSpeed does not keep one (no ZeRO, fp32), else None."""
        engine = self.engine
        if engine.zero_optimization() or engine.bfloat16_enabled():
            return None
        grads = [p.grad.detach().float() for p in engine.module.parameters() if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """`t` summed (op "sum") or maximized ("max") over the ranks, on the CPU; the reduction
        runs on the engine's device (NCCL reduces only CUDA tensors)."""
        import torch.distributed as dist

        if self.world == 1:
            return t
        on = t.to(self.device)
        dist.all_reduce(on, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
        return on.cpu()
