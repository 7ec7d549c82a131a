"""LoRA in the learner: adapters on a frozen base (PEFT), and the merged weights a snapshot carries.

With `lora_rank` > 0 the model is wrapped by PEFT before DeepSpeed sees it: only the adapters
(lora_A, lora_B of `lora_target_modules`) require gradients, so the optimizer, and under ZeRO its
partitions, hold adapter parameters alone, and ZeRO-3 still partitions the frozen base.

Snapshots stay ordinary Hugging Face folders that every replica loads today: at publish the
adapters are merged into the gathered base weights, W + (alpha / rank) B A, under the base
model's own parameter names. The adapters are initialised from `seed` in a forked RNG, so the
same settings give the same starting adapters whatever ran before.
"""

from __future__ import annotations

from typing import Any

PEFT_PREFIX = "base_model.model."


def apply_lora(
    model: Any, *, rank: int, alpha: float, dropout: float, target_modules: list[str], seed: int
) -> Any:
    """`model` with LoRA adapters (a PEFT model), or `model` itself when rank is 0."""
    if rank == 0:
        return model
    import torch
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules), bias="none",
        task_type="CAUSAL_LM",
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            return get_peft_model(model, config)
        except ValueError as e:  # PEFT: "Target modules {...} not found in the base model"
            raise ValueError(f"lora_target_modules {list(target_modules)}: {e}") from None


def is_lora(module: Any) -> bool:
    return hasattr(module, "peft_config")


def base_name(name: str) -> str:
    """A PEFT parameter name as the base model names it (adapters' own names pass through)."""
    if name.startswith(PEFT_PREFIX):
        name = name[len(PEFT_PREFIX) :]
    return name.replace(".base_layer.", ".")


def merged_state_dict(state: dict[str, Any], module: Any) -> dict[str, Any]:
    """The base model's state dict with every adapter merged in: W + scaling * B @ A in fp32,
    cast back to W's dtype, under the base model's names."""
    config = module.peft_config["default"]
    scaling = config.lora_alpha / config.r
    out = {}
    for key, value in state.items():
        if ".lora_A." in key or ".lora_B." in key:
            continue
        if key.endswith(".base_layer.weight"):
            stem = key[: -len(".base_layer.weight")]
            a, b = state[f"{stem}.lora_A.default.weight"], state[f"{stem}.lora_B.default.weight"]
            value = (value.float() + scaling * (b.float() @ a.float())).to(value.dtype)
        out[base_name(key)] = value
    return out
