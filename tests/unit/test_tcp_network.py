"""TcpNetwork on 127.0.0.1 against the shared network conformance suite (real clock)."""

from __future__ import annotations

import errno
import socket
import struct

import pytest
import trio

from gossip.errors import PeerGone
from gossip.network import TcpNetwork
from tests.conformance import CHECKS, Check, NetworkUnderTest, echo, receive_exactly, serving


def loopback() -> NetworkUnderTest:
    net = TcpNetwork()
    return NetworkUnderTest(
        server=net, client=net, server_bind="127.0.0.1:0", client_bind="127.0.0.1:0"
    )


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__)
async def test_conformance(check: Check) -> None:
    await check(loopback())


async def test_connection_reset_before_accept_does_not_stop_the_server() -> None:
    # A client that connects and resets at once (a port scanner, a crash) must cost the
    # server that connection only.
    nut = loopback()
    async with serving(nut, echo) as address:
        host, port = address.rsplit(":", 1)
        with socket.socket() as rude:
            rude.connect((host, int(port)))  # blocking, so trio cannot accept before the reset
            rude.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        with trio.fail_after(10):
            stream = await nut.client.dial(address)
            await stream.send_all(b"still here")
            assert await receive_exactly(stream, 10) == b"still here"
            await stream.aclose()


async def test_a_host_name_no_resolver_accepts_is_an_unreachable_peer() -> None:
    # A 64-character label cannot be encoded for DNS; announced by a member, it must make
    # that member unreachable, not crash the dialer.
    with pytest.raises(PeerGone):
        await TcpNetwork().dial("a" * 64 + ".example:7070")


async def test_dials_come_from_the_source_address() -> None:
    # Nodes that share a machine, each on its own loopback address, tell each other apart
    # by source address (what the fault proxy's per-source rules rely on).
    seen: list[str] = []

    async def record(stream: trio.abc.Stream) -> None:
        seen.append(stream.socket.getpeername()[0])
        await stream.send_all(b"ok")

    async with trio.open_nursery() as nursery:
        address = await nursery.start(TcpNetwork().serve, "127.0.0.1:0", record)
        with trio.fail_after(10):
            for source in ("127.0.0.2", None):
                stream = await TcpNetwork(source).dial(address)
                assert await receive_exactly(stream, 2) == b"ok"
                await stream.aclose()
        nursery.cancel_scope.cancel()
    assert seen == ["127.0.0.2", "127.0.0.1"]


# ---- reserve: bind at start-up, serve later ------------------------------------------------

def taken(port: int, kind: int) -> bool:
    with socket.socket(socket.AF_INET, kind) as other:
        try:
            other.bind(("127.0.0.1", port))
        except OSError:
            return True
        return False


async def test_a_reserved_address_is_held_and_then_served() -> None:
    net = TcpNetwork()
    address = net.reserve("127.0.0.1:0")
    port = int(address.rsplit(":", 1)[1])
    assert port != 0 and taken(port, socket.SOCK_STREAM) and taken(port, socket.SOCK_DGRAM)
    endpoint = await net.open_datagram("127.0.0.1:0")  # the address asked for takes it
    assert endpoint.local_address == address
    async with trio.open_nursery() as nursery:
        served = await nursery.start(net.serve, address, echo)
        assert served == address
        with trio.fail_after(10):
            stream = await TcpNetwork().dial(address)
            await stream.send_all(b"ping")
            assert await receive_exactly(stream, 4) == b"ping"
            await stream.aclose()
            sender = await TcpNetwork().open_datagram("127.0.0.1:0")
            await sender.send(b"hello", address)
            assert (await endpoint.receive())[0] == b"hello"
            await sender.aclose()
        nursery.cancel_scope.cancel()
    await endpoint.aclose()
    net.release()
    assert not taken(port, socket.SOCK_STREAM) and not taken(port, socket.SOCK_DGRAM)


def test_reserving_an_address_in_use_fails_at_once_and_holds_nothing() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        net = TcpNetwork()
        with pytest.raises(OSError) as caught:
            net.reserve(f"127.0.0.1:{port}")
        assert caught.value.errno == errno.EADDRINUSE
    assert not taken(port, socket.SOCK_DGRAM)  # the datagram socket bound first was closed


def test_release_frees_what_no_node_took() -> None:
    net = TcpNetwork()
    port = int(net.reserve("127.0.0.1:0").rsplit(":", 1)[1])
    net.release()
    assert not taken(port, socket.SOCK_STREAM) and not taken(port, socket.SOCK_DGRAM)
