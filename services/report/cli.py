"""`spopp report RUN_DIR...`: Table 1 (SPO++ vs SPO), Table 2 (ablation) and the curves' PNG.

Reads the folders `spopp launch` writes (run.json and eval/evals.jsonl), pairs the runs by seed
and prints the tables; with --out it also writes report.json (everything needed to recompute the
tables), report.md and curves.png. Only this module's command body imports the rest of the
package, and matplotlib only when a PNG is drawn, so that `spopp --help` stays instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from spopp.files.runs import Run

DEFAULT_METRIC = "eval/sampled/reward_mean"
DEFAULT_TITLE = "SPO++ vs SPO: held-out evaluation reward"


@click.command(
    "report",
    help="Compare SPO++ with SPO over paired runs: Table 1 (area and end reward, SPO++ − SPO by seed), "
    "Table 2 (the normalization ablation, when spopp-trajnorm runs are given) and, with --out, "
    "report.json, report.md and curves.png. RUN_DIR is a run folder (with run.json and "
    "eval/evals.jsonl) or a folder of run folders. With --render PAGE instead: redraw the report "
    "sections of a page (docs/results.md, BENCHMARKS.md) from the committed report.json each names.",
)
@click.argument("run_dirs", metavar="RUN_DIR...", nargs=-1, type=click.Path(path_type=Path))
@click.option(
    "--render",
    "pages",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="redraw this page's report sections (<!-- report:begin FILE ... -->) from their report.json "
    "files, paths relative to the current folder (the repository's root); no RUN_DIR then",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="write report.json, report.md and curves.png into this folder (created if needed)",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["markdown", "json"]),
    default="markdown",
    show_default=True,
    help="what to print: markdown tables, or the object of report.json",
)
@click.option(
    "--metric",
    default=DEFAULT_METRIC,
    show_default=True,
    help="the evals.jsonl key to compare (e.g. eval/greedy/reward_mean)",
)
@click.option(
    "--area",
    "kind",
    type=click.Choice(["trapezoid", "mean"]),
    default="trapezoid",
    show_default=True,
    help="normalized area under the curve: trapezoid rule, or step mean (rectangles)",
)
@click.option(
    "--points",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="compare every pair at exactly N curve points; pairs with fewer common points are left out "
    "(Table 1 only; default: each pair at its common length)",
)
@click.option("--title", default=DEFAULT_TITLE, show_default=True, help="title of report.md and curves.png")
@click.option(
    "--mixed-code",
    type=click.Choice(["refuse", "flag"]),
    default="refuse",
    show_default=True,
    envvar="SPOPP_MIXED_CODE",
    show_envvar=True,
    help="runs that do not come from one code (run.json's code: another commit, requirements.lock "
    "or set of uncommitted changes): refuse the report naming them, or let them through "
    "flagged in report.json and report.md",
)
@click.option(
    "--x",
    "x_axis",
    type=click.Choice(["version", "time"]),
    default="version",
    show_default=True,
    help="curves.png's x axis: policy version, or wall-clock time (minutes from the learner's start "
    "to each version's publication), to see whether a faster clock (bounded staleness) pays",
)
def command(
    run_dirs: tuple[Path, ...],
    pages: tuple[Path, ...],
    out: Path | None,
    fmt: str,
    metric: str,
    kind: str,
    points: int | None,
    title: str,
    x_axis: str,
    mixed_code: str,
) -> None:
    if pages:
        if run_dirs:
            raise click.UsageError("give RUN_DIRs or --render PAGE, not both")
        _render(pages)
        return
    if not run_dirs:
        raise click.UsageError("Missing argument 'RUN_DIR...'")
    from spopp.files.provenance import MixedCode, check
    from spopp.files.runs import RunError, read_runs

    from .tables import build, to_json, to_markdown

    warnings: list[str] = []
    try:
        runs = read_runs(list(run_dirs), metric, warnings)
        code = check({run.label: run.code for run in runs}, mixed_code, "spopp report")
    except (RunError, MixedCode) as exc:
        raise click.ClickException(str(exc)) from None
    report = build(runs, metric, kind, points, title, warnings, code)
    text_json, text_md = to_json(report), to_markdown(report)
    click.echo(text_json if fmt == "json" else text_md, nl=fmt == "json")
    if out is None:
        return
    written = _write(out, runs, text_json, text_md, title, metric, x_axis)
    # With --format json, stdout stays one JSON document; the file list goes to stderr.
    for path in written:
        click.echo(f"wrote {path}", err=fmt == "json")


def _render(pages: tuple[Path, ...]) -> None:
    from .published import render_page

    for page in pages:
        text = page.read_text(encoding="utf-8")
        try:
            new = render_page(text, Path.cwd())
        except ValueError as exc:
            raise click.ClickException(f"{page}: {exc}") from None
        if new != text:
            page.write_text(new, encoding="utf-8")
        click.echo(f"{page}: {'redrawn' if new != text else 'already the rendering of its reports'}")


def _write(
    out: Path, runs: list[Run], text_json: str, text_md: str, title: str, metric: str, x_axis: str = "version"
) -> list[Path]:
    try:
        out.mkdir(parents=True, exist_ok=True)
        paths = [out / "report.json", out / "report.md", out / "curves.png"]
        paths[0].write_text(text_json + "\n", encoding="utf-8")
        paths[1].write_text(text_md, encoding="utf-8")
    except OSError as exc:
        raise click.ClickException(f"{out}: cannot write the report: {exc.strerror or exc}") from None
    from .plot import draw

    try:
        draw(runs, paths[2], title, metric, x_axis)
    except ImportError as exc:  # matplotlib is an extra: the tables are written, the figure is not
        raise click.ClickException(
            f"curves.png needs matplotlib ({exc}); install it with pip install 'spopp[report]'"
        ) from None
    except ValueError as exc:  # --x time on a run without the learner's times
        raise click.ClickException(str(exc)) from None
    except OSError as exc:
        raise click.ClickException(f"{paths[2]}: cannot write: {exc.strerror or exc}") from None
    return paths


if __name__ == "__main__":
    command(prog_name="spopp report")
