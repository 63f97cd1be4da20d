"""The fault proxy (gossip.testing.proxy*) over real sockets on 127.0.0.1 and 127.0.0.2.

Every wait is on a condition (the proxy's statistics, an accepted stream, bytes arriving)
under a deadline; timings are asserted only as lower bounds the faults guarantee.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, AsyncIterator

import pytest
import trio

import gossip.testing.proxyctl as proxyctl
import gossip.testing.proxyudp as proxyudp
from gossip.address import format_address, parse_address
from gossip.testing.proxy import (
    MAX_CHUNK,
    MAX_HELD_BYTES,
    RANDOM_RESET_MAX_BYTES,
    FaultProxy,
    Faults,
    open_fault_proxy,
)
from gossip.testing.proxyclient import ProxyClient, ProxyError
from gossip.testing.proxyctl import open_proxy_server
from tests.conformance import receive_exactly
from tests.util import Signal

LIMIT = 10.0  # s: bounds a hang, not a speed


# ---- helpers -------------------------------------------------------------------------------


class Upstream:
    """A TCP server whose accepted streams the test drives itself."""

    def __init__(self) -> None:
        self.streams: list[trio.SocketStream] = []
        self.signal = Signal()
        self.done = trio.Event()
        self.address = ""

    async def handler(self, stream: trio.SocketStream) -> None:
        self.streams.append(stream)
        self.signal.fire()
        await self.done.wait()

    async def accepted(self, n: int = 1) -> trio.SocketStream:
        """The n-th accepted stream, once there is one."""
        with trio.fail_after(LIMIT):
            await self.signal.wait_until(lambda: len(self.streams) >= n)
        return self.streams[n - 1]


@asynccontextmanager
async def upstream_and_proxy(seed: int = 0) -> AsyncIterator[tuple[Upstream, FaultProxy]]:
    upstream = Upstream()
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, upstream.handler, 0, host="127.0.0.1"))
        upstream.address = format_address(*listeners[0].socket.getsockname()[:2])
        async with open_fault_proxy("127.0.0.1:0", upstream.address, seed=seed) as proxy:
            yield upstream, proxy
        upstream.done.set()
        nursery.cancel_scope.cancel()


async def dial(address: str, source: str = "127.0.0.1") -> trio.SocketStream:
    sock = trio.socket.socket()
    await sock.bind((source, 0))
    await sock.connect(parse_address(address))
    return trio.SocketStream(sock)


async def read_until_reset(stream: trio.abc.Stream) -> int:
    """Bytes read before the stream was reset (fails on a clean end of stream)."""
    total = 0
    with trio.fail_after(LIMIT):
        try:
            while data := await stream.receive_some():
                total += len(data)
        except trio.BrokenResourceError:
            return total
    raise AssertionError(f"clean end of stream after {total} bytes, not a reset")


async def udp(host: str = "127.0.0.1") -> trio.socket.SocketType:
    sock = trio.socket.socket(type=socket.SOCK_DGRAM)
    await sock.bind((host, 0))
    return sock


async def receive_datagram(sock: trio.socket.SocketType) -> tuple[bytes, tuple]:
    with trio.fail_after(LIMIT):
        return await sock.recvfrom(65536)


@asynccontextmanager
async def udp_proxy(**faults: Any) -> AsyncIterator[tuple[trio.socket.SocketType, FaultProxy]]:
    upstream = await udp()
    with upstream:
        async with open_fault_proxy("127.0.0.1:0", format_address(*upstream.getsockname())) as proxy:
            proxy.configure(**faults)
            yield upstream, proxy


async def wait(proxy: FaultProxy, predicate) -> Any:
    with trio.fail_after(LIMIT):
        return await proxy.wait_statistics(predicate)


# ---- TCP -----------------------------------------------------------------------------------


async def test_forwards_both_ways_counts_and_passes_on_end_of_stream() -> None:
    async with upstream_and_proxy() as (upstream, proxy):
        client = await dial(proxy.address)
        await client.send_all(b"x" * 1000)
        server = await upstream.accepted()
        assert await receive_exactly(server, 1000) == b"x" * 1000
        await server.send_all(b"y" * 300)
        assert await receive_exactly(client, 300) == b"y" * 300
        stats = await wait(proxy, lambda s: (s.bytes_upstream, s.bytes_downstream) == (1000, 300))
        assert (stats.connections_accepted, stats.connections_open) == (1, 1)
        assert (stats.bytes_held, stats.resets) == (0, 0)
        await client.send_eof()
        with trio.fail_after(LIMIT):
            assert await server.receive_some() == b""
        await server.aclose()
        with trio.fail_after(LIMIT):
            assert await client.receive_some() == b""
        stats = await wait(proxy, lambda s: s.connections_open == 0)
        assert stats.resets == 0


async def test_delay_is_a_lower_bound_each_way_and_keeps_order() -> None:
    async with upstream_and_proxy() as (upstream, proxy):
        proxy.delay(0.2)
        client = await dial(proxy.address)
        start = trio.current_time()
        await client.send_all(b"?")
        server = await upstream.accepted()
        assert await receive_exactly(server, 1) == b"?"
        await server.send_all(b"!")
        assert await receive_exactly(client, 1) == b"!"
        assert trio.current_time() - start >= 0.4
        proxy.delay(0.02, jitter=0.02)
        for i in range(50):
            await client.send_all(i.to_bytes(4, "big"))
        received = await receive_exactly(server, 200)
        assert [int.from_bytes(received[i:i + 4], "big") for i in range(0, 200, 4)] == list(range(50))


async def test_a_new_delay_applies_to_bytes_already_held_and_clear_releases_them() -> None:
    async with upstream_and_proxy() as (upstream, proxy):
        client = await dial(proxy.address)
        await client.send_all(b"a")
        server = await upstream.accepted()
        await receive_exactly(server, 1)
        proxy.delay(3600)
        await client.send_all(b"held")
        await wait(proxy, lambda s: s.bytes_held == 4)
        proxy.clear()
        assert proxy.faults == Faults()
        with trio.fail_after(LIMIT):
            assert await receive_exactly(server, 4) == b"held"


async def test_throttle_limits_the_rate() -> None:
    async with upstream_and_proxy() as (upstream, proxy):
        proxy.throttle(20_000)  # slices of 1000 bytes, one per 0.05 s
        client = await dial(proxy.address)
        start = trio.current_time()
        await client.send_all(b"t" * 10_000)
        server = await upstream.accepted()
        await receive_exactly(server, 10_000)
        assert trio.current_time() - start >= 0.44  # 9 intervals after the first slice
        proxy.throttle(None)
        await client.send_all(b"u" * 100_000)
        await receive_exactly(server, 100_000)


async def test_reset_resets_every_open_connection() -> None:
    async with upstream_and_proxy() as (upstream, proxy):
        clients = [await dial(proxy.address) for _ in range(2)]
        for n, client in enumerate(clients, 1):
            await client.send_all(b"hi")
            await receive_exactly(await upstream.accepted(n), 2)
        assert proxy.reset() == 2
        for n, client in enumerate(clients, 1):
            with trio.fail_after(LIMIT), pytest.raises(trio.BrokenResourceError):
                await client.receive_some()
            assert await read_until_reset(upstream.streams[n - 1]) == 0
        stats = await wait(proxy, lambda s: s.connections_open == 0)
        assert stats.resets == 2


async def test_cut_after_resets_a_new_connection_after_exactly_n_bytes() -> None:
    async with upstream_and_proxy() as (upstream, proxy):
        proxy.cut_after(1000)
        client = await dial(proxy.address)
        await client.send_all(b"c" * 5000)
        assert await read_until_reset(await upstream.accepted()) == 1000
        with trio.fail_after(LIMIT), pytest.raises(trio.BrokenResourceError):
            await client.receive_some()
        stats = await wait(proxy, lambda s: s.resets == 1)
        assert stats.bytes_upstream == 1000


async def test_cut_after_counts_both_directions_from_now_on_open_connections() -> None:
    async with upstream_and_proxy() as (upstream, proxy):
        client = await dial(proxy.address)
        await client.send_all(b"a" * 300)
        server = await upstream.accepted()
        await receive_exactly(server, 300)
        await server.send_all(b"b" * 200)
        await receive_exactly(client, 200)
        proxy.cut_after(500)  # 500 more, both directions together
        await server.send_all(b"d" * 100)
        await receive_exactly(client, 100)
        await client.send_all(b"e" * 1000)
        assert await read_until_reset(server) == 400
        stats = await wait(proxy, lambda s: s.resets == 1)
        assert (stats.bytes_upstream, stats.bytes_downstream) == (700, 300)


async def test_cut_after_zero_resets_open_connections_now_and_new_ones_at_once() -> None:
    async with upstream_and_proxy() as (upstream, proxy):
        client = await dial(proxy.address)
        await client.send_all(b"a")
        await receive_exactly(await upstream.accepted(), 1)
        proxy.cut_after(0)
        with trio.fail_after(LIMIT), pytest.raises(trio.BrokenResourceError):
            await client.receive_some()
        late = await dial(proxy.address)
        with trio.fail_after(LIMIT), pytest.raises(trio.BrokenResourceError):
            await late.receive_some()
        stats = await wait(proxy, lambda s: s.resets == 2)
        assert stats.connections_accepted == 2 and len(upstream.streams) == 1


async def test_corrupt_flips_one_byte_per_forwarded_chunk() -> None:
    async with upstream_and_proxy() as (upstream, proxy):
        proxy.corrupt(1.0)
        payload = bytes(range(256)) * 16
        client = await dial(proxy.address)
        await client.send_all(payload)
        received = await receive_exactly(await upstream.accepted(), len(payload))
        flipped = sum(a != b for a, b in zip(payload, received))
        assert flipped >= 1
        assert flipped == proxy.statistics().corrupted


async def test_reset_probability_resets_after_a_seeded_random_number_of_bytes() -> None:
    counts = []
    for _ in range(2):
        async with upstream_and_proxy(seed=5) as (upstream, proxy):
            proxy.reset_probability(1.0)
            client = await dial(proxy.address)
            async with trio.open_nursery() as nursery:

                async def send() -> None:
                    block = b"r" * MAX_CHUNK
                    try:
                        for _ in range(RANDOM_RESET_MAX_BYTES // MAX_CHUNK + 1):
                            await client.send_all(block)
                    except trio.BrokenResourceError:
                        pass  # the reset this test is waiting for

                nursery.start_soon(send)
                counts.append(await read_until_reset(await upstream.accepted()))
            assert proxy.statistics().resets == 1
    assert counts[0] == counts[1] < RANDOM_RESET_MAX_BYTES


async def test_block_holds_listed_sources_only_and_unblock_releases_the_bytes() -> None:
    async with upstream_and_proxy() as (upstream, proxy):
        blocked = await dial(proxy.address, source="127.0.0.2")
        await blocked.send_all(b"a")
        server = await upstream.accepted(1)
        await receive_exactly(server, 1)
        proxy.block(["127.0.0.2"])
        await blocked.send_all(b"held")  # an open connection freezes, both ways
        await server.send_all(b"back")
        await wait(proxy, lambda s: s.bytes_held == 8)
        fresh = await dial(proxy.address, source="127.0.0.2")  # a new one reaches nobody
        await fresh.send_all(b"new!")
        stats = await wait(proxy, lambda s: s.bytes_held == 12 and s.bytes_upstream == 1)
        assert stats.bytes_downstream == 0
        assert stats.connections_accepted == 2 and len(upstream.streams) == 1
        free = await dial(proxy.address, source="127.0.0.1")  # other sources pass
        await free.send_all(b"free")
        assert await receive_exactly(await upstream.accepted(2), 4) == b"free"
        proxy.unblock()
        assert await receive_exactly(server, 4) == b"held"
        assert await receive_exactly(blocked, 4) == b"back"
        assert await receive_exactly(await upstream.accepted(3), 4) == b"new!"
        assert (await wait(proxy, lambda s: s.bytes_held == 0)).resets == 0


async def test_held_bytes_are_bounded_by_backpressure() -> None:
    async with upstream_and_proxy() as (upstream, proxy):
        proxy.block("127.0.0.1")
        payload = os.urandom(24 * 1024 * 1024)
        client = await dial(proxy.address)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.send_all, payload)
            stats = await wait(proxy, lambda s: s.bytes_held >= MAX_HELD_BYTES)
            assert stats.bytes_held < MAX_HELD_BYTES + MAX_CHUNK
            proxy.unblock()
            received = await receive_exactly(await upstream.accepted(), len(payload))
        assert hashlib.sha256(received).digest() == hashlib.sha256(payload).digest()
        assert (await wait(proxy, lambda s: s.bytes_held == 0)).bytes_upstream == len(payload)


async def test_upstream_unreachable_resets_the_client() -> None:
    with socket.socket() as taken:  # bound, never listening: connections are refused
        taken.bind(("127.0.0.1", 0))
        async with open_fault_proxy("127.0.0.1:0", format_address(*taken.getsockname())) as proxy:
            client = await dial(proxy.address)
            with trio.fail_after(LIMIT), pytest.raises(trio.BrokenResourceError):
                await client.receive_some()
            assert (await wait(proxy, lambda s: s.connections_open == 0)).resets == 1


# ---- UDP -----------------------------------------------------------------------------------


async def test_udp_is_forwarded_nat_style_one_session_per_source() -> None:
    async with udp_proxy() as (upstream, proxy):
        target = parse_address(proxy.address)
        clients = [await udp("127.0.0.1"), await udp("127.0.0.2")]
        sessions = []
        for client in clients:
            await client.sendto(b"ping " + client.getsockname()[0].encode(), target)
            data, session = await receive_datagram(upstream)
            assert data == b"ping " + client.getsockname()[0].encode()
            assert session[0] == "127.0.0.1" and session != client.getsockname()
            sessions.append(session)
        assert sessions[0] != sessions[1]
        for client, session in zip(clients, sessions):
            await upstream.sendto(b"pong", session)  # upstream answers the datagram's source
            data, sender = await receive_datagram(client)
            assert (data, sender) == (b"pong", target)
        stats = await wait(proxy, lambda s: s.datagrams_forwarded == 4)
        assert (stats.datagrams_dropped, stats.udp_sessions) == (0, 2)
        for client in clients:
            client.close()


async def test_udp_sessions_are_bounded_least_recently_used_first(monkeypatch) -> None:
    monkeypatch.setattr(proxyudp, "MAX_UDP_SESSIONS", 2)
    async with udp_proxy() as (upstream, proxy):
        target = parse_address(proxy.address)
        clients = [await udp() for _ in range(3)]
        first_sessions = []
        for client in clients:
            await client.sendto(b"x", target)
            first_sessions.append((await receive_datagram(upstream))[1])
        assert (await wait(proxy, lambda s: s.udp_sessions == 2)).udp_sessions == 2
        await clients[0].sendto(b"again", target)  # evicted: gets a new session
        data, session = await receive_datagram(upstream)
        assert data == b"again" and session not in first_sessions
        await upstream.sendto(b"reply", session)
        assert await receive_datagram(clients[0]) == (b"reply", target)
        for client in clients:
            client.close()


async def test_udp_loss_drops_datagrams_with_the_seeded_probability() -> None:
    async with udp_proxy(loss=1.0) as (upstream, proxy):
        client = await udp()
        target = parse_address(proxy.address)
        for _ in range(3):
            await client.sendto(b"lost", target)
        stats = await wait(proxy, lambda s: s.datagrams_dropped == 3)
        assert stats.datagrams_forwarded == 0
        proxy.loss(0.5)
        for _ in range(40):
            await client.sendto(b"maybe", target)
        stats = await wait(proxy, lambda s: s.datagrams_dropped + s.datagrams_forwarded == 43)
        assert 0 < stats.datagrams_forwarded < 40
        for _ in range(stats.datagrams_forwarded):
            assert (await receive_datagram(upstream))[0] == b"maybe"
        client.close()


async def test_udp_delay_is_a_lower_bound_each_way() -> None:
    async with udp_proxy(delay=0.2) as (upstream, proxy):
        client = await udp()
        start = trio.current_time()
        await client.sendto(b"slow", parse_address(proxy.address))
        _, session = await receive_datagram(upstream)
        await upstream.sendto(b"reply", session)
        assert (await receive_datagram(client))[0] == b"reply"
        assert trio.current_time() - start >= 0.4
        client.close()


async def test_udp_block_drops_listed_sources_both_ways_only() -> None:
    async with udp_proxy() as (upstream, proxy):
        target = parse_address(proxy.address)
        blocked, free = await udp("127.0.0.2"), await udp("127.0.0.1")
        await blocked.sendto(b"before", target)
        _, session = await receive_datagram(upstream)
        proxy.block(["127.0.0.2"])
        await blocked.sendto(b"dropped", target)
        await wait(proxy, lambda s: s.datagrams_dropped == 1)
        await upstream.sendto(b"dropped too", session)
        await wait(proxy, lambda s: s.datagrams_dropped == 2)
        await free.sendto(b"free", target)
        assert (await receive_datagram(upstream))[0] == b"free"
        proxy.unblock()
        await blocked.sendto(b"after", target)
        assert await receive_datagram(upstream) == (b"after", session)
        blocked.close()
        free.close()


async def test_udp_corrupt_flips_one_byte() -> None:
    async with udp_proxy(corrupt=1.0) as (upstream, proxy):
        client = await udp()
        payload = bytes(range(200))
        await client.sendto(payload, parse_address(proxy.address))
        data, _ = await receive_datagram(upstream)
        assert sum(a != b for a, b in zip(payload, data)) == 1
        assert proxy.statistics().corrupted == 1
        client.close()


# ---- faults as values -----------------------------------------------------------------------


@pytest.mark.parametrize("bad", [
    {"delay": -1}, {"delay": float("nan")}, {"delay": "1"}, {"jitter": float("inf")},
    {"throttle": 0}, {"throttle": True}, {"cut_after": -1}, {"cut_after": 1.5},
    {"corrupt": 1.5}, {"reset_probability": -0.1}, {"loss": 2}, {"block": "127.0.0.1"},
    {"block": ["not an ip"]}, {"block": [1]}, {"latency": 1},
])
def test_bad_faults_are_refused_and_change_nothing(bad: dict[str, Any]) -> None:
    proxy = FaultProxy("127.0.0.1:0", "127.0.0.1:1")
    proxy.delay(0.5)
    with pytest.raises(ValueError):
        proxy.configure(**bad)
    assert proxy.faults == Faults(delay=0.5)


def test_block_normalizes_addresses() -> None:
    assert Faults(block=["::ffff:127.0.0.2", "127.0.0.3"]).block == {"127.0.0.2", "127.0.0.3"}


# ---- the HTTP control API ------------------------------------------------------------------


def http_request(method: str, path: str, body: Any = None, *, raw: bytes | None = None) -> bytes:
    payload = raw if raw is not None else b"" if body is None else json.dumps(body).encode()
    return (f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(payload)}\r\n\r\n"
            .encode() + payload)


async def exchange(address: str, request: bytes) -> tuple[int, Any]:
    """Send raw bytes, read the whole answer: (status, JSON body)."""
    with trio.fail_after(LIMIT):
        stream = await trio.open_tcp_stream(*parse_address(address))
        async with stream:
            await stream.send_all(request)
            response = bytearray()
            while data := await stream.receive_some():
                response += data
    head, _, body = bytes(response).partition(b"\r\n\r\n")
    assert b"\r\nconnection: close" in head.lower()
    assert body.endswith(b"\n") and body.count(b"\n") == 1  # one line of JSON
    return int(head.split(b" ")[1]), json.loads(body)


async def call(address: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    return await exchange(address, http_request(method, path, body))


async def test_http_api_endpoints() -> None:
    async with upstream_and_proxy() as (upstream, _), open_proxy_server() as server:
        status, created = await call(server.address, "POST", "/proxies",
                                     {"name": "a", "listen": "127.0.0.1:0", "upstream": upstream.address})
        assert status == 201 and created["name"] == "a" and created["upstream"] == upstream.address
        listen = created["listen"]
        assert parse_address(listen)[1] != 0
        client = await dial(listen)
        await client.send_all(b"via http")
        assert await receive_exactly(await upstream.accepted(), 8) == b"via http"
        await wait(server.proxies["a"], lambda s: s.bytes_upstream == 8)

        status, listing = await call(server.address, "GET", "/proxies")
        assert status == 200 and [p["name"] for p in listing["proxies"]] == ["a"]
        status, body = await call(server.address, "POST", "/proxies/a/faults",
                                  {"delay": 0.1, "block": ["127.0.0.2"], "throttle": 1e6})
        assert status == 200 and body["faults"]["delay"] == 0.1 and body["faults"]["block"] == ["127.0.0.2"]
        status, body = await call(server.address, "POST", "/proxies/a/faults", {"loss": 0.5, "throttle": None})
        assert status == 200
        assert body["faults"] == {**Faults().as_dict(), "delay": 0.1, "block": ["127.0.0.2"], "loss": 0.5}
        status, body = await call(server.address, "GET", "/proxies/a")
        assert status == 200 and body["listen"] == listen
        assert body["statistics"]["connections_accepted"] == 1
        assert body["statistics"]["bytes_upstream"] == 8
        status, body = await call(server.address, "DELETE", "/proxies/a/faults")
        assert status == 200 and body["faults"] == Faults().as_dict()
        assert server.proxies["a"].faults == Faults()

        assert await call(server.address, "POST", "/proxies/a/reset") == (200, {"reset": 1})
        with trio.fail_after(LIMIT), pytest.raises(trio.BrokenResourceError):
            await client.receive_some()
        assert await call(server.address, "DELETE", "/proxies/a") == (200, {"removed": "a"})
        assert (await call(server.address, "GET", "/proxies/a"))[0] == 404
        with pytest.raises(OSError):
            await dial(listen)
        assert await call(server.address, "GET", "/proxies") == (200, {"proxies": []})


BAD_REQUESTS = {
    "bad json": (400, http_request("POST", "/proxies/a/faults", raw=b"{nope")),
    "not an object": (400, http_request("POST", "/proxies/a/faults", [1])),
    "not utf-8": (400, http_request("POST", "/proxies/a/faults", raw=b'{"delay": "\xff"}')),
    "nan": (400, http_request("POST", "/proxies/a/faults", raw=b'{"delay": NaN}')),
    "deep nesting": (400, http_request("POST", "/proxies/a/faults", raw=b"[" * 60_000)),
    "unknown fault": (400, http_request("POST", "/proxies/a/faults", {"latency": 1})),
    "bad value": (400, http_request("POST", "/proxies/a/faults", {"loss": 2})),
    "bad block": (400, http_request("POST", "/proxies/a/faults", {"block": ["nope"]})),
    "unknown proxy": (404, http_request("GET", "/proxies/zzz")),
    "unknown proxy faults": (404, http_request("POST", "/proxies/zzz/faults", {"delay": 1})),
    "unknown proxy reset": (404, http_request("POST", "/proxies/zzz/reset")),
    "unknown proxy delete": (404, http_request("DELETE", "/proxies/zzz")),
    "unknown endpoint": (404, http_request("GET", "/nope")),
    "unknown sub-endpoint": (404, http_request("GET", "/proxies/a/nope")),
    "wrong method": (405, http_request("PUT", "/proxies")),
    "create unknown field": (400, http_request("POST", "/proxies", {"name": "b", "listen": "127.0.0.1:0",
                                                                    "upstream": "127.0.0.1:1", "x": 1})),
    "create missing field": (400, http_request("POST", "/proxies", {"name": "b"})),
    "create bad name": (400, http_request("POST", "/proxies", {"name": "a/b", "listen": "127.0.0.1:0",
                                                                "upstream": "127.0.0.1:1"})),
    "create bad address": (400, http_request("POST", "/proxies", {"name": "b", "listen": "nope",
                                                                   "upstream": "127.0.0.1:1"})),
    "create duplicate": (409, http_request("POST", "/proxies", {"name": "a", "listen": "127.0.0.1:0",
                                                                 "upstream": "127.0.0.1:1"})),
    "declared body too large": (413, b"POST /proxies HTTP/1.1\r\nContent-Length: 10000000\r\n\r\n"),
    "body too large": (413, http_request("POST", "/proxies", raw=b"x" * 100_000)),
    "head too large": (413, b"GET /proxies HTTP/1.1\r\n" + b"X-Filler: y\r\n" * 10_000),
    "chunked": (400, b"POST /proxies HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
    "bad content length": (400, b"POST /proxies HTTP/1.1\r\nContent-Length: -5\r\n\r\n"),
    "garbage": (400, b"\x00\xff\xfe not http at all\r\n\r\n"),
    "not a request line": (400, b"hello\r\n\r\n"),
    "closed early": (400, b"GET /proxies HTTP/1.1\r\n"),
    "body cut short": (400, b"POST /proxies HTTP/1.1\r\nContent-Length: 50\r\n\r\n{}"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=list(BAD_REQUESTS))
async def test_http_bad_requests_get_an_error_and_the_server_survives(case: str) -> None:
    expected, request = BAD_REQUESTS[case]
    async with open_proxy_server() as server:
        await server.create("a", "127.0.0.1:0", "127.0.0.1:1")
        with trio.fail_after(LIMIT):
            stream = await trio.open_tcp_stream(*parse_address(server.address))
            async with stream:
                await stream.send_all(request)
                await stream.send_eof()
                response = bytearray()
                while data := await stream.receive_some():
                    response += data
        head, _, body = bytes(response).partition(b"\r\n\r\n")
        assert int(head.split(b" ")[1]) == expected
        assert isinstance(json.loads(body)["error"], str)
        status, listing = await call(server.address, "GET", "/proxies")
        assert status == 200 and [p["name"] for p in listing["proxies"]] == ["a"]


async def test_http_create_on_a_taken_address_is_a_conflict() -> None:
    async with open_proxy_server() as server:
        first = await server.create("a", "127.0.0.1:0", "127.0.0.1:1")
        status, body = await call(server.address, "POST", "/proxies",
                                  {"name": "b", "listen": first.address, "upstream": "127.0.0.1:1"})
        assert status == 409 and first.address in body["error"]
        assert sorted(server.proxies) == ["a"]


async def test_http_a_slow_request_times_out_and_the_server_survives(monkeypatch) -> None:
    monkeypatch.setattr(proxyctl, "REQUEST_DEADLINE", 0.2)
    async with open_proxy_server() as server:
        with trio.fail_after(LIMIT):
            stream = await trio.open_tcp_stream(*parse_address(server.address))
            async with stream:
                await stream.send_all(b"GET /prox")  # and nothing more
                response = bytearray()
                while data := await stream.receive_some():
                    response += data
        assert response.startswith(b"HTTP/1.1 408 ")
        assert (await call(server.address, "GET", "/proxies"))[0] == 200


# ---- the CLI and the synchronous client (subprocesses, no trio) -----------------------------


def test_spawned_server_round_trip_with_the_sync_client() -> None:
    with ProxyClient.spawn(seed=3) as client, socket.create_server(("127.0.0.1", 0)) as upstream:
        upstream.settimeout(LIMIT)
        up_address = format_address(*upstream.getsockname())
        listen = client.create("a", "127.0.0.1:0", up_address)
        with socket.create_connection(parse_address(listen), timeout=LIMIT) as conn:
            conn.sendall(b"ping")
            server, _ = upstream.accept()
            with server:
                server.settimeout(LIMIT)
                assert server.recv(4, socket.MSG_WAITALL) == b"ping"
                server.sendall(b"pong")
                assert conn.recv(4, socket.MSG_WAITALL) == b"pong"
                state = client.faults("a", block={"127.0.0.2"}, delay=0.01)
                assert state["faults"]["block"] == ["127.0.0.2"] and state["faults"]["delay"] == 0.01
                assert client.get("a")["statistics"]["bytes_upstream"] == 4
                assert [p["name"] for p in client.list()] == ["a"]
                with pytest.raises(ProxyError) as caught:
                    client.faults("a", bogus=1)
                assert caught.value.status == 400 and "bogus" in caught.value.message
                with pytest.raises(ProxyError) as caught:
                    client.get("nope")
                assert caught.value.status == 404 and "nope" in caught.value.message
                assert client.clear("a")["faults"] == Faults().as_dict()
                assert client.reset("a") == 1
                with pytest.raises(ConnectionResetError):
                    conn.recv(1)
        client.remove("a")
        assert client.list() == []
        process = client.process
    assert process is not None and process.returncode == 0


def test_cli_prints_its_control_address_and_exits_0_on_sigint() -> None:
    process = subprocess.Popen([sys.executable, "-m", "gossip.testing.proxy", "--control", "127.0.0.1:0"],
                               stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], 30)
        assert ready, "no control line"
        line = process.stdout.readline().decode()
        assert line.startswith("control=127.0.0.1:") and line.endswith("\n")
        client = ProxyClient(line.strip().removeprefix("control="))
        assert client.list() == []
        process.send_signal(signal.SIGINT)
        assert process.wait(LIMIT) == 0
        assert process.stdout.read() == b""  # exactly one line
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdout.close()


def test_client_on_nothing_listening_raises_a_proxy_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        with pytest.raises(ProxyError) as caught:
            ProxyClient(format_address(*taken.getsockname())).list()
        assert caught.value.status is None
