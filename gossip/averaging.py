"""Gossip averaging: pairwise exchanges of model state with random peers.

Theory of operation
-------------------
Every ``interval`` seconds (jittered, so a swarm started at once does not fire at once) a node
runs a *round*: it takes a snapshot of its state, picks a peer at random among the members
that are alive, ready and not quarantined (a host uniformly, then one of its members:
:func:`gossip.standing.pick`), and offers an exchange on a fresh secure channel::

    initiator                               responder
    Offer(fingerprint, codec, step,   --->
          samples, weight)
                                      <---  Accept(step, samples, weight)
                                            | Close(BUSY)      already in an exchange
                                            | Close(REJECTED)  schema, codec, mode, quarantine
    state payload                     <-->  state payload        (both at once, section 7)
    check theirs; Commit or Close     <-->  check theirs; Commit or Close(REJECTED)
    apply on their Commit                   apply on their Commit

Each side applies only after it has checked the other's whole payload *and* received the
other's Commit, so a failure anywhere before that leaves both models untouched; the one-sided
case (one applies, the other not) shrinks to a lost final message. "Apply" means queueing
``delta = c·(s_peer − s)`` on the :class:`~gossip.replica.Replica`: the trainer adds it at its
next step boundary, so local steps taken during the exchange are kept (see
:mod:`gossip.mixing` for ``c`` and the checks).

One exchange at a time: a node that is in one answers any offer ``Close(BUSY)`` at once,
never waiting, so two nodes that offer to each other, or a whole swarm offering at the same
instant, cannot deadlock. The initiator then tries another peer after a short randomized
backoff (the busy one again if nobody else is left), up to ``attempts`` tries per round.
Every phase runs under its own deadline (connect, handshake, offer, transfer, commit), so a
silent peer costs one deadline.

A peer whose payload fails the checks gets a strike; ``strikes`` in a row quarantine it for
``quarantine`` seconds: we neither offer to it nor accept its offers. A peer whose schema,
codec or mixing mode differs from ours is quarantined at once (it cannot be averaged with).
How far a received state may move us depends on the exchange's standing
(:mod:`gossip.standing`): a peer we chose, or one with a record (a member for
``trust_after`` seconds, or one we chose before), moves us within the clip bound; a newcomer's offer commits but moves us by nothing, and the
newcomers behind one source host share a budget of one exchange per round of ours.

On a commit a node takes the peer's step if it is ahead, but never past the lower median of
the steps the alive, ready members announce (:func:`~gossip.standing.step_ceiling`), and the
same bound applies to a download: step-based learning-rate schedules line up across the
swarm, and a liar cannot move them.

Heavy work (snapshots, the delta) runs in a worker thread for models of
:data:`~gossip.replica.OFFLOAD_NUMEL` elements or more, and inline below that, so small models in a simulated
swarm stay on trio's virtual clock.
"""

from __future__ import annotations

import enum
import logging
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import trio

from .channel import SecureChannel, Timeouts, connect
from .download import CODEC as DOWNLOAD_CODEC
from .download import Download, download, serve_download
from .errors import GossipError, PeerGone, PeerTimeout, RemoteProtocolError, SchemaMismatch
from .groups import first_error
from .handshake import Swarm
from .identity import Identity, PeerId
from .member import Member, State
from .messages import Accept, Close, Commit, Offer, StateRequest
from .mixing import DeltaHistory, Quarantine, coefficient, make_delta, merged_weight
from .network import Network
from .replica import Counters, Replica, offload
from .roster import Roster
from .standing import NewcomerBudget, Records, Standing, pick, standing, step_ceiling
from .tensors import CODECS
from .transfer import receive_state, send_state

__all__ = ["AveragingConfig", "AveragingStatistics", "Averaging", "Exchange", "Result"]

log = logging.getLogger(__name__)

CLOSE_TIMEOUT = 1.0  # s to say Close(REJECTED) after refusing a payload


@dataclass(frozen=True)
class AveragingConfig:
    """How a node averages. Times in seconds.

    Raises:
        ValueError: a value out of range (the message names the field).
    """

    interval: float | None = 5.0  # mean time between our rounds (x U(0.75, 1.25)); None: only average_now()
    weight: float = 0.5  # fixed mode: delta = weight * (peer - own); 1/2 keeps the swarm's mean
    by_samples: bool = False  # push-sum: weigh each side by the samples it trained on
    codec: str = "fp32"  # wire codec of the exchanged states: fp32 (exact), bf16 or fp16
    attempts: int = 3  # peers tried per round when they are busy or fail
    backoff: float = 0.2  # mean pause before trying the next peer (x U(0.5, 1.5))
    clip: float = 5.0  # clip a step to clip x the median distance of our rounds; 0: no clipping
    clip_window: int = 32  # exchanges we initiated that the median looks back on
    clip_min_history: int = 8  # no clipping until this many are known
    max_norm_ratio: float = 100.0  # refuse a state farther from ours than this x our norm
    strikes: int = 3  # refused payloads in a row that quarantine a peer
    quarantine: float = 600.0  # how long a quarantine lasts
    trust_after: float = 10.0  # s alive before its offers move us, if we never picked it (standing)
    offer_timeout: float = 5.0  # from sending Offer to its answer
    transfer_timeout: float = 10.0  # both payloads: this + encoded bytes / min_rate
    min_rate: float = 1e6  # bytes/s the slowest link we accept moves (100 MB: 110 s)
    commit_timeout: float = 5.0  # for the peer's Commit, past the end of the transfer deadline
    start: str = "auto"  # "auto": download if a ready peer exists, else own init; "own"; "download"
    download_wait: float = 5.0  # "auto": after joining, how long to look for a ready peer

    def __post_init__(self) -> None:
        for name in ("interval", "weight", "clip", "quarantine", "trust_after", "download_wait"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and type(value) is not bool
                    or value is None and name == "interval"):
                raise ValueError(f"averaging.{name} must be a number, not {value!r}")
        if type(self.by_samples) is not bool:
            raise ValueError(f"averaging.by_samples must be a bool, not {self.by_samples!r}")
        positive = ("backoff", "offer_timeout", "transfer_timeout", "min_rate", "commit_timeout",
                    "max_norm_ratio")
        for name in positive:
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and type(value) is not bool
                    and math.isfinite(value) and value > 0):
                raise ValueError(f"averaging.{name} must be a positive number, not {value!r}")
        if self.interval is not None and not (math.isfinite(self.interval) and self.interval > 0):
            raise ValueError(f"averaging.interval must be positive or None, not {self.interval!r}")
        if not 0 < self.weight <= 1:
            raise ValueError(f"averaging.weight must be in (0, 1], not {self.weight!r}")
        if self.codec not in CODECS:
            raise ValueError(f"averaging.codec must be one of {CODECS}, not {self.codec!r}")
        for name in ("attempts", "clip_window", "clip_min_history", "strikes"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"averaging.{name} must be an integer >= 1, not {value!r}")
        if self.clip_min_history > self.clip_window:
            raise ValueError("averaging.clip_min_history must not exceed averaging.clip_window")
        if not (math.isfinite(self.clip) and self.clip >= 0):
            raise ValueError(f"averaging.clip must be >= 0, not {self.clip!r}")
        for name in ("quarantine", "trust_after"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"averaging.{name} must be >= 0, not {value!r}")
        if not (math.isfinite(self.download_wait) and self.download_wait >= 0):
            raise ValueError(f"averaging.download_wait must be >= 0, not {self.download_wait!r}")
        if self.start not in ("auto", "own", "download"):
            raise ValueError(f"averaging.start must be auto, own or download, not {self.start!r}")

    def transfer_deadline(self, nbytes: int) -> float:
        """The deadline for both payloads of ``nbytes`` each."""
        return self.transfer_timeout + nbytes / self.min_rate


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


@dataclass(frozen=True)
class AveragingStatistics:
    """A snapshot of a node's averaging since it started. Times are ``trio.current_time()``."""

    committed: int  # exchanges by result, as initiator or responder
    busy: int
    rejected: int
    invalid: int
    failed: int
    no_peer: int  # rounds that found no peer
    clipped: int  # committed exchanges whose step was clipped
    newcomers: int  # committed exchanges with a newcomer, whose state moved us by nothing
    newcomers_limited: int  # newcomers' offers answered busy: their host's budget was spent
    quarantined: int  # peers in quarantine now
    bytes_sent: int  # on the wire, over every averaging channel
    bytes_received: int
    last_exchange: float | None  # when the last commit happened
    mean_duration: float  # of committed exchanges, seconds, from offer to commit
    last_distance: float | None  # ||peer - own|| of the last committed exchange
    step: int  # this node's step, raised to peers' up to the members' median
    samples: int
    weight: float  # push-sum weight (1 plus samples trained; merged on exchanges)
    pending: int  # committed deltas not yet applied by the trainer
    downloads_served: int
    ready: bool  # whether this node averages (it has its initial state)


@dataclass
class _Tally:
    results: dict[Result, int] = field(default_factory=lambda: dict.fromkeys(Result, 0))
    clipped: int = 0
    newcomers: int = 0
    newcomers_limited: int = 0
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
                 allow: frozenset[str] | None = None) -> None:
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
        self.stopping = False  # set by stop(): no new exchanges either way
        self._history = DeltaHistory(config.clip_window, config.clip_min_history)
        self._quarantine = Quarantine(config.strikes, config.quarantine)
        self._newcomers = NewcomerBudget()
        self._records = Records()
        self._tally = _Tally()
        self.ready = trio.Event()
        self._nbytes = replica.schema.encoded_size(config.codec)
        self._serving = [0]  # downloads being served
        self._download_deadline = config.offer_timeout + config.transfer_deadline(
            replica.schema.encoded_size(DOWNLOAD_CODEC))

    # ---- public -----------------------------------------------------------------------

    def statistics(self) -> AveragingStatistics:
        t, c = self._tally, self.replica.counters()
        committed = t.results[Result.COMMITTED]
        return AveragingStatistics(
            committed, t.results[Result.BUSY], t.results[Result.REJECTED],
            t.results[Result.INVALID], t.results[Result.FAILED], t.results[Result.NO_PEER],
            t.clipped, t.newcomers, t.newcomers_limited,
            self._quarantine.count(trio.current_time()), t.bytes_sent,
            t.bytes_received, t.last_exchange, t.durations / committed if committed else 0.0,
            t.last_distance, c.step, c.samples, c.weight, self.replica.pending,
            t.downloads_served, self.ready.is_set(),
        )

    async def run(self) -> None:
        """Run a round every ``interval`` (jittered) until cancelled.

        The first round comes within a quarter interval of the node becoming ready, so that a
        node that just joined (or a misconfigured one) learns at once whether it can exchange.
        """
        if self.config.interval is None:
            await trio.sleep_forever()
        await self.ready.wait()
        await trio.sleep(self.config.interval * self._rng.uniform(0.0, 0.25))
        while True:
            await self.round()
            await trio.sleep(self.config.interval * self._rng.uniform(0.75, 1.25))

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
            peer = self._pick(failed | busy) or self._pick(failed)
            if peer is None:
                break
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
            with trio.move_on_after(CLOSE_TIMEOUT):
                await channel.send_message(close)
            self._count(channel)
            return
        self._busy = True
        started = trio.current_time()
        own = self.replica.buffer()
        try:
            mine = await offload(self.replica, self.replica.snapshot, own)
            try:
                with trio.fail_after(self.config.offer_timeout):
                    await channel.send_message(Accept(mine.step, mine.samples, self._my_weight(mine)))
            except trio.TooSlowError:
                raise PeerTimeout(peer.short, "accept") from None
            result = await self._swap(channel, own, mine, offer.step, offer.weight, started,
                                      rank)
        except (GossipError, trio.TooSlowError) as exc:
            result = self._failure(peer, "accept", exc)
        finally:
            self._busy = False
            self.replica.release(own)
            self._count(channel)
        self._ended(peer, False, result, started)

    async def serve_download(self, channel: SecureChannel, request: StateRequest,
                             task: Callable[[], Mapping[str, Any]]) -> None:
        """Answer a joiner's :class:`StateRequest` (the roster's handler calls this)."""
        if await serve_download(channel, request, self.replica, task, ready=self.ready.is_set(),
                                serving=self._serving, deadline=self._download_deadline):
            self._tally.downloads_served += 1

    async def download(self, candidates: list[Member]) -> Download:
        """Load the state of a candidate that answers (see
        :func:`gossip.download.download`)."""
        return await download(self.replica, candidates, self._network, self._identity,
                              self._swarm, self._timeouts, deadline=self._download_deadline,
                              rng=self._rng)

    # ---- the exchange -----------------------------------------------------------------

    def allowed(self, members: list[Member]) -> list[Member]:
        """The members on the allow-list (all of them when there is none)."""
        if self.allow is None:
            return members
        return [m for m in members if m.peer in self.allow]

    def _pick(self, skip: set[str]) -> Member | None:
        now = trio.current_time()
        return pick([m for m in self.allowed(self._roster.alive(ready=True))
                     if m.peer not in skip and not self._quarantine.barred(m.peer, now)],
                    self._rng)

    async def _initiate(self, member: Member) -> Result:
        assert not self._busy, "round() checks, with no checkpoint in between"
        self._busy = True
        peer, started = member.peer, trio.current_time()
        own = self.replica.buffer()
        channel: SecureChannel | None = None
        phase = "connect"
        try:
            mine = await offload(self.replica, self.replica.snapshot, own)
            channel = await connect(self._network, member.address, identity=self._identity,
                                    swarm=self._swarm, allow=frozenset({peer}),
                                    timeouts=self._timeouts)
            async with channel:
                phase = "offer"
                schema = self.replica.schema
                with trio.fail_after(self.config.offer_timeout):
                    await channel.send_message(Offer(schema.fingerprint, self.config.codec,
                                                     mine.step, mine.samples, self._my_weight(mine)))
                    answer = await channel.receive_message()
                if isinstance(answer, Close):
                    if answer.code == Close.REJECTED:
                        # Another schema, codec or mode, or it quarantined us: it will not
                        # take our offers for a while, so stop making them.
                        self._quarantine.bar(peer, trio.current_time())
                    result = self._refused(peer, answer)
                elif not isinstance(answer, Accept):
                    raise RemoteProtocolError(f"expected Accept, got {type(answer).__name__}")
                elif self.config.by_samples and answer.weight <= 0:
                    raise RemoteProtocolError("push-sum weight of 0 in Accept")
                else:
                    result = await self._swap(channel, own, mine, answer.step, answer.weight,
                                              started, Standing.CHOSEN)
        except (GossipError, trio.TooSlowError) as exc:
            result = self._failure(peer, phase, exc)
            if isinstance(exc, (PeerGone, PeerTimeout)) and phase == "connect":
                self._roster.report_failure(peer)
        finally:
            self._busy = False
            self.replica.release(own)
            if channel is not None:
                self._count(channel)
        self._ended(peer, True, result, started)
        return result

    async def _swap(self, channel: SecureChannel, own: torch.Tensor, mine: Counters,
                    peer_step: int, peer_weight: float, started: float,
                    rank: Standing) -> Result:
        """Both payloads at once, the checks, the commit. Returns the result (tallied)."""
        peer, config, schema = channel.peer, self.config, self.replica.schema
        theirs = self.replica.buffer()
        handed_over = False
        # Why our send failed, held until the receive is done: the verdict is on what the
        # peer sent, read to its end whatever became of our send, so that a peer that sent
        # a bad header and hung up earns its strike whether or not our payload had left.
        lost: list[GossipError] = []

        async def send() -> None:
            try:
                await send_state(channel, own, schema, config.codec)
            except GossipError as exc:  # PeerGone, or ChannelClosed: the receive failed
                lost.append(exc)

        try:
            transfer_end = trio.current_time() + config.transfer_deadline(self._nbytes)
            try:
                with trio.fail_at(transfer_end), first_error():
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(send)
                        await receive_state(channel, schema, config.codec, theirs)
                if lost:
                    raise lost[0]
            except trio.TooSlowError:
                raise PeerTimeout(peer.short, "transfer") from None
            except (SchemaMismatch, RemoteProtocolError) as exc:
                return self._invalid(peer, f"bad payload: {exc}")
            c = coefficient(config.weight, config.by_samples, self._my_weight(mine), peer_weight)
            verdict = await offload(self.replica, make_delta, theirs, own, c, self._history,
                                    clip=config.clip, max_norm_ratio=config.max_norm_ratio,
                                    standing=rank)
            if verdict.refused is not None:
                result = self._invalid(peer, verdict.refused)
                with trio.move_on_after(CLOSE_TIMEOUT):
                    try:
                        await channel.send_message(Close(Close.REJECTED, f"invalid state: {verdict.refused}"))
                    except GossipError:
                        pass  # it hung up already (say, it refused ours): the strike stands
                return result
            try:
                # Our send may have returned while the last of our payload still sat in
                # socket buffers on a slow link: the peer may still be receiving it, and it
                # has until the transfer deadline to, so the commit deadline counts from there.
                commit_by = max(transfer_end, trio.current_time()) + config.commit_timeout
                with trio.fail_at(commit_by):
                    await channel.send_message(Commit())
                    answer = await channel.receive_message()
            except trio.TooSlowError:
                raise PeerTimeout(peer.short, "commit") from None
            if isinstance(answer, Close):
                return self._refused(peer, answer)
            if not isinstance(answer, Commit):
                raise RemoteProtocolError(f"expected Commit, got {type(answer).__name__}")
            if verdict.scale > 0:  # else a newcomer's: it learns from us, we take nothing
                weight = (merged_weight(self._my_weight(mine), peer_weight) if config.by_samples
                          else None)
                self.replica.queue(theirs, scale=verdict.scale,
                                   peer_step=min(peer_step, self._step_ceiling()),
                                   weight=weight, sent_weight=self._my_weight(mine))
                handed_over = True
        finally:
            if not handed_over:
                self.replica.release(theirs)
        self._quarantine.clear(peer)
        if rank is Standing.CHOSEN:
            self._records.add(peer)
        now = trio.current_time()
        t = self._tally
        t.results[Result.COMMITTED] += 1
        t.clipped += verdict.clipped
        t.newcomers += rank is Standing.NEWCOMER
        t.last_exchange, t.last_distance = now, verdict.distance
        t.durations += now - started
        log.debug("averaging committed peer=%s distance=%.4g clipped=%s standing=%s",
                  peer.short, verdict.distance, verdict.clipped, rank.value)
        return Result.COMMITTED

    # ---- helpers ----------------------------------------------------------------------

    def _ended(self, peer: PeerId, initiated: bool, result: Result, started: float) -> None:
        log.debug("averaging %s peer=%s result=%s", "round" if initiated else "answered",
                  peer.short, result.value)
        if self._on_exchange is not None:
            distance = self._tally.last_distance if result is Result.COMMITTED else None
            self._on_exchange(Exchange(peer, initiated, result, trio.current_time() - started,
                                       distance))

    def _offerer(self, peer: str) -> Standing:
        """The standing of an offer from ``peer``: a member's, or a newcomer's."""
        member = self._roster.get(peer)
        since = member.since if member is not None and member.state is State.ALIVE else None
        return standing(False, since, trio.current_time(), self.config.trust_after,
                        chosen_before=peer in self._records)

    def _step_ceiling(self) -> int:
        return step_ceiling(self._roster.alive(ready=True))

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
        return None

    def _refusal(self, offer: Offer, peer: str) -> str | None:
        """Why we can never take this offer, or None if we could. The reason travels in
        ``Close.reason``, which is for logs: it never carries our schema's fingerprint (a
        client computes that from its model, PROTOCOL.md section 7.1); our own log does."""
        if offer.fingerprint != self.replica.schema.fingerprint:
            log.debug("averaging offer of another schema peer=%s theirs=%s ours=%s", peer[:8],
                     offer.fingerprint.hex(), self.replica.schema.fingerprint_hex)
            return "schema differs from ours (another model, or other task options)"
        if offer.codec != self.config.codec:
            return f"codec {offer.codec!r} is not ours ({self.config.codec!r})"
        if (offer.weight > 0) != self.config.by_samples:
            return "mixing modes differ (push-sum by samples vs fixed weight)"
        if self._quarantine.barred(peer, trio.current_time()):
            return "quarantined"
        return None

    def _refused(self, peer: str, close: Close) -> Result:
        if close.code == Close.BUSY:
            self._tally.results[Result.BUSY] += 1
            return Result.BUSY
        log.info("averaging refused by peer=%s code=%d reason=%s", peer[:8], close.code, close.reason)
        self._tally.results[Result.REJECTED] += 1
        return Result.REJECTED

    def _invalid(self, peer: str, reason: str) -> Result:
        barred = self._quarantine.strike(peer, trio.current_time())
        log.warning("averaging refused a payload peer=%s reason=%s%s", peer[:8], reason,
                    " (quarantined)" if barred else "")
        self._tally.results[Result.INVALID] += 1
        return Result.INVALID

    def _failure(self, peer: str, phase: str, exc: BaseException) -> Result:
        log.info("averaging round failed peer=%s phase=%s: %s", peer[:8], phase, exc)
        self._tally.results[Result.FAILED] += 1
        return Result.FAILED

    def _count(self, channel: SecureChannel) -> None:
        stats = channel.statistics()
        self._tally.bytes_sent += stats.bytes_sent
        self._tally.bytes_received += stats.bytes_received
