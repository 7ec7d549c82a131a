"""The reasoning-gym scorer, run in a reward worker (runtime.envs.single_turn's pool).

reasoning_gym is imported here at the top on purpose: the worker imports this module before it
says it is ready, so the package's import is paid once at the worker's start, not inside the
first answer's time limit (see SCORER in runtime/envs/reasoning_gym.py).
"""

from __future__ import annotations

import reasoning_gym

from .base import Task
from .reasoning_gym import extract


def score(answer_text: str, task: Task) -> float:
    """The family's own scorer on the extracted answer."""
    name = task.meta.get("rg_dataset")
    entry = task.meta.get("rg_entry")
    if not isinstance(name, str) or not isinstance(entry, dict):
        raise ValueError(
            f"task {task.task_id} is not a reasoning-gym task (no rg_dataset/rg_entry in its meta)"
        )
    return float(reasoning_gym.get_score_answer_fn(name)(extract(answer_text), entry))
