"""Sealed datagrams: membership traffic authenticated and encrypted with the swarm key.

Theory of operation
-------------------
Membership (SWIM) sends several small datagrams per node per second. A Noise handshake per
probe would cost more than the probe (a channel handshake is two signatures and four
Diffie-Hellman operations), and a pool of channels to every member does not scale, so
membership datagrams are sealed with a symmetric key that every holder of the swarm key
derives the same way (memberlist's design)::

    key      = HKDF-SHA256(ikm=swarm key, salt=none, info="gossipd membership v1:" + name)
    datagram = VERSION (1 byte) || nonce (12 random bytes) || ChaCha20-Poly1305(key, nonce,
               plaintext, associated data = VERSION)

Nonces are random 96-bit values. Every member seals under the same key, so the budget is
the swarm's, not a node's: after 2**32 datagrams swarm-wide (five days of a thousand nodes
sending ten a second) the chance that two ever shared a nonce reaches 2**-33, and it grows
with the square of the count. Rotate the swarm key well before that; a per-sender subkey
would lift the limit. What sealing gives: nobody without the swarm key can read membership
traffic or inject a message that is accepted. What it does not give: it does not prove which
member sent a datagram (every member holds the key) and it does not stop a replay of a
captured datagram. Both are bounded by the protocol: incarnation numbers make replayed
state stale, and identity is proven where it matters, on the secure channel that every
averaging exchange opens (gossip.channel checks the peer id against its Ed25519 key).

Rotating the swarm key: mid-rotation (``swarm.previous`` set) a datagram is opened under
the swarm key and then under the previous key, and what we send is sealed under the key, or
the keys, the peer at that address may need: :mod:`gossip.rotation` has the table and why a
peer not known to hold the new key gets the datagram twice, once under each key. The format
does not change: a receiver cannot tell which key sealed a datagram but by trying.

Pure: no I/O and no clock.
"""

from __future__ import annotations

import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .errors import WireError
from .handshake import Swarm

__all__ = ["Sealer", "SEAL_VERSION", "SEAL_OVERHEAD"]

SEAL_VERSION = 1
NONCE_BYTES = 12
TAG_BYTES = 16
SEAL_OVERHEAD = 1 + NONCE_BYTES + TAG_BYTES  # bytes a sealed datagram adds to its plaintext
_HEADER = bytes([SEAL_VERSION])


class Sealer:
    """Seals and opens membership datagrams for one swarm: under its key, and mid-rotation
    (``swarm.previous`` set) under its previous key too, as the swarm's
    :attr:`~gossip.handshake.Swarm.peer_keys` say (:mod:`gossip.rotation`)."""

    __slots__ = ("_aead", "_previous", "_peers")

    def __init__(self, swarm: Swarm) -> None:
        self._aead = ChaCha20Poly1305(_membership_key(swarm.key, swarm.name))
        self._previous = (None if swarm.previous is None
                          else ChaCha20Poly1305(_membership_key(swarm.previous, swarm.name)))
        self._peers = swarm.peer_keys

    def seal(self, plaintext: bytes) -> bytes:
        """Encrypt and authenticate ``plaintext`` under the swarm key; returns the datagram."""
        return _seal(self._aead, plaintext)

    def seal_for(self, plaintext: bytes, address: str) -> tuple[bytes, ...]:
        """The datagrams that carry ``plaintext`` to ``address``: one, sealed under the swarm
        key; mid-rotation, one under each key the peer there may need (two while it is not
        known to hold the swarm key: see :mod:`gossip.rotation`). Send them all."""
        if self._previous is None:
            return (_seal(self._aead, plaintext),)
        return tuple(_seal(self._previous if previous else self._aead, plaintext)
                     for previous in self._peers.seal_under(address))

    def open(self, datagram: bytes, source: str | None = None) -> bytes:
        """The plaintext of a datagram sealed under this swarm's key or, mid-rotation, under
        its previous key. ``source``, the address it came from, is remembered with the key
        that opened it (mid-rotation only), to choose the keys of what we send there.

        Raises:
            WireError: wrong version, too short, or it fails authentication under every key
                (a wrong swarm key, a corrupted datagram, or a forgery).
        """
        if len(datagram) < SEAL_OVERHEAD:
            raise WireError(f"sealed datagram of {len(datagram)} bytes is too short")
        if datagram[0] != SEAL_VERSION:
            raise WireError(f"unknown sealed datagram version {datagram[0]}")
        nonce, body = datagram[1 : 1 + NONCE_BYTES], datagram[1 + NONCE_BYTES :]
        try:
            plaintext = self._aead.decrypt(nonce, body, _HEADER)
            previous = False
        except InvalidTag:
            if self._previous is None:
                raise WireError("datagram failed authentication (wrong swarm key or "
                                "forged)") from None
            try:  # mid-rotation: a forgery costs us two tag checks instead of one, no more
                plaintext = self._previous.decrypt(nonce, body, _HEADER)
                previous = True
            except InvalidTag:
                raise WireError("datagram failed authentication under both the swarm key and "
                                "the previous one (another swarm key, or forged)") from None
        if source is not None and self._previous is not None:
            self._peers.heard(source, previous=previous)
        return plaintext


def _membership_key(swarm_key: bytes, name: str) -> bytes:
    return HKDF(
        algorithm=hashes.SHA256(),
        length=32,
        salt=None,
        info=b"gossipd membership v1:" + name.encode("utf-8"),
    ).derive(swarm_key)


def _seal(aead: ChaCha20Poly1305, plaintext: bytes) -> bytes:
    nonce = os.urandom(NONCE_BYTES)
    return _HEADER + nonce + aead.encrypt(nonce, plaintext, _HEADER)
