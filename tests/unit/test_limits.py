"""Limits on inbound work: the per-peer token bucket, the admission of unproven connections,
and the server and roster enforcing ``max_connections``, ``max_handshakes_per_host`` (by
eviction), the first-message deadline and ``peer_rate``."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator

import pytest
import trio
import trio.testing
from trio.testing import MockClock

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from gossip.endpoints import FIRST_MESSAGE_TIMEOUT, connect, serve
from gossip.config import Limits, NodeConfig, Timeouts
from gossip.errors import GossipError
from gossip.handshake import NoiseHandshake
from gossip.identity import Identity
from gossip.limits import Admission, RateLimit
from gossip.messages import Close, StateRequest
from gossip.roster import open_roster
from gossip.testing.simnet import SimNetwork
from gossip.wire import encode_frame
from tests.util import SWARM


def test_a_bucket_allows_a_burst_then_the_rate() -> None:
    rate = RateLimit(rate=2.0, burst=3)
    assert [rate.allow("a", 0.0) for _ in range(4)] == [True, True, True, False]
    assert rate.allow("b", 0.0)  # buckets are per peer
    assert not rate.allow("a", 0.4)  # 0.8 of a token back: not yet
    assert rate.allow("a", 0.5)  # one whole token after 1/rate seconds
    assert not rate.allow("a", 0.5)
    assert [rate.allow("a", 100.0) for _ in range(4)] == [True, True, True, False]  # capped


def test_a_bucket_says_how_long_until_its_next_token_without_spending() -> None:
    rate = RateLimit(rate=2.0, burst=1)
    assert rate.wait("a", 0.0) == 0.0 and rate.wait("a", 0.0) == 0.0  # asking spends nothing
    assert rate.allow("a", 0.0)
    assert rate.wait("a", 0.0) == pytest.approx(0.5)
    assert rate.wait("a", 0.4) == pytest.approx(0.1)
    assert rate.wait("a", 0.5) == 0.0 and rate.allow("a", 0.5)


def test_the_bucket_table_is_bounded_and_forgets_the_oldest_peer() -> None:
    rate = RateLimit(rate=1.0, burst=1, max_keys=2)
    assert rate.allow("a", 0.0) and rate.allow("b", 0.0)
    assert not rate.allow("a", 0.0)  # a is now the newest, b the oldest
    assert rate.allow("c", 0.0)  # b forgotten
    assert len(rate._buckets) == 2
    assert rate.allow("b", 0.0)  # starts again with a full bucket
    assert not rate.allow("c", 0.0)


def test_admission_evicts_the_oldest_unproven_connection_of_the_same_host() -> None:
    admission: Admission[str] = Admission(max_connections=10, max_unproven_per_host=2)
    assert admission.admit("x", "x1") is None and admission.admit("x", "x2") is None
    assert admission.admit("y", "y1") is None  # another host has places of its own
    assert admission.admit("x", "x3") == "x1"
    admission.proved("x", "x2")  # x2 proved the key: it frees its place, and is never evicted
    assert admission.admit("x", "x4") is None
    assert [admission.admit("x", k) for k in ("x5", "x6")] == ["x3", "x4"]
    assert admission.unproven("x") == 2 and admission.unproven("y") == 1
    assert admission.open == 7  # evicted ones stay open until their task releases them


def test_admission_counts_an_evicted_connection_until_it_is_released() -> None:
    admission: Admission[int] = Admission(max_connections=2, max_unproven_per_host=1)
    assert admission.admit("x", 1) is None
    assert admission.admit("x", 2) == 1
    assert admission.full  # 1 still holds its buffers: max_connections is never exceeded
    admission.release("x", 1)
    assert not admission.full
    admission.release("x", 2)
    assert admission.open == 0
    assert admission._unproven == {}  # nothing is kept for hosts with nothing open


@pytest.mark.parametrize("bad", [{"max_connections": 0}, {"max_handshakes_per_host": 0},
                                 {"peer_rate": 0.0},
                                 {"peer_rate": float("inf")}, {"peer_burst": 0}])
def test_limits_refuse_nonsense(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        Limits(**bad)


REQUEST = StateRequest(bytes(16), "fp32")


@asynccontextmanager
async def echo_server(net: SimNetwork, **options: object) -> AsyncIterator[list[str]]:
    """An echo server on host s with ``options`` for ``serve`` (limits, timeouts); yields the
    list of limits it closed connections for, one entry per connection."""
    refused: list[str] = []

    async def echo(channel) -> None:
        await channel.send_message(await channel.receive_message())

    async with trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: serve(
            net.host("s"), "s:7000", echo, identity=Identity.generate(), swarm=SWARM,
            on_refused=refused.append, task_status=task_status, **options))
        yield refused
        nursery.cancel_scope.cancel()


async def echoes(client, identity: Identity) -> bool:
    async with await connect(client, "s:7000", identity=identity, swarm=SWARM) as channel:
        await channel.send_message(REQUEST)
        return await channel.receive_message() == REQUEST


async def test_connections_over_the_limit_are_closed_unread(autojump_clock: MockClock) -> None:
    net = SimNetwork(seed=1, latency=0.0)  # a close reaches the server before anything else runs
    client, client_id = net.host("c"), Identity.generate()
    async with echo_server(net, limits=Limits(max_connections=2)) as refused:
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


async def closed_after(stream: trio.abc.Stream) -> float:
    """Virtual seconds until the server closes ``stream`` (reading and dropping its bytes)."""
    start = trio.current_time()
    while await stream.receive_some(65536):
        pass
    return trio.current_time() - start


async def test_a_new_connection_evicts_the_oldest_unproven_one_of_its_host(
        autojump_clock: MockClock) -> None:
    net = SimNetwork(seed=3, latency=0.0)
    async with echo_server(net, limits=Limits(max_connections=100,
                                              max_handshakes_per_host=2)) as refused:
        flooder = net.host("x")
        held = [await flooder.dial("s:7000") for _ in range(2)]
        extra = await flooder.dial("s:7000")
        assert await closed_after(held[0]) == 0.0  # the oldest, closed at once, unread
        assert refused == ["max_handshakes_per_host"]
        # An honest peer on x's own address gets in (it evicts held[1]), and one elsewhere
        # is not held back by x's stalled handshakes.
        assert await echoes(flooder, Identity.generate())
        assert await echoes(net.host("c"), Identity.generate())
        assert await closed_after(held[1]) == 0.0
        assert refused == ["max_handshakes_per_host"] * 2
        # The newest silent one is closed by the first-message deadline, counted nowhere.
        assert await closed_after(extra) == pytest.approx(FIRST_MESSAGE_TIMEOUT)
        assert len(refused) == 2


@pytest.mark.parametrize("handshake", [5.0, 1.0])
async def test_a_silent_connection_is_closed_at_the_first_message_deadline(
        autojump_clock: MockClock, handshake: float) -> None:
    net = SimNetwork(seed=4, latency=0.0)
    async with echo_server(net, timeouts=Timeouts(handshake=handshake)) as refused:
        silent = await net.host("x").dial("s:7000")
        # The handshake deadline caps it: a shorter one is not lengthened.
        assert await closed_after(silent) == pytest.approx(min(FIRST_MESSAGE_TIMEOUT, handshake))
        assert refused == []


async def test_only_a_completed_handshake_is_safe_from_eviction(autojump_clock: MockClock) -> None:
    # A valid message 1 and no more proves nothing: anyone who watched a connection can
    # replay one. Such a connection stays evictable by its host's newer ones; a connection
    # whose handshake completed never is.
    net = SimNetwork(seed=5, latency=0.0)
    timeouts = Timeouts(handshake=5.0)
    async with echo_server(net, limits=Limits(max_handshakes_per_host=1),
                           timeouts=timeouts) as refused:
        x = net.host("x")
        done = await connect(x, "s:7000", identity=Identity.generate(), swarm=SWARM)
        halfway = await x.dial("s:7000")
        hs = NoiseHandshake(initiator=True, psk=SWARM.key, static=X25519PrivateKey.generate())
        await halfway.send_all(encode_frame(hs.write_message()))
        assert await halfway.receive_some(65536)  # message 2: the responder took message 1
        silent = await x.dial("s:7000")
        assert await closed_after(halfway) == 0.0  # evicted by the next one from its host
        assert refused == ["max_handshakes_per_host"]
        await done.send_message(REQUEST)  # the completed one is still served
        assert isinstance(await done.receive_message(), StateRequest)
        await done.aclose()
        await silent.aclose()


async def test_a_replayed_message_1_is_closed_at_once_without_an_answer(
        autojump_clock: MockClock) -> None:
    # A passive observer captured an honest dialer's message 1 and replays it: it
    # authenticates under the swarm key, but its ephemeral key was seen before.
    net = SimNetwork(seed=6, latency=0.0)
    async with echo_server(net, limits=Limits(max_handshakes_per_host=8)) as refused:
        x = net.host("x")
        hs = NoiseHandshake(initiator=True, psk=SWARM.key, static=X25519PrivateKey.generate())
        first = encode_frame(hs.write_message())
        original = await x.dial("s:7000")
        await original.send_all(first)
        assert await original.receive_some(65536)  # the first time it is answered
        for _ in range(20):
            replay = await x.dial("s:7000")
            await replay.send_all(first)
            assert await replay.receive_some(65536) == b""  # closed, no message 2
        assert refused == []  # nothing was evicted to make room for them
        await original.aclose()


async def test_a_peer_over_its_rate_gets_its_channels_closed(autojump_clock: MockClock) -> None:
    net = SimNetwork(seed=2)
    limits = Limits(peer_rate=1.0, peer_burst=2)
    client_id, other_id = Identity.generate(), Identity.generate()
    async with open_roster(net.host("s"), Identity.generate(), SWARM,
                           NodeConfig(listen="s:7000", limits=limits)) as roster:

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
        assert roster.statistics().connections_evicted == 0


async def test_the_roster_counts_refusals_and_evictions_by_limit(autojump_clock: MockClock) -> None:
    net = SimNetwork(seed=6, latency=0.0)
    limits = Limits(max_connections=2, max_handshakes_per_host=1)
    async with open_roster(net.host("s"), Identity.generate(), SWARM,
                           NodeConfig(listen="s:7000", limits=limits)) as roster:
        first = await net.host("x").dial("s:7000")
        await net.host("x").dial("s:7000")  # evicts first
        assert await closed_after(first) == 0.0
        await trio.testing.wait_all_tasks_blocked()  # first's task has released its place
        await net.host("y").dial("s:7000")  # the second place
        over = await net.host("z").dial("s:7000")  # refused at accept
        assert await closed_after(over) == 0.0
        stats = roster.statistics()
        assert (stats.connections_refused, stats.connections_evicted) == (1, 1)
