"""Swarm membership as a pure state machine: SWIM with Lifeguard's refinements.

Theory of operation
-------------------
Each node keeps a table of members, each ALIVE, SUSPECT, DEAD or LEFT at an incarnation
number, and runs these timers (all times are passed in; nothing here does I/O):

* **Probe**, once per protocol period: ``Ping`` the next member of a shuffled round-robin
  list, then ask ``indirect_checks`` others to (``PingReq``); no ``Ack`` by the end of the
  period: *suspect* the member. A suspicion not refuted before its Lifeguard timeout
  (:mod:`gossip.suspicion`) makes the member *dead*.
* **Verification**, every period while we hold a suspicion, starting 1 to 2 periods after it
  began: ping the suspect with the suspicion attached. A live suspect refutes and answers the
  teller with its current Alive directly, so a member that missed a refutation gets it
  anyway; an Ack restarts our timer (a suspicion stands only while the suspect is silent); a
  ping left unanswered for a period is our own confirmation (:mod:`gossip.probing` says why).
* **Gossip**, every ``gossip_interval`` while updates are queued: send them to
  ``gossip_nodes`` random members (recently dead ones included, so they can refute).
* **Push-pull**, every ``push_pull_interval`` (scaled up above 32 members), and once more a
  few periods after joining: swap full member tables with a random member over a secure
  channel, so a node that missed gossip catches up. Every ``reconnect_interval`` the same with
  a random *dead* member, so the halves of a healed partition find each other again.

Updates (Alive, Suspect, Dead, Left) are piggybacked on every datagram, each sent
``retransmit_mult * ceil(log10(N + 1))`` times (:mod:`gossip.broadcast`). Precedence, per
member: a higher incarnation wins; at equal incarnation LEFT > DEAD > SUSPECT > ALIVE. Only
a member raises its own incarnation, and it signs its Alive and Left (:mod:`gossip.claims`):
one whose proof fails is refused, and ends the datagram or table it came in. A Suspect or
Dead, anyone's word, applies at most at the incarnation the member signed, so the member's
next Alive out-ranks it. A member *refutes* a suspicion or death about itself by announcing
Alive at its own incarnation + 1, or above an incarnation it signed itself, in an earlier run
(a restarted node that hears of its old self; :mod:`gossip.ourselves`). Two processes with
one identity at two addresses refute each other for ever, each announcement out-bidding the
other's; a restarted node refutes its old self once or twice at most. So signed claims to be
us from addresses not ours suggest an identity clash (:meth:`Membership.take_clash`), which
the driver checks by dialing them as ourselves. Full tables are merged as memberlist does: a
remote DEAD becomes a local *suspicion* (the sender's view may be stale; the member can still
refute), a remote LEFT (signed) is final.

Lifeguard's local health, a score in ``0..awareness_max``, rises when our probes fail without
the helpers' Nacks that would show our own network is fine, and when we must refute a
suspicion about ourselves; probe interval and timeout are multiplied by ``score + 1``, so a
node that is itself slow probes less aggressively and waits longer before it accuses anyone.

Probing (the probe cycle, verification, the helper's side of a ``PingReq``, the local
health) is a :class:`~gossip.probing.Prober` that the membership owns: it keeps the probe
state and returns effects (datagrams to send, our own suspicions) for the membership to
carry out; suspicions and the member table are the membership's alone.

The driver (:mod:`gossip.roster`) feeds :meth:`Membership.receive` with datagram plaintext and
:meth:`Membership.merge` with push-pull tables, calls :meth:`Membership.tick` no later than
:meth:`Membership.next_deadline`, and carries out the returned effects (:mod:`gossip.effects`).

Transitions of a member record (``inc`` the record's incarnation, ``i`` the message's)::

    message        current state           condition      new state
    Alive(i)       unknown                 proven         ALIVE at i (added)
    Alive(i)       any                     i > inc,       ALIVE at i
                                           proven
    Suspect(i)     ALIVE                   i >= inc       SUSPECT at inc (timer starts)
    Suspect(i)     SUSPECT                 i >= inc       SUSPECT (confirmation counted)
    Dead(i)        ALIVE, SUSPECT          i >= inc       DEAD at inc
    Left(i)        ALIVE, SUSPECT, DEAD    i >= inc,      LEFT at i
                                           proven
    timer fires    SUSPECT                 -              DEAD
    anything else                                         unchanged

"Proven": signed by the member (:func:`gossip.claims.proven`), checked only where the row
would otherwise apply. About ourselves: Suspect/Dead(i >= inc) is refuted with
Alive(inc + 1); a proven Left(i >= inc), or a proven Alive(i >= inc) that is not exactly what
we announced, with Alive(max(i, inc) + 1); nothing is refuted once we leave.
"""

from __future__ import annotations

import math
import random
from typing import Iterable

from .broadcast import PART_OVERHEAD, BroadcastQueue, retransmit_limit
from .claims import ClaimChecker, row_claim
from .config import MembershipConfig
from .effects import Changed, Effect, PushPullWith, Send
from .errors import WireError
from .identity import Identity, PeerId
from .member import Member, PeerPool, State, _Counters, _Record
from .ourselves import Ourselves
from .messages import (MAX_COUNT, MAX_PARTS, MAX_SHARDS, Ack, Alive, Dead, Left, MemberState,
                       Message, Nack, Packet, Ping, PingReq, Suspect)
from .probing import Answered, Datagram, Prober, ProbeEffect, Silent, Suspected
from .seal import SEAL_OVERHEAD
from .suspicion import Suspicion, suspicion_bounds
from .wire import MAX_DATAGRAM, decode, encode

__all__ = ["MembershipConfig", "Membership", "Member", "State", "Send", "PushPullWith",
           "Changed", "Effect", "MAX_MEMBERS", "MAX_PACKET"]

MAX_MEMBERS = 16384  # members a table holds; news of more is ignored until some are reaped
JOIN_CATCH_UP = 5  # periods after a join until a second push-pull
LEAVE_FANOUT = 256  # members a leaving node tells directly, one datagram each
MAX_PACKET = MAX_DATAGRAM - SEAL_OVERHEAD  # plaintext bytes of one datagram
_PACKET_OVERHEAD = 40  # Packet's array, tag and sender id around its parts


class Membership:
    """The membership state of one node. See the module docstring.

    Args:
        identity: our node identity: our peer id, and the key we sign our Alive and Left with.
        address: where others reach us (datagrams and channels).
        now: the current time.
        config: timing.
        rng: the only source of randomness (seed it in tests).
        version, step, ready: our metadata.
    """

    def __init__(self, identity: Identity, address: str, now: float,
                 config: MembershipConfig = MembershipConfig(), rng: random.Random | None = None,
                 *, version: int = 1, step: int = 0, ready: bool = False,
                 reachable: bool = True) -> None:
        self.me = identity.peer_id
        self.config = config
        self.rng = rng or random.Random()
        self.leaving = False
        self.counters = _Counters()
        self.claims = ClaimChecker()  # checks the proofs of others' Alive and Left
        self._members: dict[PeerId, _Record] = {}
        self._up = PeerPool()  # members ALIVE or SUSPECT
        self._recently_dead: list[PeerId] = []  # declared dead within gossip_to_the_dead
        self._answered: set[str] = set()  # sources answered with our announcement, per datagram
        self._prober = Prober(self.me, now, config, self.rng, self._members, self._up,
                              self.counters, self._reap)
        self._suspicions: dict[PeerId, Suspicion] = {}
        self._broadcasts = BroadcastQueue(config.retransmit_mult)
        self._ours = Ourselves(identity, address, now, self._broadcasts, version=version,
                               step=step, ready=ready, reachable=reachable)
        self._self = self._ours.record
        self._effects: list[Effect] = []
        # Spread the first timers over one interval so that nodes started together do not
        # gossip and push-pull in lockstep (the prober does the same with its probes).
        self._next_gossip = now
        self._next_push_pull = now + self.rng.random() * config.push_pull_interval
        self._next_reconnect = now + self.rng.random() * config.reconnect_interval

    # ---- queries ----------------------------------------------------------------------

    @property
    def incarnation(self) -> int:
        return self._self.incarnation

    @property
    def awareness(self) -> int:
        """Lifeguard's local health score: 0 healthy, up to ``awareness_max``."""
        return self._prober.awareness

    @property
    def pending_broadcasts(self) -> int:
        return len(self._broadcasts)

    def take_clash(self) -> str | None:
        """The address that :data:`~gossip.ourselves.CLASH_CLAIMS` announcements of us,
        signed with our key at or above our incarnation, came from, once (then counting starts
        again), or None. A hint: a restarted node that hears of its earlier run at another
        address counts it too, so the driver checks it (dials it as ourselves)."""
        return self._ours.take_clash()

    def myself(self) -> Member:
        return self._self.view()

    def get(self, peer: str) -> Member | None:
        record = self._members.get(peer)  # type: ignore[call-overload]
        return record.view() if record else None

    def members(self) -> list[Member]:
        """Every member we know of, ourselves excluded, in any state."""
        return [r.view() for r in self._members.values()]

    def alive_count(self) -> int:
        """N: members believed up, ourselves included."""
        return 1 + len(self._up)

    def full_state(self) -> list[MemberState]:
        """Our whole table, ourselves included, for a push-pull."""
        return [self.own_state(), *(_member_state(r) for r in self._members.values())]

    def own_state(self) -> MemberState:
        """Our own record, as :meth:`full_state` starts with it (:meth:`Ourselves.state`)."""
        return self._ours.state()

    def next_deadline(self) -> float:
        """The latest time :meth:`tick` must be called again."""
        deadlines = [self._next_push_pull, self._next_reconnect,
                     *self._prober.deadlines(overdue=not self.leaving and self._self.reachable)]
        if not self.leaving:
            deadlines.append(self._prober.next_probe)
            if not self._self.reachable and self._self.incarnation < MAX_COUNT:
                deadlines.append(self._ours.announced + self.config.meta_interval)  # heartbeat
        if self._broadcasts:
            deadlines.append(self._next_gossip)
        deadlines.extend(s.deadline for s in self._suspicions.values())
        return min(deadlines)

    # ---- inputs -----------------------------------------------------------------------

    def tick(self, now: float) -> list[Effect]:
        """Run every timer that is due."""
        self._carry_out(now, self._prober.expire(now))
        for peer in [p for p, s in self._suspicions.items() if s.deadline <= now]:
            record = self._members[peer]
            self.counters.deaths += 1
            self._on_dead(now, Dead(peer, record.incarnation, self.me))
        self._carry_out(now, self._prober.tick(now))
        if not self.leaving:
            self._carry_out(now, self._prober.start(now))
        # After the probe: a probe that just failed starts a suspicion due for verification now.
        self._carry_out(now, self._prober.verify(now))
        if not self.leaving:
            self._keep_alive(now)
        if now >= self._next_gossip and self._broadcasts:
            self._next_gossip = now + self.config.gossip_interval
            self._gossip(now)
        if now >= self._next_push_pull:
            self._next_push_pull = now + self._push_pull_interval()
            candidates = [r for r in self._members.values()
                          if r.state == State.ALIVE and r.reachable]
            if candidates and not self.leaving:
                chosen = self.rng.choice(candidates)
                self._effects.append(PushPullWith(chosen.address, chosen.peer))
        if now >= self._next_reconnect:
            self._next_reconnect = now + self.config.reconnect_interval
            self._reap(now)
            dead = [r for r in self._members.values() if r.state == State.DEAD and r.reachable]
            if dead and not self.leaving:
                chosen = self.rng.choice(dead)
                self._effects.append(PushPullWith(chosen.address, chosen.peer))
        return self._drain()

    def receive(self, now: float, source: str, data: bytes) -> list[Effect]:
        """Handle the plaintext of one datagram from ``source``.

        Raises:
            WireError: it is not a valid Packet of valid messages; nothing was applied.
        """
        packet = decode(data)
        if not isinstance(packet, Packet):
            raise WireError(f"expected a membership Packet, got {type(packet).__name__}")
        messages = [decode(part) for part in packet.parts]
        if packet.sender == self.me:
            return []  # our own datagram came back (a misrouted address)
        self.counters.datagrams_received += 1
        self.counters.bytes_received += len(data) + SEAL_OVERHEAD
        self._answered: set[str] = set()
        self.claims.start()
        for message in messages:
            self._dispatch(now, source, message, packet.sender)
            if self.claims.forged:
                break  # a forger's datagram: nothing more of it is applied (gossip.claims)
        return self._drain()

    def merge(self, now: float, records: Iterable[MemberState], peer: str) -> list[Effect]:
        """Merge a full table that ``peer`` sent in a push-pull. A forged proof ends the merge:
        the channel proved who sent it (:mod:`gossip.claims`)."""
        self.counters.push_pulls += 1
        by = PeerId(peer)
        self.claims.start()
        for r in records:
            claim = row_claim(r)
            if isinstance(claim, Left):
                self._on_left(now, claim)
            elif r.state == State.ALIVE:
                self._on_alive(now, claim)
            elif r.peer == self.me and r.incarnation > self.incarnation:
                # An earlier run of ours, held SUSPECT or DEAD at the incarnation its own
                # Alive proves: out-announce that (a restarted node taking its place back).
                if self.claims.check(claim):
                    self._refute(r.incarnation, counts_against_health=True)
            else:  # SUSPECT or DEAD: suspect it ourselves, if we know it; it may still refute
                # (a member we never knew, or forgot, stays forgotten: news of its death is
                # no reason to bring it back)
                self._on_suspect(now, Suspect(r.peer, r.incarnation, by))
            if self.claims.forged:
                break
        return self._drain()

    def joined(self, now: float) -> None:
        """A join push-pull succeeded. Swap tables once more with a random member a few
        periods from now: a node that joins amid a burst of joins may miss some of the others'
        announcements (each is gossiped a bounded number of times), and this catches it up
        long before the next periodic push-pull."""
        self._next_push_pull = min(self._next_push_pull, now + JOIN_CATCH_UP * self.config.probe_interval)

    def leave(self, now: float) -> list[Effect]:
        """Announce that we leave for good. We stop probing, and never refute again."""
        if not self.leaving:
            self.leaving = True
            self._prober.abandon()
            left = encode(self._ours.leave())
            self._broadcasts.enqueue(self.me, left)
            # Told to up to LEAVE_FANOUT members at once, not only gossiped: gossip misses one
            # now and then (1 in 60 swarms of 64), who would take the leave for a failure.
            up = self._up.sample(self.rng, LEAVE_FANOUT, lambda p: self._members[p].reachable)
            for peer in up:
                self._emit(self._members[peer].address, (left,))
            self._next_gossip = now
            self._gossip(now)
            self._next_gossip = now + self.config.gossip_interval
        return self._drain()

    def report_failure(self, now: float, peer: str) -> list[Effect]:
        """Evidence from elsewhere (a failed exchange) that ``peer`` may be down: probe it
        soon, out of turn. Evidence is never a verdict; only the probe is."""
        record = self._members.get(peer)  # type: ignore[call-overload]
        if record is None or record.state > State.SUSPECT or self.leaving or not record.reachable:
            return []
        self._prober.probe_soon(now, record.peer)
        return self._drain()

    def set_meta(self, now: float, *, step: int | None = None, ready: bool | None = None,
                 shard: int | None = None, shards: int | None = None,
                 reachable: bool | None = None) -> list[Effect]:
        """Update our metadata. A change of ``ready``, of the data shard (``shard`` of
        ``shards``; ``shards`` 0: none) or of whether others can reach us is announced at once;
        a new ``step`` rides on the next announcement, or is announced after ``meta_interval``.

        Raises:
            ValueError: ``shard`` is not in ``[0, shards)`` (0 when ``shards`` is 0), or
                ``shards`` is above MAX_SHARDS.
        """
        self._ours.set_meta(now, self.config.meta_interval, step=step, ready=ready,
                            shard=shard, shards=shards, reachable=reachable)
        return self._drain()

    # ---- message handlers -------------------------------------------------------------

    def _dispatch(self, now: float, source: str, message: Message, sender: str) -> None:
        if isinstance(message, (Suspect, Dead, Left)) and message.peer == self.me:
            # Whoever tells us we are suspect or dead holds a wrong picture of us: refute if
            # it is news, and either way answer the teller with our current announcement
            # directly, so that a member that missed our refutation still gets it (it may
            # be the one whose timer would otherwise declare us dead).
            {Suspect: self._on_suspect, Dead: self._on_dead, Left: self._on_left}[
                type(message)](now, message)  # type: ignore[operator]
            if not self.leaving and source not in self._answered and not self.claims.forged:
                self._answered.add(source)
                self._send(source, [encode(self._ours.announcement)])
        elif isinstance(message, Ping):
            if message.target == self.me:
                self._carry_out(now, self._prober.answer(now, source, message, sender))
        elif isinstance(message, Ack):
            self._carry_out(now, self._prober.on_ack(message.seq))
        elif isinstance(message, Nack):
            self._prober.on_nack(message.seq)
        elif isinstance(message, PingReq):
            self._carry_out(now, self._prober.help(now, source, message))
        elif isinstance(message, Alive):
            self._on_alive(now, message)
        elif isinstance(message, Suspect):
            self._on_suspect(now, message)
        elif isinstance(message, Dead):
            self._on_dead(now, message)
        elif isinstance(message, Left):
            self._on_left(now, message)
        else:  # a valid message that has no business in a datagram
            self.counters.malformed += 1

    def _on_alive(self, now: float, m: Alive) -> None:
        # Each branch checks the proof only once the claim would change something.
        if m.peer == self.me:
            # Our own announcement coming back is no news; anything else at our incarnation
            # or above, signed with our key, is an earlier run of ours (or a clash).
            if m.incarnation > self.incarnation or (
                m.incarnation == self.incarnation and m != self._ours.announcement
            ):
                if not self.claims.check(m):
                    return
                self._ours.heard_from(m.address)
                self._refute(m.incarnation, counts_against_health=False)
            return
        record = self._members.get(m.peer)  # type: ignore[call-overload]
        if record is None:
            if len(self._members) >= MAX_MEMBERS or not self.claims.check(m):
                return
            peer = PeerId(m.peer)
            record = _Record(peer, m.address, m.incarnation, State.ALIVE, m.version, m.step,
                             m.ready, now, now, m.shard, m.shards, m.reachable)
            self._members[peer] = record
            self._up.add(peer)
            self._prober.add(peer)  # probed this round
        elif m.incarnation > record.incarnation:
            if not self.claims.check(m):
                return
            if record.state != State.ALIVE:
                record.since = now
            record.state = State.ALIVE
            self._up.add(record.peer)
            record.incarnation = m.incarnation
            record.address, record.version = m.address, m.version
            record.step, record.ready, record.heard = m.step, m.ready, now
            record.shard, record.shards, record.reachable = m.shard, m.shards, m.reachable
            self._forget_suspicion(record.peer)
        else:
            return
        record.key, record.signature = m.key, m.signature
        self._broadcasts.enqueue(record.peer, encode(m))
        self._effects.append(Changed(record.view()))

    def _applies(self, m: Suspect | Dead | Left, below: State, *, health: bool) -> _Record | None:
        """The record a Suspect, Dead or Left updates, if it does: a member we know, at
        ``m.incarnation`` or below it, in a state lower than ``below``, and for a Left a proof
        that holds. About ourselves, a claim at our incarnation or above is refuted instead
        (``health``: it counts against our local health): a Left of ours (an earlier run's)
        above it, an unsigned Suspect or Dead at our own incarnation + 1 whatever it says, so
        that nobody but us moves our incarnation."""
        signed = isinstance(m, Left)
        if m.peer == self.me:
            if m.incarnation >= self.incarnation and (not signed or self.claims.check(m)):
                self._refute(m.incarnation if signed else self.incarnation,
                             counts_against_health=health)
            return None
        record = self._members.get(m.peer)  # type: ignore[call-overload]
        if record is None or m.incarnation < record.incarnation or record.state >= below:
            return None
        if signed and not self.claims.check(m):
            return None
        return record

    @staticmethod
    def _at(record: _Record, m: Suspect | Dead) -> Suspect | Dead:
        """``m`` at the record's incarnation: one above it is nobody's to claim but the
        member's, who signed the record's (PROTOCOL.md section 8.6). So the member's next
        Alive out-ranks whatever anyone says of it."""
        if m.incarnation == record.incarnation:
            return m
        return type(m)(m.peer, record.incarnation, m.by)

    def _on_suspect(self, now: float, m: Suspect) -> None:
        record = self._applies(m, State.DEAD, health=True)
        if record is None:
            return
        m = self._at(record, m)  # type: ignore[assignment]
        suspicion = self._suspicions.get(record.peer)
        if suspicion is not None:
            if suspicion.confirm(m.by):
                self._broadcasts.enqueue(record.peer, encode(m))
            return
        if m.by == self.me:
            self.counters.suspicions += 1
        record.state, record.since = State.SUSPECT, now
        n = self.alive_count()
        expected = int(self.config.suspicion_mult) - 2
        if n - 2 < expected:
            expected = 0
        low, high = suspicion_bounds(n, self.config.probe_interval, self.config.suspicion_mult,
                                     self.config.suspicion_max_mult)
        self._suspicions[record.peer] = Suspicion(now, m.by, expected, low, high)
        # See for ourselves, a little later (an outbound-only suspect cannot be pinged: it
        # hears our verdict in the answer to its own ping, Prober.answer).
        if record.reachable:
            self._prober.verify_later(now, record.peer)
        self._broadcasts.enqueue(record.peer, encode(m))
        self._effects.append(Changed(record.view()))

    def _on_dead(self, now: float, m: Dead) -> None:
        record = self._applies(m, State.DEAD, health=True)
        if record is None:
            return
        m = self._at(record, m)  # type: ignore[assignment]
        self._set_down(now, record, State.DEAD, m.incarnation)
        self._recently_dead.append(record.peer)
        self._broadcasts.enqueue(record.peer, encode(m))

    def _on_left(self, now: float, m: Left) -> None:
        record = self._applies(m, State.LEFT, health=False)
        if record is None:
            return
        self._set_down(now, record, State.LEFT, m.incarnation)
        record.key, record.signature = m.key, m.signature
        self._broadcasts.enqueue(record.peer, encode(m))

    def _set_down(self, now: float, record: _Record, state: State, incarnation: int) -> None:
        record.state, record.incarnation, record.since = state, incarnation, now
        self._up.discard(record.peer)
        self._forget_suspicion(record.peer)
        self._prober.forget(record.peer)
        self._effects.append(Changed(record.view()))

    def _refute(self, incarnation: int, *, counts_against_health: bool) -> None:
        """Someone holds an outdated or false view of us: out-announce ``incarnation``, ours
        or one we signed in an earlier run."""
        if self.leaving or not self._ours.refute(incarnation):
            return  # only we could have signed the largest incarnation, and cannot pass it
        self.counters.refutations += 1
        if counts_against_health:
            self._prober.adjust_awareness(+1)  # being suspected hints that we are the slow one

    # ---- the prober's effects, and outbound-only members -----------------------------

    def _carry_out(self, now: float, effects: list[ProbeEffect]) -> None:
        """Do what the prober decided, in order."""
        for effect in effects:
            if isinstance(effect, Datagram):
                self._send(effect.address, list(effect.parts))
            elif isinstance(effect, Suspected):
                self._on_suspect(now, effect.message)
            elif isinstance(effect, Answered):
                # A suspect answered: it is up but has not refuted (it may not know yet, or we
                # missed its refutation). Our timer starts over; the next verification ping
                # carries the suspicion to it, and its reply brings its refutation to us. A
                # suspicion can only run out while the suspect stays silent.
                suspicion = self._suspicions.get(effect.peer)
                if suspicion is not None:
                    suspicion.restart(now)
            else:  # Silent: our own confirmation, counted once
                suspicion = self._suspicions.get(effect.message.peer)
                if suspicion is None:
                    self._on_suspect(now, effect.message)
                elif suspicion.confirm_silence(self.me):
                    self._broadcasts.enqueue(effect.message.peer, encode(effect.message))

    def _forget_suspicion(self, peer: PeerId) -> None:
        self._suspicions.pop(peer, None)
        self._prober.unsuspect(peer)

    def _keep_alive(self, now: float) -> None:
        """Liveness without probes. An outbound-only node re-announces itself every
        ``meta_interval`` (a heartbeat: a training node does so anyway, with its step). A
        reachable node suspects an outbound-only member whose latest announcement is
        :data:`~gossip.probing.OVERDUE_HEARTBEATS` intervals old (:meth:`Prober.overdue
        <gossip.probing.Prober.overdue>`); the suspicion then runs its course as any other,
        and the member's next heartbeat refutes it. Outbound-only nodes judge only the
        members they can probe: they hear of the others second-hand."""
        me = self._self
        if not me.reachable:
            # Compared as next_deadline computes it, or rounding could leave it due for ever.
            if now >= self._ours.announced + self.config.meta_interval:
                self._ours.bump(now)
            return
        self._carry_out(now, self._prober.overdue(now))

    # ---- sending ----------------------------------------------------------------------

    def _gossip(self, now: float) -> None:
        # The recently dead get gossip too, so that a member wrongly declared dead hears it
        # and refutes. They are few; collect them.
        horizon = now - self.config.gossip_to_the_dead
        members = self._members
        recent = [p for p in self._recently_dead if p in members
                  and members[p].state == State.DEAD and members[p].since >= horizon]
        self._recently_dead = recent
        recent = [p for p in recent if members[p].reachable]
        k = self.config.gossip_nodes
        reachable = lambda p: members[p].reachable  # noqa: E731 - the others hear it in Acks
        if recent and self.rng.random() < len(recent) / (len(recent) + len(self._up)):
            targets = [self.rng.choice(recent)] + self._up.sample(self.rng, k - 1, reachable)
        else:
            targets = self._up.sample(self.rng, k, reachable)
        for peer in targets:
            if not self._broadcasts:
                break
            self._send(self._members[peer].address, [])

    def _send(self, address: str, parts: list[bytes]) -> None:
        """One datagram to ``address``: ``parts``, then as many queued updates as fit."""
        budget = MAX_PACKET - _PACKET_OVERHEAD - sum(len(p) + PART_OVERHEAD for p in parts)
        piggyback = self._broadcasts.take(budget, self.alive_count(), MAX_PARTS - len(parts))
        if parts or piggyback:
            self._emit(address, (*parts, *piggyback))

    def _emit(self, address: str, parts: tuple[bytes, ...]) -> None:
        """One datagram to ``address`` holding ``parts`` and nothing else."""
        data = encode(Packet(self.me, parts))
        self.counters.datagrams_sent += 1
        self.counters.bytes_sent += len(data) + SEAL_OVERHEAD
        self._effects.append(Send(address, data))

    # ---- housekeeping -----------------------------------------------------------------

    def _reap(self, now: float) -> None:
        horizon = now - self.config.reap_after
        for peer in [p for p, r in self._members.items()
                     if r.state >= State.DEAD and r.since < horizon]:
            del self._members[peer]

    def _push_pull_interval(self) -> float:
        n = self.alive_count()
        if n <= 32:
            return self.config.push_pull_interval
        return self.config.push_pull_interval * (math.ceil(math.log2(n) - math.log2(32)) + 1)

    def _drain(self) -> list[Effect]:
        effects, self._effects = self._effects, []
        return effects

    def retransmit_limit(self) -> int:
        return retransmit_limit(self.config.retransmit_mult, self.alive_count())


def _member_state(r: _Record) -> MemberState:
    return MemberState(r.peer, r.incarnation, int(r.state), r.address, r.version, r.step, r.ready,
                       r.shard, r.shards, r.reachable, key=r.key, signature=r.signature)
