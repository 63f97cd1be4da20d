"""The piggyback queue: membership updates waiting to ride on outgoing datagrams.

Theory of operation
-------------------
SWIM spreads updates (alive, suspect, dead, left) by piggybacking them on the datagrams a
node sends anyway (pings, acks, and the gossip datagrams of :mod:`gossip.membership`). Each
update is sent a limited number of times, ``retransmit_mult * ceil(log10(N + 1))`` for a
swarm of N members: enough for an epidemic to reach everyone with high probability, after
which it stops costing bandwidth. Updates sent fewer times go first (newest first among
equals), so fresh news overtakes old.

An update is keyed by the member it is about: a newer update about a member replaces the
queued one, whose news it supersedes.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math

__all__ = ["BroadcastQueue", "retransmit_limit", "PART_OVERHEAD"]

PART_OVERHEAD = 3  # CBOR header bytes of one part inside a Packet (bytes of length < 65536)


def retransmit_limit(retransmit_mult: int, members: int) -> int:
    """How many times each update is sent in a swarm of ``members``."""
    return retransmit_mult * max(1, math.ceil(math.log10(members + 1)))


class BroadcastQueue:
    """Updates to piggyback, each sent at most :func:`retransmit_limit` times."""

    __slots__ = ("retransmit_mult", "_items", "_order")

    def __init__(self, retransmit_mult: int) -> None:
        self.retransmit_mult = retransmit_mult
        self._items: dict[str, list] = {}  # key -> [transmits, -order, payload]
        self._order = 0

    def __len__(self) -> int:
        return len(self._items)

    def enqueue(self, key: str, payload: bytes) -> None:
        """Queue ``payload`` (an encoded message) about member ``key``, replacing older news
        about the same member."""
        self._order += 1
        self._items[key] = [0, -self._order, payload]

    def take(self, budget: int, members: int, limit: int = 2**31) -> list[bytes]:
        """Up to ``limit`` payloads whose parts fit in ``budget`` bytes, least sent first.
        Each one taken counts as sent once; one sent its full quota leaves the queue."""
        if not self._items or budget <= PART_OVERHEAD or limit <= 0:
            return []
        quota = retransmit_limit(self.retransmit_mult, members)
        taken: list[bytes] = []
        for key, item in sorted(self._items.items(), key=lambda kv: (kv[1][0], kv[1][1])):
            cost = len(item[2]) + PART_OVERHEAD
            if cost > budget:
                continue
            budget -= cost
            taken.append(item[2])
            item[0] += 1
            if item[0] >= quota:
                del self._items[key]
            if len(taken) >= limit or budget <= PART_OVERHEAD:
                break
        return taken

    def clear(self) -> None:
        self._items.clear()
