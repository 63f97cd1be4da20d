"""State transfer over a secure channel: header checks happen before any tensor byte."""

import pytest
import torch
import trio
import trio.testing

from gossip import lowbit, tensors
from gossip.errors import ChannelClosed, PeerGone, RemoteProtocolError, SchemaMismatch
from gossip.messages import Close, StateHeader, StateRequest
from gossip.transfer import receive_state, send_state
from tests.util import pair


def model(seed=0, width=64):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(300, width), torch.nn.BatchNorm1d(width),
                               torch.nn.Linear(width, 6000))


@pytest.mark.parametrize("codec", tensors.CODECS)
async def test_full_duplex_exchange(codec):
    alice, bob, _ = await pair()
    ma, mb = model(1), model(2)
    schema = tensors.StateSchema.from_module(ma)
    assert schema.encoded_size("fp32") > 1 << 20  # several records
    sa, sb = tensors.snapshot(ma, schema), tensors.snapshot(mb, schema)
    got = {}

    async def side(name, ch, mine):
        async with trio.open_nursery() as n:
            n.start_soon(send_state, ch, mine, schema, codec)
            got[name] = await receive_state(ch, schema, codec)

    async with trio.open_nursery() as n:
        n.start_soon(side, "a", alice, sa)
        n.start_soon(side, "b", bob, sb)
    header, state = got["a"]
    assert header.fingerprint == schema.fingerprint and header.nbytes == schema.encoded_size(codec)
    tol = 0 if codec == "fp32" else 1e-2
    assert torch.allclose(state, sb, atol=tol, rtol=tol)
    assert torch.allclose(got["b"][1], sa, atol=tol, rtol=tol)


async def test_int8_payload_of_two_vectors_blocks_each_on_its_own():
    alice, bob, _ = await pair()
    schema = tensors.StateSchema.from_module(model())
    state = tensors.snapshot(model(3), schema)
    estimate = torch.randn(schema.numel) * 1e-3  # a drift correction: far smaller values
    flat = torch.cat([state, estimate])
    async with trio.open_nursery() as n:
        n.start_soon(send_state, alice, flat, schema, "int8")
        header, got = await receive_state(bob, schema, "int8", parts=2)
    assert header.nbytes == tensors.encoded_nbytes("int8", schema.numel, 2)
    assert header.nbytes == 2 * schema.encoded_size("int8") < 0.55 * schema.encoded_size("fp32")
    # Rounded stochastically, as an exchange sends: within a whole scale of each block.
    assert torch.allclose(got[: schema.numel], state, atol=2e-3, rtol=0)
    assert torch.allclose(got[schema.numel :], estimate, atol=4e-5, rtol=0)


@pytest.mark.parametrize("codec", tensors.CODECS)
async def test_on_decoded_follows_the_final_prefix_record_by_record(codec):
    alice, bob, _ = await pair()
    schema = tensors.StateSchema.from_module(model())
    flat = torch.cat([tensors.snapshot(model(4), schema), torch.randn(schema.numel)])
    out = torch.full_like(flat, float("nan"))
    seen = []

    def on_decoded(n):  # everything before n is final: a copy now must equal the end result
        seen.append((n, out[:n].clone()))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_state, alice, flat, schema, codec)
        _, got = await receive_state(bob, schema, codec, out, parts=2, on_decoded=on_decoded)
    assert len(seen) >= 2 and seen[-1][0] == 2 * schema.numel
    assert [n for n, _ in seen] == sorted({n for n, _ in seen})  # one call per record, growing
    for n, prefix in seen:
        torch.testing.assert_close(prefix, got[:n], rtol=0, atol=0)


async def test_send_state_wants_whole_vectors_of_the_schema():
    alice, _, _ = await pair()
    schema = tensors.StateSchema.from_module(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="whole vectors"):
        await send_state(alice, torch.zeros(schema.numel + 1), schema, "int8")
    await alice.send_message(Close(Close.NORMAL, "nothing was sent"))  # the channel is intact


async def test_other_schema_is_refused_before_reading_tensors():
    alice, bob, _ = await pair()
    mine, theirs = model(width=64), model(width=65)
    s_mine, s_theirs = (tensors.StateSchema.from_module(m) for m in (mine, theirs))
    async with trio.open_nursery() as n:
        n.start_soon(send_state, alice, tensors.snapshot(theirs, s_theirs), s_theirs, "fp32")
        with pytest.raises(SchemaMismatch, match="schema"):
            await receive_state(bob, s_mine, "fp32")
        n.cancel_scope.cancel()
    assert bob.statistics().records_received == 1  # only the header was read


@pytest.mark.parametrize(
    "message, error, match",
    [
        (Close(Close.BUSY, "in another exchange"), PeerGone, "in another exchange"),
        (StateRequest(bytes(16), "fp32"), RemoteProtocolError, "expected StateHeader"),
    ],
)
async def test_unexpected_messages(message, error, match):
    alice, bob, _ = await pair()
    schema = tensors.StateSchema.from_module(model())
    await alice.send_message(message)
    with pytest.raises(error, match=match):
        await receive_state(bob, schema, "fp32")


@pytest.mark.parametrize("codec, nbytes_delta", [("bf16", 0), ("fp32", 4), ("fp32", -4), ("int8", 0)])
async def test_header_must_announce_exactly_our_size(codec, nbytes_delta):
    alice, bob, _ = await pair()
    schema = tensors.StateSchema.from_module(model())
    nbytes = schema.encoded_size("fp32" if codec == "int8" else codec) + nbytes_delta
    await alice.send_message(StateHeader(schema.fingerprint, codec, 0, 0, nbytes))
    with pytest.raises(SchemaMismatch, match="announced"):
        await receive_state(bob, schema, "fp32")
    with pytest.raises(ChannelClosed):  # state records may follow: the channel is done
        await bob.receive()


@pytest.mark.parametrize(
    "codec, error, match",
    [
        ("fp32", RemoteProtocolError, "at most 80 were expected"),  # decrypted in place
        ("bf16", RemoteProtocolError, "at most 40 were expected"),  # into the scratch record
        ("int8", RemoteProtocolError, "at most 24 were expected"),  # one short block of 20
    ],
)
async def test_oversized_record_in_the_payload_is_refused(codec, error, match):
    alice, bob, _ = await pair()
    schema = tensors.StateSchema.from_module(torch.nn.Linear(4, 4))
    nbytes = schema.encoded_size(codec)
    await alice.send_message(StateHeader(schema.fingerprint, codec, 0, 0, nbytes))
    await alice.send(bytes(nbytes + 4))
    with pytest.raises(error, match=match):
        await receive_state(bob, schema, codec)


async def test_empty_records_cannot_stall_a_payload():
    alice, bob, _ = await pair()
    schema = tensors.StateSchema.from_module(torch.nn.Linear(4, 4))
    await alice.send_message(StateHeader(schema.fingerprint, "fp32", 0, 0, schema.encoded_size("fp32")))
    await alice.send(b"")
    with pytest.raises(SchemaMismatch, match="empty record"):
        await receive_state(bob, schema, "fp32")


async def test_a_cancelled_receive_closes_the_channel(autojump_clock):
    alice, bob, _ = await pair()
    schema = tensors.StateSchema.from_module(model())
    header = StateHeader(schema.fingerprint, "fp32", 0, 0, schema.encoded_size("fp32"))
    await alice.send_message(header)
    await alice.send(bytes(lowbit.MIN_RECORD))  # a first record, then the rest is late
    with trio.move_on_after(5):  # the caller's deadline for the exchange
        await receive_state(bob, schema, "fp32")
    # The rest of the state may still arrive; it must never be read as a message.
    with pytest.raises(ChannelClosed):
        await bob.receive_message()


async def test_a_cancelled_send_closes_the_channel(autojump_clock):
    alice, bob, _ = await pair(make=trio.testing.lockstep_stream_pair)
    m = model()
    schema = tensors.StateSchema.from_module(m)
    with trio.move_on_after(5):  # nobody reads: the send stalls, then the deadline hits
        await send_state(alice, tensors.snapshot(m, schema), schema, "fp32")
    with pytest.raises(ChannelClosed):
        await alice.send_message(Close(Close.NORMAL, "would land inside the peer's tensors"))
