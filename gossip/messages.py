"""Protocol messages: frozen dataclasses that validate themselves.

Every message is a frozen, slotted dataclass whose ``__post_init__`` checks each field's type
and bounds, so an invalid message cannot exist: built locally it raises ``ValueError`` (the
caller's bug); decoded from the network, :func:`gossip.wire.decode` turns that into a
:class:`~gossip.errors.WireError` naming the message and field.

On the wire a message is the CBOR array ``[tag, field1, field2, ...]`` with the fields in
declaration order (see docs/PROTOCOL.md). ``TAGS`` maps tags to classes; it is append-only:
a tag once shipped keeps its meaning forever, and a changed message gets a new tag.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

__all__ = [
    "Message",
    "Hello",
    "Close",
    "StateRequest",
    "StateHeader",
    "TAGS",
    "MAX_TEXT",
    "MAX_UINT",
]

# Limits shared by every message. Anything larger is a protocol violation.
MAX_TEXT = 256  # characters in any text field
MAX_UINT = 2**63 - 1  # counters (steps, samples, byte sizes) fit in a signed 64-bit int
FINGERPRINT_BYTES = 16


def _uint(cls: type, name: str, value: object, maximum: int = MAX_UINT) -> None:
    # bool is an int in Python; on the wire it is a different CBOR type, so refuse it.
    if type(value) is not int:
        raise ValueError(f"{cls.__name__}.{name}: expected an unsigned integer, got {type(value).__name__}")
    if not 0 <= value <= maximum:
        raise ValueError(f"{cls.__name__}.{name}: {value} out of range 0..{maximum}")


def _bytes(cls: type, name: str, value: object, *, size: int | None = None, maximum: int = 0) -> None:
    if type(value) is not bytes:
        raise ValueError(f"{cls.__name__}.{name}: expected bytes, got {type(value).__name__}")
    if size is not None and len(value) != size:
        raise ValueError(f"{cls.__name__}.{name}: expected {size} bytes, got {len(value)}")
    if size is None and len(value) > maximum:
        raise ValueError(f"{cls.__name__}.{name}: {len(value)} bytes exceeds {maximum}")


def _text(cls: type, name: str, value: object) -> None:
    if type(value) is not str:
        raise ValueError(f"{cls.__name__}.{name}: expected text, got {type(value).__name__}")
    if len(value) > MAX_TEXT:
        raise ValueError(f"{cls.__name__}.{name}: {len(value)} characters exceeds {MAX_TEXT}")


class Message:
    """Base of every protocol message. ``TAG`` is its entry in :data:`TAGS`."""

    __slots__ = ()
    TAG: ClassVar[int]

    def to_fields(self) -> list[object]:
        return [getattr(self, f.name) for f in fields(self)]  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Hello(Message):
    """The identity payload of the handshake (messages 2 and 3 of Noise XX).

    ``signature`` is the Ed25519 signature, by ``identity_key``, of
    ``b"gossipd-noise-static-key:" + noise_static_public_key`` — it binds the connection's
    Noise key to the node's identity.
    """

    TAG: ClassVar[int] = 1
    version: int  # protocol version; see gossip.handshake.PROTOCOL_VERSION
    swarm: str  # swarm name; both sides must agree
    identity_key: bytes  # raw Ed25519 public key, 32 bytes
    signature: bytes  # 64 bytes

    def __post_init__(self) -> None:
        _uint(Hello, "version", self.version, 2**16 - 1)
        _text(Hello, "swarm", self.swarm)
        _bytes(Hello, "identity_key", self.identity_key, size=32)
        _bytes(Hello, "signature", self.signature, size=64)


@dataclass(frozen=True, slots=True)
class Close(Message):
    """Sent before closing a channel on purpose: why, as a code and a human-readable text.

    Codes: 0 normal, 1 protocol error, 2 busy, 3 rejected (schema or codec), 4 shutting down.
    """

    TAG: ClassVar[int] = 2
    NORMAL: ClassVar[int] = 0
    PROTOCOL_ERROR: ClassVar[int] = 1
    BUSY: ClassVar[int] = 2
    REJECTED: ClassVar[int] = 3
    SHUTDOWN: ClassVar[int] = 4

    code: int
    reason: str

    def __post_init__(self) -> None:
        _uint(Close, "code", self.code, 2**16 - 1)
        _text(Close, "reason", self.reason)


@dataclass(frozen=True, slots=True)
class StateRequest(Message):
    """Ask the peer for its model state in the given schema and codec."""

    TAG: ClassVar[int] = 3
    fingerprint: bytes  # schema fingerprint (gossip.tensors), 16 bytes
    # A codec name (gossip.tensors.CODECS). Any text is valid on the wire, so a peer that
    # asks for a codec we do not know is answered Close(REJECTED), not disconnected.
    codec: str

    def __post_init__(self) -> None:
        _bytes(StateRequest, "fingerprint", self.fingerprint, size=FINGERPRINT_BYTES)
        _text(StateRequest, "codec", self.codec)


@dataclass(frozen=True, slots=True)
class StateHeader(Message):
    """Announces a model state that follows as ``nbytes`` of raw tensor records.

    The receiver checks ``fingerprint`` and ``codec`` against its own schema, which fixes
    ``nbytes`` exactly; a mismatch is refused before any tensor byte is read.
    """

    TAG: ClassVar[int] = 4
    fingerprint: bytes
    codec: str
    step: int  # optimizer steps the sender has taken
    samples: int  # training samples the sender has processed
    nbytes: int  # total bytes of tensor records that follow

    def __post_init__(self) -> None:
        _bytes(StateHeader, "fingerprint", self.fingerprint, size=FINGERPRINT_BYTES)
        _text(StateHeader, "codec", self.codec)
        _uint(StateHeader, "step", self.step)
        _uint(StateHeader, "samples", self.samples)
        _uint(StateHeader, "nbytes", self.nbytes)


# The tag table. ONLY APPEND: never reuse or renumber a tag.
TAGS: dict[int, type[Message]] = {
    1: Hello,
    2: Close,
    3: StateRequest,
    4: StateHeader,
}

for _tag, _cls in TAGS.items():
    assert _cls.TAG == _tag, _cls
