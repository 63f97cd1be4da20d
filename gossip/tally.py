"""What a node's averaging reports: each exchange as it ended, and its statistics.

Theory of operation
-------------------
Every exchange ends in one :class:`~gossip.exchange_state.Result`, whichever end we were, and
so does every round that found nobody to try (``NO_PEER``). A :class:`Tally` counts them as
:class:`~gossip.averaging.Averaging` settles each one, with what its channel carried and, for
the committed ones, how long they took, how far the peer was, and how many were clipped, with
a newcomer, or swapped the correction's estimates too. It reads no clock: the averager passes
the times in, and the tally only adds up.

Two records leave the node: :class:`Exchange`, what ``open_swarm(on_exchange=...)`` is told as
each exchange ends, and :class:`AveragingStatistics`, a snapshot of the tally with the node's
counters and its trust in its peers, the quarantine and the budgets (:mod:`gossip.trust`), made
by :meth:`Tally.statistics`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .channel import SecureChannel
from .exchange_state import Result
from .identity import PeerId
from .replica import Counters
from .trust import Trust

__all__ = ["Exchange", "AveragingStatistics", "Tally"]


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
    codec: str | None = None  # of both payloads, once the Offer named it
    nbytes: int | None = None  # our payload's size (the peer's is the same) once both were due


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
    # Exchanges each round of ours makes at that spacing (gossip.plan): 1 at close spacing, up
    # to 3 from LARGE_SPACING on.
    round_peers: int = 1
    # This process's optimizer steps, which go on whatever ``step`` does, and those of them
    # still to take before ``step`` counts again (a node ahead of the swarm holds its step
    # while the others catch up: gossip.replica's debt).
    own_steps: int = 0
    held: int = 0


@dataclass
class Tally:
    """A node's exchanges since it started, added up."""

    results: dict[Result, int] = field(default_factory=lambda: dict.fromkeys(Result, 0))
    clipped: int = 0
    newcomers: int = 0
    corrected: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    last_exchange: float | None = None
    durations: float = 0.0
    last_distance: float | None = None

    def carried(self, channel: SecureChannel) -> None:
        """Count what an averaging channel carried, either way."""
        stats = channel.statistics()
        self.bytes_sent += stats.bytes_sent
        self.bytes_received += stats.bytes_received

    def committed(self, now: float, started: float, distance: float, *, clipped: bool,
                  newcomer: bool, parts: int) -> None:
        """Count a committed exchange that started at ``started`` and ended ``now``, with a
        peer ``distance`` away (``parts``: 2 if it swapped the estimates too)."""
        self.results[Result.COMMITTED] += 1
        self.clipped += clipped
        self.newcomers += newcomer
        self.corrected += parts == 2
        self.last_exchange, self.last_distance = now, distance
        self.durations += now - started

    def statistics(self, now: float, counters: Counters, trust: Trust, *, pending: int,
                   ready: bool, downloads_served: int, spacing: int | None,
                   round_peers: int = 1) -> AveragingStatistics:
        """The snapshot at ``now``, with the node's ``counters``, its ``trust`` in its peers
        and the figures the tally does not keep (see :class:`AveragingStatistics`)."""
        committed = self.results[Result.COMMITTED]
        return AveragingStatistics(
            committed=committed,
            busy=self.results[Result.BUSY],
            rejected=self.results[Result.REJECTED],
            invalid=self.results[Result.INVALID],
            failed=self.results[Result.FAILED],
            no_peer=self.results[Result.NO_PEER],
            clipped=self.clipped,
            newcomers=self.newcomers,
            newcomers_limited=trust.newcomers_limited,
            members_limited=trust.members_limited,
            quarantined=trust.quarantine.count(now),
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            last_exchange=self.last_exchange,
            seconds_since_exchange=(None if self.last_exchange is None
                                    else now - self.last_exchange),
            mean_duration=self.durations / committed if committed else 0.0,
            last_distance=self.last_distance,
            step=counters.step,
            samples=counters.samples,
            weight=counters.weight,
            pending=pending,
            downloads_served=downloads_served,
            ready=ready,
            corrected=self.corrected,
            spacing=spacing,
            round_peers=round_peers,
            own_steps=counters.local,
            held=counters.debt,
        )
