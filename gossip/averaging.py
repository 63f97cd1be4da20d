"""Gossip averaging: pairwise exchanges of model state with random peers.

Theory of operation
-------------------
A node starts a *round* every ``every`` local steps, or ``interval`` seconds after its last,
whichever comes first (:mod:`gossip.rounds`); it is also picked by its peers about as often as
it picks. A round makes ``peers`` exchanges, one after another, each with another peer (one at
close spacing, three at wide: :mod:`gossip.plan`), so the node takes part in about twice that
many every ``every`` steps. With ``every = "auto"`` the spacing follows the link
(:mod:`gossip.spacing`): :attr:`AveragingStatistics.spacing` says the figure in use.

A round takes a snapshot of the node's state (and of its drift correction's estimate, if it
keeps one: :mod:`gossip.correction`), picks a peer at random among the members that are alive,
ready and not quarantined (a host uniformly, then one of its members:
:func:`gossip.standing.pick`), and runs one exchange with it on a fresh secure channel
(:mod:`gossip.exchange`: offer, both payloads at once, the checks, the commit). Nothing is
applied unless both sides hold and accept both payloads. "Apply" means queueing
``delta = c·(s_peer − s)`` (and ``c·(z_peer − z)`` for the correction) on the
:class:`~gossip.replica.Replica`: the trainer adds it over its next steps, so local steps
taken during the exchange are kept (see :mod:`gossip.mixing` for ``c`` and the checks, and
:func:`gossip.standing.seniority` for the share a peer younger than us gets).

One exchange at a time: a node that is in one answers any offer ``Close(BUSY)`` at once,
never waiting, so two nodes that offer to each other, or a whole swarm offering at the same
instant, cannot deadlock. The initiator then tries another peer after a short randomized
backoff (the busy one again if nobody else is left), up to ``attempts`` tries per round.
Every phase runs under its own deadline (connect, handshake, offer, transfer, commit), so a
silent peer costs one deadline. The transfer's follows the link (:mod:`gossip.linkrate`): each
node times its transfers with each peer host, and gives the next one with that host its
payload's bytes at a quarter of the measured rate, never less time than at ``min_rate``; a
payload that goes ``stall_timeout`` seconds without a byte ends it sooner.

Both ends of an exchange run one path (:meth:`Averaging._exchange`): the snapshot, the
protocol, the settling and the bookkeeping are the same, and only the middle differs. An
initiator dials the peer it picked and offers; a responder first decides whether to take the
offer at all, and answers a :class:`~gossip.exchange_state.Refusal` at once if not, else
accepts. Whose offers a node takes and how far a peer may move it (the quarantine, each
exchange's standing, the newcomers' and members' budgets, the step a commit moves ours to) is
:mod:`gossip.trust`. What the node reports, each exchange as it ends and its statistics, is
:mod:`gossip.tally`.

Heavy work (snapshots, the delta) runs in a worker thread for models of
:data:`~gossip.replica.OFFLOAD_NUMEL` elements or more, and inline below that, so small models
in a simulated swarm stay on trio's virtual clock.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, replace
from functools import partial
from typing import Awaitable, Callable

import torch
import trio

from . import exchange, lowbit
from .channel import SecureChannel
from .codec import encoded_nbytes
from .config import AveragingConfig, Limits
from .correction import ESTIMATE_CLIP
from .errors import BadMessage, GossipError, PeerGone, PeerTimeout
from .exchange import Deadlines
from .exchange_state import Outcome, Refusal, Result
from .feedback import Codecs
from .groups import one_error
from .identity import PeerId
from .limits import RateLimit
from .linkrate import LinkRates
from .member import Member
from .messages import Accept, Offer
from .mismatch import describe
from .mixing import DeltaHistory, Difference, Verdict, coefficient, judge, merged_weight
from .plan import Plan, plan
from .replica import Counters, Replica, offload
from .roster import Roster
from .rounds import Rounds
from .standing import Standing, pick
from .tally import AveragingStatistics, Exchange, Tally
from .trust import Trust

__all__ = ["AveragingConfig", "AveragingStatistics", "Averaging", "Exchange", "Result"]

log = logging.getLogger(__name__)

PACE = 0.9  # our offers to one peer at most this x the channels per second it takes from one
PACE_SLACK = 0.001  # s past a paced peer's next token before we offer again (float rounding)

Dial = Callable[[Member], Awaitable[SecureChannel]]
"""``dial(member)`` opens a fresh secure channel to ``member``, and to nobody else."""


def deadlines(config: AveragingConfig) -> Deadlines:
    """The deadlines of one exchange's phases, for a link never measured (at ``min_rate``)."""
    return Deadlines(config.offer_timeout, config.transfer_timeout, config.min_rate,
                     config.commit_timeout, config.stall_timeout)


@dataclass
class _Side:
    """What differs between our two ends of an exchange, and what one learns on the way."""

    initiated: bool  # we made the offer
    rank: Standing  # the exchange's standing (CHOSEN: we picked the peer)
    corrected: bool  # our payload carries the correction's estimate too
    phase: str  # what a failure is blamed on: connect, offer (initiator) or accept
    channel: SecureChannel | None = None  # once connected
    told: int | None = None  # the peer's step, once its Offer or Accept says it
    codec: str | None = None  # of both payloads, once the Offer says it
    nbytes: int | None = None  # of our payload, once both sides sent one


_Talk = Callable[[_Side, torch.Tensor, torch.Tensor, Counters, "trio.Event | None"],
                 Awaitable[Outcome]]


class Averaging:
    """Runs rounds as initiator and answers offers as responder. Built by
    :func:`gossip.node.open_swarm`; its :meth:`respond` is the roster's channel handler for
    ``Offer`` messages.

    Args:
        dial: how this node opens a channel to a member (:data:`Dial`).
        rates: what each peer host's link carried; the node's state downloads share it.
    """

    def __init__(self, replica: Replica, roster: Roster, dial: Dial, rates: LinkRates,
                 config: AveragingConfig, rng: random.Random,
                 on_exchange: Callable[[Exchange], None] | None = None,
                 allow: frozenset[str] | None = None,
                 limits: Limits | None = None) -> None:
        self.replica = replica
        self.allow = allow  # peer ids we exchange with; None: any holder of the swarm key
        self.config = config
        self._roster = roster
        self._dial = dial
        self._rng = rng
        self._on_exchange = on_exchange
        self._busy = False
        # Whom our last committed exchange was with, either way: tried last in our next round.
        self._last_partner: PeerId | None = None
        self.stopping = False  # set by stop(): no new exchanges either way
        self._histories = (DeltaHistory(config.clip_window, config.clip_min_history),
                           DeltaHistory(config.clip_window, config.clip_min_history))
        self._trust = Trust(roster, replica.schema, config)
        # Our offers to one peer, paced below the inbound channels per peer it lets in
        # (taken to be ours, Limits.peer_rate): a pair whose rounds come faster than that
        # had every offer past it cut off at the handshake, a failed round each.
        limits = limits or Limits()
        self._pace = RateLimit(PACE * limits.peer_rate, max(1, limits.peer_burst // 2))
        self._tally = Tally()
        self.codecs = Codecs(replica.schema.numel, config.codec, config.codec_steps,
                             config.interval)
        self.ready = trio.Event()
        self._deadlines = deadlines(config)
        self._rates = rates  # per peer host: what its link carried
        self._rounds = Rounds(config, rng, lambda: len(self._candidates(set())),
                              self._payload_nbytes)
        # The last round's plan; before the first, the one a fixed every gives.
        self._plan = plan(config, None if isinstance(config.every, str) else config.every)
        self._outer_due = False
        self._hold_correction()
        # every = "auto": the spacing learns each committed exchange's duration, from our
        # offers and our answers alike, from the report _ended makes for on_exchange.
        spacing = self._rounds.meter
        if spacing is not None:
            def timed(ended: Exchange) -> None:
                if ended.result is Result.COMMITTED:
                    spacing.exchanged(ended.duration, ended.nbytes)
                if on_exchange is not None:
                    on_exchange(ended)

            self._on_exchange = timed

    # ---- public -----------------------------------------------------------------------

    def statistics(self, *, downloads_served: int) -> AveragingStatistics:
        """A snapshot of this node's averaging; ``downloads_served`` is its node's count."""
        return self._tally.statistics(
            trio.current_time(), self.replica.counters(), self._trust,
            pending=self.replica.pending, ready=self.ready.is_set(),
            downloads_served=downloads_served, spacing=self._rounds.steps(),
            round_peers=self._rounds.plan().peers)

    async def run(self) -> None:
        """Start our rounds (:meth:`Rounds.run <gossip.rounds.Rounds.run>`) until cancelled."""
        await self._rounds.run(self.replica, self.ready, self.round)

    def stop(self) -> None:
        """Start no more exchanges and answer offers busy (the node is about to leave); an
        exchange in flight goes on to its end."""
        self.stopping = True

    async def round(self) -> Result:
        """Average with ``peers`` peers (:mod:`gossip.plan`), one after another: try up to
        ``attempts`` random peers for each until one commits.

        Returns:
            INVALID if a peer's payload was (the round stops there), else COMMITTED if one
            exchange did, else the last attempt's result (``NO_PEER`` if there was nobody to
            try).
        """
        chosen = self._plan = self._rounds.plan()
        self._outer_due = chosen.by_round  # the round's first commit takes the outer step
        self._hold_correction()
        await self.ready.wait()
        self._roster.set_meta(step=self.replica.counters().step)
        self._trust.round(chosen.peers)
        self.codecs.stepped(self.replica.local_steps, trio.current_time())
        # A peer that failed or refused is not tried again this round. One that was busy
        # may be, when nobody untried is left: two nodes whose rounds start at the same
        # instant are busy with their own offers, and the randomized backoff lets one of
        # them find the other idle.
        failed: set[str] = set()  # and the peers that committed: one exchange each a round
        busy: set[str] = set()
        result, committed = Result.NO_PEER, 0
        for attempt in range(self.config.attempts * chosen.peers):
            if self.stopping:
                break
            if attempt:
                await trio.sleep(self.config.backoff * self._rng.uniform(0.5, 1.5))
            if self._busy:  # answering someone else's offer: no peer is at fault
                result = Result.BUSY
                continue
            # Our last partner only when nobody else is left: when exchanges take long (a
            # thin link), two nodes that end one together find everyone else busy, and
            # picking each other again and again would re-average what they already share.
            last = {self._last_partner} if self._last_partner is not None else set()
            paced = self._paced()
            peer = (self._pick(failed | busy | last | paced) or self._pick(failed | busy | paced)
                    or self._pick(failed | paced))
            if peer is None and paced and self._pick(failed) is not None:
                # Everyone left to try has had all the offers it takes from us for now: wait
                # for the first of them to take one more, rather than have it refused.
                now = trio.current_time()
                await trio.sleep(min(self._pace.wait(p, now) for p in paced) + PACE_SLACK)
                if self.stopping:
                    break
                if self._busy:  # an offer came meanwhile, and we answer it
                    result = Result.BUSY
                    continue
                peer = self._pick(failed | self._paced())
            if peer is None:
                break
            self._pace.allow(peer.peer, trio.current_time())
            estimating = self.replica.estimating and chosen.correct  # before the snapshot
            side = _Side(True, Standing.CHOSEN, estimating, "connect")
            result = await self._exchange(peer.peer, side, partial(self._offer, peer))
            committed += result is Result.COMMITTED
            if committed == chosen.peers or result is Result.INVALID:
                break
            (busy if result is Result.BUSY else failed).add(peer.peer)
        if committed and result is not Result.INVALID:
            result = Result.COMMITTED
        if result is Result.NO_PEER and not self.stopping:  # a leaving node looked for none
            self._tally.results[Result.NO_PEER] += 1
        return result

    def allowed(self, members: list[Member]) -> list[Member]:
        """The members on the allow-list (all of them when there is none)."""
        if self.allow is None:
            return members
        return [m for m in members if m.peer in self.allow]

    def _paced(self) -> set[str]:
        """The members that have had all the offers from us they take for now."""
        now = trio.current_time()
        return {m.peer for m in self._roster.alive(ready=True, reachable=True)
                if self._pace.wait(m.peer, now) > 0}

    def _hold_correction(self) -> None:
        """A plan that exchanges no estimates holds the drift correction (nothing updates
        it then): it is kept, but the trainer's steps add none of it."""
        # One flag, read by the trainer at its next step: no lock, which a step may hold for
        # as long as it runs.
        if self.replica.correction is not None:
            self.replica.correction.hold = not self._plan.correct

    def _payload_nbytes(self, chosen: Plan) -> int | None:
        """Bytes of each payload of an exchange we offer under ``chosen`` (None: the codec is
        picked per peer, so the size is not known before)."""
        codec = chosen.codec or self.config.codec
        if codec == "auto":
            return None
        parts = 1 + (self.config.correction and chosen.correct)
        return encoded_nbytes(codec, self.replica.schema.numel, parts)

    def _candidates(self, skip: set[str]) -> list[Member]:
        """The members a round may pick now, but those in ``skip``."""
        now = trio.current_time()
        return [m for m in self.allowed(self._roster.alive(ready=True, reachable=True))
                if m.peer not in skip and not self._trust.quarantine.barred(m.peer, now)]

    def _pick(self, skip: set[str]) -> Member | None:
        return pick(self._candidates(skip), self._rng)

    # ---- the exchange -----------------------------------------------------------------

    async def respond(self, channel: SecureChannel, offer: Offer) -> None:
        """Answer an offer on ``channel`` (the roster's handler calls this): take it, or
        refuse it at once (:meth:`_refuse`)."""
        peer = channel.peer
        refusal = self._trust.refusal(offer, peer)
        rank = self._trust.offerer(peer)
        if refusal is None and lowbit.is_lowbit(offer.codec) and not self.codecs.warm():
            # Our periods would be as coarse as the weights: our next commit measures the
            # spread (gossip.feedback), and the offerer tries another peer meanwhile.
            self.codecs.asked()
            refusal = Refusal(Result.BUSY, "no spread measured yet")
        if refusal is None:
            refusal = self._later(rank, channel.host)
        if refusal is not None:
            await self._refuse(channel, offer, refusal)
            return
        # A newcomer's payload moves us by nothing (gossip.standing), and a correction that
        # moved on its side only would leave the swarm's sum of corrections off for good
        # (gossip.correction): with a newcomer, or before we have a gradient estimate of our
        # own, only the state is swapped. So it is with a member we never picked for a round
        # of ours: estimates add up where states do not (gossip.correction, "Bounds in sum"),
        # and a key holder's identities then reach our correction only at its share of the
        # hosts we pick, not as often as its offers' budget allows.
        corrected = (offer.correction and rank is not Standing.NEWCOMER
                     and self._trust.picked(peer) and self.replica.estimating
                     and self._plan.correct)
        side = _Side(False, rank, corrected, "accept", channel, offer.step)
        await self._exchange(peer, side, partial(self._accept, channel, offer))

    async def _refuse(self, channel: SecureChannel, offer: Offer, refusal: Refusal) -> None:
        """Say ``refusal`` and hang up. Busy means "try again later" (not ready is a later
        too); rejected means never."""
        if refusal.result is Result.REJECTED:
            log.info("averaging offer refused peer=%s reason=%s", channel.peer.short,
                     refusal.reason)
        said = ([describe(self.replica.schema)]  # say what ours is
                if offer.fingerprint != self.replica.schema.fingerprint else [])
        await channel.send_closing(*said, refusal.close())
        self._tally.carried(channel)

    def _later(self, rank: Standing, host: str) -> Refusal | None:
        """Why an offer we could take must wait (answered busy), or None to take it now."""
        if self.stopping:
            return Refusal(Result.BUSY, "leaving")
        if not self.ready.is_set():
            return Refusal(Result.BUSY, "not ready (fetching its initial state)")
        if self._busy:
            return Refusal(Result.BUSY, "busy")
        return self._trust.budget(rank, host)

    async def _exchange(self, peer: PeerId, side: _Side, talk: _Talk) -> Result:
        """One exchange with ``peer``, from either end: the snapshot, then ``talk`` (which
        dials and offers, :meth:`_offer`, or accepts, :meth:`_accept`), then the settling
        and the report. We are busy throughout: offers that come meanwhile are answered
        busy."""
        assert not self._busy, "checked, with no checkpoint in between"
        self._busy = True
        started = trio.current_time()
        own = theirs = None
        failure: BaseException | None = None
        try:
            own, theirs = self.replica.buffer(), self.replica.buffer()
            with one_error():
                async with trio.open_nursery() as copying:  # holds `own` until it is whole
                    mine, ready = await self._snapshot(copying, own, 1 + side.corrected)
                    outcome = await talk(side, own, theirs, mine, ready)
            if outcome.peer is not None:
                side.told = outcome.peer.step
            if outcome.parts and side.codec is not None:
                side.nbytes = encoded_nbytes(side.codec, self.replica.schema.numel, outcome.parts)
            result = await self._settle(peer, outcome, mine, side, own, theirs, started)
            theirs = None  # handed over
        except GossipError as exc:
            failure = exc
            self.codecs.failed()
            result = self._failure(peer, side.phase, exc)
            if isinstance(exc, (PeerGone, PeerTimeout)) and side.phase == "connect":
                self._roster.report_failure(peer)
            elif isinstance(exc, BadMessage) and side.phase == "offer":
                # A message we cannot decode on an authenticated channel (a garbled
                # SchemaInfo, say) is never an honest peer's: as with a refusal, stop
                # offering to it for a while rather than offer to it every round.
                self._trust.quarantine.bar(peer, trio.current_time())
        finally:
            self._busy = False
            self._release(own, theirs)
            if side.channel is not None:
                self._tally.carried(side.channel)
                self._time_link(side.channel, started, failure)
        self._ended(peer, side, result, started)
        return result

    async def _offer(self, member: Member, side: _Side, own: torch.Tensor,
                     theirs: torch.Tensor, mine: Counters, ready: trio.Event | None) -> Outcome:
        """The initiator's middle of :meth:`_exchange`: dial ``member`` and offer."""
        channel = side.channel = await self._dial(member)
        self._roster.proved(channel)
        async with channel:
            side.phase = "offer"
            side.codec = self._plan.codec or self.codecs.offer(
                1 + side.corrected, self._rates.measured(channel.host), self._rates.known())
            offer = Offer(self.replica.schema.fingerprint, side.codec, mine.step,
                          mine.samples, self._my_weight(mine), side.corrected)
            check, difference = self._checker(own, theirs, mine, side, ready,
                                              self._trust.senior(member.peer),
                                              self.config.clip)
            return await exchange.initiate(channel, offer, own, theirs, self.replica.schema,
                                           check, self._link_deadlines(channel), ready,
                                           difference.advance, self.codecs.encoder(side.codec))

    async def _accept(self, channel: SecureChannel, offer: Offer, side: _Side,
                      own: torch.Tensor, theirs: torch.Tensor, mine: Counters,
                      ready: trio.Event | None) -> Outcome:
        """The responder's middle of :meth:`_exchange`: take ``offer``."""
        peer = channel.peer
        accept = Accept(mine.step, mine.samples, self._my_weight(mine), side.corrected)
        side.codec = offer.codec
        check, difference = self._checker(own, theirs, mine, side, ready,
                                          self._trust.senior(peer),
                                          self._trust.clip(peer, len(self._histories[0])))
        return await exchange.respond(channel, offer, accept, own, theirs, self.replica.schema,
                                      check, self._link_deadlines(channel), ready,
                                      difference.advance, self.codecs.encoder(offer.codec))

    async def _snapshot(self, nursery: trio.Nursery, own: torch.Tensor,
                        parts: int) -> tuple[Counters, trio.Event | None]:
        """Start copying our state into ``own`` and return its counters as soon as the copy
        has begun, with an event set once ``own`` is whole (None: it is already). A large
        model is copied in a worker thread of ``nursery`` meanwhile, so the copy overlaps
        the connection, the offer's round trip and the peer's payload (the two sides'
        snapshots were a fifth of a 100 MB exchange when they ran first); a small one inline, as
        :func:`~gossip.replica.offload` does."""
        if not self.replica.offloads:
            return self.replica.snapshot(own, parts), None
        begun, ready = trio.Event(), trio.Event()
        counters: list[Counters] = []
        token = trio.lowlevel.current_trio_token()

        def on_counters(mine: Counters) -> None:  # in the worker thread, lock held
            counters.append(mine)
            token.run_sync_soon(begun.set)

        async def copy() -> None:
            await trio.to_thread.run_sync(self.replica.snapshot, own, parts, on_counters)
            ready.set()

        nursery.start_soon(copy)
        await begun.wait()
        return counters[0], ready

    def _checker(self, own: torch.Tensor, theirs: torch.Tensor, mine: Counters,
                 side: _Side, ready: trio.Event | None, senior: float,
                 clip: float) -> tuple[exchange.Check, Difference]:
        """The checks of a received payload (:func:`gossip.mixing.judge`), for the exchange,
        and the pass over the state that they start while the payload arrives (fed by the
        exchange's ``on_decoded``; it waits for our snapshot to be whole). ``senior``: the
        fraction of the mixing weight the peer's state gets (:meth:`Trust.senior
        <gossip.trust.Trust.senior>`); ``clip``: the state's clip (:meth:`Trust.clip
        <gossip.trust.Trust.clip>`)."""
        config, rank = self.config, side.rank
        coverage = self.codecs.coverage(side.codec or "fp32")
        difference = Difference(theirs, own, self.replica.schema.numel,
                                (lambda: True) if ready is None else ready.is_set)

        async def check(theirs: torch.Tensor, parts: int, peer: Offer | Accept) -> Verdict:
            c = senior * coefficient(config.weight, config.by_samples, self._my_weight(mine),
                                     peer.weight)
            if parts == 2:
                n = self.replica.schema.numel
                self.replica.clear_uncovered(theirs[n:])
            estimate_clip = (min(config.clip, ESTIMATE_CLIP)
                             if config.clip and self.replica.per_exchange else None)
            return await offload(self.replica, judge, theirs, own, parts, c, self._histories,
                                 clip=clip, max_norm_ratio=config.max_norm_ratio,
                                 standing=rank,
                                 correction=self.replica.correction_rate() * config.weight,
                                 gradient_scale=self.replica.gradient_scale,
                                 difference=difference, estimate_clip=estimate_clip,
                                 coverage=coverage)

        return check, difference

    async def _settle(self, peer: PeerId, outcome: Outcome, mine: Counters, side: _Side,
                      own: torch.Tensor, theirs: torch.Tensor, started: float) -> Result:
        """Tally an exchange that ended without failing and, if it committed, queue what
        it brought (through the outer step, if the replica keeps one). ``own`` is the
        snapshot we sent; ``theirs`` is handed over: queued, or given back."""
        rank, initiated = side.rank, side.initiated
        if outcome.ending is not Result.COMMITTED:
            self.codecs.failed()
            self.replica.release(theirs)
            if outcome.ending is Result.INVALID:
                return self._invalid(peer, outcome.reason)
            if outcome.ending is Result.REJECTED and initiated and not outcome.parts:
                # Another schema, codec or mode, or it quarantined us: it will not take our
                # offers for a while, so stop making them.
                self._trust.quarantine.bar(peer, trio.current_time())
            return self._refused(peer, outcome)
        verdict, bid = outcome.verdict, outcome.peer
        assert isinstance(verdict, Verdict) and bid is not None and side.codec is not None
        # The spreads, before the outer step turns `theirs` into the change to queue.
        await offload(self.replica, self.codecs.committed, side.codec, theirs, outcome.parts,
                      taken=verdict.state.scale > 0)
        self.codecs.used(str(peer), side.codec)
        if verdict.state.scale > 0:  # else a newcomer's: it learns from us, we take nothing
            weight = (merged_weight(self._my_weight(mine), bid.weight) if self.config.by_samples
                      else None)
            move = self._trust.moved_step(peer, rank, bid.step, mine)
            scale, outer = verdict.state.scale, self.replica.outer
            if outer is not None and (not self._plan.by_round or initiated and self._outer_due):
                self._outer_due = False
                # Committed: the outer state and the queue must both take it, or neither.
                n = self.replica.schema.numel
                with trio.CancelScope(shield=True):
                    await offload(self.replica, outer.step, own[:n], theirs[:n], scale,
                                  self._plan.momentum)
                scale = 1.0
            self.replica.queue(theirs, scale=scale,
                               correction=outcome.fraction,  # the same as the peer's
                               step_move=move, weight=weight,
                               sent_weight=self._my_weight(mine))
        else:
            self.replica.release(theirs)
        self._trust.committed(peer, rank)
        self._tally.committed(trio.current_time(), started, verdict.state.distance,
                              clipped=verdict.clipped, newcomer=rank is Standing.NEWCOMER,
                              parts=outcome.parts)
        log.debug("averaging committed peer=%s distance=%.4g clipped=%s standing=%s parts=%d",
                  peer.short, verdict.state.distance, verdict.clipped, rank.value, outcome.parts)
        return Result.COMMITTED

    # ---- helpers ----------------------------------------------------------------------

    def _link_deadlines(self, channel: SecureChannel) -> Deadlines:
        """An exchange's deadlines, its transfer's at the rate the peer's link is given."""
        return replace(self._deadlines, min_rate=self._rates.rate(channel.host))

    def _time_link(self, channel: SecureChannel, started: float,
                   failure: BaseException | None) -> None:
        """Count what an exchange's channel carried since ``started`` towards its link's
        measured rate: a whole exchange, or one whose transfer ran out of time."""
        stats = channel.statistics()
        carried = max(stats.bytes_sent, stats.bytes_received)
        seconds = trio.current_time() - started
        if failure is None:
            self._rates.observe(channel.host, carried, seconds, complete=True)
        elif isinstance(failure, PeerTimeout) and failure.phase in ("transfer", "record"):
            self._rates.observe(channel.host, carried, seconds, complete=False)

    def _release(self, *buffers: torch.Tensor | None) -> None:
        for buffer in buffers:
            if buffer is not None:
                self.replica.release(buffer)

    def _ended(self, peer: PeerId, side: _Side, result: Result, started: float) -> None:
        log.debug("averaging %s peer=%s result=%s codec=%s", "round" if side.initiated
                  else "answered", peer.short, result.value, side.codec)
        if result is Result.COMMITTED:
            self._last_partner = peer
        if self._on_exchange is not None:
            distance = self._tally.last_distance if result is Result.COMMITTED else None
            self._on_exchange(Exchange(peer, side.initiated, result, trio.current_time() - started,
                                       distance, side.told, side.codec, side.nbytes))

    def _my_weight(self, counters: Counters) -> float:
        return counters.weight if self.config.by_samples else 0.0

    def _refused(self, peer: PeerId, outcome: Outcome) -> Result:
        if outcome.ending is Result.REJECTED:
            log.info("averaging refused by peer=%s reason=%s", peer.short, outcome.reason)
        self._tally.results[outcome.ending] += 1  # BUSY or REJECTED
        return outcome.ending

    def _invalid(self, peer: PeerId, reason: str) -> Result:
        barred = self._trust.quarantine.strike(peer, trio.current_time())
        log.warning("averaging refused a payload peer=%s reason=%s%s", peer.short, reason,
                    " (quarantined)" if barred else "")
        self._tally.results[Result.INVALID] += 1
        return Result.INVALID

    def _failure(self, peer: PeerId, phase: str, exc: GossipError) -> Result:
        log.info("averaging round failed peer=%s phase=%s: %s", peer.short, phase, exc)
        self._tally.results[Result.FAILED] += 1
        return Result.FAILED
