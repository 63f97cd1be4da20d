"""``gossipd demo``: a swarm of real daemons on 127.0.0.1, watched, churned, stopped and scored.

Theory of operation
-------------------
Each node is a ``gossipd run`` process with its own directory, config, identity and a copy of
one swarm key, training the same task on its own shard of the data (non-IID: with the
digits task each shard holds mostly a few classes, so no node could learn all ten alone).
The first node starts the swarm and the others bootstrap from it. Halfway through, the swarm
churns: node1 *departs* (SIGTERM: a graceful stop, its leave gossiped) and a fresh node
*joins* in its place, on its shard, as a new volunteer would: no checkpoint, the default
``averaging.start = "auto"``, so it downloads the swarm's current weights from a peer before
it trains. The demo follows the nodes' JSON-lines metrics logs to show progress, stops them
with SIGTERM, then scores them against what the same samples give without a swarm: it trains
one model centrally on all the data with as many samples as the nodes trained together (the
*central baseline*), and evaluates the average of the final weights of the nodes that trained
to the end. It prints each node's test result beside the baseline's, and plots each node's
held-out result over time with the baseline as a line and the two events marked.

The cost of churn is measured from the evaluations each daemon logs every ``EVAL_EVERY``
seconds, with the daemon's own timestamps, by :mod:`daemon.churn`: for each event (the
departure at the SIGTERM, the join at the joiner's ``download``) and each node that ran across
it, the *dip* is how far the node's accuracy fell below its level just before (each a mean of
``LEVEL_EVALS`` evaluations in a row); ``worst_dip_points`` is the largest, in points. The
schedule waits on conditions, not fixed sleeps: the departure waits until every node has a
level to dip from, and the end until the joiner has trained and every node that ran across
the join has ``LEVEL_EVALS`` evaluations since (a window to measure its low on); at the
default 60 s all are met long before they are due (the join comes a few seconds after the
departure, and the nodes evaluate a dozen times after it), so the run takes no longer than it
did without churn.
"""
from __future__ import annotations

import json
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Mapping, Sequence

from .churn import (LEVEL_EVALS, MIN_LEVEL_EVALS, ChurnEvent, Dip, dips, short_of_a_window,
                    worst_dip_points)
from .config import from_dict, load, render
from .keys import write_swarm_key
from .metrics import MetricsLogReader

__all__ = ["DemoError", "run_demo"]

START_TIMEOUT = 120.0  # s for a daemon to import torch, load its task and listen
STOP_TIMEOUT = 60.0  # s for a stopped daemon to exit
REFRESH = 2.0  # s between progress displays
# Settings for every node, before the user's --set: the averaging is the defaults'; each
# node evaluates every EVAL_EVERY seconds, for the plot and the dips.
EVAL_EVERY = 2.0
PRESETS = ["checkpoint.interval=30", "metrics.interval=2", "task.progress_interval=1",
           "task.threads=1", f"task.eval_interval={EVAL_EVERY:g}"]
POINTS = 2.0  # the demo's verdict: every node within this many points of the central baseline
LEAVER = 1  # the index of the node that departs: not node0, whose address the joiner dials
RESULT_KEYS = ("time", "event", "step")  # an eval event's fields that are not results


class DemoError(Exception):
    """The demo cannot run (bad arguments, or a node failed to start)."""


@dataclass
class _Node:
    index: int
    directory: Path
    shard: int
    process: subprocess.Popen[bytes] | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    left: float | None = None  # Unix time of its departure, for the leaver
    _log: IO[bytes] | None = None

    def __post_init__(self) -> None:
        self._reader = MetricsLogReader(self.directory / "metrics.jsonl")

    @property
    def name(self) -> str:
        return f"node{self.index}"

    def start(self, overrides: Sequence[str] = ()) -> None:
        self._log = open(self.directory / "daemon.log", "ab")
        sets = [arg for o in overrides for arg in ("--set", o)]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "daemon", "run", "-c", str(self.directory / "gossipd.toml"),
             *sets],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)  # Ctrl-C reaches the demo only; it stops them cleanly

    def leave(self) -> None:
        """Depart gracefully, as a volunteer's SIGTERM does; the demo keeps watching."""
        assert self.process is not None
        self.left = time.time()  # the daemons' clock: eval events carry time.time()
        self.process.send_signal(signal.SIGTERM)

    def poll(self) -> list[dict[str, Any]]:
        """New events from the node's metrics log."""
        new = self._reader.read()
        self.events.extend(new)
        return new

    def last(self, event: str) -> dict[str, Any] | None:
        return next((e for e in reversed(self.events) if e["event"] == event), None)

    def evals(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == "eval"]

    def series(self, metric: str) -> list[tuple[float, float]]:
        """``(time, value)`` of each evaluation that reports ``metric``."""
        return [(e["time"], e[metric]) for e in self.evals() if e.get(metric) is not None]

    def trained_since_download(self) -> bool:
        """It downloaded the swarm's state and has evaluated its training since."""
        download = self.last("download")
        return download is not None and sum(
            e["time"] > download["time"] for e in self.evals()) >= MIN_LEVEL_EVALS

    def exited_early(self) -> bool:
        return (self.process is not None and self.left is None
                and self.process.poll() is not None)

    def tail(self, lines: int = 5) -> str:
        text = (self.directory / "daemon.log").read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def wait_for(self, event: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll()
            found = self.last(event)
            if found is not None:
                return found
            assert self.process is not None
            if self.process.poll() is not None:
                raise DemoError(f"{self.name} exited with code {self.process.returncode}:\n"
                                f"{self.tail()}")
            time.sleep(0.2)
        raise DemoError(f"{self.name} did not start within {timeout:g} s:\n{self.tail()}")


@dataclass
class _Churn:
    """Who departs midway, who joins in its place, and when the joiner was started."""

    leaver: _Node
    joiner: _Node
    launched: float | None = None  # time.monotonic() at the joiner's start

    def events(self) -> list[ChurnEvent]:
        """The departure at its SIGTERM, the join when the joiner held the swarm's state."""
        found = []
        if self.leaver.left is not None:
            found.append(ChurnEvent("departure", self.leaver.name, self.leaver.left))
        download = self.joiner.last("download")
        if download is not None:
            found.append(ChurnEvent("join", self.joiner.name, download["time"]))
        return found

    def short_of_a_window(self, nodes: Sequence[_Node]) -> list[str]:
        """The running nodes whose dips after the events are not yet measured on a whole
        window (:func:`daemon.churn.short_of_a_window`). The dips are of accuracy: a task
        that reports none has no node to wait for."""
        return short_of_a_window({n.name: n.series("accuracy") for n in nodes}, self.events())


def _write_config(node: _Node, name: str, key: bytes, entry: str, nodes: int,
                  bootstrap: list[str]) -> None:
    node.directory.mkdir(parents=True)
    write_swarm_key(node.directory / "swarm.key", key)
    data = {
        "node": {"listen": "127.0.0.1:0"},
        "swarm": {"name": name, "bootstrap": bootstrap},
        "task": {"entry": entry, "seed": 0, "shard": node.shard, "shards": nodes},
    }
    config = from_dict(data, node.directory, str(node.directory / "gossipd.toml"))
    (node.directory / "gossipd.toml").write_text(render(config))


def _table(nodes: list[_Node], started: float) -> str:
    parts = [f"{time.monotonic() - started:5.0f} s"]
    for node in nodes:
        progress = node.last("progress")
        if node.left is not None:
            parts.append(f"{node.name} left")
        elif node.process is None:
            parts.append(f"{node.name} not started")
        elif progress is None:
            parts.append(f"{node.name} starting")
        else:
            parts.append(f"{node.name} step {progress['step']:>5} loss {progress['loss'] or 0:.3f} "
                         f"ex {progress['exchanges']:>3}")
    return " | ".join(parts)


def run_demo(*, nodes: int = 3, seconds: float = 60.0, directory: str | None = None,
             entry: str = "daemon.tasks.digits:task", overrides: Sequence[str] = ()) -> int:
    """Run the demo; returns the exit code (0 when every node trained and stopped cleanly).

    Args:
        nodes: how many train at once; node1 departs midway and one more joins in its place.
        overrides: ``section.key=value`` settings for every node (``gossipd run --set``).
    """
    if not 2 <= nodes <= 32:
        raise DemoError("--nodes must be between 2 and 32")
    if not seconds >= 10:
        raise DemoError("--seconds must be at least 10")
    root = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="gossipd-demo-"))
    if root.exists() and any(root.iterdir()):
        raise DemoError(f"{root} is not empty")
    key, name = secrets.token_bytes(32), f"demo-{secrets.token_hex(3)}"
    overrides = [*PRESETS, *overrides]
    swarm = [_Node(i, root / f"node{i}", i) for i in range(nodes)]
    churn = _Churn(swarm[LEAVER], _Node(nodes, root / f"node{nodes}", swarm[LEAVER].shard))
    everyone = [*swarm, churn.joiner]
    print(f"gossipd demo: {nodes} daemons on 127.0.0.1 training {entry} for {seconds:g} s; "
          f"halfway {churn.leaver.name} leaves and {churn.joiner.name} joins in its place; "
          f"files in {root}")
    wall = time.monotonic()
    try:
        _write_config(swarm[0], name, key, entry, nodes, [])
        swarm[0].start(overrides)
        first = swarm[0].wait_for("start", START_TIMEOUT)
        print(f"node0 started the swarm at {first['address']}")
        for node in everyone[1:]:
            _write_config(node, name, key, entry, nodes, [first["address"]])
        for node in swarm[1:]:
            node.start(overrides)
        _watch(everyone, churn, seconds, overrides)
    finally:
        codes = _stop(everyone)
    for node in everyone:
        node.poll()
    scores = _score(everyone, overrides, churn.leaver)
    return _report(everyone, codes, root, scores, churn, time.monotonic() - wall)


def _watch(everyone: list[_Node], churn: _Churn, seconds: float,
           overrides: Sequence[str]) -> None:
    """Show progress for ``seconds``, with the departure and the join halfway.

    Raises:
        DemoError: a node exited on its own, or the churn's conditions were not met in time.
    """
    tty = sys.stdout.isatty()
    started = time.monotonic()
    next_refresh = started
    while True:
        elapsed = time.monotonic() - started
        for node in everyone:
            node.poll()
            if node.exited_early():
                assert node.process is not None
                raise DemoError(f"{node.name} exited early with code "
                                f"{node.process.returncode}:\n{node.tail()}")
        if churn.launched is None and elapsed >= seconds / 2:
            _maybe_churn(everyone, churn, elapsed - seconds / 2, overrides, tty)
        if elapsed >= seconds and churn.launched is not None:
            trained = churn.joiner.trained_since_download()
            short = churn.short_of_a_window(everyone) if trained else []
            if trained and not short:
                break
            if time.monotonic() - churn.launched > START_TIMEOUT:
                raise DemoError(
                    f"{', '.join(short)} did not evaluate {LEVEL_EVALS} times after the join "
                    f"within {START_TIMEOUT:g} s of the joiner's start" if trained else
                    f"{churn.joiner.name} did not download the swarm's state and train within "
                    f"{START_TIMEOUT:g} s:\n{churn.joiner.tail()}")
        if time.monotonic() >= next_refresh:
            line = _table(everyone, started)
            print("\r\x1b[K" + line if tty else line, end="" if tty else "\n", flush=True)
            next_refresh += REFRESH if tty else 5 * REFRESH
        time.sleep(0.2)
    if tty:
        print()


def _maybe_churn(everyone: list[_Node], churn: _Churn, late: float,
                 overrides: Sequence[str], tty: bool) -> None:
    """Depart and join, once every running node has a level to dip from (``late`` s past
    halfway; on a slow start, a short demo's nodes may not have evaluated yet)."""
    running = [n for n in everyone if n.process is not None]
    if any(len(n.evals()) < LEVEL_EVALS for n in running):
        if late > START_TIMEOUT:
            raise DemoError(f"the nodes did not evaluate {LEVEL_EVALS} times within "
                            f"{START_TIMEOUT:g} s of halfway")
        return
    print(("\n" if tty else "") + f"{churn.leaver.name} leaves (SIGTERM); {churn.joiner.name} "
          f"joins on its shard: it downloads the swarm's weights before training")
    churn.leaver.leave()
    churn.joiner.start(overrides)
    churn.launched = time.monotonic()


def _stop(swarm: list[_Node]) -> list[int | None]:
    for node in swarm:
        if node.process is not None and node.process.poll() is None and node.left is None:
            node.process.send_signal(signal.SIGTERM)
    codes: list[int | None] = []
    for node in swarm:
        if node.process is None:
            codes.append(None)
            continue
        try:
            codes.append(node.process.wait(STOP_TIMEOUT))
        except subprocess.TimeoutExpired:
            node.process.kill()
            codes.append(node.process.wait())
        if node._log is not None:
            node._log.close()
    return codes


@dataclass
class _Scores:
    """What the swarm is compared with: the central baseline's evaluation and the averaged
    weights', each a task's ``evaluate()``, and the samples the nodes trained together."""

    central: dict[str, float]
    averaged: dict[str, float]
    samples: int


def _score(swarm: list[_Node], overrides: Sequence[str], leaver: _Node) -> _Scores | None:
    """Train the central baseline and evaluate the averaged weights of the nodes that trained
    to the end (None, said once, if the task has no evaluation or no node left a checkpoint).
    The leaver's samples count towards the baseline's: the swarm trained on them."""
    import torch

    from . import checkpoint
    from .merge import average, read_state_dict
    from .task import Context, Shard, load_entry

    states, samples = [], 0
    for node in swarm:
        config = load(node.directory / "gossipd.toml", overrides)
        found = checkpoint.load_latest(config.path(config.checkpoint.dir))
        if found is not None:
            samples += int(found[1]["counters"]["samples"])
            if node is not leaver:  # its weights are half a run old
                states.append(read_state_dict(found[0]))
    config = load(swarm[0].directory / "gossipd.toml", overrides)
    torch.set_num_threads(1)

    steps_taken = [0]  # the central baseline's step, for a task that schedules by it

    def build() -> Any:
        context = Context(config.task.seed, torch.device("cpu"), dict(config.task.options),
                          config.data_dir() / "cache", lambda: steps_taken[0])
        return load_entry(config.task.entry, config.data_dir())(context)

    task = build()
    if task.evaluate is None or not states:
        print("no scores: the task has no evaluate()" if task.evaluate is None else
              "no scores: no node left a checkpoint")
        return None
    task.model.load_state_dict(states[0] if len(states) == 1 else average(states))
    averaged = dict(task.evaluate())
    central = build()  # the same initial weights, optimizer and options
    steps = samples // central.batch_size
    print(f"training the central baseline: one model on all the data, {samples:,} samples "
          f"({steps:,} steps), as many as the nodes trained together")
    batches, started, shown = central.batches(Shard(0, 1)), time.monotonic(), time.monotonic()
    for step in range(steps):
        central.step(next(batches))
        steps_taken[0] = step + 1
        if time.monotonic() - shown >= 5 * REFRESH:
            shown = time.monotonic()
            print(f"  {step:,} of {steps:,} steps, {time.monotonic() - started:.0f} s", flush=True)
    return _Scores({k: float(v) for k, v in central.evaluate().items()},
                   {k: float(v) for k, v in averaged.items()}, samples)


def _results(node: _Node) -> dict[str, float]:
    """The node's last evaluation's results (its final one, written as it stopped)."""
    return {k: v for k, v in (node.last("eval") or {}).items() if k not in RESULT_KEYS}


def _report(swarm: list[_Node], codes: list[int | None], root: Path,
            scores: _Scores | None, churn: _Churn, wall: float) -> int:
    metric = _metric(scores.central if scores else
                     next((r for r in map(_results, swarm) if r), {}))
    origin = _origin(swarm)
    gaps = _node_rows(swarm, codes, scores, metric, churn.leaver, origin)
    if scores:
        print(f"{'central baseline':<28}          " + "  ".join(
            f"{k} {v:.4f}" for k, v in scores.central.items())
            + f"   (one model, all the data, {scores.samples:,} samples)")
        print(f"{'nodes averaged':<28}          " + "  ".join(
            f"{k} {v:.4f}" for k, v in scores.averaged.items())
            + f"   (the mean of the final weights of the nodes but {churn.leaver.name})")
        if gaps:
            verdict = "yes" if max(gaps) <= POINTS else "NO"
            print(f"every node that trained to the end within {POINTS:g} points of the central "
                  f"baseline: {verdict} (worst {max(gaps):.1f} points below it)")
    events = churn.events()
    found = dips({n.name: n.series(metric) for n in swarm}, events) \
        if metric == "accuracy" else None
    _churn_lines(swarm, churn, events, found, origin)
    plot = _plot(swarm, root / "accuracy.png", scores, metric, events, origin)
    print(f"plot: {plot}" if plot else "plot: skipped (pip install matplotlib)")
    ok = all(code == 0 for code in codes) and all(node.last("eval") for node in swarm)
    if not ok:
        print(f"some nodes did not stop cleanly: see {root}/node*/daemon.log")
    # Last, one JSON line with the figures, as the benchmarks print (a script reads the last).
    print(json.dumps({**_table_figures(swarm, codes, scores, metric, gaps),
                      **_churn_figures(swarm, churn, found, origin),
                      "wall_s": round(wall, 1), "exit": 0 if ok else 1}))
    return 0 if ok else 1


def _node_rows(swarm: list[_Node], codes: list[int | None], scores: _Scores | None,
               metric: str | None, leaver: _Node, origin: float) -> list[float]:
    """Print the table of nodes; returns the points below the baseline of the nodes that
    trained to the end (the leaver stopped halfway: its result is shown, not judged)."""
    print(f"{'node':<6} {'exit':>4} {'steps':>7} {'exchanges':>9} {'source':<10} "
          f"{'test result':<30}{f'  vs central ({metric})' if scores and metric else ''}")
    gaps: list[float] = []
    for node, code in zip(swarm, codes):
        evaluation, results = node.last("eval") or {}, _results(node)
        progress = node.last("progress") or {}
        source = "download" if node.last("download") else "own init"
        shown = "  ".join(f"{k} {v:.4f}" for k, v in results.items()) or "-"
        versus = ""
        if node is leaver and leaver.left is not None:
            versus = f"  (left at {leaver.left - origin:.0f} s)"
        elif scores and metric == "accuracy" and metric in results:
            gap = 100 * (scores.central[metric] - results[metric])
            gaps.append(gap)
            versus = f"  {-gap:+.1f} points"
        elif scores and metric in results:  # a loss, say: lower is better, no points
            versus = f"  {results[metric] - scores.central[metric]:+.4f}"
        print(f"{node.name:<6} {code if code is not None else '-':>4} "
              f"{evaluation.get('step', progress.get('step', 0)):>7} "
              f"{progress.get('exchanges', 0):>9} {source:<10} {shown:<30}{versus}")
    return gaps


def _churn_lines(swarm: list[_Node], churn: _Churn, events: list[ChurnEvent],
                 found: list[Dip] | None, origin: float) -> None:
    """Print the events, each one's worst dip, and ``worst_dip_points``."""
    donor = _donor(swarm, churn.joiner)
    for event in events:
        what = ("leaves (SIGTERM)" if event.kind == "departure" else
                f"joins (downloaded from {donor or 'a peer'}, trained on its shard)")
        line = f"at {event.time - origin:5.1f} s {event.node} {what}"
        if found is not None:
            mine = [d for d in found if d.event == event]
            worst = max(mine, key=lambda d: d.points, default=None)
            line += (f": largest fall below a node's level just before, {worst.points:.1f} "
                     f"points ({worst.node})" if worst else ": no node ran across it")
        print(line)
    if found is None:
        print("worst_dip_points: - (the task reports no accuracy)")
    else:
        print(f"worst_dip_points: {worst_dip_points(found):.1f} (the lowest mean of "
              f"{LEVEL_EVALS} evaluations in a row after the event below the mean of the last "
              f"{LEVEL_EVALS} before)")


def _table_figures(swarm: list[_Node], codes: list[int | None], scores: _Scores | None,
                   metric: str | None, gaps: list[float]) -> dict[str, Any]:
    """The JSON line's figures of the table: each node's, the baseline's, the worst gap."""
    def result(values: Mapping[str, float]) -> float | None:
        return round(values[metric], 4) if metric in values else None

    return {
        "metric": metric,  # what "result", "central" and "averaged" are
        "nodes": {n.name: {"exit": code, "source": "download" if n.last("download") else
                           "own init", "steps": (n.last("eval") or {}).get("step"),
                           "result": result(_results(n))} for n, code in zip(swarm, codes)},
        "central": result(scores.central) if scores else None,
        "averaged": result(scores.averaged) if scores else None,
        "samples": scores.samples if scores else None,
        "worst_points": round(max(gaps), 2) if gaps else None,
    }


def _churn_figures(swarm: list[_Node], churn: _Churn, found: list[Dip] | None,
                   origin: float) -> dict[str, Any]:
    """The JSON line's figures of the churn: who, when, and the dips (None: no accuracy)."""
    events = churn.events()
    at = {e.kind: round(e.time - origin, 1) for e in events}
    return {
        "departed": churn.leaver.name, "departed_at_s": at.get("departure"),
        "joined": churn.joiner.name, "joined_at_s": at.get("join"),
        "joiner_downloaded_from": _donor(swarm, churn.joiner),
        # Unix times, the daemons' clock: with their metrics logs, the dips can be recomputed.
        "events": [{"kind": e.kind, "node": e.node, "time": e.time} for e in events],
        "dips_points": None if found is None else {
            e.kind: round(worst_dip_points([d for d in found if d.event == e]), 2)
            for e in events},
        "worst_dip_points": None if found is None else round(worst_dip_points(found), 2),
    }


def _donor(swarm: list[_Node], joiner: _Node) -> str | None:
    """The name of the node the joiner downloaded from (its ``download`` event names a peer
    id, each node's ``start`` event its own)."""
    download = joiner.last("download")
    peers = {(n.last("start") or {}).get("peer"): n.name for n in swarm}
    return None if download is None else peers.get(download["peer"])


def _origin(swarm: list[_Node]) -> float:
    """Time zero of the plot and the summary: node0's first evaluation, as it started."""
    times = [e["time"] for n in swarm for e in n.evals()]
    return min(times, default=time.time())


def _metric(evaluation: dict[str, float]) -> str | None:
    """The metric to compare and plot: accuracy if the task reports it, else its first."""
    if "accuracy" in evaluation:
        return "accuracy"
    return next(iter(evaluation), None)


def _plot(swarm: list[_Node], path: Path, scores: _Scores | None, metric: str | None,
          events: list[ChurnEvent], origin: float) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    if metric is None or not any(n.series(metric) for n in swarm):
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for node in swarm:
        points = node.series(metric)
        if points:  # the leaver's line ends as it left, the joiner's begins once it joined
            xs, ys = zip(*points)
            ax.plot([x - origin for x in xs], ys, label=node.name, linewidth=1.2, marker=".")
    if scores and metric in scores.central:
        ax.axhline(scores.central[metric], color="black", linestyle="--", linewidth=1,
                   label=f"central baseline ({scores.central[metric]:.4f})")
    # Labels at the foot of their lines, one above the other (the events are seconds apart):
    # by then the curves are high, and the foot is empty.
    for i, event in enumerate(events):
        x = event.time - origin
        ax.axvline(x, color="grey", linestyle=":", linewidth=1.2)
        ax.annotate(f"{event.node} {'leaves' if event.kind == 'departure' else 'joins'}",
                    (x, 0.0), xycoords=("data", "axes fraction"), xytext=(3, 4 + 11 * i),
                    textcoords="offset points", fontsize=8, color="dimgrey")
    ax.set_xlabel("seconds")
    ax.set_ylabel(f"held-out {metric}")
    ax.set_title(f"gossipd demo: each node's held-out {metric}, every {EVAL_EVERY:g} s")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="center right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
