"""The spacing of a node's rounds when ``averaging.every = "auto"``: local steps between the
rounds it starts, from its step time and its exchanges' durations. Pure.

Theory of operation
-------------------
A node starts one round per period and is picked by its peers about as often, so it is in
about two exchanges per period. The period that keeps its link busy without queueing offers
on it is therefore two exchanges long, and in local steps::

    spacing = clamp(ceil(2 * exchange / step), 1, MAX_SPACING)
    exchange = median duration of the last EXCHANGES committed exchanges, either side's
    step = seconds per local step, over the last STEP_POINTS observations

A shorter spacing only queues rounds behind the link (a round that outlasts the spacing is
followed at once by the next: training never waits, but the offers meet busy peers); a
longer one leaves the link idle, and nodes on skewed data drift apart for nothing.

The figures are robust, not fresh: the *median* exchange, because one exchange that waited
on a stalled peer or a congested moment would otherwise multiply the spacing for as long as
a mean remembers it (only committed exchanges count: a failed one ends at a deadline, which
says nothing about the link); the *mean* step time over several rounds, because single steps
vary (data loading, an evaluation, a checkpoint) and what matters is the pace between rounds.
The caller observes the step counter when it starts a round, so no hook runs per step.

A node's payloads change size with what its rounds do (:mod:`gossip.plan`: from wide spacing
on, a smaller codec and no drift-correction estimate), so each exchange is recorded with its
payload's size, and :meth:`Spacing.steps` answers for a payload of any size: the spacing one
set of choices would give is then measured on exchanges of the other. Measured in seconds
alone, the choice would feed on itself: the wide choices' exchanges, eight times smaller, would
measure a close spacing, whose exchanges would measure a wide one.

Before both are measured the spacing is 1: the first exchanges measure the link, and rounds
run back to back until they have (on a slow link that costs nothing, since training does not
wait; on a fast one it is what the link allows anyway).

MAX_SPACING bounds what one bad figure can do: a step time measured over a burst (steps
counted after a pause, a clock that did not move) would otherwise put the next round out of
reach, for ever when ``interval`` is None. 10,000 steps is 17 minutes of training at 0.1 s a
step and nearly 3 hours at 1 s. It is past every spacing of the table in docs/DAEMON.md (the
largest, 5,100: 100M and 1B parameters over 10 Mbit/s), and past it a swarm barely mixes. At the bound a node starts rounds a little more often than its link
carries them, which costs busy answers, not training time.

Nothing here imports trio or reads a clock: callers pass step counts, seconds and ``now``.
"""

from __future__ import annotations

import math
from collections import deque

__all__ = ["Spacing", "MAX_SPACING", "EXCHANGES", "STEP_POINTS", "PER_PERIOD"]

MAX_SPACING = 10_000  # local steps; see the module docstring
EXCHANGES = 9  # committed exchanges whose median duration is the exchange time (odd: a middle one)
STEP_POINTS = 8  # (steps, now) observations the step time is measured over: 7 periods
PER_PERIOD = 2  # exchanges a node is in per period: the round it starts and one it answers
_DUST = 1e-6  # steps; float error in time differences must not round 20.000000001 up to 21


class Spacing:
    """Local steps between the rounds a node starts, measured (see the module docstring)."""

    def __init__(self) -> None:
        self._exchanges: deque[tuple[float, int | None]] = deque(maxlen=EXCHANGES)  # s, bytes
        self._points: deque[tuple[int, float]] = deque(maxlen=STEP_POINTS)

    def stepped(self, steps: int, now: float) -> None:
        """The trainer had counted ``steps`` local steps at ``now`` (seconds, any clock)."""
        if self._points and (steps < self._points[-1][0] or now < self._points[-1][1]):
            self._points.clear()  # a counter or clock that went back: start over
        self._points.append((steps, now))

    def exchanged(self, seconds: float, nbytes: int | None = None) -> None:
        """A committed exchange took ``seconds``, from its start to its end at this node, to
        move payloads of ``nbytes`` each way (None: not known). Durations that are not finite
        and >= 0 are ignored, and so is a size that is not positive."""
        if math.isfinite(seconds) and seconds >= 0:
            size = nbytes if nbytes is not None and nbytes > 0 else None
            self._exchanges.append((float(seconds), size))

    @property
    def exchange(self) -> float | None:
        """Seconds: the median of the recent committed exchanges (of an even count, the
        upper middle one); None before the first."""
        return self._median()

    def _median(self, nbytes: int | None = None) -> float | None:
        """The median exchange, each scaled to payloads of ``nbytes`` where both sizes are
        known (None: as measured)."""
        if not self._exchanges:
            return None
        scaled = sorted(t * nbytes / size if nbytes is not None and size is not None else t
                        for t, size in self._exchanges)
        return scaled[len(scaled) // 2]

    @property
    def step(self) -> float | None:
        """Seconds per local step over the recent observations; None until two of them are
        a step or more apart."""
        if len(self._points) < 2:
            return None
        (first, start), (last, end) = self._points[0], self._points[-1]
        return (end - start) / (last - first) if last > first else None

    def steps(self, nbytes: int | None = None) -> int:
        """The spacing now: ``ceil(2 * exchange / step)`` in [1, MAX_SPACING]; 1 until both
        are measured. With ``nbytes``, of exchanges of payloads that size: each measured
        exchange whose size is known counts at its seconds times ``nbytes`` over its size (the
        link's time in proportion to the bytes; its round trips are counted in proportion
        too, which on a slow link, where the spacing is large, is a small part)."""
        exchange, step = self._median(nbytes), self.step
        if exchange is None or step is None or exchange <= 0:
            return 1
        if step <= 0:  # steps that took no time at all: any exchange outlasts them
            return MAX_SPACING
        ratio = min(PER_PERIOD * exchange / step, MAX_SPACING)
        return max(1, math.ceil(ratio - _DUST))
