"""Checks every :class:`gossip.network.Network` must pass, in the spirit of trio's
``check_two_way_stream``.

A test module describes its network with a :class:`NetworkUnderTest` and runs each check in
:data:`CHECKS` (one pytest case per check reads better when one fails), or all of them with
:func:`check_network`. The checks use no clock of their own: they work on the real clock
(TcpNetwork) and under ``MockClock(autojump_threshold=0)`` (SimNetwork) alike, and they wait
on events, never on sleeps.
"""

from __future__ import annotations

import hashlib
import random
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

import trio
import trio.testing

from gossip.errors import PeerGone, RemoteProtocolError
from gossip.network import MAX_DATAGRAM, Handler, Network, parse_address

# Generous: on the real clock these bound a hang, not a speed; under autojump they cost nothing.
DEADLINE = 30.0

StreamPair = tuple[trio.abc.HalfCloseableStream, trio.abc.HalfCloseableStream]


async def fill_stream(stream: trio.abc.Stream) -> None:
    """Send until ``send_all`` blocks, then stop (trio's own clogging helper): afterwards
    sending blocks until the peer reads."""

    async def sender() -> None:
        while True:
            await stream.send_all(b"x" * 10000)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()


@dataclass(frozen=True)
class NetworkUnderTest:
    """Two hosts of one network, and how to reach them.

    Attributes:
        server: the network as the serving host sees it.
        client: the network as the dialing host sees it (may be the same object).
        server_bind: where the server serves or binds, with port 0 (``"127.0.0.1:0"``).
        client_bind: where the client binds datagram endpoints, with port 0.
        clog: fills a stream's send direction so that ``send_all`` and
            ``wait_send_all_might_not_block`` block until the peer reads (see
            ``trio.testing.check_one_way_stream``); None skips those checks. The default
            works for a network whose only blocked tasks, while a sender is not clogged yet,
            are the ones waiting on it.
    """

    server: Network
    client: Network
    server_bind: str
    client_bind: str
    clog: Callable[[trio.abc.Stream], Awaitable[None]] | None = fill_stream


async def receive_exactly(stream: trio.abc.Stream, n: int) -> bytes:
    """Read exactly ``n`` bytes; fails the test on an early end of stream."""
    buf = bytearray()
    while len(buf) < n:
        chunk = await stream.receive_some(n - len(buf))
        assert chunk, f"end of stream after {len(buf)} of {n} bytes"
        buf += chunk
    return bytes(buf)


async def receive_all(stream: trio.abc.Stream) -> bytes:
    """Read until a clean end of stream."""
    buf = bytearray()
    while chunk := await stream.receive_some():
        buf += chunk
    return bytes(buf)


async def echo(stream: trio.abc.Stream) -> None:
    while data := await stream.receive_some():
        await stream.send_all(data)


@asynccontextmanager
async def serving(nut: NetworkUnderTest, handler: Handler) -> AsyncIterator[str]:
    """Serve ``handler`` on the server host for the duration of the block; yields the
    bound address."""
    async with trio.open_nursery() as nursery:
        address = await nursery.start(nut.server.serve, nut.server_bind, handler)
        yield address
        nursery.cancel_scope.cancel()


# ---- the checks --------------------------------------------------------------------------


async def check_serve_reports_bound_address(nut: NetworkUnderTest) -> None:
    async with serving(nut, echo) as address:
        host, port = parse_address(address)
        assert host == parse_address(nut.server_bind)[0]
        assert port != 0
        # a second server cannot take the same address
        with trio.fail_after(DEADLINE):
            try:
                await nut.server.serve(address, echo)
            except OSError:
                pass
            else:  # pragma: no cover
                raise AssertionError("serving an address in use did not raise OSError")


async def check_echo_round_trip(nut: NetworkUnderTest) -> None:
    async with serving(nut, echo) as address:
        with trio.fail_after(DEADLINE):
            stream = await nut.client.dial(address)
            await stream.send_all(b"hello")
            assert await receive_exactly(stream, 5) == b"hello"
            await stream.aclose()


async def check_large_transfer(nut: NetworkUnderTest, size: int = 4 * 1024 * 1024) -> None:
    """Several MB through an echo server, sent and received at the same time, arrive intact
    and in order."""
    payload = random.Random(size).randbytes(size)
    async with serving(nut, echo) as address:
        with trio.fail_after(DEADLINE):
            stream = await nut.client.dial(address)
            received: list[bytes] = []

            async def sender() -> None:
                rng = random.Random(1)
                view = memoryview(payload)
                while view:
                    n = rng.randint(1, 200_000)
                    await stream.send_all(view[:n])
                    view = view[n:]

            async def receiver() -> None:
                received.append(await receive_exactly(stream, size))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(sender)
                nursery.start_soon(receiver)
            await stream.aclose()
    assert hashlib.sha256(received[0]).digest() == hashlib.sha256(payload).digest()


async def check_clean_eof(nut: NetworkUnderTest) -> None:
    """The handler's return closes the stream: the client reads everything, then b"".
    A half-close (send_eof) reaches the server as b"" while it can still answer."""

    async def reply_then_return(stream: trio.abc.Stream) -> None:
        await stream.send_all(b"bye" * 1000)

    async def count_until_eof(stream: trio.abc.Stream) -> None:
        total = len(await receive_all(stream))
        await stream.send_all(str(total).encode())

    with trio.fail_after(DEADLINE):
        async with serving(nut, reply_then_return) as address:
            stream = await nut.client.dial(address)
            assert await receive_all(stream) == b"bye" * 1000
            assert await stream.receive_some() == b""  # and it stays at end of stream
            await stream.aclose()
        async with serving(nut, count_until_eof) as address:
            stream = await nut.client.dial(address)
            assert isinstance(stream, trio.abc.HalfCloseableStream)
            await stream.send_all(b"x" * 12345)
            await stream.send_eof()
            assert await receive_all(stream) == b"12345"
            await stream.aclose()


async def check_many_concurrent_connections(nut: NetworkUnderTest, n: int = 50) -> None:
    results: dict[int, bytes] = {}
    async with serving(nut, echo) as address:
        with trio.fail_after(DEADLINE):

            async def client(i: int) -> None:
                stream = await nut.client.dial(address)
                message = f"client {i} ".encode() * (i + 1)
                await stream.send_all(message)
                results[i] = await receive_exactly(stream, len(message))
                await stream.aclose()

            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(client, i)
    assert results == {i: f"client {i} ".encode() * (i + 1) for i in range(n)}


async def check_dial_nobody_listening(nut: NetworkUnderTest) -> None:
    async with serving(nut, echo) as address:
        pass  # serve, then stop: the port is now free on a host that exists
    with trio.fail_after(DEADLINE):
        try:
            await nut.client.dial(address)
        except PeerGone:
            pass
        else:  # pragma: no cover
            raise AssertionError(f"dial to {address} with nobody listening did not fail")


async def check_handler_error_closes_only_its_connection(nut: NetworkUnderTest) -> None:
    """A handler raising a GossipError closes its own connection; the server, and the other
    connections it is serving, go on."""

    async def picky(stream: trio.abc.Stream) -> None:
        while data := await stream.receive_some():
            if b"!" in data:
                raise RemoteProtocolError("the client shouted")
            await stream.send_all(data)

    async with serving(nut, picky) as address:
        with trio.fail_after(DEADLINE):
            bystander = await nut.client.dial(address)
            await bystander.send_all(b"a")
            assert await receive_exactly(bystander, 1) == b"a"
            rude = await nut.client.dial(address)
            await rude.send_all(b"!")
            try:
                assert await receive_all(rude) == b""
            except trio.BrokenResourceError:
                pass  # a reset is an acceptable way to close it too
            await rude.aclose()
            await bystander.send_all(b"b")
            assert await receive_exactly(bystander, 1) == b"b"
            newcomer = await nut.client.dial(address)
            await newcomer.send_all(b"c")
            assert await receive_exactly(newcomer, 1) == b"c"
            await bystander.aclose()
            await newcomer.aclose()


async def check_datagram_round_trip(nut: NetworkUnderTest) -> None:
    with trio.fail_after(DEADLINE):
        server = await nut.server.open_datagram(nut.server_bind)
        client = await nut.client.open_datagram(nut.client_bind)
        assert parse_address(server.local_address)[1] != 0
        await client.send(b"ping", server.local_address)
        data, sender = await server.receive()
        assert (data, sender) == (b"ping", client.local_address)
        biggest = bytes(range(256)) * (MAX_DATAGRAM // 256) + b"z" * (MAX_DATAGRAM % 256)
        await server.send(biggest, sender)
        assert await client.receive() == (biggest, server.local_address)
        try:
            await client.send(biggest + b"!", server.local_address)
        except ValueError:
            pass
        else:  # pragma: no cover
            raise AssertionError("an oversized datagram was accepted")
        await client.aclose()
        try:
            await client.send(b"late", server.local_address)
        except trio.ClosedResourceError:
            pass
        else:  # pragma: no cover
            raise AssertionError("send on a closed endpoint did not raise ClosedResourceError")
        await server.aclose()


async def check_trio_stream_conformance(nut: NetworkUnderTest) -> None:
    """trio's own generic stream checks on streams obtained through the network."""
    async with trio.open_nursery() as nursery:
        accepted_send, accepted = trio.open_memory_channel[trio.abc.Stream](0)

        async def hand_over(stream: trio.abc.Stream) -> None:
            await accepted_send.send(stream)
            await trio.sleep_forever()  # keep it open: the checks close it themselves

        address = await nursery.start(nut.server.serve, nut.server_bind, hand_over)

        async def make_pair() -> StreamPair:
            client = await nut.client.dial(address)
            server = await accepted.receive()
            # Both networks give half-closeable streams (TCP's FIN, the sim's EOF marker).
            assert isinstance(client, trio.abc.HalfCloseableStream)
            assert isinstance(server, trio.abc.HalfCloseableStream)
            return client, server

        async def make_clogged_pair() -> StreamPair:
            assert nut.clog is not None
            client, server = await make_pair()
            await nut.clog(client)
            await nut.clog(server)
            return client, server

        with trio.fail_after(DEADLINE):
            await trio.testing.check_half_closeable_stream(
                make_pair, make_clogged_pair if nut.clog is not None else None
            )
        nursery.cancel_scope.cancel()


Check = Callable[[NetworkUnderTest], Awaitable[None]]

CHECKS: list[Check] = [
    check_serve_reports_bound_address,
    check_echo_round_trip,
    check_large_transfer,
    check_clean_eof,
    check_many_concurrent_connections,
    check_dial_nobody_listening,
    check_handler_error_closes_only_its_connection,
    check_datagram_round_trip,
    check_trio_stream_conformance,
]


async def check_network(make: Callable[[], NetworkUnderTest]) -> None:
    """Run every check, each on a fresh network from ``make()``."""
    for check in CHECKS:
        await check(make())
