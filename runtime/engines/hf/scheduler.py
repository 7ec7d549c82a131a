"""Continuous batching for the transformers engine: one worker thread decodes.

Between two decode steps the worker admits the requests that arrived meanwhile (prefilled together
in one left-padded forward pass, their cache rows merged into the running batch) and hands each
row back the step it finishes. A replica's episodes therefore keep the batch full the way vLLM's
scheduler does: an episode that is stepping its environment or reporting does not hold the others
back, and a request never waits for the slowest row of a batch it missed. Models whose cache is
not made of plain full-attention layers (sliding windows, linear attention) cannot merge rows
mid-flight; for them a new batch starts when the running one is empty, and rows still return as
they finish.

Weight swaps admit nothing new and wait for the running rows to finish, so every generation is
sampled from one set of weights.
"""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from ..base import settle_threadsafe
from . import batch as kv
from .batch import Batch
from .sampler import Sampler
from .sequence import Request, Row


class Scheduler:
    def __init__(
        self,
        model,
        tokenizer,
        sampler: Sampler,
        *,
        max_batch: int,
        batch_window_s: float,
        max_len: int,
        eos_ids: frozenset[int],
        pad_id: int,
        device,
    ) -> None:
        self.model, self.tokenizer, self.sampler, self.device = model, tokenizer, sampler, device
        self.max_batch = max_batch
        # An idle engine waits this long before its first forward pass, so that requests sent
        # together start together.
        self.batch_window_s = batch_window_s
        self.max_len, self.eos_ids, self.pad_id = max_len, eos_ids, pad_id
        self.merges_rows = kv.merges_rows(model)
        # Held during each forward pass and while weights are copied.
        self._lock = threading.Lock()
        # Guards the queue and the swap handshake below.
        self._cv = threading.Condition()
        self._pending: collections.deque[Request] = collections.deque()
        self._serving = False  # a decoding loop is running (or about to) in the worker thread
        self._swaps = 0  # weight swaps waiting for the running rows to finish
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-engine")
        self.closed = False

    # -- what callers and tests may watch -------------------------------------------------------

    @property
    def serving(self) -> bool:
        """A decoding loop is running (or about to)."""
        with self._cv:
            return self._serving

    @property
    def decoding(self) -> bool:
        """The loop is running and has taken every request sent so far off the queue (into its
        batch, or dropped as no longer wanted)."""
        with self._cv:
            return self._serving and not self._pending

    @property
    def swapping(self) -> bool:
        """A weight swap is registered and waiting for (or holding) the model."""
        with self._cv:
            return bool(self._swaps)

    # -- requests -------------------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        with self._cv:
            self._pending.append(request)
            self._wake()

    def _wake(self) -> None:
        """Start the decoding loop if it is not running (caller holds `_cv`)."""
        if not self._serving and self._pending and not self._swaps and not self.closed:
            self._serving = True
            self._pool.submit(self._serve)

    # -- the decoding loop (worker thread) ------------------------------------------------------

    def _serve(self) -> None:
        if self.batch_window_s:
            time.sleep(self.batch_window_s)
        batch: Batch | None = None
        while True:
            running = batch.rows if batch is not None else []
            admit = self._admit(running)
            if admit is None:
                return
            try:
                batch = self._retire(self._advance(batch, admit, len(running)))
            except Exception as exc:  # fail the rows that saw it; the next requests start afresh
                for request in [r.request for r in running] + admit:
                    settle_threadsafe(request.loop, request.future, exc)
                batch = None

    def _admit(self, running: list[Row]) -> list[Request] | None:
        """The queued requests that join now (none while a swap waits, or while rows run on a model
        that cannot merge); None when nothing runs and nothing joins: the loop ends."""
        admit: list[Request] = []
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
                return None
        return admit

    def _advance(self, batch: Batch | None, admit: list[Request], running: int) -> Batch | None:
        """One forward pass: the admitted requests' prefill if any (the running rows wait that
        step), else a decode step of the running rows."""
        import torch

        with self._lock, torch.inference_mode():
            if admit:
                return kv.merge(batch, self._prefill(admit, batch_rows=running + len(admit)))
            if batch is not None:
                logits = kv.step(self.model, batch)
                for row in batch.rows:
                    row.batch_rows += len(batch.rows)
                batch.next_ids = self._sample(batch.rows, logits)
        return batch

    def _prefill(self, requests: list[Request], batch_rows: int) -> Batch:
        rows = [self._new_row(r) for r in requests]
        prompts = [r.prompt_ids for r in requests]
        cache, mask, logits = kv.prefill(self.model, prompts, self.pad_id, self.device)
        for row in rows:
            row.batch_rows += batch_rows
        return Batch(rows, cache, mask, self._sample(rows, logits))

    def _new_row(self, request: Request) -> Row:
        s = request.sampling
        return Row(
            request,
            self.sampler.generator(s),
            frozenset(s.stop_token_ids) | self.eos_ids,
            max_tokens=min(s.max_tokens, self.max_len - len(request.prompt_ids)),
            admitted=time.perf_counter(),
        )

    def _sample(self, rows: list[Row], logits):
        """Each row's next token, recorded with its log-prob; the tokens are the next step's input."""
        samplings = [r.request.sampling for r in rows]
        chosen, picked = self.sampler.sample(logits, samplings, [r.generator for r in rows])
        for k, row in enumerate(rows):
            row.append(int(chosen[k]), float(picked[k]), self.tokenizer)
        return chosen

    def _retire(self, batch: Batch | None) -> Batch | None:
        """Hand back the rows that finished and drop those nobody waits for; None once none is left."""
        if batch is None:
            return None
        keep = []
        now = time.perf_counter()
        for k, row in enumerate(batch.rows):
            if row.finish_reason is not None:
                settle_threadsafe(row.request.loop, row.request.future, row.generation(self.tokenizer, now))
            elif row.request.wanted():
                keep.append(k)
        if not keep:
            return None
        if len(keep) < len(batch.rows):
            kv.keep_rows(batch, keep)
        return batch

    # -- weight swaps and shutdown --------------------------------------------------------------

    def swap_in(self, copy) -> None:
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

    def close(self) -> None:
        """Admit nothing more and fail the queued requests; the running rows go on (`join`)."""
        with self._cv:
            self.closed = True
            pending, self._pending = list(self._pending), collections.deque()
        for r in pending:
            settle_threadsafe(r.loop, r.future, RuntimeError("engine closed"))

    def join(self) -> None:
        """Block until the worker has finished its rows, then let go of the model."""
        self._pool.shutdown(wait=True)
        self.model = None
