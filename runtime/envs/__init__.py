"""Environments behind one small interface (`base.Environment`), one module per implementation."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any

from .base import Environment

log = logging.getLogger("spopp.sandbox")

ENVIRONMENTS = ("math-tir", "toy-calc", "alfworld")


def _env_class(name: str) -> type[Environment] | None:
    """The class of environment `name` (None for math-tir, which takes no options); imports no
    optional package (alfworld's engine loads on its first game)."""
    if name == "toy-calc":
        from .toy_calc import ToyCalcEnv

        return ToyCalcEnv
    if name == "alfworld":
        from .alfworld.env import AlfworldEnv

        return AlfworldEnv
    if name == "math-tir":
        return None
    raise ValueError(f"unknown environment {name!r}; expected one of {', '.join(ENVIRONMENTS)}")


def resolved_env_options(name: str, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Every option environment `name` runs with: its keyword defaults, overridden by `options`
    (what run.json and the map record, so that a default is written down too, e.g. toy-calc's
    time_neutral: false). Sorted by name; options it does not know are kept as given."""
    cls = _env_class(name)
    defaults = {}
    if cls is not None:
        for p in inspect.signature(cls.__init__).parameters.values():
            if p.kind is p.KEYWORD_ONLY and p.default is not p.empty:
                defaults[p.name] = p.default
    return dict(sorted({**defaults, **(options or {})}.items()))


def env_factory(name: str, options: Mapping[str, Any] | None = None) -> Callable[[], Environment]:
    """A constructor of fresh episodes of environment `name`, checked once here.

    `options` are the environment's keyword arguments (the services' `env_options` setting); one
    environment is built with them here, so an unknown or bad option fails at start-up with its
    name, as does a missing dependency of the machine (the sandbox for math-tir, the alfworld
    packages for alfworld), rather than in the first episode. Used by the rollout replica, the
    evaluator and `spopp prior`.
    """
    options = dict(options or {})
    if name == "math-tir":
        from ..check_pool import shared_pool
        from ..sandbox import SandboxConfig, bounds, check_sandbox
        from .math_tir import MathTIREnv

        if options:
            raise ValueError(f"environment math-tir takes no env_options, got {sorted(options)}")
        check_sandbox(SandboxConfig())
        log.info(bounds(SandboxConfig()))
        shared_pool().warm()  # the answer checks' first worker starts now, not in the first episode

        def make() -> Environment:
            return MathTIREnv(SandboxConfig())

        return make
    if name == "toy-calc":
        # No machine dependency: the tool is evaluated in-process by a tiny integer parser.
        from .toy_calc import ToyCalcEnv

        cls: type[Environment] = ToyCalcEnv
    elif name == "alfworld":
        from .alfworld.engine import require_alfworld
        from .alfworld.env import AlfworldEnv

        require_alfworld()
        cls = AlfworldEnv
    else:
        raise ValueError(f"unknown environment {name!r}; expected one of {', '.join(ENVIRONMENTS)}")
    try:
        cls(**options).close()
    except TypeError as e:  # an unknown keyword
        raise ValueError(f"environment {name}: bad env_options {options}: {e}") from None

    def make_with_options() -> Environment:
        return cls(**options)

    return make_with_options
