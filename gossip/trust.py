"""Whom a node trusts, and how far: which offers it takes, and how far each peer moves it.

Theory of operation
-------------------
A peer whose payload fails the checks gets a strike; ``strikes`` in a row quarantine it for
``quarantine`` seconds: we neither offer to it nor accept its offers. A peer whose schema,
codec or mixing mode differs from ours is quarantined at once (it cannot be averaged with).
How far a received state may move us depends on the exchange's standing
(:mod:`gossip.standing`): a peer we chose, or one with a record (proved to us on a channel
and a member for ``trust_after`` seconds since, or one we chose before), moves us within the
clip bound; a newcomer's offer commits but moves us by nothing. A member's offer swaps
drift-correction estimates only if we have picked it for a round of ours (:meth:`Trust.picked`):
pushes on the correction add up where pushes on the state do not (:mod:`gossip.correction`).
The newcomers behind one
source host share a budget of one exchange per round of ours, and the members behind one
host one of twice what an honest host sends us per round.

An offer we can never take (another schema, codec or mixing mode, or a quarantined peer) is
refused ``REJECTED`` (a :class:`~gossip.exchange_state.Refusal`); one whose host has spent its
budget ``BUSY``, at once, as every busy answer is (:mod:`gossip.averaging`).

On a commit a node moves its step half way towards the peer's, counting the peer's only as
far as it lies between our step and the swarm's (the median over the hosts of our last
rounds of each one's latest step, aged by our own steps since: one host counts once, however
often it is free to commit: :class:`~gossip.standing.PeerSteps`,
:func:`~gossip.standing.step_move`), and a
download takes the sender's step up to the members' median: nodes agree on the step their
learning-rate schedules follow, and a liar cannot move it.

:class:`Trust` keeps all this for one node (its quarantine, the records of the peers it chose,
the budgets per host, its chosen peers' steps) and answers its averager's questions about a
peer: whether to take its offer, with what standing, how much of the mixing weight its state
gets (:func:`~gossip.standing.seniority`), how far that state may move us (the clip), and
where its step moves ours.
"""

from __future__ import annotations

import logging

import trio

from .codec import known
from .config import AveragingConfig
from .exchange_state import Refusal, Result
from .identity import PeerId
from .member import State
from .messages import Offer
from .mixing import OFFER_CLIP, Quarantine
from .replica import Counters
from .roster import Roster
from .standing import (FOUNDING, MEMBER_BURST, MEMBER_SHARE, NewcomerBudget, PeerSteps, Records,
                       Standing, by_host, host_of, seniority, standing, step_ceiling, step_move)
from .schema import StateSchema

__all__ = ["Trust"]

log = logging.getLogger("gossip.averaging")  # its lines are the averager's


class Trust:
    """A node's trust in its peers: whose offers it takes, and how far each moves it.

    Args:
        roster: the membership view: whether a peer is alive, since when, proved to us.
        schema: our model's, which an offer must name.
        config: the codec, the mixing mode, the clip, ``trust_after`` and the quarantine.

    Attributes:
        quarantine: the peers we neither offer to nor take offers from, for now.
        newcomers_limited: newcomers' offers answered busy: their host's budget was spent.
        members_limited: members' offers answered busy: their host's budget was spent.
    """

    def __init__(self, roster: Roster, schema: StateSchema, config: AveragingConfig) -> None:
        self._roster = roster
        self._schema = schema
        self._config = config
        self.quarantine = Quarantine(config.strikes, config.quarantine)
        self._newcomers = NewcomerBudget()
        self._members = NewcomerBudget(MEMBER_BURST)
        self._records = Records()
        self._peer_steps = PeerSteps(config.clip_window)
        self._started = trio.current_time()  # for the peers' seniority: younger than us?
        self.newcomers_limited = 0
        self.members_limited = 0

    def round(self, exchanges: int = 1) -> None:
        """A round of ours starts, of ``exchanges`` exchanges (gossip.plan): each host's
        budgets grow by its share of it."""
        self._newcomers.round()
        # Each host picks among the hosts that take offers, as many times a round as we do
        # (a swarm's nodes run one plan): its share of our offers is that many over those
        # (but us). Proven ones only: claims could shrink everyone's share.
        hosts = len(by_host(self._roster.alive(ready=True, reachable=True, proven=True),
                            self._roster.proven_host))
        self._members.round(MEMBER_SHARE * exchanges / max(hosts, 1))

    def offerer(self, peer: str) -> Standing:
        """The standing of an offer from ``peer``: a member's, or a newcomer's. Its time
        counts from when it was both alive in our table and proved to us (its offer's own
        channel proves it, so a first offer is a newcomer's)."""
        member = self._roster.get(peer)
        proved = self._roster.proven_since(peer)
        since = (max(member.since, proved) if member is not None
                 and member.state is State.ALIVE and proved is not None else None)
        return standing(False, since, trio.current_time(), self._config.trust_after,
                        chosen_before=peer in self._records)

    def picked(self, peer: PeerId) -> bool:
        """Whether we have picked ``peer`` for a round of ours (it has a record here)."""
        return peer in self._records

    def senior(self, peer: str) -> float:
        """The fraction of the mixing weight ``peer``'s state gets (:func:`seniority`); in
        push-sum mode always 1, since the weights there already give a joiner its share."""
        if self._config.by_samples:
            return 1.0
        member = self._roster.get(peer)
        now = trio.current_time()
        alive_for = (now - member.since if member is not None and member.state is State.ALIVE
                     else None)
        return seniority(alive_for, now - self._started, self._config.trust_after)

    def clip(self, peer: str, history: int) -> float:
        """The state's clip for an offer from ``peer``: :data:`~gossip.mixing.OFFER_CLIP`,
        or the configured clip while we are young (``history``, the distances in our history
        of rounds, is short of ``clip_window``) and the peer was a member before us (in our
        table, alive, and proved to us, both since no later than :data:`FOUNDING` x
        ``trust_after`` after our start) that we have picked for a round of ours: a joiner is
        the one far from the swarm, and the members it joined must be able to pull it in.
        Picked: identities a key holder proved to us in our first seconds were members before
        us too, and their offers at five medians each took a young swarm's held-out loss from
        0.11 to 0.5-0.7 (tests/sim/test_correction_poisoning.py); a peer we picked is a random
        member, its key holder's share of them its share of the hosts, and such a peer moves
        us by the configured clip in our own rounds anyway."""
        clip = self._config.clip
        if not clip or history >= self._config.clip_window:
            return min(clip, OFFER_CLIP) if clip else clip
        member, proved = self._roster.get(peer), self._roster.proven_since(peer)
        founding = self._started + FOUNDING * self._config.trust_after
        older = (member is not None and member.state is State.ALIVE and member.since <= founding
                 and proved is not None and proved <= founding and self.picked(peer))
        return clip if older else min(clip, OFFER_CLIP)

    def refusal(self, offer: Offer, peer: PeerId) -> Refusal | None:
        """Why we can never take this offer (``REJECTED``), or None if we could. The reason
        travels in ``Close.reason``, which is for logs: it never carries our schema's
        fingerprint (a client computes that from its model, PROTOCOL.md section 7.1); our own
        log does."""
        if offer.fingerprint != self._schema.fingerprint:
            log.debug("averaging offer of another schema peer=%s theirs=%s ours=%s", peer.short,
                     offer.fingerprint.hex(), self._schema.fingerprint_hex)
            return _never("schema differs from ours (another model, or other task options)")
        if not known(offer.codec):
            return _never(f"codec {offer.codec!r} is not one we know")
        if (offer.weight > 0) != self._config.by_samples:
            return _never("mixing modes differ (push-sum by samples vs fixed weight)")
        if self.quarantine.barred(peer, trio.current_time()):
            return _never("quarantined")
        return None

    def budget(self, rank: Standing, host: str) -> Refusal | None:
        """Why an offer of standing ``rank`` from ``host`` must wait (``BUSY``: the host's
        budget is spent), or None: it takes one of the host's exchanges."""
        if rank is Standing.NEWCOMER and not self._newcomers.allow(host):
            self.newcomers_limited += 1
            return Refusal(Result.BUSY,
                           "busy: newcomers from this address have had their share for now")
        if (rank is Standing.MEMBER and self._config.trust_after > 0
                and not self._members.allow(host)):
            self.members_limited += 1
            return Refusal(Result.BUSY,
                           "busy: members from this address have had their share for now")
        return None

    def moved_step(self, peer: PeerId, rank: Standing, step: int, mine: Counters) -> int:
        """Where a committed exchange with ``peer`` of standing ``rank``, whose step is
        ``step``, moves ours (``mine``: our counters at its snapshot); a peer we chose counts
        towards the swarm's step from now on."""
        members = self._roster.alive(ready=True, proven=True)
        chosen = self._roster.get(peer) if rank is Standing.CHOSEN else None
        if chosen is not None:
            self._peer_steps.add(host_of(chosen), str(peer), step, mine.local)
        host = self._roster.proven_host
        swarm = self._peer_steps.swarm(mine.local, len(by_host(members, host)), len(members))
        if swarm is None:  # too few hosts of our own rounds yet: the announcements
            swarm = step_ceiling(members, host) if members else None
        return step_move(mine.heading, step, swarm)

    def committed(self, peer: PeerId, rank: Standing) -> None:
        """An exchange with ``peer`` committed: its strikes are forgiven, and a peer we chose
        has a record from now on."""
        self.quarantine.clear(peer)
        if rank is Standing.CHOSEN:
            self._records.add(peer)


def _never(reason: str) -> Refusal:
    return Refusal(Result.REJECTED, reason)
