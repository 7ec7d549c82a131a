"""Static checks of what cannot run here (no Docker engine): compose and Dockerfiles agree with the code."""

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from services.cli import build
from services.learner.config import LearnerSettings
from services.rollout.config import RolloutSettings
from services.tracker.config import TrackerSettings

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _evaluator_settings():
    from services.evaluator.config import EvaluatorSettings

    return EvaluatorSettings


def _fill(value: str) -> str:
    """Compose fills ${VAR:-default} from the environment; the default stands in for it here."""
    import re

    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


@pytest.mark.parametrize(
    "service,settings",
    [
        ("tracker", TrackerSettings),
        ("rollout", RolloutSettings),
        ("learner", LearnerSettings),
        ("evaluator", None),
    ],
)
def test_compose_environment_names_real_settings(service, settings):
    settings = settings or _evaluator_settings()
    spec = COMPOSE["services"][service]
    assert (ROOT / spec["build"]["dockerfile"]).exists()
    for name in spec["environment"]:
        assert name in settings.env_names(), f"{service}: {name} is no setting of {settings.__name__}"
    assert "SPOPP_API_TOKEN" in spec["environment"]  # one token, the same in every service


def test_compose_learner_resolves_to_valid_settings():
    """The learner's command and environment, applied to the example config, validate; it writes
    snapshots where the replicas and the evaluator read them."""
    learner = COMPOSE["services"]["learner"]
    command = [_fill(a) for a in learner["command"]]
    help_text = CliRunner().invoke(build(), ["learner", "run", "--help"], terminal_width=200).output
    for flag in (a for a in command if a.startswith("--")):
        assert flag in help_text, flag
    mounts = {m.split(":")[1]: m.split(":")[0] for m in learner["volumes"]}
    config = ROOT / mounts[command[command.index("--config") + 1]].removeprefix("./")
    env = {k: _fill(str(v)) for k, v in learner["environment"].items()}
    cfg = LearnerSettings.resolve(config, env)
    assert cfg.tracker == "http://tracker:8000" and cfg.host == "0.0.0.0"
    rollout = COMPOSE["services"]["rollout"]
    assert str(cfg.snapshots) == "/snapshots" and "snapshots:/snapshots:ro" in rollout["volumes"]
    assert "snapshots:/snapshots" in learner["volumes"]
    assert rollout["environment"]["SPOPP_ROLLOUT_LEARNER"] == f"http://learner:{cfg.port}"


def test_learner_image_has_no_vllm_sandbox_or_privileges():
    text = (ROOT / COMPOSE["services"]["learner"]["build"]["dockerfile"]).read_text().lower()
    dockerfile = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert "vllm" not in dockerfile and "bubblewrap" not in dockerfile
    assert not COMPOSE["services"]["learner"].get("privileged")
    # The services that run model-written code in bubblewrap are the replicas and the evaluator.
    for name in ("rollout", "evaluator"):
        assert "bubblewrap" in (ROOT / COMPOSE["services"][name]["build"]["dockerfile"]).read_text()


def test_compose_rollout_and_evaluator_resolve():
    for name, settings in (("rollout", RolloutSettings), ("evaluator", _evaluator_settings())):
        spec = COMPOSE["services"][name]
        env = {k: _fill(str(v)) for k, v in spec["environment"].items()}
        config = None
        if "--config" in spec["command"]:
            mounts = {m.split(":")[1]: m.split(":")[0] for m in spec["volumes"]}
            config = ROOT / mounts[spec["command"][spec["command"].index("--config") + 1]].removeprefix("./")
        s = settings.resolve(config, env)
        assert s.tracker == "http://tracker:8000" and s.host == "0.0.0.0"


def test_unset_token_from_compose_means_no_auth():
    assert TrackerSettings.resolve(env={"SPOPP_API_TOKEN": ""}).api_token is None
    assert TrackerSettings.resolve(env={"SPOPP_API_TOKEN": "x" * 20}).api_token == "x" * 20


def test_short_token_is_refused():
    from spopp.settings import SettingsError

    with pytest.raises(SettingsError, match="api_token .environment SPOPP_API_TOKEN."):
        TrackerSettings.resolve(env={"SPOPP_API_TOKEN": "short"})


def test_learner_example_config_loads_and_bad_configs_say_why(tmp_path):
    from spopp.settings import SettingsError

    cfg = LearnerSettings.resolve(ROOT / "deploy" / "learner.example.yaml", env={})
    assert (cfg.batch_size, cfg.mini_batches, cfg.lr, cfg.weight_decay) == (128, 4, 1e-6, 0.1)
    bad = tmp_path / "bad.yaml"
    for text, needle in [
        ("run: r\nmodel: m\nbatch_size: 10\nmini_batches: 4\n", "split into 4 mini-batches"),
        ("run: r\nmodel: m\nzero_stage: 5\n", "zero_stage"),
        ("run: r\nmodel: m\nzero_stage: 0\ndtype: bf16\n", "zero_stage 1"),
        ("run: r\nmodel: m\nlearning_rate: 1\n", "unknown setting 'learning_rate'"),
        ("run: r\n", "model is required"),
        ("- a list\n", "mapping"),
        ("run: [unclosed\n", "not valid YAML"),
    ]:
        bad.write_text(text)
        with pytest.raises(SettingsError) as err:
            LearnerSettings.resolve(bad, env={})
        assert needle in str(err.value), text
