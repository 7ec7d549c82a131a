"""The `spopp` command: each service's sub-commands, assembled here, outside the library.

Each service owns its group in `services/<service>/cli.py`; those modules import only their
settings, so `spopp --help` stays instant and the command works where only some services'
dependencies are installed.
"""

from __future__ import annotations

import logging
import os
import sys

import click

from spopp import __version__


def build() -> click.Group:
    from runtime.envs.alfworld.cli import group as alfworld
    from runtime.envs.cli import group as env
    from runtime.tasks_cli import group as tasks
    from services.evaluator.cli import group as evaluator
    from services.evaluator.cli import prior_command as prior
    from services.init.cli import init_command as init
    from services.launch.cli import launch_command as launch
    from services.launch.cli import scale_command as scale
    from services.learner.cli import group as learner
    from services.learner.cli import lora_group as lora
    from services.models.cli import group as model
    from services.report.cli import command as report
    from services.rollout.cli import group as rollout
    from services.study.cli import ablate_command as ablate
    from services.study.cli import map_command as map_
    from services.study.cli import study_group as study
    from services.tracker.cli import group as tracker

    app = click.Group(
        "spopp",
        help="spopp: asynchronous single-stream RL for LLM agents (SPO++ and SPO).",
        params=[click.Option(["--version"], is_flag=True, expose_value=False, is_eager=True,
                             callback=_print_version, help="print the version and exit")],
    )  # fmt: skip
    # The services' groups, then the experiment commands that compose them, then data tools.
    for command in (
        tracker,
        rollout,
        learner,
        evaluator,
        init,
        launch,
        scale,
        prior,
        report,
        ablate,
        map_,
        study,
        lora,
        model,
        env,
        tasks,
        alfworld,
    ):
        app.add_command(command)
    return app


def _print_version(ctx: click.Context, _param, value: bool) -> None:
    if value:
        click.echo(f"spopp {__version__}")
        ctx.exit()


def _json_logs(argv: list[str]) -> bool:
    """Whether this command was asked for JSON logs, read before click parses anything: by the
    flag (`--log-format json` or `--log-format=json`) or by a service's `SPOPP_*_LOG_FORMAT`."""
    for i, arg in enumerate(argv):
        if arg == "--log-format=json" or (arg == "--log-format" and argv[i + 1 : i + 2] == ["json"]):
            return True
        if arg.startswith("--log-format"):
            return False  # the flag wins over the environment
    return any(
        k.startswith("SPOPP_") and k.endswith("_LOG_FORMAT") and v == "json" for k, v in os.environ.items()
    )


def _main_json(argv: list[str]) -> int:
    """Run the command so that even what fails before its logging is set up (a usage error, a
    setting that does not parse, an exception that escapes) comes out as one JSON line, not as
    click's usage text or Python's traceback."""
    service = next((a for a in argv if not a.startswith("-")), "spopp")
    try:
        build().main(argv, prog_name="spopp", standalone_mode=False)
        return 0
    except SystemExit as exc:  # the commands' own exit codes (e.g. a finished run)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except click.exceptions.Abort:
        return 130  # Ctrl-C, as click says it
    except click.ClickException as exc:
        _json_logger(service).error(
            exc.format_message(), extra={"error": type(exc).__name__, "exit_code": exc.exit_code}
        )
        return exc.exit_code
    except Exception as exc:
        _json_logger(service).critical(
            f"{type(exc).__name__}: {exc}", exc_info=exc, extra={"error": type(exc).__name__}
        )
        return 1


def _json_logger(service: str) -> logging.Logger:
    """The command's logger; JSON logging set up first where the command failed before it did."""
    from services.shell.logs import setup_logging

    if not logging.getLogger().handlers:
        setup_logging(service, "json")
    return logging.getLogger(f"spopp.{service}")


def main() -> None:
    argv = sys.argv[1:]
    if _json_logs(argv):
        sys.exit(_main_json(argv))
    build()(prog_name="spopp")


if __name__ == "__main__":
    main()
