"""`spopp ablate CONFIG` (matched arms over seeds, then the report), `spopp map CONFIG` (the
same over a grid of toy-calc's knobs, seeds per cell fixed before the main runs) and `spopp study
compare CONFIG` (one pre-registered paired comparison, sized by its pilot: services/study/registered.py).

A study composes runs through the launcher (services.launch: its config, its `Launcher`) and
reaches no other service; its base config is read as `spopp launch` reads one.
"""

from __future__ import annotations

from pathlib import Path

import click

from services.config.launch import LaunchSettings
from services.launch.cli import CONFIG_ARGUMENT, SET_OPTION, import_package_model, resolve
from spopp.settings.base import SettingsError


def _fail(message: str) -> None:
    raise click.ClickException(message)


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
    """services.study.same_code.check, its refusal a ClickException and its flag said."""
    from spopp.files import provenance

    from .same_code import check

    try:
        summary = check(folders, out, policy, what, planned)
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
    from spopp.compare.arms import ARMS, parse_arm

    try:
        base = resolve(config, sets)
        import_package_model(base, config)
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
    from services.launch.run import LaunchError

    from .compare import arm_settings, compare

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
        CONFIG_ARGUMENT,
        SET_OPTION,
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


def _render(config: Path | None, out: Path | None, folder: Path, page: Path | None) -> None:
    """`spopp map --render DIR`: redraw a finished map from its map.json, and nothing else."""
    from .render import render

    if config is not None or out is not None:
        raise click.UsageError("--render redraws a finished map from its map.json: give no CONFIG or --out")
    try:
        for path in render(folder, page):
            click.echo(f"wrote {path}")
    except (OSError, ValueError) as exc:
        _fail(str(exc))


def _main_seeds(
    config: Path | None, out: Path | None, page: Path | None, seeds: str | None, pilot_seeds: str | None
) -> list[int] | None:
    """A map to run needs CONFIG and --out, and one seed rule: the fixed rule's seeds (default
    0,1,2), or None under the pilot rule; UsageError naming the option otherwise."""
    if config is None or out is None:
        raise click.UsageError("give CONFIG and --out (or --render DIR to redraw a finished map)")
    if page is not None:
        raise click.UsageError("--page goes with --render")
    if seeds is not None and pilot_seeds is not None:
        raise click.UsageError(
            "--seeds (the same seeds in every cell) or --pilot-seeds (n per cell from a pilot), not both"
        )
    return None if pilot_seeds else _seed_list(seeds or "0,1,2", "seeds")


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
    from services.launch.run import LaunchError

    from .map import run_map

    if render is not None:
        _render(config, out, render, page)
        return
    main = _main_seeds(config, out, page, seeds, pilot_seeds)
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
        SET_OPTION,
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


def _study_compare(
    config: Path | None, sets: tuple[str, ...], out: Path | None, arms: str, pilot_seeds: str, first_seed: int,
    effect: float, primary: str, budget_hours: float | None, force: bool, render: Path | None,
) -> None:  # fmt: skip
    from services.launch.run import LaunchError

    from .measures import StudyDataError
    from .registered import Request, StudyRefused, run_study, write_study
    from .registration import ProtocolError

    if render is not None:
        if config is not None or out is not None:
            raise click.UsageError(
                "--render redraws a finished study from its study.json: give no CONFIG or --out"
            )
        import json

        try:
            write_study(render, json.loads((render / "study.json").read_text()))
        except (OSError, ValueError, KeyError) as exc:
            _fail(f"{render / 'study.json'}: cannot redraw the page ({exc})")
        click.echo(f"wrote {render / 'README.md'}")
        return
    if config is None or out is None:
        raise click.UsageError("give CONFIG and --out (or --render DIR to redraw a finished study)")
    base, seeds, arm_list = _matched(config, sets, pilot_seeds, arms)
    if len(arm_list) != 2 or arm_list[0] == arm_list[1]:
        raise click.UsageError(f"--arms {arms!r}: two different arms, the control first (e.g. spo,spopp)")
    if len(seeds) < 2 or len(set(seeds)) != len(seeds):
        raise click.UsageError(
            f"--pilot-seeds {pilot_seeds!r}: two distinct seeds or more (the pilot's s.d.)"
        )
    req = Request(
        base=base, out=out, arms=(arm_list[0], arm_list[1]), pilot_seeds=seeds, first_seed=first_seed,
        effect=effect, primary=primary, budget_s=None if budget_hours is None else 3600 * budget_hours, force=force,
        config=config,
    )  # fmt: skip
    try:
        code = run_study(req, echo=click.echo)
    except (StudyRefused, ProtocolError, StudyDataError, LaunchError, ValueError) as exc:
        _fail(str(exc))
    raise SystemExit(code)


compare_command = click.Command(
    "compare",
    callback=_study_compare,
    params=[
        _OPTIONAL_CONFIG,
        SET_OPTION,
        click.Option(
            ["--out"],
            type=click.Path(file_okay=False, path_type=Path),
            default=None,
            help="the study's folder: pilot/, protocol.json, runs/<arm>-s<seed>/, study.json, README.md",
        ),
        click.Option(
            ["--arms"],
            default="spo,spopp",
            show_default=True,
            help="the control and the treatment, which differ in one thing (spopp/compare/arms.py)",
        ),
        click.Option(
            ["--pilot-seeds"],
            default="1000,1001,1002",
            show_default=True,
            help="the pilot's seeds (at least two; never main seeds): its runs size the study",
        ),
        click.Option(
            ["--first-seed"],
            type=click.IntRange(min=0),
            default=0,
            show_default=True,
            help="the main seeds are this, this + 1, ... (n of them, n from the pilot)",
        ),
        click.Option(
            ["--effect"],
            type=float,
            default=2.5,
            show_default=True,
            help="the difference in primary-metric points to detect with 80 % power (default: the "
            "paper's Math-TIR Δ area, +2.50)",
        ),
        click.Option(
            ["--primary"],
            type=click.Choice(["trapezoid", "step-mean"]),
            default="trapezoid",
            show_default=True,
            help="the online-reward area's rule: trapezoid (the paper's ALFWorld "
            "comparator) or step-mean (its Math-TIR one)",
        ),
        click.Option(
            ["--budget-hours"],
            type=click.FloatRange(min=0, min_open=True),
            default=None,
            help="machine hours for the pilot and the main runs together: a study whose n does not fit "
            "is refused before its main runs, naming n (default: no limit)",
        ),
        click.Option(
            ["--force"], is_flag=True, help="run past failed design checks; the page says which failed"
        ),
        click.Option(
            ["--render"],
            type=click.Path(file_okay=False, exists=True, path_type=Path),
            default=None,
            help="redraw README.md of a finished study from its study.json, and nothing else",
        ),
    ],  # fmt: skip
    help="Does the treatment beat the control on this config? A pilot on its own seeds checks the design "
    "(version-0 success 15-70 %, below the ceiling, at least 8 outcomes per prompt, an offline prior) and sizes "
    "n for a paired t test (80 % power, at least 6 pairs); protocol.json is registered before the first main "
    "run; then n pairs with common random numbers, each run's code required to be one; the page's conclusions "
    "are generated from the statistics. Resumes where it stopped.",
)

study_group = click.Group(
    "study", help="Studies that answer a question with matched runs.", commands=[compare_command]
)
