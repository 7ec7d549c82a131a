"""Weight swaps between generations, with the policy version of every generation recorded.

Under bounded staleness (the run's max_staleness k > 0) a replica does not drain at a new policy:
its episodes go on, and the weights change between the requests (turns) of an episode. The
learner must then know which version generated each token, so that it corrects exactly the
stale ones. Engines already finish running requests before they swap, but from outside one
cannot tell on which side of a swap a request queued meanwhile landed. This gate makes it exact:
a swap closes the gate, waits for the generations under way (one turn each, not whole episodes),
loads the weights and reopens it; every generation is stamped with the version the gate held
while it ran, which no swap can change under it.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

from runtime.engines.base import Engine, Generation, SamplingConfig


class VersionedEngine(Engine):
    """`engine` behind the gate; `version` is the policy version of the weights it holds."""

    def __init__(self, engine: Engine, version: int | None = None) -> None:
        self.inner = engine
        self.tokenizer = engine.tokenizer
        self.context_tokens = engine.context_tokens
        self.device_name = engine.device_name
        self.version = version
        self._running = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._open = asyncio.Event()
        self._open.set()

    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig) -> Generation:
        while not self._open.is_set():  # a swap is under way: wait for the new weights
            await self._open.wait()
        self._running += 1
        self._idle.clear()
        version = self.version
        try:
            gen = await self.inner.generate(prompt_ids, sampling)
        finally:
            self._running -= 1
            if self._running == 0:
                self._idle.set()
        return replace(gen, version=version)

    @property
    def running(self) -> int:
        """Generations under way."""
        return self._running

    async def swap(self, snapshot_dir: str | Path | None, version: int) -> float:
        """Hold new generations, wait for those under way, load `snapshot_dir` (None: version 0's
        weights, which the engine was built with) and reopen; answers the seconds waited for
        generations under way. If the load fails the old weights and version stay."""
        self._open.clear()
        try:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await self._idle.wait()
            waited = loop.time() - t0
            if snapshot_dir is not None:
                await self.inner.load_weights(snapshot_dir)
            self.version = version
            return waited
        finally:
            self._open.set()

    async def load_weights(self, snapshot_dir: str | Path) -> None:
        """Through the gate, as a swap keeping the version (no generation may straddle it)."""
        await self.swap(snapshot_dir, self.version)

    async def close(self) -> None:
        await self.inner.close()
