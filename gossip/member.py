"""The vocabulary of membership: member states, what a node knows of a member, and the
timing knobs (:class:`MembershipConfig`, with memberlist's LAN and WAN profiles).
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass
from typing import Callable

from .identity import PeerId
from .messages import MemberState

__all__ = ["State", "Member", "MembershipConfig", "PeerPool"]


class State(enum.IntEnum):
    ALIVE = MemberState.ALIVE
    SUSPECT = MemberState.SUSPECT
    DEAD = MemberState.DEAD
    LEFT = MemberState.LEFT


@dataclass(frozen=True)
class MembershipConfig:
    """Membership timing. The defaults are memberlist's LAN profile; :meth:`wan` is its WAN
    profile. N below is the number of members believed alive, this node included."""

    probe_interval: float = 1.0  # s; one probe per period, times (local health score + 1)
    probe_timeout: float = 0.5  # s; wait for a direct Ack before asking helpers; same scaling
    indirect_checks: int = 3  # helpers asked to probe a silent member for us
    suspicion_mult: float = 4.0  # min suspicion timeout = mult * max(1, log10 N) * probe_interval
    suspicion_max_mult: float = 6.0  # max suspicion timeout = this * min (Lifeguard)
    retransmit_mult: int = 4  # each update is sent mult * ceil(log10(N + 1)) times
    awareness_max: int = 8  # local health score cap: timeouts stretch at most (max + 1) times
    gossip_interval: float = 0.2  # s between gossip rounds while updates are queued
    gossip_nodes: int = 3  # members each gossip round sends to
    gossip_to_the_dead: float = 30.0  # s after its death a member still receives gossip
    push_pull_interval: float = 30.0  # s; times ceil(log2(N / 32)) + 1 above 32 members
    reconnect_interval: float = 10.0  # s between push-pulls with a random dead member
    reap_after: float = 3600.0  # s a dead or departed member is remembered, then forgotten
    meta_interval: float = 30.0  # s; a changed training step is re-announced at most this often
    join_retry_min: float = 1.0  # s; first wait after no bootstrap address answered
    join_retry_max: float = 30.0  # s; the wait doubles up to this
    push_pull_timeout: float = 10.0  # s; a whole push-pull exchange, dial to last page
    leave_timeout: float = 2.0  # s a leaving node keeps gossiping its departure

    def __post_init__(self) -> None:
        positive = ("probe_interval", "probe_timeout", "suspicion_mult", "gossip_interval",
                    "push_pull_interval", "reconnect_interval", "reap_after", "meta_interval",
                    "join_retry_min", "push_pull_timeout")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"membership.{name} must be > 0")
        if self.probe_timeout >= self.probe_interval:
            raise ValueError("membership.probe_timeout must be shorter than probe_interval")
        if self.suspicion_max_mult < 1:
            raise ValueError("membership.suspicion_max_mult must be >= 1")
        if self.join_retry_max < self.join_retry_min:
            raise ValueError("membership.join_retry_max must be >= join_retry_min")
        for name in ("indirect_checks", "retransmit_mult", "awareness_max", "gossip_nodes"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 0:
                raise ValueError(f"membership.{name} must be an integer >= 0")
        if self.gossip_to_the_dead < 0 or self.leave_timeout < 0:
            raise ValueError("membership.gossip_to_the_dead and leave_timeout must be >= 0")

    @classmethod
    def lan(cls) -> "MembershipConfig":
        """memberlist's LAN profile (the default): fast detection on a low-latency network."""
        return cls()

    @classmethod
    def wan(cls) -> "MembershipConfig":
        """memberlist's WAN profile: slower, more patient, for nodes across the internet."""
        return cls(
            probe_interval=5.0, probe_timeout=3.0, suspicion_mult=6.0, gossip_interval=0.5,
            gossip_nodes=4, gossip_to_the_dead=60.0, push_pull_interval=60.0,
            reconnect_interval=30.0, push_pull_timeout=30.0, leave_timeout=5.0,
        )


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
