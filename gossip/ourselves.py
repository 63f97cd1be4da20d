"""Our own member record: what a node says of itself, signed, for :mod:`gossip.membership`.

Theory of operation
-------------------
Only a member raises its own incarnation, and only its signature makes an ``Alive`` or a
``Left`` about it count (:mod:`gossip.claims`). This holds that part of the membership: our
record, the ``Alive`` we last signed (:attr:`Ourselves.announcement`, queued for gossip each
time it changes) and, once we leave, our signed ``Left``. The incarnation goes up by one for
new metadata or a heartbeat, and past what someone holds of us when we refute: past their
claim when we signed it ourselves (an earlier run of ours), past our own incarnation when it
is anyone's word (a ``Suspect`` or ``Dead``), so that nobody can push it to where it cannot
go on (:data:`~gossip.messages.MAX_COUNT`, where announcements stop).

It also counts signed announcements of us from another address: :data:`CLASH_CLAIMS` of
them suggest another process with our identity key (:meth:`Ourselves.take_clash`).
"""

from __future__ import annotations

from .broadcast import BroadcastQueue
from .claims import sign_alive, sign_left
from .identity import Identity
from .member import State, _Record
from .messages import MAX_COUNT, MAX_SHARDS, Alive, Left, MemberState
from .wire import encode

__all__ = ["Ourselves", "CLASH_CLAIMS"]

CLASH_CLAIMS = 3  # claims to be us, from other addresses, that mark an identity clash


class Ourselves:
    """Our record and our signed claims. ``queue`` is where our announcements go."""

    def __init__(self, identity: Identity, address: str, now: float, queue: BroadcastQueue,
                 *, version: int, step: int, ready: bool, reachable: bool) -> None:
        self.identity = identity
        self.record = _Record(identity.peer_id, address, 0, State.ALIVE, version, step, ready,
                              now, now, reachable=reachable)
        self.announced = now  # when we last announced a new incarnation
        self.left: Left | None = None  # our Left, once we leave
        self._queue = queue
        self._foreign_claims = 0  # announcements of us, from elsewhere, that we had to refute
        self._claimed: str | None = None  # where they say we are, once they are many
        self.announcement: Alive = self._announce()

    @property
    def incarnation(self) -> int:
        return self.record.incarnation

    def _announce(self) -> Alive:
        me = self.record
        self.announcement = sign_alive(self.identity, me.incarnation, me.address, me.version,
                                       me.step, me.ready, me.shard, me.shards, me.reachable)
        self._queue.enqueue(me.peer, encode(self.announcement))
        return self.announcement

    def bump(self, now: float) -> None:
        """Announce our record at the next incarnation (new metadata, or a heartbeat)."""
        if self.record.incarnation < MAX_COUNT:
            self.record.incarnation += 1
            self.announced = now
            self._announce()

    def refute(self, incarnation: int) -> bool:
        """Out-announce ``incarnation`` (ours, or one we signed in an earlier run); False
        if it cannot be (it is the largest)."""
        if incarnation >= MAX_COUNT:
            return False
        self.record.incarnation = max(incarnation, self.record.incarnation) + 1
        self._announce()
        return True

    def leave(self) -> Left:
        """Sign our departure at our incarnation; our record goes LEFT in every table."""
        self.left = sign_left(self.identity, self.record.incarnation)
        return self.left

    def heard_from(self, address: str) -> None:
        """A signed announcement of us that we refute came from ``address``."""
        if address != self.record.address:
            self._foreign_claims += 1
            if self._foreign_claims >= CLASH_CLAIMS:
                self._claimed = address

    def take_clash(self) -> str | None:
        """See :meth:`gossip.membership.Membership.take_clash`."""
        claimed, self._claimed = self._claimed, None
        if claimed is not None:
            self._foreign_claims = 0
        return claimed

    def state(self) -> MemberState:
        """Our own row of a table: as last announced (a newer step not yet announced would
        contradict our own Alive at the same incarnation), and LEFT once leaving, or a member
        that missed our Left takes us back; proven by the claim it shows."""
        a = self.announcement
        proof = self.left or a
        state = State.LEFT if self.left else State.ALIVE
        return MemberState(a.peer, proof.incarnation, int(state), a.address, a.version, a.step,
                           a.ready, a.shard, a.shards, a.reachable, key=proof.key,
                           signature=proof.signature)

    def set_meta(self, now: float, meta_interval: float, *, step: int | None,
                 ready: bool | None, shard: int | None, shards: int | None,
                 reachable: bool | None) -> None:
        """See :meth:`gossip.membership.Membership.set_meta`."""
        me = self.record
        shard = me.shard if shard is None else shard
        shards = me.shards if shards is None else shards
        if not (0 <= shards <= MAX_SHARDS and 0 <= shard < max(shards, 1)):
            raise ValueError(f"shard {shard} of {shards}: expected 0 <= shard < shards <= "
                             f"{MAX_SHARDS}, or 0 of 0")
        if self.left is not None or me.incarnation >= MAX_COUNT:
            return  # announcing ourselves now would undo the departure, or cannot be done
        urgent = ((ready is not None and ready != me.ready)
                  or (reachable is not None and reachable != me.reachable)
                  or (shard, shards) != (me.shard, me.shards))
        if ready is not None:
            me.ready = ready
        if reachable is not None:
            me.reachable = reachable
        me.shard, me.shards = shard, shards
        if step is not None:
            me.step = step
        stale = me.step != self.announcement.step  # what the swarm last heard is behind
        if urgent or (stale and now - self.announced >= meta_interval):
            self.bump(now)
