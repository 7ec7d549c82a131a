"""Build an engine by name; implementations are imported only when asked for (torch, vLLM are heavy)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from .base import Engine


def make_engine(kind: Literal["vllm", "transformers"], model_dir: str | Path, **kwargs) -> Engine:
    """`kwargs` go to the engine's constructor (e.g. `max_model_len` for vLLM, `max_batch` for transformers)."""
    if kind == "vllm":
        from .vllm import VllmEngine

        return VllmEngine(model_dir, **kwargs)
    if kind == "transformers":
        from .hf import TransformersEngine

        return TransformersEngine(model_dir, **kwargs)
    raise ValueError(f"unknown engine {kind!r}; expected 'vllm' or 'transformers'")
