"""`spopp model render`: a task's opening prompt as a replica renders it for a model.

What a user checks before a run on a new model: the model's own chat template on the environment's
messages (system prompt, worked examples, the task), the number of tokens it opens with, the
vocabulary and the context. `spopp launch --check` shows it for the run's first training task.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class RenderedPrompt:
    model: str
    vocab: int
    context: int | None
    task_id: str
    tokens: int
    text: str

    def as_dict(self) -> dict:
        return asdict(self)


def render_first_prompt(model: Path, tasks: Path, env: str, env_options: dict) -> RenderedPrompt:
    """The first task of `tasks`, opened by `env` and rendered by `model`'s chat template (ValueError
    or OSError, with the reason, when it cannot be)."""
    from transformers import AutoConfig, AutoTokenizer

    from runtime.chat import ChatRenderer
    from runtime.envs import env_factory
    from runtime.tasks import load_tasks

    tokenizer = AutoTokenizer.from_pretrained(model)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{model}: the tokenizer has no chat template; episodes are chats")
    tasks_read = load_tasks(tasks)
    if not tasks_read:
        raise ValueError(f"{tasks}: no tasks")
    first = tasks_read[0]
    episode = env_factory(env, env_options)()
    context = getattr(AutoConfig.from_pretrained(model), "max_position_embeddings", None)
    opening = episode.opening(first)
    if opening is None:  # an agent's episode: its agent writes the opening, call by call
        text = "(an agent's episode: the agent writes its own messages; spopp env check plays one)"
        return RenderedPrompt(str(model), len(tokenizer), context, first.task_id, 0, text)
    ids = ChatRenderer(tokenizer).prompt(opening)
    return RenderedPrompt(str(model), len(tokenizer), context, first.task_id, len(ids), tokenizer.decode(ids))
