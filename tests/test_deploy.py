"""Static checks of what cannot run here (no Docker engine): compose and Dockerfiles agree with the code."""

from pathlib import Path

import yaml

from services.tracker.config import TrackerSettings

ROOT = Path(__file__).resolve().parents[1]


def test_compose_tracker_settings_are_real_settings():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    tracker = compose["services"]["tracker"]
    assert (ROOT / tracker["build"]["dockerfile"]).exists()
    fields = set(TrackerSettings.model_fields)
    for name in tracker["environment"]:
        assert name.startswith("SPOPP_") and name[6:].lower() in fields, name
    assert "--appendonly" in compose["services"]["redis"]["command"]


def test_compose_rollout_settings_are_real_settings():
    from services.rollout.config import RolloutSettings

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    rollout = compose["services"]["rollout"]
    assert (ROOT / rollout["build"]["dockerfile"]).exists()
    fields = set(RolloutSettings.model_fields)
    for name in rollout["environment"]:
        assert name.startswith("SPOPP_ROLLOUT_") and name[14:].lower() in fields, name
    # The command's flags are flags of `spopp rollout serve`.
    from typer.testing import CliRunner

    from spopp.cli import app

    help_text = CliRunner().invoke(app, ["rollout", "serve", "--help"], env={"COLUMNS": "200"}).output
    for flag in (a for a in rollout["command"] if a.startswith("--")):
        assert flag in help_text, flag


def test_compose_learner_command_is_a_valid_learner_config():
    """The compose learner's flags exist, its --set overrides name real settings and, applied to
    the example config, validate; it writes snapshots where the replicas read them."""
    from typer.testing import CliRunner

    from services.learner.config import LearnerConfig
    from spopp.cli import app

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    learner, rollout = compose["services"]["learner"], compose["services"]["rollout"]
    assert (ROOT / learner["build"]["dockerfile"]).exists()
    command = learner["command"]
    help_text = CliRunner().invoke(app, ["learner", "run", "--help"], env={"COLUMNS": "200"}).output
    for flag in (a for a in command if a.startswith("--")):
        assert flag in help_text, flag
    # Compose fills ${VAR:-default} from the environment; the defaults stand in for it here.
    sets = [
        command[i + 1].replace("${SPOPP_RUN:-math-spopp}", "math-spopp")
        for i, a in enumerate(command)
        if a == "--set"
    ]
    mounts = {m.split(":")[1]: m.split(":")[0] for m in learner["volumes"]}
    config = ROOT / mounts[command[command.index("--config") + 1]].removeprefix("./")
    cfg = LearnerConfig.from_yaml(config, sets)
    assert cfg.tracker == "http://tracker:8000" and cfg.host == "0.0.0.0"
    assert str(cfg.snapshots) == "/snapshots" and "snapshots:/snapshots:ro" in rollout["volumes"]
    assert "snapshots:/snapshots" in learner["volumes"]  # read-write for the learner only
    assert str(cfg.eval.tasks) == "/data/held_out.jsonl"
    assert rollout["environment"]["SPOPP_ROLLOUT_LEARNER"] == f"http://learner:{cfg.port}"


def test_set_overrides_reach_nested_settings_and_say_what_is_wrong(tmp_path):
    import pydantic
    import pytest

    from services.learner.config import LearnerConfig

    base = tmp_path / "l.yaml"
    base.write_text("run: r\nmodel: m\neval: {every: 2, tasks: a.jsonl}\n")
    cfg = LearnerConfig.from_yaml(base, ["eval.every=4", "lr=3e-6", "betas=[0.9, 0.95]", "grad_clip=null"])
    assert (cfg.eval.every, cfg.lr, cfg.betas, cfg.grad_clip) == (4, 3e-6, (0.9, 0.95), None)
    assert LearnerConfig.from_yaml(base, ["eval="]).eval is None
    # Text settings keep the text: a numeric run name, a hex-looking token.
    cfg = LearnerConfig.from_yaml(base, ["run=123", "tracker_token=0x1F", "eval.tasks=2024-01-01.jsonl"])
    assert (cfg.run, cfg.tracker_token, str(cfg.eval.tasks)) == ("123", "0x1F", "2024-01-01.jsonl")
    empty_eval = tmp_path / "e.yaml"
    empty_eval.write_text("run: r\nmodel: m\neval:\n")  # a group left empty in the file
    assert LearnerConfig.from_yaml(empty_eval, ["eval.every=3", "eval.tasks=t.jsonl"]).eval.every == 3
    for bad, needle in [
        ("lr", "KEY=VALUE"),
        ("=3", "KEY=VALUE"),
        ("run.x=1", "not a group"),
        ("lr.x=1", "valid number"),
        ("nope=1", "nope"),
    ]:
        with pytest.raises((ValueError, pydantic.ValidationError)) as err:
            LearnerConfig.from_yaml(base, [bad])
        assert needle in str(err.value), bad


def test_unset_token_from_compose_means_no_auth(monkeypatch):
    monkeypatch.setenv("SPOPP_API_TOKEN", "")
    assert TrackerSettings().api_token is None
    monkeypatch.setenv("SPOPP_API_TOKEN", "x" * 20)
    assert TrackerSettings().api_token == "x" * 20


def test_short_token_is_refused(monkeypatch):
    import pydantic
    import pytest

    monkeypatch.setenv("SPOPP_API_TOKEN", "short")
    with pytest.raises(pydantic.ValidationError):
        TrackerSettings()


def test_learner_example_config_loads_and_bad_configs_say_why(tmp_path):
    import pydantic
    import pytest

    from services.learner.config import LearnerConfig

    cfg = LearnerConfig.from_yaml(ROOT / "deploy" / "learner.example.yaml")
    assert (cfg.batch_size, cfg.mini_batches, cfg.lr, cfg.weight_decay) == (128, 4, 1e-6, 0.1)
    bad = tmp_path / "bad.yaml"
    for text, needle in [
        ("run: r\nmodel: m\nbatch_size: 10\nmini_batches: 4\n", "split into 4 mini-batches"),
        ("run: r\nmodel: m\nzero_stage: 5\n", "zero_stage"),
        ("run: r\nmodel: m\nzero_stage: 0\ndtype: bf16\n", "zero_stage 1"),
        ("run: r\nmodel: m\nlearning_rate: 1\n", "learning_rate"),
        ("run: r\nmodel: m\neval: {every: 5}\n", "tasks"),
        ("run: r\nmodel: m\nupdates_per_publish: 2\neval: {every: 3, tasks: t.jsonl}\n", "multiple of"),
        ("run: r\nmodel: m\neval: {every: 2, tasks: t.jsonl, greedy: false, samples: 0}\n", "greedy"),
        ("- a list\n", "mapping"),
    ]:
        bad.write_text(text)
        with pytest.raises((pydantic.ValidationError, ValueError)) as err:
            LearnerConfig.from_yaml(bad)
        assert needle in str(err.value)
