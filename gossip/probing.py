"""Probing: the failure detector that a :class:`gossip.membership.Membership` owns.

Theory of operation
-------------------
A :class:`Prober` holds the state of the probe cycle and of Lifeguard's local health, and
nothing else: what it needs of the member table (states, addresses, the pool of members up)
it reads from the membership's, and what it decides it returns as *effects* for the
membership to carry out, in order: a :class:`Datagram` to send (the membership adds queued
updates to it), :class:`Answered` (a member answered our ping: a suspicion of it starts
over), :class:`Suspected` (our own evidence against a member, a failed probe or a missed
heartbeat: suspect it) and :class:`Silent` (a suspect left our verification ping unanswered:
our own confirmation). Suspicions
themselves, and every update to the table, are the membership's.

* **Probe**, once per protocol period. Pick the next member of a shuffled round-robin list
  (members reported by the averager first, out of turn) and send it ``Ping``. No ``Ack``
  within the probe timeout: ask ``indirect_checks`` other members to probe it for us
  (``PingReq``); each either forwards the target's ``Ack`` or, after :func:`helper_wait`,
  answers ``Nack``. Still no ``Ack`` at the end of the period: suspect the member.
* **Helping**: the other side of a ``PingReq``, at most ``MAX_PARTS`` at a time.
* **Verification**, every period while we hold a suspicion, starting 1 to 2 periods after it
  began: ping the suspect outside the probe cycle, with the suspicion attached (Lifeguard's
  buddy system). An ``Ack`` restarts the suspicion's timer; a ping left unanswered for a
  whole period is our own confirmation of it. Without this, a member that happened to miss
  a refutation declared a live node dead (SWIM's gossip reaches each member with high
  probability, not certainty), and one that missed the verdict waited out a long
  unconfirmed timer.
* **Outbound-only members** cannot be pinged: a reachable node suspects one whose latest
  announcement is :data:`OVERDUE_HEARTBEATS` intervals old, and answers its pings with our
  verdict on it (:meth:`Prober.answer`), so that it can refute.
* **Local health**: a score in ``0..awareness_max`` rises when our probes fail without the
  helpers' Nacks that would show our own network is fine (and when the membership must refute
  a suspicion of us), and falls with each successful probe; probe interval and timeout are
  multiplied by ``score + 1``.

Pure, like the rest of the membership: times come in as ``now``, and randomness from the
membership's ``rng``, so that a seeded run repeats exactly.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from .config import MembershipConfig
from .identity import PeerId
from .member import PeerPool, State
from .messages import MAX_PARTS, MAX_SEQUENCE, Ack, Dead, Nack, Ping, PingReq, Suspect
from .wire import encode

if TYPE_CHECKING:
    from .member import _Counters, _Record

__all__ = ["Prober", "Datagram", "Answered", "Suspected", "Silent", "ProbeEffect", "helper_wait",
           "MAX_URGENT", "MAX_VERIFYING", "OVERDUE_HEARTBEATS"]

MAX_URGENT = 16  # members queued for an out-of-turn probe
MAX_VERIFYING = 256  # verification pings awaiting an Ack
# meta_intervals without news of an outbound-only member before a reachable node suspects it
# (it announces itself every meta_interval: up to two may be lost or late)
OVERDUE_HEARTBEATS = 3


@dataclass(frozen=True)
class Datagram:
    """Effect: send ``parts`` to ``address`` in one datagram, with as many queued updates as
    fit beside them."""

    address: str
    parts: tuple[bytes, ...]


@dataclass(frozen=True)
class Answered:
    """Effect: ``peer`` answered a ping of ours; a suspicion of it starts over."""

    peer: PeerId


@dataclass(frozen=True)
class Suspected:
    """Effect: our own evidence against a member (a failed probe, a missed heartbeat):
    suspect it, as if ``message`` had come in."""

    message: Suspect


@dataclass(frozen=True)
class Silent:
    """Effect: the suspect of ``message`` left our verification ping unanswered: our own
    confirmation of the suspicion (suspect it, if we no longer do)."""

    message: Suspect


ProbeEffect = Union[Datagram, Answered, Suspected, Silent]


@dataclass
class _Probe:
    seq: int
    target: PeerId
    direct_deadline: float  # no Ack by then: ask helpers
    end: float  # no Ack by then: suspect
    helpers_asked: bool = False
    expected_nacks: int = 0
    nacks: int = 0


@dataclass
class _Helping:
    requester: str  # address to answer
    seq: int  # the requester's sequence number
    deadline: float  # no Ack by then: Nack


def helper_wait(config: MembershipConfig) -> float:
    """How long a helper waits for the target of a PingReq before it Nacks. The requester
    asked ``probe_timeout`` into its period and gives up at the period's end, so the Nack
    must leave well within what remains of it, or the requester counts it missing and blames
    its own health for the helper's wait (memberlist's timing has exactly that race)."""
    return 0.8 * min(config.probe_timeout, config.probe_interval - config.probe_timeout)


class Prober:
    """The probe cycle, verification pings and local health of one membership.

    Args:
        me: our peer id.
        now: the current time; the first probe falls at random within one interval.
        config: timing.
        rng: the membership's; a sequence number is drawn from it here.
        members: the membership's table, read only.
        up: the members ALIVE or SUSPECT, read only.
        counters: the membership's; probes and failed probes are counted in it.
        reap: forgets members long gone; called at the end of each round of probes, before
            the next round's order is drawn from ``members``.
    """

    def __init__(self, me: PeerId, now: float, config: MembershipConfig, rng: random.Random,
                 members: Mapping[PeerId, _Record], up: PeerPool, counters: _Counters,
                 reap: Callable[[float], None]) -> None:
        self._me = me
        self._config = config
        self._rng = rng
        self._members = members
        self._up = up
        self._counters = counters
        self._reap = reap
        self._seq = rng.randrange(MAX_SEQUENCE)
        self._order: list[PeerId] = []
        self._index = 0
        self._probe: _Probe | None = None
        # Members to probe before the next round-robin one, oldest first: those the
        # averager reported (Membership.report_failure).
        self._urgent: dict[PeerId, None] = {}
        self._helping: dict[int, _Helping] = {}
        # Suspects we hold -> when to ping them next (Lifeguard's buddy system, repeated
        # every period while the suspicion stands), and those pings' seq -> suspect.
        self._verify: dict[PeerId, float] = {}
        self._verifying: dict[int, PeerId] = {}
        self._unanswered: set[PeerId] = set()  # suspects whose last verification got no Ack
        self._awareness = 0
        # Spread over one interval so that nodes started together do not probe in lockstep.
        self.next_probe = now + rng.random() * config.probe_interval
        self._next_overdue = now + config.probe_interval

    # ---- queries ----------------------------------------------------------------------

    @property
    def awareness(self) -> int:
        """Lifeguard's local health score: 0 healthy, up to ``awareness_max``."""
        return self._awareness

    def deadlines(self, *, overdue: bool) -> list[float]:
        """When :meth:`tick`, :meth:`verify` or (``overdue``) :meth:`overdue` must run next,
        besides :attr:`next_probe`."""
        deadlines = [self._next_overdue] if overdue else []
        if self._probe is not None:
            deadlines.append(self._probe.end)
            if not self._probe.helpers_asked:
                deadlines.append(self._probe.direct_deadline)
        deadlines.extend(h.deadline for h in self._helping.values())
        deadlines.extend(self._verify.values())
        return deadlines

    # ---- the probe cycle --------------------------------------------------------------

    def expire(self, now: float) -> list[ProbeEffect]:
        """Nack the PingReqs whose target did not answer in time."""
        effects: list[ProbeEffect] = []
        for seq in [s for s, h in self._helping.items() if h.deadline <= now]:
            helping = self._helping.pop(seq)
            effects.append(Datagram(helping.requester, (encode(Nack(helping.seq)),)))
        return effects

    def tick(self, now: float) -> list[ProbeEffect]:
        """Move the probe under way on: ask helpers after the probe timeout, give up at the
        period's end."""
        probe = self._probe
        if probe is not None and now >= probe.end:
            return self._failed(probe)
        if probe is not None and not probe.helpers_asked and now >= probe.direct_deadline:
            return self._ask_helpers(probe)
        return []

    def start(self, now: float) -> list[ProbeEffect]:
        """Start the next probe, if it is due and none is under way."""
        if now < self.next_probe or self._probe is not None:
            return []
        target = self._next_urgent() or self._next_target(now)
        scale = self._awareness + 1
        self.next_probe = now + self._config.probe_interval * scale
        if target is None:
            return []
        record = self._members[target]
        seq = self._next_seq()
        self._counters.probes += 1
        self._probe = _Probe(seq, target, now + self._config.probe_timeout * scale,
                             now + self._config.probe_interval * scale)
        parts = [encode(Ping(seq, target))]
        if record.state == State.SUSPECT:
            # Lifeguard's "buddy system": tell a suspect first, so it can refute in time.
            parts.append(encode(Suspect(target, record.incarnation, self._me)))
        return [Datagram(record.address, tuple(parts))]

    def abandon(self) -> None:
        """We leave: the probe under way is given up, and no failure is counted."""
        self._probe = None

    def probe_soon(self, now: float, peer: PeerId) -> None:
        """Evidence from elsewhere that ``peer`` may be down: probe it out of turn, as soon as
        no probe is under way (unless it is the one under way)."""
        if self._probe is not None and self._probe.target == peer:
            return
        if len(self._urgent) < MAX_URGENT:
            self._urgent[peer] = None
        if self._probe is None:
            self.next_probe = min(self.next_probe, now)

    def add(self, peer: PeerId) -> None:
        """A new member goes to a random place in the probe order, so it is probed this round.
        Never before the current position, or it would wait a whole round."""
        self._order.insert(self._rng.randint(self._index, len(self._order)), peer)

    def forget(self, peer: PeerId) -> None:
        """``peer`` is down: no out-of-turn probe of it."""
        self._urgent.pop(peer, None)

    def adjust_awareness(self, delta: int) -> None:
        """Move the local health score by ``delta``, within ``0..awareness_max``."""
        self._awareness = min(self._config.awareness_max, max(0, self._awareness + delta))

    # ---- messages ---------------------------------------------------------------------

    def answer(self, now: float, source: str, ping: Ping, sender: str) -> list[ProbeEffect]:
        """Answer a Ping for us from ``sender`` at ``source``. An outbound-only member that
        we suspect or hold dead cannot be pinged with the news, so it gets it in the answer
        to its own ping, and refutes; its ping is also a sign of life: our suspicion starts
        over."""
        ack = encode(Ack(ping.seq))
        record = self._members.get(sender)  # type: ignore[call-overload]
        if record is None or record.reachable or record.state not in (State.SUSPECT, State.DEAD):
            return [Datagram(source, (ack,))]
        verdict = Suspect if record.state == State.SUSPECT else Dead
        return [Answered(record.peer), Datagram(source, (
            ack, encode(verdict(record.peer, record.incarnation, self._me))))]

    def on_ack(self, seq: int) -> list[ProbeEffect]:
        """An Ack came: for our probe, for a verification ping, or for one we forward."""
        probe = self._probe
        if probe is not None and seq == probe.seq:
            self._probe = None
            self.adjust_awareness(-1)
            return [Answered(probe.target)]
        peer = self._verifying.pop(seq, None)
        if peer is not None:
            self._unanswered.discard(peer)
            return [Answered(peer)]
        helping = self._helping.pop(seq, None)
        if helping is not None:
            return [Datagram(helping.requester, (encode(Ack(helping.seq)),))]
        return []

    def on_nack(self, seq: int) -> None:
        """A helper could not reach our probe's target either: our network is fine."""
        if self._probe is not None and seq == self._probe.seq:
            self._probe.nacks += 1

    def help(self, now: float, source: str, message: PingReq) -> list[ProbeEffect]:
        """Probe ``message.target`` for the member at ``source``."""
        if message.target == self._me or len(self._helping) >= MAX_PARTS:
            return []
        seq = self._next_seq()
        self._helping[seq] = _Helping(source, message.seq, now + helper_wait(self._config))
        return [Datagram(message.address, (encode(Ping(seq, message.target)),))]

    # ---- suspects ---------------------------------------------------------------------

    def verify_later(self, now: float, peer: PeerId) -> None:
        """A suspicion of ``peer`` began: ping it ourselves 1 to 2 periods from now. By then a
        live suspect's refutation has usually reached us and no ping is needed; only members
        that missed it (or a silent suspect) verify, so a suspect is not met by a ping from
        every member at once."""
        self._verify[peer] = now + self._config.probe_interval * (1 + self._rng.random())

    def unsuspect(self, peer: PeerId) -> None:
        """The suspicion of ``peer`` ended: no more verification pings."""
        self._verify.pop(peer, None)
        self._unanswered.discard(peer)

    def verify(self, now: float) -> list[ProbeEffect]:
        """Ping each suspect due for it with the suspicion attached, outside the probe cycle.
        If the last such ping went unanswered for a whole period, that silence is our own
        confirmation of the suspicion (:class:`Silent`): counted once (even by the member
        whose probe started it), and gossiped if it counts (Lifeguard's independent
        confirmations). So a holder's timer soon runs at ``max - (max - min) * ln 2 /
        ln(K + 1)`` on its own evidence, at the minimum once others' confirmations arrive,
        and a member that misses the verdict still reaches it on its own. A wrong
        confirmation costs little: any Ack from the suspect restarts the timer."""
        effects: list[ProbeEffect] = []
        for peer in [p for p, t in self._verify.items() if t <= now]:
            record = self._members[peer]
            suspect = encode(Suspect(peer, record.incarnation, self._me))
            if peer in self._unanswered:
                effects.append(Silent(Suspect(peer, record.incarnation, self._me)))
            self._unanswered.add(peer)
            self._verify[peer] = now + self._config.probe_interval
            if len(self._verifying) >= MAX_VERIFYING:
                self._verifying.pop(next(iter(self._verifying)))  # the oldest: answered or lost
            seq = self._next_seq()
            self._verifying[seq] = peer
            effects.append(Datagram(record.address, (encode(Ping(seq, peer)), suspect)))
        return effects

    def overdue(self, now: float) -> list[ProbeEffect]:
        """Suspect the outbound-only members whose latest announcement is
        :data:`OVERDUE_HEARTBEATS` intervals old (checked once per probe interval)."""
        if now < self._next_overdue:
            return []
        self._next_overdue = now + self._config.probe_interval
        horizon = now - OVERDUE_HEARTBEATS * self._config.meta_interval
        return [Suspected(Suspect(record.peer, record.incarnation, self._me))
                for record in list(self._members.values())
                if not record.reachable and record.state == State.ALIVE
                and record.heard < horizon]

    # ---- internals --------------------------------------------------------------------

    def _next_urgent(self) -> PeerId | None:
        while self._urgent:
            peer = next(iter(self._urgent))
            del self._urgent[peer]
            record = self._members.get(peer)
            if record is not None and record.state <= State.SUSPECT and record.reachable:
                return peer
        return None

    def _next_target(self, now: float) -> PeerId | None:
        for _ in range(2):
            while self._index < len(self._order):
                peer = self._order[self._index]
                self._index += 1
                record = self._members.get(peer)
                # An outbound-only member cannot be probed (see overdue()).
                if record is not None and record.state <= State.SUSPECT and record.reachable:
                    return peer
            # End of a round: forget what is long gone, reshuffle, start over.
            self._reap(now)
            self._order = list(self._members)
            self._rng.shuffle(self._order)
            self._index = 0
        return None

    def _ask_helpers(self, probe: _Probe) -> list[ProbeEffect]:
        probe.helpers_asked = True
        record = self._members.get(probe.target)
        if record is None:
            return []
        members = self._members
        chosen = self._up.sample(
            self._rng, self._config.indirect_checks,
            lambda p: p != probe.target and members[p].state == State.ALIVE and members[p].reachable,
        )
        probe.expected_nacks = len(chosen)
        request = encode(PingReq(probe.seq, probe.target, record.address))
        return [Datagram(members[helper].address, (request,)) for helper in chosen]

    def _failed(self, probe: _Probe) -> list[ProbeEffect]:
        self._probe = None
        self._counters.probes_failed += 1
        # Missing Nacks mean our own messages are not getting through: blame ourselves.
        # With no helpers to ask, any failure counts (Lifeguard; memberlist's probeNode).
        if probe.expected_nacks > 0:
            self.adjust_awareness(max(0, probe.expected_nacks - probe.nacks))
        else:
            self.adjust_awareness(+1)
        record = self._members.get(probe.target)
        if record is not None and record.state <= State.SUSPECT:
            return [Suspected(Suspect(record.peer, record.incarnation, self._me))]
        return []

    def _next_seq(self) -> int:
        self._seq = (self._seq + 1) & MAX_SEQUENCE
        return self._seq
