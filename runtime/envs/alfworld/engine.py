"""The ALFWorld text engine (the `alfworld` package on TextWorld's PDDL engine), one game at a time.

The stack is the package's own: `PddlEnv` (TextWorld's PDDL interpreter with the shipped ALFRED
domain and grammar) under `AlfredDemangler` (names like "apple 1") and `AlfredInfos`. We build it
directly rather than through `AlfredTWEnv.init_env`, whose gym wrapper adds subprocesses and a
step limit of its own; the step limit is the environment's (env.py).

The engine is not thread-safe, and not only in C: fast-downward's translator rewrites `sys.argv`
and swaps `sys.stdout` while it runs, and TextWorld parses every command with module-global TatSu
parsers. Two games stepping in two threads corrupt each other (seen: IndexError, FailedToken).
So games run one of two ways:

* in-process (`Game`): every engine call in the process holds one lock. Episodes interleave
  between calls, and Python's GIL would serialize the pure-Python engine anyway;
* in worker processes (`EnginePool`, `RemoteGame`): each worker plays its own games, one call at
  a time, and workers run in parallel on separate cores. A replica with many concurrent episodes
  (the paper's 50-interaction games) needs this on a multi-core node; `AlfworldEnv(workers=N)`.
"""

from __future__ import annotations

import atexit
import itertools
import multiprocessing
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

__all__ = [
    "ENGINE_LOCK",
    "EngineError",
    "EnginePool",
    "Game",
    "Observation",
    "engine_pool",
    "import_engine",
    "require_alfworld",
]

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


def import_engine() -> SimpleNamespace:
    """textworld and alfworld's wrappers, without keeping alfworld's import side effects.

    `alfworld.info` runs at the first alfworld import: it creates `$ALFWORLD_DATA` (default
    `~/.cache/alfworld`) and writes `os.environ["ALFWORLD_DATA"]`. Left in place, a task row without
    a data folder would silently resolve against that empty default; so the variable is put back as
    it was, and the folder removed again if the import created it (and it is still empty).
    """
    before = os.environ.get("ALFWORLD_DATA")
    folder = Path(before or "~/.cache/alfworld").expanduser()
    existed = folder.exists()
    try:
        import textworld
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredExpert, AlfredInfos
        from textworld.envs import PddlEnv
    except ImportError as e:
        raise EngineError(
            f"the alfworld environment needs the alfworld and textworld packages ({e}); "
            "install them with: pip install 'spopp[alfworld]'"
        ) from e
    finally:
        if before is None:
            os.environ.pop("ALFWORLD_DATA", None)
        else:
            os.environ["ALFWORLD_DATA"] = before
        if not existed:
            try:
                folder.rmdir()
            except OSError:
                pass
    return SimpleNamespace(
        textworld=textworld, PddlEnv=PddlEnv, AlfredDemangler=AlfredDemangler, AlfredInfos=AlfredInfos,
        AlfredExpert=AlfredExpert,
    )  # fmt: skip


def require_alfworld() -> None:
    """Fail early, with the install line, where the optional packages are missing."""
    import_engine()


def _strip_banner(text: str) -> str:
    text = text.strip()
    if text.startswith(_BANNER):
        text = text[len(_BANNER) :].lstrip()
    return text


class Game:
    """One game in play in this process. `start(gamefile)` loads it (about 0.5 s); `act(command)`.

    `expert=True` adds the package's planner expert (`AlfredExpert`, fast-downward): every
    observation then carries the plan from the current state. It costs a replan per step; the
    environment never uses it, teachers and tests do. (The package's handcoded expert is not used:
    in alfworld 0.4.2 it still waits for "put" where the grammar says "move", and loses pick_two.)
    """

    def __init__(self, *, expert: bool = False) -> None:
        eng = import_engine()
        infos = eng.textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])
        # shuffle=False: entity numbers follow the game file, so an episode is reproducible.
        env = eng.AlfredInfos(eng.AlfredDemangler(eng.PddlEnv(infos), shuffle=False))
        self._expert = expert
        self._env = eng.AlfredExpert(env, expert_type="planner") if expert else env
        self._loaded = False

    def _observe(self, state) -> Observation:
        plan = tuple(state.get("extra.expert_plan") or ()) if self._expert else ()
        return Observation(
            feedback=_strip_banner(str(state["feedback"])),
            admissible=tuple(state["admissible_commands"] or ()),
            won=bool(state["won"]),
            expert_plan=plan,
        )

    def _call(self, fn, *args):
        with ENGINE_LOCK:
            # Copied under the lock: outside it, another thread's call may have the translator's
            # argv in place, and that is what this call would then put back.
            argv = list(sys.argv)
            try:
                return fn(*args)
            finally:
                sys.argv[:] = argv  # fast-downward's translator leaves its own argv behind

    def start(self, gamefile: str | Path) -> Observation:
        def load_and_reset():
            self._env.load(str(gamefile))
            return self._env.reset()

        try:
            state = self._call(load_and_reset)
        except Exception as e:  # the engine raises its own parser and planner errors
            self._loaded = False
            raise EngineError(f"{gamefile}: the engine cannot load this game: {type(e).__name__}: {e}") from e
        self._loaded = True
        return self._observe(state)

    def act(self, command: str) -> Observation:
        if not self._loaded:
            raise EngineError("act() before start()")
        state, _score, _done = self._call(self._env.step, command)
        return self._observe(state)

    def close(self) -> None:
        env, self._env = self._env, None
        self._loaded = False
        if env is not None:
            self._call(env.close)


# -- worker processes ------------------------------------------------------------------------------


def _serve(conn) -> None:
    """A worker's loop: (op, game id, argument) in, ("ok", value) or ("error", message) out."""
    games: dict[int, Game] = {}
    while True:
        try:
            op, gid, arg = conn.recv()
        except (EOFError, OSError):  # the replica is gone: so is this worker
            break
        try:
            if op == "start":
                game = games.get(gid) or Game(expert=arg[1])
                games[gid] = game
                value = game.start(arg[0])
            elif op == "act":
                value = games[gid].act(arg)
            elif op == "close":
                game = games.pop(gid, None)
                value = game.close() if game is not None else None
            else:
                raise EngineError(f"unknown operation {op!r}")
            conn.send(("ok", value))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}" if not isinstance(e, EngineError) else str(e)))


class _Worker:
    def __init__(self, ctx, index: int) -> None:
        self.index = index
        self.lock = threading.Lock()
        self.games = 0
        self.broken = False  # its pipe failed: it is dead or dying (is_alive lags behind a SIGKILL)
        parent, child = ctx.Pipe()
        self.conn = parent
        self.proc = ctx.Process(target=_serve, args=(child,), name=f"alfworld-engine-{index}", daemon=True)
        self.proc.start()
        child.close()

    def call(self, op: str, gid: int, arg=None):
        with self.lock:  # one request and its answer at a time on this pipe
            try:
                self.conn.send((op, gid, arg))
                status, value = self.conn.recv()
            except (EOFError, OSError) as e:
                self.broken = True
                self.proc.join(timeout=2)
                raise EngineError(
                    f"engine worker {self.index} (pid {self.proc.pid}) died: exit code {self.proc.exitcode}"
                ) from e
        if status == "error":
            raise EngineError(value)
        return value

    def alive(self) -> bool:
        return not self.broken and self.proc.is_alive()

    def stop(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass
        self.proc.join(timeout=5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)


class EnginePool:
    """`size` worker processes; each new game goes to the worker with the fewest games in play.

    Workers are spawned (not forked: the replica's threads and engines must not be copied) and end
    when the replica does, since their pipe closes. A worker that dies fails the games it held with
    an EngineError; the next game gets a fresh worker in its place.
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"an engine pool needs at least one worker, got {size}")
        self.size = size
        self._ctx = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._workers = [_Worker(self._ctx, i) for i in range(size)]

    def game(self, *, expert: bool = False) -> RemoteGame:
        with self._lock:
            for i, w in enumerate(self._workers):
                if not w.alive():
                    w.stop()
                    self._workers[i] = _Worker(self._ctx, i)
            worker = min(self._workers, key=lambda w: w.games)
            worker.games += 1
        return RemoteGame(self, worker, next(self._ids), expert)

    def _release(self, worker: _Worker) -> None:
        with self._lock:
            worker.games -= 1

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def close(self) -> None:
        for w in self._workers:
            w.stop()


class RemoteGame:
    """A game played in a pool worker; the same interface as `Game`."""

    def __init__(self, pool: EnginePool, worker: _Worker, gid: int, expert: bool) -> None:
        self._pool, self._worker, self._gid, self._expert = pool, worker, gid, expert
        self._open = True

    def start(self, gamefile: str | Path) -> Observation:
        return self._worker.call("start", self._gid, (str(gamefile), self._expert))

    def act(self, command: str) -> Observation:
        return self._worker.call("act", self._gid, command)

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        try:
            self._worker.call("close", self._gid)
        except EngineError:
            pass  # a dead worker took the game with it
        finally:
            self._pool._release(self._worker)


_POOLS: dict[int, EnginePool] = {}
_POOLS_LOCK = threading.Lock()


def engine_pool(size: int) -> EnginePool:
    """The process's pool of `size` workers, started at first use and shared by every episode."""
    with _POOLS_LOCK:
        pool = _POOLS.get(size)
        if pool is None:
            pool = _POOLS[size] = EnginePool(size)
        return pool


@atexit.register
def _close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
