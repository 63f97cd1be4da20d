"""A node of 2 processes against 2 nodes of 1: throughput, and what its state broadcasts cost.

Throughput. On this one machine, the same task two ways, each for the same wall time in a
swarm with one more node of one process (the *peer*) that they exchange with:

* (a) one node of two processes (``task.processes = 2``: process 0 speaks to the swarm, both
  train; the gradients are averaged over gloo at every step and, at each step boundary after
  process 0 applied a committed exchange's delta, it broadcasts its state to process 1:
  ``gossip/nodegroup.py``);
* (b) two nodes of one process each.

Every process trains with one torch thread (``task.threads = 1``), so both setups run three
training processes (a: the node's two and the peer; b: the two nodes and the peer) on this
machine's cores: the same CPU. The daemons run with their default averaging settings (a
round every local step, drift correction on) except ``averaging.start = own`` (no download
at start-up). Each setup's clock starts once its nodes and the peer see each other alive,
each node under test has committed an exchange, and 3 more seconds have passed; then
the nodes' ``samples`` counters (``gossipd status``, read through the control socket; a node
of two counts both processes' batches) are read at the start and at the end of the window.
samples/s is the difference over the window, summed over the nodes under test; the ratio is
(a) / (b). The CPU time of every process of the nodes under test (``/proc/<pid>/stat``) is
read with the counters: samples per CPU second, and its ratio, say how well each setup used
the CPU it got, a figure that other work on a shared machine moves less than samples/s.
Two tasks: ``daemon.tasks.charlm:task`` (a small transformer, about 15 ms a step on one
core: the main row) and ``daemon.tasks.digits:task`` (an MLP whose step takes well
under a millisecond, where the two collectives every step, a header of a few integers and
the gradient all-reduce, cost more than the step). One peer per task serves both setups, which
run one after the other, ``--repeats`` times (2), in the order a b b a ... for charlm and
b a a b ... for digits, so that a drift in the machine's load weighs on both; the table
shows means.

The broadcast's share. For the node of two processes over the same window: committed
exchanges and their mean ``seconds`` (the ``exchange`` events of its metrics log, initiated
and answered), and the state broadcasts (``processes.syncs`` and ``sync_seconds`` in its
status, the window's difference); share = broadcast / (exchange + broadcast), per committed
exchange. The two are not alike in one way: an exchange runs on process 0's network side
while both processes train, a broadcast stops both processes' training for its duration; so
the table also gives the fraction of the window process 0 spent in broadcasts, in the
gradient averages and in the per-step headers.

Micro-measure, no daemon: two processes with ``torch.distributed`` (gloo, 127.0.0.1, one
torch thread each) hold a model of 1M, 10M and 50M float32 parameters (five equal tensors;
50M not with ``--quick``) and a :class:`~gossip.nodegroup.NodeGroup` over a replica that
keeps a drift correction (as the daemon does by default: a broadcast then carries the
parameters and the correction's ``c``, twice the model's bytes). Each trial times one
``group.boundary()`` on process 0 with nothing queued (the header alone) and one after
queueing a delta (``Replica.queue``: the boundary applies it, then broadcasts the state); the
broadcast's own time is the group's ``sync_seconds``. Beside it, one averaging exchange of
the same model on 127.0.0.1 as ``bench/exchange.py`` times it, through the same helper
(``bench/averaging.py``'s ``Bench``), with the drift correction on (``full fp32``: the
parameters and the correction's estimate each way, encrypted) as the daemon exchanges.
Medians of ``--trials`` after a warm-up.

Nothing here asserts on time. This machine's cores may be shared with other work (the load
average is printed): compare the ratios of one run, not its absolute figures with another's.

Usage: python bench/processes.py [--quick] [--window 30] [--repeats 2] [--trials 5]
                                 [--sizes 1,10,50] [--keep]
``--quick`` (part of ``make bench``, under 3 minutes): one 15 s window per setup, sizes 1M
and 10M, 3 trials.
Progress goes to stderr; writes bench/results/processes.json; the last line printed is one
JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import gc
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

from common import progress, save_json, table

TASKS = {"charlm": "daemon.tasks.charlm:task", "digits": "daemon.tasks.digits:task"}
ORDERS = {"charlm": ("a", "b"), "digits": ("b", "a")}  # the first repetition's; then reversed
SETUPS = {"a": (1, 2), "b": (2, 1)}  # nodes under test, processes per node
LABELS = {"a": "(a) 1 node x 2 processes", "b": "(b) 2 nodes x 1 process"}
COMMON = ("task.threads=1", "averaging.start=own", "metrics.interval=0.5",
          "task.progress_interval=3600", "checkpoint.interval=3600")
WINDOW = {"quick": 15.0, "full": 30.0}  # s of each setup's measured window
REPEATS = {"quick": 1, "full": 2}  # runs of each setup per task
WARMUP = 3.0  # s after start-up before the window opens
START_TIMEOUT = 180.0  # s for daemons to start and see each other (a loaded 2-core machine)
SIZES = {"quick": "1,10", "full": "1,10,50"}  # millions of parameters, the micro-measure
TRIALS = {"quick": 3, "full": 5}
EXCHANGE = "full fp32"  # bench/averaging.py's method: fp32 exchange with the correction


# ---- (1) throughput: real daemons -----------------------------------------------------------


def alive(daemon: Any) -> int:
    m = daemon.last("metrics")
    return m["peers"]["alive"] if m else 0


def read(daemon: Any) -> dict[str, Any]:
    """The daemon's status through its control socket, with the wall and monotonic time and
    the CPU time of its processes."""
    from daemon.control import query

    status = query(daemon.config.path(daemon.config.node.control))
    pids = [daemon.pid, *daemon.children()]
    return {"status": status, "mono": time.monotonic(), "wall": time.time(),
            "cpu": sum(cpu_seconds(pid) for pid in pids)}


def cpu_seconds(pid: int) -> float:
    """CPU time (user and system) process ``pid`` has used so far. Linux only."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_setup(swarm: Any, peer: Any, task: str, setup: str, tag: str,
              window: float) -> dict[str, Any]:
    """Start the setup's nodes beside ``peer``, measure a window, stop them."""
    from daemon.testing import wait_for

    count, procs = SETUPS[setup]
    extra = [f"task.processes={procs}"] if procs > 1 else []
    nodes = [swarm.add(f"{task}-{setup}-{tag}-{i}", bootstrap=[peer], task=TASKS[task], base=(),
                       settings=[*COMMON, *extra]).start() for i in range(count)]
    everyone = [*nodes, peer]
    try:
        wait_for(lambda: all(d.last("start") for d in nodes), START_TIMEOUT, everyone,
                 "the nodes to start")
        wait_for(lambda: all(alive(d) >= len(everyone) - 1 for d in everyone), START_TIMEOUT,
                 everyone, "every node to see the others alive")
        wait_for(lambda: all(d.committed() >= 1 for d in nodes), START_TIMEOUT, everyone,
                 "every node under test to commit an exchange")
        time.sleep(WARMUP)
        before = {d.name: read(d) for d in everyone}
        time.sleep(window)
        after = {d.name: read(d) for d in everyone}
        for d in everyone:
            if not d.running:
                raise SystemExit(f"{d.name} exited during the window:\n{d.text()[-3000:]}")
    finally:
        for d in nodes:
            if d.running:
                d.signal(signal.SIGTERM)
        for d in nodes:
            try:
                d.wait_exit(60)
            except subprocess.TimeoutExpired:
                d.kill9()

    def rate(d: Any, key: str = "samples") -> float:
        b, a = before[d.name], after[d.name]
        value = (lambda r: r[key]) if key == "cpu" else (lambda r: r["status"][key])
        return (value(a) - value(b)) / (a["mono"] - b["mono"])

    out: dict[str, Any] = {"setup": setup, "rates": [rate(d) for d in nodes],
                           "peer_rate": rate(peer), "cores": sum(rate(d, "cpu") for d in nodes),
                           "peer_cores": rate(peer, "cpu"), "nodes": []}
    out["samples_per_s"] = sum(out["rates"])
    for d in nodes:
        b, a = before[d.name], after[d.name]
        seconds = a["mono"] - b["mono"]
        events = [e for e in d.of("exchange") if b["wall"] <= e["time"] <= a["wall"]]
        committed = [e["seconds"] for e in events if e["result"] == "committed"]
        node = {"seconds": seconds,
                "steps": a["status"]["own_steps"] - b["status"]["own_steps"],
                "exchanges": len(events), "committed": len(committed),
                "exchange_s": statistics.mean(committed) if committed else math.nan}
        group_b, group_a = b["status"]["processes"], a["status"]["processes"]
        if group_a is not None:
            node["group"] = {k: group_a[k] - group_b[k] for k in
                             ("syncs", "sync_seconds", "header_seconds", "gradient_seconds")}
        out["nodes"].append(node)
    return out


def throughput(root: Path, task: str, window: float, repeats: int) -> list[dict[str, Any]]:
    """Every setup of ``task`` ``repeats`` times, beside one peer; the runs in order."""
    from daemon.testing import DaemonSwarm, wait_for

    first = ORDERS[task]
    order = [s for r in range(repeats) for s in (first if r % 2 == 0 else first[::-1])]
    runs = []
    with DaemonSwarm(root / task, f"processes-{secrets.token_hex(3)}") as swarm:
        peer = swarm.add(f"{task}-peer", task=TASKS[task], base=(), settings=COMMON).start()
        wait_for(lambda: peer.last("start"), START_TIMEOUT, [peer], "the peer to start")
        for k, setup in enumerate(order):
            progress(f"{task} {LABELS[setup]}: starting ({k + 1}/{len(order)})")
            run = run_setup(swarm, peer, task, setup, str(k), window)
            progress(f"{task} {LABELS[setup]}: {run['samples_per_s']:.0f} samples/s, "
                     f"{run['cores']:.2f} cores (peer {run['peer_rate']:.0f}, "
                     f"{run['peer_cores']:.2f}); committed "
                     f"{[n['committed'] for n in run['nodes']]}; load "
                     f"{os.getloadavg()[0]:.2f}")
            runs.append(run)
    return runs


# ---- (2) the state broadcast alone: two gloo processes --------------------------------------


def broadcasts(root: Path, sizes: list[int], trials: int) -> list[dict[str, Any]]:
    """Run the two group workers; process 0's figures, per size."""
    from daemon.processes import free_port

    port, out = free_port(), root / "broadcast.json"
    procs = [subprocess.Popen([sys.executable, __file__, "--group-rank", str(rank), "--port",
                               str(port), "--sizes", millions(sizes), "--trials",
                               str(trials), "--out", str(out)], stdin=subprocess.DEVNULL)
             for rank in (0, 1)]
    codes = [p.wait() for p in procs]
    if any(codes) or not out.exists():
        raise SystemExit(f"the group workers exited with {codes}")
    return json.loads(out.read_text())


def group_worker(rank: int, port: int, sizes: list[int], trials: int, out: Path) -> None:
    """Process ``rank`` of a node of two: time boundaries with and without a queued delta."""
    import datetime

    import torch
    import torch.distributed as dist

    import averaging
    from exchange import release
    from gossip.nodegroup import NodeGroup
    from gossip.replica import Replica

    import gossip.nodegroup
    gossip.nodegroup.SYNC_SPACING = 0.0  # time each broadcast: none deferred to space them
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=START_TIMEOUT))
    results = []
    for numel in sizes:
        model = averaging.build_model(numel)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        replica = Replica(model, optimizer=optimizer)  # a correction, as the daemon's default
        group = NodeGroup(model, optimizer)
        group.start(replica)
        times: dict[str, list[float]] = {"header": [], "state": [], "broadcast": []}
        delta = None
        for trial in range(trials + 1):  # the first: a warm-up
            for queued in ((False, True) if trial % 2 else (True, False)):
                if queued and group.speaker:
                    delta = replica.buffer()
                    delta.normal_(std=1e-3)
                    replica.queue(delta, scale=0.5, correction=0.5, weight=None,
                                  sent_weight=1.0)
                dist.barrier(group=group.control)
                synced = group.statistics().sync_seconds
                started = time.perf_counter()
                group.boundary()
                seconds = time.perf_counter() - started
                if trial:
                    times["state" if queued else "header"].append(seconds)
                    if queued:
                        times["broadcast"].append(group.statistics().sync_seconds - synced)
        stats = group.statistics()
        if group.speaker:
            group.finish()
        else:
            group.boundary()  # reads the speaker's stop
        group.close()
        replica.close()
        results.append({"numel": numel, "model_bytes": 4 * numel,
                        "bytes": stats.sync_bytes / stats.syncs,
                        **{k: statistics.median(v) for k, v in times.items()}, "times": times})
        del model, optimizer, replica, group, delta
        release()
        if rank == 0:
            progress(f"broadcast {label(numel)}: {results[-1]['broadcast'] * 1e3:.1f} ms")
    if rank == 0:
        out.write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def exchanges(sizes: list[int], trials: int) -> dict[int, dict[str, Any]]:
    """One exchange of each size between two processes (bench/averaging.py's workers)."""
    import averaging

    results = averaging.run_workers(__file__, "--trials", str(trials), "--sizes",
                                    millions(sizes))
    return {numel: {"seconds": statistics.median(a["times"][EXCHANGE]),
                    "bytes_sent": a["exchange"][EXCHANGE]["bytes_sent"]}
            for numel, a in zip(sizes, results["a"])}


def exchange_worker(role: str, key: bytes, trials: int, sizes: list[int]) -> None:
    import averaging
    from exchange import release

    class ExchangeOnly(averaging.Bench):
        """The exchange alone: no plain TCP transfers to warm up."""

        def __init__(self, *args: Any) -> None:
            super().__init__(*args, methods=(EXCHANGE,))
            self.tcp = {}

    averaging.prepare(role)
    for numel in sizes:
        ExchangeOnly(averaging.Link(), averaging.build_model(numel), key).run(role, trials)
        release()
        if role == "a":
            progress(f"exchange {label(numel)}: done")


# ---- the report -----------------------------------------------------------------------------


def mean(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.mean(values) if values else math.nan


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A task's figures: per setup, means over its repetitions; the group's sums."""
    out: dict[str, Any] = {}
    for setup in SETUPS:
        mine = [r for r in runs if r["setup"] == setup]
        nodes = [n for r in mine for n in r["nodes"]]
        seconds = sum(n["seconds"] for n in nodes)
        out[setup] = {
            "samples_per_s": statistics.mean(r["samples_per_s"] for r in mine),
            "peer_samples_per_s": statistics.mean(r["peer_rate"] for r in mine),
            "cores": statistics.mean(r["cores"] for r in mine),
            "per_cpu": statistics.mean(r["samples_per_s"] / r["cores"] for r in mine),
            "peer_cores": statistics.mean(r["peer_cores"] for r in mine),
            "step_ms": 1e3 * seconds / max(1, sum(n["steps"] for n in nodes)),
            "committed_per_s": statistics.mean(n["committed"] / n["seconds"] for n in nodes),
            "exchange_s": mean([n["exchange_s"] for n in nodes]),
        }
        groups = [n["group"] for n in nodes if "group" in n]
        if groups:
            total = {k: sum(g[k] for g in groups) for k in groups[0]}
            committed = sum(n["committed"] for n in nodes)
            steps = sum(n["steps"] for n in nodes)
            exchange_s = sum(n["exchange_s"] * n["committed"] for n in nodes
                             if n["committed"]) / max(1, committed)
            broadcast_s = total["sync_seconds"] / total["syncs"] if total["syncs"] else math.nan
            out[setup] |= {
                "committed": committed, "syncs": total["syncs"], "exchange_s": exchange_s,
                "broadcast_s": broadcast_s,
                "broadcast_share": broadcast_s / (exchange_s + broadcast_s),
                "broadcast_fraction": total["sync_seconds"] / seconds,
                "gradient_fraction": total["gradient_seconds"] / seconds,
                "header_fraction": total["header_seconds"] / seconds,
                "gradient_ms": 1e3 * total["gradient_seconds"] / max(1, steps),
                "header_ms": 1e3 * total["header_seconds"] / max(1, steps),
            }
    out["ratio"] = out["a"]["samples_per_s"] / out["b"]["samples_per_s"]
    out["cpu_ratio"] = out["a"]["per_cpu"] / out["b"]["per_cpu"]
    return out


def label(numel: int) -> str:
    return f"{numel / 1e6:g}M"


def millions(sizes: list[int]) -> str:
    """``--sizes`` for a worker: ``1,10`` for 1M and 10M parameters."""
    return ",".join(f"{n / 1e6:g}" for n in sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="one 15 s window per setup, sizes 1M and 10M, 3 trials "
                             "(under 3 minutes)")
    parser.add_argument("--window", type=float, help="s each setup is measured (30; 15 quick)")
    parser.add_argument("--repeats", type=int,
                        help="runs of each setup per task, in the order a b b a ... (2; 1 "
                             "quick)")
    parser.add_argument("--trials", type=int, help="timed trials per size (5; 3 quick)")
    parser.add_argument("--sizes", help="micro-measure sizes, millions of parameters, "
                                        "comma-separated (1,10,50; 1,10 quick)")
    parser.add_argument("--keep", action="store_true", help="keep the daemons' directories")
    parser.add_argument("--group-rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=["a", "b"], help=argparse.SUPPRESS)
    parser.add_argument("--key", help=argparse.SUPPRESS)
    args = parser.parse_args()
    mode = "quick" if args.quick else "full"
    trials = args.trials or TRIALS[mode]
    sizes = [round(float(s) * 1e6) for s in (args.sizes or SIZES[mode]).split(",")]
    if args.group_rank is not None:
        group_worker(args.group_rank, args.port, sizes, trials, args.out)
        return
    if args.worker:
        exchange_worker(args.worker, bytes.fromhex(args.key), trials, sizes)
        return
    window = args.window or WINDOW[mode]
    repeats = args.repeats or REPEATS[mode]

    started, load_before = time.monotonic(), os.getloadavg()[0]
    root = Path(tempfile.mkdtemp(prefix="gossipd-processes-"))
    try:
        runs = {task: throughput(root, task, window, repeats) for task in TASKS}
        micro = broadcasts(root, sizes, trials)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    gc.collect()
    exchange = exchanges(sizes, trials)
    elapsed, load_after = time.monotonic() - started, os.getloadavg()[0]
    summary = {task: summarize(r) for task, r in runs.items()}
    report(summary, micro, exchange, window, repeats, trials, elapsed,
           (load_before, load_after), runs)


def report(summary: dict[str, Any], micro: list[dict[str, Any]],
           exchange: dict[int, dict[str, Any]], window: float, repeats: int, trials: int,
           elapsed: float, load: tuple[float, float], runs: dict[str, Any]) -> None:
    rows = []
    for task, s in summary.items():
        for setup in SETUPS:
            r = s[setup]
            rows.append([task, LABELS[setup], r["samples_per_s"],
                         f"{s['ratio']:.2f}" if setup == "a" else "1", r["per_cpu"],
                         f"{s['cpu_ratio']:.2f}" if setup == "a" else "1",
                         f"{r['step_ms']:.2f}",
                         f"{r['gradient_ms']:.2f} + {r['header_ms']:.2f}" if setup == "a"
                         else "-",
                         r["peer_samples_per_s"], f"{r['cores']:.2f} / {r['peer_cores']:.2f}",
                         f"{r['committed_per_s']:.1f}"])
    print(f"\n1. Throughput: one node of 2 processes vs two nodes of 1, each beside a peer node "
          f"of 1; {window:g} s windows after start-up, mean of {repeats} run(s) each")
    print(table(["task", "setup", "samples/s", "vs (b)", "per CPU-s", "vs (b)", "ms/step",
                 "grad + header ms", "peer samples/s", "cores used", "commits/s/node"], rows))
    print("\n".join([
        "samples/s: the node(s) under test over the window, from their status 'samples' "
        "(a node of 2 counts both processes' batches); vs (b): (a) / (b); per CPU-s: samples "
        "per CPU second their processes used (/proc), which other work on the machine moves "
        "less.",
        "ms/step: wall time per step of a node under test (a step of a node of 2 is one batch "
        "on each process); grad + header: its per-step all-reduce of the gradients and the "
        "step boundary's header broadcast (process 0's time in them, from the node's status, "
        "waiting for process 1 to get there included).",
        f"Every process has one torch thread and this machine has {os.cpu_count()} cores: (a) "
        "runs 3 training processes (the node's 2 and the peer), (b) 3 too (2 nodes and the "
        "peer): the same CPU, shared. cores used: CPU seconds per second of the node(s) under "
        "test (every process) / of the peer, what their share came to. (b) also has 3 swarm "
        "members exchanging where (a) has 2, which costs it CPU.",
    ]))

    rows = []
    for task, s in summary.items():
        r = s["a"]
        rows.append([task, r["committed"], f"{r['exchange_s'] * 1e3:.1f}", r["syncs"],
                     f"{r['broadcast_s'] * 1e3:.2f}", f"{r['broadcast_share']:.1%}",
                     f"{r['broadcast_fraction']:.1%}", f"{r['gradient_fraction']:.1%}",
                     f"{r['header_fraction']:.1%}"])
    print("\n2. The state broadcast against the exchange, node of 2 processes (a), same windows")
    print(table(["task", "commits", "exchange ms", "broadcasts", "broadcast ms", "share",
                 "window in bcast", "in grad avg", "in headers"], rows))
    print("exchange ms: mean of its committed exchanges (initiated and answered; they run "
          "beside training); broadcast ms: sync_seconds / syncs; share: broadcast / "
          "(exchange + broadcast); window in ...: fraction of the window process 0 spent in "
          "the broadcasts (which stop both processes' training), gradient averages, headers.")

    rows = []
    for m in micro:
        x = exchange.get(m["numel"], {})
        rows.append([label(m["numel"]), f"{m['bytes'] / 1e6:.0f}",
                     f"{m['header'] * 1e3:.2f}", f"{m['state'] * 1e3:.1f}",
                     f"{m['broadcast'] * 1e3:.1f}", f"{m['bytes'] / m['broadcast'] / 1e9:.2f}",
                     f"{x['seconds'] * 1e3:.0f}" if x else "-",
                     f"{m['broadcast'] / x['seconds']:.2f}" if x else "-"])
    print(f"\n   The broadcast alone: 2 gloo processes on 127.0.0.1, a NodeGroup over a replica "
          f"with the drift correction; medians of {trials} after a warm-up")
    print(table(["params", "bcast MB", "boundary ms", "+ delta ms", "broadcast ms", "GB/s",
                 "exchange ms", "bcast / exch"], rows))
    print("boundary: group.boundary() with nothing queued (the header); + delta: after "
          "queueing a delta (apply, header, broadcast); broadcast: its state broadcast alone "
          "(sync_seconds), parameters + correction c; exchange: one fp32 exchange with the "
          "correction between two processes (bench/averaging.py's Bench, 'full fp32'), as "
          "bench/exchange.py times it.")
    print(f"wall time {elapsed:.0f} s; {os.cpu_count()} CPUs, 1-minute load average "
          f"{load[0]:.2f} before, {load[1]:.2f} after (other work on the machine moves every "
          "figure here; compare ratios within one run)")

    charlm, digits = summary["charlm"], summary["digits"]
    headline = {"bench": "processes",
                "throughput_ratio_charlm": round(charlm["ratio"], 3),
                "throughput_ratio_digits": round(digits["ratio"], 3),
                "per_cpu_ratio_charlm": round(charlm["cpu_ratio"], 3),
                "per_cpu_ratio_digits": round(digits["cpu_ratio"], 3),
                "broadcast_share": round(charlm["a"]["broadcast_share"], 4),
                "broadcast_share_digits": round(digits["a"]["broadcast_share"], 4),
                "broadcast_window_fraction_charlm": round(charlm["a"]["broadcast_fraction"], 4),
                **{f"broadcast_ms_{label(m['numel'])}": round(m["broadcast"] * 1e3, 2)
                   for m in micro},
                **{f"exchange_ms_{label(n)}": round(x["seconds"] * 1e3, 1)
                   for n, x in exchange.items()},
                "window_s": window, "loadavg": round(load[0], 2)}
    save_json("processes", {**headline, "repeats": repeats, "trials": trials,
                            "wall_s": round(elapsed, 1), "summary": summary, "runs": runs,
                            "micro": micro, "exchange": {str(k): v for k, v in exchange.items()}})
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
