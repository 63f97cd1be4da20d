"""The cost of churn: how far each node's accuracy dips after a join or a departure.

Theory of operation
-------------------
A swarm's membership changes while it trains: a node departs (its leave gossiped) or a new
one joins (it downloads the swarm's weights, then trains). Either can set the others back for
a while, as their averaging partners change. This module measures how far, from evaluations
the nodes log with their own timestamps; it is pure (no I/O, no clock), so ``gossipd demo``
and a script reading the daemons' metrics logs get the same figures.

For each :class:`ChurnEvent` and each node that ran across it, the node's *level* is the mean
of its last ``LEVEL_EVALS`` evaluations before the event (one evaluation alone swings by
points from the next); with fewer than ``MIN_LEVEL_EVALS`` it has no level, and no dip is
counted for it. Its *dip* is how far its lowest evaluation after the event, until its own
departure if it departed, fell below that level, in points, and 0 when it did not fall.
:func:`worst_dip_points` is the largest dip of any node after any event.

The node the event is about is left out: a dip is what the event costs the nodes that keep
training. The departing node's last evaluation, written as it stops after its SIGTERM, is not a
running node's; the joiner has no level before it joined, and its first evaluations, after the
download, are the start of its training, not a fall. For the same reason a node that departed
earlier does not run across a later event.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Mapping, Sequence

__all__ = ["LEVEL_EVALS", "MIN_LEVEL_EVALS", "ChurnEvent", "Dip", "dips", "worst_dip_points"]

# A node's level before an event is the mean of its last LEVEL_EVALS evaluations (one alone
# swings by points between evaluations); with fewer than MIN_LEVEL_EVALS it has no level, and
# no dip is counted for it.
LEVEL_EVALS = 3
MIN_LEVEL_EVALS = 2


@dataclass(frozen=True)
class ChurnEvent:
    """A change of the swarm's membership, at a Unix time of the daemons' clock."""

    kind: Literal["join", "departure"]
    node: str  # who joined or departed
    time: float


@dataclass(frozen=True)
class Dip:
    """How far one node's accuracy fell after an event, below its level just before it."""

    event: ChurnEvent
    node: str
    level: float  # the mean of its last LEVEL_EVALS evaluations before the event
    lowest: float  # its lowest evaluation after the event, until its end

    @property
    def points(self) -> float:
        return max(0.0, 100 * (self.level - self.lowest))


def dips(evaluations: Mapping[str, Sequence[tuple[float, float]]],
         events: Sequence[ChurnEvent]) -> list[Dip]:
    """The dip of every node that ran across each event.

    A node ran across an event when it is not the event's subject, has at least
    ``MIN_LEVEL_EVALS`` evaluations before it and one after, and had not itself departed by
    then (a departed node's final evaluation, written as it stops, is not a running one).

    Args:
        evaluations: per node, ``(time, accuracy)`` in time order, accuracy in [0, 1].
        events: the joins and departures.
    Returns:
        One :class:`Dip` per (event, node that ran across it), in the events' order.
    """
    gone = {e.node: e.time for e in events if e.kind == "departure"}
    found = []
    for event in events:
        for node, series in evaluations.items():
            end = gone.get(node, math.inf)
            if node == event.node or end <= event.time:
                continue
            before = [v for t, v in series if t < event.time][-LEVEL_EVALS:]
            after = [v for t, v in series if event.time < t < end]
            if len(before) >= MIN_LEVEL_EVALS and after:
                found.append(Dip(event, node, sum(before) / len(before), min(after)))
    return found


def worst_dip_points(found: Sequence[Dip]) -> float:
    """The largest dip in points, 0 when there is none."""
    return max((d.points for d in found), default=0.0)
