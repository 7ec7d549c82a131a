"""`spopp launch CONFIG` (one run) and `spopp scale` (its rollout replicas); a deployment's run is
created by `spopp init` (services/init).

`resolve`, `CONFIG_ARGUMENT`, `SET_OPTION` and `import_package_model` are how a launch config is read;
the studies (`spopp ablate`, `spopp map`, `spopp study compare`: services/study/cli.py) read theirs the
same way.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import click
import yaml

from services.config.launch import LaunchSettings
from services.shell.logs import command_echo
from spopp.settings.base import SettingsError, read_config_file

_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
_SET_HELP = (
    "override one setting, KEY=VALUE with the value read as YAML; a dotted key reaches into a "
    "section (learner.lr=1e-4, rollout.replicas=2); repeatable; wins over the file and SPOPP_LAUNCH_*"
)


def resolve(
    config: Path, sets: tuple[str, ...] = (), run_dir: Path | None = None, log_format: str | None = None
) -> LaunchSettings:
    """The file, then SPOPP_LAUNCH_<FIELD>, then --set, --run-dir and --log-format; SettingsError
    on bad input."""
    file_values = read_config_file(config)
    flags: dict[str, Any] = {}
    for item in sets:
        key, eq, raw = item.partition("=")
        if not eq or not key:
            raise SettingsError(f"--set {item!r}: expected KEY=VALUE")
        if "." not in key:
            flags[key] = raw  # read by the field's type, like a flag (a run named 123 stays text)
            continue
        section, *path = key.split(".")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise SettingsError(f"--set {item!r}: the value is not YAML ({exc})") from None
        if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads 3e-4 (no dot) as text
        base = flags.get(section, file_values.get(section) or {})
        if not isinstance(base, dict):
            raise SettingsError(f"--set {item!r}: {section} is not a section of settings")
        tree = node = dict(base)
        for part in path[:-1]:
            node[part] = dict(node.get(part) or {})
            node = node[part]
        node[path[-1]] = value
        flags[section] = tree
    if run_dir is not None:
        flags["run_dir"] = str(run_dir)
    if log_format is not None:
        flags["log_format"] = log_format
    return LaunchSettings.resolve(config, os.environ, flags)


def _fail(message: str) -> None:
    raise click.ClickException(message)


def import_package_model(settings: LaunchSettings, config: Path) -> None:
    """`model: pkg:<package>`: imported once (preflight), then the run uses the imported folder."""
    from .preflight import package_model

    try:
        imported = package_model(settings.model, echo=click.echo)
    except ValueError as exc:
        _fail(f"{config}: {exc}")
    if imported is not None:
        settings.model = imported


def _launch(
    config: Path, sets: tuple[str, ...], run_dir: Path | None, print_config: bool, check: bool, log_format
) -> None:
    from .preflight import check_environment, render_first_prompt
    from .run import Launcher, LaunchError

    try:
        settings = resolve(config, sets, run_dir, log_format)
    except SettingsError as exc:
        raise click.UsageError(str(exc)) from None
    if print_config:
        # As the launch would run: with a token (the user's, the folder's or a new one), masked.
        from .run_token import RunTokenError, use_run_token

        try:
            use_run_token(settings)
        except RunTokenError as exc:
            _fail(f"{config}: {exc}")
        click.echo(yaml.safe_dump(settings.redacted(), sort_keys=False), nl=False)
        return
    import_package_model(settings, config)
    launcher = Launcher(settings, echo=command_echo(settings, "launch", run=settings.run))
    try:
        plan = launcher.prepare()
    except LaunchError as exc:
        _fail(f"{config}: {exc}")
    if check:
        click.echo(f"{config}: good. run {settings.run} ({plan.arm()}) in {plan.run_dir}")
        click.echo(f"  tracker  port {plan.tracker.port}")
        click.echo(
            f"  learner  port {plan.learner.port}, {plan.nproc} rank(s), devices {settings.gpus.learner or 'none'}"
        )
        for i, r in enumerate(plan.rollouts):
            devices = settings.gpus.rollout[i] if i < len(settings.gpus.rollout) else "none"
            click.echo(f"  {r.worker_id} port {r.port}, devices {devices}")
        if plan.evaluator is not None:
            click.echo(f"  evaluator port {plan.evaluator.port}, devices {settings.gpus.evaluator or 'none'}")
        try:
            shown = render_first_prompt(
                Path(settings.model), Path(settings.tasks), settings.env, settings.env_options
            )
        except ValueError as exc:
            _fail(f"{config}: the model cannot render a task: {exc}")
        budget = plan.rollouts[0].max_total_tokens if plan.rollouts else None
        click.echo(
            f"  model    {shown['model']}: vocabulary {shown['vocab']}, context {shown['context']}; task "
            f"{shown['task_id']} opens with {shown['tokens']} tokens (episode budget {budget}):"
        )
        click.echo("    " + shown["text"].replace("\n", "\n    ").rstrip())
        if budget is not None and shown["tokens"] >= budget:
            _fail(
                f"{config}: the first task's prompt is {shown['tokens']} tokens, not under "
                f"rollout.max_total_tokens {budget}: no episode could generate a token"
            )
        r = plan.rollouts[0] if plan.rollouts else None
        found = check_environment(
            Path(settings.model), Path(settings.tasks), settings.env, settings.env_options,
            (r.max_turns, r.max_tokens_per_turn, r.max_total_tokens) if r else None,
        )  # fmt: skip
        click.echo("  " + found.stdout.strip().replace("\n", "\n  "))
        if found.returncode != 0:
            _fail(f"{config}: environment {settings.env} does not keep the contract (spopp env check)")
        return
    raise SystemExit(launcher.run())


CONFIG_ARGUMENT = click.Argument(["config"], type=click.Path(dir_okay=False, path_type=Path))
SET_OPTION = click.Option(["--set", "sets"], multiple=True, metavar="KEY=VALUE", help=_SET_HELP)
_PRINT = click.Option(["--print-config"], is_flag=True, help="print the resolved launch config and exit")
_LOG_FORMAT = click.Option(
    ["--log-format"],
    type=click.Choice(["text", "json"]),
    help="how the launcher and every process it starts log: text, or json lines (wins over "
    "log_format in the file and SPOPP_LAUNCH_LOG_FORMAT)",
)

launch_command = click.Command(
    "launch",
    callback=_launch,
    params=[
        CONFIG_ARGUMENT,
        SET_OPTION,
        click.Option(
            ["--run-dir"], type=click.Path(file_okay=False, path_type=Path), help="the run's folder"
        ),
        _PRINT,
        click.Option(["--check"], is_flag=True, help="check everything and print the plan; start nothing"),
        _LOG_FORMAT,
    ],
    help="Run one whole training run on this machine from one config file: an embedded Redis and "
    "the tracker, N rollout replicas, the learner, the evaluator. Progress every few seconds; "
    "Ctrl-C stops every process; launching the same folder again resumes the run.",
)


def _scale(run_dir: Path, replicas: int, wait: float) -> None:
    from spopp.files.jsonfile import read_model, write_text
    from spopp.files.records import RunRecord
    from spopp.machine.wait import WaitTimeout, wait_until

    from .run import SCALE_FILE, parse_replicas

    record_path = run_dir / "run.json"
    try:
        record = read_model(record_path, RunRecord)
    except FileNotFoundError:
        _fail(f"{run_dir} is not a launched run's folder: no run.json")
    except (OSError, ValueError) as exc:
        _fail(str(exc))
    if record.status != "running":
        _fail(
            f"run {record.run} in {run_dir} is {record.status}, not running: set rollout.replicas in its config"
        )
    try:
        parse_replicas(str(replicas), 0)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    write_text(run_dir / SCALE_FILE, f"{replicas}\n")

    def took() -> bool:
        now = read_model(record_path, RunRecord)
        if now.status != "running":
            _fail(f"run {now.run} became {now.status} before it took the new count")
        return now.replicas == replicas

    try:
        wait_until(took, wait, f"the launcher of {run_dir} to take {replicas} replicas", interval=0.2)
    except WaitTimeout:
        _fail(
            f"the launcher of {run_dir} did not take {replicas} replicas within {wait:g} s; see its output "
            f"(a count it refuses is named there) and {run_dir / SCALE_FILE}"
        )
    click.echo(f"run {record.run}: {replicas} rollout replica(s)")


scale_command = click.Command(
    "scale",
    callback=_scale,
    params=[
        click.Argument(["run_dir"], type=click.Path(file_okay=False, path_type=Path)),
        click.Argument(["replicas"], type=int),
        click.Option(
            ["--wait"],
            type=float,
            default=60.0,
            show_default=True,
            help="seconds to wait for the launcher to take the count",
        ),  # fmt: skip
    ],
    help="Change the number of rollout replicas of a run that `spopp launch` is running: new "
    "replicas (rollout-N, ...) start and join, the highest ones stop and give back their leases. "
    "Writes RUN_DIR/replicas, which the launcher reads every half second (editing that file by hand "
    "does the same); `docker compose up -d --scale rollout=N` is the same under compose.",
)
