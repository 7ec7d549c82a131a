"""The deployment's data step: the shared API token, Redis's password and the default task files,
each made once.

    python3 deploy/data_step.py --data /data --secrets /secrets --env toy-calc \
        --tasks tasks.jsonl --held-out held_out.jsonl

- Token: when SPOPP_API_TOKEN is empty and `<secrets>/api-token` does not exist, a new random
  token (64 hex digits) is written there, readable by its owner only; every service's entrypoint
  reads it (deploy/image/entrypoint.sh). A token set in .env is never written to the volume.
- Redis's password: when `<secrets>/redis-password` does not exist, a new random one (64 hex
  digits) is written there, and `<secrets>/redis.conf` (`requirepass ...`, the config file Redis
  starts with: the password is on no command line) is written to match it whenever it does not.
  Both are mode 0640, group `spopp`: the tracker (user spopp) and the redis image's user (a member
  of group spopp) read them; nobody else in the volume's containers does. Deleting the password
  file makes the next data step generate a new one (deploy/README.md: rotating it).
- Tasks: a training or held-out file that is missing is written with generated tasks of the
  environment (toy-calc: the CPU demo's tasks; math-tir: arithmetic word problems with a boxed
  answer), disjoint and fixed by --seed. A file that exists is left as it is, so your own data
  placed in the data volume (or the SPOPP_DATA folder) always wins. ALFWorld's tasks come from
  `spopp alfworld generate`, not from here.
Compose runs it as the `data` service on every `up`; it is idempotent.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path
from typing import ClassVar

from pydantic import Field

from runtime.envs.toy_calc import generate_toy_calc_tasks
from runtime.tasks import generate_arithmetic_tasks, write_jsonl
from spopp.settings.base import Settings, SettingsError
from spopp.settings.fields import ApiToken


class DataStepSettings(Settings):
    """What the step reads from its environment, through the settings like every service: only the
    shared token (SPOPP_API_TOKEN), so a token the tracker would refuse is refused here first."""

    env_prefix: ClassVar[str] = "SPOPP_DATA_STEP_"
    api_token: ApiToken | None = Field(None, description="the token .env sets; unset or empty: generated")


SIZES = {"toy-calc": (128, 32), "math-tir": (2048, 256)}


def ensure_token(folder: Path) -> str:
    """'set in .env', 'kept' or 'generated': what happened to the token."""
    path = folder / "api-token"
    kept = path.read_text().strip() if path.is_file() else ""
    given = DataStepSettings.resolve().api_token or ""
    # The entrypoint exports the volume's token before this step runs (deploy/image/entrypoint.sh):
    # the same value in the environment is the kept one, not one set in .env.
    if given and given != kept:
        return "set in .env"
    if kept:
        return "kept"
    folder.mkdir(parents=True, exist_ok=True)
    _write(path, secrets.token_hex(32) + "\n", 0o600)
    return "generated"


REDIS_PASSWORD = "redis-password"
REDIS_CONF = "redis.conf"
SHARED_MODE = 0o640  # owner spopp (the tracker), group spopp (the redis image's user is a member)


def _write(path: Path, text: str, mode: int) -> None:
    """`text` into `path` with `mode` from its first byte on (never a moment more readable), whole
    or not at all: a step cut off never leaves half a secret."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), mode)  # the umask took bits off os.open's mode; put back exactly these
        f.write(text)
    os.replace(tmp, path)


def ensure_redis_password(folder: Path) -> str:
    """'kept' or 'generated': what happened to Redis's password. redis.conf is (re)written whenever
    it does not say `requirepass <the password>`, so a rotated password reaches Redis at its next
    start."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / REDIS_PASSWORD
    text = path.read_text().strip() if path.is_file() else ""
    password = text.splitlines()[0] if text else ""  # the first line, as the tracker reads it
    what = "kept"
    if not password:
        password = secrets.token_hex(32)
        _write(path, password + "\n", SHARED_MODE)
        what = "generated"
    conf = folder / REDIS_CONF
    quoted = password.replace("\\", "\\\\").replace('"', '\\"')  # a config file's "string"
    text = f'# Written by deploy/data_step.py from {REDIS_PASSWORD}; rewritten when that changes.\n' \
           f'requirepass "{quoted}"\n'  # fmt: skip
    if not conf.is_file() or conf.read_text() != text:
        _write(conf, text, SHARED_MODE)
    for p in (path, conf):  # a file from before keeps no looser mode
        if (p.stat().st_mode & 0o777) != SHARED_MODE:
            p.chmod(SHARED_MODE)
    return what


def tasks_for(env: str, n: int, seed: int, split: str) -> list:
    if env == "toy-calc":
        return generate_toy_calc_tasks(n, seed, split)
    # math-tir: arithmetic tasks; the held-out ones from another seed (ids carry the seed: disjoint)
    return generate_arithmetic_tasks(n, seed=seed if split == "train" else seed + 1_000_003)


def ensure_tasks(folder: Path, env: str, name: str, split: str, n: int, seed: int) -> str:
    path = folder / name
    if path.exists():
        return f"{path} exists, used as it is"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    write_jsonl(tasks_for(env, n, seed, split), tmp)
    os.replace(tmp, path)
    return f"{path}: {n} generated {env} {split} tasks"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=Path("/data"), help="the data volume")
    p.add_argument("--secrets", type=Path, default=Path("/secrets"), help="the secrets volume")
    p.add_argument("--env", default="math-tir", help="environment of the default tasks")
    p.add_argument(
        "--family", default="",
        help="the default tasks' family where the environment is a plug-in (SPOPP_TASK_FAMILY: toy-calc "
        "for an agent that plays toy-calc); empty: the environment's own",
    )  # fmt: skip
    p.add_argument("--tasks", default="tasks.jsonl", help="training task file, under --data")
    p.add_argument("--held-out", default="held_out.jsonl", help="held-out task file, under --data")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated tasks")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        token = ensure_token(a.secrets)
    except SettingsError as exc:  # e.g. a .env token shorter than the tracker takes: nothing written
        print(f"data: {exc}", file=sys.stderr)
        return 2
    print(f"data: token {token}", flush=True)
    print(f"data: redis password {ensure_redis_password(a.secrets)}", flush=True)
    family = a.family or a.env
    if family not in SIZES:
        missing = [n for n in (a.tasks, a.held_out) if not (a.data / n).exists()]
        if missing:
            print(f"data: env {family} has no default tasks; put {', '.join(missing)} into the data volume",
                  file=sys.stderr)  # fmt: skip
            return 1
        return 0
    n_train, n_heldout = SIZES[family]
    print("data: " + ensure_tasks(a.data, family, a.tasks, "train", n_train, a.seed), flush=True)
    print("data: " + ensure_tasks(a.data, family, a.held_out, "heldout", n_heldout, a.seed), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
