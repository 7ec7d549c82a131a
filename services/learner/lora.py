"""LoRA in the learner: adapters on a frozen base (PEFT), and the merged weights a snapshot carries.

With `lora_rank` > 0 the model is wrapped by PEFT before DeepSpeed sees it: only the adapters
(lora_A, lora_B of `lora_target_modules`) require gradients, so the optimizer, and under ZeRO its
partitions, hold adapter parameters alone, and ZeRO-3 still partitions the frozen base.

A snapshot carries the adapters alone (`lora_publish: adapter`, the default), in PEFT's layout:

    adapter_config.json          PEFT's LoraConfig (rank, alpha, target modules, base model path)
    adapter_model.safetensors    lora_A / lora_B of every target, named as PEFT saves them
                                 (`base_model.model.<module>.lora_A.weight`)

so a replica keeps its base weights and swaps a few megabytes; `lora_publish: merged` writes the
full merged weights instead (W + (alpha / rank) B A under the base's own names), for replicas
that cannot take adapters. spopp.files.adapters reads such folders and merges
them (`spopp lora merge`), for the learner, the replicas and the CLI alike. The adapters are initialised from `seed` in a forked RNG, so the same
settings give the same starting adapters whatever ran before.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from spopp.files.adapters import (
    ADAPTER_CONFIG,
    ADAPTER_NAME,
    adapter_scaling,
    base_name,
    is_adapter_name,
    merge_into,
    saved_name,
)


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


def merged_state_dict(state: dict[str, Any], module: Any) -> dict[str, Any]:
    """A PEFT model's state dict with every adapter merged in, under the base model's names."""
    base = {base_name(k): v for k, v in state.items() if not is_adapter_name(k)}
    return merge_into(base, adapter_state(state), adapter_scaling(module.peft_config[ADAPTER_NAME].to_dict()))


def adapter_state(state: dict[str, Any]) -> dict[str, Any]:
    """The adapter tensors of a PEFT model's state dict, under PEFT's saved names."""
    return {saved_name(k): v for k, v in state.items() if is_adapter_name(k)}


def write_adapter_config(module: Any, folder: Path, base_model: Path) -> Path:
    """PEFT's adapter_config.json for `module`'s adapter, naming `base_model` as its base."""
    config = module.peft_config[ADAPTER_NAME]
    data = config.to_dict()
    data["base_model_name_or_path"] = str(base_model)
    # Sets (target_modules) are not JSON; PEFT writes them as sorted lists too.
    data = {k: sorted(v) if isinstance(v, set) else v for k, v in data.items()}
    path = folder / ADAPTER_CONFIG
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path
