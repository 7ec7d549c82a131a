"""The run's bearer token when the user gives none: made once per run folder, kept there for its owner.

A launch without SPOPP_API_TOKEN (or `api_token:`) used to start every service without a token,
so anything on the machine that could reach a port (an agent's child process holding only its
episode's token, another user) could read and change the run at the tracker and post to the
learner. Now such a launch makes a random token into `<run_dir>/api-token`, readable by its owner
only, hands it to its children in their environment (children.child_env) and uses it for its own
requests; a resume of the folder reads it back, so the services of every launch of one run share
it. A token the user sets wins and the file is neither read nor written. The token is never printed:
launch.yaml and the children's config files leave secrets out (Settings.to_file), --print-config
masks it, and no message here quotes it.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

from spopp.settings.fields import MAX_TOKEN_CHARS, MIN_TOKEN_CHARS

if TYPE_CHECKING:
    from services.config.launch import LaunchSettings

TOKEN_FILE = "api-token"
MODE = 0o600


class RunTokenError(RuntimeError):
    """The run folder's token file cannot be used; the message names the file, never its text."""


def token_path(run_dir: Path) -> Path:
    return Path(run_dir) / TOKEN_FILE


def read_run_token(run_dir: Path) -> str | None:
    """The token kept in the run folder, None when there is none yet. A file others may read is
    made owner-only again (the token may have leaked: delete the file to make a new one)."""
    path = token_path(run_dir)
    try:
        text = path.read_text().strip()
        mode = path.stat().st_mode & 0o777
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise RunTokenError(
            f"{path} is unreadable ({type(exc).__name__}): delete it to make a new token"
        ) from None
    # Only what an HTTP header carries as it is: the services compare the header's bytes.
    if not (MIN_TOKEN_CHARS <= len(text) <= MAX_TOKEN_CHARS and text.isascii() and text.isprintable()) or any(
        c.isspace() for c in text
    ):
        raise RunTokenError(
            f"{path} does not hold a token ({MIN_TOKEN_CHARS}..{MAX_TOKEN_CHARS} printable ASCII characters, "
            "no spaces): delete it to make a new one, or set SPOPP_API_TOKEN"
        )
    if mode & 0o077:
        path.chmod(MODE)
    return text


def use_run_token(s: LaunchSettings) -> str | None:
    """Give `s` the run's token when it has none of the user's: the one its folder keeps ('kept'),
    else a new one ('made', kept by save_run_token once the launch starts, so that a --check or a
    --print-config writes nothing). Answers which, None for the user's own. Every part of the
    launch reads the token from `s` (the plan, each child's environment, the launcher's clients),
    so all of them see the one the services ask for."""
    if s.api_token is not None:
        return None
    kept = read_run_token(Path(s.run_dir))
    s.api_token = kept or new_run_token()
    return "kept" if kept else "made"


def new_run_token() -> str:
    """32 random bytes, URL-safe (43 characters): fit for a header as they are."""
    return secrets.token_urlsafe(32)


def save_run_token(run_dir: Path, token: str) -> Path:
    """Keep `token` in the run folder: owner-only from the file's first byte (created with mode 0600,
    never chmod-ed after it is written) and whole or not at all (written under another name, then
    linked to its own, which fails rather than replace a token another launch kept first)."""
    path = token_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{TOKEN_FILE}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, MODE)
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), MODE)  # a umask may take bits off, never add them: exactly these
            f.write(token + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            if read_run_token(run_dir) != token:
                raise RunTokenError(
                    f"{path} was made by another launch of this folder meanwhile: one launch at a time"
                ) from None
    finally:
        tmp.unlink(missing_ok=True)
    return path
