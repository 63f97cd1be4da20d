"""The secure channel over in-memory streams: the happy path and every failure of the spec.

An attacker here is a test that holds one end of the raw stream and writes whatever bytes it
likes; ``Tap`` lets a test capture an honest side's records and forward them altered.
"""

import functools
import tracemalloc

import pytest
import trio
import trio.testing
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from gossip.channel import MAX_RECORD, SecureChannel
from gossip.endpoints import connect, handshake, serve
from gossip.config import Timeouts
from gossip.errors import (
    ChannelClosed,
    HandshakeError,
    LocalProtocolError,
    PeerGone,
    PeerTimeout,
    RemoteProtocolError,
)
from gossip.handshake import SIGNATURE_PREFIX, NoiseHandshake, Swarm, x25519_public_bytes
from gossip.identity import Identity
from gossip.messages import Close, Hello
from gossip.network import TcpNetwork
from gossip.testing.simnet import SimNetwork
from gossip.wire import FRAME_HEADER, encode, encode_frame

from tests.util import ALICE, BOB, SWARM, BaseExceptionGroup, Tap, pair


async def both(fa, fb):
    """Run two coroutine functions concurrently; return their results or exceptions."""
    out = {}

    async def run(key, fn):
        try:
            out[key] = await fn()
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            out[key] = exc

    async with trio.open_nursery() as n:
        n.start_soon(run, "a", fa)
        n.start_soon(run, "b", fb)
    return out["a"], out["b"]


async def test_handshake_authenticates_both_sides_and_carries_records():
    alice, bob, _ = await pair()
    assert alice.peer == BOB.peer_id and bob.peer == ALICE.peer_id
    big = bytes(range(256)) * (MAX_RECORD // 256)
    async with trio.open_nursery() as n:
        n.start_soon(alice.send, big)
        assert await bob.receive() == big
    async with trio.open_nursery() as n:
        n.start_soon(bob.send_message, Close(Close.NORMAL, "bye"))
        assert await alice.receive_message() == Close(Close.NORMAL, "bye")
    assert alice.statistics().records_sent == 1 and bob.statistics().records_received == 1
    assert alice.statistics().bytes_sent == 4 + len(big) + 16


async def test_empty_record_and_record_limit():
    alice, bob, _ = await pair()
    async with trio.open_nursery() as n:
        n.start_soon(alice.send, b"")
        assert await bob.receive() == b""
    with pytest.raises(LocalProtocolError, match="exceeds MAX_RECORD"):
        await alice.send(bytes(MAX_RECORD + 1))


async def test_wrong_swarm_key_fails_at_message_one_and_reveals_nothing():
    s1, s2 = trio.testing.memory_stream_pair()
    outsider = NoiseHandshake(initiator=True, psk=bytes(32), static=X25519PrivateKey.generate())
    message1 = outsider.write_message()
    await s1.send_all(encode_frame(message1))
    with pytest.raises(HandshakeError, match="wrong swarm key"):
        await handshake(s2, identity=BOB, swarm=SWARM, initiator=False)
    assert await s1.receive_some() == b""  # closed without sending a single byte


async def test_wrong_swarm_key_between_two_nodes():
    other = Swarm("test", bytes(32))
    with pytest.raises(BaseExceptionGroup) as info:
        await pair(swarm_b=other)
    kinds = {type(e) for e in info.value.exceptions}
    assert HandshakeError in kinds  # the responder saw the bad key; the initiator saw it leave


async def test_swarm_name_mismatch():
    with pytest.raises(BaseExceptionGroup) as info:
        await pair(swarm_b=Swarm("other", SWARM.key))
    assert any("swarm mismatch" in str(e) for e in info.value.exceptions)


async def test_allow_list_refuses_before_revealing_identity():
    s1, s2 = trio.testing.memory_stream_pair()
    a, b = await both(
        lambda: handshake(s1, identity=ALICE, swarm=SWARM, initiator=True,
                          allow=frozenset({Identity.generate().peer_id})),
        lambda: handshake(s2, identity=BOB, swarm=SWARM, initiator=False),
    )
    assert isinstance(a, HandshakeError) and "allow-list" in str(a)
    assert isinstance(b, PeerGone)  # Alice closed before message 3: Bob never learned who she is


async def test_allow_list_on_the_responder():
    s1, s2 = trio.testing.memory_stream_pair()
    a, b = await both(
        lambda: handshake(s1, identity=ALICE, swarm=SWARM, initiator=True),
        lambda: handshake(s2, identity=BOB, swarm=SWARM, initiator=False,
                          allow=frozenset({BOB.peer_id})),
    )
    assert isinstance(b, HandshakeError) and "allow-list" in str(b)
    assert isinstance(a, SecureChannel)  # completes its side; its first receive will see the close
    with pytest.raises(PeerGone):
        await a.receive()


async def forged_responder(stream, *, hello_for):
    """A responder holding the swarm key that sends the Hello built by ``hello_for``."""
    static = X25519PrivateKey.generate()
    hs = NoiseHandshake(initiator=False, psk=SWARM.key, static=static)
    header = await stream.receive_some(4)
    hs.read_message(await stream.receive_some(FRAME_HEADER.unpack(header)[0]))
    message2 = hs.write_message(encode(hello_for(x25519_public_bytes(static))))
    await stream.send_all(encode_frame(message2))


@pytest.mark.parametrize(
    "forge, match",
    [
        (lambda s: Hello(1, "test", BOB.public_key, BOB.sign(b"wrong prefix:" + s)), "signature"),
        (lambda s: Hello(1, "test", BOB.public_key, ALICE.sign(SIGNATURE_PREFIX + s)), "signature"),
        (lambda s: Hello(1, "test", BOB.public_key, BOB.sign(SIGNATURE_PREFIX + bytes(32))), "signature"),
        (lambda s: Hello(7, "test", BOB.public_key, BOB.sign(SIGNATURE_PREFIX + s)), "version mismatch"),
    ],
    ids=["wrong-prefix", "signed-by-another-key", "other-static-key", "version"],
)
async def test_bad_identity_binding_or_version(forge, match):
    s1, s2 = trio.testing.memory_stream_pair()
    a, _ = await both(
        lambda: handshake(s1, identity=ALICE, swarm=SWARM, initiator=True),
        lambda: forged_responder(s2, hello_for=forge),
    )
    assert isinstance(a, HandshakeError) and match in str(a)


async def capture(channel_tap: Tap, send, n=1):
    channel_tap.captured = []
    for _ in range(n):
        await send()
    records, channel_tap.captured = channel_tap.captured, None
    return records


async def assert_broken(bob, error, match, tap=None):
    """The receive fails with ``error``; later calls fail too, blaming the same party, and
    nothing is ever delivered; the transport underneath is closed."""
    with pytest.raises(error, match=match):
        await bob.receive()
    again = error if issubclass(error, RemoteProtocolError) else PeerGone
    with pytest.raises(again, match="earlier error"):
        await bob.receive()
    if tap is not None:  # Bob's end is closed: Alice's side of the stream reads the end
        assert await tap.inner.receive_some() == b""


@pytest.mark.parametrize("where", [0, 3, 4, 10, -1])
async def test_tampered_record(where):
    alice, bob, tap = await pair()
    [record] = await capture(tap, lambda: alice.send(b"attack at dawn"))
    forged = bytearray(record)
    forged[where] ^= 0x01
    await tap.inner.send_all(bytes(forged))
    await tap.inner.aclose()
    # A changed length makes the record either cut short or fail its tag; any other change
    # fails the tag.
    await assert_broken(bob, RemoteProtocolError, "failed authentication|truncated|exceeds")


async def test_replayed_record():
    alice, bob, tap = await pair()
    [record] = await capture(tap, lambda: alice.send(b"pay 10"))
    await tap.inner.send_all(record)
    assert await bob.receive() == b"pay 10"
    await tap.inner.send_all(record)
    await assert_broken(bob, RemoteProtocolError, "failed authentication", tap)


async def test_reordered_records():
    alice, bob, tap = await pair()
    first, second = await capture(tap, lambda: alice.send(b"x"), n=2)
    await tap.inner.send_all(second + first)
    await assert_broken(bob, RemoteProtocolError, "failed authentication", tap)


@pytest.mark.parametrize("keep", [2, 4, 10])
async def test_truncated_record(keep):
    alice, bob, tap = await pair()
    [record] = await capture(tap, lambda: alice.send(b"y" * 100))
    await tap.inner.send_all(record[:keep])
    await tap.inner.aclose()
    await assert_broken(bob, RemoteProtocolError, "closed inside a record")


async def test_clean_close_between_records_is_peer_gone():
    alice, bob, _ = await pair()
    await alice.aclose()
    await assert_broken(bob, PeerGone, "closed the connection")
    with pytest.raises(ChannelClosed):
        await alice.send(b"late")


async def test_oversized_length_is_refused_before_allocating():
    alice, bob, tap = await pair()
    tracemalloc.start()
    try:
        await tap.inner.send_all(b"\xff\xff\xff\xff" + bytes(1000))
        with pytest.raises(RemoteProtocolError, match="exceeds the limit"):
            await bob.receive()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024  # refused from the header: no record-sized buffer was allocated
    with pytest.raises(RemoteProtocolError, match="earlier error"):
        await bob.receive()


async def test_record_shorter_than_tag():
    alice, bob, tap = await pair()
    await tap.inner.send_all(FRAME_HEADER.pack(15) + bytes(15))
    await assert_broken(bob, RemoteProtocolError, "shorter than its tag", tap)


async def test_stalled_record_times_out(autojump_clock):
    alice, bob, tap = await pair(record_timeout=5.0)
    [record] = await capture(tap, lambda: alice.send(b"z" * 1000))
    await tap.inner.send_all(record[:500])  # then nothing: a slowloris
    start = trio.current_time()
    await assert_broken(bob, PeerTimeout, "record", tap)
    assert trio.current_time() - start == pytest.approx(5.0)


async def test_a_stalled_header_is_under_the_record_deadline(autojump_clock):
    alice, bob, tap = await pair(record_timeout=5.0)
    await tap.inner.send_all(b"\x00\x00")  # half a length header, then nothing
    with pytest.raises(PeerTimeout, match="record"):
        await bob.receive()


async def test_cancelled_inside_a_header_breaks_the_channel(autojump_clock):
    alice, bob, tap = await pair()
    [record] = await capture(tap, lambda: alice.send(b"hello"))
    await tap.inner.send_all(record[:2])
    with trio.move_on_after(1):  # the caller's deadline, shorter than the record deadline
        await bob.receive()
    # The two bytes already read are gone: the channel refuses to go on rather than read
    # the rest out of step and blame the peer.
    with pytest.raises(ChannelClosed, match="interrupted mid-record"):
        await bob.receive()


async def test_waiting_for_the_next_record_has_no_built_in_deadline(autojump_clock):
    alice, bob, tap = await pair(record_timeout=5.0)
    with trio.move_on_after(3600) as scope:  # an idle channel is the caller's business
        await bob.receive()
    assert scope.cancelled_caught
    async with trio.open_nursery() as n:
        n.start_soon(alice.send, b"still here")
        assert await bob.receive() == b"still here"


async def test_concurrent_senders_are_refused():
    alice, bob, tap = await pair(make=trio.testing.lockstep_stream_pair)
    async with trio.open_nursery() as n:
        n.start_soon(alice.send, bytes(MAX_RECORD))  # blocks: nobody reads
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(LocalProtocolError, match="already sending"):
            await alice.send(b"second")
        n.cancel_scope.cancel()
    # Cancelled mid-record: the stream can never carry another record.
    with pytest.raises(ChannelClosed):
        await alice.send(b"after")




@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=2000))
def test_random_bytes_after_handshake_raise_only_typed_errors(data):
    async def main():
        alice, bob, tap = await pair()
        await tap.inner.send_all(data)
        await tap.inner.aclose()
        with pytest.raises((RemoteProtocolError, PeerGone)):
            await bob.receive()
    trio.run(main)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_as_a_handshake_raise_only_typed_errors(data):
    async def main():
        s1, s2 = trio.testing.memory_stream_pair()
        await s1.send_all(data)
        await s1.aclose()
        with pytest.raises((HandshakeError, PeerGone)):
            await handshake(s2, identity=BOB, swarm=SWARM, initiator=False)
    trio.run(main)


class SilentNetwork:
    """A network whose dials connect to a peer that never says a word."""

    def __init__(self):
        self.held = []

    async def dial(self, address):
        s1, s2 = trio.testing.memory_stream_pair()
        self.held.append(s2)
        return s1

    async def serve(self, address, handler, *, task_status=trio.TASK_STATUS_IGNORED):
        task_status.started(address)
        s1, s2 = trio.testing.memory_stream_pair()
        self.held.append(s1)
        await handler(s2)


async def test_connect_times_out_in_the_handshake(autojump_clock):
    start = trio.current_time()
    with pytest.raises(PeerTimeout, match="handshake"):
        await connect(SilentNetwork(), "x:1", identity=ALICE, swarm=SWARM,
                      timeouts=Timeouts(handshake=3.0))
    assert trio.current_time() - start == pytest.approx(3.0)


async def test_serve_times_out_a_silent_client(autojump_clock):
    async def handler(channel):
        raise AssertionError("no channel should be handed out")

    start = trio.current_time()
    with pytest.raises(PeerTimeout, match="handshake"):
        await serve(SilentNetwork(), "x:1", handler, identity=BOB, swarm=SWARM,
                    timeouts=Timeouts(handshake=2.0))
    assert trio.current_time() - start == pytest.approx(2.0)


async def exchange_over(net_server, net_client, address):
    """connect/serve over a real network implementation; a few MB each way."""
    payload = bytes(range(256)) * 12_000  # ~3 MB: several full records and a partial one
    got = {}

    async def handler(channel):
        data = bytearray()
        while len(data) < len(payload):
            data += await channel.receive()
        got["server"] = (channel.peer, bytes(data))
        await channel.send(b"done")

    async with trio.open_nursery() as n:
        bound = await n.start(functools.partial(serve, net_server, address, handler,
                                                identity=BOB, swarm=SWARM))
        channel = await connect(net_client, bound, identity=ALICE, swarm=SWARM)
        async with channel:
            assert channel.peer == BOB.peer_id
            for offset in range(0, len(payload), MAX_RECORD):
                await channel.send(payload[offset : offset + MAX_RECORD])
            assert await channel.receive() == b"done"
        n.cancel_scope.cancel()
    assert got["server"] == (ALICE.peer_id, payload)


async def test_channel_over_tcp():
    await exchange_over(TcpNetwork(), TcpNetwork(), "127.0.0.1:0")


async def test_channel_over_the_simulated_network(autojump_clock):
    net = SimNetwork(seed=3, latency=0.02, bandwidth=10e6, loss=0.05)
    await exchange_over(net.host("b"), net.host("a"), "b:0")


async def test_receive_into_decrypts_in_place_and_bounds_the_record():
    alice, bob, _ = await pair()
    buf = bytearray(10)
    async with trio.open_nursery() as n:
        n.start_soon(alice.send, b"0123456789")
        assert await bob.receive_into(buf) == 10 and buf == b"0123456789"
    with pytest.raises(ValueError, match="writable"):
        await bob.receive_into(b"read-only")
    async with trio.open_nursery() as n:
        n.start_soon(alice.send, b"eleven byte")
        with pytest.raises(RemoteProtocolError, match="at most 10 were expected"):
            await bob.receive_into(buf)
    with pytest.raises(RemoteProtocolError, match="earlier error"):
        await bob.receive()


async def test_a_stalled_peer_does_not_take_the_server_down(autojump_clock):
    """A handler's own deadline ends that connection only; the server keeps serving."""
    net = SimNetwork(seed=1)
    served = []

    async def handler(channel):
        with trio.fail_after(5):  # the phase deadline every handler puts on its reads
            served.append(await channel.receive())
        await channel.send(b"ok")

    async with trio.open_nursery() as n:
        address = await n.start(functools.partial(serve, net.host("b"), "b:7070", handler,
                                                  identity=BOB, swarm=SWARM))
        silent = await connect(net.host("a"), address, identity=ALICE, swarm=SWARM)
        with pytest.raises(PeerGone):  # the server gave up on us after its 5 s deadline
            await silent.receive()
        polite = await connect(net.host("c"), address, identity=ALICE, swarm=SWARM)
        await polite.send(b"hello")
        assert await polite.receive() == b"ok"
        n.cancel_scope.cancel()
    assert served == [b"hello"]


async def test_version_mismatch_seen_by_the_responder():
    s1, s2 = trio.testing.memory_stream_pair()
    static = X25519PrivateKey.generate()
    hs = NoiseHandshake(initiator=True, psk=SWARM.key, static=static)

    async def old_initiator():
        m1 = hs.write_message()
        await s1.send_all(encode_frame(m1))
        header = await s1.receive_some(4)
        hs.read_message(await s1.receive_some(FRAME_HEADER.unpack(header)[0]))
        hello = Hello(9, "test", ALICE.public_key, ALICE.sign(SIGNATURE_PREFIX + x25519_public_bytes(static)))
        m3 = hs.write_message(encode(hello))
        await s1.send_all(encode_frame(m3))

    _, b = await both(old_initiator, lambda: handshake(s2, identity=BOB, swarm=SWARM, initiator=False))
    assert isinstance(b, HandshakeError) and "version mismatch" in str(b)


async def test_oversized_handshake_frame_is_refused_before_reading_it():
    s1, s2 = trio.testing.memory_stream_pair()
    await s1.send_all(FRAME_HEADER.pack(65536))  # one past Noise's limit, and no body
    with pytest.raises(HandshakeError, match="exceeds the limit of 65535"):
        await handshake(s2, identity=BOB, swarm=SWARM, initiator=False)
    assert await s1.receive_some() == b""  # closed
