"""free_port: launchers and tests get ports the kernel never hands out on its own (a port picked with bind(0) and
released could be taken by another run's gloo connection before the launcher binds it: CI failure of stop 39)."""
from __future__ import annotations

import socket

from trainer.parallel import dims


def test_ports_lie_below_the_ephemeral_range_and_are_free():
    low, _ = dims.ephemeral_port_range()
    for _ in range(20):
        port = dims.free_port()
        assert dims.PORT_FLOOR <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free when handed out


def test_a_port_someone_listens_on_is_skipped(monkeypatch):
    with socket.socket() as held, socket.socket() as probe:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        probe.bind(("127.0.0.1", 0))
        spare = probe.getsockname()[1]
        probe.close()
        picks = iter([taken, taken, spare])

        class Scripted:
            def randrange(self, a, b):
                return next(picks)

        monkeypatch.setattr(dims.random, "SystemRandom", Scripted)
        assert not dims.port_is_free(taken)
        assert dims.free_port() == spare


def test_a_narrow_range_falls_back_to_the_kernels_pick(monkeypatch):
    monkeypatch.setattr(dims, "ephemeral_port_range", lambda: (dims.PORT_FLOOR + 10, 60999))
    port = dims.free_port()
    assert port > 0 and dims.port_is_free(port)
