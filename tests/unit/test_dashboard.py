"""The Grafana dashboard under deploy/grafana: it parses, every panel queries the Prometheus
data source picked in ``datasource`` and follows ``instance``, and every PromQL expression
names only series the daemon exports (read from :meth:`daemon.metrics.Metrics.series`), so a
renamed metric cannot leave a panel silently empty."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from daemon.metrics import Metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "gossipd.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
# PromQL words that look like names but are not: aggregation modifiers, set operators
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
            "unless", "offset"}


def metric_names(expr: str) -> set[str]:
    """The series an expression selects: identifiers outside label matchers (``{...}``),
    range selectors (``[...]``) and grouping lists (``by (...)``), not called as functions,
    not Grafana variables (``$__rate_interval``) nor numbers."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values may hold anything
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"\$\w+", " ", expr)
    names = set()
    for match in re.finditer(r"(?<![\w.])([A-Za-z_:][\w:]*)(\s*\()?", expr):
        if not match.group(2) and match.group(1) not in KEYWORDS:
            names.add(match.group(1))
    return names


def exported(name: str, series: set[str]) -> bool:
    if name in series:
        return True
    return any(name.endswith(s) and name[:-len(s)] in series for s in HISTOGRAM_SUFFIXES)


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def test_the_parser_finds_metric_names_and_nothing_else() -> None:
    assert metric_names('histogram_quantile(0.9, sum by (le) (rate(a_bucket{instance=~"$i", '
                        'x="rate(b)"}[$__rate_interval])))') == {"a_bucket"}
    assert metric_names("sum(rate(a_sum[5m])) / sum(rate(a_count[5m])) * 60") == \
        {"a_sum", "a_count"}
    assert metric_names('a{x="1"} and on (instance) b offset 5m') == {"a", "b"}
    assert exported("gossip_exchange_duration_seconds_bucket", {"gossip_exchange_duration_seconds"})
    assert not exported("gossip_exchanges_bucket", {"gossip_exchanges_total"})


def test_every_expression_names_only_series_the_daemon_exports(
        dashboard: dict[str, Any]) -> None:
    series = Metrics().series()
    used = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            names = metric_names(target["expr"])
            assert names, (panel["title"], target["expr"])
            unknown = {n for n in names if not exported(n, series)}
            assert not unknown, (panel["title"], unknown)
            used |= names
    # the instance variable's query too
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            (name,) = re.findall(r"label_values\((\w+),", variable["query"]["query"])
            assert exported(name, series), variable["name"]
    # the panels the operator's guide promises are there
    for name in ("gossip_loss", "gossip_samples_per_second", "gossip_exchanges_total",
                 "gossip_peers", "gossip_exchange_duration_seconds_bucket",
                 "gossip_averaging_bytes_total", "gossip_quarantined_peers"):
        assert name in used, name


def test_every_panel_has_a_target_on_the_picked_data_source_and_instances(
        dashboard: dict[str, Any]) -> None:
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        assert panel["datasource"] == DATASOURCE, panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            assert target["datasource"] == DATASOURCE, panel["title"]
            # every selector follows the instance variable
            selectors = re.findall(r"gossip_\w+(\{[^}]*\})?", expr)
            assert all('instance=~"$instance"' in s for s in selectors), (panel["title"], expr)
            for left, right in ("()", "[]", "{}"):
                assert expr.count(left) == expr.count(right), (panel["title"], expr)


def test_the_variables_are_a_prometheus_data_source_and_its_instances(
        dashboard: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert set(variables) == {"datasource", "instance"}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    instance = variables["instance"]
    assert instance["datasource"] == DATASOURCE
    assert instance["multi"] and instance["includeAll"]
    assert dashboard["uid"] and dashboard["schemaVersion"] >= 36  # Grafana 9 and later
