"""Probing, the failure-detection half of :class:`gossip.membership.Membership`.

A mixin, kept apart so that each file reads in one sitting: the probe cycle (Ping, then
PingReq through helpers, then suspicion), the helper's side of an indirect probe, the
verification of suspects outside the cycle, and Lifeguard's local health score. The theory
of operation is in :mod:`gossip.membership`; everything here is pure, like the rest of it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .config import MembershipConfig
from .identity import PeerId
from .member import PeerPool, State
from .messages import MAX_PARTS, Ack, Ping, PingReq, Suspect
from .suspicion import Suspicion
from .wire import encode

__all__ = ["Probing", "helper_wait", "MAX_URGENT", "MAX_VERIFYING"]

MAX_URGENT = 16  # members queued for an out-of-turn probe
MAX_VERIFYING = 256  # verification pings awaiting an Ack


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


class Probing:
    """The probing state and transitions of a :class:`~gossip.membership.Membership`."""

    # Provided by Membership.
    me: PeerId
    config: MembershipConfig
    rng: random.Random
    _members: dict
    _up: PeerPool
    _probe: _Probe | None
    _probe_order: list[PeerId]
    _probe_index: int
    _next_probe: float
    _urgent: dict[PeerId, None]
    _helping: dict[int, _Helping]
    _suspicions: dict[PeerId, Suspicion]
    _verify: dict[PeerId, float]
    _verifying: dict[int, PeerId]
    _unanswered: set[PeerId]
    _awareness: int

    def _help(self, now: float, source: str, message: PingReq) -> None:
        """Probe ``message.target`` for the member at ``source``."""
        if message.target != self.me and len(self._helping) < MAX_PARTS:
            seq = self._next_seq()
            self._helping[seq] = _Helping(source, message.seq, now + helper_wait(self.config))
            self._send(message.address, [encode(Ping(seq, message.target))])

    def _on_ack(self, now: float, seq: int) -> None:
        probe = self._probe
        if probe is not None and seq == probe.seq:
            self._probe = None
            self._adjust_awareness(-1)
            self._answered_by(now, probe.target)
            return
        peer = self._verifying.pop(seq, None)
        if peer is not None:
            self._unanswered.discard(peer)
            self._answered_by(now, peer)
            return
        helping = self._helping.pop(seq, None)
        if helping is not None:
            self._send(helping.requester, [encode(Ack(helping.seq))])

    def _answered_by(self, now: float, peer: PeerId) -> None:
        suspicion = self._suspicions.get(peer)
        if suspicion is not None:
            # A suspect answered: it is up but has not refuted (it may not know yet, or we
            # missed its refutation). Our timer starts over; the next verification ping
            # carries the suspicion to it, and its reply brings its refutation to us. A
            # suspicion can only run out while the suspect stays silent.
            suspicion.restart(now)

    def _start_probe(self, now: float) -> None:
        target = self._next_urgent() or self._next_target(now)
        scale = self._awareness + 1
        self._next_probe = now + self.config.probe_interval * scale
        if target is None:
            return
        record = self._members[target]
        seq = self._next_seq()
        self.counters.probes += 1
        self._probe = _Probe(seq, target, now + self.config.probe_timeout * scale,
                             now + self.config.probe_interval * scale)
        parts = [encode(Ping(seq, target))]
        if record.state == State.SUSPECT:
            # Lifeguard's "buddy system": tell a suspect first, so it can refute in time.
            parts.append(encode(Suspect(target, record.incarnation, self.me)))
        self._send(record.address, parts)

    def _forget_suspicion(self, peer: PeerId) -> None:
        self._suspicions.pop(peer, None)
        self._verify.pop(peer, None)
        self._unanswered.discard(peer)

    def _send_verification(self, now: float, peer: PeerId) -> None:
        """Ping a suspect with the suspicion attached, outside the probe cycle. If the last
        such ping went unanswered for a whole period, that silence is our own confirmation
        of the suspicion: counted once (even by the member whose probe started it), and
        gossiped if it counts (Lifeguard's independent confirmations). So a holder's timer
        soon runs at ``max - (max - min) * ln 2 / ln(K + 1)`` on its own evidence, at the
        minimum once others' confirmations arrive, and a member that misses the verdict
        still reaches it on its own. A
        wrong confirmation costs little: any Ack from the suspect restarts the timer."""
        record = self._members[peer]
        if peer in self._unanswered:
            suspicion = self._suspicions.get(peer)
            own = Suspect(peer, record.incarnation, self.me)
            if suspicion is None:
                self._on_suspect(now, own)
            elif suspicion.confirm_silence(self.me):
                self._broadcasts.enqueue(peer, encode(own))
        self._unanswered.add(peer)
        self._verify[peer] = now + self.config.probe_interval
        if len(self._verifying) >= MAX_VERIFYING:
            self._verifying.pop(next(iter(self._verifying)))  # the oldest is long answered or lost
        seq = self._next_seq()
        self._verifying[seq] = peer
        self._send(record.address, [encode(Ping(seq, peer)),
                                    encode(Suspect(peer, record.incarnation, self.me))])

    def _probe_soon(self, peer: PeerId) -> None:
        if len(self._urgent) < MAX_URGENT:
            self._urgent[peer] = None

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
            while self._probe_index < len(self._probe_order):
                peer = self._probe_order[self._probe_index]
                self._probe_index += 1
                record = self._members.get(peer)
                # An outbound-only member cannot be probed (see Membership._keep_alive).
                if record is not None and record.state <= State.SUSPECT and record.reachable:
                    return peer
            # End of a round: forget what is long gone, reshuffle, start over.
            self._reap(now)
            self._probe_order = list(self._members)
            self.rng.shuffle(self._probe_order)
            self._probe_index = 0
        return None

    def _ask_helpers(self, now: float, probe: _Probe) -> None:
        probe.helpers_asked = True
        record = self._members.get(probe.target)
        if record is None:
            return
        members = self._members
        chosen = self._up.sample(
            self.rng, self.config.indirect_checks,
            lambda p: p != probe.target and members[p].state == State.ALIVE and members[p].reachable,
        )
        probe.expected_nacks = len(chosen)
        request = encode(PingReq(probe.seq, probe.target, record.address))
        for helper in chosen:
            self._send(members[helper].address, [request])

    def _probe_failed(self, now: float, probe: _Probe) -> None:
        self._probe = None
        self.counters.probes_failed += 1
        # Missing Nacks mean our own messages are not getting through: blame ourselves.
        # With no helpers to ask, any failure counts (Lifeguard; memberlist's probeNode).
        if probe.expected_nacks > 0:
            self._adjust_awareness(max(0, probe.expected_nacks - probe.nacks))
        else:
            self._adjust_awareness(+1)
        record = self._members.get(probe.target)
        if record is not None and record.state <= State.SUSPECT:
            self._on_suspect(now, Suspect(record.peer, record.incarnation, self.me))

    def _adjust_awareness(self, delta: int) -> None:
        self._awareness = min(self.config.awareness_max, max(0, self._awareness + delta))
