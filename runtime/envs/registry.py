"""Which environment a spec names: an installed plug-in's name, or an import path.

A spec is one of:

* a name that an installed package registers in the entry-point group `spopp.environments`
  (spopp's own `math-tir`, `toy-calc`, `alfworld`, `single-turn`, `agent`, `reasoning-gym` and
  `verifiers` are registered there by its pyproject.toml, exactly as a user's package would be);
* an import path `package.module:attribute`, importable where the service runs.

What the name or path points at decides how it is played:

* an `Environment` subclass: the environment itself, built with the run's `env_options`;
* an `async def` function `agent(client, task) -> float`: an agent that drives its episode through
  the replica's OpenAI-compatible endpoint (`runtime.envs.agent.AgentEnv`);
* any other function `score(answer_text, task) -> float`: the reward of a single-turn task
  (`runtime.envs.single_turn.SingleTurnEnv`), called out of process with a time limit.

Nothing is imported until `resolve`, so settings validate a spec's shape without loading it (the
services' `--help` stays instant); `resolve` fails with a message that says what is wrong: no such
name, no such module, no such attribute, or an object that is none of the three.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator

from .base import Playable
from .import_path import PATH_RE, EnvSpecError, import_object

GROUP = "spopp.environments"

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def check_spec(spec: str) -> str:
    """`spec` if it is an installed name or has the shape of an import path (nothing is imported)."""
    if not isinstance(spec, str):
        raise EnvSpecError(f"an environment is a name or module:attribute, got {type(spec).__name__}")
    if PATH_RE.fullmatch(spec):
        return spec
    if ":" not in spec and _NAME_RE.fullmatch(spec):
        # A name is looked up in the installed packages' metadata (no module is imported).
        names = installed()
        if spec not in names:
            raise EnvSpecError(
                f"unknown environment {spec!r}; installed: {', '.join(sorted(names)) or 'none: is spopp installed?'}; or give "
                "an import path package.module:attribute"
            )
        return spec
    raise EnvSpecError(
        f"environment {spec!r}: expected a registered name (e.g. toy-calc) or an import path "
        "package.module:attribute"
    )


# The settings' type of an environment, a registered name or an import path (the services' and the
# launch file's `env`): its shape is checked when settings load, what it names when the service starts
# (`resolve`).
EnvName = Annotated[str, AfterValidator(check_spec)]
# The settings' type of `env_options`: a mapping; unset (compose's empty `${SPOPP_ENV_OPTIONS:-}`
# arrives as None) is no options.
EnvOptions = Annotated[dict, BeforeValidator(lambda v: {} if v is None else v)]
ENV_HELP = (
    "environment: a name an installed package registers (math-tir, toy-calc, alfworld, single-turn, "
    "agent, ...) or an import path package.module:attribute (an Environment class, an async agent "
    "function, or a reward function); see docs/environments.md"
)


def installed() -> dict[str, metadata.EntryPoint]:
    """The names of the group, as the installed packages register them (the first of a name wins,
    as importlib lists the distributions)."""
    out: dict[str, metadata.EntryPoint] = {}
    for ep in metadata.entry_points(group=GROUP):
        out.setdefault(ep.name, ep)
    return out


@dataclass(frozen=True)
class Resolved:
    """What a spec resolves to: the environment class and the options it is built with (for a
    function, the adapter class and its options with the function's path added)."""

    cls: type[Playable]
    options: dict[str, Any]


def load(spec: str) -> Any:
    """The object `spec` names (a class or a function), imported."""
    check_spec(spec)  # an import path's shape, or a name that is installed
    if ":" in spec:
        return import_object(spec)
    return import_object(installed()[spec].value.replace(" ", ""), f"environment {spec}")


def resolve(spec: str, options: Mapping[str, Any] | None = None) -> Resolved:
    """The environment class `spec` names and the options to build it with."""
    options = dict(options or {})
    obj = load(spec)
    if inspect.isclass(obj):
        if not issubclass(obj, Playable):  # an Environment, or an agent's (AgentEnv and its kin)
            raise EnvSpecError(
                f"environment {spec}: {obj.__module__}.{obj.__qualname__} is a class but not a "
                "runtime.envs.base.Environment (subclass it: reset, step, close)"
            )
        return Resolved(obj, options)
    if inspect.iscoroutinefunction(obj):
        from .agent import AgentEnv

        return Resolved(AgentEnv, {**options, "agent": _path_of(obj, spec)})
    if inspect.isfunction(obj) or inspect.isbuiltin(obj):
        from .single_turn import SingleTurnEnv

        return Resolved(SingleTurnEnv, {**options, "reward": _path_of(obj, spec)})
    raise EnvSpecError(
        f"environment {spec}: names a {type(obj).__name__}, not an Environment class, an async agent "
        "function (client, task) -> float or a reward function (answer_text, task) -> float"
    )


def _path_of(fn: Any, spec: str) -> str:
    """The import path of function `fn` (what a worker process imports it by)."""
    if ":" in spec:
        return spec
    return f"{fn.__module__}:{fn.__qualname__}"
