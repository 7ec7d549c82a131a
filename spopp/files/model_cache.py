"""The model cache: where fetched model packages, their imports and spopp's tiny test model are
kept on a machine ($SPOPP_MODEL_CACHE, else ~/.cache/spopp/models), and how a folder is made in it
once however many processes ask at the same time.

Torch-free: `spopp launch` reads the cache's location, and the launcher may not import torch.
"""

from __future__ import annotations

import fcntl
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import ClassVar

from pydantic import Field

from spopp.settings.base import Settings

MODEL_CACHE_ENV = "SPOPP_MODEL_CACHE"


class ModelCacheSettings(Settings):
    """Where models are cached, read through the settings like every other setting. Its variable
    keeps its documented name (SPOPP_MODEL_CACHE) under a prefix of its own, so the deployment's
    SPOPP_MODEL_BUILD and SPOPP_MODEL_REVISION are never taken for unknown settings of this one."""

    env_prefix: ClassVar[str] = "SPOPP_MODELS_"
    shared_env: ClassVar[Mapping[str, str]] = {**Settings.shared_env, "cache": MODEL_CACHE_ENV}
    cache: Path = Field(
        default_factory=lambda: Path.home() / ".cache" / "spopp" / "models",
        description="fetched wheels, their GGUF files, launch's imports and the tiny test model",
    )


def models_cache() -> Path:
    """The model cache: $SPOPP_MODEL_CACHE, else ~/.cache/spopp/models."""
    return ModelCacheSettings.resolve().cache


def built_once(target: Path, build: Callable[[Path], object]) -> Path:
    """`target`, made by `build(folder)` unless it is there already. Under a file lock, so that
    concurrent processes build it once and the others wait for it; built aside and then renamed,
    so that no reader ever sees half a folder, and a build that fails leaves nothing behind."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.is_dir():
            staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".building-"))
            try:
                build(staging / "model")
                (staging / "model").rename(target)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return target
