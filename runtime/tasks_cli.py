"""`spopp tasks ...`: write task files (train.jsonl and heldout.jsonl) of the generated task families.

Each command writes both splits into OUT, disjoint by construction, and prints their paths; the
same arguments always write the same tasks. The group imports nothing heavy until a command runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

group = click.Group(
    "tasks", help="Task files of generated families: reasoning-gym's datasets, verifiers tasksets, toy-calc."
)


def json_object(text: str | None) -> dict:
    """A command-line option given as a JSON object (options of an environment or a task family)."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise click.BadParameter(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise click.BadParameter("a JSON object")
    return value


@group.command("reasoning-gym")
@click.argument("dataset")
@click.option(
    "--out", required=True, type=click.Path(file_okay=False, path_type=Path), help="folder of the two files"
)
@click.option(
    "--train", "n_train", type=click.IntRange(1), default=1000, show_default=True, help="training tasks"
)
@click.option(
    "--heldout", "n_heldout", type=click.IntRange(0), default=128, show_default=True, help="held-out tasks"
)
@click.option("--seed", type=click.IntRange(0), default=0, show_default=True, help="the training tasks' seed")
@click.option(
    "--options", default=None, help="the family's difficulty options as JSON, e.g. '{\"min_terms\": 2}'"
)
def reasoning_gym_command(dataset, out, n_train, n_heldout, seed, options) -> None:
    """Tasks of reasoning-gym's DATASET (e.g. chain_sum, countdown), for `env: reasoning-gym`.
    Held-out tasks come from seeds disjoint from training's, and never repeat a training question."""
    from .envs.reasoning_gym import write_reasoning_gym_tasks

    try:
        train, heldout = write_reasoning_gym_tasks(
            out, dataset, n_train, n_heldout, seed, json_object(options)
        )
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"{train}\n{heldout}")


@group.command("verifiers")
@click.argument("taskset")
@click.option(
    "--out", required=True, type=click.Path(file_okay=False, path_type=Path), help="folder of the two files"
)
@click.option("--config", default=None, help="the taskset's config fields as JSON")
@click.option(
    "--heldout", "n_heldout", type=click.IntRange(0), default=0, show_default=True, help="tasks held out"
)
@click.option("--seed", type=click.IntRange(0), default=0, show_default=True, help="the split's shuffle seed")
@click.option(
    "--limit",
    type=click.IntRange(1),
    default=None,
    help="read at most this many tasks (needed when infinite)",
)
def verifiers_command(taskset, out, config, n_heldout, seed, limit) -> None:
    """Tasks of a verifiers TASKSET (an installed taskset id, or package.module:MyTaskset), for
    `env: verifiers`: its tasks shuffled with SEED, the last N held out."""
    from .envs.verifiers_env import write_verifiers_tasks

    try:
        train, heldout = write_verifiers_tasks(out, taskset, json_object(config), n_heldout, seed, limit)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"{train}\n{heldout}")


@group.command("toy-calc")
@click.option(
    "--out", required=True, type=click.Path(file_okay=False, path_type=Path), help="folder of the two files"
)
@click.option("--train", "n_train", type=click.IntRange(1), default=256, show_default=True)
@click.option("--heldout", "n_heldout", type=click.IntRange(0), default=64, show_default=True)
@click.option("--seed", type=click.IntRange(0), default=0, show_default=True)
def toy_calc_command(out, n_train, n_heldout, seed) -> None:
    """Tasks of toy-calc (a*b+c with a calculator tool), for `env: toy-calc`."""
    from .envs.toy_calc import write_toy_calc_tasks

    train, heldout = write_toy_calc_tasks(out, seed=seed, n_train=n_train, n_heldout=n_heldout)
    click.echo(f"{train}\n{heldout}")
