"""The wire codec: messages to bytes and back, and length-prefixed frames. Pure: no I/O.

A message is encoded as canonical CBOR (RFC 8949 §4.2: shortest forms, sorted map keys) of
``[tag, field1, field2, ...]``. Decoding is strict, because every byte comes from a peer that
may be hostile or buggy:

* the input is bounded by :data:`MAX_MESSAGE` before cbor2 sees it;
* cbor2 runs with a depth limit, no indefinite-length items and no duplicate map keys;
* the bytes must be exactly the canonical encoding of what they decode to, so trailing
  garbage, non-shortest integers, bignums and other alternative spellings are all refused
  and every message has exactly one valid encoding (signatures over them are stable);
* the tag must be in :data:`gossip.messages.TAGS` and the array must have exactly that
  message's number of fields, each of which the message class checks for type and range.

Any violation raises :class:`~gossip.errors.WireError` naming what was wrong. The middle two
rules are :func:`decode_canonical`, which the other CBOR a peer sends (a state download's
metadata) goes through too.

A frame is a 4-byte big-endian unsigned length followed by that many bytes. The length is
checked against the reader's limit (:func:`frame_length`) before a single payload byte is
read or buffered.
"""

from __future__ import annotations

import struct
from typing import Any

import cbor2

from .errors import WireError
from .messages import TAGS, Message, field_names

__all__ = [
    "MAX_MESSAGE",
    "MAX_DEPTH",
    "MAX_DATAGRAM",
    "FRAME_HEADER",
    "encode",
    "decode",
    "decode_canonical",
    "encode_frame",
    "frame_length",
]

MAX_MESSAGE = 64 * 1024  # bytes of one encoded control message
MAX_DEPTH = 8  # CBOR nesting; our messages need 2
FRAME_HEADER = struct.Struct(">I")
# The largest datagram either network carries; larger sends are refused with ValueError (the
# caller picked the size). 1400 bytes fits in one Ethernet frame with room for the IP and UDP
# headers, as memberlist chooses.
MAX_DATAGRAM = 1400


def encode(message: Message) -> bytes:
    """Canonical CBOR of ``message``.

    Raises:
        ValueError: the encoding exceeds :data:`MAX_MESSAGE` (the caller's bug).
    """
    data = cbor2.dumps([message.TAG, *message.to_fields()], canonical=True)
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"{type(message).__name__} encodes to {len(data)} bytes > MAX_MESSAGE")
    return data


def decode(data: bytes | bytearray | memoryview) -> Message:
    """Decode one message, strictly.

    Raises:
        WireError: not canonical CBOR, unknown tag, wrong arity, or a bad field.
    """
    if len(data) > MAX_MESSAGE:
        raise WireError(f"message of {len(data)} bytes exceeds MAX_MESSAGE={MAX_MESSAGE}")
    obj = decode_canonical(data, max_depth=MAX_DEPTH)
    if type(obj) is not list or not obj:
        raise WireError("a message is a non-empty CBOR array")
    tag, *values = obj
    cls = TAGS.get(tag) if type(tag) is int else None
    if cls is None:
        raise WireError(f"unknown message tag {tag!r}")
    names = field_names(cls)
    if len(values) != len(names):
        raise WireError(f"{cls.__name__}: expected {len(names)} fields, got {len(values)}")
    try:
        return cls(**dict(zip(names, values)))  # by name: some fields are keyword-only
    except (ValueError, TypeError) as exc:
        raise WireError(str(exc)) from None


def decode_canonical(data: bytes | bytearray | memoryview, *, max_depth: int) -> Any:
    """Decode one CBOR item, strictly: at most ``max_depth`` levels deep, no
    indefinite-length items, no duplicate map keys, text that is valid UTF-8, and ``data``
    exactly the canonical encoding of what it decodes to (so nothing trails it and every value
    has one spelling). The caller bounds ``len(data)`` first.

    Raises:
        WireError: any of those is violated; the message says which.
    """
    data = bytes(data)
    try:
        obj = cbor2.loads(data, max_depth=max_depth, allow_indefinite=False,
                          allow_duplicate_keys=False, str_errors="strict")
    except (cbor2.CBORDecodeError, ValueError, TypeError, OverflowError, RecursionError) as exc:
        raise WireError(f"malformed CBOR: {exc}") from None
    try:
        canonical = cbor2.dumps(obj, canonical=True)
    except (cbor2.CBOREncodeError, ValueError, TypeError) as exc:
        raise WireError(f"undecodable value: {exc}") from None
    if canonical != data:
        raise WireError("not the canonical CBOR encoding (trailing bytes or non-shortest form)")
    return obj


def encode_frame(payload: bytes) -> bytes:
    """``payload`` behind its 4-byte length."""
    return FRAME_HEADER.pack(len(payload)) + payload


def frame_length(header: bytes | bytearray | memoryview, limit: int) -> int:
    """The payload length in a 4-byte frame header, checked against ``limit``.

    Raises:
        WireError: the length exceeds ``limit``.
    """
    (length,) = FRAME_HEADER.unpack(header)
    if length > limit:
        raise WireError(f"frame of {length} bytes exceeds the limit of {limit}")
    return length
