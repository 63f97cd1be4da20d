"""Lifeguard's suspicion timeout: long at first, shorter with each independent confirmation.

Theory of operation
-------------------
When a node suspects a member it starts a timer; if nobody refutes the suspicion before the
timer fires, the member is declared dead. A fixed timeout must be long enough for a slow
member to hear of the suspicion and refute it, which makes every real failure slow to detect.
Lifeguard (Dadgar et al., 2018) starts the timer at a maximum and lets it shrink, on a
logarithmic curve, as other members independently report the same suspicion, down to a
minimum once ``expected`` confirmations have arrived::

    minimum  = suspicion_mult * max(1, log10(N)) * probe_interval
    maximum  = suspicion_max_mult * minimum
    timeout  = max(minimum, maximum - (maximum - minimum) * log(C + 1) / log(K + 1))

with N the members the node knows to be alive, C the confirmations so far and K the
confirmations expected (``suspicion_mult - 2``, or 0 in a swarm too small to supply them, in
which case the timeout is the minimum from the start). A lone, possibly confused suspector
waits long; many agreeing suspectors conclude fast.

Pure: time is passed in.
"""

from __future__ import annotations

import math

__all__ = ["Suspicion", "suspicion_bounds"]


def suspicion_bounds(
    alive: int, probe_interval: float, suspicion_mult: float, suspicion_max_mult: float
) -> tuple[float, float]:
    """(minimum, maximum) suspicion timeout in seconds for a swarm of ``alive`` members."""
    scale = max(1.0, math.log10(max(1, alive)))
    minimum = suspicion_mult * scale * probe_interval
    return minimum, suspicion_max_mult * minimum


class Suspicion:
    """One suspicion of one member: when it started, who confirmed it, when it expires.

    Args:
        now: when the suspicion started.
        first: the member whose report started it; it never counts as a confirmation.
        expected: confirmations that bring the timeout down to ``minimum``.
        minimum, maximum: the timeout bounds, seconds (see :func:`suspicion_bounds`).
    """

    __slots__ = ("start", "expected", "minimum", "maximum", "_first", "_seen", "_own", "deadline")

    def __init__(self, now: float, first: str, expected: int, minimum: float, maximum: float):
        if not 0 < minimum <= maximum:
            raise ValueError("need 0 < minimum <= maximum")
        self.start = now
        self.expected = max(0, expected)
        self.minimum = minimum
        self.maximum = maximum
        self._first = first
        self._seen = {first}
        self._own = False  # our own silent verification, when our probe started it
        self.deadline = now + self._timeout()

    @property
    def confirmations(self) -> int:
        return len(self._seen) - 1 + self._own

    def confirm(self, by: str) -> bool:
        """Count ``by``'s report if it is new and more are still useful; returns True if it
        counted (the caller then passes the suspicion on), False for a repeat."""
        if self.confirmations >= self.expected or by in self._seen:
            return False
        self._seen.add(by)
        self.deadline = self.start + self._timeout()
        return True

    def confirm_silence(self, me: str) -> bool:
        """Count our own verification ping that went a period unanswered, once. It counts
        even when our own failed probe started the suspicion (``first``): a silence a period
        later is evidence the failed probe was not, and without it a suspector that misses
        everyone else's confirmations would wait out the maximum. Returns True if it counted.
        """
        if me != self._first:
            return self.confirm(me)
        if self._own or self.confirmations >= self.expected:
            return False
        self._own = True
        self.deadline = self.start + self._timeout()
        return True

    def restart(self, now: float) -> None:
        """Start the timeout over from ``now``, keeping the confirmations: the member just
        answered a probe, so the evidence against it is older than it looked."""
        self.start = now
        self.deadline = now + self._timeout()

    def _timeout(self) -> float:
        if self.expected < 1:
            return self.minimum
        fraction = math.log(self.confirmations + 1) / math.log(self.expected + 1)
        return max(self.minimum, self.maximum - (self.maximum - self.minimum) * fraction)
