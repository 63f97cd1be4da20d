"""What ``gossipd status`` says of each peer's step: the freshest word of it, and its age.

Theory of operation
-------------------
A member's step in the roster (:attr:`gossip.Member.step`) is the one it last *announced*.
A node re-announces a changed step at most every ``membership.meta_interval`` seconds (30 by
default: each announcement is gossiped to every member), so a peer that trains thousands of
steps a second is listed thousands of steps behind: a joiner saw its donor listed at step 0
just after downloading that donor's state at step 4,357. Yet every exchange tells the peer's
step, both ways (its ``Offer`` or ``Accept``: :attr:`gossip.Exchange.step`), and a download
tells the donor's. :class:`PeerSteps` keeps the latest of these per peer, and
:meth:`PeerSteps.of` answers with whichever is newer, that or the announcement, with its
age. A peer this node never exchanges with is as fresh as its announcements.

Newer wins, not higher: a peer that restarts from an older checkpoint goes back, and its
next word says so. Times are ``trio.current_time()``, the clock of
:attr:`gossip.Member.heard`. Memory: one entry per member of the roster (:meth:`PeerSteps.keep`
drops the others).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import gossip

__all__ = ["PeerSteps"]


class PeerSteps:
    """The step each peer last told this node outside membership, and when."""

    def __init__(self) -> None:
        self._told: dict[str, tuple[int, float]] = {}  # peer id -> (step, trio time)

    def heard(self, peer: str, step: int, now: float) -> None:
        """``peer`` said at ``now`` that it is at ``step`` (in an exchange or a download)."""
        self._told[str(peer)] = (step, now)

    def of(self, member: gossip.Member, now: float) -> dict[str, Any]:
        """``member``'s freshest step, as ``{"step": int, "step_age_s": float}``: seconds
        since this node heard it, from the member or from its announcement."""
        step, heard = member.step, member.heard
        told = self._told.get(str(member.peer))
        if told is not None and told[1] > heard:
            step, heard = told
        return {"step": step, "step_age_s": round(max(0.0, now - heard), 1)}

    def keep(self, peers: Iterable[str]) -> None:
        """Forget every peer but ``peers`` (the roster's members)."""
        members = {str(p) for p in peers}
        for peer in [p for p in self._told if p not in members]:
            del self._told[peer]
