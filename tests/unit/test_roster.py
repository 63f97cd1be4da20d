"""The roster driver: joining, hostile input, channel routing, and real sockets."""

from __future__ import annotations

import errno
import os

import pytest
import trio
from trio.testing import MockClock

from gossip.endpoints import connect
from gossip.config import MembershipConfig, NodeConfig
from gossip.handshake import Swarm
from gossip.identity import Identity
from gossip.membership import State
from gossip.ourselves import CLASH_CLAIMS
from gossip.claims import sign_alive
from gossip.messages import Close, Ping, StateRequest
from gossip.network import TcpNetwork
from gossip.roster import open_roster
from gossip.seal import Sealer
from gossip.testing.simnet import SimNetwork
from gossip.wire import encode
from tests.util import SWARM


async def wait_for(roster, condition) -> None:
    while not condition():
        await roster.wait_changed()


async def test_three_nodes_over_real_sockets_join_and_leave() -> None:
    net = TcpNetwork()
    ids = [Identity.generate() for _ in range(3)]
    config = MembershipConfig(leave_timeout=0.5)
    with trio.fail_after(20):
        async with open_roster(net, ids[0], SWARM,
                               NodeConfig(listen="127.0.0.1:0", membership=config)) as a:
            async with open_roster(net, ids[1], SWARM,
                                   NodeConfig(listen="127.0.0.1:0", membership=config,
                                              bootstrap=[a.address])) as b:
                async with open_roster(net, ids[2], SWARM,
                                       NodeConfig(listen="127.0.0.1:0", membership=config,
                                                  bootstrap=[b.address])) as c:
                    await c.wait_joined()
                    for r in (a, b, c):
                        await wait_for(r, lambda r=r: len(r.alive()) == 2)
                    assert {m.peer for m in a.alive()} == {ids[1].peer_id, ids[2].peer_id}
                # c left on exit: the others hear it at once, not by failure detection.
                for r in (a, b):
                    await wait_for(r, lambda r=r: r.members() and any(
                        m.peer == ids[2].peer_id and m.state == State.LEFT for m in r.members()))
                assert b.statistics().suspicions == 0


async def test_garbage_datagrams_are_counted_and_change_nothing(autojump_clock: MockClock) -> None:
    net = SimNetwork(seed=1)
    a_id, b_id = Identity.generate(), Identity.generate()
    async with open_roster(net.host("a"), a_id, SWARM, NodeConfig(listen="a:7000")) as a:
        async with open_roster(net.host("b"), b_id, SWARM,
                               NodeConfig(listen="b:7000", bootstrap=["a:7000"])) as b:
            await wait_for(a, lambda: len(a.alive()) == 1)
            attacker = await net.host("x").open_datagram("x:1")
            outsider = Sealer(Swarm.generate(SWARM.name))  # right name, wrong key
            insider = Sealer(SWARM)
            junk = [
                os.urandom(100),
                b"",
                outsider.seal(b"anything"),
                insider.seal(b"\xff\x00not cbor"),
                insider.seal(encode(Ping(1, a_id.peer_id))),  # a message, not a Packet
            ]
            for datagram in junk:
                await attacker.send(datagram, "a:7000")
            await trio.sleep(1.0)
            assert a.statistics().datagrams_rejected == len(junk)
            assert [m.peer for m in a.alive()] == [b_id.peer_id]
            assert b.statistics().suspicions == 0


async def test_channels_that_are_not_push_pulls_go_to_the_handler(autojump_clock: MockClock) -> None:
    net = SimNetwork(seed=1)
    got = []

    async def handler(channel, first) -> None:
        got.append((channel.peer, first))
        await channel.send_message(Close(Close.NORMAL, "handled"))

    a_id, b_id = Identity.generate(), Identity.generate()
    request = StateRequest(bytes(16), "fp32")
    async with open_roster(net.host("a"), a_id, SWARM, NodeConfig(listen="a:7000"),
                           handler=handler):
        async with open_roster(net.host("b"), b_id, SWARM, NodeConfig(listen="b:7000")):
            for address, expected in (("a:7000", "handled"), ("b:7000", "only does membership")):
                channel = await connect(net.host("c"), address, identity=Identity.generate(),
                                        swarm=SWARM)
                async with channel:
                    await channel.send_message(request)
                    answer = await channel.receive_message()
                    assert isinstance(answer, Close) and expected in answer.reason
    assert len(got) == 1 and got[0][1] == request


async def test_join_retries_with_backoff_until_a_bootstrap_answers(autojump_clock: MockClock) -> None:
    net = SimNetwork(seed=1)
    config = MembershipConfig()
    a_id, b_id = Identity.generate(), Identity.generate()
    net.host("nobody"), net.host("a")  # hosts that exist, with nothing listening yet
    async with open_roster(net.host("b"), b_id, SWARM,
                           NodeConfig(listen="b:7000", membership=config,
                                      bootstrap=["nobody:7000", "a:7000"])) as b:
        start = trio.current_time()
        await trio.sleep(60)
        refused = net.statistics().connections_refused
        # Backoff doubles from join_retry_min to join_retry_max: in 60 s that is a handful of
        # rounds (two dials each), not one per second.
        assert 4 <= refused <= 2 * 8
        assert not b.joined
        async with open_roster(net.host("a"), a_id, SWARM,
                               NodeConfig(listen="a:7000", membership=config)) as a:
            with trio.fail_after(config.join_retry_max * 1.5 + config.push_pull_timeout):
                await b.wait_joined()
            await wait_for(a, lambda: len(a.alive()) == 1)
        assert trio.current_time() - start > 60


async def test_a_bootstrap_list_naming_only_ourselves_starts_a_swarm(autojump_clock: MockClock) -> None:
    net = SimNetwork(seed=1)
    config = MembershipConfig()
    async with open_roster(net.host("a"), Identity.generate(), SWARM,
                           NodeConfig(listen="a:7000", membership=config,
                                      bootstrap=["a:7000"])) as a:
        with trio.fail_after(5):
            await a.wait_joined()
        assert a.alive() == []
        # Alone, it looks for company once per reconnect_interval, not in a loop.
        await trio.sleep(10 * config.reconnect_interval)
        assert net.statistics().connections_opened <= 12


async def test_a_table_of_long_addresses_crosses_in_pages(autojump_clock: MockClock) -> None:
    net = SimNetwork(seed=1)
    a_id, b_id = Identity.generate(), Identity.generate()
    async with open_roster(net.host("a"), a_id, SWARM, NodeConfig(listen="a:7000")) as a:
        # 600 members with the longest addresses a message allows: ~300 kB of table.
        long_host = "h" * 250
        for i in range(600):
            member = Identity.generate()
            a._m._on_alive(trio.current_time(),
                           sign_alive(member, 0, f"{long_host}:{1000 + i}", 1, 0, False))
        async with open_roster(net.host("b"), b_id, SWARM,
                               NodeConfig(listen="b:7000", bootstrap=["a:7000"])) as b:
            with trio.fail_after(30):
                await b.wait_joined()
            assert len(b.members()) == 601


async def test_a_node_without_the_swarm_key_cannot_join(autojump_clock: MockClock) -> None:
    net = SimNetwork(seed=1)
    stranger = Swarm(SWARM.name, bytes(32))
    async with open_roster(net.host("a"), Identity.generate(), SWARM,
                           NodeConfig(listen="a:7000")) as a:
        async with open_roster(net.host("x"), Identity.generate(), stranger,
                               NodeConfig(listen="x:7000", bootstrap=["a:7000"])) as x:
            await trio.sleep(30)
            assert a.alive() == [] and x.alive() == []
            assert not x.joined


async def test_metadata_reaches_the_others(autojump_clock: MockClock) -> None:
    net = SimNetwork(seed=1)
    a_id, b_id = Identity.generate(), Identity.generate()
    async with open_roster(net.host("a"), a_id, SWARM, NodeConfig(listen="a:7000")) as a:
        async with open_roster(net.host("b"), b_id, SWARM,
                               NodeConfig(listen="b:7000", bootstrap=["a:7000"])) as b:
            await wait_for(a, lambda: len(a.alive()) == 1)
            assert a.random_alive(ready=True) is None
            b.set_meta(step=42, ready=True)
            with trio.fail_after(2):
                await wait_for(a, lambda: a.alive(ready=True) != [])
            member = a.random_alive(ready=True)
            assert member.peer == b_id.peer_id and member.step == 42
            assert member.incarnation == b.me.incarnation


class PortTakenFirst(TcpNetwork):
    """A TcpNetwork whose first port-0 datagram endpoint lands on ``port``, which a stream
    socket already holds: what the system's pick of a free datagram port can give."""

    def __init__(self, port: int) -> None:
        super().__init__()
        self.port = port
        self.datagram_ports: list[int] = []

    async def open_datagram(self, address: str):
        if address.endswith(":0") and not self.datagram_ports:
            address = f"127.0.0.1:{self.port}"
        endpoint = await super().open_datagram(address)
        self.datagram_ports.append(int(endpoint.local_address.rsplit(":", 1)[1]))
        return endpoint


async def test_port_0_takes_another_port_when_the_stream_port_is_taken() -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    taken = listeners[0].socket.getsockname()[1]
    net = PortTakenFirst(taken)
    try:
        with trio.fail_after(20):
            async with open_roster(net, Identity.generate(), SWARM,
                                   NodeConfig(listen="127.0.0.1:0")) as a:
                port = int(a.address.rsplit(":", 1)[1])
                assert net.datagram_ports[0] == taken and port == net.datagram_ports[-1] != taken
                # Both halves of the roster answer on the new port: a peer can join through it.
                async with open_roster(TcpNetwork(), Identity.generate(), SWARM,
                                       NodeConfig(listen="127.0.0.1:0",
                                                  bootstrap=[a.address])) as b:
                    await wait_for(b, lambda: len(b.alive()) == 1)
    finally:
        for listener in listeners:
            await listener.aclose()


async def test_a_fixed_port_that_is_taken_is_an_error() -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    taken = listeners[0].socket.getsockname()[1]
    try:
        with pytest.raises(OSError) as info:
            async with open_roster(TcpNetwork(), Identity.generate(), SWARM,
                                   NodeConfig(listen=f"127.0.0.1:{taken}")):
                pass  # pragma: no cover
        assert info.value.errno == errno.EADDRINUSE
    finally:
        for listener in listeners:
            await listener.aclose()


async def test_a_node_that_cannot_join_says_why_at_a_slowing_pace(
        autojump_clock: MockClock, caplog: pytest.LogCaptureFixture) -> None:
    net = SimNetwork(seed=1)
    stranger = Swarm(SWARM.name, bytes(32))  # the right name, another key
    net.host("nobody")  # a host with nothing listening
    caplog.set_level("INFO", logger="gossip.roster")
    async with open_roster(net.host("a"), Identity.generate(), SWARM, NodeConfig(listen="a:7000")):
        async with open_roster(net.host("x"), Identity.generate(), stranger,
                               NodeConfig(listen="x:7000",
                                          bootstrap=["a:7000", "nobody:7000"])) as x:
            start = trio.current_time()
            await trio.sleep(3600)
            assert not x.joined
            trouble = x.trouble
            assert trouble is not None and trouble.since - start < 5
            assert "another swarm key" in trouble.reasons["a:7000"]
            assert "check that our swarm key and swarm.cipher are this swarm's" in trouble.reasons["a:7000"]
            assert "connection refused" in trouble.reasons["nobody:7000"]
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    # At once, then with gaps doubling from 30 s to 10 minutes: about 8 in the hour, not
    # one per attempt (backoff alone makes some 60 attempts an hour).
    assert warnings and "cannot join the swarm" in warnings[0].getMessage()
    assert "another swarm key" in warnings[0].getMessage()
    assert 5 <= len(warnings) <= 10
    assert trouble.attempts > 2 * len(warnings)


async def test_a_swarm_name_mismatch_is_named(autojump_clock: MockClock) -> None:
    net = SimNetwork(seed=1)
    async with open_roster(net.host("a"), Identity.generate(), SWARM, NodeConfig(listen="a:7000")):
        async with open_roster(net.host("x"), Identity.generate(), Swarm("other", SWARM.key),
                               NodeConfig(listen="x:7000", bootstrap=["a:7000"])) as x:
            await trio.sleep(5)
            assert x.trouble is not None
            assert "check swarm.name" in x.trouble.reasons["a:7000"]
            assert not x.joined


async def test_two_nodes_with_one_identity_both_report_the_clash(
        autojump_clock: MockClock, caplog: pytest.LogCaptureFixture) -> None:
    # A copied data directory: the same identity key at two addresses.
    net = SimNetwork(seed=1)
    twin = Identity.generate()
    async with open_roster(net.host("a"), twin, SWARM, NodeConfig(listen="a:7000")) as a:
        async with open_roster(net.host("b"), twin, SWARM,
                               NodeConfig(listen="b:7000", bootstrap=["a:7000"])) as b:
            await trio.sleep(10)
            assert not b.joined  # the copy does not take itself for the first node
            assert b.clash == "a:7000" and a.clash == "b:7000"
            assert "identity" in b.trouble.reasons["a:7000"]
            assert a.alive() == [] and b.alive() == []
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any("identity clash: the node at a:7000" in e for e in errors)
    assert any("identity clash: the node at b:7000" in e for e in errors)


async def test_a_clone_that_joins_through_a_third_node_is_found_by_both(
        autojump_clock: MockClock) -> None:
    net = SimNetwork(seed=1)
    twin = Identity.generate()
    async with open_roster(net.host("c"), Identity.generate(), SWARM,
                           NodeConfig(listen="c:7000")) as c:
        async with open_roster(net.host("a"), twin, SWARM,
                               NodeConfig(listen="a:7000", bootstrap=["c:7000"])) as a:
            await a.wait_joined()
            async with open_roster(net.host("b"), twin, SWARM,
                                   NodeConfig(listen="b:7000", bootstrap=["c:7000"])) as b:
                # Each side refutes the other's claims, which travel through c: the first
                # claims come at once, the third within a few push-pull intervals; then it
                # dials the address as itself, which only the clone can answer.
                with trio.fail_after(4 * MembershipConfig().push_pull_interval):
                    await wait_for(a, lambda: a.clash is not None)
                    await wait_for(b, lambda: b.clash is not None)
                assert (a.clash, b.clash) == ("b:7000", "a:7000")
                assert c.clash is None
            # The clone stops: the next check finds nobody with our identity there.
            with trio.fail_after(2 * MembershipConfig().push_pull_interval):
                await wait_for(a, lambda: a.clash is None)


async def test_claims_in_gossip_alone_prove_no_clash(autojump_clock: MockClock) -> None:
    # Signed announcements of this node at x:7000 (an earlier run's, say, relayed late): the
    # node dials x:7000 as itself, where an honest node (another identity) answers, and
    # nothing is flagged. (A key holder cannot sign them: gossip.claims.)
    net = SimNetwork(seed=1)
    victim = Identity.generate()
    async with open_roster(net.host("x"), Identity.generate(), SWARM,
                           NodeConfig(listen="x:7000")) as x:
        async with open_roster(net.host("v"), victim, SWARM,
                               NodeConfig(listen="v:7000", bootstrap=["x:7000"])) as v:
            await v.wait_joined()
            for incarnation in range(100, 100 + 2 * CLASH_CLAIMS):
                v._m._on_alive(trio.current_time(),
                               sign_alive(victim, incarnation, "x:7000", 1, 0, True))
            await v._execute([])
            await trio.sleep(MembershipConfig().push_pull_interval)
            assert v.clash is None and x.clash is None
            assert len(v.alive()) == 1
