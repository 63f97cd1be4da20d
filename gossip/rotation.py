"""Swarm key rotation: which of this node's two swarm keys each peer address holds.

Pure: no trio, no sockets, no clock.

Theory of operation
-------------------
A node mid-rotation holds the swarm's new key (:attr:`Swarm.key <gossip.handshake.Swarm>`)
and the key it replaces (:attr:`Swarm.previous`). It accepts either on everything it
receives: handshake message 1 is tried under one key and then the other, and so is a sealed
datagram. What it *sends* must reach three kinds of peer, and it cannot ask which one it
faces: peers not rotated yet (previous key only), peers mid-rotation (both) and peers that
finished (new key only). So it remembers, per peer address, what the peer has shown, and a
:class:`PeerKeys` turns that into what to send. Evidence, and the entry it leaves::

    evidence about address A                          A's entry afterwards
    a datagram from A opened under key                CURRENT
    a handshake we opened to A completed under key    CURRENT
    a datagram from A opened under previous           PREVIOUS, unless CURRENT or PREVIOUS_ONLY
    A closed after message 1 under key, then
      completed a handshake under previous            PREVIOUS_ONLY

and what each entry means for what we send::

    A's entry       datagrams to A sealed under     handshake to A tried under, then
    CURRENT         key                             key, previous
    PREVIOUS        key and previous (two)          previous, key
    PREVIOUS_ONLY   previous                        previous, key
    (none)          key and previous (two)          key, previous

"Then": a responder that cannot read message 1 closes the connection without a word
(:class:`~gossip.errors.HandshakeClosed`); the dialer then dials again under the other key,
once.

Why two datagrams where in doubt. A datagram under the previous key does not tell whether
its sender also holds the new key: a node mid-rotation seals under the previous key too. If
each node answered in the key it last heard, two nodes that first heard each other under the
previous key (one of them before the other restarted) would speak it to each other for ever,
and when one of them finished (dropped the previous key) it would lose every datagram from
the other until that one happened to hear it first. Sealing under both keys lets a node
mid-rotation hear the new key at once, and a CURRENT entry then stops the doubling. It costs
one extra datagram per datagram to each peer not yet known to hold the new key, for the
length of the rotation; a peer not rotated yet drops the extra one (and counts it in
``datagrams_rejected``).

CURRENT is sticky, and only a key's own holder can earn it: only a holder of the new key can
seal under it or complete a handshake under it. A later datagram under the previous key does
not demote it (a peer mid-rotation may be sealing under both). What this assumes: a peer that
has shown the new key keeps it until the rotation ends. Undo a rotation by rotating back (the
two keys swapped), never by giving a node that held the new key only the old one again: its
peers would go on sealing to it under the new key. A holder of the new key that forges UDP
source addresses can mark an address CURRENT; a node not rotated yet at that address then
misses our datagrams (we seal only under the new key) until the rotation reaches it: no worse
than the rotation without this module.

Bounds. At most :data:`MAX_ADDRESSES` entries, least recently used first out; a forgotten
address is treated as unknown (two datagrams; the new key first), which costs traffic, never
reachability. Entries are made only from evidence that authenticated under one of our keys,
so only key holders can make them, and never more than the bound. The memory is a hint for
what to send, never a reason to refuse what arrives.

A :class:`PeerKeys` lives on its :class:`~gossip.handshake.Swarm` (:attr:`Swarm.peer_keys`),
so that every dialer and the datagram sealer of a node share it; it is used only while the
swarm has a previous key. Each entry is a fact about the remote peer, not about us, so two
nodes in one process that share a Swarm may share one too.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["MAX_ADDRESSES", "Holds", "PeerKeys", "RotationStatistics"]

# Peer addresses remembered. An entry is about 200 bytes (the address string, the node of
# the ordered dict): 4096 of them cost under 1 MiB, and cover a swarm of that many members.
MAX_ADDRESSES = 4096


class Holds(enum.Enum):
    """What a peer address has shown of the keys it holds."""

    CURRENT = "current"  # it sealed or completed a handshake under the new key: it holds it
    PREVIOUS = "previous"  # it sealed under the previous key; it may hold the new one too
    PREVIOUS_ONLY = "previous only"  # it refused the new key and took the previous one


@dataclass(frozen=True)
class RotationStatistics:
    """Counters since the swarm object was made (that is, since the node started)."""

    addresses: int  # peer addresses remembered now (at most MAX_ADDRESSES)
    datagrams_previous: int  # datagrams that opened under the previous key
    handshakes_previous: int  # handshakes completed under the previous key, either side
    fallbacks: int  # dials refused under one key that then completed under the other


class PeerKeys:
    """Which key each peer address holds, as far as it has shown: see the module's theory of
    operation for the table of evidence and of what to send."""

    __slots__ = ("_entries", "_max", "_datagrams_previous", "_handshakes_previous",
                 "_fallbacks")

    def __init__(self, max_addresses: int = MAX_ADDRESSES) -> None:
        if max_addresses < 1:
            raise ValueError("max_addresses must be at least 1")
        self._entries: OrderedDict[str, Holds] = OrderedDict()
        self._max = max_addresses
        self._datagrams_previous = self._handshakes_previous = self._fallbacks = 0

    def __len__(self) -> int:
        return len(self._entries)

    def holds(self, address: str) -> Holds | None:
        """What ``address`` has shown; None if nothing (or it was forgotten)."""
        return self._entries.get(address)

    # -- evidence ------------------------------------------------------------------------

    def heard(self, address: str, *, previous: bool) -> None:
        """A datagram from ``address`` opened under the previous key (``previous``) or the
        current one."""
        if not previous:
            self._set(address, Holds.CURRENT)
            return
        self._datagrams_previous += 1
        if self._entries.get(address) in (Holds.CURRENT, Holds.PREVIOUS_ONLY):
            self._entries.move_to_end(address)  # stronger evidence stands
        else:
            self._set(address, Holds.PREVIOUS)

    def dialed(self, address: str, *, previous: bool, refused: bool) -> None:
        """A handshake we opened to ``address`` completed under the previous key
        (``previous``) or the current one, after ``address`` had refused the other key on
        this dial (``refused``)."""
        if refused:
            self._fallbacks += 1
        if not previous:
            self._set(address, Holds.CURRENT)
            return
        self._handshakes_previous += 1
        if refused:
            self._set(address, Holds.PREVIOUS_ONLY)
        elif address not in self._entries:  # a hint sent us there first: keep what it was
            self._set(address, Holds.PREVIOUS)
        else:
            self._entries.move_to_end(address)

    def answered(self, *, previous: bool) -> None:
        """A handshake a peer opened to us completed under the previous key (``previous``)
        or the current one. Counted only: the address a connection comes from is not the
        one the peer listens on, so it says nothing about where to send."""
        if previous:
            self._handshakes_previous += 1

    def _set(self, address: str, holds: Holds) -> None:
        self._entries[address] = holds
        self._entries.move_to_end(address)
        if len(self._entries) > self._max:
            self._entries.popitem(last=False)

    # -- what to send --------------------------------------------------------------------

    def seal_under(self, address: str) -> tuple[bool, ...]:
        """The keys to seal a datagram to ``address`` under, as ``previous`` flags, in the
        order to send them: one datagram per flag."""
        holds = self._entries.get(address)
        if holds is Holds.CURRENT:
            return (False,)
        if holds is Holds.PREVIOUS_ONLY:
            return (True,)
        return (False, True)

    def dial_previous_first(self, address: str) -> bool:
        """Whether a handshake to ``address`` should first be tried under the previous key."""
        return self._entries.get(address) in (Holds.PREVIOUS, Holds.PREVIOUS_ONLY)

    def statistics(self) -> RotationStatistics:
        return RotationStatistics(len(self._entries), self._datagrams_previous,
                                  self._handshakes_previous, self._fallbacks)
