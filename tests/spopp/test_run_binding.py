"""The run binding (spopp/settings/run_binding.py): the run, the tracker and the token are one model, read
under one set of variables by every process that joins a run, and refused at start when wrong."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from services.cli import build
from services.config.evaluator import EvaluatorSettings, ScoreSettings
from services.config.init import InitSettings
from services.config.learner import LearnerSettings
from services.config.rollout import RolloutSettings
from services.config.tracker import TrackerSettings
from spopp.settings.base import SettingsError
from spopp.settings.run_binding import RunBinding

TOKEN = "k" * 32
# Each run-bound settings class with what else it needs to validate.
BOUND = {
    RolloutSettings: {"model": "/m"},
    LearnerSettings: {"model": "/m"},
    EvaluatorSettings: {"tasks": "/t"},
    InitSettings: {"recipe": "spopp", "base_snapshot": "/m", "tasks": "/t"},
}
COMMANDS = {"rollout serve": RolloutSettings, "learner run": LearnerSettings, "evaluator run": EvaluatorSettings,
            "init": InitSettings}  # fmt: skip
SHARED = {"SPOPP_RUN": "math-s0", "SPOPP_TRACKER_URL": "http://127.0.0.1:18000", "SPOPP_API_TOKEN": TOKEN}


def _cli(args: list[str], env: dict[str, str]):
    import os

    clean = {k: None for k in os.environ if k.startswith("SPOPP_")}
    return CliRunner().invoke(build(), args, env={**clean, **env}, terminal_width=400)


@pytest.mark.parametrize("cls", BOUND, ids=lambda c: c.__name__)
def test_every_run_bound_service_takes_the_one_definition(cls):
    for name, field in RunBinding.model_fields.items():
        mine = cls.model_fields[name]
        assert (mine.annotation, mine.metadata, mine.default) == (
            field.annotation,
            field.metadata,
            field.default,
        )
        assert mine.description == field.description, name
    assert {cls.env_name(f) for f in RunBinding.model_fields} == set(SHARED)


def test_one_environment_binds_every_service_to_the_same_run():
    bound = [cls.resolve(env={**SHARED}, flags=extra) for cls, extra in BOUND.items()]
    assert {(b.run, b.tracker, b.api_token) for b in bound} == {
        (SHARED["SPOPP_RUN"], SHARED["SPOPP_TRACKER_URL"], TOKEN)
    }
    # A flag still binds one process otherwise (a test, a second run by hand).
    other = RolloutSettings.resolve(env=SHARED, flags={"model": "/m", "run": "other"})
    assert other.run == "other" and other.tracker == SHARED["SPOPP_TRACKER_URL"]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_names_the_shared_variables(command):
    out = _cli([*command.split(), "--help"], {}).output
    for var in SHARED:
        assert var in out, (command, var)


def test_the_per_service_names_of_before_are_refused_with_where_they_went():
    """SPOPP_ROLLOUT_RUN was read before the binding; a deployment still setting it must not start
    bound to a run it did not name, so it is refused, and the message names SPOPP_RUN."""
    for cls, extra in BOUND.items():
        for field, shared in (("run", "SPOPP_RUN"), ("tracker", "SPOPP_TRACKER_URL")):
            old = f"{cls.env_prefix}{field.upper()}"
            with pytest.raises(
                SettingsError, match=f"unknown environment variable.*{old}.*{field} is {shared}"
            ):
                cls.resolve(env={**SHARED, old: "x"}, flags=extra)
    out = _cli(["rollout", "serve", "--model", "/m", "--print-config"], {"SPOPP_ROLLOUT_RUN": "r"})
    assert out.exit_code == 2 and "run is SPOPP_RUN in every service" in out.output


def test_the_run_is_required_and_named_as_the_tracker_would_accept_it():
    out = _cli(["rollout", "serve", "--model", "/m", "--print-config"], {})
    assert out.exit_code == 2 and "run is required: give --run, SPOPP_RUN" in out.output
    for bad in ("a/b", "..", "", "x" * 257, "sp ace"):
        with pytest.raises(SettingsError, match="run"):
            LearnerSettings.resolve(env={}, flags={"model": "/m", "run": bad} if bad else {"model": "/m"})


@pytest.mark.parametrize(
    "url, why",
    [("127.0.0.1:8000", "http:// or https://"), ("ftp://h", "http:// or https://"), ("http://", "with a host"),
     ("http://h:8000/?a=1", "no query"), ("http://h#x", "no query")],
)  # fmt: skip
def test_a_tracker_that_is_no_base_url_is_refused_at_start(url, why):
    for cls, extra in BOUND.items():
        with pytest.raises(SettingsError, match=f"tracker .environment SPOPP_TRACKER_URL.*{why}"):
            cls.resolve(env={**SHARED, "SPOPP_TRACKER_URL": url}, flags=extra)
    ok = RolloutSettings.resolve(
        env={**SHARED, "SPOPP_TRACKER_URL": "https://tracker.example:8443/spopp"}, flags={"model": "/m"}
    )
    assert ok.tracker == "https://tracker.example:8443/spopp"  # a path prefix (a proxy) is a base URL


def test_a_token_the_tracker_would_refuse_is_refused_by_its_clients():
    for cls, extra in BOUND.items():
        with pytest.raises(SettingsError, match="api_token .environment SPOPP_API_TOKEN."):
            cls.resolve(env={**SHARED, "SPOPP_API_TOKEN": "short"}, flags=extra)
    with pytest.raises(SettingsError, match="api_token"):
        TrackerSettings.resolve(env={"SPOPP_API_TOKEN": "short"})
    # compose passes an unset token as "": no token, as for the tracker
    assert (
        RolloutSettings.resolve(env={**SHARED, "SPOPP_API_TOKEN": ""}, flags={"model": "/m"}).api_token
        is None
    )


def test_the_tracker_reads_no_binding_and_is_not_stopped_by_one():
    """compose hands its env file to every container, the tracker's included: SPOPP_TRACKER_URL
    starts with the tracker's prefix but is the binding's, not an unknown tracker setting."""
    s = TrackerSettings.resolve(env={**SHARED, "SPOPP_TRACKER_PORT": "18000"})
    assert s.port == 18000 and s.api_token == TOKEN and "run" not in TrackerSettings.model_fields


def test_scoring_folders_is_bound_to_no_run():
    assert not set(RunBinding.model_fields) & set(ScoreSettings.model_fields)
    out = _cli(["evaluator", "score", "--help"], {}).output
    assert "--run" not in out and "--tracker" not in out and "--tasks" in out
