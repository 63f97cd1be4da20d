"""What one node lets others make it do: :class:`Limits` and the per-peer :class:`RateLimit`.

Theory of operation
-------------------
Every read from the network is already bounded in size (the frame caps) and in time (the
phase deadlines). What those bounds do not cap is *how many* at once, and a holder of the
swarm key can also ask for expensive work (an exchange, a state download) as often as it
likes. Two limits close that gap:

* ``max_connections``: inbound connections open at once, handshakes included. One over the
  limit is closed as soon as it is accepted, before a byte is read, so a flood of half-open
  connections costs at most ``max_connections`` handshake buffers (64 KiB each) and as many
  descriptors, and honest peers retry on their next round. Our own dials do not count.
* ``max_handshakes_per_host``: handshakes in progress at once from one remote host. Until
  the handshake's first message proves the swarm key, a connection could be anyone's; an
  honest peer holds one for a round trip or two, an outsider for as long as the handshake
  deadline lets it. Without this cap one host could fill all ``max_connections`` places
  and keep honest peers out; with it, it takes that many hosts.
* ``peer_rate`` / ``peer_burst``: inbound channels one authenticated peer may open, as a
  token bucket (``peer_burst`` at once, refilled at ``peer_rate`` per second). A channel
  over the budget is closed after the handshake, before its first message is read. An
  honest node opens a few per averaging interval (an offer, now and then a push-pull or a
  download), far below the default; a peer looping on offers is cut off.

The bucket table holds at most :data:`MAX_BUCKETS` peers; a full table forgets the peer
seen longest ago (a forgotten peer starts again with a full bucket, which errs on the side
of letting honest peers in). Pure: time comes in as ``now``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["Limits", "RateLimit", "MAX_BUCKETS"]

MAX_BUCKETS = 4096  # peers whose budget is remembered at once


@dataclass(frozen=True)
class Limits:
    """A node's limits on inbound work. See the module docstring.

    Attributes:
        max_connections: inbound connections open at once, handshakes included (>= 1).
        max_handshakes_per_host: handshakes in progress at once from one host (>= 1).
        peer_rate: inbound channels per second one peer may open on average (> 0).
        peer_burst: inbound channels one peer may open at once (>= 1).
    """

    max_connections: int = 256
    max_handshakes_per_host: int = 8
    peer_rate: float = 10.0
    peer_burst: int = 20

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, not {self.max_connections!r}")
        if self.max_handshakes_per_host < 1:
            raise ValueError("max_handshakes_per_host must be >= 1, not "
                             f"{self.max_handshakes_per_host!r}")
        if not (math.isfinite(self.peer_rate) and self.peer_rate > 0):
            raise ValueError(f"peer_rate must be > 0, not {self.peer_rate!r}")
        if self.peer_burst < 1:
            raise ValueError(f"peer_burst must be >= 1, not {self.peer_burst!r}")


class RateLimit:
    """Token buckets keyed by peer: ``allow(peer, now)`` spends one token if there is one."""

    def __init__(self, rate: float, burst: int, max_keys: int = MAX_BUCKETS) -> None:
        self.rate = rate
        self.burst = burst
        self._max_keys = max_keys
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tokens, when

    def allow(self, peer: str, now: float) -> bool:
        """Whether ``peer`` may open one more channel at ``now`` (and count it if so)."""
        tokens, then = self._buckets.pop(peer, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + max(0.0, now - then) * self.rate)
        allowed = tokens >= 1.0
        if allowed:
            tokens -= 1.0
        self._buckets[peer] = (tokens, now)
        if len(self._buckets) > self._max_keys:
            self._buckets.popitem(last=False)
        return allowed
