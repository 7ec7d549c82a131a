"""Names of model sources, torch-free: what `pkg:<package>` may name and where imports are cached.
Shared by the importer and by `spopp launch`, which may not import the importer (it pulls in torch)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

from pydantic import Field

from spopp.settings import Settings

PACKAGE_PREFIX = "pkg:"
# A distribution's name as the packaging specification allows it (PEP 508), nothing more.
PACKAGE_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")


MODEL_CACHE_ENV = "SPOPP_MODEL_CACHE"


class ModelCacheSettings(Settings):
    """Where imports are cached, read through the settings like every other setting. Its variable
    keeps its documented name (SPOPP_MODEL_CACHE) under a prefix of its own, so the deployment's
    SPOPP_MODEL_BUILD and SPOPP_MODEL_REVISION are never taken for unknown settings of this one."""

    env_prefix: ClassVar[str] = "SPOPP_MODELS_"
    shared_env: ClassVar[Mapping[str, str]] = {**Settings.shared_env, "cache": MODEL_CACHE_ENV}
    cache: Path = Field(
        default_factory=lambda: Path.home() / ".cache" / "spopp" / "models",
        description="fetched wheels, their GGUF files and launch's imports",
    )


def models_cache() -> Path:
    """Fetched wheels, their GGUF files and launch's imports: $SPOPP_MODEL_CACHE, else ~/.cache/spopp/models."""
    return ModelCacheSettings.resolve().cache
