"""Tests for daemon.status: each peer's freshest step, from its announcements or from what it
told this node in an exchange or a download, whichever is newer, with its age."""

from __future__ import annotations

from gossip.identity import PeerId
from gossip.member import Member, State

from daemon.status import StepReports

A, B = PeerId("a" * 26), PeerId("b" * 26)


def member(peer: PeerId, step: int, heard: float) -> Member:
    """A member whose latest announcement (at ``step``) reached us at ``heard``."""
    return Member(peer, "10.0.0.1:7070", 1, State.ALIVE, 1, step, True, 0.0, heard)


def test_an_announcement_alone_is_its_step_and_age() -> None:
    assert StepReports().of(member(A, 0, heard=10.0), now=42.5) == {"step": 0, "step_age_s": 32.5}


def test_an_exchange_after_the_announcement_is_fresher() -> None:
    # The case: announced at step 0, then its state downloaded at step 4,357.
    steps = StepReports()
    steps.heard(A, 4357, now=20.0)
    assert steps.of(member(A, 0, heard=10.0), now=21.0) == {"step": 4357, "step_age_s": 1.0}


def test_a_newer_announcement_wins_even_with_a_lower_step() -> None:
    # Newer, not higher: a peer that restarted from an older checkpoint has gone back.
    steps = StepReports()
    steps.heard(A, 900, now=20.0)
    assert steps.of(member(A, 300, heard=25.0), now=25.0) == {"step": 300, "step_age_s": 0.0}


def test_each_peer_is_its_own() -> None:
    steps = StepReports()
    steps.heard(A, 7, now=5.0)
    assert steps.of(member(B, 3, heard=1.0), now=5.0)["step"] == 3


def test_keep_forgets_peers_that_left_the_roster() -> None:
    steps = StepReports()
    steps.heard(A, 7, now=5.0)
    steps.heard(B, 8, now=5.0)
    steps.keep([B])
    assert steps.of(member(A, 1, heard=0.0), now=6.0)["step"] == 1  # forgotten
    assert steps.of(member(B, 1, heard=0.0), now=6.0)["step"] == 8
