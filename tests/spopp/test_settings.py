"""Settings of every service: one order (default < file < SPOPP_* environment < flag), every field
on the command line, one token name, and bad settings refused with the field and its source."""

from __future__ import annotations

import pytest
import yaml
from click.testing import CliRunner

from services.cli import build
from spopp.settings.base import Settings

# (command, settings needed to validate at all, a numeric field to probe precedence with)
COMMANDS = {
    "tracker serve": ({}, "port"),
    "rollout serve": ({"run": "r", "model": "m"}, "concurrency"),
    "learner run": ({"run": "r", "model": "m"}, "checkpoint_every"),
    "evaluator run": ({"run": "r", "model": "m", "tasks": "t.jsonl"}, "concurrency"),
}


def settings_class(command: str) -> type[Settings]:
    cmd = build()
    for word in command.split():
        cmd = cmd.commands[word]
    return cmd.settings_cls


def resolved(command: str, args=(), env=None) -> dict:
    clean = {k: None for k in __import__("os").environ if k.startswith("SPOPP_")}
    result = CliRunner().invoke(
        build(), [*command.split(), *args, "--print-config"], env={**clean, **(env or {})}
    )
    assert result.exit_code == 0, result.output
    return yaml.safe_load(result.output)


@pytest.mark.parametrize("command", COMMANDS)
def test_flag_beats_environment_beats_file_beats_default(command, tmp_path):
    required, field = COMMANDS[command]
    cls = settings_class(command)
    default = cls.model_fields[field].default
    flag = "--" + field.replace("_", "-")
    env_var = cls.env_name(field)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({**required, field: default + 1}))

    assert resolved(command, ["--config", str(config)])[field] == default + 1  # file over default
    env = {env_var: str(default + 2)}
    assert resolved(command, ["--config", str(config)], env)[field] == default + 2  # env over file
    out = resolved(command, ["--config", str(config), flag, str(default + 3)], env)
    assert out[field] == default + 3  # flag over env
    # and with nothing given, the default
    assert resolved(command, [f"--{k.replace('_', '-')}={v}" for k, v in required.items()])[field] == default


@pytest.mark.parametrize("command", COMMANDS)
def test_every_field_is_a_flag_with_help_and_the_token_has_one_name(command):
    cls = settings_class(command)
    help_text = CliRunner().invoke(build(), [*command.split(), "--help"], terminal_width=400).output
    for name, field in cls.model_fields.items():
        assert f"--{name.replace('_', '-')}" in help_text, name
        assert field.description, f"{cls.__name__}.{name} has no description"
        assert cls.env_name(name) in help_text, name
    assert cls.env_name("api_token") == "SPOPP_API_TOKEN"
    required, _ = COMMANDS[command]
    args = [f"--{k.replace('_', '-')}={v}" for k, v in required.items()]
    shown = resolved(command, args, {"SPOPP_API_TOKEN": "s3cret-token-0123456789"})
    assert shown["api_token"] == "***"  # printed masked


def test_numeric_bounds_are_declared():
    """Every int or float field states a lower and an upper bound, or is a port-like choice."""
    for command in COMMANDS:
        cls = settings_class(command)
        for name, field in cls.model_fields.items():
            if field.annotation in (int, float, int | None, float | None):
                kinds = {type(m).__name__ for m in field.metadata}
                assert kinds & {"Ge", "Gt"}, f"{cls.__name__}.{name} has no lower bound"


def test_bad_settings_name_the_field_and_its_source(tmp_path):
    runner = CliRunner()
    app = build()
    out = runner.invoke(app, ["tracker", "serve", "--port", "70000", "--print-config"]).output
    assert "port (flag --port)" in out and "65535" in out
    out = runner.invoke(app, ["tracker", "serve", "--print-config"], env={"SPOPP_TRACKER_PORT": "x"}).output
    assert "port (environment SPOPP_TRACKER_PORT)" in out
    out = runner.invoke(app, ["tracker", "serve", "--print-config"], env={"SPOPP_TRACKER_PROT": "1"}).output
    assert "unknown environment variable(s) SPOPP_TRACKER_PROT" in out
    config = tmp_path / "t.yaml"
    config.write_text("prot: 1\n")
    out = runner.invoke(app, ["tracker", "serve", "--config", str(config), "--print-config"]).output
    assert "unknown setting 'prot'" in out
    out = runner.invoke(app, ["rollout", "serve", "--print-config"]).output
    assert "model is required" in out and "SPOPP_ROLLOUT_MODEL" in out


def test_a_renamed_launch_key_is_refused_with_its_new_name(tmp_path):
    # `updates` of a launch file from before the rename: in the file, by --set, or in the environment.
    from services.config.launch import LaunchSettings
    from services.launch.cli import resolve
    from spopp.settings.base import SettingsError

    hint = "updates: renamed max_updates (the run's budget in learner updates)"
    config = tmp_path / "launch.yaml"
    config.write_text("model: m\ntasks: t.jsonl\nupdates: 40\n")
    with pytest.raises(SettingsError) as err:
        resolve(config)
    assert f"{hint} (config file {config})" in str(err.value)
    config.write_text("model: m\ntasks: t.jsonl\n")
    with pytest.raises(SettingsError) as err:
        resolve(config, ("updates=40",))
    assert f"{hint} (flag --updates)" in str(err.value)
    with pytest.raises(SettingsError) as err:
        LaunchSettings.resolve(config, {"SPOPP_LAUNCH_UPDATES": "40"})
    assert "unknown environment variable(s) SPOPP_LAUNCH_UPDATES" in str(err.value) and hint in str(err.value)
    assert resolve(config, ("max_updates=40",)).max_updates == 40


def test_text_stays_text_and_structured_values_are_read_as_yaml():
    from services.config.learner import LearnerSettings
    from services.config.rollout import RolloutSettings

    s = LearnerSettings.resolve(
        env={"SPOPP_RUN": "123", "SPOPP_API_TOKEN": "0x1F00000000000000"},
        flags={"model": "2024-01-01", "betas": "[0.9, 0.95]", "grad_clip": "null"},
    )
    assert (s.run, s.api_token, str(s.model), s.betas, s.grad_clip) == (
        "123",
        "0x1F00000000000000",  # read as YAML it would be an integer
        "2024-01-01",
        (0.9, 0.95),
        None,
    )
    r = RolloutSettings.resolve(
        env={"SPOPP_ROLLOUT_ENGINE_OPTIONS": "{device: cpu, max_model_len: 512}"},
        flags={"model": "m", "run": "r"},
    )
    assert r.engine_options == {"device": "cpu", "max_model_len": 512}


@pytest.mark.parametrize("command", ["rollout serve", "evaluator run"])
def test_an_engine_option_that_is_a_field_of_its_own_is_refused(command):
    """engine_options.lora_rank would be passed to the engine beside the section's own lora_rank:
    the evaluator died on it at start-up, again at every restart. Refused where the settings are
    read, with the field to use."""
    required, _ = COMMANDS[command]
    flags = [x for k, v in required.items() for x in (f"--{k.replace('_', '-')}", v)]
    out = CliRunner().invoke(
        build(), [*command.split(), *flags, "--engine-options", "{lora_rank: 8}", "--print-config"]
    )
    assert out.exit_code != 0
    assert "engine_options.lora_rank is not an engine option here" in out.output
    assert "set the section's own lora_rank" in out.output
    ok = CliRunner().invoke(build(), [*command.split(), *flags, "--lora-rank", "8", "--print-config"])
    assert ok.exit_code == 0 and yaml.safe_load(ok.output)["lora_rank"] == 8


def test_episode_settings_are_declared_once_for_every_service_that_plays():
    """The rollout replica, the evaluator, `spopp prior` and a launch file's sections take how
    episodes are played from runtime/episode_settings.py: each field's type, bounds and description
    are the declaration's; only a default may be a service's own (EvaluatorEpisodes'), and the
    budget of an episode is built from the same fields."""
    from runtime.episode_settings import EpisodeTuning, bounds
    from services.config.launch import EvaluatorSection, RolloutSection

    own_defaults = {"engine": "transformers", "concurrency": 32}
    players = [settings_class("rollout serve"), settings_class("evaluator run"), settings_class("prior"),
               RolloutSection, EvaluatorSection]  # fmt: skip
    for cls in players:
        for name, declared in EpisodeTuning.model_fields.items():
            field = cls.model_fields[name]
            assert (field.annotation, field.metadata, field.description) == (
                declared.annotation, declared.metadata, declared.description,
            ), f"{cls.__name__}.{name} is declared again"  # fmt: skip
            if field.default != declared.default:
                assert own_defaults.get(name) == field.default, f"{cls.__name__}.{name}"
    # One set of bounds: the evaluator refuses what the replica refuses, naming the field.
    for command, required in (("rollout serve", {"run": "r", "model": "m"}),
                              ("evaluator run", {"run": "r", "model": "m", "tasks": "t.jsonl"})):  # fmt: skip
        r = CliRunner().invoke(
            build(), [*command.split(), *_flags(required), "--concurrency", "1025", "--print-config"]
        )
        assert r.exit_code != 0 and "concurrency" in r.output and "1024" in r.output, r.output
    assert bounds("max_turns") == (1, 1000)
    s = settings_class("rollout serve").model_validate(
        {"run": "r", "model": "m", "max_turns": 3, "max_total_tokens": 99}
    )
    assert (s.budget().max_turns, s.budget().max_tokens_per_turn, s.budget().max_total_tokens) == (
        3,
        1024,
        99,
    )


def _flags(values: dict) -> list[str]:
    return [x for k, v in values.items() for x in (f"--{k.replace('_', '-')}", str(v))]
