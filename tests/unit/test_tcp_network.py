"""TcpNetwork on 127.0.0.1 against the shared network conformance suite (real clock)."""

from __future__ import annotations

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
