"""Floods of connections from one address: bounded per host before any cryptographic work
(``Limits.host_rate`` / ``host_burst``, :mod:`gossip.limits`), in virtual time."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from trio.testing import MockClock

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from gossip.address import parse_address
from gossip.config import Limits, NodeConfig
from gossip.endpoints import serve
from gossip.handshake import NoiseHandshake
from gossip.identity import Identity
from gossip.network import TcpNetwork
from gossip.roster import open_roster
from gossip.testing.simnet import SimHost, SimNetwork
from gossip.wire import encode_frame
from tests.unit.test_limits import closed_after, echo_server, echoes
from tests.util import SWARM


def message_1() -> bytes:
    """A fresh, valid handshake message 1, framed: what makes a responder do a signature and
    two Diffie-Hellman operations to answer it."""
    hs = NoiseHandshake(initiator=True, psk=SWARM.key, static=X25519PrivateKey.generate())
    return encode_frame(hs.write_message())


async def answered(host: SimHost, first: bytes) -> bool:
    """Whether the server answered ``first`` with a message 2 (it did the handshake's work)
    or closed the connection unanswered."""
    stream = await host.dial("s:7000")
    try:
        await stream.send_all(first)
        return bool(await stream.receive_some(65536))
    except trio.BrokenResourceError:  # closed at accept, before our bytes were sent
        return False
    finally:
        await stream.aclose()


async def test_one_address_gets_its_burst_then_its_rate_of_handshakes(
        autojump_clock: MockClock) -> None:
    net = SimNetwork(seed=11, latency=0.0)
    limits = Limits(max_handshakes_per_host=100, host_rate=2.0, host_burst=5)
    async with echo_server(net, limits=limits) as refused:
        x = net.host("x")
        # 50 fresh message 1s at once: the first 5 are answered, the rest closed unread.
        assert [await answered(x, message_1()) for _ in range(50)] == [True] * 5 + [False] * 45
        assert refused == ["host_rate"] * 45
        await trio.sleep(1.0)  # virtual: two tokens back
        assert [await answered(x, message_1()) for _ in range(5)] == [True] * 2 + [False] * 3
        # Another address has a bucket of its own, and an honest peer there gets through.
        assert await echoes(net.host("y"), Identity.generate())
        assert refused == ["host_rate"] * 48


async def test_a_throttled_connection_is_closed_before_a_byte_is_read(
        autojump_clock: MockClock) -> None:
    net = SimNetwork(seed=12, latency=0.0)
    async with echo_server(net, limits=Limits(host_rate=1.0, host_burst=1)) as refused:
        x = net.host("x")
        held = await x.dial("s:7000")  # takes the one token, sends nothing
        over = await x.dial("s:7000")
        assert await closed_after(over) == 0.0  # closed at accept, not at a deadline
        assert refused == ["host_rate"]
        await held.aclose()


async def test_an_honest_peer_completes_its_exchanges_during_a_flood(
        autojump_clock: MockClock) -> None:
    # x replays one captured message 1 some 300 times a second (virtual); an honest peer on
    # y keeps its pace, as it would without the flood, and x reaches the handshake's work at
    # most host_burst + host_rate x (seconds of flood) times.
    net = SimNetwork(seed=13, latency=0.001)
    limits = Limits(host_rate=5.0, host_burst=10)
    captured = message_1()
    honest = Identity.generate()
    async with echo_server(net, limits=limits) as refused:
        reached = 0
        floods = 0

        async def flood() -> None:
            nonlocal reached, floods
            x = net.host("x")
            while True:
                floods += 1
                stream = await x.dial("s:7000")
                try:
                    await stream.send_all(captured)
                except trio.BrokenResourceError:
                    pass  # closed at accept
                await stream.aclose()
                await trio.sleep(0.001)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(flood)
            start = trio.current_time()
            done = []
            for _ in range(20):
                done.append(await echoes(net.host("y"), honest))
                await trio.sleep(0.2)
            seconds = trio.current_time() - start
            nursery.cancel_scope.cancel()
        reached = floods - refused.count("host_rate")
        assert done == [True] * 20
        assert floods > 1000  # the flood did run, at some 300 connections a second
        assert reached <= limits.host_burst + limits.host_rate * seconds + 1


async def test_honest_nodes_behind_one_address_keep_their_pace_under_the_defaults(
        autojump_clock: MockClock) -> None:
    # Five nodes behind one NAT address, each opening channels at the fastest pace an honest
    # node does (0.9 x peer_rate a second, gossip.averaging.PACE), for ten seconds.
    net = SimNetwork(seed=14, latency=0.001)
    limits = Limits()
    nat = net.host("n")
    async with echo_server(net, limits=limits) as refused:
        results: list[bool] = []

        async def node(identity: Identity) -> None:
            for _ in range(90):
                results.append(await echoes(nat, identity))
                await trio.sleep(1 / (0.9 * limits.peer_rate))

        async with trio.open_nursery() as nursery:
            for _ in range(5):
                nursery.start_soon(node, Identity.generate())
        assert results == [True] * 450
        assert refused == []


async def test_the_roster_counts_throttled_connections(autojump_clock: MockClock) -> None:
    net = SimNetwork(seed=15, latency=0.0)
    limits = Limits(host_rate=1.0, host_burst=2, max_handshakes_per_host=10)
    async with open_roster(net.host("s"), Identity.generate(), SWARM,
                           NodeConfig(listen="s:7000", limits=limits)) as roster:
        streams = [await net.host("x").dial("s:7000") for _ in range(5)]
        await trio.testing.wait_all_tasks_blocked()
        stats = roster.statistics()
        assert (stats.connections_throttled, stats.connections_evicted,
                stats.connections_refused) == (3, 0, 0)
        for stream in streams:
            await stream.aclose()


async def test_a_tcp_connection_refused_at_accept_is_reset_not_closed() -> None:
    # A graceful close would leave the server's end in TIME_WAIT for a minute: a flood of
    # refusals would pile up that kernel state by the hundred thousand. A reset leaves none.
    refused: list[str] = []

    async def unreachable(channel) -> None:
        raise AssertionError("no channel gets this far")

    async with trio.open_nursery() as nursery:
        address = await nursery.start(lambda task_status: serve(
            TcpNetwork(), "127.0.0.1:0", unreachable, identity=Identity.generate(),
            swarm=SWARM, limits=Limits(host_rate=1.0, host_burst=1),
            on_refused=refused.append, task_status=task_status))
        host, port = parse_address(address)
        with trio.fail_after(30):
            held = await trio.open_tcp_stream(host, port)  # takes the one token
            over = await trio.open_tcp_stream(host, port)
            with pytest.raises(trio.BrokenResourceError):  # reset: not an end of stream
                await over.receive_some(1)
        assert refused == ["host_rate"]
        await held.aclose()
        await over.aclose()
        nursery.cancel_scope.cancel()
