"""reasoning-gym's procedural tasks (`reasoning-gym`): any of its datasets, scored by its own scorer.

reasoning-gym (the `reasoning-gym` package, offline) generates tasks of about a hundred families
(`chain_sum`, `countdown`, `knights_knaves`, ...) from a seed, each with options for its difficulty,
and ships a scorer per family. Here:

* `generate_tasks(dataset, n, seed, options)` / `write_reasoning_gym_tasks`: task files for
  `load_tasks`. The training tasks are items 0..n-1 of the dataset made with `seed`; the held-out
  tasks come from seed + HELDOUT_SEED_OFFSET. reasoning-gym draws item i of seed s from
  `Random(s + i)`, so seeds s and s + 1 share all but one item: the offset keeps the two item
  ranges apart for any n below it, and a held-out item whose question a training item also asks
  (a small family repeats itself) is dropped. Each task keeps its whole entry in
  `meta["rg_entry"]` (what the scorer reads) and the family in `meta["rg_dataset"]`.
* `ReasoningGymEnv`: one turn (the question, after a system prompt that asks for the answer
  inside <answer></answer>), scored by the family's own `score_answer` on the extracted answer,
  out of process with a time limit (`runtime.envs.single_turn`: some scorers parse or evaluate
  what the model wrote).

`spopp tasks reasoning-gym DATASET` writes the task files (runtime/tasks_cli.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..tasks import write_jsonl
from .base import Task
from .single_turn import SingleTurnEnv

# reasoning-gym's own instruction style: the answer inside <answer></answer>, nothing else there.
SYSTEM_PROMPT = (
    "Think about the problem, then give only the final answer inside <answer></answer>, "
    "for example <answer>42</answer>."
)
HELDOUT_SEED_OFFSET = 1_000_000_007
# The worked examples of `shots` come from this seed of the task's own family and options: far from
# any training seed s (items s..s+n) and from the held-out ones (s + HELDOUT_SEED_OFFSET + i).
SHOTS_SEED = 3 * HELDOUT_SEED_OFFSET
MAX_SHOTS = 8
# The scorer lives in a module of its own that imports reasoning-gym at its top: a reward worker
# imports it before it is ready (runtime.sandbox.check_pool's preload), so the package's import, several
# seconds on a loaded machine, is not charged to the first answers' reward_timeout_s (at 5 s, 5 of
# 8 first checks of a pilot were killed and scored 0 when the import happened inside the check).
SCORER = "runtime.envs.reasoning_gym_score:score"


def _dataset(name: str, size: int, seed: int, options: dict[str, Any]):
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError("the reasoning-gym package is missing: pip install 'spopp[reasoning-gym]'") from None
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        raise ValueError(
            f"reasoning-gym has no dataset {name!r}; e.g. {', '.join(sorted(DATASETS)[:8])}, ..."
        )
    try:
        return reasoning_gym.create_dataset(name, size=size, seed=seed, **options)
    except TypeError as e:  # an option the family's config does not have
        raise ValueError(f"reasoning-gym {name}: bad options {options}: {e}") from None


def _task(name: str, split: str, seed: int, index: int, entry: dict, options: dict) -> Task:
    entry = json.loads(json.dumps(entry))  # as a task file keeps it (tuples become lists)
    return Task(
        task_id=f"rg-{name}-{split}-{seed}-{index}",
        prompt=entry["question"],
        answer=str(entry["answer"]),
        meta={"rg_dataset": name, "rg_entry": entry, "rg_options": options},
    )


def generate_tasks(
    name: str, n_train: int, n_heldout: int, seed: int = 0, options: dict[str, Any] | None = None
) -> tuple[list[Task], list[Task]]:
    """(train, held-out) tasks of dataset `name`; the same arguments, the same tasks."""
    if not (0 < n_train < HELDOUT_SEED_OFFSET and 0 <= n_heldout < HELDOUT_SEED_OFFSET):
        raise ValueError(f"task counts must be in [1, {HELDOUT_SEED_OFFSET}), got {n_train} and {n_heldout}")
    options = dict(options or {})
    train = [
        _task(name, "train", seed, i, e, options)
        for i, e in enumerate(_dataset(name, n_train, seed, options))
    ]
    asked = {t.prompt for t in train}
    heldout: list[Task] = []
    if n_heldout:
        # Draw past the count to make up for questions training already asks.
        far = seed + HELDOUT_SEED_OFFSET
        source = _dataset(name, 8 * n_heldout + 64, far, options)
        for i in range(len(source)):
            entry = source[i]
            if entry["question"] not in asked:
                asked.add(entry["question"])
                heldout.append(_task(name, "heldout", far, i, entry, options))
            if len(heldout) == n_heldout:
                break
        if len(heldout) < n_heldout:
            raise ValueError(
                f"reasoning-gym {name}: only {len(heldout)} held-out questions differ from the training "
                f"ones (asked for {n_heldout}): the family is too small at these options"
            )
    return train, heldout


def write_reasoning_gym_tasks(
    out: str | Path, name: str, n_train: int, n_heldout: int, seed: int = 0, options: dict | None = None
) -> tuple[Path, Path]:
    """train.jsonl and heldout.jsonl in `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train, heldout = generate_tasks(name, n_train, n_heldout, seed, options)
    write_jsonl(train, out / "train.jsonl")
    write_jsonl(heldout, out / "heldout.jsonl")
    return out / "train.jsonl", out / "heldout.jsonl"


def extract(answer_text: str) -> str | None:
    """The text of the last <answer></answer> in a reply (None without one)."""
    end = answer_text.rfind("</answer>")
    start = answer_text.rfind("<answer>", 0, end if end != -1 else None)
    if start == -1:
        return None
    inner = answer_text[start + len("<answer>") : end if end != -1 else None]
    return inner.strip()


_shots_cache: dict[str, list[tuple[str, str]]] = {}


def worked_examples(name: str, options: dict, k: int, avoid: str) -> list[tuple[str, str]]:
    """`k` (question, answer) pairs of the family at SHOTS_SEED, none asking `avoid` (the task's own
    question); the same for every episode of a family and options."""
    key = json.dumps([name, options], sort_keys=True)
    pool = _shots_cache.get(key)
    if pool is None:
        dataset = _dataset(name, MAX_SHOTS + 1, SHOTS_SEED, options)
        pool = [(dataset[i]["question"], str(dataset[i]["answer"])) for i in range(MAX_SHOTS + 1)]
        _shots_cache[key] = pool
    return [pair for pair in pool if pair[0] != avoid][:k]


class ReasoningGymEnv(SingleTurnEnv):
    """A reasoning-gym task, asked once and scored by its family's scorer.

    `shots` (0-8) puts that many worked examples of the task's own family before it, as earlier
    turns of the chat (user: a question; assistant: `<answer>ANSWER</answer>`): a small instruct
    model follows a demonstrated format far more often than a described one (SmolLM2-135M-Instruct
    wrote no <answer> tag for 32 of 32 chain_sum tasks with the system prompt alone). The examples
    come from a seed no training or held-out task is drawn from."""

    name = "reasoning-gym"

    def __init__(
        self,
        *,
        system_prompt: str | None = SYSTEM_PROMPT,
        shots: int = 0,
        reward_timeout_s: float = 5.0,
        reward_memory_mb: int = 1024,
    ) -> None:
        if isinstance(shots, bool) or not isinstance(shots, int) or not 0 <= shots <= MAX_SHOTS:
            raise ValueError(f"shots must be an integer in 0..{MAX_SHOTS}, got {shots!r}")
        super().__init__(
            reward=SCORER,
            system_prompt=system_prompt,
            reward_timeout_s=reward_timeout_s,
            reward_memory_mb=reward_memory_mb,
        )
        self.shots = shots

    @property
    def scorer_label(self) -> str:
        return "reasoning-gym's scorer"

    def reset(self, task: Task) -> list[dict]:
        opening = super().reset(task)
        if not self.shots:
            return opening
        name, options = task.meta.get("rg_dataset"), task.meta.get("rg_options", {})
        if not isinstance(name, str) or not isinstance(options, dict):
            raise ValueError(f"task {task.task_id}: shots need a reasoning-gym task (rg_dataset, rg_options)")
        examples = []
        for question, answer in worked_examples(name, options, self.shots, task.prompt):
            examples += [
                {"role": "user", "content": question},
                {"role": "assistant", "content": f"<answer>{answer}</answer>"},
            ]
        return opening[:-1] + examples + opening[-1:]

    @classmethod
    def prepare(cls, options: dict[str, Any]) -> None:
        try:
            import reasoning_gym  # noqa: F401
        except ImportError:
            raise ValueError(
                "the reasoning-gym package is missing: pip install 'spopp[reasoning-gym]'"
            ) from None
        cls(**options)  # the options' own checks first (shots)
        single_turn = {k: v for k, v in options.items() if k != "shots"}
        super().prepare({**single_turn, "reward": SCORER})
