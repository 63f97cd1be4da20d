"""``gossipd demo``: a swarm of real daemons on 127.0.0.1, watched, stopped and scored.

Each node is a ``gossipd run`` process with its own directory, config, identity and a copy of
one swarm key, training the same task on its own shard of the data (non-IID: with the
digits task each shard holds mostly a few classes, so no node could learn all ten alone).
The first node starts the swarm; the others bootstrap from it, and the last one joins a
quarter of the way in, downloading the swarm's weights. The demo follows the nodes'
JSON-lines metrics logs to show progress, stops them with SIGTERM, then scores them against
what the same samples give without a swarm: it trains one model centrally on all the data
with as many samples as the nodes trained together (the *central baseline*), and evaluates
the average of the nodes' final weights. It prints each node's test result beside the
baseline's, and plots each node's held-out result over time with the baseline as a line.
"""
from __future__ import annotations

import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Sequence

from .config import from_dict, load, render
from .keys import write_swarm_key
from .metrics import MetricsLogReader

__all__ = ["DemoError", "run_demo"]

START_TIMEOUT = 120.0  # s for a daemon to import torch, load its task and listen
STOP_TIMEOUT = 60.0  # s for a stopped daemon to exit
REFRESH = 2.0  # s between progress displays
# Settings for every node, before the user's --set: the averaging is the defaults'; each
# node evaluates every EVAL_EVERY seconds, for the plot.
EVAL_EVERY = 2.0
PRESETS = ["checkpoint.interval=30", "metrics.every=2", "task.progress_interval=1",
           "task.threads=1", f"task.eval_every={EVAL_EVERY:g}"]
POINTS = 2.0  # the demo's verdict: every node within this many points of the central baseline


class DemoError(Exception):
    """The demo cannot run (bad arguments, or a node failed to start)."""


@dataclass
class _Node:
    index: int
    directory: Path
    process: subprocess.Popen[bytes] | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
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

    def poll(self) -> list[dict[str, Any]]:
        """New events from the node's metrics log."""
        new = self._reader.read()
        self.events.extend(new)
        return new

    def last(self, event: str) -> dict[str, Any] | None:
        return next((e for e in reversed(self.events) if e["event"] == event), None)

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


def _write_config(node: _Node, name: str, key: bytes, entry: str, nodes: int,
                  bootstrap: list[str]) -> None:
    node.directory.mkdir(parents=True)
    write_swarm_key(node.directory / "swarm.key", key)
    data = {
        "node": {"listen": "127.0.0.1:0"},
        "swarm": {"name": name, "bootstrap": bootstrap},
        "task": {"entry": entry, "seed": 0, "shard": node.index, "shards": nodes},
    }
    config = from_dict(data, node.directory, str(node.directory / "gossipd.toml"))
    (node.directory / "gossipd.toml").write_text(render(config))


def _table(nodes: list[_Node], started: float) -> str:
    parts = [f"{time.monotonic() - started:5.0f} s"]
    for node in nodes:
        progress = node.last("progress")
        if node.process is None:
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
    swarm = [_Node(i, root / f"node{i}") for i in range(nodes)]
    print(f"gossipd demo: {nodes} daemons on 127.0.0.1 training {entry} for {seconds:g} s; "
          f"files in {root}")
    tty = sys.stdout.isatty()
    started = time.monotonic()
    late = swarm[-1]
    try:
        _write_config(swarm[0], name, key, entry, nodes, [])
        swarm[0].start(overrides)
        first = swarm[0].wait_for("start", START_TIMEOUT)
        print(f"node0 started the swarm at {first['address']}")
        for node in swarm[1:]:
            _write_config(node, name, key, entry, nodes, [first["address"]])
        for node in swarm[1:-1]:
            node.start(overrides)
        started = time.monotonic()
        next_refresh = started
        while time.monotonic() - started < seconds:
            if late.process is None and time.monotonic() - started >= seconds / 4:
                print(("\n" if tty else "") + f"{late.name} joins late: it downloads the "
                      "swarm's weights before training")
                late.start(overrides)
            for node in swarm:
                node.poll()
                if node.process is not None and node.process.poll() is not None:
                    raise DemoError(f"{node.name} exited early with code "
                                    f"{node.process.returncode}:\n{node.tail()}")
            if time.monotonic() >= next_refresh:
                line = _table(swarm, started)
                print("\r\x1b[K" + line if tty else line, end="" if tty else "\n", flush=True)
                next_refresh += REFRESH if tty else 5 * REFRESH
            time.sleep(0.2)
        if tty:
            print()
    finally:
        codes = _stop(swarm)
    for node in swarm:
        node.poll()
    scores = _score(swarm, overrides)
    return _report(swarm, codes, root, scores)


def _stop(swarm: list[_Node]) -> list[int | None]:
    for node in swarm:
        if node.process is not None and node.process.poll() is None:
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


def _score(swarm: list[_Node], overrides: Sequence[str]) -> _Scores | None:
    """Train the central baseline and evaluate the nodes' averaged weights (None, said once,
    if the task has no evaluation or no node left a checkpoint)."""
    import torch

    from . import checkpoint
    from .merge import average, read_state_dict
    from .task import Context, Shard, load_entry

    states, samples = [], 0
    for node in swarm:
        config = load(node.directory / "gossipd.toml", overrides)
        found = checkpoint.load_latest(config.path(config.checkpoint.dir))
        if found is not None:
            states.append(read_state_dict(found[0]))
            samples += int(found[1]["counters"]["samples"])
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


def _report(swarm: list[_Node], codes: list[int | None], root: Path,
            scores: _Scores | None) -> int:
    metric = _metric(scores.central) if scores else None
    print(f"{'node':<6} {'exit':>4} {'steps':>7} {'exchanges':>9} {'source':<10} "
          f"{'test result':<30}{f'  vs central ({metric})' if metric else ''}")
    gaps: list[float] = []
    for node, code in zip(swarm, codes):
        evaluation = node.last("eval") or {}
        progress = node.last("progress") or {}
        source = "download" if node.last("download") else "own init"
        metrics = {k: v for k, v in evaluation.items() if k not in ("time", "event", "step")}
        shown = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()) or "-"
        versus = ""
        if scores and metric == "accuracy" and metric in metrics:
            gap = 100 * (scores.central[metric] - metrics[metric])
            gaps.append(gap)
            versus = f"  {-gap:+.1f} points"
        elif scores and metric in metrics:  # a loss, say: lower is better, no points
            versus = f"  {metrics[metric] - scores.central[metric]:+.4f}"
        print(f"{node.name:<6} {code if code is not None else '-':>4} "
              f"{evaluation.get('step', progress.get('step', 0)):>7} "
              f"{progress.get('exchanges', 0):>9} {source:<10} {shown:<30}{versus}")
    if scores:
        print(f"{'central baseline':<28}          " + "  ".join(
            f"{k} {v:.4f}" for k, v in scores.central.items())
            + f"   (one model, all the data, {scores.samples:,} samples)")
        print(f"{'nodes averaged':<28}          " + "  ".join(
            f"{k} {v:.4f}" for k, v in scores.averaged.items())
            + "   (the mean of the nodes' final weights)")
        if gaps:
            verdict = "yes" if max(gaps) <= POINTS else "NO"
            print(f"every node within {POINTS:g} points of the central baseline: {verdict} "
                  f"(worst {max(gaps):.1f} points below it)")
    plot = _plot(swarm, root / "accuracy.png", scores)
    print(f"plot: {plot}" if plot else "plot: skipped (pip install matplotlib)")
    ok = all(code == 0 for code in codes) and all(node.last("eval") for node in swarm)
    if not ok:
        print(f"some nodes did not stop cleanly: see {root}/node*/daemon.log")
    return 0 if ok else 1


def _metric(evaluation: dict[str, float]) -> str | None:
    """The metric to compare and plot: accuracy if the task reports it, else its first."""
    if "accuracy" in evaluation:
        return "accuracy"
    return next(iter(evaluation), None)


def _plot(swarm: list[_Node], path: Path, scores: _Scores | None) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    evals = [e for n in swarm for e in n.events if e["event"] == "eval"]
    metric = _metric(scores.central) if scores else _metric(
        {k: v for k, v in (evals[0] if evals else {}).items()
         if k not in ("time", "event", "step")})
    if not evals or metric is None:
        return None
    t0 = min(e["time"] for e in evals)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for node in swarm:
        points = [(e["time"] - t0, e[metric]) for e in node.events
                  if e["event"] == "eval" and e.get(metric) is not None]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, label=node.name, linewidth=1.2, marker=".")
    if scores and metric in scores.central:
        ax.axhline(scores.central[metric], color="black", linestyle="--", linewidth=1,
                   label=f"central baseline ({scores.central[metric]:.4f})")
    ax.set_xlabel("seconds")
    ax.set_ylabel(f"held-out {metric}")
    ax.set_title(f"gossipd demo: each node's held-out {metric}, every {EVAL_EVERY:g} s")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
