"""The churn figures on small tables: each node's lives, its level before an event, its dip
after, and ``worst_dip_points`` (pure, no daemons). ``gossipd demo``'s summary of them is
tests/unit/test_demo.py, and bench/efficiency.py's reading of its runs into them
tests/unit/test_bench_dips.py."""

from __future__ import annotations

import pytest

import math

from daemon.churn import ChurnEvent, dips, lives, worst_dip_points

LEAVES = ChurnEvent("departure", "b", 10.0)
JOINS = ChurnEvent("join", "c", 20.0)


def series(*points: tuple[float, float]) -> list[tuple[float, float]]:
    return list(points)


def test_a_dip_is_the_lowest_after_below_the_mean_of_the_last_three_before() -> None:
    # a's 0.50 is older than its last three, so the level is (0.90 + 0.92 + 0.94) / 3 = 0.92;
    # its lowest after the departure is 0.85, and it recovers: 7 points.
    a = series((2, 0.50), (4, 0.90), (6, 0.92), (8, 0.94), (12, 0.85), (14, 0.95))
    found = dips({"a": a}, [LEAVES])
    assert [(d.node, d.event) for d in found] == [("a", LEAVES)]
    assert found[0].level == pytest.approx(0.92)
    assert found[0].lowest == 0.85
    assert worst_dip_points(found) == pytest.approx(7.0)


def test_no_fall_is_zero_points_and_no_dips_is_zero() -> None:
    rising = series((6, 0.80), (8, 0.82), (12, 0.90))
    assert [d.points for d in dips({"a": rising}, [LEAVES])] == [0.0]
    assert worst_dip_points([]) == 0.0


def test_the_event_s_own_node_is_not_counted() -> None:
    # b's final evaluation, written as it stops after its SIGTERM, and c's first ones, after
    # its download, are not dips of theirs.
    b = series((6, 0.90), (8, 0.90), (10.5, 0.10))
    c = series((21, 0.10), (23, 0.90))
    assert dips({"b": b}, [LEAVES]) == []
    assert dips({"c": c}, [JOINS]) == []


def test_a_node_counts_only_while_it_runs() -> None:
    # b left at 10: it did not run across the join at 20 (its last evaluation, at 10.5, is
    # after it left). For an earlier join, its evaluations after its own departure are not
    # a running node's.
    b = series((6, 0.90), (8, 0.90), (10.5, 0.10))
    assert dips({"b": b}, [LEAVES, JOINS]) == []
    b_after_a_join = series((6, 0.90), (8, 0.90), (9.5, 0.85), (10.5, 0.10))
    early_join = ChurnEvent("join", "c", 9.0)
    (dip,) = dips({"b": b_after_a_join}, [early_join, LEAVES])
    assert dip.event == early_join and dip.points == pytest.approx(5.0)  # not 80


def test_a_node_without_a_level_before_the_event_is_not_counted() -> None:
    one_before = series((8, 0.90), (12, 0.10))
    assert dips({"a": one_before}, [LEAVES]) == []
    two_before = series((6, 0.90), (8, 0.80), (12, 0.70))
    assert [round(d.points, 6) for d in dips({"a": two_before}, [LEAVES])] == [15.0]


def test_the_worst_dip_is_over_every_event_and_node() -> None:
    a = series((6, 0.90), (8, 0.90), (9, 0.90), (12, 0.88), (18, 0.89), (19, 0.90), (22, 0.86))
    d = series((6, 0.80), (8, 0.80), (9, 0.80), (12, 0.80), (18, 0.80), (19, 0.80), (22, 0.75))
    found = dips({"a": a, "d": d}, [LEAVES, JOINS])
    assert {(x.event.kind, x.node): round(x.points, 6) for x in found} == {
        ("departure", "a"): 4.0, ("departure", "d"): 5.0,
        ("join", "a"): 3.0, ("join", "d"): 5.0}
    assert worst_dip_points(found) == pytest.approx(5.0)


def test_a_node_lives_from_each_join_to_its_next_departure() -> None:
    crash, back, gone = (ChurnEvent("departure", "b", 10.0), ChurnEvent("join", "b", 15.0),
                         ChurnEvent("departure", "b", 30.0))
    assert lives("a", [crash, back]) == [(-math.inf, math.inf)]  # no event of its own
    assert lives("b", [crash, back, gone]) == [(-math.inf, 10.0), (15.0, 30.0)]
    assert lives("b", [back, gone]) == [(15.0, 30.0)]  # a joiner: nothing before its join
    # In time order, whatever the list's; a join while it runs changes nothing.
    assert lives("b", [gone, back, back, crash]) == [(-math.inf, 10.0), (15.0, 30.0)]


def test_a_node_that_came_back_is_measured_in_its_new_life_only() -> None:
    # b crashes at 10 and is back at 15. Its evaluations in between (a model nobody trains)
    # count for no one; at a's join at 22 its level is that of its new life, (0.60 + 0.70) / 2,
    # not its 0.95s before the crash; and its own return is no dip of its own.
    crash, back = ChurnEvent("departure", "b", 10.0), ChurnEvent("join", "b", 15.0)
    joins = ChurnEvent("join", "c", 22.0)
    b = series((6, 0.95), (8, 0.95), (12, 0.10), (16, 0.60), (20, 0.70), (24, 0.50))
    found = dips({"b": b}, [crash, back, joins])
    assert [(d.event, d.node) for d in found] == [(joins, "b")]
    assert found[0].level == pytest.approx(0.65) and found[0].lowest == 0.50


def test_the_window_runs_to_the_end_of_the_life_not_to_the_next_event() -> None:
    # The departure at 10 and the join at 11: a's fall begins after the first and is lowest
    # after the second. Counted from the level before the departure, it is 15 points; cut at
    # the join, it would be 5 from the departure and 13 from a level the fall had lowered.
    leaves, joins = ChurnEvent("departure", "b", 10.0), ChurnEvent("join", "c", 11.0)
    a = series((6, 0.90), (8, 0.90), (9, 0.90), (10.5, 0.85), (11.5, 0.75), (13, 0.80))
    assert worst_dip_points(dips({"a": a}, [leaves, joins])) == pytest.approx(15.0)
