"""Environments behind one small interface (`base.Environment`), one module per implementation.

Every environment, spopp's own included, is found the same way (`registry.resolve`): by the name
an installed package registers under the entry-point group `spopp.environments`, or by an import
path. `env_factory` checks it once, at start-up, and gives the services a constructor of fresh
episodes.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from .base import Environment, Playable
from .import_path import EnvSpecError
from .registry import check_spec, installed, resolve

__all__ = [
    "EnvSpecError",
    "Environment",
    "Playable",
    "check_spec",
    "env_factory",
    "installed",
    "resolved_env_options",
]


def resolved_env_options(spec: str, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Every option environment `spec` runs with: its keyword defaults, overridden by `options`
    (what run.json and the map record, so that a default is written down too, e.g. toy-calc's
    time_neutral: false). Sorted by name; options it does not know are kept as given."""
    r = resolve(spec, options)
    defaults = {}
    for p in inspect.signature(r.cls.__init__).parameters.values():
        if p.kind is p.KEYWORD_ONLY and p.default is not p.empty:
            defaults[p.name] = p.default
    return dict(sorted({**defaults, **r.options}.items()))


def env_factory(spec: str, options: Mapping[str, Any] | None = None) -> Callable[[], Playable]:
    """A constructor of fresh episodes of environment `spec`, checked once here.

    `options` are the environment's keyword arguments (the services' `env_options` setting). One
    environment is built with the options and closed, then the class's `prepare` checks the
    machine (the sandbox for math-tir, the alfworld packages), so that a missing dependency, an unknown or a
    bad option fails at start-up naming the environment, not in the first episode. Used by the
    rollout replica, the evaluator, `spopp prior` and `spopp env check`.
    """
    r = resolve(spec, options)
    try:
        r.cls(**r.options).close()  # the options first: no process starts for a misspelt one
        r.cls.prepare(r.options)
    except TypeError as e:  # an unknown or missing keyword
        raise EnvSpecError(f"environment {spec}: bad env_options {r.options}: {e}") from None
    except ValueError as e:  # an option's own check, or a function its options name (EnvSpecError)
        message = str(e)
        raise EnvSpecError(
            message if message.startswith(f"environment {spec}") else f"environment {spec}: {message}"
        ) from None

    cls, built = r.cls, r.options

    def make() -> Playable:
        return cls(**built)

    return make
