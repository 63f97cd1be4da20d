"""The vocabulary of membership: member states and what a node knows of a member. The timing
knobs, :class:`MembershipConfig` with memberlist's LAN and WAN profiles, are declared with the
other settings in :mod:`gossip.config`.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass
from typing import Callable

from .config import MembershipConfig
from .identity import PeerId
from .messages import MemberState

__all__ = ["State", "Member", "MembershipConfig", "PeerPool"]


class State(enum.IntEnum):
    ALIVE = MemberState.ALIVE
    SUSPECT = MemberState.SUSPECT
    DEAD = MemberState.DEAD
    LEFT = MemberState.LEFT


@dataclass(frozen=True)
class Member:
    """One member as this node sees it."""

    peer: PeerId
    address: str
    incarnation: int
    state: State
    version: int  # its protocol version
    step: int  # its training step when it last announced itself
    ready: bool  # whether it takes part in averaging
    since: float  # when this node last saw its state change
    heard: float = 0.0  # when this node took its latest announcement (``step`` is as of then)
    shard: int = 0  # the data shard it trains on, in [0, shards)
    shards: int = 0  # how many shards that data is cut into; 0: it announces none
    reachable: bool = True  # False: outbound only (behind a NAT): never dialed nor probed


class PeerPool:
    """A set of peer ids with O(1) add, remove and uniform random choice."""

    __slots__ = ("items", "_index")

    def __init__(self) -> None:
        self.items: list[PeerId] = []
        self._index: dict[PeerId, int] = {}

    def __len__(self) -> int:
        return len(self.items)

    def add(self, peer: PeerId) -> None:
        if peer not in self._index:
            self._index[peer] = len(self.items)
            self.items.append(peer)

    def discard(self, peer: PeerId) -> None:
        i = self._index.pop(peer, None)
        if i is not None:
            last = self.items.pop()
            if last != peer:
                self.items[i] = last
                self._index[last] = i

    def sample(self, rng: random.Random, k: int, accept: Callable[[PeerId], bool]) -> list[PeerId]:
        """Up to ``k`` distinct members that ``accept`` passes, uniformly at random.
        Rejection sampling first (cheap when most pass), then an exact scan."""
        chosen: list[PeerId] = []
        if k <= 0 or not self.items:
            return chosen
        for _ in range(4 * k):
            peer = self.items[rng.randrange(len(self.items))]
            if peer not in chosen and accept(peer):
                chosen.append(peer)
                if len(chosen) == k:
                    return chosen
        rest = [p for p in self.items if p not in chosen and accept(p)]
        return chosen + rng.sample(rest, min(k - len(chosen), len(rest)))


@dataclass
class _Record:
    peer: PeerId
    address: str
    incarnation: int
    state: State
    version: int
    step: int
    ready: bool
    since: float
    heard: float
    shard: int = 0
    shards: int = 0
    reachable: bool = True
    # The proof of the member's own claim that the incarnation comes from (gossip.claims):
    # its Left once LEFT, else its Alive with the fields above. Our own record has none.
    key: bytes = b""
    signature: bytes = b""

    def view(self) -> Member:
        return Member(self.peer, self.address, self.incarnation, self.state, self.version,
                      self.step, self.ready, self.since, self.heard, self.shard, self.shards,
                      self.reachable)


@dataclass
class _Counters:
    probes: int = 0
    probes_failed: int = 0
    suspicions: int = 0  # members this node started suspecting
    refutations: int = 0  # suspicions or deaths of ourselves we refuted
    deaths: int = 0  # members this node declared dead itself
    datagrams_sent: int = 0
    bytes_sent: int = 0
    datagrams_received: int = 0
    bytes_received: int = 0
    malformed: int = 0  # datagrams the driver could not open or decode
    push_pulls: int = 0
