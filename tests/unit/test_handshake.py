"""The Noise state machine against an independent implementation (the noiseprotocol package),
and the identity layer on top of it."""

import os

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from noise.connection import Keypair, NoiseConnection

from gossip.errors import HandshakeError, LocalProtocolError
from gossip.handshake import (
    CIPHERS,
    PROLOGUE,
    PROTOCOL_NAME,
    SIGNATURE_PREFIX,
    NoiseHandshake,
    Swarm,
    x25519_public_bytes,
    check_hello,
    make_hello,
    protocol_name,
)
from gossip.identity import Identity
from gossip.messages import Hello
from gossip.wire import encode


def reference(initiator: bool, psk: bytes, cipher: str = "aesgcm") -> NoiseConnection:
    conn = NoiseConnection.from_name(protocol_name(cipher))
    conn.set_as_initiator() if initiator else conn.set_as_responder()
    conn.set_psks(psk)
    conn.set_prologue(PROLOGUE)
    conn.set_keypair_from_private_bytes(Keypair.STATIC, os.urandom(32))
    conn.start_handshake()
    return conn


def ours(initiator: bool, psk: bytes, cipher: str = "aesgcm") -> NoiseHandshake:
    return NoiseHandshake(initiator=initiator, psk=psk, static=X25519PrivateKey.generate(),
                          cipher=cipher)


def test_the_default_suite_is_aesgcm():
    assert PROTOCOL_NAME == b"Noise_XXpsk0_25519_AESGCM_SHA256"
    assert protocol_name("chachapoly") == b"Noise_XXpsk0_25519_ChaChaPoly_SHA256"
    assert Swarm("s", bytes(32)).cipher == "aesgcm"


@pytest.mark.parametrize("cipher", CIPHERS)
def test_our_responder_completes_against_reference_initiator(cipher):
    psk = os.urandom(32)
    ref, me = reference(True, psk, cipher), ours(False, psk, cipher)
    assert me.read_message(ref.write_message(b"")) == b""
    assert bytes(ref.read_message(me.write_message(b"from responder"))) == b"from responder"
    assert me.read_message(ref.write_message(b"from initiator")) == b"from initiator"
    assert ref.handshake_finished and me.complete
    assert bytes(ref.get_handshake_hash()) == me.handshake_hash
    send, receive = me.split()
    for n in range(3):  # past n = 0, whose nonce reads the same in either byte order
        assert receive.decrypt(b"", bytes(ref.encrypt(b"i->r %d" % n))) == b"i->r %d" % n
        assert bytes(ref.decrypt(send.encrypt(b"", b"r->i %d" % n))) == b"r->i %d" % n


@pytest.mark.parametrize("cipher", CIPHERS)
def test_our_initiator_completes_against_reference_responder(cipher):
    psk = os.urandom(32)
    me, ref = ours(True, psk, cipher), reference(False, psk, cipher)
    assert bytes(ref.read_message(me.write_message(b""))) == b""
    assert me.read_message(ref.write_message(b"r")) == b"r"
    assert bytes(ref.read_message(me.write_message(b"i"))) == b"i"
    assert ref.handshake_finished and me.complete
    assert bytes(ref.get_handshake_hash()) == me.handshake_hash
    send, receive = me.split()
    for n in range(3):
        assert bytes(ref.decrypt(send.encrypt(b"", b"x" * 1000))) == b"x" * 1000
        assert receive.decrypt(b"", bytes(ref.encrypt(b"y"))) == b"y"
    # Static keys each side learned are the ones the other holds.
    assert me.remote_static == bytes(ref.noise_protocol.keypairs["s"].public_bytes)


def test_wrong_psk_fails_at_the_first_message():
    initiator, responder = ours(True, os.urandom(32)), ours(False, os.urandom(32))
    message1 = initiator.write_message()
    assert len(message1) == 48  # ephemeral key + the tag of an empty, PSK-keyed payload
    with pytest.raises(HandshakeError, match="wrong swarm key"):
        responder.read_message(message1)


@pytest.mark.parametrize("initiator_cipher, responder_cipher",
                         [("aesgcm", "chachapoly"), ("chachapoly", "aesgcm")])
def test_a_node_of_the_other_cipher_fails_at_the_first_message(initiator_cipher,
                                                                responder_cipher):
    # Never negotiated: the suite's name is hashed first, so a mismatch looks like a wrong key.
    psk = os.urandom(32)
    initiator = ours(True, psk, initiator_cipher)
    responder = ours(False, psk, responder_cipher)
    with pytest.raises(HandshakeError, match="wrong swarm key or cipher"):
        responder.read_message(initiator.write_message())


@pytest.mark.parametrize("cipher", ["AESGCM", "aes", "", None, 3])
def test_an_unknown_cipher_is_refused(cipher):
    with pytest.raises(ValueError, match="unknown cipher"):
        Swarm("s", bytes(32), cipher)
    with pytest.raises(ValueError, match="unknown cipher"):
        ours(True, bytes(32), cipher)


@pytest.mark.parametrize("cut", [1, 16, 47])
def test_truncated_messages_are_refused(cut):
    psk = os.urandom(32)
    initiator, responder = ours(True, psk), ours(False, psk)
    with pytest.raises(HandshakeError):
        responder.read_message(initiator.write_message()[:-cut])


def test_low_order_ephemeral_is_refused():
    psk = os.urandom(32)
    responder = ours(False, psk)
    with pytest.raises(HandshakeError):
        responder.read_message(bytes(32) + bytes(16))  # the all-zero point


def test_out_of_turn_use_is_a_local_error():
    psk = os.urandom(32)
    with pytest.raises(LocalProtocolError, match="turn"):
        ours(False, psk).write_message()
    with pytest.raises(LocalProtocolError, match="not complete"):
        ours(True, psk).split()


def hello_case(identity, static_pub, own_swarm, **change):
    fields = dict(version=1, swarm=own_swarm.name, identity_key=identity.public_key,
                  signature=identity.sign(SIGNATURE_PREFIX + static_pub))
    fields.update(change)
    return encode(Hello(**fields))


def test_hello_binds_identity_to_static_key():
    swarm, ident = Swarm.generate("s"), Identity.generate()
    static = x25519_public_bytes(X25519PrivateKey.generate())
    assert check_hello(make_hello(ident, static, swarm), static, swarm) == ident.peer_id
    other_static = x25519_public_bytes(X25519PrivateKey.generate())
    with pytest.raises(HandshakeError, match="signature"):
        check_hello(make_hello(ident, static, swarm), other_static, swarm)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(version=2), "version mismatch"),
        (dict(swarm="other"), "swarm mismatch"),
        (dict(signature=bytes(64)), "signature"),
        (dict(identity_key=Identity.generate().public_key), "signature"),
    ],
)
def test_bad_hello_is_refused(change, match):
    swarm, ident = Swarm.generate("s"), Identity.generate()
    static = x25519_public_bytes(X25519PrivateKey.generate())
    with pytest.raises(HandshakeError, match=match):
        check_hello(hello_case(ident, static, swarm, **change), static, swarm)


def test_allow_list():
    swarm, ident = Swarm.generate("s"), Identity.generate()
    static = x25519_public_bytes(X25519PrivateKey.generate())
    payload = make_hello(ident, static, swarm)
    assert check_hello(payload, static, swarm, frozenset({ident.peer_id}))
    with pytest.raises(HandshakeError, match="allow-list"):
        check_hello(payload, static, swarm, frozenset({Identity.generate().peer_id}))


def test_garbage_payload_is_a_handshake_error():
    swarm = Swarm.generate("s")
    with pytest.raises(HandshakeError, match="bad handshake payload"):
        check_hello(b"\xff\x00", bytes(32), swarm)


def test_swarm_key_is_never_printed():
    swarm = Swarm(name="s", key=b"\xab" * 32)
    assert "ab" not in repr(swarm).lower().replace("swarm", "")


def test_a_generated_swarm_is_rebuilt_from_its_hex_key():
    swarm = Swarm.generate("s")
    assert swarm.key != Swarm.generate("s").key  # a fresh key each time
    assert Swarm.from_hex("s", swarm.key.hex()) == swarm
    assert Swarm.from_hex("s", f"  {swarm.key.hex().upper()}\n") == swarm  # a key file's text


@pytest.mark.parametrize("text", ["", "ab" * 31, "ab" * 33, "zz" * 32, "ab " * 21 + "a",
                                  "ab" * 16 + " " * 32])
def test_a_malformed_hex_key_is_refused_without_echoing_it(text):
    with pytest.raises(ValueError, match="64 hexadecimal characters") as caught:
        Swarm.from_hex("s", text)
    assert text.strip() == "" or text.strip() not in str(caught.value)
