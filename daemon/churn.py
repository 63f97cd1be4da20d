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
evaluations of that life before the event, and its *low* the lowest mean of ``LEVEL_EVALS``
consecutive evaluations after the event, until that life ends (the mean of all of them when
it has fewer). Either needs ``MIN_LEVEL_EVALS`` evaluations: a node with fewer before the
event, or fewer after it before its life ends (it departed, or the record stops), has no dip
counted. Its *dip* is how far the low fell below the level, in points, and 0 when it did not
fall. :func:`worst_dip_points` is the largest dip of any node after any event.

Both sides are means of the same number of evaluations because one evaluation alone swings by
points from the next (in ``bench/efficiency.py``, 359 test images, and nodes that train on
one or two classes between exchanges), and the lowest of many single evaluations is far below
their mean even when nothing happened. The bench's control, this measure at the same
evaluations and events of its swarm where nothing crashed, in ten seeds to the budget: with
the low a single evaluation, 0.8 to 10.3 points (median 2.2), as much as the churn it was to
measure (0.6 to 12.0, median 2.8, on the churn runs of the same seeds); with the low a mean of
three, 0 to 2.5 (median 0.3), and the churn runs 0 to 1.7 (median 0). The floor is not 0: a
dip of 2 or 3 points in one seed is within what a swarm that lost no one shows. A fall that
lasts three evaluations is counted in full; one evaluation low between two that are not
counts a third: a node's 12 points at the second evaluation after a crash in the bench count
1.7, since the control has single evaluations as far below their neighbours (9 points), and
over those ten seeds the three evaluations after each event of the churn runs were on average
no more than 0.2 points lower than the control's at the same moments (7 nodes x 10 seeds).

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
from typing import Iterator, Literal, Mapping, Sequence

__all__ = ["LEVEL_EVALS", "MIN_LEVEL_EVALS", "ChurnEvent", "Dip", "dips", "lives",
           "lowest_mean", "short_of_a_window", "worst_dip_points"]

# A node's level before an event is the mean of its last LEVEL_EVALS evaluations, its low after
# it the lowest mean of LEVEL_EVALS consecutive ones (one alone swings by points between
# evaluations); with fewer than MIN_LEVEL_EVALS on either side, no dip is counted for it.
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
    low: float  # the lowest mean of LEVEL_EVALS consecutive evaluations after it, in that life

    @property
    def points(self) -> float:
        return max(0.0, 100 * (self.level - self.low))


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


def lowest_mean(after: Sequence[float]) -> float | None:
    """The lowest mean of ``LEVEL_EVALS`` consecutive values (of all of them when fewer);
    None with fewer than ``MIN_LEVEL_EVALS``."""
    if len(after) < MIN_LEVEL_EVALS:
        return None
    width = min(LEVEL_EVALS, len(after))
    return min(sum(after[i:i + width]) / width for i in range(len(after) - width + 1))


def _across(evaluations: Mapping[str, Sequence[tuple[float, float]]],
            events: Sequence[ChurnEvent]
            ) -> Iterator[tuple[ChurnEvent, str, float, list[float], float]]:
    """``(event, node, its level, its values after the event in that life, the life's end)``
    for each event and each node but its subject with a level before it, in the events'
    order."""
    spans = {node: lives(node, events) for node in evaluations}
    for event in events:
        for node, series in evaluations.items():
            if node == event.node:
                continue
            for start, end in spans[node]:
                if start < event.time < end:
                    before = [v for t, v in series if start < t < event.time][-LEVEL_EVALS:]
                    if len(before) >= MIN_LEVEL_EVALS:
                        after = [v for t, v in series if event.time < t < end]
                        yield event, node, sum(before) / len(before), after, end


def dips(evaluations: Mapping[str, Sequence[tuple[float, float]]],
         events: Sequence[ChurnEvent]) -> list[Dip]:
    """The dip of every node that ran across each event.

    A node ran across an event when it is not the event's subject, one of its
    :func:`lives` began before the event and ends after it, and in that life it has at
    least ``MIN_LEVEL_EVALS`` evaluations before the event and as many after.

    Args:
        evaluations: per node, ``(time, accuracy)`` in time order, accuracy in [0, 1].
        events: the joins and departures.
    Returns:
        One :class:`Dip` per (event, node that ran across it), in the events' order.
    """
    found = []
    for event, node, level, after, _ in _across(evaluations, events):
        lowest = lowest_mean(after)
        if lowest is not None:
            found.append(Dip(event, node, level, lowest))
    return found


def short_of_a_window(evaluations: Mapping[str, Sequence[tuple[float, float]]],
                      events: Sequence[ChurnEvent]) -> list[str]:
    """The nodes still running (no departure ends their life) with a level before an event
    and fewer than ``LEVEL_EVALS`` evaluations after it: a watcher that stops them now would
    measure their dip on a short window, or none. Sorted, each once."""
    return sorted({node for _, node, _, after, end in _across(evaluations, events)
                   if end == math.inf and len(after) < LEVEL_EVALS})


def worst_dip_points(found: Sequence[Dip]) -> float:
    """The largest dip in points, 0 when there is none."""
    return max((d.points for d in found), default=0.0)
