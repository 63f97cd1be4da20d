"""Gossip averaging: pairwise exchanges of model state with random peers.

Theory of operation
-------------------
A node starts a *round* once it has taken ``every`` local optimizer steps (x U(0.75, 1.25),
so a swarm that steps in lockstep does not offer in lockstep) since it started its last one,
or ``interval`` seconds (likewise jittered) after its last one ended, whichever comes first: the
period is counted in steps, because a second is thousands of steps of a small model and a
fraction of one of a large model, and the time bound keeps an idle node mixing. A round that
takes longer than ``every`` steps (a slow link) is followed at once by the next; training never
waits for the network. The node is also picked by its peers about as often as it picks, so it
takes part in about two exchanges every ``every`` steps. With ``every = "auto"`` the node
measures its step time and its committed exchanges' durations and starts a round every
``ceil(2 x exchange / step)`` steps (:mod:`gossip.spacing`; 1 until both are measured): its
exchanges come as often as its link carries them, and its own rounds do not queue behind
them. :attr:`AveragingStatistics.spacing` says the figure in use.

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

A peer whose payload fails the checks gets a strike; ``strikes`` in a row quarantine it for
``quarantine`` seconds: we neither offer to it nor accept its offers. A peer whose schema,
codec or mixing mode differs from ours is quarantined at once (it cannot be averaged with).
How far a received state may move us depends on the exchange's standing
(:mod:`gossip.standing`): a peer we chose, or one with a record (proved to us on a channel
and a member for ``trust_after`` seconds since, or one we chose before), moves us within the
clip bound; a newcomer's offer commits but moves us by nothing. The newcomers behind one
source host share a budget of one exchange per round of ours, and the members behind one
host one of twice what an honest host sends us per round.

On a commit a node moves its step half way towards the peer's, counting the peer's only as
far as it lies between our step and the swarm's (the median over the hosts of our last
rounds of each one's latest step, aged by our own steps since: one host counts once, however
often it is free to commit: :class:`~gossip.standing.PeerSteps`,
:func:`~gossip.standing.step_move`), and a
download takes the sender's step up to the members' median: nodes agree on the step their
learning-rate schedules follow, and a liar cannot move it.

Heavy work (snapshots, the delta) runs in a worker thread for models of
:data:`~gossip.replica.OFFLOAD_NUMEL` elements or more, and inline below that, so small models
in a simulated swarm stay on trio's virtual clock.
"""

from __future__ import annotations

import enum
import logging
import math
import random
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
import trio

from . import exchange
from .channel import SecureChannel, connect
from .config import AveragingConfig, Limits, Timeouts
from .correction import ESTIMATE_CLIP
from .download import CODEC as DOWNLOAD_CODEC
from .download import Download, Said, download, serve_download
from .errors import BadMessage, GossipError, PeerGone, PeerTimeout
from .exchange import Deadlines, Ending, Outcome
from .groups import one_error
from .handshake import Swarm
from .identity import Identity, PeerId
from .limits import RateLimit
from .linkrate import LinkRates
from .member import Member, State
from .messages import Accept, Close, Offer, StateRequest
from .mismatch import describe
from .mixing import (OFFER_CLIP, DeltaHistory, Difference, Quarantine, Verdict, coefficient,
                     judge, merged_weight)
from .network import Network
from .replica import OFFLOAD_NUMEL, Counters, Replica, offload
from .roster import Roster
from .spacing import Spacing
from .standing import (FOUNDING, MEMBER_BURST, MEMBER_SHARE, NewcomerBudget, PeerSteps, Records,
                       Standing, by_host, host_of, pick, seniority, standing, step_ceiling,
                       step_move)

__all__ = ["AveragingConfig", "AveragingStatistics", "Averaging", "Exchange", "Result"]

log = logging.getLogger(__name__)

PACE = 0.9  # our offers to one peer at most this x the channels per second it takes from one
PACE_SLACK = 0.001  # s past a paced peer's next token before we offer again (float rounding)


def deadlines(config: AveragingConfig) -> Deadlines:
    """The deadlines of one exchange's phases, for a link never measured (at ``min_rate``)."""
    return Deadlines(config.offer_timeout, config.transfer_timeout, config.min_rate,
                     config.commit_timeout, config.stall_timeout)


class Result(enum.Enum):
    """How an exchange (or a round) ended."""

    COMMITTED = "committed"  # both sides hold both states; the delta is queued
    BUSY = "busy"  # the peer was in another exchange
    REJECTED = "rejected"  # the peer refused our offer or our payload
    INVALID = "invalid"  # we refused the peer's payload (a strike)
    FAILED = "failed"  # network, deadline or protocol failure; nothing applied
    NO_PEER = "no_peer"  # a round found nobody to average with


@dataclass(frozen=True)
class Exchange:
    """One exchange as it ended at this node: what ``open_swarm(on_exchange=...)`` is told.

    A round that found nobody to try is no exchange; an offer this node refused before any
    payload (busy, or a schema it cannot use) is none either.
    """

    peer: PeerId
    initiated: bool  # we made the offer
    result: Result
    duration: float  # seconds, from before the snapshot to the end
    distance: float | None  # ||peer - own|| when committed, else None
    step: int | None = None  # the peer's step as its Offer or Accept said; None: unheard


@dataclass(frozen=True)
class AveragingStatistics:
    """A snapshot of a node's averaging since it started.

    ``seconds_since_exchange`` is the figure to show or alert on; ``last_exchange`` is a time
    on trio's clock (``trio.current_time()``, which is not ``time.time()``), for code in the
    node's own trio run that compares it with later snapshots.
    """

    committed: int  # exchanges by result, as initiator or responder
    busy: int
    rejected: int
    invalid: int
    failed: int
    no_peer: int  # rounds that found no peer
    clipped: int  # committed exchanges whose step (state or correction) was clipped
    newcomers: int  # committed exchanges with a newcomer, whose state moved us by nothing
    newcomers_limited: int  # newcomers' offers answered busy: their host's budget was spent
    members_limited: int  # members' offers answered busy: their host's budget was spent
    quarantined: int  # peers in quarantine now
    bytes_sent: int  # on the wire, over every averaging channel
    bytes_received: int
    last_exchange: float | None  # trio.current_time() of the last commit; None: none yet
    seconds_since_exchange: float | None  # seconds from the last commit to this snapshot
    mean_duration: float  # of committed exchanges, seconds, from offer to commit
    last_distance: float | None  # ||peer - own|| of the last committed exchange
    step: int  # the step this node schedules by: its own, moved towards the swarm's
    samples: int
    weight: float  # push-sum weight (1 plus samples trained; merged on exchanges)
    pending: int  # committed deltas not yet applied by the trainer
    downloads_served: int
    ready: bool  # whether this node averages (it has its initial state)
    corrected: int  # committed exchanges that swapped drift-correction estimates too
    # Local steps between the rounds this node starts, before the jitter: ``every``, or with
    # every = "auto" what the node measures now (gossip.spacing); None: by interval only.
    spacing: int | None


@dataclass
class _Tally:
    results: dict[Result, int] = field(default_factory=lambda: dict.fromkeys(Result, 0))
    clipped: int = 0
    newcomers: int = 0
    newcomers_limited: int = 0
    members_limited: int = 0
    corrected: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    last_exchange: float | None = None
    durations: float = 0.0
    last_distance: float | None = None
    downloads_served: int = 0


class Averaging:
    """Runs rounds as initiator and answers offers as responder. Built by
    :func:`gossip.node.open_swarm`; its :meth:`respond` is the roster's channel handler for
    ``Offer`` messages."""

    def __init__(self, replica: Replica, roster: Roster, network: Network, identity: Identity,
                 swarm: Swarm, config: AveragingConfig, timeouts: Timeouts,
                 rng: random.Random,
                 on_exchange: Callable[[Exchange], None] | None = None,
                 allow: frozenset[str] | None = None,
                 limits: Limits | None = None) -> None:
        self.replica = replica
        self.allow = allow  # peer ids we exchange with; None: any holder of the swarm key
        self.config = config
        self._roster = roster
        self._network = network
        self._identity = identity
        self._swarm = swarm
        self._timeouts = timeouts
        self._rng = rng
        self._on_exchange = on_exchange
        self._busy = False
        # Whom our last committed exchange was with, either way: tried last in our next round.
        self._last_partner: PeerId | None = None
        self.stopping = False  # set by stop(): no new exchanges either way
        self._histories = (DeltaHistory(config.clip_window, config.clip_min_history),
                           DeltaHistory(config.clip_window, config.clip_min_history))
        self._quarantine = Quarantine(config.strikes, config.quarantine)
        self._newcomers = NewcomerBudget()
        self._members = NewcomerBudget(MEMBER_BURST)
        self._records = Records()
        self._peer_steps = PeerSteps(config.clip_window)
        # Our offers to one peer, paced below the inbound channels per peer it lets in
        # (taken to be ours, Limits.peer_rate): a pair whose rounds come faster than that
        # had every offer past it cut off at the handshake, a failed round each.
        limits = limits or Limits()
        self._pace = RateLimit(PACE * limits.peer_rate, max(1, limits.peer_burst // 2))
        self._tally = _Tally()
        self.ready = trio.Event()
        self._deadlines = deadlines(config)
        self._rates = LinkRates(config.min_rate)  # per peer host: what its link carried
        self._serving = [0]  # downloads being served
        self._said = Said()  # download failures logged so far: each once out loud
        self._started = trio.current_time()  # for the peers' seniority: younger than us?
        # every = "auto": the spacing learns each committed exchange's duration, from our
        # offers and our answers alike, from the report _ended makes for on_exchange.
        spacing = self._spacing = Spacing() if config.every == "auto" else None
        self._every = None if isinstance(config.every, str) else config.every  # when fixed
        if spacing is not None:
            def timed(ended: Exchange) -> None:
                if ended.result is Result.COMMITTED:
                    spacing.exchanged(ended.duration)
                if on_exchange is not None:
                    on_exchange(ended)

            self._on_exchange = timed

    # ---- public -----------------------------------------------------------------------

    def statistics(self) -> AveragingStatistics:
        t, c, now = self._tally, self.replica.counters(), trio.current_time()
        committed = t.results[Result.COMMITTED]
        return AveragingStatistics(
            committed=committed,
            busy=t.results[Result.BUSY],
            rejected=t.results[Result.REJECTED],
            invalid=t.results[Result.INVALID],
            failed=t.results[Result.FAILED],
            no_peer=t.results[Result.NO_PEER],
            clipped=t.clipped,
            newcomers=t.newcomers,
            newcomers_limited=t.newcomers_limited,
            members_limited=t.members_limited,
            quarantined=self._quarantine.count(now),
            bytes_sent=t.bytes_sent,
            bytes_received=t.bytes_received,
            last_exchange=t.last_exchange,
            seconds_since_exchange=None if t.last_exchange is None else now - t.last_exchange,
            mean_duration=t.durations / committed if committed else 0.0,
            last_distance=t.last_distance,
            step=c.step,
            samples=c.samples,
            weight=c.weight,
            pending=self.replica.pending,
            downloads_served=t.downloads_served,
            ready=self.ready.is_set(),
            corrected=t.corrected,
            spacing=self._every if self._spacing is None else self._spacing.steps(),
        )

    async def run(self) -> None:
        """Start a round every ``every`` local steps, counted from the start of the last
        round, or once ``interval`` seconds pass after the last round's end, whichever comes
        first (each jittered), until cancelled.

        The first round's time bound is a quarter interval, so that a node that just joined
        (or a misconfigured one) learns at once whether it can exchange.

        With ``every = "auto"`` the steps are the spacing measured when the round starts
        (:mod:`gossip.spacing`, fed the step counter at each round's start), and the time
        bound is at least the median exchange: an idle node, too, then leaves its link free
        half the time for its peers' offers, where a short ``interval`` would queue its own
        rounds behind a slow link.
        """
        every, interval = self._every, self.config.interval
        if every is None and self._spacing is None and interval is None:
            await trio.sleep_forever()
        await self.ready.wait()
        first, pause = True, interval
        since, began = self.replica.local_steps, trio.current_time()  # the last round's start
        while True:
            if self._spacing is not None:
                self._spacing.stepped(since, began)
                every = self._spacing.steps()
                if interval is not None:
                    pause = max(interval, self._spacing.exchange or 0.0)
            steps = None if every is None else max(1, round(every * self._rng.uniform(0.75, 1.25)))
            spread = (0.0, 0.25) if first else (0.75, 1.25)
            seconds = math.inf if pause is None else pause * self._rng.uniform(*spread)
            with trio.move_on_after(seconds):  # an idle node pauses between its rounds
                if steps is None:
                    await trio.sleep_forever()
                await self._local_steps(since + steps)
            first = False
            since, began = self.replica.local_steps, trio.current_time()
            await self.round()

    async def _local_steps(self, target: int) -> None:
        """Return once the trainer has counted ``target`` local steps (it may count them in
        any thread)."""
        reached = trio.Event()
        token, here = trio.lowlevel.current_trio_token(), threading.get_ident()

        def wake() -> None:
            if threading.get_ident() == here:
                reached.set()
            else:
                try:
                    token.run_sync_soon(reached.set)
                except trio.RunFinishedError:
                    pass  # the node is gone; nobody waits any more

        self.replica.watch(target, wake)
        await reached.wait()

    def stop(self) -> None:
        """Start no more exchanges and answer offers busy (the node is about to leave); an
        exchange in flight goes on to its end."""
        self.stopping = True

    async def round(self) -> Result:
        """Average with one peer: try up to ``attempts`` random peers until one commits.

        Returns:
            The last attempt's result (``NO_PEER`` if there was nobody to try).
        """
        await self.ready.wait()
        self._roster.set_meta(step=self.replica.counters().step)
        self._newcomers.round()
        # Each host picks among the hosts that take offers: its share of our offers is one
        # over those (but us). Proven ones only: claims could shrink everyone's share.
        hosts = len(by_host(self._roster.alive(ready=True, reachable=True, proven=True),
                            self._roster.proven_host))
        self._members.round(MEMBER_SHARE / max(hosts, 1))
        # A peer that failed or refused is not tried again this round. One that was busy
        # may be, when nobody untried is left: two nodes whose rounds start at the same
        # instant are busy with their own offers, and the randomized backoff lets one of
        # them find the other idle.
        failed: set[str] = set()
        busy: set[str] = set()
        result = Result.NO_PEER
        for attempt in range(self.config.attempts):
            if self.stopping:
                return result
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
                    return result
                if self._busy:  # an offer came meanwhile, and we answer it
                    result = Result.BUSY
                    continue
                peer = self._pick(failed | self._paced())
            if peer is None:
                break
            self._pace.allow(peer.peer, trio.current_time())
            result = await self._initiate(peer)
            if result in (Result.COMMITTED, Result.INVALID):
                break
            (busy if result is Result.BUSY else failed).add(peer.peer)
        if result is Result.NO_PEER:
            self._tally.results[Result.NO_PEER] += 1
        return result

    async def respond(self, channel: SecureChannel, offer: Offer) -> None:
        """Answer an offer on ``channel`` (the roster's handler calls this)."""
        peer = channel.peer
        refusal = self._refusal(offer, peer)
        rank = self._offerer(peer)
        later = None if refusal is not None else self._later(rank, channel.host)
        if later is not None or refusal is not None:
            # Busy means "try again later" (not ready is a later too); Rejected means never.
            if later is not None:
                close = Close(Close.BUSY, later)
            else:
                log.info("averaging offer refused peer=%s reason=%s", peer.short, refusal)
                close = Close(Close.REJECTED, refusal)
            said = ([describe(self.replica.schema)]  # say what ours is
                    if offer.fingerprint != self.replica.schema.fingerprint else [])
            await channel.send_closing(*said, close)
            self._count(channel)
            return
        self._busy = True
        started = trio.current_time()
        # A newcomer's payload moves us by nothing (gossip.standing), and a correction that
        # moved on its side only would leave the swarm's sum of corrections off for good
        # (gossip.correction): with a newcomer, or before we have a gradient estimate of our
        # own, only the state is swapped.
        corrected = (offer.correction and rank is not Standing.NEWCOMER
                     and self.replica.estimating)
        own = theirs = None
        failure: BaseException | None = None
        try:
            own, theirs = self.replica.buffer(), self.replica.buffer()
            with one_error():
                async with trio.open_nursery() as copying:  # holds `own` until it is whole
                    mine, ready = await self._snapshot(copying, own, 1 + corrected)
                    accept = Accept(mine.step, mine.samples, self._my_weight(mine), corrected)
                    check, difference = self._checker(own, theirs, mine, rank, ready,
                                                      self._seniority(peer), self._clip(peer))
                    outcome = await exchange.respond(channel, offer, accept, own, theirs,
                                                     self.replica.schema, check,
                                                     self._link_deadlines(channel), ready,
                                                     difference.advance)
            result = await self._settle(peer, outcome, mine, rank, own, theirs, started,
                                        initiated=False)
            theirs = None  # handed over
        except GossipError as exc:
            failure = exc
            result = self._failure(peer, "accept", exc)
        finally:
            self._busy = False
            self._release(own, theirs)
            self._count(channel)
            self._time_link(channel, started, failure)
        self._ended(peer, False, result, started, offer.step)

    async def serve_download(self, channel: SecureChannel, request: StateRequest,
                             task: Callable[[], Mapping[str, Any]]) -> None:
        """Answer a joiner's :class:`StateRequest` (the roster's handler calls this)."""
        if await serve_download(channel, request, self.replica, task, ready=self.ready.is_set(),
                                serving=self._serving, deadline=self._download_deadline):
            self._tally.downloads_served += 1

    async def download(self, candidates: list[Member],
                       task: Callable[[], Mapping[str, Any]] | None = None) -> Download:
        """Load the state of a candidate that answers (see
        :func:`gossip.download.download`); ``task`` gives our task metadata, to compare with
        a refusing peer's. The step's ceiling counts only the candidates that proved
        their identity to us (:meth:`~gossip.roster.Roster.prove` some first)."""
        proven = {m.peer: self._roster.proven_host(m) for m in candidates
                  if self._roster.proven_since(m.peer) is not None}
        return await download(self.replica, candidates, self._network, self._identity,
                              self._swarm, self._timeouts, deadline=self._download_deadline,
                              rng=self._rng, task=task, said=self._said, rates=self._rates,
                              stall=self.config.stall_timeout, proven=proven)

    def _download_deadline(self, host: str) -> float:
        """Seconds a state download with ``host`` may take once connected: the request's
        answer, and the state at the rate its link is given (:mod:`gossip.linkrate`)."""
        return self.config.offer_timeout + self._rates.deadline(
            host, self.config.transfer_timeout, self.replica.schema.encoded_size(DOWNLOAD_CODEC))

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

    # ---- the exchange -----------------------------------------------------------------

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

    def _pick(self, skip: set[str]) -> Member | None:
        now = trio.current_time()
        return pick([m for m in self.allowed(self._roster.alive(ready=True, reachable=True))
                     if m.peer not in skip and not self._quarantine.barred(m.peer, now)],
                    self._rng)

    async def _initiate(self, member: Member) -> Result:
        assert not self._busy, "round() checks, with no checkpoint in between"
        self._busy = True
        peer, started = member.peer, trio.current_time()
        channel: SecureChannel | None = None
        phase = "connect"
        corrected = self.replica.estimating  # decided before the snapshot that holds it
        own = theirs = None
        told: int | None = None  # the peer's step, once its Accept says it
        failure: BaseException | None = None
        try:
            own, theirs = self.replica.buffer(), self.replica.buffer()
            with one_error():
                async with trio.open_nursery() as copying:  # holds `own` until it is whole
                    mine, ready = await self._snapshot(copying, own, 1 + corrected)
                    channel = await connect(self._network, member.address,
                                            identity=self._identity, swarm=self._swarm,
                                            allow=frozenset({peer}), timeouts=self._timeouts)
                    self._roster.proved(channel)
                    async with channel:
                        phase = "offer"
                        offer = Offer(self.replica.schema.fingerprint, self.config.codec,
                                      mine.step, mine.samples, self._my_weight(mine), corrected)
                        check, difference = self._checker(own, theirs, mine, Standing.CHOSEN,
                                                          ready, self._seniority(peer),
                                                          self.config.clip)
                        outcome = await exchange.initiate(
                            channel, offer, own, theirs, self.replica.schema, check,
                            self._link_deadlines(channel), ready, difference.advance)
            told = None if outcome.peer is None else outcome.peer.step
            result = await self._settle(peer, outcome, mine, Standing.CHOSEN, own, theirs,
                                        started, initiated=True)
            theirs = None  # handed over
        except GossipError as exc:
            failure = exc
            result = self._failure(peer, phase, exc)
            if isinstance(exc, (PeerGone, PeerTimeout)) and phase == "connect":
                self._roster.report_failure(peer)
            elif isinstance(exc, BadMessage) and phase == "offer":
                # A message we cannot decode on an authenticated channel (a garbled
                # SchemaInfo, say) is never an honest peer's: as with a refusal, stop
                # offering to it for a while rather than offer to it every round.
                self._quarantine.bar(peer, trio.current_time())
        finally:
            self._busy = False
            self._release(own, theirs)
            if channel is not None:
                self._count(channel)
                self._time_link(channel, started, failure)
        self._ended(peer, True, result, started, told)
        return result

    async def _snapshot(self, nursery: trio.Nursery, own: torch.Tensor,
                        parts: int) -> tuple[Counters, trio.Event | None]:
        """Start copying our state into ``own`` and return its counters as soon as the copy
        has begun, with an event set once ``own`` is whole (None: it is already). A large
        model is copied in a worker thread of ``nursery`` meanwhile, so the copy overlaps
        the connection, the offer's round trip and the peer's payload (the two sides'
        snapshots were a fifth of a 100 MB exchange when they ran first); a small one inline, as
        :func:`~gossip.replica.offload` does."""
        if self.replica.schema.numel < OFFLOAD_NUMEL:
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
                 rank: Standing, ready: trio.Event | None, senior: float,
                 clip: float) -> tuple[exchange.Check, Difference]:
        """The checks of a received payload (:func:`gossip.mixing.judge`), for the exchange,
        and the pass over the state that they start while the payload arrives (fed by the
        exchange's ``on_decoded``; it waits for our snapshot to be whole). ``senior``: the
        fraction of the mixing weight the peer's state gets (:func:`seniority`); ``clip``:
        the state's clip (:meth:`_clip`)."""
        config = self.config
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
                                 difference=difference, estimate_clip=estimate_clip)

        return check, difference

    async def _settle(self, peer: PeerId, outcome: Outcome, mine: Counters, rank: Standing,
                      own: torch.Tensor, theirs: torch.Tensor, started: float, *,
                      initiated: bool) -> Result:
        """Tally an exchange that ended without failing and, if it committed, queue what
        it brought (through the outer step, if the replica keeps one). ``own`` is the
        snapshot we sent; ``theirs`` is handed over: queued, or given back."""
        if outcome.ending is not Ending.COMMITTED:
            self.replica.release(theirs)
            if outcome.ending is Ending.INVALID:
                return self._invalid(peer, outcome.reason)
            if outcome.ending is Ending.REJECTED and initiated and not outcome.parts:
                # Another schema, codec or mode, or it quarantined us: it will not take our
                # offers for a while, so stop making them.
                self._quarantine.bar(peer, trio.current_time())
            return self._refused(peer, outcome)
        verdict, bid = outcome.verdict, outcome.peer
        assert isinstance(verdict, Verdict) and bid is not None
        if verdict.state.scale > 0:  # else a newcomer's: it learns from us, we take nothing
            weight = (merged_weight(self._my_weight(mine), bid.weight) if self.config.by_samples
                      else None)
            members = self._roster.alive(ready=True, proven=True)
            chosen = self._roster.get(peer) if rank is Standing.CHOSEN else None
            if chosen is not None:
                self._peer_steps.add(host_of(chosen), str(peer), bid.step, mine.local)
            host = self._roster.proven_host
            swarm = self._peer_steps.swarm(mine.local, len(by_host(members, host)), len(members))
            if swarm is None:  # too few hosts of our own rounds yet: the announcements
                swarm = step_ceiling(members, host) if members else None
            move = step_move(mine.heading, bid.step, swarm)
            scale, outer = verdict.state.scale, self.replica.outer
            if outer is not None:
                # Committed: the outer state and the queue must both take it, or neither.
                n = self.replica.schema.numel
                with trio.CancelScope(shield=True):
                    await offload(self.replica, outer.step, own[:n], theirs[:n], scale)
                scale = 1.0
            self.replica.queue(theirs, scale=scale,
                               correction=outcome.fraction,  # the same as the peer's
                               step_move=move, weight=weight,
                               sent_weight=self._my_weight(mine))
        else:
            self.replica.release(theirs)
        self._quarantine.clear(peer)
        if rank is Standing.CHOSEN:
            self._records.add(peer)
        now = trio.current_time()
        t = self._tally
        t.results[Result.COMMITTED] += 1
        t.clipped += verdict.clipped
        t.newcomers += rank is Standing.NEWCOMER
        t.corrected += outcome.parts == 2
        t.last_exchange, t.last_distance = now, verdict.state.distance
        t.durations += now - started
        log.debug("averaging committed peer=%s distance=%.4g clipped=%s standing=%s parts=%d",
                  peer.short, verdict.state.distance, verdict.clipped, rank.value, outcome.parts)
        return Result.COMMITTED

    # ---- helpers ----------------------------------------------------------------------

    def _release(self, *buffers: torch.Tensor | None) -> None:
        for buffer in buffers:
            if buffer is not None:
                self.replica.release(buffer)

    def _ended(self, peer: PeerId, initiated: bool, result: Result, started: float,
               step: int | None) -> None:
        log.debug("averaging %s peer=%s result=%s", "round" if initiated else "answered",
                  peer.short, result.value)
        if result is Result.COMMITTED:
            self._last_partner = peer
        if self._on_exchange is not None:
            distance = self._tally.last_distance if result is Result.COMMITTED else None
            self._on_exchange(Exchange(peer, initiated, result, trio.current_time() - started,
                                       distance, step))

    def _offerer(self, peer: str) -> Standing:
        """The standing of an offer from ``peer``: a member's, or a newcomer's. Its time
        counts from when it was both alive in our table and proved to us (its offer's own
        channel proves it, so a first offer is a newcomer's)."""
        member = self._roster.get(peer)
        proved = self._roster.proven_since(peer)
        since = (max(member.since, proved) if member is not None
                 and member.state is State.ALIVE and proved is not None else None)
        return standing(False, since, trio.current_time(), self.config.trust_after,
                        chosen_before=peer in self._records)

    def _seniority(self, peer: str) -> float:
        """The fraction of the mixing weight ``peer``'s state gets (:func:`seniority`); in
        push-sum mode always 1, since the weights there already give a joiner its share."""
        if self.config.by_samples:
            return 1.0
        member = self._roster.get(peer)
        now = trio.current_time()
        alive_for = (now - member.since if member is not None and member.state is State.ALIVE
                     else None)
        return seniority(alive_for, now - self._started, self.config.trust_after)

    def _clip(self, peer: str) -> float:
        """The state's clip for an offer from ``peer``: :data:`~gossip.mixing.OFFER_CLIP`,
        or the configured clip while we are young (our history of rounds is not full yet)
        and the peer was a member before us (in our table, alive, and proved to us, both
        since no later than :data:`FOUNDING` x ``trust_after`` after our start): a joiner is
        the one far from the swarm, and the members it joined must be able to pull it in."""
        clip = self.config.clip
        if not clip or len(self._histories[0]) >= self.config.clip_window:
            return min(clip, OFFER_CLIP) if clip else clip
        member, proved = self._roster.get(peer), self._roster.proven_since(peer)
        founding = self._started + FOUNDING * self.config.trust_after
        older = (member is not None and member.state is State.ALIVE and member.since <= founding
                 and proved is not None and proved <= founding)
        return clip if older else min(clip, OFFER_CLIP)

    def _my_weight(self, counters: Counters) -> float:
        return counters.weight if self.config.by_samples else 0.0

    def _later(self, rank: Standing, host: str) -> str | None:
        """Why an offer we could take must wait (answered busy), or None to take it now."""
        if self.stopping:
            return "leaving"
        if not self.ready.is_set():
            return "not ready (fetching its initial state)"
        if self._busy:
            return "busy"
        if rank is Standing.NEWCOMER and not self._newcomers.allow(host):
            self._tally.newcomers_limited += 1
            return "busy: newcomers from this address have had their share for now"
        if (rank is Standing.MEMBER and self.config.trust_after > 0
                and not self._members.allow(host)):
            self._tally.members_limited += 1
            return "busy: members from this address have had their share for now"
        return None

    def _refusal(self, offer: Offer, peer: PeerId) -> str | None:
        """Why we can never take this offer, or None if we could. The reason travels in
        ``Close.reason``, which is for logs: it never carries our schema's fingerprint (a
        client computes that from its model, PROTOCOL.md section 7.1); our own log does."""
        if offer.fingerprint != self.replica.schema.fingerprint:
            log.debug("averaging offer of another schema peer=%s theirs=%s ours=%s", peer.short,
                     offer.fingerprint.hex(), self.replica.schema.fingerprint_hex)
            return "schema differs from ours (another model, or other task options)"
        if offer.codec != self.config.codec:
            return f"codec {offer.codec!r} is not ours ({self.config.codec!r})"
        if (offer.weight > 0) != self.config.by_samples:
            return "mixing modes differ (push-sum by samples vs fixed weight)"
        if self._quarantine.barred(peer, trio.current_time()):
            return "quarantined"
        return None

    def _refused(self, peer: PeerId, outcome: Outcome) -> Result:
        if outcome.ending is Ending.BUSY:
            self._tally.results[Result.BUSY] += 1
            return Result.BUSY
        log.info("averaging refused by peer=%s reason=%s", peer.short, outcome.reason)
        self._tally.results[Result.REJECTED] += 1
        return Result.REJECTED

    def _invalid(self, peer: PeerId, reason: str) -> Result:
        barred = self._quarantine.strike(peer, trio.current_time())
        log.warning("averaging refused a payload peer=%s reason=%s%s", peer.short, reason,
                    " (quarantined)" if barred else "")
        self._tally.results[Result.INVALID] += 1
        return Result.INVALID

    def _failure(self, peer: PeerId, phase: str, exc: GossipError) -> Result:
        log.info("averaging round failed peer=%s phase=%s: %s", peer.short, phase, exc)
        self._tally.results[Result.FAILED] += 1
        return Result.FAILED

    def _count(self, channel: SecureChannel) -> None:
        stats = channel.statistics()
        self._tally.bytes_sent += stats.bytes_sent
        self._tally.bytes_received += stats.bytes_received
