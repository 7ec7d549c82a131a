"""The snapshot folder: one layout shared by the learner (writes, prunes), the rollout replicas and
the evaluator (read), and the evaluator's holds on versions it has still to score.

Layout under the snapshot root (the learner's `snapshots` setting, shared storage):

    v000007/                   one published policy version, complete once it has this name
      manifest.json            {"version": 7, "step": 14, "files": {...}, ...} (`Manifest`)
    v000008.tmp/, v000003.del/ a publish or a deletion under way (never a published version)
    .holds/<holder>.json       {"holder", "from_version", "every", "expires_at"}: a hold

A hold asks the learner's pruning, which otherwise keeps only the newest K snapshots, to spare
every version v with `v >= from_version and v % every == 0` until `expires_at` (unix seconds).
Its holder refreshes it while it runs and removes it when it stops; a holder that dies leaves a
hold that ends by itself. Hold files are written to a temporary name and renamed, so a reader
sees an old hold or a new one, never half of one. Expiry compares wall clocks of two machines:
keep `hold_seconds` well above their skew.

No torch here: pure file-system conventions, usable by every service.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field

from spopp.files.jsonfile import FileFormatError, read_json, read_model, to_text

log = logging.getLogger("spopp.snapshots")

MANIFEST = "manifest.json"
HOLDS_DIR = ".holds"
_FINAL = re.compile(r"^v(\d{6,})$")
# A holder id is a file name: no separators, no leading dot (hidden and temporary files).
HOLDER_PATTERN = r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,199}$"
_HOLDER = re.compile(HOLDER_PATTERN)


def version_dirname(version: int) -> str:
    """The folder name of a published version: `v000007`."""
    if version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    return f"v{version:06d}"


def parse_version_dirname(name: str) -> int | None:
    """The version a published folder's name carries, None for any other name."""
    m = _FINAL.match(name)
    return int(m.group(1)) if m else None


def list_snapshots(root: str | Path) -> list[tuple[int, Path]]:
    """Published (complete) snapshots under `root` as (version, path), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        version = parse_version_dirname(p.name)
        if version is not None and p.is_dir():
            found.append((version, p))
    return sorted(found)


def snapshot_path(uri: str) -> Path:
    """`file:///abs/dir` or a plain path; other schemes need a fetcher we do not have yet."""
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        return Path(parsed.path if parsed.scheme else uri)
    raise ValueError(f"unsupported snapshot URI {uri!r}: use a path on shared storage or file://")


class ManifestFile(BaseModel):
    """One weights file of a snapshot, as the learner wrote it."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="hex SHA-256 of the file")
    bytes: int = Field(ge=0, description="the file's size")


class Manifest(BaseModel):
    """A snapshot's manifest.json, written by the learner's publish and read by every consumer.

    Readers need only `version` and `step`, so the rest is optional: folders made by hand (a test,
    `spopp evaluator score` on a copy) carry no more, and keys a later learner adds are kept.
    """

    model_config = ConfigDict(strict=True, extra="allow", frozen=True)

    version: int = Field(ge=0, description="the policy version the folder publishes")
    step: int | None = Field(
        None, ge=0, description="the learner's update count at the publish; null in manifests without it"
    )
    files: dict[str, ManifestFile] = Field(default_factory=dict, description="weights files by name")
    base_model: str | None = Field(None, description="the base model folder (config, tokenizer)")
    created_at: str | None = Field(None, description="ISO 8601 time of the publish (UTC)")
    lora: dict[str, Any] | None = Field(
        None,
        description="set when the folder holds LoRA adapters alone (PEFT's adapter_model.safetensors and "
        "adapter_config.json) for base_model: {rank, alpha, target_modules}",
    )

    def same_weights(self, other: Manifest) -> bool:
        """Whether `other` publishes this version with these very weights (a learner's re-publish)."""
        return self.version == other.version and self.files == other.files


def _json_object(path: Path) -> dict:
    """A file holding one JSON object; ValueError naming the file otherwise (OSError if unreadable)."""
    data = read_json(path)
    if not isinstance(data, dict):
        raise FileFormatError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def read_manifest(folder: str | Path) -> Manifest:
    """A snapshot's manifest.json, checked.

    Raises FileNotFoundError when there is none, ValueError (FileFormatError: `<file>: <field>:
    <what>`) when it is not a manifest.
    """
    return read_model(Path(folder) / MANIFEST, Manifest)


def write_manifest(folder: str | Path, manifest: Manifest) -> Path:
    """Write `folder/manifest.json` (into a folder that is published by renaming it, so the file
    itself needs no temporary name); ValueError before anything is written when it cannot be JSON."""
    path = Path(folder) / MANIFEST
    text = to_text(manifest.model_dump(mode="json", exclude_unset=True), str(path))
    path.write_text(text)
    return path


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# -- holds -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hold:
    holder: str
    from_version: int
    every: int
    expires_at: float  # unix seconds

    def __post_init__(self) -> None:
        if not isinstance(self.holder, str) or not _HOLDER.match(self.holder):
            raise ValueError(f"holder {self.holder!r} must match {HOLDER_PATTERN} (it names a file)")
        if not _is_int(self.from_version) or self.from_version < 0:
            raise ValueError(f"from_version must be an integer >= 0, got {self.from_version!r}")
        if not _is_int(self.every) or self.every < 1:
            raise ValueError(f"every must be an integer >= 1, got {self.every!r}")
        if isinstance(self.expires_at, bool) or not isinstance(self.expires_at, int | float):
            raise ValueError(f"expires_at must be a number (unix seconds), got {self.expires_at!r}")
        if not math.isfinite(self.expires_at):
            raise ValueError(f"expires_at must be finite, got {self.expires_at!r}")

    def covers(self, version: int) -> bool:
        """Whether this hold asks to keep `version` (expiry aside)."""
        return version >= self.from_version and version % self.every == 0

    def expired(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) >= self.expires_at


def holds_dir(root: str | Path) -> Path:
    return Path(root) / HOLDS_DIR


def hold_file(root: str | Path, holder: str) -> Path:
    return holds_dir(root) / f"{holder}.json"


def write_hold(root: str | Path, hold: Hold) -> Path:
    """Write (or replace) `hold` under `root/.holds/`, atomically: temporary file, fsync, rename."""
    folder = holds_dir(root)
    folder.mkdir(parents=True, exist_ok=True)
    path = hold_file(root, hold.holder)
    tmp = folder / f".{hold.holder}.json.{os.getpid()}-{threading.get_ident()}.tmp"
    with tmp.open("w", encoding="utf-8") as f:
        f.write(json.dumps(asdict(hold)) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def remove_hold(root: str | Path, holder: str) -> bool:
    """Remove `holder`'s hold; answers whether there was one."""
    try:
        hold_file(root, holder).unlink()
        return True
    except FileNotFoundError:
        return False


def read_hold(path: str | Path) -> Hold:
    """One hold file; ValueError (or OSError) when it is not a hold."""
    data = _json_object(Path(path))
    fields = {"holder", "from_version", "every", "expires_at"}
    if set(data) != fields:
        raise ValueError(f"expected the keys {sorted(fields)}, got {sorted(data)}")
    hold = Hold(**data)
    if path.name != f"{hold.holder}.json":
        raise ValueError(f"holder {hold.holder!r} does not match the file name")
    return hold


def read_holds(root: str | Path, now: float | None = None) -> list[Hold]:
    """The unexpired holds under `root`. Malformed hold files are logged and ignored, as are
    expired ones: a holder that died stops protecting anything once its hold expires."""
    folder = holds_dir(root)
    if not folder.is_dir():
        return []
    now = time.time() if now is None else now
    holds = []
    for path in sorted(folder.glob("*.json")):
        if path.name.startswith("."):
            continue  # a temporary file being written
        try:
            hold = read_hold(path)
        except FileNotFoundError:
            continue  # removed by its holder meanwhile
        except (OSError, ValueError, TypeError) as exc:
            log.warning("ignoring malformed hold file %s: %s", path, exc)
            continue
        if not hold.expired(now):
            holds.append(hold)
    return holds


def held(version: int, holds: list[Hold]) -> bool:
    """Whether any of `holds` covers `version`."""
    return any(h.covers(version) for h in holds)
