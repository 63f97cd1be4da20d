"""Swarm key rotation in the library: a Swarm with a previous key, the responder's trial
decryption of message 1, the dialer's fallback and its memory, sealed datagrams under either
key, and the memory's bounds (gossip.rotation, gossip.handshake, gossip.seal, gossip.channel).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest
import trio
import trio.testing
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from gossip.endpoints import connect, handshake, serve
from gossip.errors import HandshakeClosed, HandshakeError, LocalProtocolError, WireError
from gossip.handshake import NoiseHandshake, Swarm, read_first_message
from gossip.identity import Identity
from gossip.rotation import MAX_ADDRESSES, Holds, PeerKeys
from gossip.seal import Sealer
from gossip.testing.simnet import SimNetwork
from tests.util import ALICE, BOB

OLD, NEW, OTHER = bytes(range(32)), bytes(range(1, 33)), bytes(32)


def old() -> Swarm:
    """A node not rotated yet."""
    return Swarm("s", OLD)


def rotating() -> Swarm:
    """A node mid-rotation: the new key, and the old one as previous."""
    return Swarm("s", NEW, previous=OLD)


def finished() -> Swarm:
    """A node that finished the rotation: the new key only."""
    return Swarm("s", NEW)


@pytest.mark.parametrize("module", ["rotation", "handshake", "seal"])
def test_the_rotation_logic_is_pure(module: str) -> None:
    """Sans-IO: the memory, trial decryption and sealing import neither trio nor socket."""
    source = Path(__file__).resolve().parents[2] / "gossip" / f"{module}.py"
    imported = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            imported.add(node.module.split(".")[0])
    assert not imported & {"trio", "socket", "time"}


# --- Swarm ------------------------------------------------------------------------------


def test_rotate_and_finish() -> None:
    swarm = old()
    mid = swarm.rotate(NEW)
    assert (mid.key, mid.previous, mid.name, mid.cipher) == (NEW, OLD, "s", swarm.cipher)
    assert mid.finish_rotation() == finished()
    fresh = swarm.rotate()
    assert fresh.previous == OLD and len(fresh.key) == 32 and fresh.key != OLD
    with pytest.raises(ValueError, match="already rotating"):
        mid.rotate()


@pytest.mark.parametrize("previous, match", [
    (OLD, "is the swarm key itself"),
    (b"short", "32 bytes"),
    ("00" * 32, "32 bytes"),
])
def test_a_bad_previous_key_is_refused(previous, match) -> None:
    with pytest.raises(ValueError, match=match):
        Swarm("s", OLD, previous=previous)


def test_from_hex_takes_the_previous_key() -> None:
    swarm = Swarm.from_hex("s", NEW.hex(), previous_hex=OLD.hex() + "\n")
    assert swarm == rotating()
    with pytest.raises(ValueError, match="previous swarm key is 64 hexadecimal") as info:
        Swarm.from_hex("s", NEW.hex(), previous_hex="zz" * 32)
    assert "zz" not in str(info.value)


def test_the_previous_key_is_never_printed() -> None:
    text = repr(rotating())
    assert OLD.hex() not in text and NEW.hex() not in text
    assert "previous=<secret>" in text


def test_peer_keys_are_not_part_of_the_swarms_value() -> None:
    a, b = rotating(), rotating()
    a.peer_keys.heard("x:1", previous=False)
    assert a == b and hash(a) == hash(b)
    assert a.peer_keys is not b.peer_keys


# --- PeerKeys: the table of gossip.rotation ----------------------------------------------


def test_evidence_table() -> None:
    keys = PeerKeys()
    keys.heard("a:1", previous=False)
    keys.heard("b:1", previous=True)
    keys.dialed("c:1", previous=True, refused=True)
    keys.dialed("d:1", previous=False, refused=False)
    keys.dialed("e:1", previous=True, refused=False)
    keys.dialed("f:1", previous=False, refused=True)
    assert [keys.holds(a) for a in ("a:1", "b:1", "c:1", "d:1", "e:1", "f:1", "g:1")] == [
        Holds.CURRENT, Holds.PREVIOUS, Holds.PREVIOUS_ONLY, Holds.CURRENT, Holds.PREVIOUS,
        Holds.CURRENT, None]


@pytest.mark.parametrize("holds, seal, previous_first", [
    (Holds.CURRENT, (False,), False),
    (Holds.PREVIOUS, (False, True), True),
    (Holds.PREVIOUS_ONLY, (True,), True),
    (None, (False, True), False),
])
def test_what_each_entry_sends(holds, seal, previous_first) -> None:
    keys = PeerKeys()
    if holds is Holds.CURRENT:
        keys.heard("a:1", previous=False)
    elif holds is Holds.PREVIOUS:
        keys.heard("a:1", previous=True)
    elif holds is Holds.PREVIOUS_ONLY:
        keys.dialed("a:1", previous=True, refused=True)
    assert keys.holds("a:1") is holds
    assert keys.seal_under("a:1") == seal
    assert keys.dial_previous_first("a:1") is previous_first


def test_the_previous_key_does_not_demote_stronger_evidence() -> None:
    keys = PeerKeys()
    keys.heard("a:1", previous=False)
    keys.dialed("b:1", previous=True, refused=True)
    for _ in range(3):  # a peer mid-rotation may seal to us under both keys
        keys.heard("a:1", previous=True)
        keys.heard("b:1", previous=True)
    assert (keys.holds("a:1"), keys.holds("b:1")) == (Holds.CURRENT, Holds.PREVIOUS_ONLY)
    keys.heard("b:1", previous=False)  # it rotated: the new key proves it
    assert keys.holds("b:1") is Holds.CURRENT


def test_the_memory_is_bounded_and_forgets_the_least_recently_seen() -> None:
    keys = PeerKeys(max_addresses=4)
    for i in range(4):
        keys.heard(f"n{i}:1", previous=False)
    keys.heard("n0:1", previous=True)  # seen again: now the most recent
    keys.heard("n4:1", previous=True)
    assert len(keys) == 4
    assert keys.holds("n1:1") is None  # the least recently seen went first
    assert keys.holds("n0:1") is Holds.CURRENT
    assert keys.seal_under("n1:1") == (False, True)  # forgotten: as unknown, both keys


def test_a_flood_of_addresses_stays_within_max_addresses() -> None:
    keys = PeerKeys()
    for i in range(3 * MAX_ADDRESSES):
        keys.heard(f"10.0.{i // 256}.{i % 256}:7070", previous=i % 2 == 0)
    assert len(keys) == MAX_ADDRESSES
    assert keys.statistics().addresses == MAX_ADDRESSES


def test_statistics_count_the_previous_key() -> None:
    keys = PeerKeys()
    keys.heard("a:1", previous=True)
    keys.heard("a:1", previous=False)
    keys.dialed("b:1", previous=True, refused=True)
    keys.answered(previous=True)
    keys.answered(previous=False)
    stats = keys.statistics()
    assert (stats.addresses, stats.datagrams_previous, stats.handshakes_previous,
            stats.fallbacks) == (2, 1, 2, 1)


# --- message 1 under either key (pure) ---------------------------------------------------


def full_handshake(initiator_psk: bytes, responder: Swarm) -> bool:
    """A whole handshake, our initiator under ``initiator_psk`` against a responder of
    ``responder`` reading message 1 by trial; returns whether it used the previous key."""
    i = NoiseHandshake(initiator=True, psk=initiator_psk, static=X25519PrivateKey.generate())
    static = X25519PrivateKey.generate()
    r, previous = read_first_message(i.write_message(), responder, static)
    i.read_message(r.write_message(b"hello r"))
    assert r.read_message(i.write_message(b"hello i")) == b"hello i"
    (i_send, i_receive), (r_send, r_receive) = i.split(), r.split()
    assert r_receive.decrypt(b"", i_send.encrypt(b"", b"record")) == b"record"
    assert i_receive.decrypt(b"", r_send.encrypt(b"", b"reply")) == b"reply"
    return previous


@pytest.mark.parametrize("initiator_psk, responder, previous", [
    (NEW, rotating(), False),  # a rotated dialer
    (OLD, rotating(), True),  # a dialer not rotated yet
    (OLD, old(), False),  # no rotation: as ever
    (NEW, finished(), False),
])
def test_the_responder_reads_message_1_under_either_key(initiator_psk, responder,
                                                        previous) -> None:
    assert full_handshake(initiator_psk, responder) is previous


@pytest.mark.parametrize("responder", [rotating(), old(), finished()])
def test_message_1_under_neither_key_fails_as_a_wrong_key_does(responder) -> None:
    i = NoiseHandshake(initiator=True, psk=OTHER, static=X25519PrivateKey.generate())
    with pytest.raises(HandshakeError, match="wrong swarm key or cipher"):
        read_first_message(i.write_message(), responder, X25519PrivateKey.generate())


def test_a_previous_key_holder_is_refused_after_the_rotation() -> None:
    i = NoiseHandshake(initiator=True, psk=OLD, static=X25519PrivateKey.generate())
    with pytest.raises(HandshakeError):
        read_first_message(i.write_message(), finished(), X25519PrivateKey.generate())


@pytest.mark.parametrize("psk", [NEW, OLD])
def test_a_payload_in_message_1_is_refused_under_either_key(psk) -> None:
    i = NoiseHandshake(initiator=True, psk=psk, static=X25519PrivateKey.generate())
    with pytest.raises(HandshakeError, match="unexpected payload"):
        read_first_message(i.write_message(b"x"), rotating(), X25519PrivateKey.generate())


# --- sealed datagrams -------------------------------------------------------------------


def test_a_rotating_node_opens_datagrams_under_either_key() -> None:
    swarm = rotating()
    sealer = Sealer(swarm)
    assert sealer.open(Sealer(old()).seal(b"from the past"), "o:1") == b"from the past"
    assert sealer.open(Sealer(finished()).seal(b"from the future"), "f:1") == b"from the future"
    assert swarm.peer_keys.holds("o:1") is Holds.PREVIOUS
    assert swarm.peer_keys.holds("f:1") is Holds.CURRENT
    with pytest.raises(WireError, match="both the swarm key and the previous one"):
        sealer.open(Sealer(Swarm("s", OTHER)).seal(b"stranger"), "x:1")
    assert swarm.peer_keys.holds("x:1") is None  # what fails to open leaves no trace


def test_what_a_rotating_node_seals_reaches_every_kind_of_peer() -> None:
    swarm = rotating()
    sealer = Sealer(swarm)
    datagrams = sealer.seal_for(b"ping", "unknown:1")
    assert len(datagrams) == 2
    for receiver in (old(), rotating(), finished()):  # each opens one of the two
        opened = []
        for d in datagrams:
            try:
                opened.append(Sealer(receiver).open(d))
            except WireError:
                pass
        assert b"ping" in opened
    swarm.peer_keys.heard("new:1", previous=False)
    (only,) = sealer.seal_for(b"ping", "new:1")
    assert Sealer(finished()).open(only) == b"ping"
    swarm.peer_keys.dialed("old:1", previous=True, refused=True)
    (only,) = sealer.seal_for(b"ping", "old:1")
    assert Sealer(old()).open(only) == b"ping"


def test_without_a_previous_key_nothing_changes() -> None:
    swarm = old()
    sealer = Sealer(swarm)
    (datagram,) = sealer.seal_for(b"ping", "a:1")
    assert sealer.open(datagram, "a:1") == b"ping"
    assert len(swarm.peer_keys) == 0  # nothing remembered outside a rotation
    with pytest.raises(WireError, match="wrong swarm key or forged"):
        sealer.open(Sealer(finished()).seal(b"x"), "b:1")


# --- channels: the dialer's fallback and its memory -------------------------------------


async def test_handshake_under_the_previous_key_over_a_stream() -> None:
    s1, s2 = trio.testing.memory_stream_pair()
    result = {}

    async def run(name, stream, ident, swarm, initiator, previous):
        result[name] = await handshake(stream, identity=ident, swarm=swarm,
                                       initiator=initiator, previous=previous)

    responder = rotating()
    async with trio.open_nursery() as n:
        n.start_soon(run, "a", s1, ALICE, rotating(), True, True)
        n.start_soon(run, "b", s2, BOB, responder, False, False)
    await result["a"].send(b"over the old key")
    assert await result["b"].receive() == b"over the old key"
    assert responder.peer_keys.statistics().handshakes_previous == 1


async def test_initiating_under_a_previous_key_the_swarm_lacks_is_a_local_error() -> None:
    s1, _ = trio.testing.memory_stream_pair()
    with pytest.raises(LocalProtocolError):
        await handshake(s1, identity=ALICE, swarm=old(), initiator=True, previous=True)


async def serving(nursery: trio.Nursery, net: SimNetwork, host: str, swarm: Swarm) -> str:
    async def handler(channel) -> None:
        await channel.send(b"hi")

    return await nursery.start(functools.partial(serve, net.host(host), f"{host}:7070", handler,
                                                 identity=Identity.generate(), swarm=swarm))


class CountingDials:
    """The client's network, counting its dials."""

    def __init__(self, net: SimNetwork, host: str) -> None:
        self._host = net.host(host)
        self.dials = 0

    async def dial(self, address: str):
        self.dials += 1
        return await self._host.dial(address)


@pytest.mark.parametrize("dialer, server, dials, holds", [
    (rotating, old, 2, Holds.PREVIOUS_ONLY),  # refused under the new key, then the old
    (rotating, rotating, 1, Holds.CURRENT),
    (rotating, finished, 1, Holds.CURRENT),
    (old, rotating, 1, None),  # an old node dials as ever; the responder tries both
    (finished, rotating, 1, None),
])
async def test_connect_reaches_every_kind_of_peer(autojump_clock, dialer, server, dials,
                                                  holds) -> None:
    net = SimNetwork(seed=1)
    client = dialer()
    network = CountingDials(net, "c")
    async with trio.open_nursery() as n:
        address = await serving(n, net, "s", server())
        async with await connect(network, address, identity=ALICE, swarm=client) as channel:
            assert await channel.receive() == b"hi"
        assert network.dials == dials
        assert client.peer_keys.holds(address) is holds
        # The next dial goes straight to the key that worked.
        async with await connect(network, address, identity=ALICE, swarm=client) as channel:
            assert await channel.receive() == b"hi"
        assert network.dials == dials + 1
        n.cancel_scope.cancel()


async def test_a_stale_hint_costs_one_dial(autojump_clock) -> None:
    # We heard the peer under the previous key, but it has since finished the rotation.
    net = SimNetwork(seed=1)
    client = rotating()
    network = CountingDials(net, "c")
    async with trio.open_nursery() as n:
        address = await serving(n, net, "s", finished())
        client.peer_keys.heard(address, previous=True)
        async with await connect(network, address, identity=ALICE, swarm=client) as channel:
            assert await channel.receive() == b"hi"
        assert network.dials == 2
        assert client.peer_keys.holds(address) is Holds.CURRENT
        n.cancel_scope.cancel()


async def test_a_peer_with_neither_key_is_refused_after_two_dials(autojump_clock) -> None:
    net = SimNetwork(seed=1)
    client = rotating()
    network = CountingDials(net, "c")
    async with trio.open_nursery() as n:
        address = await serving(n, net, "s", Swarm("s", OTHER))
        with pytest.raises(HandshakeClosed):
            await connect(network, address, identity=ALICE, swarm=client)
        assert network.dials == 2
        assert client.peer_keys.holds(address) is None
        n.cancel_scope.cancel()


async def test_an_old_node_cannot_reach_a_finished_one(autojump_clock) -> None:
    net = SimNetwork(seed=1)
    async with trio.open_nursery() as n:
        address = await serving(n, net, "s", finished())
        with pytest.raises(HandshakeClosed):
            await connect(net.host("c"), address, identity=ALICE, swarm=old())
        n.cancel_scope.cancel()
