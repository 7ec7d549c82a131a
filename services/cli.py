"""The `spopp` command: each service's sub-commands, assembled here, outside the library.

Each service owns its group in `services/<service>/cli.py`; those modules import only their
settings, so `spopp --help` stays instant and the command works where only some services'
dependencies are installed.
"""

from __future__ import annotations

import click

from spopp import __version__


def build() -> click.Group:
    from runtime.envs.alfworld.cli import group as alfworld
    from services.evaluator.cli import group as evaluator
    from services.evaluator.cli import prior_command as prior
    from services.launch.cli import ablate_command as ablate
    from services.launch.cli import init_command as init
    from services.launch.cli import launch_command as launch
    from services.learner.cli import group as learner
    from services.report.cli import command as report
    from services.rollout.cli import group as rollout
    from services.tracker.cli import group as tracker

    app = click.Group(
        "spopp",
        help="spopp: asynchronous single-stream RL for LLM agents (SPO++ and SPO).",
        params=[click.Option(["--version"], is_flag=True, expose_value=False, is_eager=True,
                             callback=_print_version, help="print the version and exit")],
    )  # fmt: skip
    # The services' groups, then the experiment commands that compose them, then data tools.
    for command in (tracker, rollout, learner, evaluator, init, launch, prior, report, ablate, alfworld):
        app.add_command(command)
    return app


def _print_version(ctx: click.Context, _param, value: bool) -> None:
    if value:
        click.echo(f"spopp {__version__}")
        ctx.exit()


def main() -> None:
    build()(prog_name="spopp")


if __name__ == "__main__":
    main()
