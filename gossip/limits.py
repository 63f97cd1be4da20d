"""What one node lets others make it do: the per-peer and per-host :class:`RateLimit` and the
:class:`Admission` of inbound connections, which enforce the settings of
:class:`gossip.config.Limits`.

Theory of operation
-------------------
Every read from the network is already bounded in size (the frame caps) and in time (the
phase deadlines). What those bounds do not cap is *how many* at once, and a holder of the
swarm key can also ask for expensive work (an exchange, a state download) as often as it
likes. These limits close that gap:

* ``max_connections``: inbound connections open at once, handshakes included. One over the
  limit is closed as soon as it is accepted, before a byte is read, so a flood of half-open
  connections costs at most ``max_connections`` handshake buffers (64 KiB each) and as many
  descriptors, and honest peers retry on their next round. Our own dials do not count.
* ``max_handshakes_per_host``: connections from one remote host whose handshake has not
  completed yet. Until the handshake's last message proves it, a connection could be
  anyone's: message 1 authenticates under the swarm key, but anyone who watched a connection
  can replay one (it carries no proof of a live peer until message 3 answers our fresh
  ephemeral key). An honest peer's completes a round trip and a half after the accept, an
  outsider's or a replayer's never does; a replayed message 1 is also known as one
  (:class:`FirstMessages`) and closed at once. Without this cap one host could fill all
  ``max_connections`` places and keep honest peers out; with it, it takes that many hosts. When
  a host is at its cap, a new connection from it *evicts* the host's oldest unproven one instead
  of being refused: an outsider sharing an address with honest peers (one NAT, one machine)
  would otherwise keep them out by holding the slots, whereas now each honest connection has
  until the next ``max_handshakes_per_host`` connections from its host arrive to complete its
  handshake (:class:`Admission`). Connections that never send it are closed by the server's
  first-message deadline (:data:`gossip.endpoints.FIRST_MESSAGE_TIMEOUT`).
* ``host_rate`` / ``host_burst``: connections one remote host may open, as a token bucket
  spent at accept, before a byte is read. The cap above bounds how many of a host's unproven
  connections are open at once, not how many it opens: a flood of replayed (or fresh) message
  1s evicts and is evicted, and every one of them still cost us a task, a read and the AEAD
  open of message 1 (a fresh one, a signature and two Diffie-Hellman operations as well)
  before it could be told from an honest one. Spent before any of that work, the bucket bounds
  it to ``host_burst`` connections and then ``host_rate`` a second per host; the rest cost an
  accept and a reset (:func:`gossip.network.reset_on_close`). It counts every connection of
  the host, proven or not (which are which is only known after the work it bounds), so it is
  sized for the honest nodes that share one address (a NAT, one machine): each opens at most
  0.9 x ``peer_rate`` a second to us, usually a few per averaging interval, and the default
  (50 a second, 100 at once) leaves room for five nodes at their fastest and far more at their
  usual pace. A host that floods us takes its own address's honest nodes down with it, for as
  long as it floods; nobody else's.
* ``peer_rate`` / ``peer_burst``: inbound channels one authenticated peer may open, as a
  token bucket (``peer_burst`` at once, refilled at ``peer_rate`` per second). A channel
  over the budget is closed after the handshake, before its first message is read. An
  honest node in a large swarm opens a few per averaging interval (an offer, now and then a
  push-pull or a download), far below the default; but a pair alone, or a node whose rounds
  come fast, would offer its one peer as fast as exchanges end, so the initiator paces its
  offers to each peer at 0.9 x the default (:data:`gossip.averaging.PACE`), waiting for the
  peer's next token rather than having the offer cut off. A peer looping on offers is cut off.

Each bucket table holds at most :data:`MAX_BUCKETS` peers (or hosts); a full table forgets
the one seen longest ago (a forgotten one starts again with a full bucket, which errs on the
side of letting honest peers in). :class:`Admission` holds one entry per open connection, so
``max_connections`` bounds it too. Pure: time comes in as ``now``, connections as keys.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, Hashable, TypeVar

from .config import Limits

__all__ = ["Limits", "RateLimit", "Admission", "FirstMessages", "MAX_BUCKETS", "MAX_FIRSTS"]

MAX_BUCKETS = 4096  # peers whose budget is remembered at once
MAX_FIRSTS = 16384  # handshake first messages remembered, to know a replay (about 1 MB)


class FirstMessages:
    """The ephemeral keys of the last :data:`MAX_FIRSTS` handshake first messages a server
    took: ``fresh(key)`` is False for one seen before. An honest initiator draws a new
    ephemeral key for every connection, so a repeat is a captured message 1 replayed (it
    authenticates under the swarm key, so nothing else tells it apart before message 3)."""

    def __init__(self, max_keys: int = MAX_FIRSTS) -> None:
        self._max_keys = max_keys
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def fresh(self, key: bytes) -> bool:
        """Whether ``key`` is new (and remember it)."""
        if key in self._seen:
            return False
        self._seen[key] = None
        if len(self._seen) > self._max_keys:
            self._seen.popitem(last=False)
        return True


class RateLimit:
    """Token buckets keyed by peer: ``allow(peer, now)`` spends one token if there is one."""

    def __init__(self, rate: float, burst: int, max_keys: int = MAX_BUCKETS) -> None:
        self.rate = rate
        self.burst = burst
        self._max_keys = max_keys
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tokens, when

    def wait(self, peer: str, now: float) -> float:
        """Seconds until ``peer`` has a token (0: it has one now); spends nothing."""
        tokens, then = self._buckets.get(peer, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + max(0.0, now - then) * self.rate)
        return 0.0 if tokens >= 1.0 else (1.0 - tokens) / self.rate

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


K = TypeVar("K", bound=Hashable)


class Admission(Generic[K]):
    """Which inbound connections a server holds: ``max_connections`` in all, and at most
    ``max_unproven_per_host`` per host that have not proved the swarm key. Keys are the
    caller's handles for its connections (``serve`` uses each one's ``trio.CancelScope``).

    A connection goes ``admit`` -> (``proved``) -> ``release``. One that is evicted stays
    counted against ``max_connections`` until its ``release``: its buffers live until its
    task has unwound, so ``open`` never exceeds the cap, not even for an instant.

    Args:
        max_connections: None for no cap.
        max_unproven_per_host: None for no cap (and so no evictions).
    """

    def __init__(self, max_connections: int | None, max_unproven_per_host: int | None) -> None:
        self._max_open = max_connections
        self._max_unproven = max_unproven_per_host
        self.open = 0  # admitted and not yet released, evicted ones included
        self._unproven: dict[str, dict[K, None]] = {}  # host -> its unproven keys, oldest first

    @property
    def full(self) -> bool:
        """Whether ``max_connections`` are open: refuse the next one, whoever it is from."""
        return self._max_open is not None and self.open >= self._max_open

    def unproven(self, host: str) -> int:
        """Connections from ``host`` that have not proved the key, evicted ones excluded."""
        return len(self._unproven.get(host, ()))

    def admit(self, host: str, key: K) -> K | None:
        """Count ``key``, a new connection from ``host``, as open and unproven. Call only when
        not :attr:`full`.

        Returns:
            The connection it evicts, if ``host`` was at its cap: the host's oldest unproven
            one, now no longer unproven here (close it; it is still open until released).
        """
        assert not self.full, "admit() on a full Admission"
        waiting = self._unproven.setdefault(host, {})
        evicted = None
        if self._max_unproven is not None and len(waiting) >= self._max_unproven:
            evicted = next(iter(waiting))
            del waiting[evicted]
        waiting[key] = None
        self.open += 1
        return evicted

    def proved(self, host: str, key: K) -> None:
        """``key`` proved the swarm key: it can no longer be evicted. No-op if it was."""
        waiting = self._unproven.get(host)
        if waiting is not None:
            waiting.pop(key, None)
            if not waiting:
                del self._unproven[host]

    def release(self, host: str, key: K) -> None:
        """``key`` is closed."""
        self.proved(host, key)
        self.open -= 1
