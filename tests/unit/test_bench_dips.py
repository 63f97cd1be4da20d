"""bench/efficiency.py's churn dip: how it reads a run (per node, its accuracy in percent at
each evaluation, None while down; each crash and restart between two evaluations) into
daemon.churn's evaluations and events. The dip itself is daemon.churn's, tested on its own
tables in tests/unit/test_churn.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The bench scripts import their ``common`` as scripts run from bench/ do; appended, not
# inserted, so that bench/'s modules shadow nothing the other tests import.
sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))

from efficiency import churn_events, worst_dip  # noqa: E402

from daemon.churn import ChurnEvent  # noqa: E402


def test_a_crash_is_a_departure_and_a_restart_a_join_between_two_evaluations() -> None:
    assert churn_events([(4, 1, "crash"), (7, 1, "restart")]) == [
        ChurnEvent("departure", "n1", 3.5), ChurnEvent("join", "n1", 6.5)]


def test_a_run_s_dip_is_daemon_churn_s_in_points() -> None:
    # Node 0 across node 1's crash after evaluation 3: its level is the mean of 3, 4 and 5
    # percent-points (80, 90, 100) = 90, its low after the lowest mean of three in a row,
    # (80 + 70 + 60) / 3 = 70, up to the end of the table.
    per_node = [[10.0, 80.0, 90.0, 100.0, 80.0, 70.0, 60.0, 95.0], [50.0] * 8]
    assert worst_dip(per_node, [(4, 1, "crash")]) == pytest.approx(20.0)
    # Node 0's own crash after evaluation 5 ends the window: (80 + 70) / 2 = 75.
    assert worst_dip(per_node, [(4, 1, "crash"), (6, 0, "crash")]) == pytest.approx(15.0)


def test_a_node_down_counts_from_its_restart_and_none_is_no_evaluation() -> None:
    # Node 1 is down for evaluations 2 and 3 (None) and back for 4: at node 2's crash after
    # evaluation 5 its level is that of 4 and 5 only (60, 62), not its 99s before.
    per_node = [[70.0] * 8,
                [99.0, 99.0, None, None, 60.0, 62.0, 55.0, 55.0],
                [70.0, 70.0, 70.0, 70.0, 70.0, 70.0, None, None]]
    schedule = [(2, 1, "crash"), (4, 1, "restart"), (6, 2, "crash")]
    assert worst_dip(per_node, schedule) == pytest.approx(61.0 - 55.0)
    assert worst_dip([[50.0, 60.0, 70.0]] * 2, []) == 0.0
