"""How fast each peer's link has carried our payloads, and the deadlines that follow. Pure.

Theory of operation
-------------------
A bulk transfer's deadline must fit the link it crosses. One fixed rate cannot: set for a
datacenter, it fails every exchange of a volunteer on 5 Mbit/s; set for the thinnest link, it
lets a peer that trickles hold an exchange for an hour on a link that could move it in a
second. So each node remembers, per peer host, what its transfers with that host carried
(an exponentially weighted mean of bytes per second), and gives a transfer of ``nbytes``::

    deadline = base + nbytes / rate(host)
    rate(host) = max(floor, measured(host) / SLACK)      # floor when the host is unknown

Three guards, each against its own failure:

* **stall** (:meth:`gossip.channel.SecureChannel.stall_guard`): a payload that goes ``stall``
  seconds without a byte is dropped, whatever its size: a peer that froze, crashed behind a
  NAT or lost its link costs seconds, not the hours a thin link's deadline allows.
* **the deadline above**: a peer that trickles bytes (a slowloris, or a link that fell far
  below what it carried before) is held to an average of ``rate(host)``: dropped once its
  payload's time at that rate has passed. A host we measured fast is held to a quarter of
  its rate; one we never measured, to ``floor``.
* **floor** (``min_rate``): the slowest link always given time. Measurements only ever
  shorten a deadline from the floor's, never lengthen it, so no peer can talk its way into
  more time than the floor grants; the floor is also the bound on what a trickling peer with
  no history can hold (``base + nbytes / floor``).

Samples: a transfer of at least :data:`MIN_SAMPLE` bytes that completed adds its rate to the
host's mean (weight :data:`ALPHA`); smaller ones say more about round trips than about the
link, and are left out. A sample is timed over the whole exchange, round trips and checks
included, up to the peer's Commit (for a download, the state's last byte), so it can only
underestimate the link: the safe side, a longer deadline. A download's server takes none: a
sender cannot tell when its last bytes left its socket buffer. A transfer that ran out of
time carried less than the link was thought to: its rate (what moved by the deadline)
lowers the mean to it at once, so that a link that slowed down costs one failed exchange,
not one per halving of the mean.

The table holds :data:`MAX_HOSTS` hosts, the least recently used forgotten first, so its
memory is bounded whatever the swarm's churn. It is keyed by host (IP address), not peer id:
a link belongs to a machine, and a key holder mints peer ids for free, not addresses.

Nothing here imports trio or reads a clock: callers pass bytes and seconds.
"""

from __future__ import annotations

import math
from collections import OrderedDict

__all__ = ["LinkRates", "MIN_RATE", "SLACK", "MIN_SAMPLE", "ALPHA", "MAX_HOSTS", "STALL"]

# bytes/s: the slowest link every transfer is given time for (400 kbit/s). A 5 Mbit/s link
# carries 12 times this; a TCP flow over 200 ms and 1% loss (Reno, about MSS / RTT x
# 1.22 / sqrt(loss) = 88 kB/s) still clears it. The cost of a lower floor is how long a
# peer with no history may trickle: a 100 MB payload, 2,000 s here.
MIN_RATE = 5e4
SLACK = 4.0  # a measured link is given 4x the time its mean rate needs
STALL = 10.0  # s a payload may go without a byte (three lost retransmissions in a row,
# RTO 1 + 2 + 4 s, still fit; a frozen or vanished peer is dropped this fast)
MIN_SAMPLE = 1 << 18  # bytes: smaller transfers are timed by their round trips, not the link
ALPHA = 0.25  # weight of a new sample in a host's mean
MAX_HOSTS = 1024  # hosts remembered, least recently used forgotten first


class LinkRates:
    """The measured rate of each peer host's link, and the transfer deadlines it gives.

    Args:
        floor: bytes/s; the rate a transfer with an unknown or slow host is given time for.
        capacity: hosts remembered.

    Raises:
        ValueError: a floor that is not a positive number, or a capacity below 1.
    """

    def __init__(self, floor: float = MIN_RATE, capacity: int = MAX_HOSTS) -> None:
        if not (math.isfinite(floor) and floor > 0):
            raise ValueError(f"floor must be a positive number of bytes/s, not {floor!r}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, not {capacity!r}")
        self.floor = float(floor)
        self._capacity = capacity
        self._rates: OrderedDict[str, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._rates)

    def measured(self, host: str) -> float | None:
        """The mean rate of transfers with ``host``, bytes/s; None if never measured."""
        return self._rates.get(host)

    def known(self) -> list[float]:
        """The mean rates of every host measured, bytes/s."""
        return list(self._rates.values())

    def rate(self, host: str) -> float:
        """The rate a transfer with ``host`` is given time for, bytes/s:
        ``max(floor, measured / SLACK)``."""
        measured = self._rates.get(host)
        return self.floor if measured is None else max(self.floor, measured / SLACK)

    def deadline(self, host: str, base: float, nbytes: int) -> float:
        """Seconds for a transfer of ``nbytes`` each way with ``host``: ``base`` plus the
        bytes at :meth:`rate`."""
        return base + nbytes / self.rate(host)

    def observe(self, host: str, nbytes: int, seconds: float, *, complete: bool) -> None:
        """Record that a transfer with ``host`` carried ``nbytes`` (each way) in ``seconds``:
        ``complete`` if it ended, False if it ran out of time (see the module docstring).
        Samples below :data:`MIN_SAMPLE` bytes, of no duration, or from an unknown host ("")
        are ignored."""
        if not host or nbytes < MIN_SAMPLE or not (seconds > 0 and math.isfinite(seconds)):
            return
        sample = nbytes / seconds
        old = self._rates.pop(host, None)
        if old is None or not complete:
            new = sample if old is None else min(old, sample)
        else:
            new = old + ALPHA * (sample - old)
        self._rates[host] = new
        while len(self._rates) > self._capacity:
            self._rates.popitem(last=False)
