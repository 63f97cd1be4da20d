"""The daemon's metrics: Prometheus series, and the same figures as JSON lines.

Theory of operation
-------------------
:class:`Metrics` owns a private :class:`prometheus_client.CollectorRegistry` (two daemons in
one process, as in tests, do not collide). Counters move beside the log line for the same
event: :meth:`Metrics.exchange` is the averaging node's ``on_exchange`` callback, and
:meth:`Metrics.trained` is told each chunk of training steps. Gauges that mirror a state
(peers by state, step, pending deltas) are refreshed by :meth:`Metrics.sample`, which also
returns the snapshot the JSON-lines log and ``gossipd status`` show, so the three never
disagree. :meth:`Metrics.totals` sums up the run for the ``stop`` event. Names follow
``gossip_<noun>_<unit>``.

The registry exports no ``*_created`` series (the Unix time each counter and histogram was
made: one more series per counter, read by nobody). prometheus_client can turn them off only
for the whole process, which would change the exposition of any other registry the program
holds; :class:`_Registry` drops them from its own output instead.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import deque
from pathlib import Path
from typing import IO, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.metrics_core import Metric

import gossip
from gossip.lowlevel import parse_address

__all__ = ["Metrics", "MetricsLog", "MetricsLogReader"]

log = logging.getLogger(__name__)

RESULTS = tuple(r.value for r in gossip.Result if r is not gossip.Result.NO_PEER)
STATES = ("alive", "suspect", "dead", "left")
LIMITS = ("max_connections", "max_handshakes_per_host", "host_rate",  # gossip_inbound_refused
          "peer_rate")
RATE_WINDOW = 30.0  # s of chunks the samples/s figure averages over
CREATED = "_created"  # the suffix of the series _Registry leaves out
TOTALLED = ("committed", "failed", "busy", "rejected", "invalid", "no_peer")  # in totals()


class _Registry(CollectorRegistry):
    """A registry that exports no ``*_created`` samples, by itself, whatever the process-wide
    setting of prometheus_client (``disable_created_metrics()``) says."""

    def collect(self) -> Any:
        for metric in super().collect():
            yield _without_created(metric)

    def restricted_registry(self, names: Any) -> Any:
        # A scrape of ``?name[]=...`` collects through RestrictedRegistry, which keeps the
        # samples named in the set: leaving the _created names out leaves those samples out.
        return super().restricted_registry(n for n in names if not n.endswith(CREATED))


def _without_created(metric: Metric) -> Metric:
    if metric.type in ("counter", "histogram", "summary"):
        # collect() builds a new Metric every time: filtering it in place touches no state
        metric.samples = [s for s in metric.samples if not s.name.endswith(CREATED)]
    return metric


class Metrics:
    """Counters and gauges of one daemon."""

    def __init__(self) -> None:
        self.registry = r = _Registry()
        self.steps = Counter("gossip_steps", "Optimizer steps taken here", registry=r)
        self.samples = Counter("gossip_samples", "Training samples consumed here", registry=r)
        self.loss = Gauge("gossip_loss", "Mean training loss of the last chunk of steps", registry=r)
        self.rate = Gauge("gossip_samples_per_second", f"Training samples per second over the "
                          f"last {RATE_WINDOW:g} s", registry=r)
        self.step = Gauge("gossip_step", "The training step the swarm agrees on: this node's "
                          "steps, moved towards its peers' at each exchange", registry=r)
        self.exchanges = Counter("gossip_exchanges", "Averaging exchanges by result",
                                 ["result"], registry=r)
        self.rounds_without_peer = Counter("gossip_rounds_without_peer",
                                           "Averaging rounds that found no peer", registry=r)
        self.bytes = Counter("gossip_averaging_bytes", "Bytes on the wire in averaging channels",
                             ["direction"], registry=r)
        self.duration = Histogram(
            "gossip_exchange_duration_seconds", "Committed exchanges, offer to commit",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120), registry=r)
        self.peers = Gauge("gossip_peers", "Swarm members by state, this node excluded",
                           ["state"], registry=r)
        self.pending = Gauge("gossip_pending_deltas", "Committed deltas not yet applied",
                             registry=r)
        self.quarantined = Gauge("gossip_quarantined_peers", "Peers this node holds in "
                                 "quarantine now (averaging.strikes invalid states in a row, "
                                 "or a model that cannot be averaged with ours)", registry=r)
        self.refused = Counter("gossip_inbound_refused", "Inbound connections closed unread, "
                               "by limit: max_connections (refused at accept), "
                               "max_handshakes_per_host (an unproven one evicted), "
                               "host_rate (its address over its rate, refused at accept), "
                               "peer_rate",
                               ["limit"], registry=r)
        self.newcomers = Counter("gossip_newcomer_offers", "Offers from newcomers (peers not "
                                 "proved to us and members for averaging.trust_after since, nor "
                                 "picked by us before): "
                                 "committed (their state moved us by nothing) or limited "
                                 "(answered busy: the newcomers of their host had had their "
                                 "share)", ["outcome"], registry=r)
        self.members_limited = Counter("gossip_member_offers_limited", "Offers from members "
                                       "answered busy: the members of their host had had "
                                       "their share of our rounds", registry=r)
        self.claims_refused = Counter("gossip_membership_claims_refused", "Membership claims "
                                      "(Alive, Left) refused: not signed by the member they "
                                      "are about, or sent after one that was not", registry=r)
        self.evaluation = Gauge("gossip_eval", "The task's latest evaluation, by metric "
                                "(task.eval_interval, and at exit)", ["metric"], registry=r)
        self.checkpoints = Counter("gossip_checkpoints", "Checkpoints written", registry=r)
        self.checkpoint_failures = Counter("gossip_checkpoint_failures",
                                           "Checkpoints that could not be written", registry=r)
        self.checkpoint_seconds = Gauge("gossip_checkpoint_duration_seconds",
                                        "Time to write the last checkpoint", registry=r)
        for result in RESULTS:
            self.exchanges.labels(result)
        for direction in ("sent", "received"):
            self.bytes.labels(direction)
        for limit in LIMITS:
            self.refused.labels(limit)
        for outcome in ("committed", "limited"):
            self.newcomers.labels(outcome)
        self._newcomers_seen = (0, 0)
        self._members_limited_seen = 0
        self._claims_refused_seen = 0
        self._refused_seen = dict.fromkeys(LIMITS, 0)
        self._chunks: deque[tuple[float, int]] = deque()  # (monotonic end, samples)
        self._last_loss = math.nan
        self._bytes_seen = (0, 0)
        self._no_peer_seen = 0
        self._steps = self._samples = 0  # this run's, for totals()
        self._last_eval: dict[str, float] = {}

    # ---- events -----------------------------------------------------------------------

    def trained(self, steps: int, samples: int, loss: float) -> None:
        """Count one chunk of ``steps`` steps over ``samples`` samples with mean ``loss``."""
        self.steps.inc(steps)
        self.samples.inc(samples)
        self._steps += steps
        self._samples += samples
        if math.isfinite(loss):
            self.loss.set(loss)
            self._last_loss = loss
        now = time.monotonic()
        self._chunks.append((now, samples))
        while self._chunks and self._chunks[0][0] < now - RATE_WINDOW:
            self._chunks.popleft()

    def exchange(self, exchange: gossip.Exchange) -> None:
        self.exchanges.labels(exchange.result.value).inc()
        if exchange.result is gossip.Result.COMMITTED:
            self.duration.observe(exchange.duration)

    def checkpointed(self, seconds: float) -> None:
        self.checkpoints.inc()
        self.checkpoint_seconds.set(seconds)

    def evaluated(self, evaluation: dict[str, float]) -> None:
        """Set the ``gossip_eval`` gauges to the task's latest evaluation, and keep it for
        :meth:`totals`."""
        for metric, value in evaluation.items():
            self.evaluation.labels(metric).set(value)
        if evaluation:
            self._last_eval = dict(evaluation)

    # ---- state ------------------------------------------------------------------------

    def samples_per_second(self) -> float:
        if len(self._chunks) < 2:
            return 0.0
        span = self._chunks[-1][0] - self._chunks[0][0]
        return sum(n for _, n in list(self._chunks)[1:]) / span if span > 0 else 0.0

    def sample(self, node: gossip.SwarmNode) -> dict[str, Any]:
        """Refresh the state gauges from ``node`` and return one snapshot of everything."""
        stats, roster = node.statistics(), node.roster.statistics()
        sent, received = self._bytes_seen
        self.bytes.labels("sent").inc(stats.bytes_sent - sent)
        self.bytes.labels("received").inc(stats.bytes_received - received)
        self._bytes_seen = (stats.bytes_sent, stats.bytes_received)
        self.rounds_without_peer.inc(stats.no_peer - self._no_peer_seen)
        self._no_peer_seen = stats.no_peer
        committed, limited = self._newcomers_seen
        self.newcomers.labels("committed").inc(stats.newcomers - committed)
        self.newcomers.labels("limited").inc(stats.newcomers_limited - limited)
        self._newcomers_seen = (stats.newcomers, stats.newcomers_limited)
        self.members_limited.inc(stats.members_limited - self._members_limited_seen)
        self._members_limited_seen = stats.members_limited
        refused = dict(zip(LIMITS, (roster.connections_refused, roster.connections_evicted,
                                    roster.connections_throttled,
                                    roster.channels_limited)))
        for limit, count in refused.items():
            self.refused.labels(limit).inc(count - self._refused_seen[limit])
        self._refused_seen = refused
        self.claims_refused.inc(roster.claims_refused - self._claims_refused_seen)
        self._claims_refused_seen = roster.claims_refused
        for state in STATES:
            self.peers.labels(state).set(getattr(roster, state))
        self.step.set(stats.step)
        self.pending.set(stats.pending)
        self.quarantined.set(stats.quarantined)
        rate = self.samples_per_second()
        self.rate.set(rate)
        return {
            "step": stats.step,
            "samples": stats.samples,
            "loss": None if math.isnan(self._last_loss) else self._last_loss,
            "samples_per_s": round(rate, 1),
            "ready": stats.ready,
            "peers": {state: getattr(roster, state) for state in STATES},
            "exchanges": {"committed": stats.committed, "busy": stats.busy,
                          "rejected": stats.rejected, "invalid": stats.invalid,
                          "failed": stats.failed, "no_peer": stats.no_peer,
                          "newcomers": stats.newcomers,
                          "newcomers_limited": stats.newcomers_limited,
                          "members_limited": stats.members_limited},
            "bytes": {"sent": stats.bytes_sent, "received": stats.bytes_received},
            "mean_exchange_s": round(stats.mean_duration, 4),
            "spacing": stats.spacing,  # local steps between our rounds; None: by time only
            "round_peers": stats.round_peers,  # exchanges each of our rounds makes
            "last_distance": stats.last_distance,
            "pending": stats.pending,
            "quarantined": stats.quarantined,
            "refused": refused,
            "claims_refused": roster.claims_refused,
            "downloads_served": stats.downloads_served,
        }

    def totals(self, node: gossip.SwarmNode) -> dict[str, Any]:
        """What this run did, for the ``stop`` event and line.

        Returns:
            ``step`` (the swarm's step, as the checkpoint holds it), ``steps`` and ``samples``
            (trained by this process, the checkpoint resumed not counted), ``loss`` (of the
            last chunk with a finite one; None: none), ``exchanges`` (this run's, by result;
            ``no_peer`` counts rounds that found nobody) and ``eval`` (the task's latest
            evaluation; None: none ran).
        """
        stats = node.statistics()
        return {
            "step": stats.step,
            "steps": self._steps,
            "samples": self._samples,
            "loss": None if math.isnan(self._last_loss) else self._last_loss,
            "exchanges": {result: getattr(stats, result) for result in TOTALLED},
            "eval": dict(self._last_eval) or None,
        }

    def series(self) -> set[str]:
        """The names of the series exported, as PromQL spells them: a counter's with
        ``_total``, a histogram's without ``_bucket``, ``_sum`` or ``_count``."""
        return {f"{m.name}_total" if m.type == "counter" else m.name
                for m in self.registry.collect()}

    def serve(self, address: str) -> Any:
        """Start the Prometheus endpoint on ``host:port`` (a thread of prometheus_client's).

        Returns:
            The HTTP server; call ``shutdown()`` on it to stop.

        Raises:
            OSError: the address cannot be bound (in use, or not ours).
        """
        host, port = parse_address(address)
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server


class MetricsLog:
    """Append-only JSON lines: one object per line, each with ``time`` (Unix seconds) and
    ``event``. A line is written whole and flushed, so a crash loses at most the last one and
    a reader (``gossipd demo``) can follow the file as it grows."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file: IO[str] = open(path, "a", encoding="utf-8")
        self._failed = False

    def write(self, event: str, **fields: Any) -> None:
        """Append one record. A write that fails (a full disk) is reported once and the log
        turned off: losing the log must not stop training."""
        if self._failed:
            return
        record = {"time": round(time.time(), 3), "event": event, **fields}
        try:
            self._file.write(json.dumps(record, separators=(",", ":"), default=str) + "\n")
            self._file.flush()
        except OSError as exc:
            self._failed = True
            log.error("metrics log write failed path=%s error=%s; the log is off until restart",
                      self.path, exc)

    def close(self) -> None:
        try:
            os.fsync(self._file.fileno())
        except OSError:
            pass  # already reported by write(), or nothing left to save
        finally:
            self._file.close()


class MetricsLogReader:
    """Follows a daemon's :class:`MetricsLog` as it grows (``gossipd demo``, tests, benches):
    each :meth:`read` returns the records of the whole lines written since the last one."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:  # the daemon has not started yet
            return []
        end = data.rfind(b"\n") + 1  # a line being written is read next time
        self._offset += end
        return [json.loads(line) for line in data[:end].splitlines() if line.strip()]
