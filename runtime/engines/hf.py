"""The transformers engine: a KV-cached sampling loop with continuous batching.

One worker thread decodes. Between two decode steps it admits the requests that arrived
meanwhile (prefilled together in one left-padded forward pass, their cache rows merged into the
running batch) and hands each row back the step it finishes. A replica's episodes therefore keep
the batch full the way vLLM's scheduler does: an episode that is stepping its environment or
reporting does not hold the others back, and a request never waits for the slowest row of a batch
it missed. Models whose cache is not made of plain full-attention layers (sliding windows, linear
attention) cannot merge rows mid-flight; for them a new batch starts when the running one is empty,
and rows still return as they finish.

Weight swaps admit nothing new and wait for the running rows to finish, so every generation is
sampled from one set of weights.

Semantics follow the vLLM engine: the tokenizer's and generation config's end-of-sequence tokens
stop a turn, stop tokens and stop strings are kept in the output, a stop on the last allowed token
counts as "stop", and the log-prob of a sampled token is taken under the distribution it was drawn
from (logits / T, then top-k/top-p masking and renormalization when those are on). Greedy decoding
(T = 0) reports log-probs at T = 1, as vLLM's processed log-probs do.
"""

from __future__ import annotations

import asyncio
import collections
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .base import Engine, Generation, SamplingConfig, settle_threadsafe


@dataclass
class _Request:
    prompt_ids: list[int]
    sampling: SamplingConfig
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    submitted: float = field(default_factory=time.perf_counter)

    def wanted(self) -> bool:
        """False once the caller stopped waiting (cancelled, or its event loop is gone)."""
        return not self.future.done() and not self.loop.is_closed()


@dataclass
class _Row:
    """Decoding state of one request inside the running batch."""

    request: _Request
    generator: object  # torch.Generator
    stop_ids: frozenset[int]
    max_tokens: int
    admitted: float
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    text: str | None = None
    batch_rows: int = 0  # summed over the forward passes this row took part in, for its mean batch size


@dataclass
class _Batch:
    """The running rows: their KV cache, the attention mask over its columns (left padding is 0) and
    each row's next input token. Row i of every tensor is rows[i]."""

    rows: list[_Row]
    cache: object  # transformers.DynamicCache
    mask: object  # LongTensor (rows, cache columns)
    next_ids: object  # LongTensor (rows,)


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
        from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
        from transformers.cache_utils import DynamicLayer

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
        self.max_batch = max_batch
        # An idle engine waits this long before its first forward pass, so that requests sent
        # together start together.
        self.batch_window_s = batch_window_s
        self.max_len = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self.context_tokens = self.max_len
        self.eos_ids = frozenset(self._eos_ids())
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else min(self.eos_ids, default=0))
        # Rows can join a running batch only if every cache layer is a plain growing key/value
        # store, which left padding can align.
        layers = DynamicCache(config=self.model.config).layers
        self.merges_rows = bool(layers) and all(type(layer) is DynamicLayer for layer in layers)
        # Held during each forward pass and while weights are copied.
        self._lock = threading.Lock()
        # Guards the queue and the swap handshake below.
        self._cv = threading.Condition()
        self._pending: collections.deque[_Request] = collections.deque()
        self._serving = False  # a decoding loop is running (or about to) in the worker thread
        self._swaps = 0  # weight swaps waiting for the running rows to finish
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-engine")
        self._closed = False
        # The adapter layout injected by the first LoRA snapshot (rank, alpha, targets, rsLoRA);
        # None while the engine holds plain weights.
        self._lora: tuple | None = None
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
        request = _Request(list(map(int, prompt_ids)), sampling, loop.create_future(), loop)
        with self._cv:
            self._pending.append(request)
            self._wake()
        return await request.future

    def _wake(self) -> None:
        """Start the decoding loop if it is not running (caller holds `_cv`)."""
        if not self._serving and self._pending and not self._swaps and not self._closed:
            self._serving = True
            self._pool.submit(self._serve)

    # -- the decoding loop (worker thread) -----------------------------------------------------

    def _serve(self) -> None:
        import torch

        if self.batch_window_s:
            time.sleep(self.batch_window_s)
        batch: _Batch | None = None
        while True:
            running = batch.rows if batch is not None else []
            admit: list[_Request] = []
            with self._cv:
                if not self._swaps and (self.merges_rows or not running):
                    while self._pending and len(running) + len(admit) < self.max_batch:
                        request = self._pending.popleft()
                        if request.wanted():
                            admit.append(request)
                if not running and not admit:
                    self._serving = False
                    self._cv.notify_all()
                    self._wake()  # a request that raced the exit, or a swap that just finished
                    return
            try:
                with self._lock, torch.inference_mode():
                    if admit:
                        batch = self._merge(batch, self._prefill(admit, batch_rows=len(running) + len(admit)))
                    elif batch is not None:
                        self._step(batch)
                batch = self._retire(batch)
            except Exception as exc:  # fail the rows that saw it; the next requests start afresh
                failed = [r.request for r in running] + admit
                for request in failed:
                    settle_threadsafe(request.loop, request.future, exc)
                batch = None

    def _new_row(self, request: _Request):
        import torch

        s = request.sampling
        gen = self._shared_gen
        if s.seed is not None:
            gen = torch.Generator(self.device).manual_seed(int(s.seed))
        room = self.max_len - len(request.prompt_ids)
        return _Row(
            request,
            gen,
            frozenset(s.stop_token_ids) | self.eos_ids,
            max_tokens=min(s.max_tokens, room),
            admitted=time.perf_counter(),
        )

    def _prefill(self, requests: list[_Request], batch_rows: int) -> _Batch:
        """One forward pass over the new prompts, left-padded to a common width; samples each row's
        first token."""
        import torch
        from transformers import DynamicCache

        rows = [self._new_row(r) for r in requests]
        width = max(len(r.prompt_ids) for r in requests)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(requests):
            ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        cache = DynamicCache(config=self.model.config)
        logits = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1, :]
        for row in rows:
            row.batch_rows += batch_rows
        return _Batch(rows, cache, mask, self._sample(rows, logits.float()))

    def _step(self, batch: _Batch) -> None:
        """One decode step: every row's next token in, one sampled token out."""
        import torch

        mask = torch.cat([batch.mask, batch.mask.new_ones((len(batch.rows), 1))], dim=1)
        logits = self.model(
            input_ids=batch.next_ids.unsqueeze(1),
            attention_mask=mask,
            # A row's next position is the number of real tokens before it.
            position_ids=batch.mask.sum(-1, keepdim=True),
            past_key_values=batch.cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1, :]
        batch.mask = mask
        for row in batch.rows:
            row.batch_rows += len(batch.rows)
        batch.next_ids = self._sample(batch.rows, logits.float())

    def _merge(self, a: _Batch | None, b: _Batch) -> _Batch:
        """One batch of both: the narrower cache is padded on the left (masked out) to the wider."""
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
        return _Batch(
            a.rows + b.rows, a.cache, torch.cat([a.mask, b.mask]), torch.cat([a.next_ids, b.next_ids])
        )

    def _retire(self, batch: _Batch | None) -> _Batch | None:
        """Hand back the rows that finished, drop those nobody waits for, and trim the cache columns
        that only the departed rows used."""
        import torch

        if batch is None:
            return None
        keep = []
        now = time.perf_counter()
        for k, row in enumerate(batch.rows):
            if row.finish_reason is not None:
                settle_threadsafe(row.request.loop, row.request.future, self._generation(row, now))
            elif row.request.wanted():
                keep.append(k)
        if not keep:
            return None
        if len(keep) < len(batch.rows):
            index = torch.tensor(keep, device=self.device)
            batch.cache.batch_select_indices(index)
            batch.rows = [batch.rows[k] for k in keep]
            batch.mask, batch.next_ids = batch.mask[index], batch.next_ids[index]
            # Left padding is 0 in every row; columns where all rows are 0 hold nothing anyone reads.
            first = int(batch.mask.any(0).int().argmax())
            if first:
                batch.mask = batch.mask[:, first:]
                for layer in batch.cache.layers:
                    layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
        return batch

    def _generation(self, row: _Row, now: float) -> Generation:
        text = row.text
        if text is None:
            text = self.tokenizer.decode(row.token_ids, skip_special_tokens=True)
        timings = {
            "queue_s": row.admitted - row.request.submitted,
            "engine_s": now - row.admitted,
            "batch_size": row.batch_rows / max(1, len(row.token_ids)),
        }
        return Generation(row.token_ids, row.logprobs, row.finish_reason, text, timings)

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

    def _swap_in(self, copy) -> None:
        """Run `copy()` with no row running and none admitted: no row may see half a swap, nor be
        sampled from two sets of weights. The running rows finish first."""
        import torch

        with self._cv:
            self._swaps += 1
            while self._serving:  # it stops once its running rows are done
                self._cv.wait()
        try:
            with self._lock, torch.no_grad():
                copy()
        finally:
            with self._cv:
                self._swaps -= 1
                self._wake()

    def _load_adapter(self, folder: Path) -> None:
        """A LoRA snapshot: the first injects PEFT's adapter layers into the base (loaded once, at
        start-up); every one copies its adapter tensors into them in place. Everything is checked
        before anything changes, so a bad adapter leaves the engine as it was."""
        from spopp.adapters import adapter_targets, check_adapter_fits, read_adapter

        config, tensors = read_adapter(folder)
        layout = (config["r"], config["lora_alpha"], tuple(sorted(config["target_modules"])),
                  bool(config.get("use_rslora")))  # fmt: skip
        if self._lora is not None and layout != self._lora:
            raise ValueError(
                f"adapter {folder} has rank/alpha/targets {layout[:3]}, the engine holds {self._lora[:3]}: "
                "one run's adapters share a layout (restart the engine to change it)"
            )
        check_adapter_fits(self.model, tensors, config)
        targets = adapter_targets(tensors)  # saved name -> the injected parameter's name

        def copy() -> None:
            if self._lora is None:
                from peft import LoraConfig, inject_adapter_in_model

                lora = LoraConfig(r=config["r"], lora_alpha=config["lora_alpha"], lora_dropout=0.0,
                                  target_modules=list(config["target_modules"]),
                                  use_rslora=bool(config.get("use_rslora")))  # fmt: skip
                inject_adapter_in_model(lora, self.model)
                self.model.eval()
                self._lora = layout
            params = dict(self.model.named_parameters())
            for name, tensor in tensors.items():
                params[targets[name]].copy_(tensor)

        self._swap_in(copy)

    def _load_weights(self, folder: Path) -> None:
        import torch
        from safetensors.torch import load_file

        from spopp.adapters import is_adapter_folder

        if is_adapter_folder(folder):
            return self._load_adapter(folder)
        if self._lora is not None:
            raise ValueError(
                f"snapshot {folder} holds full weights but this engine runs LoRA adapters on its base: "
                "one run publishes one kind (restart the engine to change it)"
            )
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

        def copy() -> None:
            for name, tensor in state.items():
                targets[name].copy_(tensor)

        self._swap_in(copy)

    async def close(self) -> None:
        if self._closed:
            return
        with self._cv:
            self._closed = True
            pending, self._pending = list(self._pending), collections.deque()
        for r in pending:
            settle_threadsafe(r.loop, r.future, RuntimeError("engine closed"))
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
