"""Import paths `package.module:attribute`: their shape and the object one names.

A leaf: the environment registry resolves a spec through it, and the environments whose options
name a function (a reward, an agent, a verifiers taskset) import that function through it, without
importing the registry that in turn imports them.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

PATH_RE = re.compile(
    r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
)


class EnvSpecError(ValueError):
    """A spec that names no environment; the message says why."""


def is_import_path(text: str) -> bool:
    """Whether `text` has the shape `package.module:attribute`."""
    return isinstance(text, str) and PATH_RE.fullmatch(text) is not None


def import_object(path: str, what: str | None = None) -> Any:
    """The object at import path `path` (`package.module:attribute`); EnvSpecError saying what is
    missing (the module, something it imports, the attribute), about `what` (default: the
    environment `path`; "reward ...", "agent ..." for a function an environment's options name)."""
    what = what or f"environment {path}"
    module_name, _, attribute = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise EnvSpecError(
                f"{what}: no module named {e.name!r} (is the package installed, or its folder on PYTHONPATH?)"
            ) from None
        raise EnvSpecError(f"{what}: importing {module_name} failed: {e}") from None
    except Exception as e:  # noqa: BLE001 - the user's module raised at import: say so, with what
        raise EnvSpecError(f"{what}: importing {module_name} failed: {type(e).__name__}: {e}") from None
    for part in attribute.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise EnvSpecError(f"{what}: module {module_name} has no attribute {attribute!r}") from None
    return obj
