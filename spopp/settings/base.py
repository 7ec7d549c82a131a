"""Service settings: one typed model per service, read in one order, every field on the command line.

Each service describes its settings as a `Settings` subclass: a pydantic model whose fields carry
a description and their bounds. `resolve()` merges four sources, each overriding the one before:

    defaults  <  config file (YAML)  <  SPOPP_<SERVICE>_<FIELD> environment  <  command-line flags

The run binding is the one exception to the naming (spopp/settings/run_binding.py): the bearer token is
`SPOPP_API_TOKEN` in every service, and the run's name and the tracker's URL are `SPOPP_RUN` and
`SPOPP_TRACKER_URL` in every service bound to a run, so one secret and one run configure the
tracker, the replicas, the learner and the evaluator.
`settings_command()` turns a model into a click command with one option per field (listed by
`--help` with its default, bounds and variable), plus `--config FILE` and `--print-config`.

Text from the environment and from flags is read as YAML for fields that take numbers, booleans,
lists or mappings (`2`, `1e-6`, `[0.9, 0.95]`, `{device: cuda:1}`) and kept as it is for fields that
take text or paths, so a run named `123` stays a name. No torch or vLLM import here: `--help` is
instant and the tracker never imports torch.
"""

from __future__ import annotations

import os
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal, Self

import annotated_types
import click
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

API_TOKEN_ENV = "SPOPP_API_TOKEN"
RUN_ENV = "SPOPP_RUN"
TRACKER_URL_ENV = "SPOPP_TRACKER_URL"
# Read under one name by every service that takes them, so never a service's unknown variable
# (SPOPP_TRACKER_URL is not a tracker setting, though it starts with the tracker's prefix).
SHARED_ENV = frozenset({API_TOKEN_ENV, RUN_ENV, TRACKER_URL_ENV})
# SPOPP_* variables that are not a service's settings: the machine's, kept by `environ_without_settings`.
MACHINE_ENV = frozenset({"SPOPP_PORT_RANGE"})


def environ_without_settings(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment (this process's by default) less every service setting (`SPOPP_*`): what a
    child is started with when only what its starter passes may configure it. What describes the
    machine rather than a service (`MACHINE_ENV`: the port range to draw from) stays."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if not k.startswith("SPOPP_") or k in MACHINE_ENV}


class SettingsError(ValueError):
    """Settings that do not validate; the message names each field and where its value came from."""


class SettingsGroup(BaseModel):
    """A group of settings fields that several services' settings take alike (the HTTP server's
    bounds, a claim) or that one service's operator tunes (its `...Tuning` model, which is also
    that service's section of `spopp launch`'s file). Only a `Settings` subclass is read from
    files, the environment and flags."""

    model_config = ConfigDict(extra="forbid")


class Settings(SettingsGroup):
    """Base of every service's settings. Subclasses set `env_prefix` (e.g. `SPOPP_TRACKER_`)."""

    env_prefix: ClassVar[str] = "SPOPP_"
    # Fields printed as "***" by --print-config and never written to a resolved config file.
    secret_fields: ClassVar[frozenset[str]] = frozenset({"api_token"})
    # Fields read from one variable in every service rather than SPOPP_<SERVICE>_<FIELD>; RunBinding
    # (a base listed before Settings) adds the run's name and the tracker's URL.
    shared_env: ClassVar[Mapping[str, str]] = {"api_token": API_TOKEN_ENV}
    # Keys an earlier version read, by their old name: what they are called now. Given, they are
    # refused as unknown, with `<old>: renamed <new>` rather than a bare "unknown setting".
    renamed: ClassVar[Mapping[str, str]] = {}

    # Every command logs, so every command's settings say how (services.shell.logs).
    log_format: Literal["text", "json"] = Field(
        "text",
        description="how the process logs: text lines for a terminal, or json: one JSON object a "
        "line (time, level, service, run, worker, message and the event's fields) for a log collector",
    )

    @classmethod
    def env_name(cls, field: str) -> str:
        return cls.shared_env.get(field) or f"{cls.env_prefix}{field.upper()}"

    @classmethod
    def resolve(
        cls,
        config_file: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        flags: Mapping[str, Any] | None = None,
    ) -> Self:
        """Merge defaults < `config_file` < `env` (default: os.environ) < `flags` and validate.

        `flags` holds values already typed or as text (read like the environment's). Raises
        SettingsError naming every bad field and the source of its value.
        """
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        source: dict[str, str] = {}
        if config_file is not None:
            for key, value in read_config_file(config_file).items():
                values[key], source[key] = value, f"config file {config_file}"
        for name in cls.model_fields:
            var = cls.env_name(name)
            if var in env:
                values[name], source[name] = cls.parse_text(name, env[var]), f"environment {var}"
        unknown = sorted(
            k
            for k in env
            if k.startswith(cls.env_prefix) and k not in SHARED_ENV and k not in cls.env_names()
        )
        if unknown and cls.env_prefix != "SPOPP_":
            raise SettingsError(
                f"unknown environment variable(s) {', '.join(unknown)}: {cls.__name__} reads "
                f"{cls.env_prefix}<FIELD> for the fields listed by --help{cls._shared_hint(unknown)}"
                f"{cls._renamed_hint(unknown)}"
            )
        for name, value in (flags or {}).items():
            flag = "--" + name.replace("_", "-")
            values[name] = cls.parse_text(name, value) if isinstance(value, str) else value
            source[name] = f"flag {flag}"
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            raise SettingsError(_explain(cls, exc, source)) from None

    @classmethod
    def _shared_hint(cls, unknown: list[str]) -> str:
        """Where a shared field is read, for a variable named as if it were the service's own
        (SPOPP_ROLLOUT_RUN, as it was before the run binding)."""
        said = [
            f"{f} is {var}" for f, var in cls.shared_env.items() if f"{cls.env_prefix}{f.upper()}" in unknown
        ]
        return "; " + ", ".join(said) + " in every service" if said else ""

    @classmethod
    def _renamed_hint(cls, unknown: list[str]) -> str:
        """The new name of each variable named after a renamed field (SPOPP_LAUNCH_UPDATES)."""
        said = [
            f"{old}: renamed {new}"
            for old, new in cls.renamed.items()
            if f"{cls.env_prefix}{old.upper()}" in unknown
        ]
        return "; " + "; ".join(said) if said else ""

    @classmethod
    def env_names(cls) -> set[str]:
        return {cls.env_name(name) for name in cls.model_fields}

    @classmethod
    def parse_text(cls, name: str, raw: str) -> Any:
        """A value given as text (environment, flag): YAML unless the field takes text."""
        if name not in cls.model_fields:
            return raw  # validation reports the unknown name
        if raw.strip() == "":
            return None  # compose passes `${VAR:-}` through as an empty string when VAR is unset
        if _takes_text(cls.model_fields[name].annotation):
            return raw
        try:
            return yaml.safe_load(raw)
        except yaml.YAMLError:
            return raw  # let the field's validation say what it expected

    @classmethod
    def explain_nested(cls, err: Any) -> str:
        """What is wrong with a field of a nested model (one pydantic error), without its source."""
        path = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            return f"{path}: unknown setting"
        return f"{path}: {err['msg']}"

    def redacted(self) -> dict[str, Any]:
        """The settings as plain data, secrets masked: what --print-config shows."""
        data = self.model_dump(mode="json")
        for name in self.secret_fields & data.keys():
            if data[name] is not None:
                data[name] = "***"
        return data

    def to_file(self, path: str | Path) -> Path:
        """Write the resolved settings as a config file, secrets left out (they travel by env)."""
        data = {k: v for k, v in self.model_dump(mode="json").items() if k not in self.secret_fields}
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(yaml.safe_dump(data, sort_keys=False))
        tmp.rename(path)
        return path


def read_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise SettingsError(f"config file {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise SettingsError(f"config file {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsError(f"config file {path}: expected a mapping of settings, got {type(data).__name__}")
    return data


def _explain(cls: type[Settings], exc: ValidationError, source: dict[str, str]) -> str:
    lines = []
    for err in exc.errors():
        name = str(err["loc"][0]) if err["loc"] else "settings"
        where = source.get(name, "default")
        if len(err["loc"]) > 1:
            # A field of a nested model (a launch section): named by its path, `learner.lr`.
            lines.append(f"{cls.explain_nested(err)} ({where})")
        elif err["type"] == "extra_forbidden" and name in cls.renamed:
            lines.append(f"{name}: renamed {cls.renamed[name]} ({where})")
        elif err["type"] == "extra_forbidden":
            lines.append(f"unknown setting {name!r} ({where}); see --help for the settings")
        elif err["type"] == "missing":
            lines.append(
                f"{name} is required: give --{name.replace('_', '-')}, {cls.env_name(name)} or "
                f"`{name}:` in the config file"
            )
        else:
            lines.append(f"{name} ({where}): {err['msg']}")
    return f"invalid {cls.__name__}:\n  " + "\n  ".join(lines)


def _kinds(annotation: Any) -> set:
    """The types a field takes, None left out; an alias of spopp.settings.fields (`ApiToken | None` is
    `Annotated[str, ...] | None`: pydantic keeps the Annotated inside a union) counts as its type."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kinds = set(typing.get_args(annotation)) - {type(None)}
    else:
        kinds = {annotation}
    return {typing.get_args(k)[0] if typing.get_origin(k) is typing.Annotated else k for k in kinds}


def _takes_text(annotation: Any) -> bool:
    """Whether a field takes text or a path only (no number, boolean, list or mapping)."""
    kinds = _kinds(annotation)
    for kind in kinds:
        if typing.get_origin(kind) is Literal:
            if not all(isinstance(a, str) for a in typing.get_args(kind)):
                return False
        elif kind not in (str, Path):
            return False
    return bool(kinds)


def _metadata(field: Any) -> list:
    """The field's constraints: its own, and those of an Annotated alias inside a union (pydantic
    lifts an alias's constraints onto the field only when the alias is the whole annotation)."""
    out = list(field.metadata)
    annotation = field.annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            if typing.get_origin(arg) is typing.Annotated:
                for extra in typing.get_args(arg)[1:]:
                    out.extend(getattr(extra, "metadata", [extra]))
    return out


def _is_bool(annotation: Any) -> bool:
    return _kinds(annotation) == {bool}


def field_help(cls: type[Settings], name: str) -> str:
    """--help text of one field: description, default, bounds and environment variable."""
    field = cls.model_fields[name]
    parts = [field.description or ""]
    notes = []
    if not field.is_required():
        default = field.get_default(call_default_factory=True)
        if default not in (None, {}, []):
            notes.append(f"default {default}")
    else:
        notes.append("required")
    for meta in _metadata(field):
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if isinstance(meta, getattr(annotated_types, attr.capitalize())):
                notes.append(f"{sign} {getattr(meta, attr)}")
    for kind in _kinds(field.annotation):
        if typing.get_origin(kind) is Literal:
            notes.append("one of " + ", ".join(map(str, typing.get_args(kind))))
    notes.append(f"env {cls.env_name(name)}")
    return f"{parts[0]} [{'; '.join(notes)}]".strip()


def settings_command(
    cls: type[Settings],
    name: str,
    run: Callable[..., None],
    help: str,
    extra_params: Sequence[click.Parameter] = (),
) -> click.Command:
    """A click command with one option per settings field, `--config` and `--print-config`.

    `run(settings, **extra)` gets the resolved settings and the values of `extra_params`.
    """
    params: list[click.Parameter] = [
        click.Option(
            ["--config"],
            type=click.Path(dir_okay=False, path_type=Path),
            help="YAML file of settings (field: value); environment and flags override it",
        ),
        click.Option(
            ["--print-config"],
            is_flag=True,
            help="print the resolved settings (secrets masked) and exit",
        ),
        *extra_params,
    ]
    for field in cls.model_fields:
        opt = "--" + field.replace("_", "-")
        if _is_bool(cls.model_fields[field].annotation):
            decl = [f"{opt}/--no-{field.replace('_', '-')}", field]
            params.append(click.Option(decl, default=None, help=field_help(cls, field)))
        else:
            params.append(
                click.Option(
                    [opt, field], type=str, default=None, metavar="VALUE", help=field_help(cls, field)
                )
            )
    extra_names = {p.name for p in extra_params}

    def callback(config: Path | None, print_config: bool, **given: Any) -> None:
        extra = {k: given.pop(k) for k in list(given) if k in extra_names}
        flags = {k: v for k, v in given.items() if v is not None}
        try:
            settings = cls.resolve(config, os.environ, flags)
        except SettingsError as exc:
            raise click.UsageError(str(exc)) from None
        if print_config:
            click.echo(yaml.safe_dump(settings.redacted(), sort_keys=False), nl=False)
            return
        run(settings, **extra)

    command = click.Command(name, callback=callback, params=params, help=help)
    command.settings_cls = cls  # what a launcher or a test resolves for this command
    return command
