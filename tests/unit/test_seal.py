"""Sealed membership datagrams: what opens, and every way a datagram must fail to open."""

import pytest

from gossip.errors import WireError
from gossip.handshake import Swarm
from gossip.seal import NONCE_BYTES, SEAL_OVERHEAD, SEAL_VERSION, Sealer

SWARM = Swarm("test", bytes(range(32)))
SEALER = Sealer(SWARM)
PLAINTEXT = b"\x83\x05membership datagram"


@pytest.mark.parametrize("plaintext", [b"", b"x", PLAINTEXT, bytes(range(256)) * 5])
def test_round_trip(plaintext):
    assert SEALER.open(SEALER.seal(plaintext)) == plaintext


def test_another_sealer_for_the_same_swarm_opens_it():
    # Every member derives the same key from the swarm key and name.
    assert Sealer(Swarm("test", bytes(range(32)))).open(SEALER.seal(PLAINTEXT)) == PLAINTEXT


@pytest.mark.parametrize("size", [0, 1, 100, 1371])
def test_overhead_is_seal_overhead(size):
    assert len(SEALER.seal(bytes(size))) == size + SEAL_OVERHEAD
    assert SEAL_OVERHEAD == 1 + NONCE_BYTES + 16


def test_header_is_the_version_byte():
    assert SEALER.seal(PLAINTEXT)[0] == SEAL_VERSION


def test_two_seals_of_the_same_plaintext_differ():
    a, b = SEALER.seal(PLAINTEXT), SEALER.seal(PLAINTEXT)
    assert a != b
    assert a[1 : 1 + NONCE_BYTES] != b[1 : 1 + NONCE_BYTES]  # a fresh random nonce each time


@pytest.mark.parametrize(
    "opener",
    [
        Sealer(Swarm("test", bytes(32))),  # wrong swarm key
        Sealer(Swarm("other", bytes(range(32)))),  # same key, wrong swarm name
    ],
    ids=["wrong-key", "wrong-name"],
)
def test_another_swarm_cannot_open_it(opener):
    with pytest.raises(WireError, match="authentication"):
        opener.open(SEALER.seal(PLAINTEXT))


def _flip(data: bytes, index: int) -> bytes:
    buf = bytearray(data)
    buf[index] ^= 0x01
    return bytes(buf)


@pytest.mark.parametrize(
    "where",
    [1, NONCE_BYTES, NONCE_BYTES + 1, NONCE_BYTES + 5, -16, -1],
    ids=["nonce-first", "nonce-last", "ciphertext-first", "ciphertext-mid", "tag-first",
         "tag-last"],
)
def test_a_flipped_bit_fails_authentication(where):
    datagram = SEALER.seal(PLAINTEXT)
    with pytest.raises(WireError, match="authentication"):
        SEALER.open(_flip(datagram, where % len(datagram)))


@pytest.mark.parametrize("cut", [1, 16, len(PLAINTEXT)])
def test_a_truncated_datagram_fails(cut):
    datagram = SEALER.seal(PLAINTEXT)
    with pytest.raises(WireError):
        SEALER.open(datagram[:-cut])


@pytest.mark.parametrize("size", [0, 1, SEAL_OVERHEAD - 1])
def test_shorter_than_the_overhead_is_too_short(size):
    with pytest.raises(WireError, match="too short"):
        SEALER.open(SEALER.seal(b"")[:size])


@pytest.mark.parametrize("version", [0, SEAL_VERSION + 1, 255])
def test_a_wrong_version_byte_is_refused(version):
    datagram = SEALER.seal(PLAINTEXT)
    with pytest.raises(WireError, match="version"):
        SEALER.open(bytes([version]) + datagram[1:])


def test_the_version_byte_is_authenticated():
    # Even if a future version byte were accepted, the original tag covers the header.
    datagram = SEALER.seal(PLAINTEXT)
    assert SEALER.open(datagram) == PLAINTEXT
    with pytest.raises(WireError):
        SEALER.open(bytes([datagram[0] ^ 0x80]) + datagram[1:])


def test_appended_bytes_fail():
    with pytest.raises(WireError, match="authentication"):
        SEALER.open(SEALER.seal(PLAINTEXT) + b"\x00")
