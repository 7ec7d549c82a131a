"""Test helpers around the tiny model (runtime/tiny_model.py builds it): perturbed copies and
random LoRA adapters of a model folder. The builder's names are re-exported for the tests' and
benchmarks' imports."""

from __future__ import annotations

import shutil
from pathlib import Path

from runtime.tiny_model import CHAT_TEMPLATE, build_tiny_model, render, sample_chat

__all__ = [
    "CHAT_TEMPLATE",
    "LINEAR_MODULES",
    "build_tiny_model",
    "perturb_weights",
    "random_adapter",
    "render",
    "sample_chat",
]


def perturb_weights(src_dir: str | Path, dst_dir: str | Path, scale: float = 0.05, seed: int = 1) -> Path:
    """Copy a model folder with every weight moved by `scale` times its mean magnitude in noise."""
    import torch
    from safetensors.torch import load_file, save_file

    src, dst = Path(src_dir), Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, dst / f.name)
    gen = torch.Generator().manual_seed(seed)
    for f in sorted(src.glob("*.safetensors")):
        tensors = load_file(f)
        out = {}
        for name in sorted(tensors):
            t = tensors[name]
            noise = torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype)
            out[name] = (t + scale * t.abs().mean() * noise).contiguous()
        save_file(out, dst / f.name, metadata={"format": "pt"})
    return dst


LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_adapter(
    base: str | Path,
    out: str | Path,
    *,
    seed: int,
    rank: int = 8,
    alpha: float | None = None,
    targets: tuple[str, ...] | list[str] = LINEAR_MODULES,
    scale: float = 0.01,
) -> Path:
    """A LoRA adapter folder of `base` in PEFT's layout (as the learner publishes it) whose A and B
    are drawn N(0, scale) from `seed`: a trained-looking adapter, B nonzero, unlike a fresh one.
    alpha defaults to 2 * rank."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank if alpha is None else alpha,
                        target_modules=list(targets), task_type="CAUSAL_LM")  # fmt: skip
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, scale)
    model.save_pretrained(out)
    return Path(out)
