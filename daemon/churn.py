"""The cost of churn: how far each node's accuracy dips after a join or a departure.

Theory of operation
-------------------
A swarm's membership changes while it trains: a node departs (its leave gossiped, or it
crashes) or one joins (a new one that downloads the swarm's weights, or a node that comes back
from a checkpoint). Either can set the others back for a while, as their averaging partners
change. This module measures how far, from evaluations the nodes log with their own
timestamps; it is pure (no I/O, no clock), so ``gossipd demo``, ``bench/efficiency.py`` and a
script reading the daemons' metrics logs get the same figures.

A node's *lives*: it runs from its join (from the start of its record, if it was there
before its first event) until its next departure (the end of its record, if none). A node
that departs and joins again, as one that crashes and restarts does, has two lives, and an
evaluation between them (a model nobody trains) is no one's.

For each :class:`ChurnEvent` and each node that runs across it (one of its lives began before
the event and ends after it), the node's *level* is the mean of its last ``LEVEL_EVALS``
evaluations of that life before the event (one evaluation alone swings by points from the
next); with fewer than ``MIN_LEVEL_EVALS`` it has no level, and no dip is counted for it. Its
*dip* is how far its lowest evaluation after the event, until that life ends, fell below that
level, in points, and 0 when it did not fall. :func:`worst_dip_points` is the largest dip of
any node after any event.

The window runs to the end of the life, not to the next event: events come close together
(the demo's departure and join, seconds apart), and a fall that began after the first and
reached its lowest after the second would otherwise be cut in two, its second half measured
from a level that had already fallen.

The node the event is about is left out: a dip is what the event costs the nodes that keep
training. The departing node's last evaluation, written as it stops after its SIGTERM, is not a
running node's; the joiner has no level before it joined, and its first evaluations, after the
download, are the start of its training, not a fall. For the same reason a node that had
departed (and not come back) does not run across a later event, and a node that came back
has its level from its new life alone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Mapping, Sequence

__all__ = ["LEVEL_EVALS", "MIN_LEVEL_EVALS", "ChurnEvent", "Dip", "dips", "lives",
           "worst_dip_points"]

# A node's level before an event is the mean of its last LEVEL_EVALS evaluations (one alone
# swings by points between evaluations); with fewer than MIN_LEVEL_EVALS it has no level, and
# no dip is counted for it.
LEVEL_EVALS = 3
MIN_LEVEL_EVALS = 2


@dataclass(frozen=True)
class ChurnEvent:
    """A change of the swarm's membership, at a time of the evaluations' clock (the daemons'
    Unix time; any clock that orders the events among the evaluations will do)."""

    kind: Literal["join", "departure"]
    node: str  # who joined or departed
    time: float


@dataclass(frozen=True)
class Dip:
    """How far one node's accuracy fell after an event, below its level just before it."""

    event: ChurnEvent
    node: str
    level: float  # the mean of its last LEVEL_EVALS evaluations before the event
    lowest: float  # its lowest evaluation after the event, until that life of it ends

    @property
    def points(self) -> float:
        return max(0.0, 100 * (self.level - self.lowest))


def lives(node: str, events: Sequence[ChurnEvent]) -> list[tuple[float, float]]:
    """The ``(start, end)`` times between which ``node`` runs: from each join (``-inf`` if its
    first event is a departure, or it has none) to its next departure (``inf`` if none). A
    join while it runs, or a departure while it is gone, changes nothing."""
    mine = sorted((e.time, e.kind) for e in events if e.node == node)
    found: list[tuple[float, float]] = []
    start: float | None = -math.inf if not mine or mine[0][1] == "departure" else None
    for time, kind in mine:
        if kind == "join" and start is None:
            start = time
        elif kind == "departure" and start is not None:
            found.append((start, time))
            start = None
    if start is not None:
        found.append((start, math.inf))
    return found


def dips(evaluations: Mapping[str, Sequence[tuple[float, float]]],
         events: Sequence[ChurnEvent]) -> list[Dip]:
    """The dip of every node that ran across each event.

    A node ran across an event when it is not the event's subject, one of its
    :func:`lives` began before the event and ends after it, and in that life it has at
    least ``MIN_LEVEL_EVALS`` evaluations before the event and one after.

    Args:
        evaluations: per node, ``(time, accuracy)`` in time order, accuracy in [0, 1].
        events: the joins and departures.
    Returns:
        One :class:`Dip` per (event, node that ran across it), in the events' order.
    """
    spans = {node: lives(node, events) for node in evaluations}
    found = []
    for event in events:
        for node, series in evaluations.items():
            if node == event.node:
                continue
            for start, end in spans[node]:
                if start < event.time < end:
                    before = [v for t, v in series if start < t < event.time][-LEVEL_EVALS:]
                    after = [v for t, v in series if event.time < t < end]
                    if len(before) >= MIN_LEVEL_EVALS and after:
                        found.append(Dip(event, node, sum(before) / len(before), min(after)))
    return found


def worst_dip_points(found: Sequence[Dip]) -> float:
    """The largest dip in points, 0 when there is none."""
    return max((d.points for d in found), default=0.0)
