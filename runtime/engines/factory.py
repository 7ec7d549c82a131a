"""Build an engine by name; implementations are imported only when asked for (torch, vLLM are heavy)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from .base import Engine


def make_engine(
    kind: Literal["vllm", "transformers"], model_dir: str | Path, *, process: bool = False, **kwargs
) -> Engine:
    """`kwargs` go to the engine's constructor (e.g. `max_model_len` for vLLM, `max_batch` for transformers).

    `process=True` hosts the engine in a child process of its own (`EngineProcess`): what a replica
    wants for the transformers engine, whose decoding thread would otherwise share the GIL with the
    replica's event loop. vLLM already runs its engine core in another process.
    """
    if process:
        from .process import EngineProcess

        return EngineProcess(kind, model_dir, **kwargs)
    if kind == "vllm":
        from .vllm import VllmEngine

        return VllmEngine(model_dir, **kwargs)
    if kind == "transformers":
        from .hf import TransformersEngine

        return TransformersEngine(model_dir, **kwargs)
    raise ValueError(f"unknown engine {kind!r}; expected 'vllm' or 'transformers'")
