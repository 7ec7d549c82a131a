"""`spopp env ...`: environments as plug-ins.

`spopp env list` names the installed environments (the entry-point group `spopp.environments`);
`spopp env check SPEC` plays a few episodes with a model and says whether the environment keeps
the contract (runtime/envs/check.py). The group imports nothing heavy until a command runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ..episode_settings import bounds
from ..tasks_cli import json_object

group = click.Group("env", help="Environments: list the installed ones, check one (yours) before a run.")


@group.command("list")
def list_command() -> None:
    """The installed environments and where each comes from."""
    from .registry import installed

    for name, ep in sorted(installed().items()):
        click.echo(f"{name:<16} {ep.value}")


@group.command("check")
@click.argument("spec")
@click.option(
    "--model",
    default=None,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="a model folder (Hugging Face layout) to play the episodes with; unset: the tiny test model, "
    "from the model cache (built there the first time, about 20 s)",
)
@click.option(
    "--tasks",
    "tasks_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="task file (JSONL/parquet); unset: a few small arithmetic questions",
)
@click.option("--episodes", type=click.IntRange(1, 10_000), default=8, show_default=True)
@click.option("--env-options", default=None, help="the environment's options as JSON, e.g. '{\"tries\": 2}'")
# The budgets' bounds are the services' (runtime/episode_settings.py); the defaults are a check's.
@click.option("--max-turns", type=click.IntRange(*bounds("max_turns")), default=8, show_default=True)
@click.option("--max-tokens-per-turn", type=click.IntRange(*bounds("max_tokens_per_turn")), default=256,
              show_default=True)  # fmt: skip
@click.option("--max-total-tokens", type=click.IntRange(*bounds("max_total_tokens")), default=2048,
              show_default=True)  # fmt: skip
@click.option("--seed", type=click.IntRange(0), default=0, show_default=True)
def check_command(spec, model, tasks_file, episodes, env_options, max_turns, max_tokens_per_turn,
                  max_total_tokens, seed) -> None:  # fmt: skip
    """Play EPISODES episodes of SPEC (a registered name or package.module:attribute) and print what
    was found: rewards outside [0, 1], episodes that never end, exceptions, non-determinism under
    one seed, a chat template that rewrites earlier turns, prompts over the context. Exit 0 only
    when the contract holds."""
    from ..episode import Budget
    from ..tasks import load_tasks
    from .check import probe_tasks, run_check

    options = json_object(env_options)
    if str(Path.cwd()) not in sys.path:  # a package in the current folder, as `python -m` finds it
        sys.path.insert(0, str(Path.cwd()))
    tasks = load_tasks(tasks_file) if tasks_file else probe_tasks(max(episodes, 1))
    budget = Budget(max_turns, max_tokens_per_turn, max_total_tokens)
    if model is None:
        from ..tiny_model import cached_tiny_model

        click.echo("no --model: the tiny test model, from the model cache (built there the first time, "
                   "about 20 s)", err=True)  # fmt: skip
        model = cached_tiny_model()
    click.echo(f"checking {spec} with {model}: {episodes} episodes over {len(tasks)} tasks", err=True)
    report = run_check(spec, options, model, tasks, episodes, budget, seed)
    click.echo(report.table())
    sys.exit(0 if report.ok else 1)
