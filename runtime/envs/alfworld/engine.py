"""The ALFWorld text engine (the `alfworld` package on TextWorld's PDDL engine), one game at a time.

The stack is the package's own: `PddlEnv` (TextWorld's PDDL interpreter with the shipped ALFRED
domain and grammar) under `AlfredDemangler` (names like "apple 1") and `AlfredInfos`. We build it
directly rather than through `AlfredTWEnv.init_env`, whose gym wrapper adds subprocesses and a
step limit of its own; the step limit is the environment's (env.py).

The engine is not thread-safe, and not only in C: fast-downward's translator rewrites `sys.argv`
and swaps `sys.stdout` while it runs, and TextWorld parses every command with module-global TatSu
parsers. Two games stepping in two threads corrupt each other (seen: IndexError, FailedToken).
So every engine call in a process holds one lock; episodes still interleave between calls, and
the rollout's thread pool keeps the event loop free while a reset (about 0.5 s) runs.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ENGINE_LOCK", "EngineError", "Game", "Observation", "require_alfworld"]

ENGINE_LOCK = threading.Lock()
INVALID_FEEDBACK = "Nothing happens."
_BANNER = "-= Welcome to TextWorld, ALFRED! =-"


class EngineError(RuntimeError):
    """The engine could not load or play a game (the message says which and why)."""


@dataclass(frozen=True)
class Observation:
    feedback: str
    admissible: tuple[str, ...]
    won: bool
    # The planner's plan from this state (its first command is the next move); only with expert=True.
    expert_plan: tuple[str, ...] = ()


def require_alfworld() -> None:
    """Fail early, with the install line, where the optional packages are missing."""
    try:
        import alfworld.agents.environment.alfred_tw_env  # noqa: F401
        import textworld.envs  # noqa: F401
    except ImportError as e:
        raise EngineError(
            f"the alfworld environment needs the alfworld and textworld packages ({e}); "
            "install them with: pip install 'spopp[alfworld]'"
        ) from e


def _strip_banner(text: str) -> str:
    text = text.strip()
    if text.startswith(_BANNER):
        text = text[len(_BANNER) :].lstrip()
    return text


class Game:
    """One game in play. `start(gamefile)` loads it (about 0.5 s); `act(command)` plays a command.

    `expert=True` adds the package's planner expert (`AlfredExpert`, fast-downward): every
    observation then carries the plan from the current state. It costs a replan per step; the
    environment never uses it, teachers and tests do. (The package's handcoded expert is not used:
    in alfworld 0.4.2 it still waits for "put" where the grammar says "move", and loses pick_two.)
    """

    def __init__(self, *, expert: bool = False) -> None:
        require_alfworld()
        import textworld
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredExpert, AlfredInfos
        from textworld.envs import PddlEnv

        infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])
        # shuffle=False: entity numbers follow the game file, so an episode is reproducible.
        env = AlfredInfos(AlfredDemangler(PddlEnv(infos), shuffle=False))
        self._expert = expert
        self._env = AlfredExpert(env, expert_type="planner") if expert else env
        self._loaded = False

    def _observe(self, state) -> Observation:
        plan = tuple(state.get("extra.expert_plan") or ()) if self._expert else ()
        return Observation(
            feedback=_strip_banner(str(state["feedback"])),
            admissible=tuple(state["admissible_commands"] or ()),
            won=bool(state["won"]),
            expert_plan=plan,
        )

    def start(self, gamefile: str | Path) -> Observation:
        argv = list(sys.argv)
        with ENGINE_LOCK:
            try:
                self._env.load(str(gamefile))
                state = self._env.reset()
            except Exception as e:  # the engine raises its own parser and planner errors
                self._loaded = False
                raise EngineError(
                    f"{gamefile}: the engine cannot load this game: {type(e).__name__}: {e}"
                ) from e
            finally:
                sys.argv[:] = argv  # fast-downward's translator leaves its own argv behind
        self._loaded = True
        return self._observe(state)

    def act(self, command: str) -> Observation:
        if not self._loaded:
            raise EngineError("act() before start()")
        argv = list(sys.argv)
        with ENGINE_LOCK:
            try:
                state, _score, _done = self._env.step(command)
            finally:
                sys.argv[:] = argv  # the expert's replanning translates again
        return self._observe(state)

    def close(self) -> None:
        env, self._env = self._env, None
        self._loaded = False
        if env is not None:
            with ENGINE_LOCK:
                env.close()
