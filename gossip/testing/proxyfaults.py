"""What a fault proxy does to traffic (:class:`Faults`) and what it counted
(:class:`ProxyStatistics`): frozen values shared by the proxy, its UDP side and its HTTP API.
Pure: no sockets, no trio.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import random
from typing import Any, Iterable

__all__ = ["Faults", "ProxyStatistics", "FAULT_FIELDS", "normalize_ip", "seeded", "flip_one_byte"]


def normalize_ip(address: str) -> str:
    """The canonical text of an IP address; an IPv4-mapped IPv6 address becomes IPv4.

    Raises:
        ValueError: not an IP address.
    """
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip)


def seeded(seed: int, *labels: object) -> random.Random:
    """An independent generator for one consumer (a str seed is hashed with SHA-512, so the
    same labels give the same stream in every process)."""
    return random.Random("/".join(map(str, (seed, *labels))))


def flip_one_byte(data: bytes, rng: random.Random) -> bytes:
    """``data`` with one byte, chosen at random, XORed with a random non-zero value."""
    buf = bytearray(data)
    buf[rng.randrange(len(buf))] ^= rng.randrange(1, 256)
    return bytes(buf)


def _number(name: str, value: object, *, maximum: float = math.inf) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, not {type(value).__name__}")
    if not (math.isfinite(value) and 0 <= value <= maximum):
        bound = f"between 0 and {maximum:g}" if math.isfinite(maximum) else "finite and >= 0"
        raise ValueError(f"{name} must be {bound}, not {value!r}")


@dataclasses.dataclass(frozen=True)
class Faults:
    """Every fault a proxy can apply; the defaults apply none. Validated on construction.

    Raises:
        ValueError: a field has the wrong type or is out of range.
    """

    delay: float = 0.0  # s added to every TCP chunk and UDP datagram
    jitter: float = 0.0  # s: each delay is uniform in delay ± jitter, never below 0
    throttle: float | None = None  # bytes/s per direction of each TCP connection; None: no limit
    cut_after: int | None = None  # bytes (both directions) before each TCP connection resets
    corrupt: float = 0.0  # probability that a chunk or datagram gets one byte flipped
    reset_probability: float = 0.0  # probability that a new TCP connection resets at random
    loss: float = 0.0  # probability that a UDP datagram is dropped
    block: frozenset[str] = frozenset()  # source IPs black-holed (TCP held, UDP dropped)

    def __post_init__(self) -> None:
        _number("delay", self.delay)
        _number("jitter", self.jitter)
        for name in ("corrupt", "reset_probability", "loss"):
            _number(name, getattr(self, name), maximum=1.0)
        if self.throttle is not None:
            _number("throttle", self.throttle)
            if self.throttle == 0:
                raise ValueError("throttle must be > 0 bytes/s (null for no limit)")
        if self.cut_after is not None and (
            isinstance(self.cut_after, bool) or not isinstance(self.cut_after, int)
            or self.cut_after < 0
        ):
            raise ValueError(f"cut_after must be an integer >= 0 or null, not {self.cut_after!r}")
        if isinstance(self.block, (str, bytes)) or not isinstance(self.block, Iterable):
            raise ValueError("block must be a list of IP addresses")
        sources = set()
        for source in self.block:
            if not isinstance(source, str):
                raise ValueError(f"block must list IP addresses as strings, not {source!r}")
            try:
                sources.add(normalize_ip(source))
            except ValueError:
                raise ValueError(f"block: {source!r} is not an IP address") from None
        object.__setattr__(self, "block", frozenset(sources))

    def as_dict(self) -> dict[str, Any]:
        """Every field, ``block`` as a sorted list: JSON-ready, and accepted by ``Faults(**)``."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["block"] = sorted(self.block)
        return fields


FAULT_FIELDS = tuple(f.name for f in dataclasses.fields(Faults))


@dataclasses.dataclass(frozen=True)
class ProxyStatistics:
    """A proxy's counters since it started."""

    connections_accepted: int  # TCP connections accepted
    connections_open: int  # TCP connections open now
    bytes_upstream: int  # TCP bytes forwarded from clients to upstream
    bytes_downstream: int  # TCP bytes forwarded from upstream to clients
    bytes_held: int  # TCP bytes read and not yet forwarded (delayed, blocked, throttled)
    resets: int  # TCP connections the proxy closed with a reset, whatever the cause
    corrupted: int  # TCP chunks and UDP datagrams that had a byte flipped
    datagrams_forwarded: int  # UDP datagrams sent on, both directions
    datagrams_dropped: int  # UDP datagrams dropped: loss, block, queue full, send error
    udp_sessions: int  # UDP sources with a socket of their own now
