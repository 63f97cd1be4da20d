"""Limits on inbound work: the per-peer token bucket, and the server and roster enforcing
``max_connections`` and ``peer_rate``."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator

import pytest
import trio
import trio.testing
from trio.testing import MockClock

from gossip.channel import connect, serve
from gossip.errors import GossipError
from gossip.identity import Identity
from gossip.limits import Limits, RateLimit
from gossip.messages import Close, StateRequest
from gossip.roster import open_roster
from gossip.simnet import SimNetwork
from tests.util import SWARM


def test_a_bucket_allows_a_burst_then_the_rate() -> None:
    rate = RateLimit(rate=2.0, burst=3)
    assert [rate.allow("a", 0.0) for _ in range(4)] == [True, True, True, False]
    assert rate.allow("b", 0.0)  # buckets are per peer
    assert not rate.allow("a", 0.4)  # 0.8 of a token back: not yet
    assert rate.allow("a", 0.5)  # one whole token after 1/rate seconds
    assert not rate.allow("a", 0.5)
    assert [rate.allow("a", 100.0) for _ in range(4)] == [True, True, True, False]  # capped


def test_the_bucket_table_is_bounded_and_forgets_the_oldest_peer() -> None:
    rate = RateLimit(rate=1.0, burst=1, max_keys=2)
    assert rate.allow("a", 0.0) and rate.allow("b", 0.0)
    assert not rate.allow("a", 0.0)  # a is now the newest, b the oldest
    assert rate.allow("c", 0.0)  # b forgotten
    assert len(rate._buckets) == 2
    assert rate.allow("b", 0.0)  # starts again with a full bucket
    assert not rate.allow("c", 0.0)


@pytest.mark.parametrize("bad", [{"max_connections": 0}, {"max_handshakes_per_host": 0},
                                 {"peer_rate": 0.0},
                                 {"peer_rate": float("inf")}, {"peer_burst": 0}])
def test_limits_refuse_nonsense(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        Limits(**bad)


REQUEST = StateRequest(bytes(16), "fp32")


@asynccontextmanager
async def echo_server(net: SimNetwork, **limits: int) -> AsyncIterator[list[int]]:
    """An echo server on host s with ``limits``; yields a list whose length counts the
    connections it refused."""
    refused: list[int] = []

    async def echo(channel) -> None:
        await channel.send_message(await channel.receive_message())

    async with trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: serve(
            net.host("s"), "s:7000", echo, identity=Identity.generate(), swarm=SWARM,
            on_refused=lambda: refused.append(1), task_status=task_status, **limits))
        yield refused
        nursery.cancel_scope.cancel()


async def echoes(client, identity: Identity) -> bool:
    async with await connect(client, "s:7000", identity=identity, swarm=SWARM) as channel:
        await channel.send_message(REQUEST)
        return await channel.receive_message() == REQUEST


async def test_connections_over_the_limit_are_closed_unread(autojump_clock: MockClock) -> None:
    net = SimNetwork(seed=1, latency=0.0)  # a close reaches the server before anything else runs
    client, client_id = net.host("c"), Identity.generate()
    async with echo_server(net, max_connections=2) as refused:
        # Two half-open connections take both places: they never send a handshake byte.
        held = [await client.dial("s:7000") for _ in range(2)]
        extra = await client.dial("s:7000")
        with trio.fail_after(1):
            assert await extra.receive_some(1024) == b""  # closed at once, nothing read
        assert len(refused) == 1
        with pytest.raises(GossipError):
            await connect(client, "s:7000", identity=client_id, swarm=SWARM)
        assert len(refused) == 2
        # One place frees up when a half-open connection goes away: an honest peer gets in.
        await held[0].aclose()
        await trio.testing.wait_all_tasks_blocked()
        assert await echoes(client, client_id)
        assert len(refused) == 2


async def test_one_host_cannot_hold_more_than_its_share_of_handshakes(
        autojump_clock: MockClock) -> None:
    net = SimNetwork(seed=3, latency=0.0)
    async with echo_server(net, max_connections=100, max_handshakes_per_host=2) as refused:
        flooder = net.host("x")
        held = [await flooder.dial("s:7000") for _ in range(2)]
        extra = await flooder.dial("s:7000")
        with trio.fail_after(1):
            assert await extra.receive_some(1024) == b""
        assert len(refused) == 1
        # Another host is not held back by x's stalled handshakes.
        assert await echoes(net.host("c"), Identity.generate())
        assert len(refused) == 1 and len(held) == 2


async def test_a_peer_over_its_rate_gets_its_channels_closed(autojump_clock: MockClock) -> None:
    net = SimNetwork(seed=2)
    limits = Limits(peer_rate=1.0, peer_burst=2)
    client_id, other_id = Identity.generate(), Identity.generate()
    async with open_roster(net.host("s"), Identity.generate(), SWARM, "s:7000",
                           limits=limits) as roster:

        async def ask(identity: Identity) -> bool:
            """Whether the roster answered (it refuses averaging: it has no handler)."""
            async with await connect(net.host("c"), "s:7000", identity=identity,
                                     swarm=SWARM) as channel:
                await channel.send_message(REQUEST)
                try:
                    reply = await channel.receive_message()
                except GossipError:
                    return False
                assert isinstance(reply, Close) and reply.code == Close.REJECTED
                return True

        assert [await ask(client_id) for _ in range(3)] == [True, True, False]
        assert await ask(other_id)  # another peer has its own budget
        assert roster.statistics().channels_limited == 1
        await trio.sleep(1.0)  # virtual: one token back
        assert [await ask(client_id) for _ in range(2)] == [True, False]
        assert roster.statistics().channels_limited == 2
        assert roster.statistics().connections_refused == 0
