"""The restart policy of `spopp launch` (services/launch/supervise.py): backoff, budget, window.

Pure decisions on a clock the test holds; the launcher's use of them, with real processes killed
mid-run, is tests/launch/test_supervision_restarts.py.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.config.supervision import SupervisionSettings
from services.launch.supervise import GaveUp, RestartBudget, describe_exit
from spopp.files.records import RunRecord


def budget(**over) -> RestartBudget:
    return RestartBudget(SupervisionSettings(**over))


def test_backoff_doubles_from_its_start_up_to_its_cap():
    b = budget(max_restarts=10, window_seconds=1000, backoff_seconds=1, max_backoff_seconds=5)
    assert [b.death("learner", -9, t) for t in range(6)] == [1, 2, 4, 5, 5, 5]


def test_one_death_too_many_within_the_window_gives_up_naming_process_count_and_exit():
    b = budget(max_restarts=2, window_seconds=60)
    b.death("rollout-1", -9, 0.0)
    b.death("rollout-1", 1, 10.0)
    with pytest.raises(GaveUp) as err:
        b.death("rollout-1", -9, 25.0)
    message = str(err.value)
    assert message.startswith("died 3 times in 25 s, more than the 2 restarts")
    assert "within 60 s" in message and message.endswith("its last exit: SIGKILL")


def test_deaths_older_than_the_window_are_forgotten_and_the_backoff_starts_over():
    b = budget(max_restarts=2, window_seconds=60, backoff_seconds=1, max_backoff_seconds=30)
    assert b.death("tracker", -9, 0.0) == 1
    assert b.death("tracker", -9, 30.0) == 2
    # 70 s: the death at 0 left the window; two in it now (30, 70): still within the budget.
    assert b.death("tracker", -9, 70.0) == 2
    # After a whole quiet window, a death is a first one again.
    assert b.death("tracker", -9, 200.0) == 1


def test_each_process_has_its_own_budget():
    b = budget(max_restarts=1, window_seconds=60)
    b.death("rollout-0", -9, 0.0)
    assert b.death("rollout-1", -9, 1.0) == 1  # another process: its first death
    with pytest.raises(GaveUp):
        b.death("rollout-0", -9, 2.0)


def test_a_budget_of_zero_restarts_gives_up_at_the_first_death():
    with pytest.raises(GaveUp, match="died 1 times"):
        budget(max_restarts=0).death("evaluator", 2, 0.0)


@pytest.mark.parametrize(
    "over,field",
    [
        ({"max_restarts": -1}, "max_restarts"),
        ({"window_seconds": 0}, "window_seconds"),
        ({"backoff_seconds": -1}, "backoff_seconds"),
        ({"enabled": "yes"}, "enabled"),
        ({"restarts": 3}, "restarts"),
        ({"backoff_seconds": 10, "max_backoff_seconds": 5}, "max_backoff_seconds"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(over, field):
    with pytest.raises(ValidationError) as err:
        SupervisionSettings(**over)
    assert field in str(err.value)


def test_a_launch_file_names_the_supervision_field_at_fault(tmp_path):
    from services.config.launch import LaunchSettings
    from spopp.settings.base import SettingsError

    path = tmp_path / "launch.yaml"
    path.write_text("model: m\ntasks: t.jsonl\nsupervision: {max_restarts: many}\n")
    with pytest.raises(SettingsError, match=r"supervision\.max_restarts"):
        LaunchSettings.resolve(path, env={})
    path.write_text("model: m\ntasks: t.jsonl\nsupervision: {max_restarts: 2, window_seconds: 30}\n")
    s = LaunchSettings.resolve(path, env={}).supervision
    assert (s.enabled, s.max_restarts, s.window_seconds, s.backoff_seconds) == (True, 2, 30.0, 1.0)


def test_exits_are_described_by_signal_name_or_code():
    assert describe_exit(-9) == "SIGKILL"
    assert describe_exit(-15) == "SIGTERM"
    assert describe_exit(3) == "code 3"
    assert describe_exit(-200) == "signal 200"


def test_run_json_keeps_restarts_per_process_and_refuses_a_bad_count():
    record = RunRecord.model_validate({"arm": "spopp", "seed": 0, "restarts": {"tracker": 1}})
    assert record.restarts == {"tracker": 1}
    assert RunRecord.model_validate({"arm": "spopp", "seed": 0}).restarts == {}
    with pytest.raises(ValidationError):
        RunRecord.model_validate({"arm": "spopp", "seed": 0, "restarts": {"tracker": -1.5}})


@pytest.mark.parametrize(
    "text,slots,expect",
    [
        ("3\n", 0, 3),
        (" 1 ", 0, 1),
        ("0", 0, "replicas must be 1..256, got 0"),
        ("257", 0, "replicas must be 1..256, got 257"),
        ("-2", 0, "replicas must be 1..256, got -2"),
        ("2.5", 0, "expected a whole number of replicas, got '2.5'"),
        ("", 0, "expected a whole number of replicas, got ''"),
        ("3", 2, "gpus.rollout has devices for 2 replicas, not 3"),
        ("2", 2, 2),
    ],
)
def test_a_scale_file_holds_a_whole_count_within_bounds_and_the_gpus_given(text, slots, expect):
    from services.launch.run import parse_replicas

    if isinstance(expect, int):
        assert parse_replicas(text, slots) == expect
    else:
        with pytest.raises(ValueError) as err:
            parse_replicas(text, slots)
        assert str(err.value) == expect
