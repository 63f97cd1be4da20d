"""One averaging exchange over a secure channel, from either side.

Theory of operation
-------------------
::

    initiator                               responder
    Offer(fingerprint, codec, step,   --->
          samples, weight, correction)
                                      <---  Accept(step, samples, weight, correction)
                                            | Close(BUSY)      try again later
                                            | Close(REJECTED)  never (schema, codec, ...)
                                            | SchemaInfo, Close(REJECTED)  another schema
    payload                           <-->  payload              (both at once)
    check theirs; Commit or Close     <-->  check theirs; Commit or Close(REJECTED)

A payload is ``parts`` vectors of the model's schema back to back: the state, and, when both
sides keep a drift correction (the offer says it can, and the accept says so too), the
correction's estimate (:mod:`gossip.correction`). Each side knows the size of what it will
receive before a byte of it arrives. Each side checks the other's whole payload (``check``)
before it says ``Commit``, and the caller applies only after the peer's ``Commit`` has come
too, so a failure anywhere before that leaves both models untouched; the one-sided case (one
applies, the other not) shrinks to a lost final message.

This module is the protocol of one exchange and nothing else: *when* to exchange and with
whom (the scheduler), whether an offer may be taken at all, what the checks are and what a
committed payload does to the model are the caller's (:mod:`gossip.averaging`). The caller
passes its snapshot, a buffer to receive into, and ``check``; it gets an
:class:`~gossip.exchange_state.Outcome`. Which message may come next, and what each one means,
are the pure :class:`~gossip.exchange_state.ExchangeState`'s rules: the functions here move the
messages and the payloads under their deadlines, and ask it.
The snapshot may still be being copied when the exchange starts (``ready``, set once it is
whole): the counters in the Offer or Accept are known as soon as the copy begins, so the copy
overlaps the offer's round trip and the peer's payload, and only our own send and the check
wait for it.
Every phase runs under its own deadline, and a deadline that passes is a
:class:`~gossip.errors.PeerTimeout` naming the phase; what a peer did wrong is a
:class:`~gossip.errors.GossipError`; neither leaves anything applied.

The verdict on a payload depends only on what the peer sent, never on how far our own send had
got: a peer that sends a bad header and hangs up earns the same ``INVALID`` whether or not our
payload had left, because the receive is read to its end (or its failure) before any failure
of our send is looked at.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Awaitable, Callable

import torch
import trio

from .channel import SecureChannel
from . import lowbit
from .codec import encoded_nbytes, lowbit_payload
from .errors import BadMessage, GossipError, PeerTimeout, RemoteProtocolError, SchemaMismatch
from .exchange_state import ExchangeState, Outcome, Result, Side, Verdict
from .groups import first_error, phase_deadline, phase_deadline_at
from .linkrate import STALL
from .messages import Accept, Close, Offer
from .schema import StateSchema
from .replica import offload_for
from .transfer import receive_state, send_state

__all__ = ["Deadlines", "Outcome", "Result", "Verdict", "Check", "initiate", "respond"]


@dataclass(frozen=True)
class Deadlines:
    """How long each phase of an exchange may take, in seconds.

    The transfer's deadline follows the link: the caller passes as ``min_rate`` the rate it
    gives this peer's link time for (:meth:`gossip.linkrate.LinkRates.rate`: the link's
    measured rate over a slack, never below the configured floor), and the peer's payload
    may go no more than ``stall`` seconds without a byte, so that a peer that stops
    mid-payload is dropped in seconds, not at the end of a deadline sized for a thin link.
    """

    offer: float  # from sending Offer to its answer (the responder: to send Accept)
    transfer: float  # both payloads: this, plus the payload's bytes at ``min_rate``
    min_rate: float  # bytes/s the exchange's link is given time for
    commit: float  # for the peer's Commit, past the end of the transfer deadline
    stall: float = STALL  # s the peer's payload may go without a byte

    def transfer_for(self, nbytes: int) -> float:
        """The deadline for both payloads of ``nbytes`` each."""
        return self.transfer + nbytes / self.min_rate


Check = Callable[[torch.Tensor, int, "Offer | Accept"], Awaitable[Verdict]]
# A mod codec's payload from our snapshot (gossip.codec.lowbit_payload with the node's periods
# and error feedback); called in a worker thread once the snapshot is whole.
Encoder = Callable[[torch.Tensor], torch.Tensor]
"""``check(theirs, parts, peer)`` judges the received payload (``theirs`` holds ``parts``
vectors; ``peer`` is the peer's ``Offer`` or ``Accept``) and returns a :class:`Verdict`; it
may turn ``theirs`` into whatever it needs in place."""


async def initiate(channel: SecureChannel, offer: Offer, own: torch.Tensor,
                   theirs: torch.Tensor, schema: StateSchema, check: Check,
                   deadlines: Deadlines, ready: trio.Event | None = None,
                   on_decoded: Callable[[int], None] | None = None,
                   encoder: Encoder | None = None) -> Outcome:
    """Offer an exchange on ``channel`` and, if the peer accepts, swap payloads and commit.

    Args:
        offer: our offer (``offer.correction``: ``own`` holds an estimate after the state).
        own: our snapshot, one or two vectors of the schema; not changed.
        theirs: where the peer's payload goes, as large as ``own``.
        check: judges the peer's payload before we commit.
        ready: set once ``own`` holds the whole snapshot (None: it does already).
        on_decoded: called as the peer's payload arrives, with how many leading elements of
            ``theirs`` are final (:func:`~gossip.transfer.receive_state`).
        encoder: for a ``mod`` codec, makes our payload from ``own`` (:data:`Encoder`);
            None: periods from the values alone, no error feedback.

    Raises:
        PeerTimeout: a phase's deadline passed.
        GossipError: the channel failed or the peer broke the protocol.
    """
    state = ExchangeState(Side.INITIATOR, offer)
    with phase_deadline(deadlines.offer, channel.peer.short, "offer"):
        await channel.send_message(offer)
        answer = await channel.receive_message()
    ended = state.answered(answer, schema)  # a SchemaInfo: a Close follows, unread
    if ended is not None:
        return ended
    return await _swap(channel, state, own, theirs, schema, check, deadlines, ready, on_decoded,
                       encoder)


async def respond(channel: SecureChannel, offer: Offer, accept: Accept, own: torch.Tensor,
                  theirs: torch.Tensor, schema: StateSchema, check: Check,
                  deadlines: Deadlines, ready: trio.Event | None = None,
                  on_decoded: Callable[[int], None] | None = None,
                  encoder: Encoder | None = None) -> Outcome:
    """Take ``offer`` (already judged acceptable by the caller): say ``accept``, swap
    payloads and commit. Arguments and errors as :func:`initiate`; ``accept.correction``
    must be true only if ``offer.correction`` is and ``own`` holds an estimate (else a
    ``ValueError``, before anything is sent)."""
    state = ExchangeState(Side.RESPONDER, offer, accept)
    with phase_deadline(deadlines.offer, channel.peer.short, "accept"):
        await channel.send_message(accept)
    return await _swap(channel, state, own, theirs, schema, check, deadlines, ready, on_decoded,
                       encoder)


async def _swap(channel: SecureChannel, state: ExchangeState, own: torch.Tensor,
                theirs: torch.Tensor, schema: StateSchema, check: Check,
                deadlines: Deadlines, ready: trio.Event | None,
                on_decoded: Callable[[int], None] | None,
                encoder: Encoder | None = None) -> Outcome:
    """Both payloads at once, the check, the commit."""
    codec, parts = state.offer.codec, state.parts
    size = parts * schema.numel
    mine, into = own[:size], theirs[:size]
    # Why our send failed, held until the receive is done (see the module docstring).
    lost: list[GossipError] = []

    async def send() -> None:
        if ready is not None:
            await ready.wait()
        try:
            payload = None
            if lowbit.is_lowbit(codec):
                make = encoder or (lambda flat: lowbit_payload(flat, codec, state.parts))
                payload = await offload_for(schema.numel, make, mine)
            await send_state(channel, mine, schema, codec, payload=payload)
        except GossipError as exc:  # PeerGone, or ChannelClosed: the receive failed
            lost.append(exc)

    transfer_end = trio.current_time() + deadlines.transfer_for(
        encoded_nbytes(codec, schema.numel, parts))
    try:
        with phase_deadline_at(transfer_end, channel.peer.short, "transfer"), first_error():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send)
                with channel.stall_guard(deadlines.stall):
                    await receive_state(channel, schema, codec, into, parts=parts,
                                        on_decoded=on_decoded, reference=mine,
                                        reference_ready=ready)
        if lost:
            raise lost[0]
    except PeerTimeout as exc:
        if exc.phase in ("transfer", "record"):  # the payload's deadline, or a record's
            raise
        raise PeerTimeout(channel.peer.short, f"transfer, {exc.phase}") from None  # a stall
    except (SchemaMismatch, RemoteProtocolError) as exc:
        return state.bad_payload(exc)
    # Our send waited for the snapshot, so it is whole by now.
    assert ready is None or ready.is_set()
    said = state.judged(await check(into, parts, state.peer))
    if isinstance(said, Close):
        try:
            await channel.send_closing(said)
        except GossipError:
            pass  # it hung up already (say, it refused ours): the verdict stands
        assert state.outcome is not None
        return state.outcome
    # Our send may have returned while the last of our payload still sat in socket buffers
    # on a slow link: the peer may still be receiving it, and it has until the transfer
    # deadline to, so the commit deadline counts from there.
    with phase_deadline_at(max(transfer_end, trio.current_time()) + deadlines.commit,
                           channel.peer.short, "commit"):
        await channel.send_message(said)
        try:
            answer = await channel.receive_message()
        except BadMessage as exc:  # a Commit out of range, say: a strike (exchange_state)
            return state.bad_commit(exc)
    return state.committed(answer)
