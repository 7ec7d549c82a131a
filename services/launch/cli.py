"""`spopp launch CONFIG` (one run) and `spopp ablate CONFIG` (matched arms over seeds, then the report)."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import click
import yaml

from spopp.settings import SettingsError, read_config_file

from .config import LaunchSettings

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


def _echo(settings, service: str, **context):
    """Set up the command's logging; answer how it prints its progress: plain lines on stdout, or
    with json logs, log lines (so that everything it writes parses)."""
    from services.shell.logs import setup_logging

    setup_logging(service, settings.log_format, **context)
    if settings.log_format == "json":
        return logging.getLogger(f"spopp.{service}").info
    return click.echo


def _import_package_model(settings: LaunchSettings, config: Path) -> None:
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
        click.echo(yaml.safe_dump(settings.redacted(), sort_keys=False), nl=False)
        return
    _import_package_model(settings, config)
    launcher = Launcher(settings, echo=_echo(settings, "launch", run=settings.run))
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


_CONFIG = click.Argument(["config"], type=click.Path(dir_okay=False, path_type=Path))
_SET = click.Option(["--set", "sets"], multiple=True, metavar="KEY=VALUE", help=_SET_HELP)
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
        _CONFIG,
        _SET,
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
    from spopp.jsonfile import read_model, write_text
    from spopp.records import RunRecord
    from spopp.wait import WaitTimeout, wait_until

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


# `spopp ablate` and `spopp map` pick their runs alike.
_SEEDS = click.Option(["--seeds"], default="0,1,2", show_default=True, help="seeds, comma-separated")
_ARMS = click.Option(
    ["--arms"],
    default="spo,spopp-trajnorm,spopp",
    show_default=True,
    help="arms, comma-separated: spo, spo-eventtime, spopp-trajnorm, spopp (each adds one change to the one "
    "before; spo,spopp is the paired comparison), each optionally with -k<N> for max_staleness N (spopp,spopp-k1 "
    "pairs k = 0 against k = 1)",
)


_MIXED_CODE = click.Option(
    ["--mixed-code"],
    type=click.Choice(["refuse", "flag"]),
    default="refuse",
    show_default=True,
    envvar="SPOPP_MIXED_CODE",
    show_envvar=True,
    help="runs that do not come from one code (run.json's code: another commit, requirements.lock or set of "
    "uncommitted changes; this checkout's counts for the runs to come): refuse, naming them, before any run "
    "starts and at the summary, or let them through flagged in the output",
)


def _check_code(folders: list[Path], out: Path, policy: str, what: str, planned: bool = True) -> None:
    """Before any run starts: this checkout's code and that of the runs already in `folders` must be
    one code (spopp.provenance), rather than the comparison being refused at its end. This checkout
    counts only when a run is still to come: a finished comparison run again (to redraw its page
    after a pull) runs nothing, and its runs' code is what it is. `planned`: `folders` are every
    run the comparison will have (ablate's); a map's are only those there so far, and it is
    finished only once its map.json is written."""
    from spopp import provenance
    from spopp.jsonfile import read_model
    from spopp.records import RunRecord

    found: dict[str, dict | None] = {}
    to_come = not folders or not planned
    for folder in folders:
        try:
            record = read_model(folder / "run.json", RunRecord)
        except (OSError, ValueError):  # no run there yet, or one its launch will name
            to_come = True
            continue
        found[str(folder)] = record.code
        to_come = to_come or record.status != "finished"
    runs = {"this checkout (the runs to come)": provenance.code(exclude=[out])} if to_come else {}
    runs |= found
    try:
        summary = provenance.check(runs, policy, what)
    except provenance.MixedCode as exc:
        _fail(str(exc))
    if summary["flagged"]:
        click.echo(
            f"mixed code, let through by --mixed-code flag and flagged in the output: {summary['problem']}"
        )


def _matched(
    config: Path, sets: tuple[str, ...], seeds: str, arms: str
) -> tuple[LaunchSettings, list[int], list[str]]:
    """The base config, the seeds and the arms of `spopp ablate` and `spopp map`; UsageError
    naming the option of any problem."""
    from .arms import ARMS, parse_arm

    try:
        base = resolve(config, sets)
        _import_package_model(base, config)
        seed_list = [int(x) for x in seeds.split(",") if x.strip()]
    except SettingsError as exc:
        raise click.UsageError(str(exc)) from None
    except ValueError:
        raise click.UsageError(f"--seeds {seeds!r}: expected integers separated by commas") from None
    arm_list = [a.strip() for a in arms.split(",") if a.strip()]
    unknown = []
    for a in arm_list:
        try:
            parse_arm(a)
        except ValueError:
            unknown.append(a)
    if unknown or not arm_list or not seed_list:
        raise click.UsageError(
            f"--arms: choose from {', '.join(ARMS)}, each optionally with -k<N> (max_staleness N, "
            "e.g. spopp-k1); --seeds: at least one"
        )
    return base, seed_list, arm_list


def _ablate(config: Path, sets: tuple[str, ...], seeds: str, arms: str, out: Path, mixed_code: str) -> None:
    from .compare import arm_settings, compare
    from .run import LaunchError

    base, seed_list, arm_list = _matched(config, sets, seeds, arms)
    try:
        folders = [arm_settings(base, arm, seed, out).run_dir for seed in seed_list for arm in arm_list]
        _check_code(folders, out, mixed_code, f"spopp ablate --out {out}")
        code = compare(
            base, arm_list, seed_list, out, echo=click.echo, report_args=("--mixed-code", mixed_code)
        )
    except (LaunchError, ValueError) as exc:
        _fail(str(exc))
    raise SystemExit(code)


ablate_command = click.Command(
    "ablate",
    callback=_ablate,
    params=[
        _CONFIG,
        _SET,
        _SEEDS,
        _ARMS,
        click.Option(
            ["--out"],
            type=click.Path(file_okay=False, path_type=Path),
            required=True,
            help="folder of the runs (runs/<arm>-s<seed>/) and the report",
        ),  # fmt: skip
        _MIXED_CODE,
    ],
    help="Matched runs of one config: each arm on each seed, all else equal, one after another; "
    "then `spopp report` over them (Table 1 for SPO vs SPO++, Table 2's C10 when "
    "spopp-trajnorm is among the arms).",
)


def _init(settings) -> None:
    from .init import run_init

    try:
        run_init(settings, echo=_echo(settings, "init", run=settings.run))
    except (RuntimeError, ValueError, OSError) as exc:
        _fail(str(exc))


def _init_command() -> click.Command:
    from spopp.settings import settings_command

    from .init import InitSettings

    return settings_command(
        InitSettings,
        "init",
        _init,
        help="Create a run at the tracker and load its tasks with their prior (the init step of "
        "docker compose and Kubernetes). Idempotent: a second init with the same settings changes "
        "nothing; a different recipe, config or prior is refused with the reason.",
    )


init_command = _init_command()


def _distinct(text: str, what: str, kind: type = float) -> list:
    """A comma-separated option's distinct values (numbers, or integers for seeds); UsageError
    naming the option otherwise."""
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        expected = "numbers" if kind is float else "integers"
        raise click.UsageError(f"--{what} {text!r}: expected {expected} separated by commas") from None
    if not values or len(set(values)) != len(values):
        raise click.UsageError(f"--{what} {text!r}: give distinct values, at least one")
    return values


def _numbers(text: str, what: str) -> list[float]:
    return _distinct(text, what)


def _seed_list(text: str | None, what: str) -> list[int] | None:
    return None if text is None else _distinct(text, what, int)


def _render(folder: Path, page: Path | None) -> None:
    from .map_render import render

    try:
        for path in render(folder, page):
            click.echo(f"wrote {path}")
    except (OSError, ValueError) as exc:
        _fail(str(exc))


def _map(
    config: Path | None,
    sets: tuple[str, ...],
    seeds: str | None,
    pilot_seeds: str | None,
    first_seed: int,
    arms: str,
    coupling: str,
    latency: str,
    out: Path | None,
    target_se: float,
    n_min: int,
    budget_minutes: float | None,
    render: Path | None,
    page: Path | None,
    mixed_code: str,
) -> None:
    from .map import run_map
    from .run import LaunchError

    if render is not None:
        if config is not None or out is not None:
            raise click.UsageError(
                "--render redraws a finished map from its map.json: give no CONFIG or --out"
            )
        _render(render, page)
        return
    if config is None or out is None:
        raise click.UsageError("give CONFIG and --out (or --render DIR to redraw a finished map)")
    if page is not None:
        raise click.UsageError("--page goes with --render")
    if seeds is not None and pilot_seeds is not None:
        raise click.UsageError(
            "--seeds (the same seeds in every cell) or --pilot-seeds (n per cell from a pilot), not both"
        )
    main = None if pilot_seeds else _seed_list(seeds or "0,1,2", "seeds")
    base, _seeds, arm_list = _matched(config, sets, "0", arms)
    couplings, latencies = _numbers(coupling, "coupling"), _numbers(latency, "latency")
    pilot = _seed_list(pilot_seeds, "pilot-seeds")
    folders = sorted(out.glob("cells/*/runs/*")) + sorted(out.glob("pilot/cells/*/runs/*"))
    _check_code(folders, out, mixed_code, f"spopp map --out {out}", planned=(out / "map.json").is_file())
    try:
        code = run_map(
            base, couplings, latencies, arm_list, out, seeds=main,
            pilot_seeds=pilot, target_se=target_se, n_min=n_min,
            first_seed=first_seed, budget_s=None if budget_minutes is None else 60 * budget_minutes, echo=click.echo,
            mixed_code=mixed_code,
        )  # fmt: skip
    except (LaunchError, ValueError) as exc:
        _fail(str(exc))
    raise SystemExit(code)


_OPTIONAL_CONFIG = click.Argument(["config"], required=False, type=click.Path(dir_okay=False, path_type=Path))
map_command = click.Command(
    "map",
    callback=_map,
    params=[
        _OPTIONAL_CONFIG,
        _SET,
        click.Option(
            ["--seeds"],
            default=None,
            help="the fixed rule: these seeds in every cell (default 0,1,2 without --pilot-seeds)",
        ),
        click.Option(
            ["--pilot-seeds"],
            default=None,
            help="the pilot rule: run every arm and cell on these seeds first (never reused), then fix each cell's n "
            "from its SPO++ − SPO s.d. before the main runs (written to <out>/protocol.json)",
        ),  # fmt: skip
        click.Option(
            ["--first-seed"],
            type=click.IntRange(min=0),
            default=0,
            show_default=True,
            help="with --pilot-seeds: the main seeds are this, this + 1, ...",
        ),
        _ARMS,
        click.Option(
            ["--coupling"],
            default="-1,0,1",
            show_default=True,
            help="toy-calc's coupling levels: -1 failures longer (as in ALFWorld), 0 none, +1 successes longer",
        ),  # fmt: skip
        click.Option(
            ["--latency"],
            default="0,1.5",
            show_default=True,
            help="toy-calc's latency_sigma levels: 0 none, else a lognormal delay of that log-s.d.",
        ),  # fmt: skip
        click.Option(
            ["--out"],
            type=click.Path(file_okay=False, path_type=Path),
            default=None,
            help="folder of the runs (pilot/cells/... and cells/<cell>/runs/<arm>-s<seed>/), protocol.json and "
            "map.json, map.md, map.png",
        ),  # fmt: skip
        click.Option(
            ["--target-se"],
            type=click.FloatRange(min=0, min_open=True),
            default=1.5,
            show_default=True,
            help="with --pilot-seeds: the standard error (area points) each cell's n aims SPO++ − SPO at",
        ),  # fmt: skip
        click.Option(
            ["--n-min"],
            type=click.IntRange(min=2),
            default=3,
            show_default=True,
            help="with --pilot-seeds: the fewest seeds a cell gets",
        ),
        click.Option(
            ["--budget-minutes"],
            type=click.FloatRange(min=0, min_open=True),
            default=None,
            help="with --pilot-seeds: minutes for the pilot and the main runs together; cells whose n does not fit are "
            "capped (and named) before the main runs start (default: no limit)",
        ),  # fmt: skip
        click.Option(
            ["--render"],
            type=click.Path(file_okay=False, exists=True, path_type=Path),
            default=None,
            help="redraw map.md and map.png of a finished map from its map.json in this folder, and nothing else",
        ),  # fmt: skip
        click.Option(
            ["--page"],
            type=click.Path(dir_okay=False, exists=True, path_type=Path),
            default=None,
            help="with --render: also replace this page's map section (its map:begin / map:end lines)",
        ),  # fmt: skip
        _MIXED_CODE,
    ],
    help="When does SPO++ beat SPO? Paired runs of every arm on every seed in each cell of a grid over "
    "toy-calc's two knobs (length-advantage coupling, outcome latency), the seeds per cell fixed before the "
    "main runs (by a pilot, or given); then map.json, map.md and the heatmap map.png: area per arm, each "
    "step's and SPO++ − SPO's paired difference with its t interval, pairs won and sign test, C10, and what "
    "each knob measurably did. Resumes where it stopped.",
)
