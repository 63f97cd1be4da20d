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
    """Seals and opens membership datagrams for one swarm."""

    __slots__ = ("_aead",)

    def __init__(self, swarm: Swarm) -> None:
        key = HKDF(
            algorithm=hashes.SHA256(),
            length=32,
            salt=None,
            info=b"gossipd membership v1:" + swarm.name.encode("utf-8"),
        ).derive(swarm.key)
        self._aead = ChaCha20Poly1305(key)

    def seal(self, plaintext: bytes) -> bytes:
        """Encrypt and authenticate ``plaintext``; returns the datagram."""
        nonce = os.urandom(NONCE_BYTES)
        return _HEADER + nonce + self._aead.encrypt(nonce, plaintext, _HEADER)

    def open(self, datagram: bytes) -> bytes:
        """The plaintext of a datagram sealed with this swarm's key.

        Raises:
            WireError: wrong version, too short, or it fails authentication (a wrong swarm
                key, a corrupted datagram, or a forgery).
        """
        if len(datagram) < SEAL_OVERHEAD:
            raise WireError(f"sealed datagram of {len(datagram)} bytes is too short")
        if datagram[0] != SEAL_VERSION:
            raise WireError(f"unknown sealed datagram version {datagram[0]}")
        nonce = datagram[1 : 1 + NONCE_BYTES]
        try:
            return self._aead.decrypt(nonce, datagram[1 + NONCE_BYTES :], _HEADER)
        except InvalidTag:
            raise WireError("datagram failed authentication (wrong swarm key or forged)") from None
