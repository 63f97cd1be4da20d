"""``gossipd demo``'s churn figures without daemons: the dip helper on small tables, and the
summary and JSON line read from metrics logs like the daemons' (one departure, one join).
The full demo, with real daemons, is tests/e2e/test_demo.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from daemon import demo
from daemon.demo import ChurnEvent, dips, worst_dip_points

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


# ---- the summary and the JSON line, from metrics logs ---------------------------------


def write_log(directory: Path, records: list[dict[str, Any]]) -> None:
    """A node's metrics.jsonl, one JSON object a line with ``time`` and ``event``, as
    :class:`daemon.metrics.MetricsLog` writes it (here at chosen times)."""
    directory.mkdir()
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def evals(*points: tuple[float, float]) -> list[dict[str, Any]]:
    return [{"event": "eval", "time": t, "step": int(t * 100), "accuracy": a, "loss": 1 - a}
            for t, a in points]


def test_the_summary_and_json_line_report_the_churn_and_its_worst_dip(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    t0 = 1000.0
    logs = {
        "node0": [{"event": "start", "time": t0, "peer": "p0"},
                  *evals((t0, 0.50), (t0 + 4, 0.90), (t0 + 6, 0.92), (t0 + 8, 0.94),
                         (t0 + 12, 0.91), (t0 + 16, 0.93), (t0 + 22, 0.88), (t0 + 24, 0.95))],
        "node1": [{"event": "start", "time": t0 + 1, "peer": "p1"},
                  {"event": "download", "time": t0 + 1, "peer": "p0", "step": 0},
                  *evals((t0 + 4, 0.90), (t0 + 8, 0.93), (t0 + 10.5, 0.94))],
        "node2": [{"event": "start", "time": t0 + 17, "peer": "p2"},
                  {"event": "download", "time": t0 + 18, "peer": "p0", "step": 1700},
                  *evals((t0 + 20, 0.90), (t0 + 24, 0.96))],
    }
    nodes = [demo._Node(i, tmp_path / f"node{i}", i) for i in range(3)]
    for node in nodes:
        write_log(node.directory, logs[node.name])
        node.poll()
    churn = demo._Churn(nodes[1], nodes[2])
    nodes[1].left = t0 + 10

    code = demo._report(nodes, [0, 0, 0], tmp_path, None, churn, wall=30.0)

    out = capsys.readouterr().out.splitlines()
    figures = json.loads(out[-1])  # the last line, as a script reads it
    assert code == 0 and figures["exit"] == 0
    assert (figures["departed"], figures["departed_at_s"]) == ("node1", 10.0)
    assert (figures["joined"], figures["joined_at_s"]) == ("node2", 18.0)  # its download
    assert figures["joiner_downloaded_from"] == "node0"
    assert figures["nodes"]["node2"]["source"] == "download"
    # node0's level before the departure is (0.90 + 0.92 + 0.94) / 3 = 0.92, lowest after
    # 0.88: 4 points; before the join (0.94 + 0.91 + 0.93) / 3 = 0.9267: 4.67 points.
    assert figures["dips_points"] == {"departure": 4.0, "join": 4.67}
    assert figures["worst_dip_points"] == 4.67
    assert any(line.startswith("at  10.0 s node1 leaves") and "4.0 points (node0)" in line
               for line in out)
    assert any(line.startswith("at  18.0 s node2 joins (downloaded from node0") for line in out)
    assert "worst_dip_points: 4.7" in "\n".join(out)
    node1_row = next(line for line in out if line.startswith("node1 "))
    assert node1_row.endswith("(left at 10 s)")
