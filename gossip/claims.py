"""Claims only a member can make about itself: its Alive and its Left, signed.

Theory of operation
-------------------
Every holder of the swarm key can seal a datagram, so the seal proves nothing about who wrote
a membership update. Two updates decide where a member stands for good: ``Alive`` (its
address, metadata and incarnation; only the member raises its own incarnation) and ``Left``
(a departure is final). A forger who could write them could pin a member LEFT, or at an
incarnation it cannot out-announce. So the member signs both with its node identity
(:mod:`gossip.identity`), and a receiver applies one only if:

* ``key`` is a raw 32-byte Ed25519 public key whose peer id is the claim's ``peer``, and
* ``signature`` is that key's Ed25519 signature of :data:`CLAIM_CONTEXT` followed by the
  canonical CBOR array ``[tag, field1, ...]`` of the claim's other fields, in wire order.

The context keeps these signatures apart from the handshake's (``gossipd-noise-static-key:``)
and the tag keeps an Alive's apart from a Left's. ``Suspect`` and ``Dead`` stay unsigned: they
are what other members observe, and the member refutes them with a newer signed Alive
(:mod:`gossip.membership` makes sure it always can).

A push-pull row (:class:`~gossip.messages.MemberState`) carries the proof of the claim its
incarnation comes from, so a table passes on signed incarnations only: a LEFT row the
member's Left, every other row the member's Alive with the row's fields
(:func:`row_claim`).

Cost. A check is a SHA-256 (the key against the peer id, first: a wrong key costs nothing
more) and an Ed25519 verification, about 70 µs (76 µs measured on a busy machine; a signature
costs 25 µs). The membership checks only a claim that would change its table, so gossip
repeating an announcement costs no check. A datagram holds
at most ten signed claims (1331 bytes of parts, 133 bytes at least for each), and
:class:`ClaimChecker` refuses every claim of a datagram or table after its first forged
proof without checking it: honest members pass on only claims they checked, so whoever sent
it forged it, and it buys one failed verification a datagram.
"""

from __future__ import annotations

import cbor2

from .identity import Identity, peer_id_from_public_key, verify_signature
from .messages import Alive, Left, MemberState

__all__ = ["CLAIM_CONTEXT", "ClaimChecker", "sign_alive", "sign_left", "signed_bytes",
           "proven", "row_claim", "alive_row"]

CLAIM_CONTEXT = b"gossipd-membership-claim:"


def signed_bytes(claim: Alive | Left) -> bytes:
    """What the member signs: the context, then ``[tag, fields...]`` without the proof."""
    return CLAIM_CONTEXT + _body(claim.TAG, claim.to_fields()[:-2])


def _body(tag: int, fields: list[object]) -> bytes:
    return cbor2.dumps([tag, *fields], canonical=True)


def sign_alive(identity: Identity, incarnation: int, address: str, version: int, step: int,
               ready: bool, shard: int = 0, shards: int = 0, reachable: bool = True) -> Alive:
    """Our own announcement, signed.

    Raises:
        ValueError: a field out of its range (as :class:`~gossip.messages.Alive` says).
    """
    fields = [identity.peer_id, incarnation, address, version, step, ready, shard, shards,
              reachable]
    signature = identity.sign(CLAIM_CONTEXT + _body(Alive.TAG, fields))
    return Alive(*fields, key=identity.public_key, signature=signature)  # type: ignore[arg-type]


def sign_left(identity: Identity, incarnation: int) -> Left:
    """Our own departure, signed."""
    signature = identity.sign(CLAIM_CONTEXT + _body(Left.TAG, [identity.peer_id, incarnation]))
    return Left(identity.peer_id, incarnation, key=identity.public_key, signature=signature)


def proven(claim: Alive | Left) -> bool:
    """Whether ``claim`` is signed by the member it is about."""
    return (peer_id_from_public_key(claim.key) == claim.peer
            and verify_signature(claim.key, claim.signature, signed_bytes(claim)))


def row_claim(row: MemberState) -> Alive | Left:
    """The claim a table row's proof is for: the member's Left for a LEFT row, else its Alive
    with the row's fields. (Whether the proof holds is for :func:`proven` to say.)"""
    if row.state == MemberState.LEFT:
        return Left(row.peer, row.incarnation, key=row.key, signature=row.signature)
    return Alive(row.peer, row.incarnation, row.address, row.version, row.step, row.ready,
                 row.shard, row.shards, row.reachable, key=row.key, signature=row.signature)


def alive_row(alive: Alive) -> MemberState:
    """The ALIVE table row of ``alive``, carrying its proof (the inverse of
    :func:`row_claim`)."""
    return MemberState(alive.peer, alive.incarnation, MemberState.ALIVE, alive.address,
                       alive.version, alive.step, alive.ready, alive.shard, alive.shards,
                       alive.reachable, key=alive.key, signature=alive.signature)


class ClaimChecker:
    """Checks the proofs of one node's incoming claims, a datagram or a table at a time.

    Call :meth:`start` before each datagram or table, and :meth:`check` for each claim that
    would change the table. After one forged proof, :attr:`forged` is set and every later
    claim of the same datagram or table is refused unchecked (the caller stops there).
    """

    def __init__(self) -> None:
        self.checked = 0  # signatures verified, good or bad
        self.refused = 0  # claims refused: a forged proof, or after one
        self.forged = False

    def start(self) -> None:
        self.forged = False

    def check(self, claim: Alive | Left) -> bool:
        """Whether to apply ``claim``: True if its proof holds."""
        if not self.forged:
            self.checked += 1
            if proven(claim):
                return True
            self.forged = True
        self.refused += 1
        return False
