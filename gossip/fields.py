"""The field types of every message: the limits shared by all of them, and their checks.

Each check takes the message class and the field's name (for the error), and raises
``ValueError`` for a value the type does not allow; :mod:`gossip.messages` calls them from each
message's ``__post_init__``, and :func:`gossip.wire.decode` turns the error into a
:class:`~gossip.errors.WireError`. PROTOCOL.md section 6.2 names the same types.
"""

from __future__ import annotations

from .address import parse_address

__all__ = ["MAX_TEXT", "MAX_COUNT", "MAX_PART", "MAX_WEIGHT", "MAX_SHARDS", "PEER_ID_CHARS",
           "KEY_BYTES", "SIGNATURE_BYTES"]

# Limits shared by every message. Anything larger is a protocol violation.
MAX_TEXT = 256  # characters in any text field
# Every counter (step, samples, incarnation, byte size) is an integer in [0, MAX_COUNT]. The
# range is decided here, once, and checked at decode, so that whatever the wire accepts is
# valid everywhere downstream: exact as a float64 (Prometheus samples, JSON readers), as an
# int64 (torch), and in a checkpoint's 16-digit file name. Local counters saturate at it.
MAX_COUNT = 2**53 - 1
PEER_ID_CHARS = 26  # gossip.identity: base32 of 16 bytes, lowercase, no padding
MAX_PART = 1400  # bytes of one part: a datagram never holds more
MAX_WEIGHT = float(MAX_COUNT + 1)  # a push-sum weight (1 + samples) is a float in [0, 2^53]
MAX_SHARDS = 2**16 - 1  # parts a swarm's data may be cut into (a member's announced shard)
KEY_BYTES = 32  # a raw Ed25519 public key
SIGNATURE_BYTES = 64  # an Ed25519 signature
_BASE32 = frozenset("abcdefghijklmnopqrstuvwxyz234567")


def _uint(cls: type, name: str, value: object, maximum: int = MAX_COUNT) -> None:
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


def _bool(cls: type, name: str, value: object) -> None:
    if type(value) is not bool:
        raise ValueError(f"{cls.__name__}.{name}: expected a boolean, got {type(value).__name__}")


def _weight(cls: type, name: str, value: object) -> None:
    # A CBOR float decodes as a Python float; an integer is a different type on the wire.
    if type(value) is not float:
        raise ValueError(f"{cls.__name__}.{name}: expected a float, got {type(value).__name__}")
    if not 0.0 <= value <= MAX_WEIGHT:  # also refuses NaN and the infinities
        raise ValueError(f"{cls.__name__}.{name}: {value} out of range 0..{MAX_WEIGHT:g}")


def _shard(cls: type, shard: object, shards: object) -> None:
    """A data shard: ``shard`` of ``shards``. ``shards`` 0 announces none, and ``shard`` is 0
    then, so that "no shard" has one encoding."""
    _uint(cls, "shard", shard, MAX_SHARDS - 1)
    _uint(cls, "shards", shards, MAX_SHARDS)
    top = max(shards, 1) - 1  # type: ignore[call-overload]
    if shard > top:  # type: ignore[operator]
        raise ValueError(f"{cls.__name__}.shard: {shard} out of range 0..{top} "
                         f"(shards is {shards})")


def _peer(cls: type, name: str, value: object) -> None:
    if not isinstance(value, str) or len(value) != PEER_ID_CHARS or not _BASE32.issuperset(value):
        raise ValueError(f"{cls.__name__}.{name}: not a peer id (26 lowercase base32 characters)")


def _address(cls: type, name: str, value: object) -> None:
    """An address others can reach: ``host:port`` with a port from 1 to 65535."""
    _text(cls, name, value)
    try:
        _, port = parse_address(value)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ValueError(f"{cls.__name__}.{name}: {exc}") from None
    if port == 0:
        raise ValueError(f"{cls.__name__}.{name}: port 0 is not an address anyone can reach")


def _parts(cls: type, name: str, value: object, maximum: int) -> None:
    # Decoded CBOR arrays arrive as lists; store a tuple so the message stays immutable.
    if type(value) not in (list, tuple):
        raise ValueError(f"{cls.__name__}.{name}: expected an array, got {type(value).__name__}")
    if len(value) > maximum:  # type: ignore[arg-type]
        raise ValueError(f"{cls.__name__}.{name}: {len(value)} items exceeds {maximum}")  # type: ignore[arg-type]
    for item in value:  # type: ignore[attr-defined]
        _bytes(cls, name, item, maximum=MAX_PART)


def _proof(cls: type, key: object, signature: object) -> None:
    """A member's proof of its own claim: its raw public key and its signature
    (:mod:`gossip.claims` says over what; this checks only the sizes)."""
    _bytes(cls, "key", key, size=KEY_BYTES)
    _bytes(cls, "signature", signature, size=SIGNATURE_BYTES)
