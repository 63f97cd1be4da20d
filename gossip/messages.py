"""Protocol messages: frozen dataclasses that validate themselves.

Every message is a frozen, slotted dataclass whose ``__post_init__`` checks each field's type
and bounds, so an invalid message cannot exist: built locally it raises ``ValueError`` (the
caller's bug); decoded from the network, :func:`gossip.wire.decode` turns that into a
:class:`~gossip.errors.WireError` naming the message and field.

On the wire a message is the CBOR array ``[tag, field1, field2, ...]`` with the fields in
declaration order (see docs/PROTOCOL.md). ``TAGS`` maps tags to classes; it is append-only:
a tag once shipped keeps its meaning forever, and a changed message gets a new tag (before the
first release the protocol is a draft: a field was appended to ``Offer`` and ``Accept``,
three and then a proof to ``Alive`` and ``MemberState``, and a proof to ``Left``:
docs/PROTOCOL.md section 11).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields
from typing import ClassVar

from .fields import (MAX_COUNT, MAX_PART, MAX_SHARDS, MAX_TEXT, MAX_WEIGHT, _address, _bool,
                     _bytes, _parts, _peer, _proof, _shard, _text, _uint, _weight)

__all__ = [
    "Message", "Hello", "Close", "StateRequest", "StateHeader", "Packet", "Ping",
    "PingReq", "Ack", "Nack", "Alive", "Suspect", "Dead", "Left", "MemberState",
    "PushPull", "Offer", "Accept", "Commit", "StateInfo", "SchemaInfo", "DialBack", "TAGS",
    "MAX_TEXT", "MAX_COUNT", "MAX_WEIGHT", "MAX_SHARDS", "DIAL_BACK_NONCE",
]

# Limits of single messages (those shared by every field type are in gossip.fields).
DIAL_BACK_NONCE = 16  # bytes of a DialBack's nonce
FINGERPRINT_BYTES = 16
MAX_SEQUENCE = 2**32 - 1  # probe sequence numbers wrap here
MAX_PARTS = 64  # messages in one datagram, or member records in one push-pull page
MAX_META = 32 * 1024  # bytes of the task metadata in a StateInfo
MAX_SCHEMA_ENTRIES = 1024  # tensors a SchemaInfo lists at most (it lists a schema's start)
MAX_DIMS = 32  # dimensions of one tensor a SchemaInfo lists
SCHEMA_DTYPES = ("float16", "bfloat16", "float32", "float64")  # PROTOCOL.md section 7.1


class Message:
    """Base of every protocol message. ``TAG`` is its entry in :data:`TAGS`."""

    __slots__ = ()
    TAG: ClassVar[int]

    def to_fields(self) -> list[object]:
        return [getattr(self, name) for name in field_names(type(self))]


@functools.lru_cache(maxsize=None)
def field_names(cls: type) -> tuple[str, ...]:
    """The wire order of a message class's fields (its declaration order)."""
    return tuple(f.name for f in fields(cls))


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


# ---- membership (gossip.membership) --------------------------------------------------------
# Packet is the plaintext of one sealed datagram: the sender and up to MAX_PARTS encoded
# messages (Ping, PingReq, Ack, Nack and piggybacked Alive/Suspect/Dead/Left). PushPull pages
# travel over a secure channel and carry encoded MemberState records.


@dataclass(frozen=True, slots=True)
class Packet(Message):
    """One membership datagram: who sent it and the encoded messages it carries."""

    TAG: ClassVar[int] = 5
    sender: str  # peer id
    parts: tuple[bytes, ...]  # each is wire.encode() of one message

    def __post_init__(self) -> None:
        _peer(Packet, "sender", self.sender)
        _parts(Packet, "parts", self.parts, MAX_PARTS)
        object.__setattr__(self, "parts", tuple(self.parts))


@dataclass(frozen=True, slots=True)
class Ping(Message):
    """Are you ``target``? Answered with Ack(seq) to the datagram's source address."""

    TAG: ClassVar[int] = 6
    seq: int
    target: str  # the peer id the sender means; a different node at that address stays quiet

    def __post_init__(self) -> None:
        _uint(Ping, "seq", self.seq, MAX_SEQUENCE)
        _peer(Ping, "target", self.target)


@dataclass(frozen=True, slots=True)
class PingReq(Message):
    """Probe ``target`` at ``address`` for me: forward its Ack(seq), or send Nack(seq) if it
    stays silent for a probe timeout."""

    TAG: ClassVar[int] = 7
    seq: int
    target: str
    address: str

    def __post_init__(self) -> None:
        _uint(PingReq, "seq", self.seq, MAX_SEQUENCE)
        _peer(PingReq, "target", self.target)
        _address(PingReq, "address", self.address)


@dataclass(frozen=True, slots=True)
class Ack(Message):
    """The answer to Ping(seq), direct or forwarded by the helper of a PingReq."""

    TAG: ClassVar[int] = 8
    seq: int

    def __post_init__(self) -> None:
        _uint(Ack, "seq", self.seq, MAX_SEQUENCE)


@dataclass(frozen=True, slots=True)
class Nack(Message):
    """From the helper of PingReq(seq): the target did not answer me either. Tells the
    requester that the helper, and so the requester's own network path, is working."""

    TAG: ClassVar[int] = 9
    seq: int

    def __post_init__(self) -> None:
        _uint(Nack, "seq", self.seq, MAX_SEQUENCE)


@dataclass(frozen=True, slots=True)
class Alive(Message):
    """``peer`` is alive at ``incarnation``, reachable at ``address``, with its metadata,
    signed by ``peer`` itself (``key``, ``signature``: :mod:`gossip.claims`)."""

    TAG: ClassVar[int] = 10
    peer: str
    incarnation: int
    address: str  # host:port for datagrams and channels
    version: int  # the peer's protocol version
    step: int  # the peer's training step when it last announced itself
    ready: bool  # whether it will take part in averaging now
    shard: int = 0  # the data shard it trains on, in [0, shards)
    shards: int = 0  # how many shards that data is cut into; 0: it announces no shard
    # False: it cannot accept connections or unsolicited datagrams (behind a NAT or a
    # firewall): nobody dials it or probes it, and it keeps its record alive itself.
    reachable: bool = True
    # The member's proof: its raw Ed25519 public key and its signature of the fields above.
    # Keyword-only, and last on the wire; a receiver checks them (gossip.claims) before it
    # applies what the claim would change.
    key: bytes = field(kw_only=True)
    signature: bytes = field(kw_only=True)

    def __post_init__(self) -> None:
        _peer(Alive, "peer", self.peer)
        _uint(Alive, "incarnation", self.incarnation)
        _address(Alive, "address", self.address)
        _uint(Alive, "version", self.version, 2**16 - 1)
        _uint(Alive, "step", self.step)
        _bool(Alive, "ready", self.ready)
        _shard(Alive, self.shard, self.shards)
        _bool(Alive, "reachable", self.reachable)
        _proof(Alive, self.key, self.signature)


@dataclass(frozen=True, slots=True)
class Suspect(Message):
    """``by`` could not reach ``peer`` at ``incarnation``; ``peer`` may refute it."""

    TAG: ClassVar[int] = 11
    peer: str
    incarnation: int
    by: str

    def __post_init__(self) -> None:
        _peer(Suspect, "peer", self.peer)
        _uint(Suspect, "incarnation", self.incarnation)
        _peer(Suspect, "by", self.by)


@dataclass(frozen=True, slots=True)
class Dead(Message):
    """``by`` declared ``peer`` dead at ``incarnation``: a suspicion nobody refuted in time."""

    TAG: ClassVar[int] = 12
    peer: str
    incarnation: int
    by: str

    def __post_init__(self) -> None:
        _peer(Dead, "peer", self.peer)
        _uint(Dead, "incarnation", self.incarnation)
        _peer(Dead, "by", self.by)


@dataclass(frozen=True, slots=True)
class Left(Message):
    """``peer`` left the swarm on purpose at ``incarnation``, signed by ``peer`` (as Alive)."""

    TAG: ClassVar[int] = 13
    peer: str
    incarnation: int
    key: bytes = field(kw_only=True)
    signature: bytes = field(kw_only=True)

    def __post_init__(self) -> None:
        _peer(Left, "peer", self.peer)
        _uint(Left, "incarnation", self.incarnation)
        _proof(Left, self.key, self.signature)


@dataclass(frozen=True, slots=True)
class MemberState(Message):
    """One member as a node sees it, for a full-state push-pull. ``key`` and ``signature``
    prove the member's own claim the row's incarnation comes from: its ``Left`` for a LEFT
    row, else its ``Alive`` with the row's fields (:func:`gossip.claims.row_claim`)."""

    TAG: ClassVar[int] = 14
    ALIVE: ClassVar[int] = 0
    SUSPECT: ClassVar[int] = 1
    DEAD: ClassVar[int] = 2
    LEFT: ClassVar[int] = 3

    peer: str
    incarnation: int
    state: int  # ALIVE, SUSPECT, DEAD or LEFT
    address: str
    version: int
    step: int
    ready: bool
    shard: int = 0  # as in Alive
    shards: int = 0
    reachable: bool = True  # as in Alive
    key: bytes = field(kw_only=True)
    signature: bytes = field(kw_only=True)

    def __post_init__(self) -> None:
        _peer(MemberState, "peer", self.peer)
        _uint(MemberState, "incarnation", self.incarnation)
        _uint(MemberState, "state", self.state, 3)
        _address(MemberState, "address", self.address)
        _uint(MemberState, "version", self.version, 2**16 - 1)
        _uint(MemberState, "step", self.step)
        _bool(MemberState, "ready", self.ready)
        _shard(MemberState, self.shard, self.shards)
        _bool(MemberState, "reachable", self.reachable)
        _proof(MemberState, self.key, self.signature)


@dataclass(frozen=True, slots=True)
class PushPull(Message):
    """One page of a node's full member table (encoded MemberState records), over a secure
    channel. ``last`` marks the final page; ``join`` says the sender is joining."""

    TAG: ClassVar[int] = 15
    join: bool
    last: bool
    records: tuple[bytes, ...]

    def __post_init__(self) -> None:
        _bool(PushPull, "join", self.join)
        _bool(PushPull, "last", self.last)
        _parts(PushPull, "records", self.records, MAX_PARTS * 4)
        object.__setattr__(self, "records", tuple(self.records))


# ---- averaging (gossip.averaging, gossip.download) ------------------------------------------
# An exchange runs on its own secure channel: Offer -> Accept (or Close BUSY / REJECTED) ->
# both state payloads at once -> Commit both ways (or Close REJECTED). A state download is
# StateRequest -> StateInfo and a state payload (or Close).


@dataclass(frozen=True, slots=True)
class Offer(Message):
    """The first message of an exchange: what the initiator will send and its counters."""

    TAG: ClassVar[int] = 16
    fingerprint: bytes  # schema fingerprint (gossip.tensors), 16 bytes
    codec: str  # the codec both payloads will use
    step: int  # the initiator's (global) training step
    samples: int  # training samples it has processed
    weight: float  # its push-sum weight; 0.0 when it mixes with a fixed weight
    correction: bool = False  # it keeps a drift correction and can send its estimate

    def __post_init__(self) -> None:
        _bytes(Offer, "fingerprint", self.fingerprint, size=FINGERPRINT_BYTES)
        _text(Offer, "codec", self.codec)
        _uint(Offer, "step", self.step)
        _uint(Offer, "samples", self.samples)
        _weight(Offer, "weight", self.weight)
        _bool(Offer, "correction", self.correction)


@dataclass(frozen=True, slots=True)
class Accept(Message):
    """The responder takes the offered exchange; both payloads follow at once."""

    TAG: ClassVar[int] = 17
    step: int
    samples: int
    weight: float  # as Offer.weight
    correction: bool = False  # both payloads carry the estimates (the offer said it could)

    def __post_init__(self) -> None:
        _uint(Accept, "step", self.step)
        _uint(Accept, "samples", self.samples)
        _weight(Accept, "weight", self.weight)
        _bool(Accept, "correction", self.correction)


@dataclass(frozen=True, slots=True)
class Commit(Message):
    """I hold your whole payload and it passed my checks: apply yours when you have mine.

    Each side sends it after validating the other's payload and applies the result only on
    receiving the other's Commit, so nothing is applied unless both sides hold both states.
    ``correction`` is the fraction of the estimates' difference the sender would move its drift
    correction by (its rate, weight and clipping), 0.0 when the payloads held no estimates:
    both sides move by the smaller of the two, so that the pair's corrections keep their sum.
    """

    TAG: ClassVar[int] = 18
    correction: float = 0.0

    def __post_init__(self) -> None:
        if type(self.correction) is not float:
            raise ValueError(f"Commit.correction: expected a float, got "
                             f"{type(self.correction).__name__}")
        if not 0.0 <= self.correction <= 1.0:  # also refuses NaN
            raise ValueError(f"Commit.correction: {self.correction} out of range 0..1")


@dataclass(frozen=True, slots=True)
class StateInfo(Message):
    """The answer to a StateRequest, before the state payload: the sender's counters and the
    task's metadata (``meta``: a canonical CBOR map, see gossip.download)."""

    TAG: ClassVar[int] = 19
    step: int
    samples: int
    weight: float  # the sender's push-sum weight (1.0 in fixed mode); for information
    meta: bytes

    def __post_init__(self) -> None:
        _uint(StateInfo, "step", self.step)
        _uint(StateInfo, "samples", self.samples)
        _weight(StateInfo, "weight", self.weight)
        _bytes(StateInfo, "meta", self.meta, maximum=MAX_META)


@dataclass(frozen=True, slots=True)
class SchemaInfo(Message):
    """Sent just before ``Close(REJECTED)`` to a peer whose ``StateRequest`` or ``Offer``
    names another schema: the sender's own schema, so that the peer can say which tensors
    differ (a fingerprint says only that they do; see gossip.mismatch).

    ``count`` is how many entries the schema has, ``entries`` its first entries (all of them
    when they fit in one message) as ``(name, shape, dtype)``, and ``meta`` the task's
    metadata as in ``StateInfo`` (empty: none given). Each name is printable text, unique;
    each shape at most ``MAX_DIMS`` counters; each dtype one of ``SCHEMA_DTYPES``.
    """

    TAG: ClassVar[int] = 20
    count: int
    entries: tuple[tuple[str, tuple[int, ...], str], ...]
    meta: bytes

    def __post_init__(self) -> None:
        _uint(SchemaInfo, "count", self.count)
        entries = self.entries
        if type(entries) not in (list, tuple):
            raise ValueError(f"SchemaInfo.entries: expected an array, got {type(entries).__name__}")
        if len(entries) > min(MAX_SCHEMA_ENTRIES, self.count):
            raise ValueError(f"SchemaInfo.entries: {len(entries)} entries, more than "
                             f"{min(MAX_SCHEMA_ENTRIES, self.count)} (count is {self.count})")
        names: set[str] = set()
        checked = []
        for entry in entries:
            if type(entry) not in (list, tuple) or len(entry) != 3:
                raise ValueError("SchemaInfo.entries: an entry is not [name, shape, dtype]")
            name, shape, dtype = entry
            _text(SchemaInfo, "entries", name)
            if not name or not name.isprintable() or name in names:
                raise ValueError(f"SchemaInfo.entries: name {name!r} is empty, not printable "
                                 "or given twice")
            names.add(name)
            if type(shape) not in (list, tuple) or len(shape) > MAX_DIMS:
                raise ValueError(f"SchemaInfo.entries: the shape of {name!r} is not an array "
                                 f"of at most {MAX_DIMS} dimensions")
            for size in shape:
                _uint(SchemaInfo, "entries", size)
            if dtype not in SCHEMA_DTYPES:  # also refuses non-text: it is never equal
                raise ValueError(f"SchemaInfo.entries: dtype of {name!r} is not one of "
                                 f"{', '.join(SCHEMA_DTYPES)}")
            checked.append((name, tuple(shape), dtype))
        object.__setattr__(self, "entries", tuple(checked))
        _bytes(SchemaInfo, "meta", self.meta, maximum=MAX_META)


@dataclass(frozen=True, slots=True)
class DialBack(Message):
    """Reachability check, over a secure channel. A joining node sends it to a member to ask
    "dial me back": the member dials the address in the requester's own member record,
    sends the same ``DialBack`` as the first message of that new channel, then sends it again
    on the request's channel to say it has tried. The requester believes only the channel
    that reached it: an answer on the request's channel just ends its wait early."""

    TAG: ClassVar[int] = 21
    nonce: bytes  # DIAL_BACK_NONCE random bytes chosen by the requester

    def __post_init__(self) -> None:
        _bytes(DialBack, "nonce", self.nonce, size=DIAL_BACK_NONCE)


# The tag table. ONLY APPEND: never reuse or renumber a tag.
TAGS: dict[int, type[Message]] = {
    1: Hello,
    2: Close,
    3: StateRequest,
    4: StateHeader,
    5: Packet,
    6: Ping,
    7: PingReq,
    8: Ack,
    9: Nack,
    10: Alive,
    11: Suspect,
    12: Dead,
    13: Left,
    14: MemberState,
    15: PushPull,
    16: Offer,
    17: Accept,
    18: Commit,
    19: StateInfo,
    20: SchemaInfo,
    21: DialBack,
}

for _tag, _cls in TAGS.items():
    assert _cls.TAG == _tag, _cls
