"""End to end: two real daemons rotate their swarm key one at a time, with
``gossipd rotate-key`` and ``gossipd retire-key``, and keep averaging throughout.

What the simulated swarm (tests/sim/test_rotation.py) cannot show: the config and key files
as the commands leave them, the daemon reading them at start-up, real TCP and UDP (the
address a datagram comes from is the one its sender advertises), and ``gossipd status``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.cli import main
from daemon.testing import START, Daemon, DaemonSwarm, free_port, wait_for

pytestmark = pytest.mark.slow


def restart(d: Daemon, others: list[Daemon]) -> None:
    """Stop ``d`` gracefully, start it again, and wait until it has averaged again."""
    assert d.stop() == 0
    d.poll()  # every event of the old process read: what follows is the new one's
    since = len(d.events)
    d.restart()
    wait_for(lambda: d.of("start", since), START, [d, *others], f"{d.name} to start again")
    wait_for(lambda: d.committed(since) >= 1, START, [d, *others], f"{d.name} to average again")


def test_two_daemons_rotate_the_swarm_key_and_keep_averaging(tmp_path: Path) -> None:
    with DaemonSwarm(tmp_path) as swarm:
        # Fixed ports: a restarted daemon keeps its address, as a real one does.
        a = swarm.add("a", listen=f"127.0.0.1:{free_port()}").start()
        wait_for(lambda: a.last("start"), START, [a], "a to start")
        b = swarm.add("b", bootstrap=[a], listen=f"127.0.0.1:{free_port()}").start()
        wait_for(lambda: a.committed() >= 2 and b.committed() >= 2, START, [a, b],
                 "both to average")
        old = (a.directory / "swarm.key").read_bytes()

        # Start: a first. It reaches b, which holds the old key only, by falling back.
        assert main(["rotate-key", "-c", str(a.config_path)]) == 0
        restart(a, [b])
        rotation = a.status()["rotation"]
        assert rotation["old_key"] == [b.address] and rotation["fallbacks"] + rotation[
            "handshakes_previous"] > 0
        # Then b, to the same key.
        assert main(["rotate-key", "-c", str(b.config_path), "--key-file",
                     str(a.directory / "swarm.key")]) == 0
        restart(b, [a])
        wait_for(lambda: a.status()["rotation"]["new_key"] == [b.address], 30, [a, b],
                 "a to hear b on the new key")

        # Finish: a's daemon has heard b on the new key, so retire-key goes ahead. On the
        # new key alone, a still averages with b, which holds both. (b's own restart on the
        # new key alone would be a's again.)
        assert main(["retire-key", "-c", str(a.config_path)]) == 0
        restart(a, [b])
        assert a.status()["rotation"] is None
        assert (a.directory / "swarm.key").read_bytes() != old
        assert not (a.directory / "swarm.previous.key").exists()
        assert [m["state"] for m in a.status()["members"]] == ["alive"]
