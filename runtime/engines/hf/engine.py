"""The transformers engine: a KV-cached sampling loop with continuous batching.

It composes its parts, one module each: the scheduler (continuous batching in one worker thread,
and the gate weight swaps pass through), the sampler (token choice and log-probs), the loaders
(full weights and LoRA adapters, checked before anything changes). Semantics follow the vLLM
engine: see `sequence` for when a generation stops and `sampler` for its log-probs.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from ..base import Engine, Generation, SamplingConfig
from .loaders import WeightLoader
from .sampler import Sampler
from .scheduler import Scheduler
from .sequence import Request


class TransformersEngine(Engine):
    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        max_batch: int = 32,
        batch_window_s: float = 0.002,
        lora_rank: int = 0,
    ) -> None:
        """`lora_rank` is what vLLM must know at start-up (the largest adapter rank); here any
        adapter loads, so it is only checked, letting one engine_options serve both engines."""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if lora_rank < 0:
            raise ValueError(f"lora_rank must be >= 0, got {lora_rank}")
        if max_batch < 1 or batch_window_s < 0:
            raise ValueError(
                f"need max_batch >= 1 and batch_window_s >= 0, got {max_batch}, {batch_window_s}"
            )
        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=getattr(torch, dtype))
        self.model.to(self.device).eval()
        # Where the weights landed, with the index torch resolved ("cuda" -> "cuda:0").
        self.device_name = str(next(self.model.parameters()).device)
        self.max_len = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self.context_tokens = self.max_len
        self.eos_ids = frozenset(self._eos_ids())
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else min(self.eos_ids, default=0))
        self.sampler = Sampler(self.device)
        self.scheduler = Scheduler(
            self.model, self.tokenizer, self.sampler,
            max_batch=max_batch, batch_window_s=batch_window_s, max_len=self.max_len,
            eos_ids=self.eos_ids, pad_id=self.pad_id, device=self.device,
        )  # fmt: skip
        self.loader = WeightLoader()

    def _eos_ids(self) -> set[int]:
        ids = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if gen_eos is not None:
            ids.update([int(gen_eos)] if isinstance(gen_eos, int) else map(int, gen_eos))
        return ids

    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig) -> Generation:
        if self.scheduler.closed:
            raise RuntimeError("engine is closed")
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if sampling.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {sampling.max_tokens}")
        if len(prompt_ids) >= self.max_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room in {self.max_len} positions")
        loop = asyncio.get_running_loop()
        request = Request(list(map(int, prompt_ids)), sampling, loop.create_future(), loop)
        self.scheduler.submit(request)
        return await request.future

    async def load_weights(self, snapshot_dir: str | Path) -> None:
        if self.scheduler.closed:
            raise RuntimeError("engine is closed")
        await asyncio.to_thread(self._load_weights, Path(snapshot_dir))

    def _load_weights(self, folder: Path) -> None:
        # Read and checked before the swap waits for the running rows, which decode meanwhile.
        self.scheduler.swap_in(self.loader.prepare(self.model, folder))

    async def close(self) -> None:
        if self.scheduler.closed:
            return
        self.scheduler.close()
        await asyncio.to_thread(self.scheduler.join)
        self.model = None
