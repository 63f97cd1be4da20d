"""Stragglers: gossip daemons against synchronous all-reduce (DDP) and local SGD, on one machine.

Four workers train the same task, ``bench/tasks.py:teacher``: a 400K-parameter MLP learning
a fixed random linear labelling of 256-dimensional Gaussian inputs, batch 256, SGD with
momentum 0.9 at lr 0.05, one torch thread each; worker *i* draws its own endless stream of
samples (independent draws from one distribution), and every method's worker *i* draws the
same stream. Three methods, each run without and with a straggler, in one run of this script
on 127.0.0.1, the six runs repeated ``--repeats`` times (3; the tables show medians):

* gossip: four real daemons (``python -m daemon run``) with the default averaging settings:
  each starts an exchange with a random peer every local step (``averaging.every`` = 1), or as
  soon as the last one ends when an exchange takes longer than a step, and keeps the
  drift correction (on IID data, as here, it has next to nothing to correct).
* DDP: ``torch.distributed`` over gloo with ``DistributedDataParallel``: the gradients are
  all-reduced (averaged) at every step, so every step waits for the slowest worker. The same
  learning rate: the step sees a batch of 4 x 256.
* local SGD: each worker steps on its own and every ``H`` = 32 steps the workers all-reduce
  (average) their weights over gloo, which also waits for the slowest.

The straggler is worker 3, 4 times slower per step: after each step it keeps its core busy
(``tasks.burn``: small matrix products) for 3 times a step's compute time, the median step
of local SGD's workers without a straggler (all four busy, no communication inside a step),
measured earlier in the same run. A busy core rather than a sleep, so that on this shared
2-core machine the straggler keeps its share of the CPU instead of handing it to the others,
which would flatter whichever method keeps the others going; a fixed time rather than a
multiple of its own step, so that it does not speed up when the others wait for it (its
compute then gets a whole core, which flatters DDP and local SGD a little: their straggler
steps take somewhat less than 4x).

Each run's clock starts once all four workers are up: for the daemons, once each sees the
three others alive (their first step waits for a file the bench then creates); for
torch.distributed, after a barrier. Every worker evaluates its model on a fixed held-out set
of 1,024 samples every 0.5 s (the daemons through ``task.eval_interval``; under DDP the replicas
are identical, so only rank 0 evaluates). Time to a loss L is the first moment the mean over
workers of their latest held-out losses is at most L, for L = 0.5, 0.4 and 0.3 (the loss
starts at 2.3; the headline figures use 0.3). A run stops at 0.3, or after ``--budget``
seconds. One run's crossing time is noisy (a loss near L goes up and down with SGD's noise),
hence the repetitions; a run that never got there counts as the slowest. Aggregate
throughput is the samples all workers trained per second from the start to the end of the
run.

Targets (from the issue; nothing here asserts on time): gossip keeps at least
0.9 x (N - 0.75) / N of its no-straggler throughput (N = 4: 0.73; a perfect method loses
exactly the straggler's missing 3/4, keeping 0.81), reaches the target at least 1.5x sooner
than DDP with the straggler, and without one takes at most 1.15x DDP's time.

Usage: python bench/straggler.py [--quick] [--repeats 3] [--budget 150] [--keep]
                                 [--set KEY=VALUE ...] [--codecs fp32,bf16,fp16,int8]
Progress goes to stderr; writes bench/results/straggler.json (``gossip_speedup_vs_ddp``:
DDP's time to the target with the straggler over gossip's) and straggler.png; the last line
printed is one JSON object with the headline figures.

``--codecs bf16,int8`` compares the daemons' wire codecs (``averaging.codec``; without the
option they use the default, fp32): gossip runs once per codec listed, each without and with
the straggler, beside DDP and local SGD in every repetition, so a comparison costs a gossip
run per codec and no more baseline runs. The runs are named ``gossip-<codec>`` and
``gossip-<codec>-straggler``; the table has a row per codec, the headline figures are the
first codec's, and the JSON line adds ``codec`` (that first one) and ``codecs``: per codec,
the same four gossip figures (``gossip_speedup_vs_ddp``, ``gossip_speedup_vs_local_sgd``,
``gossip_vs_ddp_no_straggler``, ``gossip_throughput_kept``). It sets ``averaging.codec``
itself, so it refuses a ``--set averaging.codec=...`` beside it.
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
from typing import Any, Sequence

from common import progress, pyplot, save_figure, save_json, table
from tasks import TEACHER_DEFAULTS as TEACHER_SHAPE

ENTRY = f"{Path(__file__).resolve().with_name('tasks.py')}:teacher"
WORKERS = 4
SLOWDOWN = 4.0
STRAGGLER = WORKERS - 1  # its index
SEED = 0
TARGETS = (0.5, 0.4, 0.3)  # held-out cross-entropy levels timed; the run ends at the last
TARGET = 0.3  # the one the headline figures use
BUDGET = 150.0  # s after the start before a run gives up on the target
EVAL_EVERY = 0.5  # s
H = 32  # local SGD: steps between weight all-reduces
CHECK = 16  # DDP: steps between the all-reduces of the stop flag
POLL = 0.05  # s between looks at the daemons' logs
START_TIMEOUT = 180.0  # s for the workers to come up
METHODS = ("gossip", "ddp", "local")
LABELS = {"gossip": "gossip daemons", "ddp": "DDP (all-reduce every step)",
          "local": f"local SGD (all-reduce every {H} steps)"}
TARGET_KEPT = 0.9 * (WORKERS - 0.75) / WORKERS
TARGET_SPEEDUP = 1.5
TARGET_NO_STRAGGLER = 1.15


# ---- gossip: real daemons -------------------------------------------------------------


def run_gossip(root: Path, delay: float, target: float, budget: float,
               extra: Sequence[str] = ()) -> dict[str, Any]:
    from daemon.testing import DaemonSwarm, wait_for

    go = root / "go"
    settings = ["task.threads=1", f"task.eval_interval={EVAL_EVERY}", "metrics.interval=0.5",
                "averaging.start=own",
                "checkpoint.interval=3600", "task.progress_interval=3600",
                f"task.options.start_file={go}", *extra]

    def add(swarm: DaemonSwarm, i: int, bootstrap: list) -> Any:
        extra = [f"task.options.delay={delay}"] if delay and i == STRAGGLER else []
        return swarm.add(f"w{i}", bootstrap=bootstrap, task=ENTRY, shard=i, shards=WORKERS,
                         base=(), settings=[*settings, *extra])

    with DaemonSwarm(root, f"straggler-{secrets.token_hex(3)}") as swarm:
        first = add(swarm, 0, []).start()
        wait_for(lambda: first.last("start"), START_TIMEOUT, [first], "w0 to start")
        nodes = [first] + [add(swarm, i, [first]).start() for i in range(1, WORKERS)]

        def alive(d: Any) -> int:
            m = d.last("metrics")
            return m["peers"]["alive"] if m else 0

        wait_for(lambda: all(alive(d) == WORKERS - 1 for d in nodes), START_TIMEOUT, nodes,
                 "every daemon to see the three others alive")
        go.touch()
        t0 = time.time()
        reached = None
        while reached is None and time.time() - t0 < budget:
            time.sleep(POLL)
            for d in nodes:
                if d.process.poll() is not None:
                    raise SystemExit(f"{d.name} exited:\n{d.text()[-3000:]}")
            reached = time_to_target([evals(d.of("eval"), t0) for d in nodes], target)
        end = time.time()
        for d in nodes:
            d.signal(signal.SIGTERM)
        for d in nodes:
            d.wait_exit(60)
        workers = []
        for d in nodes:
            metrics = [e for e in d.of("metrics") if e["time"] <= end]
            last = metrics[-1]
            exchanges = [e for e in d.of("exchange") if t0 <= e["time"] <= end]
            workers.append({"samples": last["samples"], "seconds": last["time"] - t0,
                            "evals": evals(d.of("eval"), t0, end),
                            "exchanges": sum(e["result"] == "committed" for e in exchanges)})
    return {"workers": workers, "seconds": end - t0}


def evals(events: list[dict[str, Any]], t0: float, end: float = math.inf) -> list[list[float]]:
    """[seconds since t0, loss] of the evaluations made while training, from t0 on."""
    return [[e["time"] - t0, e["loss"]] for e in events if t0 < e["time"] <= end
            and e.get("loss") is not None]


# ---- torch.distributed: DDP and local SGD -----------------------------------------------


def run_distributed(method: str, root: Path, delay: float, budget: float) -> dict[str, Any]:
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=START_TIMEOUT),
                          wait_for_workers=False)
    procs, outs = [], []
    for rank in range(WORKERS):
        out = root / f"{method}-{rank}.json"
        outs.append(out)
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--worker", method, "--rank", str(rank),
             "--port", str(store.port), "--delay", str(delay if rank == STRAGGLER else 0.0),
             "--budget", str(budget), "--out", str(out)], stdin=subprocess.DEVNULL))
    codes = [p.wait() for p in procs]
    missing = [rank for rank, o in enumerate(outs) if not o.exists()]
    if missing:
        raise SystemExit(f"{method} workers exited with {codes}; no results from {missing}")
    if any(codes):  # after writing their results: a crash in gloo's teardown
        progress(f"warning: {method} workers exited with {codes} after writing their results")
    ranks = [json.loads(o.read_text()) for o in outs]
    t0 = ranks[0]["t0"]
    workers = [{"samples": r["steps"] * r["batch_size"], "seconds": r["end"] - t0,
                "evals": [[t - t0, loss] for t, loss in r["evals"]], "exchanges": r["syncs"]}
               for r in ranks]
    return {"workers": workers, "seconds": max(r["end"] for r in ranks) - t0,
            "step_s": statistics.median(r["step_s"] for r in ranks)}


def worker(method: str, rank: int, port: int, delay: float, target: float, budget: float,
           out: Path) -> None:
    """One torch.distributed worker; writes its steps and evaluations to ``out``."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    from daemon.task import classifier_step
    from tasks import Teacher, delayed

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=START_TIMEOUT))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORKERS)
    problem = Teacher(SEED, **TEACHER_SHAPE)
    model = problem.model
    module = DistributedDataParallel(model) if method == "ddp" else model
    opt = problem.optimizer(module.parameters())

    step = delayed(classifier_step(module, opt), delay)
    batches = problem.batches(rank)
    evaluates = method == "local" or rank == 0  # DDP's replicas are all the same
    history: list[list[float]] = []
    durations: list[float] = []
    latest = math.inf
    steps = syncs = 0
    dist.barrier()
    t0 = time.time()
    next_eval = t0 + EVAL_EVERY
    while True:
        batch = next(batches)
        started = time.perf_counter()
        step(batch)
        durations.append(time.perf_counter() - started)
        steps += 1
        now = time.time()
        if evaluates and now >= next_eval:
            latest = problem.evaluate()["loss"]
            history.append([now, latest])
            next_eval += EVAL_EVERY * math.ceil((now - next_eval) / EVAL_EVERY + 1e-9)
        over = float(now - t0 > budget)
        if method == "local" and steps % H == 0:
            # The weights, each worker's latest loss and whether it is out of time, in one
            # all-reduce: the mean model, the mean loss, and the stop decision.
            flat = torch.cat([parameters_to_vector(model.parameters()),
                              torch.tensor([latest, over])])
            dist.all_reduce(flat)
            with torch.no_grad():
                vector_to_parameters(flat[:-2] / WORKERS, model.parameters())
            syncs += 1
            if flat[-2].item() / WORKERS <= target or flat[-1].item() > 0:
                break
        elif method == "ddp" and steps % CHECK == 0:
            flag = torch.tensor([float(latest <= target) + over])
            dist.all_reduce(flag)
            if flag.item() > 0:
                break
    end = time.time()
    syncs = steps if method == "ddp" else syncs
    out.write_text(json.dumps({"rank": rank, "t0": t0, "end": end, "steps": steps,
                               "batch_size": TEACHER_SHAPE["batch_size"], "evals": history,
                               "syncs": syncs, "step_s": statistics.median(durations)}))
    dist.barrier()  # nobody tears gloo down while another rank still talks to it
    dist.destroy_process_group()


# ---- analysis ----------------------------------------------------------------------------


def time_to_target(series: list[list[list[float]]], target: float) -> float | None:
    """The first time at which every worker has been evaluated and the mean of their latest
    losses is at most ``target`` (one series: that worker's own)."""
    points = sorted((t, i, loss) for i, s in enumerate(series) for t, loss in s)
    latest: dict[int, float] = {}
    for t, i, loss in points:
        latest[i] = loss
        if len(latest) == len(series) and sum(latest.values()) / len(latest) <= target:
            return t
    return None


def summarize(run: dict[str, Any], targets: tuple[float, ...]) -> dict[str, Any]:
    workers = run["workers"]
    series = [w["evals"] for w in workers if w["evals"]]
    rates = [w["samples"] / w["seconds"] for w in workers]
    return {**run, "time_to": {str(t): time_to_target(series, t) for t in targets},
            "samples_per_s": sum(rates), "worker_samples_per_s": rates}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="one repetition instead of three (about 2 minutes)")
    parser.add_argument("--repeats", type=int, help="repetitions of every run (default 3)")
    parser.add_argument("--budget", type=float, default=BUDGET, help="s per run at most")
    parser.add_argument("--keep", action="store_true", help="keep the workers' directories")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting for every gossip daemon (gossipd run --set), to "
                             "compare others with the defaults; repeatable")
    parser.add_argument("--codecs", metavar="LIST",
                        help="run gossip once per wire codec in this comma-separated list "
                             "(averaging.codec: fp32, bf16, fp16, int8), e.g. bf16,int8; the "
                             "headline figures are the first one's")
    parser.add_argument("--worker", choices=["ddp", "local"], help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--delay", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.rank, args.port, args.delay, min(TARGETS), args.budget,
               args.out)
        return
    repeats = args.repeats or (1 if args.quick else 3)
    try:
        codecs = codec_list(args.codecs, args.set) if args.codecs is not None else []
    except ValueError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    # (name, method, gossip settings) of each series, in the order they run in a repetition.
    gossip = ([(f"gossip-{c}", [*args.set, f"averaging.codec={c}"]) for c in codecs]
              or [("gossip", args.set)])
    series = [(name, method, settings) for method in METHODS
              for name, settings in (gossip if method == "gossip" else [(method, [])])]

    root = Path(tempfile.mkdtemp(prefix="gossipd-straggler-"))
    started = time.monotonic()
    runs: dict[str, list[dict[str, Any]]] = {
        f"{name}{suffix}": [] for suffix in ("", "-straggler") for name, _, _ in series}
    delay = 0.0
    try:
        for rep in range(repeats):
            for slow in (False, True):
                if slow and not delay:
                    # The straggler's extra busy time a step: (slowdown - 1) x a step's
                    # compute with all four workers busy, as local SGD's workers (no
                    # communication inside a step) just measured it; the same in every
                    # repetition.
                    delay = (SLOWDOWN - 1) * runs["local"][0]["step_s"]
                    progress(f"step compute {runs['local'][0]['step_s'] * 1e3:.2f} ms: the "
                             f"straggler burns {delay * 1e3:.2f} ms more a step")
                for base, method, settings in series:
                    name = f"{base}{'-straggler' if slow else ''}"
                    progress(f"{name} ({rep + 1}/{repeats}): starting {WORKERS} workers")
                    directory = root / f"{name}-{rep}"
                    directory.mkdir()
                    extra = delay if slow else 0.0
                    run = (run_gossip(directory, extra, min(TARGETS), args.budget, settings)
                           if method == "gossip" else
                           run_distributed(method, directory, extra, args.budget))
                    r = summarize(run, TARGETS)
                    runs[name].append(r)
                    progress(f"{name}: " + ", ".join(
                        f"{t}: {'-' if s is None else format(s, '.1f')} s"
                        for t, s in r["time_to"].items())
                        + f"; {r['samples_per_s']:.0f} samples/s")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    report(runs, repeats, args.budget, delay, time.monotonic() - started, codecs)


def codec_list(text: str, settings: Sequence[str]) -> list[str]:
    """The codecs of ``--codecs`` (comma-separated), in order.

    Raises:
        ValueError: an empty, unknown or repeated codec, or a ``--set`` in ``settings`` that
            sets ``averaging.codec`` too (whichever came last would silently win).
    """
    from daemon.config import ConfigError, parse_override
    from gossip.tensors import CODECS

    codecs = [c.strip() for c in text.split(",")]
    for c in codecs:
        if c not in CODECS:
            raise ValueError(f"--codecs {text}: {c!r} is not a codec (expected a comma-"
                             f"separated list of {', '.join(CODECS)})")
    if len(set(codecs)) < len(codecs):
        raise ValueError(f"--codecs {text}: a codec is listed twice")
    for setting in settings:
        try:
            section, key, _ = parse_override(setting)
        except ConfigError:
            continue  # not a setting at all: the daemons refuse it with a better message
        if section == "averaging" and (key == "codec" or key.startswith("codec.")):
            raise ValueError(f"--set {setting} conflicts with --codecs, which sets "
                             f"averaging.codec itself; drop one of them")
    return codecs


def median(values: list[float | None]) -> float | None:
    """The median, a run that never got there counting as the slowest (None if half did not)."""
    ranked = sorted(values, key=lambda v: math.inf if v is None else v)
    middle = ranked[(len(ranked) - 1) // 2: len(ranked) // 2 + 1]
    return None if None in middle else statistics.mean(middle)


def ratio(a: float | None, b: float | None) -> float:
    return a / b if a is not None and b else math.nan


def label(base: str) -> str:
    """A series' row label: ``gossip-int8`` is the gossip daemons with int8 on the wire."""
    method, _, codec = base.partition("-")
    return f"{LABELS[method]} ({codec})" if codec else LABELS[method]


def report(runs: dict[str, list[dict[str, Any]]], repeats: int, budget: float, delay: float,
           elapsed: float, codecs: Sequence[str] = ()) -> None:
    shape = ", ".join(f"{k} {v}" for k, v in TEACHER_SHAPE.items())
    step_ms = runs["local"][0]["step_s"] * 1e3
    summary: dict[str, dict[str, Any]] = {}
    for name, reps in runs.items():
        summary[name] = {
            "time_to": {str(t): median([r["time_to"][str(t)] for r in reps]) for t in TARGETS},
            "samples_per_s": statistics.median(r["samples_per_s"] for r in reps),
            "worker_samples_per_s": [statistics.median(r["worker_samples_per_s"][i]
                                                       for r in reps) for i in range(WORKERS)]}
    rows = []
    for name, r in summary.items():
        base = name.removesuffix("-straggler")
        fast = [x for i, x in enumerate(r["worker_samples_per_s"]) if i != STRAGGLER]
        rows.append([label(base), "yes" if name.endswith("straggler") else "no",
                     *(f"> {budget:g}" if r["time_to"][str(t)] is None else r["time_to"][str(t)]
                       for t in TARGETS),
                     r["samples_per_s"],
                     ratio(r["samples_per_s"], summary[base]["samples_per_s"]),
                     sum(fast) / len(fast), r["worker_samples_per_s"][STRAGGLER]])
    print(f"\n{WORKERS} workers, bench/tasks.py:teacher ({shape}; 400K parameters, SGD "
          f"momentum 0.9), one torch thread each, 127.0.0.1; straggler: worker {STRAGGLER}, "
          f"{SLOWDOWN:g}x slower per step (+{delay * 1e3:.1f} ms busy after each "
          f"{step_ms:.1f} ms step); medians of {repeats} run(s)")
    print(table(["method", "straggler", *(f"s to {t}" for t in TARGETS), "samples/s",
                 "vs none", "fast worker s/s", "worker 3 s/s"], rows))
    print("s to L: seconds from the start until the mean of the workers' latest held-out "
          "losses is <= L (it starts at 2.3); samples/s: all workers, start to end of the run")

    headline_t = str(TARGET)
    t = {name: r["time_to"][headline_t] for name, r in summary.items()}
    # The gossip series by codec ("": the one run with the default codec, without --codecs).
    gossips = {c: f"gossip-{c}" for c in codecs} or {"": "gossip"}
    figures = {c: {"gossip_speedup_vs_ddp": ratio(t["ddp-straggler"], t[f"{g}-straggler"]),
                   "gossip_speedup_vs_local_sgd": ratio(t["local-straggler"],
                                                        t[f"{g}-straggler"]),
                   "gossip_vs_ddp_no_straggler": ratio(t[g], t["ddp"]),
                   "gossip_throughput_kept": ratio(summary[f"{g}-straggler"]["samples_per_s"],
                                                   summary[g]["samples_per_s"])}
               for c, g in gossips.items()}
    verdict = {True: "met", False: "MISSED"}
    kept_says, speedup_says, none_says, exchanges = [], [], [], []
    for codec, f in figures.items():
        tag = f"{codec} " if codec else ""
        kept, speedup = f["gossip_throughput_kept"], f["gossip_speedup_vs_ddp"]
        no_straggler = f["gossip_vs_ddp_no_straggler"]
        kept_says.append(f"{tag}{verdict[kept >= TARGET_KEPT]} ({kept:.3f})")
        speedup_says.append(f"{tag}{verdict[speedup >= TARGET_SPEEDUP]} ({speedup:.2f}x; "
                            f"local SGD: {f['gossip_speedup_vs_local_sgd']:.2f}x)")
        none_says.append(f"{tag}{verdict[no_straggler <= TARGET_NO_STRAGGLER]} "
                         f"({no_straggler:.2f}x)")
        exchanges.append(f"{tag}{[w['exchanges'] for w in runs[gossips[codec]][0]['workers']]}")
    print(f"target: gossip keeps >= {TARGET_KEPT:.3f} of its no-straggler throughput: "
          + ", ".join(kept_says))
    print(f"target: with the straggler, gossip reaches loss {TARGET:g} >= {TARGET_SPEEDUP:g}x "
          f"sooner than DDP: " + ", ".join(speedup_says))
    print(f"target: without a straggler, gossip's time to loss {TARGET:g} <= "
          f"{TARGET_NO_STRAGGLER:g}x DDP's: " + ", ".join(none_says))
    print(f"gossip exchanges committed per worker (first run, no straggler): "
          f"{', '.join(exchanges)}; wall time {elapsed:.0f} s; {os.cpu_count()} CPUs, load "
          f"{os.getloadavg()[0]:.2f}")

    rounded = {c: {k: round(v, 3) for k, v in f.items()} for c, f in figures.items()}
    headline = {**next(iter(rounded.values())),  # the first codec's
                "throughput_kept_target": round(TARGET_KEPT, 3),
                "ddp_throughput_kept": round(ratio(summary["ddp-straggler"]["samples_per_s"],
                                                   summary["ddp"]["samples_per_s"]), 3),
                "time_to_target_s": {n: None if v is None else round(v, 2) for n, v in t.items()},
                "samples_per_s": {n: round(r["samples_per_s"], 1) for n, r in summary.items()},
                "target_loss": TARGET, "repeats": repeats, "workers": WORKERS,
                "slowdown": SLOWDOWN, "straggler_delay_s": round(delay, 5)}
    if codecs:
        headline |= {"codec": codecs[0], "codecs": rounded}
    save_json("straggler", {**headline, "targets": TARGETS, "budget_s": budget,
                            "wall_s": round(elapsed, 1), "summary": summary, "runs": runs})
    plot({name: reps[0] for name, reps in runs.items()})
    print(json.dumps(headline))


def plot(runs: dict[str, dict[str, Any]]) -> None:
    plt = pyplot()
    bases = [name for name in runs if not name.endswith("-straggler")]
    figure, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, slow in zip(axes, (False, True)):
        for base in bases:
            r = runs[f"{base}{'-straggler' if slow else ''}"]
            points = sorted((t, i, loss) for i, w in enumerate(r["workers"])
                            for t, loss in w["evals"])
            latest: dict[int, float] = {}
            xs, ys = [], []
            for t, i, loss in points:
                latest[i] = loss
                xs.append(t)
                ys.append(sum(latest.values()) / len(latest))
            ax.plot(xs, ys, label=label(base))
        ax.axhline(TARGET, color="grey", linestyle=":", label=f"loss {TARGET:g}")
        ax.set_yscale("log")
        ax.set_xlabel("seconds since all workers were up")
        ax.set_title(f"worker {STRAGGLER} {SLOWDOWN:g}x slower" if slow else "no straggler")
    axes[0].set_ylabel("held-out loss (mean over workers)")
    axes[0].legend()
    save_figure(figure, "straggler")


if __name__ == "__main__":
    main()
