"""A node of 2 pipeline stages against one process training the whole model: throughput,
memory per process, and what an exchange's state round costs.

The model: an ``nn.Sequential`` MLP of 8 ``Linear(W, W)`` layers, ReLUs between (W = 1024,
8.4M parameters; 512 and 2.1M with ``--quick``), ``F.cross_entropy`` over W classes, AdamW
(lr 1e-3), batches of 64 (eight seeded, cycled) in 4 micro-batches; cut by
``gossip.pipeline.stage_bounds`` into 2 stages of 4 layers, half the parameters each. Each
setup is a fresh process (or two: gloo on 127.0.0.1, launched as torchrun would, one torch
thread each), built from the same seed, training the same steps; one setup runs at a time:

* ``2 stages 1f1b`` / ``gpipe``: ``Pipeline(model, opt, stages, correction=True)``; rank 0
  (the speaker) makes the node's ``Replica`` over the whole model (``pipe.mirror``) and
  starts the ``StageGroup``; a step is ``boundaries.boundary()`` then ``pipe.step(batch)``,
  as a trainer runs it. Each step ends with the last stage's loss broadcast.
* ``2 stages torch 1f1b`` / ``torch gpipe`` (table 1 only): the same cut with torch's
  ``torch.distributed.pipelining``: a ``PipelineStage`` over a copy of the rank's
  ``model[start:stop]`` with its part of AdamW, ``Schedule1F1B`` / ``ScheduleGPipe`` with
  ``loss_fn=F.cross_entropy`` (``scale_grads=True`` divides the summed micro-batch gradients
  by 4: our step), then ``opt.step()``, with a drift correction's hook on it as our stages
  keep. No replica, no boundary, no loss broadcast (the loss, the mean of the
  micro-batches', stays on the last rank); a barrier ends the timed steps.
* ``1 process, 1 thread`` (the ratios' baseline) and ``2 threads``: ``sequential_step`` (the
  same micro-batches and step) and a ``Replica(model, optimizer=opt)`` with its drift
  correction; a step is ``replica.apply_pending()`` (nothing queued) then the step.

1. Throughput: ``--steps`` steps after ``--warmup``, ``time.perf_counter`` on rank 0. The
   ideal for 2 stages is 2 × 4/5 = 1.6: the bubble is (K − 1) / (M + K − 1) = 1/5 of a step
   (K = 2 stages, M = 4 micro-batches), before the sends and a 16-row micro-batch's lower
   efficiency. 1F1B and GPipe differ in order and in how many micro-batches' activations a
   stage holds (K − k against M: little memory here): compare them for time.
2. Memory per process after training: ``state``, the parameters and AdamW's state each
   process trains; ``+ correction``, with the drift correction's ``c`` and ``ĝ``;
   ``maxrss`` also counts torch, the whole model every process builds before the cut and,
   on the speaker, the node's host copy of the model (``mirror MB``, in memory all stages
   map, kept for the swarm's exchanges).
3. An exchange's state round: a zero delta queued on the speaker's replica, then
   ``boundaries.settle()`` (every stage publishes its slice into the mirror, the speaker
   applies the delta, every stage takes its slice back), against a one-process node's
   ``replica.snapshot(buf)`` then ``apply_pending()``; ``whole`` = publish (what a snapshot
   asks for first) + the snapshot's copy of the mirror + settle. Medians after a warm-up.
Each table's footnote says what its columns are.

Nothing asserts on time; the cores may be shared (the load average is printed): compare the
ratios of one run. ``--repeats`` runs the setups in the order a b c ..., then ... c b a
(means; exchanges: medians). ``--pin``: stage k on core k, the one process on cores
0 .. threads − 1 (``os.sched_setaffinity``); without it the kernel may put both stages'
threads (gloo's ``gloo_tcp_loop`` too) on one core (the runq column shows it).

Usage: python bench/pipeline.py [--quick] [--pin] [--width 1024] [--steps 40] [--warmup 5]
                                [--exchanges 10] [--repeats 2]
``--quick`` (``make bench``; about 30 s on 2 idle cores): width 512, 60 steps after 5, 8
exchanges, one repeat; the full run takes about 3 minutes. Progress goes to stderr; writes
bench/results/pipeline.json; the last line printed is one JSON object of the headline figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import progress, save_json, table

LAYERS = 8  # Linear(W, W) layers
BATCH = 64
MICRO = 4
STAGES = 2
DISTINCT = 8  # distinct seeded batches, cycled
WIDTH = {"quick": 512, "full": 1024}
STEPS = {"quick": 60, "full": 40}
WARMUP = {"quick": 5, "full": 5}
EXCHANGES = {"quick": 8, "full": 10}
REPEATS = {"quick": 1, "full": 2}
TIMEOUT = 600.0  # s for one setup's processes to finish
SETUPS = ("single1", "1f1b", "gpipe", "torch-1f1b", "torch-gpipe", "single2")  # then reversed
LABELS = {"single1": "1 process, 1 thread", "single2": "1 process, 2 threads",
          "1f1b": "2 stages 1f1b", "gpipe": "2 stages gpipe",
          "torch-1f1b": "2 stages torch 1f1b", "torch-gpipe": "2 stages torch gpipe"}


# ---- the workers: one setup each, in its own process(es) ------------------------------------


def build(width: int) -> tuple[Any, Any]:
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(LAYERS):
        layers.append(nn.Linear(width, width))
        if i < LAYERS - 1:
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def batches(width: int) -> list[tuple[Any, Any]]:
    import torch

    g = torch.Generator().manual_seed(5)
    return [(torch.randn(BATCH, width, generator=g),
             torch.randint(0, width, (BATCH,), generator=g)) for _ in range(DISTINCT)]


def stages_for(schedule: str) -> Any:
    import torch.nn.functional as F

    from gossip.pipeline import Stages

    return Stages(loss=F.cross_entropy, micro_batches=MICRO, schedule=schedule)


def state_bytes(module: Any, optimizer: Any) -> dict[str, int]:
    """Bytes of ``module``'s parameters and of ``optimizer``'s state tensors."""
    import torch

    params = sum(p.numel() * p.element_size() for p in module.parameters())
    opt = sum(v.numel() * v.element_size() for s in optimizer.state.values()
              for v in s.values() if isinstance(v, torch.Tensor))
    return {"param_bytes": params, "optimizer_bytes": opt}


def correction_bytes(correction: Any) -> int:
    if correction is None:
        return 0
    return sum(c.numel() * c.element_size() + g.numel() * g.element_size()
               for _, c, g in correction.named())


def maxrss() -> int:
    """Peak resident set of this process, bytes (Linux reports kB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def clocks() -> tuple[float, float, float]:
    """Wall time, this process's CPU time (all its threads), and the time this thread has
    waited, runnable, for a CPU (``/proc/thread-self/schedstat``; NaN where there is none)."""
    try:
        delay = int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        delay = math.nan
    return time.perf_counter(), time.process_time(), delay


def timed(one: Any, args: argparse.Namespace, start: Any = None,
          end: Any = None) -> tuple[list[float], dict[str, float]]:
    """``one(i)`` for ``--warmup`` steps, ``start()``, then ``--steps`` timed ones and
    ``end()``: their losses, and the wall time and per step CPU and run-queue seconds."""
    for i in range(args.warmup):
        one(i)
    if start is not None:
        start()
    before = clocks()
    losses = [one(i) for i in range(args.warmup, args.warmup + args.steps)]
    if end is not None:
        end()
    after = clocks()
    return losses, {"seconds": after[0] - before[0],
                    "cpu_per_step": (after[1] - before[1]) / args.steps,
                    "wait_per_step": (after[2] - before[2]) / args.steps}


def release() -> None:
    """Free what was dropped and give the memory back to the system (glibc keeps it)."""
    import ctypes
    import gc

    gc.collect()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def queue_zero(replica: Any) -> None:
    """Queue a committed delta of zeros: the exchange's bookkeeping and copies, no move."""
    d = replica.buffer()
    d.zero_()
    replica.queue(d, scale=0.5, correction=0.0, step_move=0, weight=None, sent_weight=1.0)


def pin(cores: set[int]) -> None:
    """Keep this process (the threads it starts from now on) on ``cores`` (``--pin``)."""
    count = os.cpu_count() or 1
    os.sched_setaffinity(0, {c % count for c in cores})


def single_worker(args: argparse.Namespace) -> None:
    """The whole model in this process, ``args.threads`` torch threads."""
    if args.pin:
        pin(set(range(args.threads)))
    import torch

    from gossip.pipeline import sequential_step
    from gossip.replica import Replica

    torch.set_num_threads(args.threads)
    model, opt = build(args.width)
    replica = Replica(model, optimizer=opt)
    train = sequential_step(model, opt, stages_for("1f1b"))
    data = batches(args.width)

    def one(i: int) -> float:
        replica.apply_pending()
        loss = float(train(data[i % DISTINCT]))
        replica.advance(1, BATCH)
        return loss

    losses, timing = timed(one, args)

    out = replica.buffer()
    times: dict[str, list[float]] = {"snapshot": [], "apply": [], "exchange": []}
    for trial in range(args.exchanges + 1):  # the first: a warm-up
        queue_zero(replica)
        t0 = time.perf_counter()
        replica.snapshot(out)
        t1 = time.perf_counter()
        replica.apply_pending()
        t2 = time.perf_counter()
        if trial:
            times["snapshot"].append(t1 - t0)
            times["apply"].append(t2 - t1)
            times["exchange"].append(t2 - t0)
    result = {"setup": f"single{args.threads}", "threads": args.threads, **timing,
              "steps": args.steps, "losses": losses,
              "params": sum(p.numel() for p in model.parameters()),
              **state_bytes(model, opt), "correction_bytes": correction_bytes(replica.correction),
              "times": times, "maxrss": maxrss()}
    args.out.write_text(json.dumps(result))
    os._exit(0)


def pipeline_worker(args: argparse.Namespace) -> None:
    """One stage of a node of :data:`STAGES` (rank and rendezvous from the environment)."""
    if args.pin:
        pin({int(os.environ["RANK"])})
    import datetime

    import torch
    import torch.distributed as dist

    from gossip.pipeline import Pipeline
    from gossip.replica import Replica

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT))
    rank = dist.get_rank()
    model, opt = build(args.width)
    params = sum(p.numel() for p in model.parameters())
    pipe = Pipeline(model, opt, stages_for(args.schedule), correction=True)
    group = pipe.boundaries
    replica = Replica(model, optimizer=opt) if rank == 0 else None
    if rank != 0:
        del model, opt  # a stage keeps its own part only (pipe.module, pipe.optimizer)
        release()
    group.start(replica)
    data = batches(args.width)

    def one(i: int) -> float:
        group.boundary()
        loss = float(pipe.step(data[i % DISTINCT]))
        if replica is not None:
            replica.advance(1, BATCH)
        return loss

    losses, timing = timed(one, args, dist.barrier)

    times: dict[str, list[float]] = {"publish": [], "snapshot": [], "settle": [], "whole": []}
    if replica is not None:
        out = replica.buffer()
        refresh = replica.refresh  # the stages' publish, which settle() below stands in for
        for trial in range(args.exchanges + 1):  # the first: a warm-up
            t0 = time.perf_counter()
            group.settle()  # nothing queued: the stages publish (what a snapshot asks for)
            t1 = time.perf_counter()
            replica.refresh = None  # the mirror is current: copy it without waiting
            replica.snapshot(out)
            replica.refresh = refresh
            t2 = time.perf_counter()
            queue_zero(replica)
            t3 = time.perf_counter()
            applied = group.settle()  # publish, apply, take
            t4 = time.perf_counter()
            assert applied == 1, applied
            if trial:
                times["publish"].append(t1 - t0)
                times["snapshot"].append(t2 - t1)
                times["settle"].append(t4 - t3)
                times["whole"].append((t1 - t0) + (t2 - t1) + (t4 - t3))
        group.finish()
    else:
        group.boundary()  # every publish and take the speaker asks for, until its stop
        assert group.stopped
    stats = group.statistics()
    result = {"setup": args.schedule, "rank": rank, **timing, "steps": args.steps,
              "losses": losses, "params": params,
              "stage_params": sum(p.numel() for p in pipe.module.parameters()),
              "bounds": pipe.bounds[rank], **state_bytes(pipe.module, pipe.optimizer),
              "correction_bytes": correction_bytes(group._correction),
              "mirror": int(group._memory.numel()) if rank == 0 else 0,
              "syncs": stats.syncs, "times": times, "maxrss": maxrss()}
    dist.barrier()  # the speaker's stop is read before anyone leaves
    args.out.write_text(json.dumps(result))
    os._exit(0)  # no gloo teardown: it can abort at exit


def torch_worker(args: argparse.Namespace) -> None:
    """One stage of the same node with ``torch.distributed.pipelining`` for the schedule."""
    rank = int(os.environ["RANK"])
    if args.pin:
        pin({rank})
    import copy
    import datetime

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from gossip.pipeline import split_optimizer, stage_bounds

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT))
    model, opt = build(args.width)
    params = sum(p.numel() for p in model.parameters())
    start, stop = stage_bounds(model, STAGES)[rank]
    module = copy.deepcopy(model[start:stop])  # as Pipeline cuts it, with its own AdamW
    opt = split_optimizer(opt, dict(zip(map(id, model[start:stop].parameters()),
                                        module.parameters())))
    del model
    release()
    # The drift correction's hook, as each of our stages keeps one: the same work per step.
    from gossip.correction import Correction
    from gossip.tensors import StateSchema
    correction = Correction(module, StateSchema.from_module(module))
    opt.register_step_pre_hook(lambda o, a, k: correction.before_step(o))
    kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[args.schedule]
    # scale_grads=True (the default): the micro-batches' summed gradients / MICRO, our step
    schedule = kind(PipelineStage(module, rank, STAGES, torch.device("cpu")), MICRO,
                    loss_fn=F.cross_entropy, scale_grads=True)
    data = batches(args.width)

    def one(i: int) -> float:
        x, y = data[i % DISTINCT]
        opt.zero_grad(set_to_none=True)
        losses: list[Any] = []
        if rank == 0:
            schedule.step(x)
        elif rank == STAGES - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        opt.step()
        return sum(float(v) for v in losses) / len(losses) if losses else math.nan

    # the end's barrier, as our loss broadcast: the time covers every rank's last step
    losses, timing = timed(one, args, dist.barrier, dist.barrier)
    result = {"setup": f"torch-{args.schedule}", "rank": rank, **timing, "steps": args.steps,
              "losses": losses, "params": params, "bounds": [start, stop],
              **state_bytes(module, opt), "times": {}, "maxrss": maxrss()}
    dist.barrier()
    args.out.write_text(json.dumps(result))
    os._exit(0)


# ---- the parent: runs the setups one at a time ----------------------------------------------


def launch(setup: str, args: argparse.Namespace, root: Path, tag: str) -> list[dict[str, Any]]:
    """Run one setup's process(es); their results (the node's: one per rank)."""
    from daemon.processes import free_port

    common = [sys.executable, __file__, "--width", str(args.width), "--steps", str(args.steps),
              "--warmup", str(args.warmup), "--exchanges", str(args.exchanges),
              *(["--pin"] if args.pin else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if setup.startswith("single"):
        threads = int(setup[-1])
        outs = [root / f"{setup}-{tag}.json"]
        commands = [[*common, "--worker", "single", "--threads", str(threads),
                     "--out", str(outs[0])]]
        envs = [{**env, "OMP_NUM_THREADS": str(threads)}]
    else:
        port, worker = free_port(), "torch" if setup.startswith("torch") else "pipeline"
        outs = [root / f"{setup}-{tag}-{rank}.json" for rank in range(STAGES)]
        commands = [[*common, "--worker", worker, "--schedule", setup.split("-")[-1],
                     "--out", str(out)] for out in outs]
        envs = [{**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                 "WORLD_SIZE": str(STAGES), "RANK": str(rank), "LOCAL_RANK": str(rank)}
                for rank in range(STAGES)]
    procs = [subprocess.Popen(c, env=e, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for c, e in zip(commands, envs)]
    texts = []
    try:
        texts = [p.communicate(timeout=TIMEOUT)[0] or "" for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    if any(codes) or not all(o.exists() for o in outs):
        failed = SystemExit(f"{LABELS[setup]}: the workers exited with {codes}:\n"
                            + "\n---\n".join(t[-3000:] for t in texts))
        reasons = [t.strip().splitlines()[-1] for t, c in zip(texts, codes) if c and t.strip()]
        failed.reason = (reasons or [f"exit codes {codes}"])[0]  # type: ignore[attr-defined]
        raise failed
    return [json.loads(o.read_text()) for o in outs]


def summarize(runs: dict[str, list[list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per setup: mean samples/s over the repeats, the last repeat's memory, the exchange
    times' medians over all repeats."""
    out: dict[str, Any] = {}
    for setup, repeats in runs.items():
        if not repeats:  # torch's pipelining failed
            continue
        rates = [r[0]["steps"] * BATCH / r[0]["seconds"] for r in repeats]
        last = repeats[-1]
        times = {k: statistics.median([t for r in repeats for t in r[0]["times"][k]])
                 for k in last[0]["times"] if last[0]["times"][k]}
        out[setup] = {
            "samples_per_s": statistics.mean(rates), "rates": rates,
            "step_ms": 1e3 * BATCH / statistics.mean(rates),
            "losses": last[-1]["losses"], "params": last[0]["params"],
            "processes": [{k: p[k] for k in ("param_bytes", "optimizer_bytes", "correction_bytes",
                                              "maxrss", "mirror", "bounds", "stage_params")
                           if k in p} for p in last],
            "times": times,
            # per process (each rank of the node), means over the repeats
            "cpu_ms": [1e3 * statistics.mean(r[k]["cpu_per_step"] for r in repeats)
                       for k in range(len(last))],
            "wait_ms": [1e3 * statistics.mean(r[k]["wait_per_step"] for r in repeats)
                        for k in range(len(last))],
        }
    base = out["single1"]
    for setup, s in out.items():
        s["ratio"] = s["samples_per_s"] / base["samples_per_s"]
        s["ratio_2t"] = s["samples_per_s"] / out["single2"]["samples_per_s"]
        s["loss_diff"] = max(abs(a - b) for a, b in zip(s["losses"], base["losses"]))
    return out


def rounded(values: list[float], digits: int) -> list[float | None]:
    """``values`` rounded, NaN as None (the JSON line stays JSON)."""
    return [None if math.isnan(v) else round(v, digits) for v in values]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="width 512, 60 timed steps, 8 exchanges, one repeat (under a "
                             "minute)")
    parser.add_argument("--width", type=int, help="the layers' width (1024; 512 quick)")
    parser.add_argument("--steps", type=int, help="timed steps per setup (40; 60 quick)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (5)")
    parser.add_argument("--exchanges", type=int, help="timed exchange rounds (10; 8 quick)")
    parser.add_argument("--repeats", type=int,
                        help="runs of each setup, in the order a b c d d c b a ... (2; 1 quick)")
    parser.add_argument("--pin", action="store_true",
                        help="keep each process on its own core(s) (stage k on core k, the "
                             "one process on cores 0..threads-1; Linux)")
    parser.add_argument("--worker", choices=["single", "pipeline", "torch"],
                        help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--schedule", choices=["1f1b", "gpipe"], help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    mode = "quick" if args.quick else "full"
    args.width = args.width or WIDTH[mode]
    args.steps = args.steps or STEPS[mode]
    args.warmup = WARMUP[mode] if args.warmup is None else args.warmup
    args.exchanges = args.exchanges or EXCHANGES[mode]
    if args.worker == "single":
        single_worker(args)
        return
    if args.worker in ("pipeline", "torch"):
        (pipeline_worker if args.worker == "pipeline" else torch_worker)(args)
        return
    repeats = args.repeats or REPEATS[mode]

    started, load_before = time.monotonic(), os.getloadavg()[0]
    runs: dict[str, list[list[dict[str, Any]]]] = {s: [] for s in SETUPS}
    order = [s for r in range(repeats) for s in (SETUPS if r % 2 == 0 else SETUPS[::-1])]
    failure = None  # why torch's pipelining did not run, if it did not
    with tempfile.TemporaryDirectory(prefix="gossipd-pipeline-") as root:
        for k, setup in enumerate(order):
            if setup.startswith("torch") and failure:
                continue
            try:
                result = launch(setup, args, Path(root), str(k))
            except SystemExit as exc:
                if not setup.startswith("torch"):
                    raise
                failure = getattr(exc, "reason", str(exc))[:300]
                progress(f"{LABELS[setup]}: failed: {exc}")
                continue
            runs[setup].append(result)
            r = result[0]
            progress(f"{LABELS[setup]} ({k + 1}/{len(order)}): "
                     f"{r['steps'] * BATCH / r['seconds']:.0f} samples/s; load "
                     f"{os.getloadavg()[0]:.2f}")
    elapsed, load_after = time.monotonic() - started, os.getloadavg()[0]
    report(summarize(runs), args, repeats, elapsed, (load_before, load_after), runs, failure)


def report(summary: dict[str, Any], args: argparse.Namespace, repeats: int, elapsed: float,
           load: tuple[float, float], runs: dict[str, Any], failure: str | None) -> None:
    mb = 1e6
    base, two = summary["single1"], summary["single2"]
    bubble = (STAGES - 1) / (MICRO + STAGES - 1)
    params = base["params"]

    rows = []
    for setup in ("single1", "single2", "1f1b", "gpipe", "torch-1f1b", "torch-gpipe"):
        if setup not in summary:
            rows.append([LABELS[setup], "2 x 1", "failed"] + ["-"] * 6)
            continue
        s = summary[setup]
        rows.append([LABELS[setup], setup[-1] if setup.startswith("single") else "2 x 1",
                     s["samples_per_s"], f"{s['step_ms']:.1f}", f"{s['ratio']:.2f}",
                     f"{s['ratio_2t']:.2f}", " / ".join(f"{v:.1f}" for v in s["cpu_ms"]),
                     " / ".join(f"{v:.1f}" for v in s["wait_ms"]), f"{s['loss_diff']:.1e}"])
    print(f"\n1. Throughput: MLP of {LAYERS} x Linear({args.width}, {args.width}) "
          f"({params / 1e6:.1f}M parameters), AdamW, batch {BATCH} in {MICRO} micro-batches; "
          f"{args.steps} steps timed after {args.warmup}, mean of {repeats} run(s)"
          f"{'; each process pinned to its own core(s)' if args.pin else ''}")
    print(table(["setup", "threads", "samples/s", "ms/step", "vs 1 thread", "vs 2 threads",
                 "CPU ms/step", "runq ms/step", "loss diff"], rows))
    if failure:
        print(f"torch.distributed.pipelining failed: {failure}")
    print(f"vs 1 thread: samples/s over the one process with one torch thread (the same "
          f"thread count per process as each stage); ideal for {STAGES} stages, {MICRO} "
          f"micro-batches: {STAGES * (1 - bubble):.2f} (the bubble, {bubble:.0%} of a step, "
          f"before the sends). CPU ms/step: CPU time per step of each process (all its "
          f"threads; stage 0 / stage 1); runq ms/step: time per step its main thread waited, "
          f"runnable, for a CPU (/proc schedstat: other work on the machine, or the stages "
          f"put on one core). loss diff: the largest |loss - the baseline's loss| over the "
          f"timed steps (the same steps: float noise). torch: torch.distributed.pipelining's "
          f"schedule over the same cut, its loss scaled as ours.")

    rows = []
    single = base["processes"][0]
    single_state = single["param_bytes"] + single["optimizer_bytes"]
    single_total = single_state + single["correction_bytes"]
    for setup in ("single1", "1f1b", "gpipe"):
        for rank, p in enumerate(summary[setup]["processes"]):
            state = p["param_bytes"] + p["optimizer_bytes"]
            name = (LABELS[setup] if setup.startswith("single")
                    else f"{LABELS[setup]}, stage {rank}")
            rows.append([name, f"{state / mb:.1f}", f"{state / single_state:.2f}",
                         f"{(state + p['correction_bytes']) / mb:.1f}",
                         f"{(state + p['correction_bytes']) / single_total:.2f}",
                         f"{p['maxrss'] / mb:.0f}",
                         f"{p['mirror'] / mb:.1f}" if p.get("mirror") else "-"])
    print("\n2. Memory per process, after training")
    print(table(["process", "state MB", "share", "+ correction MB", "share", "maxrss MB",
                 "mirror MB"], rows))
    print("state: parameters + optimizer state (AdamW exp_avg, exp_avg_sq, step) the process "
          "trains; share: of the one process's; + correction: with the drift correction's c "
          "and g. maxrss: peak resident set (torch, the whole model each process builds "
          "before the cut, and on stage 0 the node's mirror of the whole model, in memory "
          "the stages share).")

    rows = []
    bx = base["times"]
    for setup in ("1f1b", "gpipe"):
        t = summary[setup]["times"]
        rows.append([LABELS[setup], f"{t['publish'] * 1e3:.2f}", f"{t['snapshot'] * 1e3:.2f}",
                     f"{t['settle'] * 1e3:.2f}", f"{t['whole'] * 1e3:.2f}",
                     f"{t['settle'] / bx['exchange']:.2f}",
                     f"{t['whole'] / bx['exchange']:.2f}"])
    rows.append([LABELS["single1"], "-", f"{bx['snapshot'] * 1e3:.2f}",
                 f"{bx['apply'] * 1e3:.2f} (apply)", f"{bx['exchange'] * 1e3:.2f}", "1", "1"])
    print(f"\n3. An exchange's state round (a queued zero delta), medians of "
          f"{args.exchanges} x {repeats} after a warm-up")
    print(table(["setup", "publish ms", "snapshot ms", "settle ms", "whole ms",
                 "settle / single", "whole / single"], rows))
    print("settle: boundaries.settle() with the delta queued (every stage publishes, the "
          "speaker applies, every stage takes); publish: settle() with nothing queued (what "
          "a snapshot asks for first); snapshot: replica.snapshot() of the mirror; whole: "
          "the three. single: replica.snapshot() + replica.apply_pending() in one process "
          "(its whole per-exchange work).")
    print(f"wall time {elapsed:.0f} s; {os.cpu_count()} CPUs, 1-minute load average "
          f"{load[0]:.2f} before, {load[1]:.2f} after (compare ratios within one run)")

    def shares(setup: str, correction: bool) -> list[float]:
        total = single_total if correction else single_state
        return [round((p["param_bytes"] + p["optimizer_bytes"]
                       + (p["correction_bytes"] if correction else 0))
                      / total, 3) for p in summary[setup]["processes"]]

    f1, gp = summary["1f1b"], summary["gpipe"]
    headline = {
        "bench": "pipeline", "width": args.width, "params": params, "pinned": args.pin,
        "samples_per_s_single_1thread": round(base["samples_per_s"], 1),
        "samples_per_s_single_2threads": round(two["samples_per_s"], 1),
        "samples_per_s_1f1b": round(f1["samples_per_s"], 1),
        "samples_per_s_gpipe": round(gp["samples_per_s"], 1),
        "samples_per_s_ratio_1f1b": round(f1["ratio"], 3),
        "samples_per_s_ratio_gpipe": round(gp["ratio"], 3),
        "samples_per_s_ratio_1f1b_vs_2threads": round(f1["ratio_2t"], 3),
        "samples_per_s_ratio_gpipe_vs_2threads": round(gp["ratio_2t"], 3),
        "ideal_ratio": round(STAGES * (1 - bubble), 3),
        "cpu_ms_per_step_single_1thread": rounded(base["cpu_ms"], 2),
        "cpu_ms_per_step_1f1b": rounded(f1["cpu_ms"], 2),
        "cpu_ms_per_step_gpipe": rounded(gp["cpu_ms"], 2),
        "runq_ms_per_step_1f1b": rounded(f1["wait_ms"], 2),
        "runq_ms_per_step_gpipe": rounded(gp["wait_ms"], 2),
        "loss_max_diff": max(f1["loss_diff"], gp["loss_diff"]),
        **({"torch_pipelining": failure} if failure else {}),
        **{f"samples_per_s_torch_{k}": round(summary[f"torch-{k}"]["samples_per_s"], 1)
           if f"torch-{k}" in summary else None for k in ("gpipe", "1f1b")},
        **{f"samples_per_s_ratio_torch_{k}": round(summary[f"torch-{k}"]["ratio"], 3)
           if f"torch-{k}" in summary else None for k in ("gpipe", "1f1b")},
        "loss_max_diff_torch": max((summary[s]["loss_diff"] for s in ("torch-1f1b", "torch-gpipe")
                                    if s in summary), default=None),
        "stage_memory_share": shares("1f1b", False),
        "stage_memory_share_with_correction": shares("1f1b", True),
        "stage_state_bytes": [p["param_bytes"] + p["optimizer_bytes"] for p in f1["processes"]],
        "single_state_bytes": single_state,
        "maxrss_mb_stages": [round(p["maxrss"] / mb) for p in f1["processes"]],
        "maxrss_mb_single": round(base["processes"][0]["maxrss"] / mb),
        "mirror_mb": round(f1["processes"][0]["mirror"] / mb, 1),
        "exchange_seconds_settle": round(f1["times"]["settle"], 5),
        "exchange_seconds_settle_gpipe": round(gp["times"]["settle"], 5),
        "exchange_seconds_single": round(bx["exchange"], 5),
        "exchange_seconds_ratio": round(f1["times"]["settle"] / bx["exchange"], 3),
        "exchange_seconds_whole": round(f1["times"]["whole"], 5),
        "exchange_whole_ratio": round(f1["times"]["whole"] / bx["exchange"], 3),
        "loadavg": round(load[0], 2),
    }
    save_json("pipeline", {**headline, "steps": args.steps, "warmup": args.warmup,
                           "exchanges": args.exchanges, "repeats": repeats,
                           "wall_s": round(elapsed, 1), "summary": summary, "runs": runs})
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
