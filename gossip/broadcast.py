"""The piggyback queue: membership updates waiting to ride on outgoing datagrams.

Theory of operation
-------------------
SWIM spreads updates (alive, suspect, dead, left) by piggybacking them on the datagrams a
node sends anyway (pings, acks, and the gossip datagrams of :mod:`gossip.membership`). Each
update is sent a limited number of times, ``retransmit_mult * ceil(log10(N + 1))`` for a
swarm of N members: enough for an epidemic to reach everyone with high probability, after
which it stops costing bandwidth. Updates sent fewer times go first (among equals, the most
recently queued or sent), so fresh news overtakes old.

An update is keyed by the member it is about: a newer update about a member replaces the
queued one, whose news it supersedes.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import itertools
import math

__all__ = ["BroadcastQueue", "retransmit_limit", "PART_OVERHEAD"]

PART_OVERHEAD = 3  # CBOR header bytes of one part inside a Packet (bytes of length < 65536)
MAX_SCAN = 256  # updates one take() looks at, at most (it stops far sooner when they fit)


def retransmit_limit(retransmit_mult: int, members: int) -> int:
    """How many times each update is sent in a swarm of ``members``."""
    return retransmit_mult * max(1, math.ceil(math.log10(members + 1)))


class BroadcastQueue:
    """Updates to piggyback, each sent at most :func:`retransmit_limit` times.

    Kept in buckets by how often each was sent, newest last within a bucket, so taking the
    next few costs about as much as the few taken, however long the queue (a node that has
    just merged a big table may hold thousands).
    """

    __slots__ = ("retransmit_mult", "_buckets", "_where")

    def __init__(self, retransmit_mult: int) -> None:
        self.retransmit_mult = retransmit_mult
        self._buckets: list[dict[str, bytes]] = [{}]  # [times sent] -> key -> payload
        self._where: dict[str, int] = {}  # key -> its bucket

    def __len__(self) -> int:
        return len(self._where)

    def enqueue(self, key: str, payload: bytes) -> None:
        """Queue ``payload`` (an encoded message) about member ``key``, replacing older news
        about the same member."""
        sent = self._where.pop(key, None)
        if sent is not None:
            del self._buckets[sent][key]
        self._buckets[0][key] = payload
        self._where[key] = 0

    def take(self, budget: int, members: int, limit: int = 2**31) -> list[bytes]:
        """Up to ``limit`` payloads whose parts fit in ``budget`` bytes, least sent first and,
        among equals, the most recently queued or sent first. Each one taken counts as sent once; one sent its full
        quota leaves the queue. Looks at no more than :data:`MAX_SCAN` updates."""
        if not self._where or budget <= PART_OVERHEAD or limit <= 0:
            return []
        quota = retransmit_limit(self.retransmit_mult, members)
        chosen: list[tuple[str, int, bytes]] = []
        scanned = 0
        for sent, bucket in enumerate(self._buckets):
            for key, payload in itertools.islice(reversed(bucket.items()), MAX_SCAN - scanned):
                scanned += 1
                cost = len(payload) + PART_OVERHEAD
                if cost <= budget:
                    budget -= cost
                    chosen.append((key, sent, payload))
                    if len(chosen) >= limit or budget <= PART_OVERHEAD:
                        break
            if len(chosen) >= limit or budget <= PART_OVERHEAD or scanned >= MAX_SCAN:
                break
        for key, sent, payload in chosen:
            del self._buckets[sent][key]
            if sent + 1 >= quota:
                del self._where[key]
                continue
            if sent + 1 == len(self._buckets):
                self._buckets.append({})
            self._buckets[sent + 1][key] = payload
            self._where[key] = sent + 1
        return [payload for _, _, payload in chosen]

    def clear(self) -> None:
        self._buckets = [{}]
        self._where.clear()
