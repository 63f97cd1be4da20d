"""Moving a model's state over a secure channel.

A state travels as one :class:`~gossip.messages.StateHeader` record followed by exactly
``header.nbytes`` bytes of tensor data in records of whole elements (see
:func:`gossip.tensors.encode_chunks`). A payload may hold more than one vector of the schema's
size back to back (an averaging exchange's state and drift-correction estimate): ``parts`` of
them, which both sides agreed on before (``int8`` blocks each on its own, so the size is
:func:`gossip.tensors.encoded_nbytes` of the codec, the schema's size and ``parts``). The
receiver checks the header against the schema it already has before reading any tensor byte,
so the payload size is fixed locally, never by the peer; a peer that says ``Close`` instead is
reported with its reason.

Both functions take no deadline: wrap them in :func:`~gossip.groups.phase_deadline` with the
phase's timeout.
Sending and receiving may run at the same time on one channel (full duplex).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import trio

from .channel import MAX_RECORD, SecureChannel
from .errors import PeerGone, RemoteProtocolError, SchemaMismatch
from .messages import Close, StateHeader
from .replica import offload_for
from . import int8, lowbit
from .codec import LowbitDecoder, lowbit_payload
from .tensors import StateDecoder, StateSchema, encode_chunks, encoded_nbytes

__all__ = ["send_state", "receive_state"]


async def send_state(
    channel: SecureChannel,
    flat: torch.Tensor,
    schema: StateSchema,
    codec: str = "fp32",
    *,
    step: int = 0,
    samples: int = 0,
    payload: torch.Tensor | None = None,
) -> None:
    """Send a flat state (from :func:`gossip.tensors.snapshot`; or several of the schema's
    size back to back) as header plus records.

    ``flat`` must not change until this returns: fp32 records are views of it. On any failure
    or cancellation the channel is closed, since the peer may hold part of the state, except
    :class:`PeerGone`: the peer is gone, nothing more can be sent, and what it sent before it
    went can still be received.

    ``payload``: for a ``mod`` codec, the encoding already made (a CPU byte tensor, by
    :func:`gossip.codec.lowbit_payload` with the sender's periods and error feedback); without
    it ``flat`` is encoded with periods from its values alone.

    Raises:
        ValueError: an unknown codec, or ``flat``'s size is not a multiple of the schema's,
            or a ``payload`` of the wrong size (nothing is sent then).
    """
    parts, rest = divmod(flat.numel(), schema.numel) if schema.numel else (1, flat.numel())
    if rest:
        raise ValueError(f"a flat state of {flat.numel()} elements is not whole vectors of "
                         f"the schema's {schema.numel}")
    header = StateHeader(
        fingerprint=schema.fingerprint,
        codec=codec,
        step=step,
        samples=samples,
        nbytes=encoded_nbytes(codec, schema.numel, parts),
    )
    if payload is not None and payload.numel() != header.nbytes:
        raise ValueError(f"a payload of {payload.numel()} bytes for {header.nbytes}")
    try:
        await channel.send_message(header)
        if payload is not None:
            for record in _slices(payload):
                await channel.send(record)
            return
        if lowbit.is_lowbit(codec):
            encoded = await offload_for(schema.numel, lowbit_payload, flat, codec, parts)
            for record in _slices(encoded):
                await channel.send(record)
            return
        # int8 rounds stochastically, so that the rounding errors of successive exchanges
        # are independent and average out (gossip.int8).
        generator = int8.dither(flat.device) if codec == "int8" else None
        for record in encode_chunks(flat, codec, MAX_RECORD, parts=parts, generator=generator):
            await channel.send(record)
    except PeerGone:
        raise
    except BaseException:
        # Failed or cancelled (the caller's deadline) between records: the peer's decoder
        # would take our next message for tensor bytes, so the channel is done.
        await channel.aclose()
        raise


def _slices(payload: torch.Tensor) -> Iterator[memoryview]:
    view = memoryview(payload.numpy()).cast("B").toreadonly()
    for start in range(0, len(view), MAX_RECORD):
        yield view[start : start + MAX_RECORD]


async def receive_state(
    channel: SecureChannel,
    schema: StateSchema,
    codec: str = "fp32",
    out: torch.Tensor | None = None,
    parts: int = 1,
    on_decoded: Callable[[int], None] | None = None,
    reference: torch.Tensor | None = None,
    reference_ready: trio.Event | None = None,
) -> tuple[StateHeader, torch.Tensor]:
    """Receive a state sent by :func:`send_state` into a flat float32 buffer (of ``parts``
    times the schema's size).

    ``on_decoded(n)`` is called after each record, with how many leading elements of the
    output hold their final values (to work on them while they are in cache and the rest is
    on the wire).

    A ``mod`` codec decodes against ``reference``, the receiver's own payload (``parts``
    vectors), once ``reference_ready`` is set (if given): the bytes are read first, then
    decoded in a worker thread.

    Returns:
        The header (the sender's step and sample counts) and the flat state.

    On any failure or cancellation the channel is closed: records of the refused state may
    already be on their way, so it could never carry another message.

    Raises:
        SchemaMismatch: the header's fingerprint, codec or size differ from ours, or the
            records do not add up to the announced size.
        PeerGone: the peer closed the channel (with its reason, if it sent ``Close``).
        RemoteProtocolError: anything other than a header where one is due.
    """
    try:
        return await _receive_state(channel, schema, codec, out, parts, on_decoded, reference,
                                    reference_ready)
    except BaseException:
        # Including a cancellation by the caller's deadline between records: the rest of the
        # state may still arrive, and would be read as messages.
        await channel.aclose()
        raise


async def _receive_state(
    channel: SecureChannel, schema: StateSchema, codec: str, out: torch.Tensor | None,
    parts: int, on_decoded: Callable[[int], None] | None,
    reference: torch.Tensor | None = None, reference_ready: trio.Event | None = None,
) -> tuple[StateHeader, torch.Tensor]:
    message = await channel.receive_message()
    if isinstance(message, Close):
        raise PeerGone(f"{channel.peer.short} closed the exchange: code={message.code} {message.reason}")
    if not isinstance(message, StateHeader):
        raise RemoteProtocolError(f"expected StateHeader, got {type(message).__name__}")
    if message.fingerprint != schema.fingerprint:
        raise SchemaMismatch(
            f"{channel.peer.short} sent a state of schema {message.fingerprint.hex()}, "
            f"ours is {schema.fingerprint_hex}"
        )
    expected = encoded_nbytes(codec, schema.numel, parts)
    if message.codec != codec or message.nbytes != expected:
        raise SchemaMismatch(
            f"{channel.peer.short} announced {message.nbytes} bytes of {message.codec}; "
            f"expected {expected} bytes of {codec}"
        )
    if lowbit.is_lowbit(codec):
        if reference is None:
            raise ValueError(f"a {codec} payload decodes against a reference")
        lowbits = LowbitDecoder(schema, codec, reference, out, parts=parts)
        while not lowbits.done:
            window = lowbits.window(MAX_RECORD)
            assert window is not None
            lowbits.wrote(await channel.receive_into(window))
        if reference_ready is not None:
            await reference_ready.wait()
        await offload_for(schema.numel, lowbits.finish)
        if on_decoded is not None:
            on_decoded(lowbits.decoded)
        return message, lowbits.result()
    decoder = StateDecoder(schema, codec, out, parts=parts)
    while not decoder.done:
        # Each record is decrypted straight into the state (fp32 into host memory) or into a
        # reused scratch buffer the decoder casts from: no allocation per record.
        window = decoder.window(MAX_RECORD)
        assert window is not None  # a failed decoder has raised already
        decoder.wrote(await channel.receive_into(window))
        if on_decoded is not None:
            on_decoded(decoder.decoded)
    return message, decoder.result()
