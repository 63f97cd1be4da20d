"""What averaging costs a training daemon, and how soon a new daemon takes part.

Real daemons (``python -m daemon run``), each with its own temporary directory, config,
identity and copy of one swarm key, on 127.0.0.1; the bench reads only their JSON-lines
metrics logs (``metrics.jsonl``), never their log text.

* Overhead. The trainer is one daemon training ``bench/tasks.py:mlp10m`` (a 10.5M-parameter
  MLP on synthetic batches, SGD, one torch thread) with rounds by time alone
  (``averaging.every = 0``, ``averaging.interval = 5``), so that exchanges come at a known
  pace. After a warm-up it alternates phases of ``--seconds``: A, alone (its rounds find no
  peer, so no exchange happens); B, with a peer: a fresh daemon bootstrapping to it, likewise
  (each side starts a round 5 s after its last, so the pair exchanges about every 2.5 s; each
  exchange carries the state and the drift correction's estimate, the defaults), from its
  first exchange on; then the peer is stopped (SIGTERM) and, once it
  has exited, the next A starts. ``--rounds`` rounds, and a last A, so that every B has an A
  on each side: the overhead ratio is the median over rounds of B's steps/s over the mean of
  its two A's, which cancels a slow drift in the machine's speed. Steps/s come from the
  trainer's ``progress`` events, one per chunk of steps (``task.progress_interval = 0``). Their
  ``step`` is the one the swarm agrees on, which the idle peer holds back (the trainer pays a
  debt of steps it does not count); the bench checks (each ``metrics`` event's step x batch
  size against its local ``samples``) and counts samples when they differ.
  Training time lost per exchange is (1 - ratio) x the B phases' length / their exchanges;
  the bench also compares the trainer's chunks (0.25 s each) that overlap an exchange with
  the others.

* Time to the first exchange. Each round's peer is a joiner with no checkpoint: it downloads
  the trainer's state (42 MB), becomes ready, then averages. The figure is the wall time from
  just before its ``Popen`` to its ``first_exchange`` event (``time`` is Unix time, the same
  clock), minus the time from launching ``python -c "import daemon.cli, daemon.service,
  torch._dynamo"`` to the end of its imports, while the trainer trains (median of three,
  during the warm-up; the child reports when, as its exit takes a while longer): interpreter
  start-up and imports, torch's above all, cost any Python daemon alike, and the issue leaves
  them out (``torch._dynamo`` is imported by the first torch optimizer a task builds). The
  peer's ``start`` (imported, task built, listening) and ``download`` (joined, downloaded:
  ready) events give the breakdown.

Why the peer is idle: on this 2-core machine the trainer has one core (``task.threads = 1``)
and a second trainer on the other would take the CPU that the trainer's own exchange work
(snapshot, encryption, delta, on the daemon's other threads) needs, which a peer on another
machine would not. So the peer runs ``mlp10m`` with ``idle = true``: its step sleeps instead
of training. Its exchange work (serialization, encryption, checks, mixing of 42 MB each
way) is real and still runs on this machine, so the overhead measured is if anything too high.

Targets (from the issue): with averaging, at least 90% of the steps/s without; at most 3 s
from launch to the first exchange, imports excluded (hivemind, measured on this kind of
machine elsewhere, not in this run: about 10 s to its first averaging, with silent 30 s
stalls in 2 of 9 runs).

On a GPU (``make gpu-check`` runs this): ``--device cuda --width 4096 --depth 6 --batch 256``,
a 100.7M-parameter model (403 MB) on the GPU in both daemons; the 42 MB above become 403.

Usage: python bench/overhead.py [--quick] [--rounds 5] [--seconds 30] [--keep]
       [--device cpu|auto|cuda|cuda:N] [--width 1024] [--depth 10] [--batch 64]
The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from daemon.config import from_dict, render
from daemon.keys import write_swarm_key
from daemon.metrics import MetricsLogReader

ENTRY = f"{Path(__file__).resolve().with_name('tasks.py')}:mlp10m"
# The model: DEPTH width x width layers and a 10-way head, BATCH samples a step, on DEVICE
# (--width, --depth, --batch, --device set them; the defaults are the 2-core CPU bench's).
WIDTH, DEPTH, BATCH, DEVICE = 1024, 10, 64, "cpu"


def set_model(width: int, depth: int, batch: int, device: str) -> None:
    global WIDTH, DEPTH, BATCH, DEVICE
    WIDTH, DEPTH, BATCH, DEVICE = width, depth, batch, device


def params() -> int:
    return DEPTH * (WIDTH * WIDTH + WIDTH) + WIDTH * 10 + 10
INTERVAL = 5.0  # s, averaging.interval on both daemons
TARGET_RATIO = 0.90  # steps/s with averaging >= this x without
TARGET_FIRST_S = 3.0  # launch to first exchange, imports excluded, at most this
HIVEMIND_FIRST_S = 10.0  # hivemind's time to its first averaging, measured elsewhere
IMPORT_RUNS = 3
START_TIMEOUT = 120.0  # s for a daemon to start, or a joiner to make its first exchange
STOP_TIMEOUT = 60.0  # s for a stopped daemon to exit before it is killed
SETTLE = 1.0  # s after a peer exits before phase A starts
# What a daemon imports: its own modules (torch among them), and torch._dynamo, which the
# first torch.optim optimizer a task builds imports (about 1 s, 800 modules, in torch 2.13).
IMPORTS = "import daemon.cli, daemon.service, torch._dynamo"


class Daemon:
    """One ``python -m daemon run`` process and the events of its metrics log."""

    def __init__(self, directory: Path, name: str, key: bytes, bootstrap: list[str],
                 idle: bool) -> None:
        directory.mkdir(parents=True)
        write_swarm_key(directory / "swarm.key", key)
        data = {
            "node": {"listen": "127.0.0.1:0"},
            "swarm": {"name": name, "bootstrap": bootstrap},
            "task": {"entry": ENTRY, "device": DEVICE, "threads": 1, "progress_interval": 0,
                     "options": {"width": WIDTH, "depth": DEPTH, "batch_size": BATCH,
                                 "idle": idle}},
            "averaging": {"every": 0, "interval": INTERVAL},
            "checkpoint": {"interval": 3600.0},  # none while measuring; one at exit
            "metrics": {"interval": 1.0},
        }
        config = directory / "gossipd.toml"
        config.write_text(render(from_dict(data, directory, str(config))))
        self.directory = directory
        self.events: list[dict[str, Any]] = []
        self._reader = MetricsLogReader(directory / "metrics.jsonl")
        self.launched = time.time()
        with open(directory / "daemon.log", "ab") as log:
            # A session of its own: a Ctrl-C reaches only the bench, which then stops this.
            self.process = subprocess.Popen(
                [sys.executable, "-m", "daemon", "run", "-c", str(config)], stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def poll(self) -> None:
        self.events += self._reader.read()

    def find(self, event: str, after: float = 0.0, **match: Any) -> dict[str, Any] | None:
        return next((e for e in self.events if e["event"] == event and e["time"] >= after
                     and all(e.get(k) == v for k, v in match.items())), None)

    def wait_for(self, event: str, after: float = 0.0, **match: Any) -> dict[str, Any]:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            self.poll()
            found = self.find(event, after, **match)
            if found is not None:
                return found
            if self.process.poll() is not None:
                raise SystemExit(f"{self.directory.name} exited with code "
                                 f"{self.process.returncode}:\n{self.tail()}")
            time.sleep(0.05)
        raise SystemExit(f"no {event} event from {self.directory.name} within "
                         f"{START_TIMEOUT:g} s:\n{self.tail()}")

    def tail(self) -> str:
        return "\n".join((self.directory / "daemon.log").read_text(errors="replace")
                         .splitlines()[-8:])

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited within STOP_TIMEOUT."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.poll()


def import_seconds() -> float:
    """From launching ``python -c IMPORTS`` to the end of its imports: the child reports the
    time, since its exit (tearing down torch and some 2,000 modules) takes a while longer."""
    started = time.time()
    code = f"{IMPORTS}; import os, time; print(time.time(), flush=True); os._exit(0)"
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    return float(done.stdout) - started


def sleep_until(t: float, *running: Daemon) -> None:
    """Sleep until Unix time ``t``, failing early if one of the ``running`` daemons exits."""
    while (left := t - time.time()) > 0:
        time.sleep(min(left, 0.5))
        for d in running:
            if d.process.poll() is not None:
                raise SystemExit(f"{d.directory.name} exited early:\n{d.tail()}")


def measure(root: Path, rounds: int, seconds: float, warmup: float) -> dict[str, Any]:
    """Run the trainer and its peers; returns the trainer's events, the phase windows, the
    peers' launch times and events, and the import times."""
    key, name = secrets.token_bytes(32), f"bench-{secrets.token_hex(3)}"
    daemons: list[Daemon] = []
    try:
        trainer = Daemon(root / "trainer", name, key, [], idle=False)
        daemons.append(trainer)
        address = trainer.wait_for("start")["address"]
        warm_end = trainer.wait_for("progress")["time"] + warmup
        imports = [import_seconds() for _ in range(IMPORT_RUNS)]  # on the other core
        sleep_until(warm_end, trainer)
        alone, paired, peers = [], [], []
        for r in range(rounds + 1):
            t0 = time.time()
            sleep_until(t0 + seconds, trainer)
            alone.append((t0, time.time()))
            if r == rounds:
                break
            print(f"round {r + 1}/{rounds}: alone done; launching a peer", file=sys.stderr)
            peer = Daemon(root / f"peer{r}", name, key, [address], idle=True)
            daemons.append(peer)
            first = peer.wait_for("first_exchange")
            b0 = trainer.wait_for("exchange", first["time"] - 1.0, result="committed")["time"]
            sleep_until(b0 + seconds, trainer, peer)
            paired.append((b0, time.time()))
            peer.stop()
            peers.append({"launched": peer.launched, "events": peer.events,
                          "code": peer.process.returncode})
            sleep_until(time.time() + SETTLE, trainer)
        # When exchanges move the trainer's step, local_steps falls back on the metrics
        # events, one a second: let one land after the last window's end.
        sleep_until(time.time() + 1.5, trainer)
        trainer.stop()
        return {"events": trainer.events, "alone": alone, "paired": paired, "peers": peers,
                "imports": imports, "code": trainer.process.returncode}
    finally:
        for d in daemons:  # on an error or Ctrl-C; a no-op for those already stopped
            d.stop()


# ---- analysis ----------------------------------------------------------------------------


def local_steps(events: list[dict[str, Any]]) -> tuple[list[tuple[float, float]], bool]:
    """(time, steps trained here) at each chunk's end, and whether the merged step stayed
    local (else the points come from the ``metrics`` events' samples, once a second)."""
    metrics = [e for e in events if e["event"] == "metrics"]
    local = all(e["step"] * BATCH == e["samples"] for e in metrics)
    if local:
        return [(e["time"], e["step"]) for e in events if e["event"] == "progress"], True
    return [(e["time"], e["samples"] / BATCH) for e in metrics], False


def at(points: list[tuple[float, float]], t: float) -> float:
    """Steps at time ``t``, linear between points (steps are spread evenly over a chunk)."""
    for (t0, s0), (t1, s1) in zip(points, points[1:]):
        if t0 <= t <= t1:
            return s0 + (s1 - s0) * (t - t0) / (t1 - t0) if t1 > t0 else s1
    raise SystemExit(f"no progress events around {t}")


def rate(points: list[tuple[float, float]], window: tuple[float, float]) -> float:
    return (at(points, window[1]) - at(points, window[0])) / (window[1] - window[0])


def chunks(points: list[tuple[float, float]],
           windows: list[tuple[float, float]]) -> list[tuple[float, float, float]]:
    """(start, end, steps/s) of each chunk inside one of ``windows``."""
    return [(t0, t1, (s1 - s0) / (t1 - t0)) for (t0, s0), (t1, s1) in zip(points, points[1:])
            if t1 > t0 and any(a <= t0 and t1 <= b for a, b in windows)]


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="2 rounds of 10 s phases (about 80 s)")
    parser.add_argument("--rounds", type=int, help="A/B rounds and joiners (default 5; 2 quick)")
    parser.add_argument("--seconds", type=float, help="s per phase (default 30; 10 quick)")
    parser.add_argument("--keep", action="store_true", help="keep the daemons' directories")
    parser.add_argument("--device", default=DEVICE,
                        help="task.device of both daemons: cpu (default), auto, cuda or cuda:N")
    parser.add_argument("--width", type=int, default=WIDTH, help=f"default {WIDTH}")
    parser.add_argument("--depth", type=int, default=DEPTH, help=f"default {DEPTH}")
    parser.add_argument("--batch", type=int, default=BATCH, help=f"default {BATCH}")
    args = parser.parse_args()
    set_model(args.width, args.depth, args.batch, args.device)
    rounds = args.rounds or (2 if args.quick else 5)
    seconds = args.seconds or (10.0 if args.quick else 30.0)
    root = Path(tempfile.mkdtemp(prefix="gossipd-overhead-"))
    signal.signal(signal.SIGTERM, _interrupt)  # the same clean-up as Ctrl-C
    load_before, started = os.getloadavg()[0], time.monotonic()
    try:
        run = measure(root, rounds, seconds, warmup=10.0 if args.quick else 15.0)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    elapsed, load_after = time.monotonic() - started, os.getloadavg()[0]
    report(run, rounds, seconds, elapsed, load_before, load_after,
           str(root) if args.keep else None)


def report(run: dict[str, Any], rounds: int, seconds: float, elapsed: float,
           load_before: float, load_after: float, kept: str | None) -> None:
    events = run["events"]
    points, local = local_steps(events)
    alone = [rate(points, w) for w in run["alone"]]
    paired = [rate(points, w) for w in run["paired"]]
    a, b = statistics.median(alone), statistics.median(paired)
    # Each with-peer phase against the mean of the alone phases around it: linear drift in
    # the machine's speed cancels.
    ratios = [q / ((p0 + p1) / 2) for p0, q, p1 in zip(alone, paired, alone[1:])]
    ratio = statistics.median(ratios)
    exchanges = [e for e in events if e["event"] == "exchange"
                 and any(w0 <= e["time"] <= w1 for w0, w1 in run["paired"])]
    committed = [e for e in exchanges if e["result"] == "committed"]
    durations = [e["seconds"] for e in committed]
    others = {r: sum(e["result"] == r for e in exchanges)
              for r in ("busy", "rejected", "invalid", "failed")}
    paired_s = sum(w1 - w0 for w0, w1 in run["paired"])
    lost = (1 - ratio) * paired_s / len(committed) if committed else 0.0  # s of training
    spans = [(e["time"] - e["seconds"], e["time"]) for e in committed]
    during, outside = [], []
    for t0, t1, r in chunks(points, run["paired"]):
        (during if any(s0 < t1 and t0 < s1 for s0, s1 in spans) else outside).append(r)
    gaps = {name: max(t1 - t0 for t0, t1, _ in chunks(points, run[name]))
            for name in ("alone", "paired")}

    imports = statistics.median(run["imports"])
    trials = []
    for peer in run["peers"]:
        t, pe = peer["launched"], peer["events"]
        up, ready, first = (next((e["time"] - t for e in pe if e["event"] == name), math.nan)
                            for name in ("start", "download", "first_exchange"))
        trials.append({"up": up, "ready": ready, "first": first, "net": first - imports})
    net = [tr["net"] for tr in trials]
    first_s, first_max = statistics.median(net), max(net)
    verdict = {True: "met", False: "MISSED"}

    print(f"\nbench/tasks.py:mlp10m, {params():,} float32 parameters "
          f"({params() * 4 / 1e6:.0f} MB), batch {BATCH}, on {DEVICE}, "
          f"one torch thread; averaging.interval {INTERVAL:g} s on both daemons; "
          f"{rounds} rounds of {seconds:g} s alone, then {seconds:g} s with an idle peer; "
          f"{seconds:g} s alone to end")
    print(f"{'phase':<34}{'steps/s':>8}{'min':>8}{'max':>8}{'vs alone':>10}"
          f"{'longest chunk s':>17}")
    print(f"{'alone (rounds find no peer)':<34}{a:>8.2f}{min(alone):>8.2f}{max(alone):>8.2f}"
          f"{1:>10.3f}{gaps['alone']:>17.2f}")
    print(f"{'with a peer (averaging)':<34}{b:>8.2f}{min(paired):>8.2f}{max(paired):>8.2f}"
          f"{ratio:>10.3f}{gaps['paired']:>17.2f}")
    print("vs alone: the median over rounds of each with-peer phase over the mean of the two "
          "alone phases around it: " + " ".join(f"{r:.3f}" for r in ratios))
    print(f"exchanges in the with-peer phases: {len(committed)} committed "
          f"({60 * len(committed) / paired_s:.1f}/min), "
          + ", ".join(f"{n} {r}" for r, n in others.items())
          + (f"; duration median {statistics.median(durations):.3f} s, max "
             f"{max(durations):.3f} s, {params() * 4 / 1e6:.0f} MB each way (fp32)"
             if durations else ""))
    if during and outside:
        print(f"trainer chunks overlapping an exchange: {statistics.median(during):.2f} "
              f"steps/s (n={len(during)}); the others: {statistics.median(outside):.2f} "
              f"(n={len(outside)}); training time lost per exchange: {lost:.3f} s")
    if not local:
        print("note: the merged step ran ahead of the trainer's own; steps counted from the "
              "metrics events' samples instead")

    print(f"\njoiner: launch to first exchange ({len(trials)} joiners, bootstrap = the trainer, "
          "no checkpoint: each downloads the state first), seconds")
    print(f"{'joiner':<8}{'start':>8}{'ready':>8}{'first exchange':>16}{'minus imports':>15}")
    for i, tr in enumerate(trials, 1):
        print(f"{i:<8}{tr['up']:>8.2f}{tr['ready']:>8.2f}{tr['first']:>16.2f}{tr['net']:>15.2f}")
    print(f"imports (python -c '{IMPORTS}', from launch to imported, while the trainer "
          f"trains): median {imports:.2f} s of " + ", ".join(f"{x:.2f}" for x in run["imports"]))
    print("start: imports, task built, listening; ready: joined and downloaded; first exchange: "
          "its first committed exchange (either side's round)")
    print(f"hivemind (ref., measured elsewhere): about {HIVEMIND_FIRST_S:g} s to its first "
          "averaging, with silent 30 s stalls in 2 of 9 runs")
    print(f"target: steps/s with averaging >= {TARGET_RATIO:.0%} of without: "
          f"{verdict[ratio >= TARGET_RATIO]} ({ratio:.1%})")
    print(f"target: first exchange <= {TARGET_FIRST_S:g} s after launch, imports excluded: "
          f"{verdict[first_max <= TARGET_FIRST_S]} (median {first_s:.2f} s, max {first_max:.2f} s)")
    print(f"wall time {elapsed:.0f} s; {os.cpu_count()} CPUs, 1-minute load average "
          f"{load_before:.2f} before, {load_after:.2f} after; daemon exit codes: trainer "
          f"{run['code']}, peers {[p['code'] for p in run['peers']]}"
          + (f"; files in {kept}" if kept else ""))
    print(json.dumps({
        "overhead_ratio": round(ratio, 4),
        "steps_per_s": round(b, 3),
        "steps_per_s_alone": round(a, 3),
        "first_exchange_s": round(first_s, 3),
        "first_exchange_max_s": round(first_max, 3),
        "first_exchange_raw_s": round(statistics.median(tr["first"] for tr in trials), 3),
        "import_s": round(imports, 3),
        "exchange_s": round(statistics.median(durations), 4) if durations else None,
        "exchanges_per_min": round(60 * len(committed) / paired_s, 2),
        "exchanges_not_committed": sum(others.values()),
        "lost_per_exchange_s": round(lost, 4),
        "params": params(),
        "device": DEVICE,
        "rounds": rounds,
        "seconds": seconds,
        "loadavg": round(load_before, 2),
    }))


if __name__ == "__main__":
    main()
