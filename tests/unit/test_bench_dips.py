"""bench/efficiency.py's churn dip: hand-made tables of per-node accuracy, known answers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The bench scripts import their ``common`` as scripts run from bench/ do; appended, not
# inserted, so that bench/'s modules shadow nothing the other tests import.
sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))

from efficiency import LEVEL_EVALS, worst_dip  # noqa: E402


def test_dip_is_level_minus_lowest_after_until_the_next_event() -> None:
    assert LEVEL_EVALS == 3
    per_node = [[10.0, 80.0, 90.0, 100.0, 85.0, 95.0, 70.0], [50.0] * 7]
    # Level before 4: mean(80, 90, 100) = 90 (the last 3 only); lowest after it: 70 -> 20.
    assert worst_dip(per_node, [(4, 1)]) == pytest.approx(20.0)
    # The window ends at the next event: lowest in [4, 6) is 85 -> 5; the 70 falls after an
    # event of node 0's own, which does not count for it.
    assert worst_dip(per_node, [(4, 1), (6, 0)]) == pytest.approx(5.0)
    # After an event of node 1's instead, the 70 counts, from the level before that one.
    assert worst_dip(per_node, [(4, 1), (6, 1)]) == pytest.approx(
        (100.0 + 85.0 + 95.0) / 3 - 70.0)


def test_the_events_node_is_excluded() -> None:
    # Node 1 crashes at 2: its own fall (to None, or its model's 0 while down) is no dip, and
    # its restart at 4 is its own event too; node 0 is steady across both.
    per_node = [[60.0, 60.0, 60.0, 60.0, 60.0, 60.0], [90.0, 90.0, None, None, 40.0, 40.0]]
    assert worst_dip(per_node, [(2, 1), (4, 1)]) == 0.0
    # The same table with the events credited to node 0 instead: node 1 is down across the
    # first (excluded), and across the second it was down just before (excluded).
    assert worst_dip(per_node, [(2, 0), (4, 0)]) == 0.0


def test_a_node_that_came_back_has_its_level_since_then() -> None:
    # Node 1 is back at 3 (its event); at 5 node 2's crash: node 1's level is the mean of
    # 3 and 4 only (fewer than LEVEL_EVALS since it came up), not its pre-crash 99s.
    per_node = [[70.0] * 7,
                [99.0, 99.0, None, 60.0, 62.0, 55.0, 58.0],
                [70.0, 70.0, 70.0, 70.0, 70.0, None, None]]
    assert worst_dip(per_node, [(2, 1), (3, 1), (5, 2)]) == pytest.approx(61.0 - 55.0)


def test_empty_windows_and_rises_count_nothing() -> None:
    per_node = [[50.0, 60.0, 70.0], [50.0, 50.0, 50.0]]
    assert worst_dip(per_node, [(3, 1)]) == 0.0  # no evaluation after it
    assert worst_dip(per_node, [(0, 1)]) == 0.0  # none before it
    assert worst_dip(per_node, [(2, 1)]) == 0.0  # node 0 rose: floored at 0
    assert worst_dip(per_node, []) == 0.0
    assert worst_dip([], [(1, 0)]) == 0.0
