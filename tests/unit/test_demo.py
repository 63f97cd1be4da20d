"""``gossipd demo``'s churn figures without daemons: the summary and JSON line read from
metrics logs like the daemons' (one departure, one join). The dip helper on small tables is
tests/unit/test_churn.py; the full demo, with real daemons, is tests/e2e/test_demo.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from daemon import demo

T0 = 1000.0  # the Unix time of node0's start


def write_log(directory: Path, records: list[dict[str, Any]]) -> None:
    """A node's metrics.jsonl, one JSON object a line with ``time`` and ``event``, as
    :class:`daemon.metrics.MetricsLog` writes it (here at chosen times)."""
    directory.mkdir()
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def churned(tmp_path: Path, logs: dict[str, list[dict[str, Any]]]
            ) -> tuple[list[demo._Node], demo._Churn]:
    """node0 to node2 with these metrics logs read: node1 departed at ``T0 + 10`` and node2
    joins in its place."""
    nodes = [demo._Node(i, tmp_path / f"node{i}", i) for i in range(3)]
    for node in nodes:
        write_log(node.directory, logs[node.name])
        node.poll()
    nodes[1].left = T0 + 10
    return nodes, demo._Churn(nodes[1], nodes[2])


def evals(*points: tuple[float, float]) -> list[dict[str, Any]]:
    return [{"event": "eval", "time": t, "step": int(t * 100), "accuracy": a, "loss": 1 - a}
            for t, a in points]


def test_the_summary_and_json_line_report_the_churn_and_its_worst_dip(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logs = {
        "node0": [{"event": "start", "time": T0, "peer": "p0"},
                  *evals((T0, 0.50), (T0 + 4, 0.90), (T0 + 6, 0.92), (T0 + 8, 0.94),
                         (T0 + 12, 0.91), (T0 + 16, 0.93), (T0 + 22, 0.88), (T0 + 24, 0.95))],
        "node1": [{"event": "start", "time": T0 + 1, "peer": "p1"},
                  {"event": "download", "time": T0 + 1, "peer": "p0", "step": 0},
                  *evals((T0 + 4, 0.90), (T0 + 8, 0.93), (T0 + 10.5, 0.94))],
        "node2": [{"event": "start", "time": T0 + 17, "peer": "p2"},
                  {"event": "download", "time": T0 + 18, "peer": "p0", "step": 1700},
                  *evals((T0 + 20, 0.90), (T0 + 24, 0.96))],
    }
    nodes, churn = churned(tmp_path, logs)

    code = demo._report(nodes, [0, 0, 0], tmp_path, None, churn, wall=30.0)

    out = capsys.readouterr().out.splitlines()
    figures = json.loads(out[-1])  # the last line, as a script reads it
    assert code == 0 and figures["exit"] == 0
    assert (figures["departed"], figures["departed_at_s"]) == ("node1", 10.0)
    assert (figures["joined"], figures["joined_at_s"]) == ("node2", 18.0)  # its download
    assert figures["joiner_downloaded_from"] == "node0"
    assert figures["nodes"]["node2"]["source"] == "download"
    # node0's level before the departure is (0.90 + 0.92 + 0.94) / 3 = 0.92, its lowest three
    # after (0.91 + 0.93 + 0.88) / 3 = 0.9067: 1.33 points; before the join
    # (0.94 + 0.91 + 0.93) / 3 = 0.9267, and it has two after, (0.88 + 0.95) / 2: 1.17 points.
    assert figures["dips_points"] == {"departure": 1.33, "join": 1.17}
    assert figures["worst_dip_points"] == 1.33
    assert any(line.startswith("at  10.0 s node1 leaves") and "1.3 points (node0)" in line
               for line in out)
    assert any(line.startswith("at  18.0 s node2 joins (downloaded from node0") for line in out)
    assert "worst_dip_points: 1.3" in "\n".join(out)
    node1_row = next(line for line in out if line.startswith("node1 "))
    assert node1_row.endswith("(left at 10 s)")


def test_the_demo_ends_once_every_node_across_the_join_has_a_window_after_it(
        tmp_path: Path) -> None:
    # node1 departed at 10 and node2 joined at 18 (its download): node0 has two evaluations
    # since, one short of a window; the leaver and the joiner are waited for by no one.
    node0 = evals((T0 + 4, 0.90), (T0 + 6, 0.92), (T0 + 8, 0.94), (T0 + 20, 0.90),
                  (T0 + 22, 0.91))
    logs = {"node0": node0,
            "node1": evals((T0 + 4, 0.90), (T0 + 8, 0.93)),
            "node2": [{"event": "download", "time": T0 + 18, "peer": "p0", "step": 1700},
                      *evals((T0 + 20, 0.90), (T0 + 22, 0.96))]}
    nodes, churn = churned(tmp_path, logs)
    assert churn.short_of_a_window(nodes) == ["node0"]
    with (nodes[0].directory / "metrics.jsonl").open("a") as log:
        log.write(json.dumps(evals((T0 + 24, 0.92))[0]) + "\n")
    nodes[0].poll()
    assert churn.short_of_a_window(nodes) == []
