"""The transformers engine (`engine.TransformersEngine`) and its parts, one module each:
`scheduler` (continuous batching), `batch` (the KV-cached forward passes it runs), `sequence`
(one request's tokens and stop rules), `sampler` (token choice and log-probs), `loaders` (full
weights and LoRA adapters)."""

from .engine import TransformersEngine

__all__ = ["TransformersEngine"]
