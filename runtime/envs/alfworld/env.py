"""ALFWorld as a spopp environment (`alfworld`): a household text game, reward 1 iff it is won.

An episode: `reset(task)` loads the task's game and answers with the game's opening (the room and
"Your task is to: ...") and the admissible actions; each model turn is one action, sent to the
game as the model wrote it (after taking it out of its format, below), and the game's own answer
comes back: "Nothing happens." for an action the game does not admit, exactly as ALFWorld says it.
The whole interaction history stays in context (it is the chat), and everything the game says is
an observation, so it is masked out of the loss by the agent loop.

Two action formats:
* `line` (stop "\\n"): the first non-empty line of the turn, lowercased, a final "." dropped; for
  small models that answer with the action alone;
* `tag` (stop "</action>"): the text inside the last `<action>...</action>`, so a model may think
  first, as verl-agent's ALFWorld prompt asks; a turn without the tag is an invalid action.

Where games run: `workers=0` (the default) plays them in the replica's process, one engine call
at a time (engine.py says why); `workers=N` plays them in a pool of N processes shared by the
replica's episodes, so game loads and steps use N cores.

The game never ends an episode by itself except by a win, so the environment counts interactions:
after `max_steps` (the paper: 50) the episode ends with reward 0, finish "max_steps". The run's
budget (`max_turns`) should leave room for them, or the budget cuts the episode first.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from ..base import Environment, StepResult, Task
from .engine import INVALID_FEEDBACK, Game, Observation, engine_pool
from .games import GameFileError, game_path, read_game

__all__ = ["AlfworldEnv", "parse_action"]

ActionFormat = Literal["line", "tag"]
ACTION_FORMATS = ("line", "tag")
_ACTION_RE = re.compile(r"<action>(.*?)</action>", re.DOTALL)
# The engine matches commands exactly; anything longer than this is not a command of the grammar.
MAX_ACTION_CHARS = 200

SYSTEM_PROMPTS = {
    "line": (
        "You are an agent in a household. Each turn, reply with exactly one of the admissible actions, "
        "on one line, and nothing else."
    ),
    "tag": (
        "You are an agent in a household. Each turn, think briefly if you need to, then give exactly one "
        "of the admissible actions inside <action></action>, for example <action>go to desk 1</action>."
    ),
}


def parse_action(text: str, action_format: ActionFormat) -> str | None:
    """The command in a model turn, or None when the turn holds none in `action_format`."""
    if action_format == "tag":
        # A stop string ends generation before its own text reaches us in some engines.
        found = _ACTION_RE.findall(text if "</action>" in text else text + "</action>")
        command = found[-1] if found else None
    else:
        lines = [line for line in text.splitlines() if line.strip()]
        command = lines[0] if lines else None
    if command is None:
        return None
    command = " ".join(command.split()).lower().rstrip(".").strip()
    return command if 0 < len(command) <= MAX_ACTION_CHARS else None


class AlfworldEnv(Environment):
    name = "alfworld"
    cheap_reset = False  # a game load per opening; see Environment.cheap_reset

    @classmethod
    def prepare(cls, options: dict[str, Any]) -> None:
        """The alfworld and textworld packages must be installed (their engine loads on the first game)."""
        from .engine import require_alfworld

        require_alfworld()

    def __init__(
        self,
        *,
        max_steps: int = 50,
        action_format: ActionFormat = "line",
        show_admissible: bool = True,
        system_prompt: str | None = None,
        data_root: str | None = None,
        workers: int = 0,
    ) -> None:
        if not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps < 1:
            raise ValueError(f"max_steps must be an integer >= 1, got {max_steps!r}")
        if not isinstance(workers, int) or isinstance(workers, bool) or not 0 <= workers <= 256:
            raise ValueError(f"workers must be an integer in [0, 256], got {workers!r}")
        if action_format not in ACTION_FORMATS:
            raise ValueError(f"action_format must be one of {ACTION_FORMATS}, got {action_format!r}")
        self.max_steps = max_steps
        self.action_format = action_format
        self.show_admissible = bool(show_admissible)
        self.system_prompt = SYSTEM_PROMPTS[action_format] if system_prompt is None else system_prompt
        self.data_root = data_root
        self.workers = workers
        self.stop = ("</action>",) if action_format == "tag" else ("\n",)
        self._game: Game | None = None
        self.task: Task | None = None
        self.steps = self.invalid = 0
        self.done = True
        self._last_admissible: tuple[str, ...] = ()

    def _text(self, obs: Observation) -> str:
        if not self.show_admissible:
            return obs.feedback
        return f"{obs.feedback}\n\nAdmissible actions: {', '.join(obs.admissible)}"

    def _info(self, **extra: Any) -> dict[str, Any]:
        task_type = self.task.meta.get("task_type") if self.task is not None else None
        return {"steps": self.steps, "invalid": self.invalid, "task_type": task_type, **extra}

    def reset(self, task: Task) -> list[dict]:
        if not task.answer:
            raise GameFileError(f"task {task.task_id}: no game (`answer` must be <split>/<folder>/<trial>)")
        path = game_path(task.answer, task.meta.get("alfworld_data") or self.data_root)
        read_game(path)  # a clear error for a broken file before the engine's own
        if self._game is None:
            self._game = engine_pool(self.workers).game() if self.workers else Game()
        obs = self._game.start(path)
        self.task = task
        self.steps = self.invalid = 0
        self.done = False
        self._last_admissible = obs.admissible
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return messages + [{"role": "user", "content": self._text(obs)}]

    def step(self, action: str) -> StepResult:
        if self._game is None or self.done:
            raise RuntimeError("step() needs a reset() first, and the episode is over")
        self.steps += 1
        command = parse_action(action, self.action_format)
        if command is None:
            # No command in the turn: the game is not asked, and says what it says to a bad command.
            self.invalid += 1
            obs = Observation(INVALID_FEEDBACK, self._last_admissible, won=False)
        else:
            obs = self._game.act(command)
            if obs.feedback == INVALID_FEEDBACK:
                self.invalid += 1
        self._last_admissible = obs.admissible
        if obs.won:
            self.done = True
            return StepResult([], done=True, reward=1.0, info=self._info(finish="won"))
        if self.steps >= self.max_steps:
            self.done = True
            return StepResult([], done=True, reward=0.0, info=self._info(finish="max_steps"))
        return StepResult([{"role": "user", "content": self._text(obs)}], done=False, info=self._info())

    def close(self) -> None:
        if self._game is not None:
            self._game.close()
            self._game = None
        self.done = True
