"""SimNetwork: the shared conformance suite, then what only a simulated network can show.

Every test runs under ``MockClock(autojump_threshold=0)`` (the ``autojump_clock`` fixture):
delays are measured in virtual time, and a ``move_on_after`` around something that must
*not* happen costs no wall time.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import trio
import trio.testing
from trio.testing import MockClock

from gossip.averaging import Result
from gossip.errors import PeerGone
from gossip.network import MAX_DATAGRAM, Handler, Network
from gossip.testing.simnet import MAX_DATAGRAM_QUEUE, SimDatagramEndpoint, SimNetwork
from gossip.testing import open_sim_swarm
from tests.conformance import (
    CHECKS,
    Check,
    NetworkUnderTest,
    check_datagram_round_trip,
    echo,
    receive_all,
    receive_exactly,
)

LONG = 1000.0  # virtual seconds: "never", for things that must not happen


def sim_pair(**config: float) -> NetworkUnderTest:
    net = SimNetwork(seed=1, **config)  # type: ignore[arg-type]
    nut = NetworkUnderTest(
        server=net.host("server"),
        client=net.host("client"),
        server_bind="server:0",
        client_bind="client:0",
    )
    if config.get("bandwidth") is None:
        return nut  # the generic clog (send until blocked) works

    async def fill_window(stream: trio.abc.Stream) -> None:
        # With a bandwidth limit the sender also blocks while serializing, so "send until
        # blocked" stops early; exactly one window's worth clogs the stream instead.
        await stream.send_all(b"x" * net.window)

    return dataclasses.replace(nut, clog=fill_window)


SLOW_LOSSY = dict(latency=0.02, bandwidth=5e6, loss=0.2, window=64 * 1024, rto=0.1)


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__)
async def test_conformance(check: Check, autojump_clock: MockClock) -> None:
    await check(sim_pair())


@pytest.mark.parametrize(
    "check", [c for c in CHECKS if c is not check_datagram_round_trip], ids=lambda c: c.__name__
)
async def test_conformance_slow_lossy(check: Check, autojump_clock: MockClock) -> None:
    # Streams stay reliable and ordered over a slow link that loses a fifth of its segments.
    await check(sim_pair(**SLOW_LOSSY))


async def timed_dial(host: Network, address: str) -> tuple[trio.abc.Stream, float]:
    start = trio.current_time()
    stream = await host.dial(address)
    return stream, trio.current_time() - start


async def test_latency_in_virtual_time(autojump_clock: MockClock) -> None:
    net = SimNetwork(latency=0.05)
    net.set_link("a", "c", latency=0.2)
    a, b, c = net.host("a"), net.host("b"), net.host("c")
    arrivals_in, arrivals = trio.open_memory_channel[float](math.inf)

    async def stamp(stream: trio.abc.Stream) -> None:
        await stream.receive_some()
        arrivals_in.send_nowait(trio.current_time())

    async with trio.open_nursery() as nursery:
        at_b = await nursery.start(b.serve, "b:0", stamp)
        at_c = await nursery.start(c.serve, "c:0", stamp)
        stream, took = await timed_dial(a, at_b)
        assert took == pytest.approx(0.1)  # one round trip
        sent = trio.current_time()
        await stream.send_all(b"x")
        assert await arrivals.receive() - sent == pytest.approx(0.05)
        _, took = await timed_dial(a, at_c)
        assert took == pytest.approx(0.4)  # the overridden link, both ways

        ea, eb = await a.open_datagram("a:0"), await b.open_datagram("b:7")
        sent = trio.current_time()
        await ea.send(b"hi", eb.local_address)
        assert await eb.receive() == (b"hi", ea.local_address)
        assert trio.current_time() - sent == pytest.approx(0.05)
        nursery.cancel_scope.cancel()


async def test_bandwidth_serializes_bytes(autojump_clock: MockClock) -> None:
    net = SimNetwork(latency=0.01, bandwidth=1e6)
    a, b = net.host("a"), net.host("b")
    done_in, done = trio.open_memory_channel[float](math.inf)

    async def sink(stream: trio.abc.Stream) -> None:
        await receive_exactly(stream, 500_000)
        done_in.send_nowait(trio.current_time())

    async with trio.open_nursery() as nursery:
        address = await nursery.start(b.serve, "b:0", sink)
        one, _ = await timed_dial(a, address)
        start = trio.current_time()
        await one.send_all(b"1" * 500_000)
        assert trio.current_time() - start == pytest.approx(0.5)  # 500 kB at 1 MB/s
        assert await done.receive() - start == pytest.approx(0.51)  # plus one latency

        # Two streams in the same direction share the link: both finish after 1 s.
        two, _ = await timed_dial(a, address)
        three, _ = await timed_dial(a, address)
        start = trio.current_time()
        async with trio.open_nursery() as senders:
            senders.start_soon(two.send_all, b"2" * 500_000)
            senders.start_soon(three.send_all, b"3" * 500_000)
        assert trio.current_time() - start == pytest.approx(1.0)
        nursery.cancel_scope.cancel()


async def test_retransmission_costs_rto_and_keeps_bytes(autojump_clock: MockClock) -> None:
    net = SimNetwork(latency=0.01, rto=0.5)
    net.set_link("a", "b", loss=1.0)  # every segment and handshake packet lost once
    a, b = net.host("a"), net.host("b")
    async with trio.open_nursery() as nursery:
        address = await nursery.start(b.serve, "b:0", echo)
        stream, took = await timed_dial(a, address)
        assert took == pytest.approx(2 * 0.51)
        start = trio.current_time()
        payload = bytes(range(256)) * 1000
        await stream.send_all(payload)
        assert await receive_exactly(stream, len(payload)) == payload
        # there and back, each leg late by one rto
        assert trio.current_time() - start == pytest.approx(2 * 0.51, abs=0.01)
        assert net.statistics().segments_retransmitted >= 2 * 4
        nursery.cancel_scope.cancel()


async def test_partition_blackholes_and_heal_restores(autojump_clock: MockClock) -> None:
    net = SimNetwork()
    a, b, c = net.host("a"), net.host("b"), net.host("c")
    async with trio.open_nursery() as nursery:
        address = await nursery.start(b.serve, "b:80", echo)
        stream = await a.dial(address)
        ea, eb = await a.open_datagram("a:0"), await b.open_datagram("b:0")

        net.partition(["a"])  # a alone; b and c, named nowhere, stay together
        await stream.send_all(b"held")
        await ea.send(b"lost", eb.local_address)
        with trio.move_on_after(LONG):
            await stream.receive_some()
            pytest.fail("bytes crossed a partition")
        with trio.move_on_after(LONG):
            await eb.receive()
            pytest.fail("a datagram crossed a partition")
        with pytest.raises(trio.TooSlowError):
            with trio.fail_after(LONG):
                await a.dial(address)  # hangs like a real partition, until our deadline
        from_c = await c.dial(address)  # same side: unaffected
        await from_c.send_all(b"c")
        assert await receive_exactly(from_c, 1) == b"c"

        # A dial in progress when the partition heals goes through.
        dialed = trio.Event()

        async def dial_later() -> None:
            await a.dial(address)
            dialed.set()

        nursery.start_soon(dial_later)
        await trio.testing.wait_all_tasks_blocked()
        net.heal()
        assert await receive_exactly(stream, 4) == b"held"  # stalled bytes resume, intact
        await ea.send(b"found", eb.local_address)
        assert await eb.receive() == (b"found", ea.local_address)
        with trio.fail_after(1):
            await dialed.wait()
        assert net.statistics().datagrams_dropped == 1
        nursery.cancel_scope.cancel()


async def test_a_new_partition_replaces_the_old_one(autojump_clock: MockClock) -> None:
    net = SimNetwork(latency=0.01)
    a, b, c = net.host("a"), net.host("b"), net.host("c")
    async with trio.open_nursery() as nursery:
        address = await nursery.start(b.serve, "b:80", echo)
        ab, cb = await a.dial(address), await c.dial(address)
        net.partition(["a"], ["b", "c"])
        await ab.send_all(b"from a")
        net.partition(["a", "b"], ["c"])  # a-b heals, b-c is cut
        await cb.send_all(b"from c")
        assert await receive_exactly(ab, 6) == b"from a"
        with trio.move_on_after(LONG):
            await cb.receive_some()
            pytest.fail("bytes crossed the new cut")
        net.heal()
        assert await receive_exactly(cb, 6) == b"from c"
        nursery.cancel_scope.cancel()


async def test_pause_cuts_a_host_off_both_ways_until_resume(autojump_clock: MockClock) -> None:
    net = SimNetwork(latency=0.01)
    a, b, c = net.host("a"), net.host("b"), net.host("c")
    async with trio.open_nursery() as nursery:
        at_b = await nursery.start(b.serve, "b:80", echo)
        at_c = await nursery.start(c.serve, "c:80", echo)
        ab = await a.dial(at_b)
        ea, eb = await a.open_datagram("a:0"), await b.open_datagram("b:0")
        await ab.send_all(b"in flight")  # on the link when the pause begins: held too

        net.pause("b")
        assert net.paused("b") and not net.paused("a")
        await ea.send(b"to b", eb.local_address)
        await eb.send(b"from b", ea.local_address)
        with trio.move_on_after(LONG):
            await ab.receive_some()
            pytest.fail("bytes reached or left a paused host")
        with trio.move_on_after(LONG):
            await ea.receive()
            pytest.fail("a datagram left a paused host")
        with pytest.raises(trio.TooSlowError):
            with trio.fail_after(LONG):
                await a.dial(at_b)  # waits, as across a partition
        with pytest.raises(trio.TooSlowError):
            with trio.fail_after(LONG):
                await b.dial(at_c)
        ac = await a.dial(at_c)  # hosts other than b: unaffected
        await ac.send_all(b"ok")
        assert await receive_exactly(ac, 2) == b"ok"

        net.resume("b")
        assert await receive_exactly(ab, 9) == b"in flight"  # held bytes resume, intact
        await ea.send(b"again", eb.local_address)
        assert await eb.receive() == (b"again", ea.local_address)
        assert net.statistics().datagrams_dropped == 2
        nursery.cancel_scope.cancel()


async def test_pause_and_partition_compose(autojump_clock: MockClock) -> None:
    net = SimNetwork(latency=0.01)
    a, b = net.host("a"), net.host("b")
    async with trio.open_nursery() as nursery:
        at_b = await nursery.start(b.serve, "b:80", echo)
        ab = await a.dial(at_b)
        net.pause("a")
        net.partition(["a"], ["b"])
        net.resume("a")  # the partition still cuts a from b
        await ab.send_all(b"1")
        with trio.move_on_after(LONG):
            await ab.receive_some()
            pytest.fail("bytes crossed the partition once the pause ended")
        net.pause("b")
        net.heal()  # b is still paused
        with trio.move_on_after(LONG):
            await ab.receive_some()
            pytest.fail("bytes reached a paused host once the partition healed")
        net.resume("b")
        assert await receive_exactly(ab, 1) == b"1"
        net.pause("a")
        net.pause("a")  # idempotent, as resume is
        net.resume("a")
        net.resume("a")
        await ab.send_all(b"2")
        assert await receive_exactly(ab, 1) == b"2"
        nursery.cancel_scope.cancel()


async def test_crash_resets_refuses_and_restart_serves_again(autojump_clock: MockClock) -> None:
    net = SimNetwork()
    a, b = net.host("a"), net.host("b")
    serve_errors: list[BaseException] = []

    async def serve_b(task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await b.serve("b:80", echo, task_status=task_status)
        except PeerGone as exc:
            serve_errors.append(exc)

    async with trio.open_nursery() as nursery:
        address = await nursery.start(serve_b)
        stream = await a.dial(address)
        await stream.send_all(b"1")
        assert await receive_exactly(stream, 1) == b"1"
        endpoint = await b.open_datagram("b:53")

        net.crash(b)
        with pytest.raises(trio.BrokenResourceError):
            await stream.receive_some()
        with pytest.raises(trio.BrokenResourceError):
            await stream.send_all(b"2")
        with pytest.raises(PeerGone):
            await endpoint.receive()
        with pytest.raises(PeerGone):
            await a.dial(address)
        with pytest.raises(PeerGone):
            await b.dial("a:1")
        with pytest.raises(PeerGone):
            await b.open_datagram("b:0")
        await trio.testing.wait_all_tasks_blocked()
        assert len(serve_errors) == 1

        net.restart("b")
        address = await nursery.start(b.serve, "b:80", echo)  # the port is free again
        again = await a.dial(address)
        await again.send_all(b"3")
        assert await receive_exactly(again, 1) == b"3"
        stats = net.statistics()
        assert (stats.connections_opened, stats.connections_reset) == (2, 1)
        assert stats.connections_refused == 1
        nursery.cancel_scope.cancel()


async def test_reset_between_two_hosts(autojump_clock: MockClock) -> None:
    net = SimNetwork()
    a, b, c = net.host("a"), net.host("b"), net.host("c")
    async with trio.open_nursery() as nursery:
        at_b = await nursery.start(b.serve, "b:0", echo)
        at_c = await nursery.start(c.serve, "c:0", echo)
        ab, ac = await a.dial(at_b), await a.dial(at_c)
        net.reset("b", a)
        with pytest.raises(trio.BrokenResourceError):
            await ab.receive_some()
        await ac.send_all(b"ok")  # another pair: untouched
        assert await receive_exactly(ac, 2) == b"ok"
        fresh = await a.dial(at_b)  # neither host crashed
        await fresh.send_all(b"ok")
        assert await receive_exactly(fresh, 2) == b"ok"
        assert net.statistics().connections_reset == 1
        nursery.cancel_scope.cancel()


async def datagram_trace(seed: int, n: int = 1000, loss: float = 0.3) -> list[int]:
    """Send n numbered datagrams a -> b over a lossy link; returns the numbers received.
    (n stays below MAX_DATAGRAM_QUEUE: nobody reads until all are sent.)"""
    net = SimNetwork(seed, loss=loss)
    ea = await net.host("a").open_datagram("a:0")
    eb = await net.host("b").open_datagram("b:0")
    for i in range(n):
        await ea.send(i.to_bytes(4, "big"), eb.local_address)
    delivered = n - net.statistics().datagrams_dropped
    received = [int.from_bytes((await eb.receive())[0], "big") for _ in range(delivered)]
    with trio.move_on_after(LONG):
        await eb.receive()
        pytest.fail("more datagrams arrived than the statistics say")
    return received


async def test_datagram_loss_rate_matches_configuration(autojump_clock: MockClock) -> None:
    received = await datagram_trace(seed=7)
    assert 0.25 < 1 - len(received) / 1000 < 0.35
    assert received == sorted(received)  # equal delays keep the order


async def test_same_seed_same_faults(autojump_clock: MockClock) -> None:
    first, again, other = [await datagram_trace(seed) for seed in (3, 3, 4)]
    assert first == again
    assert first != other

    async def stream_timing(seed: int) -> list[float]:
        net = SimNetwork(seed, latency=0.01, loss=0.3, rto=0.2, bandwidth=1e7)
        times: list[float] = []
        async with trio.open_nursery() as nursery:
            address = await nursery.start(net.host("b").serve, "b:0", echo)
            stream = await net.host("a").dial(address)
            start = trio.current_time()
            for _ in range(20):
                await stream.send_all(b"x" * 100_000)
                await receive_exactly(stream, 100_000)
                times.append(round(trio.current_time() - start, 9))
            nursery.cancel_scope.cancel()
        return times

    assert await stream_timing(5) == await stream_timing(5)
    assert await stream_timing(5) != await stream_timing(6)


async def test_flow_control_bounds_buffered_bytes(autojump_clock: MockClock) -> None:
    window = 64 * 1024
    net = SimNetwork(window=window)
    a, b = net.host("a"), net.host("b")
    reader_may_start, reader_done = trio.Event(), trio.Event()
    payload = bytes(range(256)) * 40_000  # 10 MB

    async def stalled_reader(stream: trio.abc.Stream) -> None:
        await reader_may_start.wait()
        assert await receive_all(stream) == payload
        reader_done.set()

    async with trio.open_nursery() as nursery:
        address = await nursery.start(b.serve, "b:0", stalled_reader)
        stream = await a.dial(address)
        writer_done = trio.Event()

        async def writer() -> None:
            await stream.send_all(payload)
            await stream.aclose()
            writer_done.set()

        nursery.start_soon(writer)
        with trio.move_on_after(LONG):
            await writer_done.wait()
        assert not writer_done.is_set()
        assert net.statistics().bytes_buffered == window  # exactly full, no more
        reader_may_start.set()
        await writer_done.wait()
        await reader_done.wait()
        assert net.statistics().bytes_buffered == 0
        assert net.statistics().bytes_sent == len(payload)
        nursery.cancel_scope.cancel()


async def test_64_nodes_each_dial_every_other(autojump_clock: MockClock) -> None:
    n = 64
    net = SimNetwork(seed=2, latency=0.005)
    names = [f"node{i}" for i in range(n)]
    answers: set[tuple[str, str]] = set()

    def answer_as(name: str) -> Handler:
        async def handler(stream: trio.abc.Stream) -> None:
            request = await receive_all(stream)
            await stream.send_all(f"{name} answers {request.decode()}".encode())

        return handler

    async with trio.open_nursery() as servers:
        for name in names:
            await servers.start(net.host(name).serve, f"{name}:7070", answer_as(name))

        async def ask(client: str, server: str) -> None:
            stream = await net.host(client).dial(f"{server}:7070")
            await stream.send_all(client.encode())
            await stream.send_eof()
            reply = await receive_all(stream)
            assert reply == f"{server} answers {client}".encode()
            answers.add((client, server))
            await stream.aclose()

        with trio.fail_after(60):  # virtual seconds
            async with trio.open_nursery() as clients:
                for client in names:
                    for server in names:
                        if client != server:
                            clients.start_soon(ask, client, server)
        servers.cancel_scope.cancel()
    assert len(answers) == n * (n - 1)
    stats = net.statistics()
    assert stats.connections_opened == n * (n - 1)
    assert stats.bytes_buffered == 0


async def test_statistics_and_argument_checks(autojump_clock: MockClock) -> None:
    net = SimNetwork()
    assert set(dataclasses.astuple(net.statistics())) == {0}
    with pytest.raises(dataclasses.FrozenInstanceError):
        net.statistics().bytes_sent = 1  # type: ignore[misc]
    for bad in (dict(latency=-1), dict(loss=1.5), dict(bandwidth=0), dict(window=0)):
        with pytest.raises(ValueError):
            SimNetwork(**bad)  # type: ignore[arg-type]
    for name in ("", "a:b", "[x]", "two words"):
        with pytest.raises(ValueError):
            net.host(name)
    a = net.host("a")
    assert net.host("a") is a
    assert isinstance(a, Network)
    with pytest.raises(OSError):
        await a.serve("b:0", echo)  # a host binds only its own name
    with pytest.raises(OSError):
        await a.open_datagram("b:0")
    with pytest.raises(PeerGone):
        await a.dial("nowhere:1")
    with pytest.raises(ValueError):
        net.partition(["a"], ["a", "b"])
    net.set_link("a", "b", bandwidth=math.inf)  # inf = unlimited
    endpoint = await a.open_datagram("a:5")
    with pytest.raises(OSError):
        await a.open_datagram("a:5")
    await endpoint.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await endpoint.receive()
    again = await a.open_datagram("a:5")  # free again
    with pytest.raises(ValueError):
        await again.send(b"x" * (MAX_DATAGRAM + 1), "a:5")

    # An endpoint nobody reads holds MAX_DATAGRAM_QUEUE datagrams and drops the rest.
    for i in range(MAX_DATAGRAM_QUEUE + 10):
        await again.send(b"%d" % i, "a:5")
    stats = net.statistics()
    assert (stats.datagrams_sent, stats.datagrams_dropped) == (MAX_DATAGRAM_QUEUE + 10, 10)


# ---- hosts behind a NAT or a firewall ------------------------------------------------------


async def test_nat_lets_out_and_keeps_out(autojump_clock: MockClock) -> None:
    net = SimNetwork(latency=0.01)
    a, b, c = net.host("a"), net.host("b"), net.host("c")
    async with trio.open_nursery() as nursery:
        at_a = await nursery.start(a.serve, "a:80", echo)
        at_b = await nursery.start(b.serve, "b:80", echo)
        before = await b.dial(at_a)  # opened inbound before the NAT: kept, as established

        net.nat(a)
        assert net.behind_nat(a) and not net.behind_nat(b)
        out, took = await timed_dial(a, at_b)  # outbound: as if no NAT
        assert took == pytest.approx(0.02)
        for stream in (out, before):
            await stream.send_all(b"both ways")
            assert await receive_exactly(stream, 9) == b"both ways"
        start = trio.current_time()
        with pytest.raises(trio.TooSlowError):
            with trio.fail_after(LONG):
                await b.dial(at_a)  # the SYN is dropped: only the caller's deadline ends it
        assert trio.current_time() - start == pytest.approx(LONG)
        assert net.statistics().connections_refused == 0

        # A dial waiting at the NAT goes through once the NAT is gone, as a SYN retry would.
        dialed = trio.Event()

        async def dial_a() -> None:
            stream = await c.dial(at_a)
            await stream.send_all(b"in")
            assert await receive_exactly(stream, 2) == b"in"
            dialed.set()

        nursery.start_soon(dial_a)
        await trio.testing.wait_all_tasks_blocked()
        net.unnat(a)
        net.unnat(a)  # idempotent
        assert not net.behind_nat(a)
        with trio.fail_after(1):
            await dialed.wait()
        nursery.cancel_scope.cancel()


async def test_firewall_refuses_dials_at_once(autojump_clock: MockClock) -> None:
    net = SimNetwork(latency=0.01)
    a, b = net.host("a"), net.host("b")
    async with trio.open_nursery() as nursery:
        at_a = await nursery.start(a.serve, "a:80", echo)
        net.nat(a)
        waiting = trio.Event()

        async def dial_until_refused() -> None:
            with pytest.raises(PeerGone, match="connection refused"):
                await b.dial(at_a)
            waiting.set()

        nursery.start_soon(dial_until_refused)
        await trio.testing.wait_all_tasks_blocked()
        net.nat(a, refuse=True)  # a dial waiting at the NAT meets the firewall's RST
        with trio.fail_after(1):
            await waiting.wait()
        start = trio.current_time()
        with pytest.raises(PeerGone, match="connection refused"):  # as at a closed port
            await b.dial(at_a)
        assert trio.current_time() - start == pytest.approx(0.02)  # one round trip
        assert net.statistics().connections_refused == 2
        out = await a.dial(await nursery.start(b.serve, "b:80", echo))
        await out.send_all(b"out")
        assert await receive_exactly(out, 3) == b"out"
        nursery.cancel_scope.cancel()


async def test_nat_admits_datagrams_from_addresses_it_sent_to(autojump_clock: MockClock) -> None:
    net = SimNetwork(latency=0.01)
    net.nat("a", udp_timeout=30.0)
    a, b, c = net.host("a"), net.host("b"), net.host("c")
    ea, other_port = await a.open_datagram("a:5000"), await a.open_datagram("a:5001")
    eb, eb2 = await b.open_datagram("b:53"), await b.open_datagram("b:54")
    ec = await c.open_datagram("c:53")

    async def lost(endpoint: SimDatagramEndpoint) -> None:
        with trio.move_on_after(LONG):
            await endpoint.receive()
            pytest.fail("a datagram got through the NAT")

    await ea.send(b"query", eb.local_address)  # maps a:5000 <-> b:53, nothing else
    assert await eb.receive() == (b"query", ea.local_address)  # the host's own address
    await eb.send(b"reply", ea.local_address)
    assert await ea.receive() == (b"reply", eb.local_address)
    await eb2.send(b"other port", ea.local_address)  # the exact address, not just the host
    await ec.send(b"unsolicited", ea.local_address)
    await eb.send(b"to another port", other_port.local_address)  # the mapping is per port
    await lost(ea)
    await lost(other_port)
    assert net.statistics().nat_dropped == 3

    # Time the mapping out: a reply arriving 30 s after the query passes, one later does not.
    sent = trio.current_time()
    await ea.send(b"refresh", eb.local_address)  # each datagram sent refreshes its mapping
    await trio.sleep(30.0 - 0.01 - (trio.current_time() - sent))
    await eb.send(b"just in time", ea.local_address)
    assert await ea.receive() == (b"just in time", eb.local_address)
    await eb.send(b"too late", ea.local_address)  # arrives 30.01 s after the last send
    await lost(ea)
    await ea.send(b"again", eb.local_address)
    await eb.send(b"answer", ea.local_address)
    assert await ea.receive() == (b"answer", eb.local_address)

    net.unnat("a")
    await ec.send(b"welcome", ea.local_address)
    assert await ea.receive() == (b"welcome", ec.local_address)
    stats = net.statistics()
    assert stats.nat_dropped == 4 and stats.datagrams_dropped == 4


async def test_nat_hole_punching_and_datagrams_in_flight(autojump_clock: MockClock) -> None:
    net = SimNetwork(latency=0.01)
    ea, eb = await net.host("a").open_datagram("a:1"), await net.host("b").open_datagram("b:1")
    await eb.send(b"in flight", ea.local_address)
    net.nat("a")  # the mappings start empty: what is on its way to a was unsolicited
    assert net.statistics().nat_dropped == 1
    net.nat("b")
    await ea.send(b"punch", eb.local_address)  # dropped at b's NAT, but opens a's
    await eb.send(b"through", ea.local_address)  # passes a's NAT, opens b's
    assert await ea.receive() == (b"through", eb.local_address)
    await ea.send(b"and back", eb.local_address)
    assert await eb.receive() == (b"and back", ea.local_address)
    assert net.statistics().nat_dropped == 2
    with pytest.raises(ValueError):
        net.nat("a", udp_timeout=0)


async def test_nat_outlives_crash_and_composes_with_faults(autojump_clock: MockClock) -> None:
    net = SimNetwork(latency=0.01)
    a, b = net.host("a"), net.host("b")
    net.nat(a)
    ea, eb = await a.open_datagram("a:1"), await b.open_datagram("b:1")
    await ea.send(b"map", eb.local_address)
    net.crash(a)
    net.restart(a)
    assert net.behind_nat(a)  # the host's network, not its process: mappings included
    ea = await a.open_datagram("a:1")
    await eb.send(b"after restart", ea.local_address)
    assert await ea.receive() == (b"after restart", eb.local_address)

    async def serve_a(task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        with pytest.raises(PeerGone):  # when a crashes
            await a.serve("a:80", echo, task_status=task_status)

    async with trio.open_nursery() as nursery:
        at_a = await nursery.start(serve_a)
        net.crash(a)  # a crashed host behind a NAT looks the same from outside: no answer
        with pytest.raises(trio.TooSlowError):
            with trio.fail_after(LONG):
                await b.dial(at_a)
        net.restart(a)
        ea = await a.open_datagram("a:1")
        await nursery.start(a.serve, at_a, echo)

        net.partition(["a"])
        await ea.send(b"across the cut", eb.local_address)  # lost, but maps (NAT before cut)
        net.heal()
        net.pause(a)
        await ea.send(b"paused", "b:2")  # never leaves the host: maps nothing
        net.resume(a)
        eb2 = await b.open_datagram("b:2")
        await eb.send(b"mapped", ea.local_address)
        await eb2.send(b"not mapped", ea.local_address)
        assert await ea.receive() == (b"mapped", eb.local_address)
        with trio.move_on_after(LONG):
            await ea.receive()
            pytest.fail("a datagram got through the NAT")

        net.partition(["a"])  # the NAT ends while a partition still cuts: the dial waits on
        dialed = trio.Event()

        async def dial_a() -> None:
            await b.dial(at_a)
            dialed.set()

        nursery.start_soon(dial_a)
        await trio.testing.wait_all_tasks_blocked()
        net.unnat(a)
        with trio.move_on_after(LONG):
            await dialed.wait()
        assert not dialed.is_set()
        net.heal()
        with trio.fail_after(1):
            await dialed.wait()
        nursery.cancel_scope.cancel()


async def test_a_sim_swarm_node_behind_nat_averages_through_its_own_offers(
    autojump_clock: MockClock,
) -> None:
    async with open_sim_swarm(3, seed=1) as sim:
        with trio.fail_after(120):
            await sim.wait_ready()
        sim.nat(2)  # SimSwarm passes it through to the network
        assert sim.net.behind_nat("n2")
        since = trio.current_time()
        with trio.fail_after(120):  # n2 dials out, so what it starts still commits
            await sim.wait_until(lambda: any(
                e.node.index == 2 and e.initiated and e.result is Result.COMMITTED
                and e.started >= since for e in sim.exchanges))
        sim.unnat(sim.nodes[2])
        assert not sim.net.behind_nat("n2")
