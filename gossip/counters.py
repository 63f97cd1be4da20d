"""A replica's counters, read together, and the lead that bounds how far exchanges move its
step (:mod:`gossip.replica` keeps both; :mod:`gossip.standing` says where a step moves).

The lead: moves up add to a step at most :data:`~gossip.standing.MOVE_SLACK` in all, earned
back at :data:`~gossip.standing.LEAD_RATE` per optimizer step of the node's own, never more
than ``MOVE_SLACK`` saved. Counted over hosts, the swarm's median holds a step only while
under half of the hosts lie; with half or more, each commit with a liar could double the
step, and four liars against four honest nodes took every honest step to 2^53 − 1 within 400
steps (tests/sim/test_step_holds.py). With the lead, whoever holds the median, a step runs at
most ``MOVE_SLACK`` plus ``1 + LEAD_RATE`` times the node's own pace, and a node four times
slower than the swarm's median still keeps up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .standing import LEAD_RATE, MOVE_SLACK

__all__ = ["Counters", "Lead"]


@dataclass(frozen=True)
class Counters:
    """A replica's counters, read together. ``debt`` and ``local`` are this process's (not
    checkpointed): the steps still to take without counting, and the optimizer steps taken."""

    step: int
    samples: int
    weight: float
    debt: int = field(default=0, compare=False)
    local: int = field(default=0, compare=False)

    @property
    def heading(self) -> int:
        """Where the step is headed: ``step`` less the debt still to pay."""
        return self.step - self.debt


class Lead:
    """What moves up may still add to a step: ``MOVE_SLACK`` at the start, spent by moves up,
    earned back at ``LEAD_RATE`` per optimizer step (this process's: a restart starts full).
    Not thread-safe: the replica's lock guards it."""

    def __init__(self) -> None:
        self.left = MOVE_SLACK

    def earn(self, steps: int) -> None:
        """``steps`` optimizer steps were taken."""
        self.left = min(self.left + LEAD_RATE * steps, MOVE_SLACK)

    def spend(self, up: int) -> int:
        """How much of a move up by ``up`` (past any debt) the step may take, taken off."""
        up = min(up, self.left)
        self.left -= up
        return up
