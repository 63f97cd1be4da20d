"""The churn figures on small tables: each node's lives, its level before an event, its low
after (the lowest mean of three consecutive evaluations), its dip, ``worst_dip_points`` and
who is still short of a window (pure, no daemons). ``gossipd demo``'s summary of them is
tests/unit/test_demo.py, and bench/efficiency.py's reading of its runs into them
tests/unit/test_bench_dips.py."""

from __future__ import annotations

import pytest

import math

from daemon.churn import (ChurnEvent, dips, lives, lowest_mean, short_of_a_window,
                          worst_dip_points)

LEAVES = ChurnEvent("departure", "b", 10.0)
JOINS = ChurnEvent("join", "c", 20.0)


def series(*points: tuple[float, float]) -> list[tuple[float, float]]:
    return list(points)


def test_a_dip_is_the_lowest_three_after_below_the_mean_of_the_last_three_before() -> None:
    # a's 0.50 is older than its last three, so the level is (0.90 + 0.92 + 0.94) / 3 = 0.92;
    # after the departure its lowest three in a row are (0.85 + 0.86 + 0.90) / 3 = 0.87, and
    # it recovers: 5 points.
    a = series((2, 0.50), (4, 0.90), (6, 0.92), (8, 0.94), (12, 0.85), (13, 0.86), (14, 0.90),
               (16, 0.95))
    found = dips({"a": a}, [LEAVES])
    assert [(d.node, d.event) for d in found] == [("a", LEAVES)]
    assert found[0].level == pytest.approx(0.92)
    assert found[0].low == pytest.approx(0.87)
    assert worst_dip_points(found) == pytest.approx(5.0)


@pytest.mark.parametrize("after, points", [
    # One evaluation 15 points low between ones at the level counts a third of it...
    ((0.90, 0.75, 0.90, 0.90), 5.0),
    # ...a fall that lasts three evaluations in full...
    ((0.90, 0.75, 0.75, 0.75, 0.90), 15.0),
    # ...and a node whose evaluations alternate 2 points either side of its level, as one
    # on a shard of one or two classes swings between exchanges, dips 0.67, not 2.
    ((0.88, 0.92, 0.88, 0.92, 0.88), 2 / 3),
])
def test_a_low_is_a_mean_of_three_as_the_level_is(after: tuple[float, ...],
                                                   points: float) -> None:
    a = series((6, 0.90), (7, 0.90), (8, 0.90), *((11 + k, v) for k, v in enumerate(after)))
    assert worst_dip_points(dips({"a": a}, [LEAVES])) == pytest.approx(points)


def test_a_low_of_fewer_than_three_is_their_mean_and_of_fewer_than_two_none() -> None:
    assert lowest_mean([0.9, 0.8, 0.7, 0.9]) == pytest.approx(0.8)
    assert lowest_mean([0.8, 0.7]) == pytest.approx(0.75)
    assert lowest_mean([0.7]) is None and lowest_mean([]) is None
    # a has only two evaluations after the departure: one window, their mean, 5 points; with
    # one, no dip.
    two_after = series((6, 0.90), (7, 0.90), (8, 0.90), (12, 0.80), (14, 0.90))
    assert [round(d.points, 6) for d in dips({"a": two_after}, [LEAVES])] == [5.0]
    assert dips({"a": two_after[:-1]}, [LEAVES]) == []


def test_a_node_that_departs_one_evaluation_after_an_event_has_no_dip() -> None:
    # a departs at 13, one evaluation after b's departure at 10: its 0.50 at 12 is not a low;
    # one that departs at 15 has two: (0.50 + 0.60) / 2, 35 points.
    a = series((6, 0.90), (7, 0.90), (8, 0.90), (12, 0.50), (14, 0.60))
    assert dips({"a": a}, [LEAVES, ChurnEvent("departure", "a", 13.0)]) == []
    (dip,) = dips({"a": a}, [LEAVES, ChurnEvent("departure", "a", 15.0)])
    assert dip.event == LEAVES and dip.points == pytest.approx(35.0)


def test_no_fall_is_zero_points_and_no_dips_is_zero() -> None:
    rising = series((6, 0.80), (8, 0.82), (12, 0.90), (14, 0.91))
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
    b_after_a_join = series((6, 0.90), (8, 0.90), (9.2, 0.85), (9.6, 0.85), (10.5, 0.10))
    early_join = ChurnEvent("join", "c", 9.0)
    (dip,) = dips({"b": b_after_a_join}, [early_join, LEAVES])
    assert dip.event == early_join and dip.points == pytest.approx(5.0)  # not 80, nor 55


def test_a_node_without_a_level_before_the_event_is_not_counted() -> None:
    one_before = series((8, 0.90), (12, 0.10))
    assert dips({"a": one_before}, [LEAVES]) == []
    two_before = series((6, 0.90), (8, 0.80), (12, 0.70), (14, 0.70))
    assert [round(d.points, 6) for d in dips({"a": two_before}, [LEAVES])] == [15.0]


def test_the_worst_dip_is_over_every_event_and_node() -> None:
    times = (6, 8, 9, 12, 14, 16, 18, 19, 19.5, 22, 24, 26)
    a = series(*zip(times, (0.90,) * 3 + (0.86,) * 3 + (0.90,) * 3 + (0.87,) * 3))
    d = series(*zip(times, (0.80,) * 9 + (0.75,) * 3))
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
    # count for no one; at c's join at 22 its level is that of its new life, (0.60 + 0.70) / 2,
    # not its 0.95s before the crash; and its own return is no dip of its own.
    crash, back = ChurnEvent("departure", "b", 10.0), ChurnEvent("join", "b", 15.0)
    joins = ChurnEvent("join", "c", 22.0)
    b = series((6, 0.95), (8, 0.95), (12, 0.10), (16, 0.60), (20, 0.70), (24, 0.50), (26, 0.50))
    found = dips({"b": b}, [crash, back, joins])
    assert [(d.event, d.node) for d in found] == [(joins, "b")]
    assert found[0].level == pytest.approx(0.65) and found[0].low == pytest.approx(0.50)


def test_the_window_runs_to_the_end_of_the_life_not_to_the_next_event() -> None:
    # The departure at 10 and the join at 11: a's fall begins after the first and is lowest
    # after the second. Counted from the level before the departure, it is 15 points; cut at
    # the join, the departure would have one evaluation after it (no dip), and the join 13.3
    # points from a level the fall had begun to lower.
    leaves, joins = ChurnEvent("departure", "b", 10.0), ChurnEvent("join", "c", 11.0)
    a = series((6, 0.90), (8, 0.90), (9, 0.90), (10.5, 0.85), (11.5, 0.75), (12, 0.75),
               (13, 0.75), (14, 0.90))
    found = dips({"a": a}, [leaves, joins])
    assert [round(d.points, 2) for d in found] == [15.0, 13.33]


def test_short_of_a_window_names_the_running_nodes_with_fewer_than_three_after() -> None:
    # a, running, has a level before b's departure at 10 and two evaluations after it; c has
    # none before it; d departed at 13 with one (it will have no more); b is the subject.
    a = series((6, 0.90), (8, 0.90), (12, 0.90), (14, 0.90))
    c = series((12, 0.90), (14, 0.90))
    d = series((6, 0.90), (8, 0.90), (12, 0.90))
    b = series((6, 0.90), (8, 0.90))
    events = [LEAVES, ChurnEvent("departure", "d", 13.0)]
    assert short_of_a_window({"a": a, "b": b, "c": c, "d": d}, events) == ["a"]
    # Three after 10, and after d's departure at 13 too: (14, 16, 18).
    assert short_of_a_window({"a": [*a, (16, 0.90), (18, 0.90)], "c": c}, events) == []
    # A later event wants a window of its own: a's three after 10 are one after a join at 15.
    joins = ChurnEvent("join", "c", 15.0)
    assert short_of_a_window({"a": [*a, (16, 0.90)]}, [LEAVES, joins]) == ["a"]
