"""LoRA adapter folders in PEFT's layout, shared by the learner (writes them), the replicas and the
evaluator (load them in place) and `spopp lora merge`:

    adapter_config.json          PEFT's LoraConfig: r, lora_alpha, target_modules, base model path
    adapter_model.safetensors    lora_A [r, in] and lora_B [out, r] of every targeted module, named
                                 as PEFT saves them: `base_model.model.<module>.lora_A.weight`

An adapted module computes W x + (alpha / r) B A x (alpha / sqrt(r) under rsLoRA), so merging
is W + scaling B A. No torch or PEFT at module level: they are imported where used.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_NAME = "default"  # PEFT's name of the one adapter; dropped from saved names, as PEFT does


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


def _stems(tensors: dict[str, Any]) -> set[str]:
    """The adapted modules' names in the base model (`model.layers.0.self_attn.q_proj`)."""
    return {base_name(k.rsplit(".lora_", 1)[0]) for k in tensors}


def adapter_targets(tensors: dict[str, Any]) -> dict[str, str]:
    """Saved name -> the parameter's name once PEFT's layers are injected into the bare model
    (`model.layers.0.self_attn.q_proj.lora_A.default.weight`)."""
    return {k: base_name(k).replace(".weight", f".{ADAPTER_NAME}.weight") for k in tensors}


def check_adapter_fits(model: Any, tensors: dict[str, Any], config: dict) -> None:
    """ValueError unless `tensors` are exactly one lora_A [r, in] and lora_B [out, r] for every
    module of `model` that the config's target_modules name, and nothing else."""
    r, targets = config["r"], config["target_modules"]
    targets = [targets] if isinstance(targets, str) else list(targets)
    wanted = {
        name for name, module in model.named_modules()
        if any(name == t or name.endswith("." + t) for t in targets) and hasattr(module, "in_features")
    }  # fmt: skip
    stems = _stems(tensors)
    problems = []
    if stems != wanted:
        problems.append(f"adapted modules {sorted(stems ^ wanted)[:4]} differ from the model's {targets}")
    for stem in sorted(stems & wanted):
        module = model.get_submodule(stem)
        a = tensors.get(f"{PEFT_PREFIX}{stem}.lora_A.weight")
        b = tensors.get(f"{PEFT_PREFIX}{stem}.lora_B.weight")
        if a is None or b is None:
            problems.append(f"{stem}: lora_A and lora_B both needed")
        elif tuple(a.shape) != (r, module.in_features) or tuple(b.shape) != (module.out_features, r):
            problems.append(
                f"{stem}: shapes {tuple(a.shape)}, {tuple(b.shape)} for rank {r} on "
                f"{module.in_features} -> {module.out_features}"
            )
    if problems:
        raise ValueError("the adapter does not fit the model: " + "; ".join(problems[:4]))
