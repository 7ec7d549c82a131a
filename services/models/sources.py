"""Names of model sources, torch-free: what `pkg:<package>` may name. Shared by the importer and by
`spopp launch`, which may not import the importer (it pulls in torch). Where imports are cached is
spopp/files/model_cache.py."""

from __future__ import annotations

import re

PACKAGE_PREFIX = "pkg:"
# A distribution's name as the packaging specification allows it (PEP 508), nothing more.
PACKAGE_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")
