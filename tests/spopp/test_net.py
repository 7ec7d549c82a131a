"""The one port picker: draws below the ephemeral range, within SPOPP_PORT_RANGE when set, never a
port it was told is taken, never one a listener holds; a malformed range is refused by name."""

from __future__ import annotations

import socket

import pytest

from spopp.machine.net import PORT_RANGE_ENV, ephemeral_range, free_port, port_free, port_range


def test_draws_stay_in_the_given_range_and_skip_taken_and_held_ports(monkeypatch):
    monkeypatch.setenv(PORT_RANGE_ENV, "20000-20199")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 20000))
        held.listen()
        assert not port_free(20000)
        taken = set(range(20001, 20100))
        got = {free_port(taken=taken) for _ in range(60)}
    assert all(20100 <= p <= 20199 for p in got), sorted(got)
    assert len(got) > 1  # drawn, not a fixed answer


def test_without_a_range_ports_lie_below_the_ephemeral_range(monkeypatch):
    monkeypatch.delenv(PORT_RANGE_ENV, raising=False)
    lo, hi = port_range()
    assert hi == ephemeral_range()[0] - 1 and lo == 10_000
    assert all(lo <= free_port() <= hi for _ in range(20))


@pytest.mark.parametrize("spec", ["20000", "a-b", "30000-20000", "80-90", "60000-70000"])
def test_a_malformed_range_is_refused_by_name(monkeypatch, spec):
    monkeypatch.setenv(PORT_RANGE_ENV, spec)
    with pytest.raises(ValueError, match=PORT_RANGE_ENV):
        free_port()
