"""The secure handshake: Noise ``XXpsk0_25519_AESGCM_SHA256`` plus identity binding.

Pure: no trio, no sockets. :class:`NoiseHandshake` is the Noise state machine (Noise spec
revision 34, §5 and §9); the identity layer on top (:func:`make_hello`, :func:`check_hello`)
is this protocol's own. :mod:`gossip.endpoints` drives both over a stream, and
:mod:`gossip.channel` carries the records that follow.

Theory of operation
-------------------
The XXpsk0 pattern::

    -> psk, e              message 1: initiator's ephemeral key; payload empty
    <- e, ee, s, es        message 2: responder's ephemeral and static keys; payload Hello
    -> s, se               message 3: initiator's static key; payload Hello

The swarm key is the pre-shared key, mixed in before anything else (psk0). Message 1's
(empty) payload is therefore encrypted under a key derived from the PSK: a responder that
does not hold the swarm key rejects it, and an initiator without the key cannot produce it,
so an outsider learns nothing from a responder: not its static key, not its identity, not
that it speaks this protocol beyond the fact that it closed the connection. A fake responder
without the key cannot produce a valid message 2 either.

The Noise static keys are fresh X25519 keys (per process, or per connection); what names a
node is its Ed25519 identity. Each side's ``Hello`` payload carries its identity public key
and an Ed25519 signature over ``SIGNATURE_PREFIX + noise_static_public_key``, binding the
identity to the static key that Noise authenticated (the construction libp2p uses). Because
the Noise transcript covers the static key, the signature cannot be replayed onto another
connection without the matching static private key.

The responder reveals its identity in message 2 only after checking the PSK; the initiator
checks the responder (signature, version, swarm, allow-list) before it sends message 3, so
an initiator never reveals its identity to a peer it will refuse.

Rotating the swarm key: a :class:`Swarm` may hold a second, ``previous`` key for the length
of a rotation. Message 1 is the only message the PSK alone decides, so the responder reads it
under the swarm key and then under the previous one (:func:`read_first_message`) and goes on
under whichever authenticated it; a dialer initiates under the swarm key and dials again
under the previous one if the responder closes after message 1 (:func:`gossip.endpoints.connect`,
with the memory of :mod:`gossip.rotation`). Until the rotation finishes, a holder of the
previous key is as much a member as a holder of the new one: a rotation that shuts someone
out takes effect when the last node drops the previous key.

The cipher is a property of the swarm (:attr:`Swarm.cipher`), never negotiated: ``aesgcm``
(the default, ``Noise_XXpsk0_25519_AESGCM_SHA256``) or ``chachapoly``
(``Noise_XXpsk0_25519_ChaChaPoly_SHA256``) for a swarm of machines without AES instructions.
The suite's name is the first thing hashed into the transcript, so a node of the other suite
fails message 1 exactly as a node with another swarm key does: no downgrade is possible.
With AES instructions, AES-256-GCM seals a 1 MiB record about 3x faster than
ChaCha20-Poly1305; without them, ChaCha20-Poly1305 is the faster one by far.

Costs: three X25519 key agreements and one Ed25519 signature and verification per side;
about 0.3 ms of CPU on a current x86 core.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

from .errors import HandshakeError, LocalProtocolError, RemoteProtocolError, WireError
from .identity import Identity, PeerId, peer_id_from_public_key, verify_signature
from .messages import Hello
from .rotation import PeerKeys
from .wire import decode, encode

__all__ = [
    "CIPHERS",
    "DEFAULT_CIPHER",
    "PROTOCOL_NAME",
    "protocol_name",
    "PROLOGUE",
    "PROTOCOL_VERSION",
    "SIGNATURE_PREFIX",
    "MAX_HANDSHAKE_MESSAGE",
    "Swarm",
    "CipherState",
    "NoiseHandshake",
    "read_first_message",
    "make_hello",
    "check_hello",
    "x25519_public_bytes",
]

# Swarm cipher setting -> (Noise cipher name, AEAD, nonce of counter n). Noise §12: AESGCM
# puts the 64-bit counter big-endian after 32 zero bits, ChaChaPoly little-endian.
_SUITES = {
    "aesgcm": (b"AESGCM", AESGCM, struct.Struct(">4xQ")),
    "chachapoly": (b"ChaChaPoly", ChaCha20Poly1305, struct.Struct("<4xQ")),
}
CIPHERS: tuple[str, ...] = tuple(_SUITES)
DEFAULT_CIPHER = "aesgcm"


def protocol_name(cipher: str = DEFAULT_CIPHER) -> bytes:
    """The Noise protocol name of the swarm cipher ``cipher`` (one of :data:`CIPHERS`)."""
    return b"Noise_XXpsk0_25519_" + _suite(cipher)[0] + b"_SHA256"


def _suite(cipher: str) -> tuple:
    try:
        return _SUITES[cipher]
    except (KeyError, TypeError):
        raise ValueError(f"unknown cipher {cipher!r}; expected one of {CIPHERS}") from None


PROTOCOL_NAME = protocol_name()  # the default suite's
PROLOGUE = b"gossipd"
PROTOCOL_VERSION = 1
SIGNATURE_PREFIX = b"gossipd-noise-static-key:"
MAX_HANDSHAKE_MESSAGE = 65535  # Noise's own limit on a handshake message
HASHLEN = 32
DHLEN = 32
TAGLEN = 16
MAX_NONCE = 2**64 - 1  # reserved by Noise; reaching it means the channel must be closed


@dataclass(frozen=True)
class Swarm:
    """What a node must share with its swarm: a name, a 32-byte secret key and the channel
    cipher (one of :data:`CIPHERS`; every node of a swarm must use the same one).

    While the swarm key is being rotated, ``previous`` is the key it replaces: the node then
    accepts both (handshake message 1 and datagrams under either), and initiates and seals
    under ``key``, falling back to ``previous`` for peers that have not rotated yet
    (:mod:`gossip.rotation`). :attr:`peer_keys` is this process's bounded memory of which key
    each peer address holds; it is not part of the swarm's value (equality ignores it)."""

    name: str
    key: bytes
    cipher: str = DEFAULT_CIPHER
    previous: bytes | None = None
    peer_keys: PeerKeys = field(default_factory=PeerKeys, init=False, compare=False,
                                repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not 0 < len(self.name) <= 64:
            raise ValueError("swarm name must be 1 to 64 characters")
        if not isinstance(self.key, bytes) or len(self.key) != 32:
            raise ValueError("swarm key must be 32 bytes")
        if self.previous is not None:
            if not isinstance(self.previous, bytes) or len(self.previous) != 32:
                raise ValueError("the previous swarm key must be 32 bytes")
            if hmac.compare_digest(self.previous, self.key):
                raise ValueError("the previous swarm key is the swarm key itself: a rotation "
                                 "needs a new key")
        _suite(self.cipher)

    @classmethod
    def generate(cls, name: str, cipher: str = DEFAULT_CIPHER) -> "Swarm":
        """A new swarm named ``name`` with a fresh random key, for its first node. Hand the
        others ``swarm.key.hex()`` as a secret (whoever holds it can join and read the
        weights), and let them build the same swarm with :meth:`from_hex`."""
        return cls(name, secrets.token_bytes(32), cipher)

    @classmethod
    def from_hex(cls, name: str, key_hex: str, cipher: str = DEFAULT_CIPHER,
                 previous_hex: str | None = None) -> "Swarm":
        """The swarm named ``name`` whose key is ``key_hex``: 64 hexadecimal characters, as
        ``swarm.key.hex()`` gives them and as ``gossipd init`` writes its swarm key file
        (surrounding whitespace, a final newline say, is ignored). ``previous_hex``, in the
        same form, is the key being rotated away from, if any.

        Raises:
            ValueError: ``key_hex`` or ``previous_hex`` is not 64 hexadecimal characters,
                the two are the same key, ``name`` is not 1 to 64 characters, or ``cipher``
                is not one of :data:`CIPHERS`.
        """
        previous = None if previous_hex is None else _key_from_hex(previous_hex, "previous ")
        return cls(name, _key_from_hex(key_hex), cipher, previous)

    def rotate(self, key: bytes | None = None) -> "Swarm":
        """This swarm mid-rotation to ``key`` (a fresh random key if None): ``key`` is the
        swarm key, and this swarm's key its previous one.

        Raises:
            ValueError: already mid-rotation (finish that first), or ``key`` is not 32 bytes
                or is the current key.
        """
        if self.previous is not None:
            raise ValueError("already rotating the swarm key: finish that rotation first")
        return Swarm(self.name, secrets.token_bytes(32) if key is None else key, self.cipher,
                     self.key)

    def finish_rotation(self) -> "Swarm":
        """This swarm without its previous key: once every node holds the current one."""
        return Swarm(self.name, self.key, self.cipher)

    def __repr__(self) -> str:  # never print the key
        rotating = "" if self.previous is None else ", previous=<secret>"
        return f"Swarm(name={self.name!r}, key=<secret>, cipher={self.cipher!r}{rotating})"


def _key_from_hex(key_hex: str, which: str = "") -> bytes:
    text = key_hex.strip()
    try:
        key = bytes.fromhex(text) if len(text) == 64 else b""
    except ValueError:
        key = b""
    if len(key) != 32:  # fromhex skips inner spaces: "00 00 ..." is 64 characters
        raise ValueError(f"a {which}swarm key is 64 hexadecimal characters")
    return key


def _hmac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def _hkdf(chaining_key: bytes, ikm: bytes, n: int) -> list[bytes]:
    """Noise's HKDF (§4.3): n outputs of HASHLEN bytes."""
    temp_key = _hmac(chaining_key, ikm)
    outputs, prev = [], b""
    for i in range(1, n + 1):
        prev = _hmac(temp_key, prev + bytes([i]))
        outputs.append(prev)
    return outputs


class CipherState:
    """A key and a nonce counter (Noise §5.1) of the swarm cipher ``cipher``. Used for
    handshake payloads and, after :meth:`NoiseHandshake.split`, for the channel's records."""

    __slots__ = ("_aead", "_nonce", "n")

    def __init__(self, key: bytes | None = None, cipher: str = DEFAULT_CIPHER) -> None:
        _, aead, self._nonce = _suite(cipher)
        self._aead = aead(key) if key is not None else None
        self.n = 0

    @property
    def has_key(self) -> bool:
        return self._aead is not None

    def _next_nonce(self) -> bytes:
        if self.n >= MAX_NONCE:
            raise LocalProtocolError("nonce space exhausted; the channel must be reopened")
        nonce = self._nonce.pack(self.n)
        self.n += 1
        return nonce

    def encrypt(self, ad: bytes, plaintext: bytes) -> bytes:
        if self._aead is None:
            return plaintext
        return self._aead.encrypt(self._next_nonce(), plaintext, ad)

    def decrypt(self, ad: bytes, ciphertext: bytes) -> bytes:
        """Raises RemoteProtocolError if authentication fails; the nonce is then not used up,
        but the caller must close the channel anyway (Noise §5.1)."""
        if self._aead is None:
            return ciphertext
        if self.n >= MAX_NONCE:
            raise LocalProtocolError("nonce space exhausted; the channel must be reopened")
        try:
            plaintext = self._aead.decrypt(self._nonce.pack(self.n), ciphertext, ad)
        except InvalidTag:
            raise RemoteProtocolError("record failed authentication (tampered, replayed or reordered)") from None
        self.n += 1
        return plaintext

    def encrypt_into(self, ad: bytes | memoryview, plaintext: bytes | memoryview, out: memoryview) -> None:
        """Encrypt into ``out``, which must be exactly ``len(plaintext) + 16`` bytes."""
        assert self._aead is not None
        self._aead.encrypt_into(self._next_nonce(), plaintext, ad, out)

    def decrypt_into(self, ad: bytes | memoryview, ciphertext: memoryview, out: memoryview) -> None:
        """Decrypt into ``out`` (``len(ciphertext) - 16`` bytes). On failure ``out`` holds no
        plaintext that may be used."""
        assert self._aead is not None
        if self.n >= MAX_NONCE:
            raise LocalProtocolError("nonce space exhausted; the channel must be reopened")
        try:
            self._aead.decrypt_into(self._nonce.pack(self.n), ciphertext, ad, out)
        except InvalidTag:
            raise RemoteProtocolError("record failed authentication (tampered, replayed or reordered)") from None
        self.n += 1


def x25519_public_bytes(key: X25519PrivateKey) -> bytes:
    """The raw 32-byte public key of an X25519 key pair."""
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _dh(private: X25519PrivateKey, public: bytes) -> bytes:
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError:
        # A low-order point gives an all-zero shared secret, which cryptography refuses.
        raise HandshakeError("peer sent an invalid X25519 public key") from None


class NoiseHandshake:
    """One side of a Noise XXpsk0 handshake (§5.2 SymmetricState and §5.3 HandshakeState).

    Call ``write_message`` and ``read_message`` alternately, starting with ``write_message``
    on the initiator; after three messages :attr:`complete` is true and :meth:`split` gives
    the transport cipher states.

    Args:
        initiator: True for the side that dialed.
        psk: the 32-byte pre-shared key (the swarm key).
        static: this side's X25519 static key.
        prologue: bytes both sides must agree on; mixed into the transcript.
        ephemeral: fixed ephemeral key, for test vectors only.
        cipher: the swarm cipher, one of :data:`CIPHERS`.
    """

    # (direction, tokens): True means initiator -> responder.
    PATTERN = (
        (True, ("psk", "e")),
        (False, ("e", "ee", "s", "es")),
        (True, ("s", "se")),
    )

    def __init__(
        self,
        *,
        initiator: bool,
        psk: bytes,
        static: X25519PrivateKey,
        prologue: bytes = PROLOGUE,
        ephemeral: X25519PrivateKey | None = None,
        cipher: str = DEFAULT_CIPHER,
    ) -> None:
        if len(psk) != 32:
            raise ValueError("the PSK must be 32 bytes")
        self.cipher = cipher
        self.initiator = initiator
        self._psk = psk
        self._s = static
        self._e = ephemeral
        self._re: bytes | None = None
        self.remote_static: bytes | None = None
        # InitializeSymmetric: a name longer than HASHLEN is hashed.
        name = protocol_name(cipher)
        self._h = name.ljust(HASHLEN, b"\0") if len(name) <= HASHLEN else hashlib.sha256(name).digest()
        self._ck = self._h
        self._cipher = CipherState(cipher=cipher)
        self._mix_hash(prologue)
        self._index = 0

    # -- SymmetricState ------------------------------------------------------------------
    def _mix_hash(self, data: bytes) -> None:
        self._h = hashlib.sha256(self._h + data).digest()

    def _mix_key(self, ikm: bytes) -> None:
        self._ck, temp_k = _hkdf(self._ck, ikm, 2)
        self._cipher = CipherState(temp_k, self.cipher)

    def _mix_key_and_hash(self, ikm: bytes) -> None:
        self._ck, temp_h, temp_k = _hkdf(self._ck, ikm, 3)
        self._mix_hash(temp_h)
        self._cipher = CipherState(temp_k, self.cipher)

    def _encrypt_and_hash(self, plaintext: bytes) -> bytes:
        ciphertext = self._cipher.encrypt(self._h, plaintext)
        self._mix_hash(ciphertext)
        return ciphertext

    def _decrypt_and_hash(self, ciphertext: bytes) -> bytes:
        try:
            plaintext = self._cipher.decrypt(self._h, ciphertext)
        except RemoteProtocolError:
            raise HandshakeError(
                "handshake message failed authentication (wrong swarm key or cipher, or tampered)"
            ) from None
        self._mix_hash(ciphertext)
        return plaintext

    # -- HandshakeState ------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        return self._index == len(self.PATTERN)

    @property
    def handshake_hash(self) -> bytes:
        """The transcript hash h; equal on both sides once complete (channel binding)."""
        return self._h

    @property
    def remote_ephemeral(self) -> bytes | None:
        """The peer's ephemeral public key, once its first message is read: fresh random
        bytes in every honest handshake, so a message 1 that brings one seen before is a
        replay (:class:`gossip.limits.FirstMessages`)."""
        return self._re

    def _dh_token(self, token: str) -> bytes:
        assert self._e is not None and self._re is not None
        if token == "ee":
            return _dh(self._e, self._re)
        # "es": initiator's ephemeral with responder's static; "se": the reverse.
        if (token == "es") == self.initiator:
            assert self.remote_static is not None
            return _dh(self._e, self.remote_static)
        return _dh(self._s, self._re)

    def _next(self, writing: bool) -> tuple[str, ...]:
        if self.complete:
            raise LocalProtocolError("handshake already complete")
        outgoing, tokens = self.PATTERN[self._index]
        if outgoing != (writing == self.initiator):
            raise LocalProtocolError(f"not this side's turn to {'write' if writing else 'read'}")
        self._index += 1
        return tokens

    def write_message(self, payload: bytes = b"") -> bytes:
        out = bytearray()
        for token in self._next(writing=True):
            if token == "psk":
                self._mix_key_and_hash(self._psk)
            elif token == "e":
                if self._e is None:
                    self._e = X25519PrivateKey.generate()
                e_pub = x25519_public_bytes(self._e)
                out += e_pub
                self._mix_hash(e_pub)
                self._mix_key(e_pub)  # psk handshakes mix e into the key too (§9.2)
            elif token == "s":
                out += self._encrypt_and_hash(x25519_public_bytes(self._s))
            else:
                self._mix_key(self._dh_token(token))
        out += self._encrypt_and_hash(payload)
        if len(out) > MAX_HANDSHAKE_MESSAGE:
            raise LocalProtocolError("handshake payload too large")
        return bytes(out)

    def read_message(self, message: bytes) -> bytes:
        """Process the peer's next handshake message and return its decrypted payload.

        Raises:
            HandshakeError: truncated, oversized, or failed authentication.
        """
        if len(message) > MAX_HANDSHAKE_MESSAGE:
            raise HandshakeError("handshake message too large")
        view = memoryview(message)
        for token in self._next(writing=False):
            if token == "psk":
                self._mix_key_and_hash(self._psk)
            elif token == "e":
                if len(view) < DHLEN:
                    raise HandshakeError("handshake message truncated")
                self._re, view = bytes(view[:DHLEN]), view[DHLEN:]
                self._mix_hash(self._re)
                self._mix_key(self._re)
            elif token == "s":
                size = DHLEN + (TAGLEN if self._cipher.has_key else 0)
                if len(view) < size:
                    raise HandshakeError("handshake message truncated")
                self.remote_static = self._decrypt_and_hash(bytes(view[:size]))
                view = view[size:]
            else:
                self._mix_key(self._dh_token(token))
        if len(view) < TAGLEN:
            raise HandshakeError("handshake message truncated")
        return self._decrypt_and_hash(bytes(view))

    def split(self) -> tuple[CipherState, CipherState]:
        """``(send, receive)`` cipher states for this side (§5.2 Split)."""
        if not self.complete:
            raise LocalProtocolError("handshake not complete")
        k1, k2 = _hkdf(self._ck, b"", 2)
        c1, c2 = CipherState(k1, self.cipher), CipherState(k2, self.cipher)
        return (c1, c2) if self.initiator else (c2, c1)


def read_first_message(
    message: bytes, swarm: Swarm, static: X25519PrivateKey, *, prologue: bytes = PROLOGUE,
) -> tuple[NoiseHandshake, bool]:
    """The responder's side of message 1, under whichever of the swarm's keys the initiator
    used: the swarm key, and then, mid-rotation, the previous key.

    psk0 mixes the PSK in before message 1's payload is encrypted, so the payload's tag tells
    which key the initiator holds. Message 1 costs no Diffie-Hellman operation (a few hashes
    and one AEAD on an empty payload), so a second try at most doubles what a failed message
    1 costs us, and nothing else is done twice.

    Returns:
        The handshake, continued under the key that authenticated message 1, and whether
        that was the previous key.

    Raises:
        HandshakeError: message 1 authenticates under neither key (the error the swarm key
            gave: as a node without a previous key reports it), or its payload is not empty.
    """
    keys = (swarm.key,) if swarm.previous is None else (swarm.key, swarm.previous)
    first_error: HandshakeError | None = None
    for index, psk in enumerate(keys):
        hs = NoiseHandshake(initiator=False, psk=psk, static=static, prologue=prologue,
                            cipher=swarm.cipher)
        try:
            payload = hs.read_message(message)
        except HandshakeError as exc:
            first_error = first_error or exc
            continue
        if payload != b"":
            raise HandshakeError("unexpected payload in the first handshake message")
        return hs, index == 1
    assert first_error is not None
    raise first_error


def make_hello(identity: Identity, static_public: bytes, swarm: Swarm) -> bytes:
    """The encoded Hello payload binding ``static_public`` to ``identity``."""
    hello = Hello(
        version=PROTOCOL_VERSION,
        swarm=swarm.name,
        identity_key=identity.public_key,
        signature=identity.sign(SIGNATURE_PREFIX + static_public),
    )
    return encode(hello)


def check_hello(
    payload: bytes,
    remote_static: bytes,
    swarm: Swarm,
    allow: frozenset[str] | None = None,
) -> PeerId:
    """Validate the peer's Hello payload; return its peer id.

    Raises:
        HandshakeError: undecodable, version or swarm mismatch, bad signature, or a peer id
            not in ``allow`` (when given).
    """
    try:
        hello = decode(payload)
    except WireError as exc:
        raise HandshakeError(f"bad handshake payload: {exc}") from None
    if not isinstance(hello, Hello):
        raise HandshakeError(f"expected Hello in the handshake, got {type(hello).__name__}")
    if hello.version != PROTOCOL_VERSION:
        raise HandshakeError(
            f"protocol version mismatch: peer speaks {hello.version}, we speak {PROTOCOL_VERSION}"
        )
    if hello.swarm != swarm.name:
        raise HandshakeError(f"swarm mismatch: peer is in {hello.swarm!r}, we are in {swarm.name!r}")
    if not verify_signature(hello.identity_key, hello.signature, SIGNATURE_PREFIX + remote_static):
        raise HandshakeError("identity signature does not match the Noise static key")
    peer = peer_id_from_public_key(hello.identity_key)
    if allow is not None and peer not in allow:
        raise HandshakeError(f"peer {peer.short} is not on the allow-list")
    return peer
