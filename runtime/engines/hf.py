"""The transformers engine: a KV-cached sampling loop over batches of concurrent requests.

Requests that arrive within `batch_window_s` of each other run as one left-padded batch in a
worker thread; rows leave the batch as they finish. Semantics follow the vLLM engine: the
tokenizer's and generation config's end-of-sequence tokens stop a turn, stop tokens and stop
strings are kept in the output, a stop on the last allowed token counts as "stop", and the
log-prob of a sampled token is taken under the distribution it was drawn from (logits / T, then
top-k/top-p masking and renormalization when those are on). Greedy decoding (T = 0) reports
log-probs at T = 1, as vLLM's processed log-probs do.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .base import Engine, Generation, SamplingConfig


@dataclass
class _Request:
    prompt_ids: list[int]
    sampling: SamplingConfig
    future: asyncio.Future
    submitted: float = field(default_factory=time.perf_counter)


@dataclass
class _Row:
    """Decoding state of one request inside a batch."""

    request: _Request
    generator: object  # torch.Generator
    stop_ids: frozenset[int]
    max_tokens: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    text: str | None = None


class TransformersEngine(Engine):
    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        max_batch: int = 32,
        batch_window_s: float = 0.002,
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if max_batch < 1 or batch_window_s < 0:
            raise ValueError(
                f"need max_batch >= 1 and batch_window_s >= 0, got {max_batch}, {batch_window_s}"
            )
        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=getattr(torch, dtype))
        self.model.to(self.device).eval()
        self.max_batch = max_batch
        self.batch_window_s = batch_window_s
        self.max_len = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self.eos_ids = frozenset(self._eos_ids())
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else min(self.eos_ids, default=0))
        # Held while a batch runs and while weights are copied, so no batch sees half a swap.
        self._lock = threading.Lock()
        # One worker: batches run one after another; requests arriving meanwhile form the next.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-engine")
        self._pending: list[_Request] = []
        self._dispatcher: asyncio.Task | None = None
        self._closed = False
        # Requests without a seed draw from this engine-wide stream.
        self._shared_gen = torch.Generator(self.device).manual_seed(
            int.from_bytes(os.urandom(8), "little") >> 1
        )

    def _eos_ids(self) -> set[int]:
        ids = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if gen_eos is not None:
            ids.update([int(gen_eos)] if isinstance(gen_eos, int) else map(int, gen_eos))
        return ids

    # -- requests ---------------------------------------------------------------------------

    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig) -> Generation:
        if self._closed:
            raise RuntimeError("engine is closed")
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if sampling.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {sampling.max_tokens}")
        if len(prompt_ids) >= self.max_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room in {self.max_len} positions")
        loop = asyncio.get_running_loop()
        request = _Request(list(map(int, prompt_ids)), sampling, loop.create_future())
        self._pending.append(request)
        # The engine serves one event loop at a time; a new loop (e.g. a later asyncio.run) gets a
        # new dispatcher, and requests left over from a finished loop are dropped.
        if self._dispatcher is None or self._dispatcher.done() or self._dispatcher.get_loop() is not loop:
            self._dispatcher = loop.create_task(self._dispatch())
        return await request.future

    async def _dispatch(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            await asyncio.sleep(self.batch_window_s)
            taken, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
            batch = [r for r in taken if not r.future.done() and r.future.get_loop() is loop]
            if not batch:
                continue
            try:
                results = await loop.run_in_executor(self._pool, self._run_batch, batch)
            except Exception as exc:
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(exc)
                continue
            for r, gen in zip(batch, results, strict=True):
                if not r.future.done():
                    r.future.set_result(gen)

    # -- the decoding loop (worker thread) -----------------------------------------------------

    def _run_batch(self, batch: list[_Request]) -> list[Generation]:
        import torch

        started = time.perf_counter()
        rows = []
        for r in batch:
            s = r.sampling
            gen = self._shared_gen
            if s.seed is not None:
                gen = torch.Generator(self.device).manual_seed(int(s.seed))
            room = self.max_len - len(r.prompt_ids)
            rows.append(
                _Row(r, gen, frozenset(s.stop_token_ids) | self.eos_ids, max_tokens=min(s.max_tokens, room))
            )
        with self._lock, torch.inference_mode():
            self._decode(rows)
        elapsed = time.perf_counter() - started
        out = []
        for row in rows:
            text = row.text
            if text is None:
                text = self.tokenizer.decode(row.token_ids, skip_special_tokens=True)
            timings = {
                "queue_s": started - row.request.submitted,
                "engine_s": elapsed,
                "batch_size": float(len(rows)),
            }
            out.append(Generation(row.token_ids, row.logprobs, row.finish_reason, text, timings))
        return out

    def _decode(self, rows: list[_Row]) -> None:
        import torch
        from transformers import DynamicCache

        dev = self.device
        width = max(len(r.request.prompt_ids) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            p = r.request.prompt_ids
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        active = list(range(len(rows)))  # indices into `rows` of the cache's batch rows
        while True:
            logits = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1, :]
            next_ids = self._sample([rows[i] for i in active], logits.float())
            keep = [k for k, i in enumerate(active) if rows[i].finish_reason is None]
            if not keep:
                return
            if len(keep) < len(active):
                index = torch.tensor(keep, device=dev)
                cache.batch_select_indices(index)
                mask, positions, next_ids = mask[index], positions[index], next_ids[index]
                active = [active[k] for k in keep]
            ids = next_ids.unsqueeze(1)
            mask = torch.cat([mask, mask.new_ones((len(active), 1))], dim=1)
            positions = positions[:, -1:] + 1

    def _sample(self, rows: list[_Row], logits):
        """Pick one token per row, record it with its log-prob, and mark rows that finished."""
        import torch

        temps = torch.tensor([r.request.sampling.temperature for r in rows], device=logits.device)
        greedy = temps <= 0
        scaled = logits / torch.where(greedy, 1.0, temps).unsqueeze(1)
        for k, r in enumerate(rows):
            s = r.request.sampling
            if not greedy[k] and (0 < s.top_k < logits.shape[1] or s.top_p < 1.0):
                scaled[k] = _top_k_top_p(scaled[k], s.top_k, s.top_p)
        logp = torch.log_softmax(scaled, dim=-1)
        chosen = logp.argmax(dim=-1)
        probs = logp.exp()
        for k, r in enumerate(rows):
            if not greedy[k]:
                chosen[k] = torch.multinomial(probs[k], 1, generator=r.generator)[0]
        picked = logp.gather(1, chosen.unsqueeze(1)).squeeze(1)
        for k, r in enumerate(rows):
            self._append(r, int(chosen[k]), float(picked[k]))
        return chosen

    def _append(self, row: _Row, token: int, logprob: float) -> None:
        row.token_ids.append(token)
        row.logprobs.append(logprob)
        stops = row.request.sampling.stop
        if token in row.stop_ids:
            row.finish_reason = "stop"
        elif stops:
            text = self.tokenizer.decode(row.token_ids, skip_special_tokens=True)
            found = [text.find(s) + len(s) for s in stops if s and s in text]
            if found:
                row.finish_reason = "stop"
                row.text = text[: min(found)]
        if row.finish_reason is None and len(row.token_ids) >= row.max_tokens:
            row.finish_reason = "length"

    # -- weights and shutdown ----------------------------------------------------------------

    async def load_weights(self, snapshot_dir: str | Path) -> None:
        if self._closed:
            raise RuntimeError("engine is closed")
        await asyncio.to_thread(self._load_weights, Path(snapshot_dir))

    def _load_weights(self, folder: Path) -> None:
        import torch
        from safetensors.torch import load_file

        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {folder}")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(f))
        # Tied weights appear once in named_parameters() but a checkpoint may hold either name.
        targets = dict(self.model.named_parameters(remove_duplicate=False))
        required = {name for name, _ in self.model.named_parameters()}
        unknown = sorted(set(state) - set(targets))
        missing = sorted(n for n in required if n not in state and not _has_alias(self.model, n, state))
        bad_shape = sorted(n for n in state if n in targets and state[n].shape != targets[n].shape)
        if unknown or missing or bad_shape:
            # Checked before any copy, so a bad snapshot leaves the old weights whole.
            raise ValueError(
                f"snapshot {folder} does not fit: unknown={unknown} missing={missing} shape={bad_shape}"
            )
        with self._lock, torch.no_grad():
            for name, tensor in state.items():
                targets[name].copy_(tensor)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for r in self._pending:
            if not r.future.done():
                r.future.set_exception(RuntimeError("engine closed"))
        self._pending.clear()
        await asyncio.to_thread(self._pool.shutdown, wait=True)
        self.model = None


def _top_k_top_p(logits, top_k: int, top_p: float):
    """Mask one row of logits to its top-k and top-p set, as vLLM does (ties at the k-th kept)."""
    import torch

    if 0 < top_k < logits.shape[0]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum <= 1 - top_p
        drop[-1] = False  # at least one token survives
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


def _has_alias(model, name: str, state: dict) -> bool:
    """Whether `name` is tied to a parameter the checkpoint does hold (e.g. lm_head = embeddings)."""
    target = dict(model.named_parameters(remove_duplicate=False))[name]
    return any(n in state and p is target for n, p in model.named_parameters(remove_duplicate=False))
