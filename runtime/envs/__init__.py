"""Environments behind one small interface (`base.Environment`), one module per implementation."""

from __future__ import annotations

from collections.abc import Callable

from .base import Environment

ENVIRONMENTS = ("math-tir", "toy-calc")


def env_factory(name: str) -> Callable[[], Environment]:
    """A constructor of fresh episodes of environment `name`, checked once here.

    The check runs what the environment needs from the machine (the sandbox for math-tir) so a
    missing dependency fails at start-up rather than in the first episode. Used by the rollout
    replica and by the learner's evaluation.
    """
    if name == "math-tir":
        from ..sandbox import SandboxConfig, check_sandbox
        from .math_tir import MathTIREnv

        check_sandbox(SandboxConfig())

        def make() -> Environment:
            return MathTIREnv(SandboxConfig())

        return make
    if name == "toy-calc":
        # No machine dependency: the tool is evaluated in-process by a tiny integer parser.
        from .toy_calc import ToyCalcEnv

        return ToyCalcEnv
    raise ValueError(f"unknown environment {name!r}; expected one of {', '.join(ENVIRONMENTS)}")
