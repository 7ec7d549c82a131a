"""Names of model sources, torch-free: what `pkg:<package>` may name and where imports are cached.
Shared by the importer and by `spopp launch`, which may not import the importer (it pulls in torch)."""

from __future__ import annotations

import os
import re
from pathlib import Path

PACKAGE_PREFIX = "pkg:"
# A distribution's name as the packaging specification allows it (PEP 508), nothing more.
PACKAGE_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")


def models_cache() -> Path:
    """Fetched wheels, their GGUF files and launch's imports: $SPOPP_MODEL_CACHE, else ~/.cache/spopp/models."""
    return Path(os.environ.get("SPOPP_MODEL_CACHE", Path.home() / ".cache" / "spopp" / "models"))
