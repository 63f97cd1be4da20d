"""Real sockets: silent connections from one address do not lock out a key holder dialing from
the same address. The minute-long version, with exchange rates, runs on virtual time in
``tests/sim/test_lockout.py``; this one checks, in about a second, that the same holds over
TCP, where the source address comes from the socket and a closed connection is a FIN.
"""

from __future__ import annotations

import functools

import pytest
import trio

from gossip.endpoints import FIRST_MESSAGE_TIMEOUT, connect, serve
from gossip.config import Limits
from gossip.identity import Identity
from gossip.network import TcpNetwork
from gossip.testing.hostile import Outsider
from tests.util import SWARM

pytestmark = pytest.mark.slow

LIMIT = 4  # max_handshakes_per_host
SILENT = 40  # silent connections from 127.0.0.1, all held at once


async def test_silent_connections_over_tcp_do_not_lock_out_a_key_holder_on_their_address() -> None:
    refused: list[str] = []

    async def echo(channel) -> None:
        await channel.send(await channel.receive())

    async with trio.open_nursery() as nursery:
        address = await nursery.start(functools.partial(
            serve, TcpNetwork(), "127.0.0.1:0", echo, identity=Identity.generate(),
            swarm=SWARM, limits=Limits(max_handshakes_per_host=LIMIT),
            on_refused=refused.append))
        async with Outsider(network=TcpNetwork("127.0.0.1")).open_flood(
                address, SILENT, first_bytes=b"") as flood:
            with trio.fail_after(10):
                await flood.all_opened.wait()
            # The server accepts in order: by the time it has handled the first key holder,
            # every silent connection was admitted, each evicting the oldest before it.
            for _ in range(3):  # a key holder on the same address gets through every time
                with trio.fail_after(5):
                    async with await connect(TcpNetwork("127.0.0.1"), address,
                                             identity=Identity.generate(),
                                             swarm=SWARM) as channel:
                        await channel.send(b"hello")
                        assert await channel.receive() == b"hello"
            # The flood's evictions, and one by the first key holder; the next two found a
            # place free (the first, once it had proved the key, no longer took one).
            evicted = SILENT - LIMIT + 1
            assert refused == ["max_handshakes_per_host"] * evicted
            with trio.fail_after(FIRST_MESSAGE_TIMEOUT + 3):
                await flood.all_closed.wait()  # the rest: at the first-message deadline
        nursery.cancel_scope.cancel()
    held = sorted(flood.held_seconds)
    assert held[evicted - 1] < 1.0 and held[-1] < FIRST_MESSAGE_TIMEOUT + 1.0, held
    assert held[evicted] > FIRST_MESSAGE_TIMEOUT - 0.5, held
