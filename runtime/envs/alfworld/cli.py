"""`spopp alfworld ...`: ALFWorld games on disk.

The group imports nothing heavy: each command imports what it needs when it runs, so `spopp --help`
stays instant and works without the optional alfworld packages. More commands join the group with
`group.add_command`.
"""

from __future__ import annotations

from pathlib import Path

import click

# The generator's own lists: that module imports the standard library only, so --help stays instant.
from .generate import LAYOUT_CHOICES, SPLITS

group = click.Group(
    "alfworld", help="ALFWorld text games: generate games in the package's layout, write task files."
)


@group.command("generate")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="data folder (an ALFWORLD_DATA)")
@click.option("--seed", type=int, default=0, show_default=True, help="the set's seed (>= 0)")
@click.option("--per-type", type=int, default=4, show_default=True, help="games per task type (six types)")
@click.option(
    "--split", default="train", show_default=True, metavar="|".join(SPLITS), help="the split folder"
)
@click.option(
    "--layouts",
    default=None,
    metavar="|".join(LAYOUT_CHOICES),
    help="room layouts to draw from  [default: seen for train and valid_seen, unseen for valid_unseen]",
)
@click.option("--max-receptacles", type=int, default=None, help="at most this many receptacles a game (>= 2)")
@click.option("--max-distractors", type=int, default=None, help="at most this many objects beyond the task's")
@click.option(
    "--no-check",
    is_flag=True,
    help="skip the planner check (fast): games get walkthrough null and still solvable true, "
    "which their construction ensures but no planner has proved",
)
def generate_command(out, seed, per_type, split, layouts, max_receptacles, max_distractors, no_check) -> None:
    """Generate ALFWorld-format games of the six task types under OUT/json_2.1.1/SPLIT/.

    Writes OUT/SPLIT_seedSEED.txt, one <split>/<folder>/<trial> a line. The same arguments give
    byte-identical files. Each game is checked with the fast-downward planner, whose plan is stored
    as its walkthrough; train and the valid splits never share a game, and valid_unseen uses room
    layouts the other splits never see.
    """
    # The same checks generate_games makes, here for the errors the option parser would otherwise
    # print with a usage block: one line each.
    if split not in SPLITS:
        raise click.ClickException(f"unknown --split {split!r}; expected one of {', '.join(SPLITS)}")
    if layouts is not None and layouts not in LAYOUT_CHOICES:
        raise click.ClickException(
            f"unknown --layouts {layouts!r}; expected one of {', '.join(LAYOUT_CHOICES)}"
        )
    from .generate import GenerationError, generate_games

    try:
        generate_games(
            out,
            seed=seed,
            per_type=per_type,
            split=split,
            layouts=layouts,
            max_receptacles=max_receptacles,
            max_distractors=max_distractors,
            check=not no_check,
            progress=click.echo,
        )
    except GenerationError as e:
        raise click.ClickException(str(e)) from None
    except ImportError as e:
        hint = "" if "spopp[alfworld]" in str(e) else "; install them with: pip install 'spopp[alfworld]'"
        raise click.ClickException(f"{e}{hint}") from None


@group.command("tasks")
@click.option(
    "--data",
    type=click.Path(path_type=Path),
    default=None,
    help="the data folder holding json_2.1.1/  [default: $ALFWORLD_DATA]",
)
@click.option(
    "--list",
    "list_file",
    required=True,
    type=click.Path(path_type=Path),
    help="task list: <split>/<folder>/<trial> a line",
)
@click.option("--out", required=True, type=click.Path(path_type=Path), help="task file to write (JSONL)")
@click.option(
    "--portable",
    is_flag=True,
    help="leave the data folder out of the rows: they are resolved against $ALFWORLD_DATA where they run",
)
def tasks_command(data, list_file, out, portable) -> None:
    """Write the task file of the games LIST names, for `spopp launch`, the replicas and `spopp prior`.

    Every game is checked first (it exists, parses, is solvable, has a goal); one bad game writes
    nothing. A row: task_id alfworld/<split>/<folder>/<trial>, prompt = the game's goal text, answer =
    the trial path, task_type, and the data folder unless --portable.
    """
    from .games import GameFileError, write_alfworld_tasks

    if out.is_dir():
        raise click.ClickException(f"--out {out} is a folder; give the task file's path")
    try:
        tasks = write_alfworld_tasks(data, list_file, out, portable=portable)
    except GameFileError as e:
        raise click.ClickException(str(e)) from None
    kinds: dict[str, int] = {}
    for t in tasks:
        kinds[t.meta["task_type"]] = kinds.get(t.meta["task_type"], 0) + 1
    summary = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
    click.echo(f"{len(tasks)} tasks -> {out} ({summary})")
