"""The wire codec: round trips, strictness, and fuzzing with random and mutated bytes."""

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gossip import messages as m
from gossip.errors import WireError
from gossip.wire import MAX_MESSAGE, decode, encode, encode_frame, frame_length
from tests.util import mutate

FP = bytes(range(16))
PEER = "a" * 26
OTHER = "b2" * 13
PROOF = dict(key=b"k" * 32, signature=b"s" * 64)  # the wire checks sizes; gossip.claims the rest
K, S = PROOF["key"], PROOF["signature"]

EXAMPLES = [
    m.Hello(version=1, swarm="demo", identity_key=b"k" * 32, signature=b"s" * 64),
    m.Close(code=m.Close.BUSY, reason="busy"),
    m.StateRequest(fingerprint=FP, codec="bf16"),
    m.StateHeader(fingerprint=FP, codec="fp32", step=2**40, samples=0, nbytes=100_000_000),
    m.Packet(sender=PEER, parts=(b"\x82\x08\x05", b"")),
    m.Ping(seq=7, target=PEER),
    m.PingReq(seq=2**32 - 1, target=PEER, address="10.0.0.2:7070"),
    m.Ack(seq=0),
    m.Nack(seq=1),
    m.Alive(peer=PEER, incarnation=3, address="[::1]:7070", version=1, step=10, ready=True,
            shard=3, shards=8, **PROOF),
    m.Suspect(peer=PEER, incarnation=3, by=OTHER),
    m.Dead(peer=PEER, incarnation=4, by=OTHER),
    m.Left(peer=PEER, incarnation=5, **PROOF),
    m.MemberState(peer=PEER, incarnation=1, state=m.MemberState.DEAD, address="a:1", version=1,
                  step=0, ready=False, reachable=False, **PROOF),
    m.PushPull(join=True, last=False, records=(b"x" * 100,)),
    m.Offer(fingerprint=FP, codec="fp32", step=12, samples=768, weight=0.0, correction=True),
    m.Accept(step=13, samples=2**50, weight=1234.5, correction=False),
    m.Commit(),
    m.Commit(correction=0.375),
    m.StateInfo(step=7, samples=0, weight=1.0, meta=b"\xa0"),
    m.SchemaInfo(count=3, entries=(("fc.weight", (4, 8), "float32"), ("fc.bias", (4,), "float32")),
                 meta=b""),
    m.DialBack(nonce=bytes(range(16))),
]


def test_every_tagged_message_has_an_example():
    assert {type(x) for x in EXAMPLES} == set(m.TAGS.values())


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda x: type(x).__name__)
def test_round_trip(message):
    data = encode(message)
    assert decode(data) == message
    assert cbor2.loads(data)[0] == message.TAG
    assert encode(decode(data)) == data  # one canonical encoding


@pytest.mark.parametrize(
    "obj, match",
    [
        ([99, 1], "unknown message tag 99"),
        (["x", 1], "unknown message tag"),
        ([], "non-empty CBOR array"),
        ({"tag": 2}, "non-empty CBOR array"),
        ([2, 0], "Close: expected 2 fields, got 1"),
        ([2, 0, "ok", 3], "Close: expected 2 fields, got 3"),
        ([2, -1, "ok"], "Close.code"),
        ([2, True, "ok"], "Close.code: expected an unsigned integer, got bool"),
        ([2, 2**16, "ok"], "Close.code"),
        ([2, 0, "x" * 257], "Close.reason"),
        ([2, 0, b"bytes"], "Close.reason: expected text"),
        ([3, FP[:15], "fp32"], "StateRequest.fingerprint: expected 16 bytes"),
        ([3, FP, "x" * 300], "StateRequest.codec"),
        ([4, FP, "fp32", 0, 0, 2**63], "StateHeader.nbytes"),
        ([4, FP, "fp32", 0, 1.5, 0], "StateHeader.samples"),
        ([1, 1, "s", b"k" * 31, b"s" * 64], "Hello.identity_key"),
        ([6, 1, "A" * 26], "Ping.target"),  # peer ids are lowercase
        ([6, 2**32, "a" * 26], "Ping.seq"),
        ([10, "a" * 26, 0, "a:1", 1, 0, 1, 0, 0, True, K, S], "Alive.ready"),  # 1 is not a boolean
        ([14, "a" * 26, 0, 4, "a:1", 1, 0, False, 0, 0, True, K, S], "MemberState.state"),
        ([10, "a" * 26, 0, "a:1", 1, 0, True], "Alive: expected 11 fields, got 6"),  # no shard
        ([10, "a" * 26, 0, "a:1", 1, 0, True, 8, 8, True, K, S], "Alive.shard: 8 out of range 0..7"),
        ([10, "a" * 26, 0, "a:1", 1, 0, True, 1, 0, True, K, S], "Alive.shard: 1 out of range 0..0"),
        ([10, "a" * 26, 0, "a:1", 1, 0, True, 0, 2**16, True, K, S], "Alive.shards"),
        ([10, "a" * 26, 0, "a:1", 1, 0, True, -1, 8, True, K, S], "Alive.shard"),
        ([14, "a" * 26, 0, 0, "a:1", 1, 0, False, 2, 2, True, K, S], "MemberState.shard: 2 out of range"),
        ([14, "a" * 26, 0, 0, "a:1", 1, 0, False, 0, True, True, K, S], "MemberState.shards: expected an"),
        ([5, "a" * 26, [b""] * 65], "Packet.parts"),
        ([5, "a" * 26, ["text"]], "Packet.parts"),
        ([5, "a" * 26, [b"x" * 1401]], "Packet.parts"),
        ([15, False, True, [b""] * 257], "PushPull.records"),
        ([10, "a" * 26, 0, "not an address", 1, 0, True, 0, 0, True, K, S], "Alive.address"),
        ([10, "a" * 26, 0, "a:1", 1, 0, True, 0, 0, 1, K, S], "Alive.reachable"),
        ([14, "a" * 26, 0, 0, "a:1", 1, 0, True, 0, 0], "MemberState: expected 12 fields, got 9"),
        ([21, b"x" * 15], "DialBack.nonce: expected 16 bytes"),
        ([10, "a" * 26, 0, "host:0", 1, 0, True, 0, 0, True, K, S], "Alive.address"),
        ([7, 1, "a" * 26, "::1:80"], "PingReq.address"),
        ([16, FP, "fp32", 0, 0, 0.0], "Offer: expected 6 fields, got 5"),  # before correction
        ([16, FP, "fp32", 0, 0, 0.0, 1], "Offer.correction: expected a boolean"),
        ([16, FP, "fp32", 0, 0, 0, False], "Offer.weight: expected a float"),
        ([17, 0, 0, 0.0], "Accept: expected 4 fields, got 3"),
        ([17, 0, 0, 0.0, None], "Accept.correction: expected a boolean"),
        ([18], "Commit: expected 1 fields, got 0"),  # before the correction's fraction
        ([18, 0], "Commit.correction: expected a float"),
        ([18, 1.5], "Commit.correction: 1.5 out of range 0..1"),
        ([18, -0.25], "Commit.correction"),
        ([18, float("nan")], "Commit.correction"),
    ],
)
def test_bad_fields_name_the_problem(obj, match):
    with pytest.raises(WireError, match=match):
        decode(cbor2.dumps(obj, canonical=True))


@pytest.mark.parametrize(
    "data, match",
    [
        (encode(EXAMPLES[1]) + b"\x00", "canonical"),  # trailing garbage
        (b"\x82\x18\x02\x00\x60", "canonical"),  # non-shortest integer for tag 2
        (b"\x82\x02\xc2\x41\x00", "canonical"),  # bignum where a small int belongs
        (b"\x9f\x02\x00\x60\xff", "indefinite"),  # indefinite-length array
        (b"\xa2\x01\x01\x01\x02", "duplicate"),  # duplicate map keys
        (b"\x81" * 20 + b"\x00", "depth"),  # nesting beyond MAX_DEPTH
        (b"\x83\x02\x00", "malformed"),  # truncated
        (b"", "malformed"),
        (b"\x9b" + (2**40).to_bytes(8, "big"), "malformed"),  # claims 2**40 items
        (bytes(MAX_MESSAGE + 1), "exceeds MAX_MESSAGE"),
    ],
)
def test_malformed_bytes_are_refused(data, match):
    with pytest.raises(WireError, match=f"(?i){match}"):
        decode(data)


@pytest.mark.parametrize(
    "message, spelled",
    [  # docs/PROTOCOL.md section 6.4
        (m.Offer(bytes.fromhex("9679fd51f362229c65de22dd47d2b393"), "fp32", 1000, 64000, 0.0, False),
         "87 10 50 96 79 fd 51 f3 62 22 9c 65 de 22 dd 47 d2 b3 93 64 66 70 33 32 19 03 e8 19 fa 00 f9 00 00 f4"),
        (m.Offer(bytes.fromhex("9679fd51f362229c65de22dd47d2b393"), "fp32", 1000, 64000, 0.0, True),
         "87 10 50 96 79 fd 51 f3 62 22 9c 65 de 22 dd 47 d2 b3 93 64 66 70 33 32 19 03 e8 19 fa 00 f9 00 00 f5"),
        (m.Offer(bytes.fromhex("9679fd51f362229c65de22dd47d2b393"), "bf16", 1000, 64000, 64001.0, False),
         "87 10 50 96 79 fd 51 f3 62 22 9c 65 de 22 dd 47 d2 b3 93 64 62 66 31 36 19 03 e8 19 fa 00 fa 47 7a 01 00 f4"),
        (m.Accept(1200, 76800, 0.0, False), "85 11 19 04 b0 1a 00 01 2c 00 f9 00 00 f4"),
        (m.Accept(1200, 76800, 0.0, True), "85 11 19 04 b0 1a 00 01 2c 00 f9 00 00 f5"),
        (m.Accept(1200, 76800, 76801.0, False), "85 11 19 04 b0 1a 00 01 2c 00 fa 47 96 00 80 f4"),
    ],
    ids=["offer", "offer-correction", "offer-push-sum", "accept", "accept-correction",
         "accept-push-sum"],
)
def test_averaging_messages_match_the_spec(message, spelled):
    data = bytes.fromhex(spelled)
    assert encode(message) == data
    assert decode(data) == message


# docs/PROTOCOL.md sections 6.4 and 8.6: the member of RFC 8032 TEST 2 signs its Alive, and
# its row in a table carries that proof. Ed25519 signatures are deterministic.
RFC8032_TEST2 = "4ccd089b28ff96da9db6c346ec114e0f5b8a319f35aba624da8cf6ed4fb8a6fb"
SPEC_ALIVE_SIGNATURE = ("40a8a4035dcf5c5007fc1eb51de9f90b6723f31783fce6ef2f7aa783c33da349"
                        "023d5cd9484617edff92a58e3427e5ad41b89f752e68b2442ace5bf6deca5c09")
SPEC_LEFT_SIGNATURE = ("66e1c2100e71c47130c91d15bebafcab2531ad06d438ccb0c64b7a56d02e7b98"
                       "2f3dfbffb41e4fb8d5f4bbe08e2d6d0719533cb0d2340f7699709fcde7e2ad0b")


def test_member_state_matches_the_spec():
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from gossip.claims import CLAIM_CONTEXT, proven, row_claim, sign_alive, sign_left, signed_bytes
    from gossip.identity import Identity
    member = Identity(Ed25519PrivateKey.from_private_bytes(bytes.fromhex(RFC8032_TEST2)))
    alive = sign_alive(member, 3, "10.0.0.2:7070", 1, 1200, True, 3, 8, True)
    assert signed_bytes(alive) == CLAIM_CONTEXT + bytes.fromhex(
        "8a0a781a686833726875666769717374366263737371713374356933746d036d31302e302e302e32"
        "3a37303730011904b0f50308f5")
    assert alive.signature.hex() == SPEC_ALIVE_SIGNATURE
    record = m.MemberState("hh3rhufgiqst6bcssqq3t5i3tm", 3, m.MemberState.ALIVE, "10.0.0.2:7070",
                           1, 1200, True, 3, 8, True, key=alive.key, signature=alive.signature)
    data = encode(record)
    assert len(data) == 154
    # shard 3 of 8, then reachable; then the key and the signature
    assert data[:2] == bytes.fromhex("8d0e") and data[47:54] == bytes.fromhex("1904b0f50308f5")
    assert data[54:88] == bytes.fromhex("5820") + member.public_key
    assert data[88:] == bytes.fromhex("5840" + SPEC_ALIVE_SIGNATURE)
    assert decode(data) == record and row_claim(record) == alive and proven(row_claim(record))
    left = sign_left(member, 5)
    assert signed_bytes(left) == CLAIM_CONTEXT + bytes.fromhex(
        "830d781a686833726875666769717374366263737371713374356933746d05")
    assert left.signature.hex() == SPEC_LEFT_SIGNATURE and len(encode(left)) == 131


def test_the_largest_member_records_fit_their_limits():
    # The longest address (hosts are ASCII: letters, digits, '.', '-', '_'; a 4-byte
    # character would be larger still, and is refused) and every number at its maximum: an
    # Alive still fits one datagram beside the Packet around it, a MemberState
    # MAX_RECORD_BYTES.
    from gossip.broadcast import PART_OVERHEAD
    from gossip.membership import _PACKET_OVERHEAD, MAX_PACKET
    from gossip.pushpull import MAX_RECORD_BYTES
    address, top = "h" * 250 + ":65535", 2**53 - 1
    alive = m.Alive(PEER, top, address, 2**16 - 1, top, True, m.MAX_SHARDS - 1, m.MAX_SHARDS,
                    **PROOF)
    record = m.MemberState(PEER, top, m.MemberState.LEFT, address, 2**16 - 1, top, True,
                           m.MAX_SHARDS - 1, m.MAX_SHARDS, **PROOF)
    assert len(encode(alive)) + PART_OVERHEAD <= MAX_PACKET - _PACKET_OVERHEAD
    assert len(encode(record)) <= MAX_RECORD_BYTES


def test_an_unknown_codec_is_valid_on_the_wire():
    # So that a peer asking for a codec we lack gets a polite refusal, not a disconnect.
    assert decode(encode(m.StateRequest(FP, "int8"))).codec == "int8"


def test_invalid_messages_cannot_be_built():
    with pytest.raises(ValueError, match="Close.reason"):
        m.Close(code=0, reason=7)
    with pytest.raises(ValueError, match="StateHeader.step"):
        m.StateHeader(fingerprint=FP, codec="fp32", step=-1, samples=0, nbytes=0)
    with pytest.raises(ValueError, match="Alive.shard: 4 out of range 0..3"):
        m.Alive(PEER, 0, "a:1", 1, 0, True, shard=4, shards=4, **PROOF)
    with pytest.raises(ValueError, match="MemberState.shards"):
        m.MemberState(PEER, 0, 0, "a:1", 1, 0, True, shard=0, shards=m.MAX_SHARDS + 1, **PROOF)
    with pytest.raises(ValueError, match="Alive.reachable: expected a boolean"):
        m.Alive(PEER, 0, "a:1", 1, 0, True, reachable=1, **PROOF)
    with pytest.raises(ValueError, match="Left.key: expected 32 bytes"):
        m.Left(PEER, 0, key=b"k" * 31, signature=b"s" * 64)
    with pytest.raises(ValueError, match="MemberState.signature: expected 64 bytes"):
        m.MemberState(PEER, 0, 0, "a:1", 1, 0, True, key=b"k" * 32, signature=b"")
    with pytest.raises(ValueError, match="DialBack.nonce: expected 16 bytes"):
        m.DialBack(b"short")


def test_tag_table_is_append_only_so_far():
    # Shipped tags keep their meaning: changing this table needs a new tag, not an edit.
    assert {t: c.__name__ for t, c in m.TAGS.items()} == {
        1: "Hello", 2: "Close", 3: "StateRequest", 4: "StateHeader", 5: "Packet", 6: "Ping",
        7: "PingReq", 8: "Ack", 9: "Nack", 10: "Alive", 11: "Suspect", 12: "Dead", 13: "Left",
        14: "MemberState", 15: "PushPull", 16: "Offer", 17: "Accept", 18: "Commit",
        19: "StateInfo", 20: "SchemaInfo", 21: "DialBack",
    }


def test_frame_length_checks_before_reading():
    assert frame_length(encode_frame(b"abc")[:4], 3) == 3
    with pytest.raises(WireError, match="exceeds the limit"):
        frame_length(b"\xff\xff\xff\xff", MAX_MESSAGE)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_raise_only_wire_error(data):
    try:
        message = decode(data)
    except WireError:
        return
    assert encode(message) == data


@settings(max_examples=500, deadline=None)
@given(
    st.sampled_from([encode(x) for x in EXAMPLES]),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=4),
    st.integers(0, 3),
)
def test_mutated_messages_raise_only_wire_error(data, flips, cut):
    data = mutate(data, flips, cut)
    try:
        message = decode(data)
    except WireError:
        return
    assert encode(message) == data


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=4, max_size=4), st.integers(0, 2**32 - 1))
def test_frame_length_never_exceeds_limit(header, limit):
    try:
        assert frame_length(header, limit) <= limit
    except WireError:
        assert int.from_bytes(header, "big") > limit


@pytest.mark.parametrize("address", ["x\nERROR forged:7000", "a b:1", "\x1b[31mred:1",
                                     "[::1\n]:1", "caf\u00e9.example:1"])
def test_an_address_that_could_forge_a_log_line_is_refused_at_decode(address):
    # Peers' addresses reach logs and the operator's terminal (gossipd status): a host may
    # hold only what a host name or an IP address holds.
    with pytest.raises(ValueError, match="Alive.address"):
        m.Alive(PEER, 0, address, 1, 0, True, **PROOF)
    forged = cbor2.dumps([10, PEER, 0, address, 1, 0, True, 0, 0, True, b"k" * 32, b"s" * 64])
    with pytest.raises(WireError):
        decode(forged)
