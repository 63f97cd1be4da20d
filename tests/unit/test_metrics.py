"""Tests for daemon.metrics: the Prometheus series each event moves (read back from the
instance's own registry), the samples/s window, sample() against real nodes on a simulated
network, the HTTP endpoint, and the JSON-lines log."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import threading
import urllib.request
from pathlib import Path

import prometheus_client
import pytest
import torch
import trio
import trio.testing
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from trio.testing import MockClock

import gossip
import gossip.lowlevel
from daemon import metrics as metrics_module
from daemon.metrics import RATE_WINDOW, Metrics, MetricsLog
from gossip.config import NodeConfig
from gossip.testing.simnet import SimNetwork
from tests.util import Signal

PEER = gossip.Identity.generate().peer_id
DAEMON_MD = Path(__file__).resolve().parents[2] / "docs" / "DAEMON.md"


def value(m: Metrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels or None)


def exchange(result: gossip.Result, duration: float = 0.3) -> gossip.Exchange:
    return gossip.Exchange(PEER, True, result, duration, 0.1 if result is gossip.Result.COMMITTED
                           else None)


# --- events ----------------------------------------------------------------------------------


def test_fresh_metrics_expose_zeroed_series() -> None:
    m = Metrics()
    assert value(m, "gossip_steps_total") == 0
    assert value(m, "gossip_samples_total") == 0
    assert value(m, "gossip_checkpoints_total") == 0
    # every result and direction is exported from the start, so rate() works from the first
    # scrape; no_peer is a round, not an exchange, and has its own counter
    for result in ("committed", "busy", "rejected", "invalid", "failed"):
        assert value(m, "gossip_exchanges_total", result=result) == 0
    assert value(m, "gossip_exchanges_total", result="no_peer") is None
    assert value(m, "gossip_rounds_without_peer_total") == 0
    for direction in ("sent", "received"):
        assert value(m, "gossip_averaging_bytes_total", direction=direction) == 0
    for limit in ("max_connections", "max_handshakes_per_host", "peer_rate"):
        assert value(m, "gossip_inbound_refused_total", limit=limit) == 0


def test_trained_counts_steps_samples_and_loss() -> None:
    m = Metrics()
    m.trained(10, 640, 2.5)
    m.trained(5, 320, 1.25)
    assert value(m, "gossip_steps_total") == 15
    assert value(m, "gossip_samples_total") == 960
    assert value(m, "gossip_loss") == 1.25


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_loss_keeps_the_last_finite_one(bad: float) -> None:
    m = Metrics()
    m.trained(1, 8, 0.5)
    m.trained(1, 8, bad)
    assert value(m, "gossip_loss") == 0.5
    assert value(m, "gossip_steps_total") == 2


def test_exchange_counts_by_result_and_times_only_committed_ones() -> None:
    m = Metrics()
    m.exchange(exchange(gossip.Result.COMMITTED, 0.3))
    m.exchange(exchange(gossip.Result.COMMITTED, 7.0))
    m.exchange(exchange(gossip.Result.FAILED, 50.0))
    m.exchange(exchange(gossip.Result.BUSY, 0.01))
    m.exchange(exchange(gossip.Result.INVALID, 1.0))
    m.exchange(exchange(gossip.Result.REJECTED, 1.0))
    assert value(m, "gossip_exchanges_total", result="committed") == 2
    assert value(m, "gossip_exchanges_total", result="failed") == 1
    assert value(m, "gossip_exchanges_total", result="busy") == 1
    assert value(m, "gossip_exchanges_total", result="invalid") == 1
    assert value(m, "gossip_exchanges_total", result="rejected") == 1
    assert value(m, "gossip_exchange_duration_seconds_count") == 2
    assert value(m, "gossip_exchange_duration_seconds_sum") == pytest.approx(7.3)
    assert value(m, "gossip_exchange_duration_seconds_bucket", le="0.5") == 1
    assert value(m, "gossip_exchange_duration_seconds_bucket", le="10.0") == 2


def test_checkpointed() -> None:
    m = Metrics()
    m.checkpointed(0.75)
    m.checkpointed(1.5)
    assert value(m, "gossip_checkpoints_total") == 2
    assert value(m, "gossip_checkpoint_duration_seconds") == 1.5
    assert value(m, "gossip_checkpoint_failures_total") == 0


def test_evaluated_sets_the_gauges_and_an_empty_evaluation_keeps_the_last() -> None:
    m = Metrics()
    m.evaluated({"accuracy": 0.5, "loss": 1.5})
    m.evaluated({})  # a task whose evaluate() returned nothing this time
    assert value(m, "gossip_eval", metric="accuracy") == 0.5
    assert value(m, "gossip_eval", metric="loss") == 1.5


def test_two_instances_do_not_collide() -> None:
    a, b = Metrics(), Metrics()  # the same names twice: no "Duplicated timeseries" error
    a.trained(3, 30, 1.0)
    b.exchange(exchange(gossip.Result.COMMITTED))
    assert value(a, "gossip_steps_total") == 3
    assert value(b, "gossip_steps_total") == 0
    assert value(a, "gossip_exchanges_total", result="committed") == 0
    assert value(b, "gossip_exchanges_total", result="committed") == 1


def test_samples_per_second_over_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(metrics_module.time, "monotonic", lambda: now[0])
    m = Metrics()
    assert m.samples_per_second() == 0.0
    m.trained(1, 100, 1.0)
    assert m.samples_per_second() == 0.0  # one chunk has no span
    now[0] += 1.0
    m.trained(1, 30, 1.0)
    now[0] += 1.0
    m.trained(1, 50, 1.0)
    # the first chunk only marks the start: 80 samples over 2 s
    assert m.samples_per_second() == pytest.approx(40.0)
    now[0] += RATE_WINDOW + 1
    m.trained(1, 10, 1.0)  # everything older than the window is dropped
    assert m.samples_per_second() == 0.0


# --- sample() against real nodes on a simulated network --------------------------------------

# Rounds only when the test asks; members trusted at once, so that both sides of an exchange
# apply it (the newcomer rule has tests of its own in test_averaging).
CONFIG = gossip.AveragingConfig(every=None, interval=None, trust_after=0.0)
# Node a starts the swarm on its host of the simulated network; node b joins it.
A = NodeConfig(listen="a:7000", averaging=CONFIG)
B = NodeConfig(listen="b:7000", bootstrap=("a:7000",), averaging=CONFIG)


async def test_sample_of_a_lone_node(autojump_clock: MockClock) -> None:
    net = SimNetwork(seed=1)
    m = Metrics()
    async with gossip.open_swarm(torch.nn.Linear(2, 2), gossip.Swarm.generate("t"), A,
                                 network=net.host("a")) as node:
        await node.wait_ready()
        node.replica.advance(4, 32)
        m.trained(4, 32, 0.5)
        assert await node.average_now() is gossip.Result.NO_PEER
        snap = m.sample(node)
    assert snap["step"] == 4
    assert snap["samples"] == 32
    assert snap["loss"] == 0.5
    assert snap["ready"] is True
    assert snap["peers"] == {"alive": 0, "suspect": 0, "dead": 0, "left": 0}
    assert snap["exchanges"]["no_peer"] == 1
    assert snap["exchanges"]["committed"] == 0
    assert snap["pending"] == 0
    json.dumps(snap)  # what the JSON-lines log and `gossipd status` send
    assert value(m, "gossip_step") == 4
    assert value(m, "gossip_rounds_without_peer_total") == 1
    assert value(m, "gossip_peers", state="alive") == 0
    assert value(m, "gossip_quarantined_peers") == 0


async def test_totals_sum_up_the_run_for_the_stop_event(autojump_clock: MockClock) -> None:
    net = SimNetwork(seed=1)
    m = Metrics()
    async with gossip.open_swarm(torch.nn.Linear(2, 2), gossip.Swarm.generate("t"), A,
                                 network=net.host("a"),
                                 counters=gossip.lowlevel.Counters(step=100, samples=800, weight=1.0)
                                 ) as node:
        await node.wait_ready()
        assert m.totals(node) == {"step": 100, "steps": 0, "samples": 0, "loss": None,
                                  "exchanges": dict.fromkeys(
                                      ("committed", "failed", "busy", "rejected", "invalid",
                                       "no_peer"), 0),
                                  "eval": None}
        node.replica.advance(6, 48)
        m.trained(4, 32, 0.75)
        m.trained(2, 16, math.nan)  # the loss is the last finite one
        m.evaluated({"accuracy": 0.875})
        assert await node.average_now() is gossip.Result.NO_PEER
    totals = m.totals(node)  # after the node has closed, as the daemon asks at its stop
    # steps and samples are this run's; step is the swarm's, the resumed checkpoint's included
    assert (totals["step"], totals["steps"], totals["samples"]) == (106, 6, 48)
    assert totals["loss"] == 0.75
    assert totals["exchanges"]["no_peer"] == 1 and totals["exchanges"]["committed"] == 0
    assert totals["eval"] == {"accuracy": 0.875}
    json.dumps(totals)


async def test_sample_counts_inbound_refusals_by_limit(autojump_clock: MockClock) -> None:
    net = SimNetwork(seed=1, latency=0.0)
    m = Metrics()
    limits = gossip.Limits(max_connections=2, max_handshakes_per_host=1)
    async with gossip.open_swarm(torch.nn.Linear(2, 2), gossip.Swarm.generate("t"),
                                 dataclasses.replace(A, limits=limits),
                                 network=net.host("a")) as node:
        for _ in range(limits.host_burst + 1):  # w over its host_rate: the last one refused
            last = await net.host("w").dial("a:7000")
            await last.aclose()
            await trio.testing.wait_all_tasks_blocked()
        first = await net.host("x").dial("a:7000")
        await net.host("x").dial("a:7000")  # x's second silent connection evicts its first
        assert await first.receive_some(1) == b""
        await trio.testing.wait_all_tasks_blocked()  # first's place is free again
        await net.host("y").dial("a:7000")  # the second place
        over = await net.host("z").dial("a:7000")  # over max_connections: refused
        assert await over.receive_some(1) == b""
        snap = m.sample(node)
        again = m.sample(node)  # a second sample adds nothing
    expected = {"max_connections": 1, "max_handshakes_per_host": 1, "host_rate": 1,
                "peer_rate": 0}
    assert snap["refused"] == again["refused"] == expected
    for limit, count in expected.items():
        assert value(m, "gossip_inbound_refused_total", limit=limit) == count


async def test_sample_counts_forged_membership_claims(autojump_clock: MockClock) -> None:
    from gossip.testing.hostile import HostilePeer

    net = SimNetwork(seed=1, latency=0.0)
    m = Metrics()
    swarm = gossip.Swarm.generate("t")
    async with gossip.open_swarm(torch.nn.Linear(2, 2), swarm, A,
                                 network=net.host("a")) as node:
        # A key holder says the node itself left, at the largest incarnation: it cannot sign
        # that as the node, so it is refused (and counted), not refuted.
        hostile = HostilePeer(swarm, torch.nn.Linear(2, 2), network=net.host("x"))
        endpoint = await net.host("x").open_datagram("x:0")
        await endpoint.send(hostile.datagram((hostile.forged_left(node.peer_id),)), "a:7000")
        await trio.testing.wait_all_tasks_blocked()
        snap = m.sample(node)
        again = m.sample(node)
        assert node.roster.statistics().refutations == 0
    assert snap["claims_refused"] == again["claims_refused"] == 1
    assert value(m, "gossip_membership_claims_refused_total") == 1


async def test_sample_loss_is_none_before_any_finite_loss(autojump_clock: MockClock) -> None:
    net = SimNetwork(seed=1)
    m = Metrics()
    async with gossip.open_swarm(torch.nn.Linear(2, 2), gossip.Swarm.generate("t"), A,
                                 network=net.host("a")) as node:
        m.trained(1, 1, math.nan)
        assert m.sample(node)["loss"] is None


async def test_sample_after_an_exchange(autojump_clock: MockClock) -> None:
    net = SimNetwork(seed=2)
    swarm = gossip.Swarm.generate("t")
    ma, mb = Metrics(), Metrics()
    told = Signal()

    def on_exchange_a(e: gossip.Exchange) -> None:
        ma.exchange(e)
        told.fire()

    torch.manual_seed(0)
    async with gossip.open_swarm(torch.nn.Linear(2, 2), swarm, A, network=net.host("a"),
                                 on_exchange=on_exchange_a) as a:
        async with gossip.open_swarm(torch.nn.Linear(2, 2), swarm, B, network=net.host("b"),
                                     on_exchange=mb.exchange) as b:
            await b.wait_ready()
            assert await b.average_now() is gossip.Result.COMMITTED
            await told.wait_until(
                lambda: value(ma, "gossip_exchanges_total", result="committed") == 1)
            sa, sb = ma.sample(a), mb.sample(b)
            # a second sample adds only what changed since the first: nothing
            sa2 = ma.sample(a)

    assert value(mb, "gossip_exchanges_total", result="committed") == 1
    assert value(mb, "gossip_exchange_duration_seconds_count") == 1
    for m, snap in ((ma, sa), (mb, sb)):
        assert snap["exchanges"]["committed"] == 1
        assert snap["peers"]["alive"] == 1
        assert snap["pending"] == 1  # nobody trains here, so the delta is still queued
        assert snap["bytes"]["sent"] > 0 and snap["bytes"]["received"] > 0
        assert value(m, "gossip_peers", state="alive") == 1
        assert value(m, "gossip_pending_deltas") == 1
    # what one side sent the other received, and the counters agree with the snapshots
    assert sa["bytes"]["sent"] == sb["bytes"]["received"]
    assert sa2["bytes"] == sa["bytes"]
    assert value(ma, "gossip_averaging_bytes_total", direction="sent") == sa["bytes"]["sent"]
    assert value(ma, "gossip_averaging_bytes_total", direction="received") == \
        sa["bytes"]["received"]
    assert value(mb, "gossip_averaging_bytes_total", direction="sent") == sb["bytes"]["sent"]


# --- the HTTP endpoint -----------------------------------------------------------------------


def test_serve_on_port_0_exposes_the_registry_until_shutdown() -> None:
    m = Metrics()
    m.trained(7, 70, 0.25)
    before = set(threading.enumerate())
    server = m.serve("127.0.0.1:0")
    (thread,) = set(threading.enumerate()) - before  # prometheus_client's serving thread
    try:
        host, port = server.server_address[:2]
        assert host == "127.0.0.1" and port != 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            assert reply.status == 200
            body = reply.read().decode()
    finally:
        server.shutdown()  # returns once serve_forever has (up to its 0.5 s poll interval)
        server.server_close()
    thread.join(10)
    assert not thread.is_alive()
    assert "gossip_steps_total 7.0" in body
    assert "gossip_exchange_duration_seconds_bucket" in body
    assert 'gossip_exchanges_total{result="committed"} 0.0' in body
    assert "_created" not in body


def test_no_created_series_in_any_exposition_and_no_global_switch() -> None:
    other = prometheus_client.CollectorRegistry()  # a registry of the program's own
    prometheus_client.Counter("other", "a counter", registry=other)
    before = prometheus_client.generate_latest(other)
    m = Metrics()
    m.exchange(exchange(gossip.Result.COMMITTED))
    text = prometheus_client.generate_latest(m.registry).decode()
    assert "gossip_exchange_duration_seconds_count 1.0" in text
    assert "_created" not in text
    assert "_created" not in generate_openmetrics(m.registry).decode()
    # a scrape of ?name[]=... collects through a restricted registry
    names = ["gossip_steps_total", "gossip_steps_created", "gossip_exchange_duration_seconds_sum"]
    restricted = prometheus_client.generate_latest(m.registry.restricted_registry(names))
    assert b"gossip_steps_total 0.0" in restricted
    assert b"gossip_exchange_duration_seconds_sum" in restricted
    assert b"_created" not in restricted
    # nothing process-wide was switched: the other registry exports what it did before
    assert prometheus_client.generate_latest(other) == before


def test_the_metrics_table_in_daemon_md_lists_every_series_and_no_other() -> None:
    text = DAEMON_MD.read_text()
    section = text[text.index("\n## Metrics\n"):]
    section = section[:section.index("\n## ", 1)]
    documented = set()
    for row in section.splitlines():
        if row.startswith("| `gossip_"):
            first_cell = row.split("|")[1]
            documented |= {re.sub(r"\{.*\}", "", name)
                           for name in re.findall(r"`(gossip_[^`]+)`", first_cell)}
    assert documented == Metrics().series()


def test_serve_on_a_bad_address_raises_os_error() -> None:
    m = Metrics()
    first = m.serve("127.0.0.1:0")
    try:
        port = first.server_address[1]
        with pytest.raises(OSError):
            Metrics().serve(f"127.0.0.1:{port}")  # in use
    finally:
        first.shutdown()
        first.server_close()


# --- the JSON-lines log ----------------------------------------------------------------------


def test_metrics_log_writes_one_object_per_line(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "metrics.jsonl"  # the directory is made
    log = MetricsLog(path)
    log.write("start", peer="abc", address="h:1")
    log.write("sample", step=3, peers={"alive": 1}, path=Path("/x"))  # non-JSON -> str
    # flushed as it goes: a reader sees both lines before close()
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    first, second = map(json.loads, lines)
    assert first["event"] == "start" and first["peer"] == "abc" and first["address"] == "h:1"
    assert second == {"time": second["time"], "event": "sample", "step": 3,
                      "peers": {"alive": 1}, "path": "/x"}
    assert isinstance(first["time"], float) and first["time"] > 1.6e9  # Unix seconds
    assert first["time"] <= second["time"]
    log.close()
    with pytest.raises(ValueError):  # closed
        log.write("late")


def test_metrics_log_appends(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    log.write("one")
    log.close()
    log = MetricsLog(path)
    log.write("two")
    log.close()
    assert [json.loads(line)["event"] for line in path.read_text().splitlines()] == ["one", "two"]


def test_a_reader_follows_the_log_and_never_returns_a_partial_line(tmp_path) -> None:
    from daemon.metrics import MetricsLog, MetricsLogReader

    path = tmp_path / "m.jsonl"
    reader = MetricsLogReader(path)
    assert reader.read() == []  # no log yet
    log = MetricsLog(path)
    log.write("start", step=0)
    assert [e["event"] for e in reader.read()] == ["start"]
    with open(path, "a") as f:
        f.write('{"time": 1, "event": "half')  # a line still being written
    assert reader.read() == []
    with open(path, "a") as f:
        f.write('way"}\n')
    assert [e["event"] for e in reader.read()] == ["halfway"]
    log.close()


async def test_sample_counts_newcomers_offers(autojump_clock: MockClock) -> None:
    # B has been a member of A's table for less than trust_after: its offer commits at A,
    # and moves A by nothing; A counts it.
    net = SimNetwork(seed=3)
    swarm = gossip.Swarm.generate("t")
    m, told = Metrics(), Signal()
    young = gossip.AveragingConfig(every=None, interval=None, trust_after=60.0)
    async with gossip.open_swarm(torch.nn.Linear(2, 2), swarm,
                                 dataclasses.replace(A, averaging=young),
                                 network=net.host("a"), on_exchange=told.fire) as a:
        async with gossip.open_swarm(torch.nn.Linear(2, 2), swarm,
                                     dataclasses.replace(B, averaging=young),
                                     network=net.host("b")) as b:
            await b.wait_ready()
            assert await b.average_now() is gossip.Result.COMMITTED
            await told.wait_until(lambda: a.statistics().committed == 1)
            snap = m.sample(a)
            again = m.sample(a)
    assert snap["exchanges"]["newcomers"] == again["exchanges"]["newcomers"] == 1
    assert snap["pending"] == 0  # nothing queued: the newcomer's state moved a by nothing
    assert value(m, "gossip_newcomer_offers_total", outcome="committed") == 1
    assert value(m, "gossip_newcomer_offers_total", outcome="limited") == 0
