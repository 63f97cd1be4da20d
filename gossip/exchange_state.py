"""The rules of one averaging exchange: which message may come next, and how it ended. Pure.

Theory of operation
-------------------
:mod:`gossip.exchange` moves the messages and the payloads; this module decides what each
message the peer sends means, and what we say back, so the I/O is thin glue and the rules are
tested without a channel (h11 keeps its state machine the same way). An
:class:`ExchangeState` goes through these phases::

    phase     event                              next      ending
    ANSWER    Close(BUSY)                        ENDED     BUSY
    ANSWER    Close(any other code)              ENDED     REJECTED
    ANSWER    SchemaInfo (a Close follows)       ENDED     REJECTED, what differs
    ANSWER    Accept that fits the Offer         TRANSFER
    ANSWER    anything else                      RemoteProtocolError
    TRANSFER  a payload that does not decode     ENDED     INVALID, "bad payload"
    TRANSFER  our verdict refuses the payload    ENDED     INVALID; we say Close(REJECTED)
    TRANSFER  our verdict takes it               COMMIT    we say Commit(fraction)
    COMMIT    Close                              ENDED     BUSY or REJECTED
    COMMIT    Commit                             ENDED     COMMITTED, the smaller fraction
    COMMIT    a record that is no valid message, ENDED     INVALID, "bad Commit"
              or another message

The initiator starts in ANSWER, its ``Offer`` sent. The responder starts in TRANSFER, its
``Accept`` sent: whether to take an offer at all is its caller's decision, which says no with a
:class:`Refusal`. An ``Accept`` fits the offer when it mixes the same way (push-sum or a fixed
weight) and takes the correction's estimates only if the offer brought them; the payloads then
hold the state and, if the ``Accept`` says so, the estimates (``parts``, 1 or 2).

An exchange that did not fail ends as an :class:`Outcome`; one that failed raises (the peer's
protocol error here, the channel's and the deadlines' in :mod:`gossip.exchange`), and either
way nothing is applied unless the ending is ``COMMITTED``.

A bad answer to our ``Commit`` (a ``Commit`` whose fraction is out of range, which does not
decode, or any message but ``Commit`` and ``Close``) ends ``INVALID``, a strike, and not as a
mere failure: by then the peer holds our ``Commit`` and may apply the exchange, while we
apply nothing. A peer that hangs up instead gets the same one-sided exchange, but a lost
message is what an honest link does too; a malformed answer is the peer's doing alone.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from .errors import LocalProtocolError, RemoteProtocolError
from .messages import Accept, Close, Commit, Message, Offer, SchemaInfo
from .mismatch import explain
from .schema import StateSchema

__all__ = ["Result", "Refusal", "Verdict", "Outcome", "Side", "Phase", "ExchangeState"]


class Result(enum.Enum):
    """How an exchange (or a round) ended."""

    COMMITTED = "committed"  # both sides hold both states; the delta is queued
    BUSY = "busy"  # the peer was in another exchange
    REJECTED = "rejected"  # the peer refused our offer or our payload
    INVALID = "invalid"  # we refused the peer's payload (a strike)
    FAILED = "failed"  # network, deadline or protocol failure; nothing applied
    NO_PEER = "no_peer"  # a round found nobody to average with


@dataclass(frozen=True)
class Refusal:
    """Why an offer is not taken: ``BUSY`` (try again later) or ``REJECTED`` (never), and the
    reason, which is for logs."""

    result: Result
    reason: str

    def __post_init__(self) -> None:
        if self.result not in (Result.BUSY, Result.REJECTED):
            raise ValueError(f"an offer is refused busy or rejected, not {self.result.value}")

    @classmethod
    def of(cls, close: Close) -> Refusal:
        """What the peer's ``Close`` says: busy for ``BUSY``, rejected for any other code."""
        return cls(Result.BUSY if close.code == Close.BUSY else Result.REJECTED, close.reason)

    def close(self) -> Close:
        """The ``Close`` that says it."""
        return Close(Close.BUSY if self.result is Result.BUSY else Close.REJECTED, self.reason)


class Verdict(Protocol):
    """What a payload's check returns: ``refused`` is why the payload is refused, or None;
    ``fraction`` what our ``Commit`` offers to move the correction by (0.0: no estimates)."""

    @property
    def refused(self) -> str | None: ...

    @property
    def fraction(self) -> float: ...


@dataclass(frozen=True)
class Outcome:
    """An exchange that ended without failing.

    Attributes:
        ending: how it ended (never ``FAILED`` or ``NO_PEER``).
        reason: why it did not commit (the peer's ``Close`` reason, or our refusal).
        peer: the peer's ``Offer`` or ``Accept`` (its counters), once it was known.
        parts: the vectors each payload held (0 if no payload moved).
        verdict: the check's verdict on the peer's payload, if it got that far.
        fraction: committed: the fraction of the estimates' difference both sides move their
            corrections by, the smaller of the two ``Commit``s' (0.0: no estimates).
    """

    ending: Result
    reason: str = ""
    peer: Offer | Accept | None = None
    parts: int = 0
    verdict: Verdict | None = None
    fraction: float = 0.0


class Side(enum.Enum):
    """Which end of an exchange we are."""

    INITIATOR = "initiator"  # we sent the Offer
    RESPONDER = "responder"  # we took it


class Phase(enum.Enum):
    """What an exchange waits for next."""

    ANSWER = "answer"  # the peer's answer to our Offer
    TRANSFER = "transfer"  # both payloads, then our verdict on the peer's
    COMMIT = "commit"  # the peer's Commit, after ours
    ENDED = "ended"  # nothing: ``outcome`` says how it ended


class ExchangeState:
    """One exchange's phase and what it has learnt (the table in the module docstring).

    Args:
        side: which end we are.
        offer: the exchange's ``Offer``: ours, or the peer's that we take.
        accept: the responder's ``Accept`` (ours); the initiator passes none.

    Raises:
        ValueError: the responder's ``Accept`` takes estimates the offer did not bring, or is
            missing; or the initiator passed one.
    """

    def __init__(self, side: Side, offer: Offer, accept: Accept | None = None) -> None:
        if (accept is None) != (side is Side.INITIATOR):
            raise ValueError("the responder, and only it, starts with its Accept")
        if accept is not None and accept.correction and not offer.correction:
            raise ValueError("cannot accept a correction the offer did not bring")
        self.side = side
        self.offer = offer
        self.accept = accept
        self.phase = Phase.ANSWER if accept is None else Phase.TRANSFER
        self.outcome: Outcome | None = None
        self._verdict: Verdict | None = None  # ours on the peer's payload, once judged
        self._fraction = 0.0  # what our Commit offered

    @property
    def peer(self) -> Offer | Accept:
        """The peer's counters: its ``Offer``, or the ``Accept`` it answered ours with."""
        peer = self.offer if self.side is Side.RESPONDER else self.accept
        assert peer is not None, "known from TRANSFER on"
        return peer

    @property
    def parts(self) -> int:
        """The vectors each payload holds: the state, and the estimates if accepted."""
        assert self.accept is not None, "known from TRANSFER on"
        return 1 + self.accept.correction

    def answered(self, message: Message, schema: StateSchema) -> Outcome | None:
        """The initiator's answer to its ``Offer``: how the exchange ended, or None when the
        peer accepted and the payloads follow (``schema`` is ours, to say what a
        ``SchemaInfo`` differs in).

        Raises:
            RemoteProtocolError: not an answer, or an ``Accept`` that contradicts the offer.
        """
        self._expect(Phase.ANSWER)
        if isinstance(message, Close):
            return self._end(Refusal.of(message))
        if isinstance(message, SchemaInfo):
            return self._end(Refusal(Result.REJECTED,
                                     f"schema differs: {explain(schema, message)}"))
        if not isinstance(message, Accept):
            raise RemoteProtocolError(f"expected Accept, got {type(message).__name__}")
        if (message.weight > 0) != (self.offer.weight > 0):
            raise RemoteProtocolError("Accept's mixing mode is not the offer's")
        if message.correction and not self.offer.correction:
            raise RemoteProtocolError("Accept takes a correction the offer did not bring")
        self.accept, self.phase = message, Phase.TRANSFER
        return None

    def bad_payload(self, error: Exception) -> Outcome:
        """The peer's payload did not decode (or was not the one agreed): its fault."""
        self._expect(Phase.TRANSFER)
        return self._finish(Outcome(Result.INVALID, f"bad payload: {error}", self.peer,
                                    self.parts))

    def judged(self, verdict: Verdict) -> Commit | Close:
        """What we say once our check has judged the peer's whole payload: ``Commit`` (the
        peer's answer is due), or ``Close`` (the exchange ended ``INVALID``)."""
        self._expect(Phase.TRANSFER)
        if verdict.refused is not None:
            self._finish(Outcome(Result.INVALID, verdict.refused, self.peer, self.parts,
                                 verdict))
            return Close(Close.REJECTED, f"invalid state: {verdict.refused}")
        self._fraction = verdict.fraction if self.parts == 2 else 0.0
        self._verdict, self.phase = verdict, Phase.COMMIT
        return Commit(self._fraction)

    def committed(self, message: Message) -> Outcome:
        """How the exchange ended, given the peer's answer to our ``Commit`` (another
        message: ``INVALID``, as :meth:`bad_commit`)."""
        self._expect(Phase.COMMIT)
        if isinstance(message, Close):
            refusal = Refusal.of(message)
            return self._finish(Outcome(refusal.result, refusal.reason, self.peer, self.parts,
                                        self._verdict))
        if not isinstance(message, Commit):
            return self.bad_commit(RemoteProtocolError(
                f"expected Commit, got {type(message).__name__}"))
        # The smaller: a peer can make us move less than we judged, never more.
        return self._finish(Outcome(Result.COMMITTED, "", self.peer, self.parts, self._verdict,
                                    min(self._fraction, message.correction)))

    def bad_commit(self, error: Exception) -> Outcome:
        """The peer answered our ``Commit`` with a record that is no valid message, or with
        another message than ``Commit`` or ``Close``: its fault, ``INVALID`` (a strike)."""
        self._expect(Phase.COMMIT)
        return self._finish(Outcome(Result.INVALID, f"bad Commit: {error}", self.peer,
                                    self.parts, self._verdict))

    def _end(self, refusal: Refusal) -> Outcome:
        return self._finish(Outcome(refusal.result, refusal.reason))

    def _finish(self, outcome: Outcome) -> Outcome:
        self.outcome, self.phase = outcome, Phase.ENDED
        return outcome

    def _expect(self, phase: Phase) -> None:
        if self.phase is not phase:
            raise LocalProtocolError(f"an exchange in phase {self.phase.value} cannot take "
                                     f"what comes in phase {phase.value}")
