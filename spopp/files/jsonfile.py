"""The system's JSON files, read and written through pydantic models.

Each file kind (the prior, a snapshot's manifest, a run's run.json, a line of evals.jsonl) has a
model next to the code that owns the file. Reading validates the whole object and refuses a bad
file with one line per problem, `<file>: <field>: <what is wrong>`, so that a hand-edited or
truncated file names itself and the field instead of failing later with a KeyError. Writing
serializes the whole text first (NaN and infinities refused, so nothing is half-written when a
value is bad), then writes it beside the file under a temporary name, fsyncs and renames it: a
reader sees the old file or the new one, never part of one. No torch here.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

__all__ = [
    "FileFormatError",
    "describe",
    "field_name",
    "parse_json",
    "read_json",
    "read_model",
    "to_text",
    "validate",
    "write_text",
]

M = TypeVar("M", bound=BaseModel)


class FileFormatError(ValueError):
    """A file that is not what its model says; the message names the file and each bad field."""


def field_name(loc: Sequence[str | int]) -> str:
    """A pydantic location as a reader writes it: ("tasks", 3, "alpha0") -> "tasks[3].alpha0"."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def describe(where: str, exc: ValidationError) -> str:
    """One line per error: `<where>: <field>: <what>` (`<where>: <what>` for the whole object)."""
    lines = []
    for err in exc.errors():
        # A validator's ValueError comes as "Value error, <message>": the message is what matters.
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            msg = "missing"
        elif err["type"] == "extra_forbidden":
            msg = "unknown field"
        field = field_name(err["loc"])
        lines.append(f"{where}: {field}: {msg}" if field else f"{where}: {msg}")
    return "\n".join(lines)


def validate(model: type[M], data: Any, where: str) -> M:
    """`data` (a parsed JSON value) as `model`; FileFormatError naming `where` and the fields."""
    if not isinstance(data, dict):
        raise FileFormatError(f"{where}: expected a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise FileFormatError(describe(where, exc)) from None


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def parse_json(text: str, where: str) -> Any:
    """Strict JSON (no NaN or Infinity literals); FileFormatError naming `where` otherwise."""
    try:
        return json.loads(text, parse_constant=_no_constant)
    except ValueError as exc:
        raise FileFormatError(f"{where}: not JSON: {exc}") from None


def read_json(path: str | Path, where: str | None = None) -> Any:
    """The JSON value in `path`. FileNotFoundError when there is none (callers say what to do);
    FileFormatError for a folder, text that is not UTF-8 or not JSON."""
    path = Path(path)
    where = str(path) if where is None else where
    try:
        text = path.read_text(encoding="utf-8")
    except IsADirectoryError:
        raise FileFormatError(f"{where} is a directory") from None
    except UnicodeDecodeError:
        raise FileFormatError(f"{where}: not UTF-8 text") from None
    return parse_json(text, where)


def read_model(path: str | Path, model: type[M], where: str | None = None) -> M:
    """The file at `path` as `model` (see read_json and validate for the errors)."""
    where = str(path) if where is None else where
    return validate(model, read_json(path, where), where)


def to_text(data: Any, where: str, indent: int | None = 2) -> str:
    """JSON text of `data`, one trailing newline; ValueError naming `where` for what JSON cannot
    hold (NaN, infinities, objects), before anything is written."""
    try:
        return json.dumps(data, indent=indent, allow_nan=False, ensure_ascii=False) + "\n"
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: cannot be written as JSON: {exc}") from None


def write_text(path: str | Path, text: str, *, overwrite: bool = True, mode: int = 0o644) -> None:
    """Write `text` to `path` atomically: a temporary file beside it, fsync, then rename.

    An existing file is replaced only at the rename. With overwrite=False an existing `path` is
    kept and FileExistsError raised (the link that publishes the file fails atomically). `mode`:
    mkstemp makes files 0600, and these files are read by other users (a compose step, a report).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        if overwrite:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # fails if `path` exists, with no window between check and write
            except FileExistsError:
                raise FileExistsError(f"{path} exists (not replaced)") from None
            os.unlink(tmp)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    """Make the rename itself durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
