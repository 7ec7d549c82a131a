"""The one restart budget (spopp/machine/restarts.py) that the launcher's supervision and the tracker's
embedded Redis both keep."""

import pytest

from spopp.machine.restarts import RestartWindow


def test_at_most_max_restarts_within_the_window_and_old_ones_are_forgotten():
    w = RestartWindow(max_restarts=2, window_seconds=10.0)
    assert w.spend(0.0) and w.spend(4.0)
    assert not w.spend(9.0)  # a third within 10 s: refused, and not counted
    assert (w.count, w.since_oldest(9.0)) == (2, 9.0)
    assert w.spend(10.5)  # the restart at 0 is 10.5 s old: out of the window
    assert w.count == 2 and w.since_oldest(10.5) == 6.5
    assert not w.spend(14.0)
    assert w.spend(25.0) and w.count == 1  # after a quiet window, a fresh budget


def test_a_zero_budget_refuses_the_first_restart_and_bad_settings_are_refused():
    assert not RestartWindow(0, 1.0).spend(0.0)
    for bad in [(-1, 1.0), (1, 0.0)]:
        with pytest.raises(ValueError, match="need max_restarts >= 0 and window_seconds > 0"):
            RestartWindow(*bad)
