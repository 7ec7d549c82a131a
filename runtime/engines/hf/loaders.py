"""Snapshot loading for the transformers engine: full weights, or a LoRA adapter on the base.

Loading is split in two: `WeightLoader.prepare` reads a snapshot folder and checks all of it
against the model, outside any lock (a bad snapshot raises and changes nothing); the copy it
returns then writes the tensors into the model in place, which the engine runs while no row
decodes. The model object stays the same, so whoever holds it sees the new weights.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


class WeightLoader:
    def __init__(self) -> None:
        # The adapter layout injected by the first LoRA snapshot (rank, alpha, targets, rsLoRA);
        # None while the model holds plain weights.
        self.lora: tuple | None = None

    def prepare(self, model, folder: Path) -> Callable[[], None]:
        """The copy that swaps the snapshot in `folder` into `model`; ValueError (or
        FileNotFoundError) when it does not fit, before anything changes."""
        from spopp.files.adapters import is_adapter_folder

        if is_adapter_folder(folder):
            return self._adapter(model, folder)
        if self.lora is not None:
            raise ValueError(
                f"snapshot {folder} holds full weights but this engine runs LoRA adapters on its base: "
                "one run publishes one kind (restart the engine to change it)"
            )
        return full_weights(model, folder)

    def _adapter(self, model, folder: Path) -> Callable[[], None]:
        """A LoRA snapshot: the first injects PEFT's adapter layers into the base (loaded once, at
        start-up); every one copies its adapter tensors into them in place."""
        from spopp.files.adapters import adapter_targets, check_adapter_fits, read_adapter

        config, tensors = read_adapter(folder)
        layout = (config["r"], config["lora_alpha"], tuple(sorted(config["target_modules"])),
                  bool(config.get("use_rslora")))  # fmt: skip
        if self.lora is not None and layout != self.lora:
            raise ValueError(
                f"adapter {folder} has rank/alpha/targets {layout[:3]}, the engine holds {self.lora[:3]}: "
                "one run's adapters share a layout (restart the engine to change it)"
            )
        check_adapter_fits(model, tensors, config)
        targets = adapter_targets(tensors)  # saved name -> the injected parameter's name

        def copy() -> None:
            if self.lora is None:
                from peft import LoraConfig, inject_adapter_in_model

                lora = LoraConfig(r=config["r"], lora_alpha=config["lora_alpha"], lora_dropout=0.0,
                                  target_modules=list(config["target_modules"]),
                                  use_rslora=bool(config.get("use_rslora")))  # fmt: skip
                inject_adapter_in_model(lora, model)
                model.eval()
                self.lora = layout
            params = dict(model.named_parameters())
            for name, tensor in tensors.items():
                params[targets[name]].copy_(tensor)

        return copy


def full_weights(model, folder: Path) -> Callable[[], None]:
    """A snapshot of every weight (*.safetensors in `folder`)."""
    import torch
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    # Tied weights appear once in named_parameters() but a checkpoint may hold either name.
    targets = dict(model.named_parameters(remove_duplicate=False))
    required = {name for name, _ in model.named_parameters()}
    unknown = sorted(set(state) - set(targets))
    missing = sorted(n for n in required if n not in state and not _has_alias(model, n, state))
    bad_shape = sorted(n for n in state if n in targets and state[n].shape != targets[n].shape)
    if unknown or missing or bad_shape:
        raise ValueError(
            f"snapshot {folder} does not fit: unknown={unknown} missing={missing} shape={bad_shape}"
        )

    def copy() -> None:
        for name, tensor in state.items():
            targets[name].copy_(tensor)

    return copy


def _has_alias(model, name: str, state: dict) -> bool:
    """Whether `name` is tied to a parameter the checkpoint does hold (e.g. lm_head = embeddings)."""
    target = dict(model.named_parameters(remove_duplicate=False))[name]
    return any(n in state and p is target for n, p in model.named_parameters(remove_duplicate=False))
