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
that cannot take adapters. `merge_adapter_folder` turns an adapter snapshot into such a folder
(`spopp lora merge`). The adapters are initialised from `seed` in a forked RNG, so the same
settings give the same starting adapters whatever ran before.

Nothing here imports torch or PEFT at module level: the rollout and the CLI use the helpers too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_NAME = "default"  # PEFT's name of the one adapter; dropped from saved names, as PEFT does


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


def is_adapter_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def saved_name(name: str) -> str:
    """A PEFT model's adapter parameter name as PEFT saves it (the adapter's own name dropped)."""
    return name.replace(f".{ADAPTER_NAME}.weight", ".weight")


def merge_into(base: dict[str, Any], adapters: dict[str, Any], scaling: float) -> dict[str, Any]:
    """`base` (the base model's names) with each adapter pair in `adapters` (saved names,
    `base_model.model.<module>.lora_A.weight` and `.lora_B.weight`) merged into its module's weight:
    W + scaling * B @ A, in fp32, cast back to W's dtype. KeyError naming a module the base lacks."""
    out = dict(base)
    stems = {k[: -len(".lora_A.weight")] for k in adapters if k.endswith(".lora_A.weight")}
    for stem in sorted(stems):
        target = base_name(stem) + ".weight"
        if target not in out:
            raise KeyError(f"the adapter targets {base_name(stem)}, which the base model does not have")
        a, b = adapters[f"{stem}.lora_A.weight"], adapters[f"{stem}.lora_B.weight"]
        w = out[target]
        out[target] = (w.float() + scaling * (b.float() @ a.float())).to(w.dtype)
    return out


def merged_state_dict(state: dict[str, Any], module: Any) -> dict[str, Any]:
    """A PEFT model's state dict with every adapter merged in, under the base model's names."""
    config = module.peft_config[ADAPTER_NAME]
    base = {base_name(k): v for k, v in state.items() if not is_adapter_name(k)}
    adapters = {saved_name(k): v for k, v in state.items() if is_adapter_name(k)}
    return merge_into(base, adapters, config.lora_alpha / config.r)


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


def is_adapter_folder(folder: str | Path) -> bool:
    return (Path(folder) / ADAPTER_CONFIG).is_file()


def read_adapter(folder: str | Path) -> tuple[dict, dict[str, Any]]:
    """(adapter_config.json as a dict, the adapter tensors) of a PEFT adapter folder; ValueError
    naming the file when one is missing or not what PEFT writes."""
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
    except FileNotFoundError:
        raise ValueError(f"{folder} has no {ADAPTER_CONFIG}: not a LoRA adapter") from None
    except ValueError as exc:
        raise ValueError(f"{folder / ADAPTER_CONFIG}: not JSON ({exc})") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{folder / ADAPTER_CONFIG}: not a LoRA adapter config")
    for key in ("r", "lora_alpha", "target_modules"):
        if key not in config:
            raise ValueError(f"{folder / ADAPTER_CONFIG}: no {key!r}")
    if not (folder / ADAPTER_WEIGHTS).is_file():
        raise ValueError(f"{folder} has no {ADAPTER_WEIGHTS}")
    tensors = load_file(str(folder / ADAPTER_WEIGHTS))
    if not tensors or not all(is_adapter_name(k) and k.startswith(PEFT_PREFIX) for k in tensors):
        raise ValueError(f"{folder / ADAPTER_WEIGHTS}: expected lora_A/lora_B tensors under {PEFT_PREFIX!r}")
    return config, tensors


def adapter_scaling(config: dict) -> float:
    """alpha / rank (alpha / sqrt(rank) under rsLoRA), as PEFT scales the adapter's output."""
    r = config["r"]
    return config["lora_alpha"] / (r**0.5 if config.get("use_rslora") else r)


def merge_adapter_folder(adapter: str | Path, out: str | Path, base: str | Path | None = None) -> Path:
    """A Hugging Face folder with `adapter` merged into its base (`base`, else the adapter's
    manifest's base_model, else its config's base_model_name_or_path): model.safetensors and the
    base's config and tokenizer files. Written under a temporary name and renamed; `out` must not
    exist. Answers `out`."""
    import shutil

    from safetensors.torch import load_file, save_file

    adapter, out = Path(adapter), Path(out)
    config, tensors = read_adapter(adapter)
    if base is None:
        try:
            base = json.loads((adapter / "manifest.json").read_text()).get("base_model")
        except (FileNotFoundError, ValueError):
            base = None
        base = base or config.get("base_model_name_or_path")
    if not base or not (Path(base) / "config.json").is_file():
        raise ValueError(f"base model {base!r}: no config.json there (give the base folder with --base)")
    base = Path(base)
    files = sorted(base.glob("*.safetensors"))
    if not files:
        raise ValueError(f"base model {base}: no *.safetensors")
    if out.exists():
        raise FileExistsError(f"{out} exists; give a new folder")
    state: dict[str, Any] = {}
    for f in files:
        state.update(load_file(str(f)))
    try:
        merged = merge_into(state, tensors, adapter_scaling(config))
    except KeyError as exc:
        raise ValueError(f"{adapter} does not fit {base}: {exc.args[0]}") from None
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        save_file({k: v.contiguous() for k, v in merged.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})  # fmt: skip
        for f in base.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name != "manifest.json":
                shutil.copyfile(f, tmp / f.name)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out
