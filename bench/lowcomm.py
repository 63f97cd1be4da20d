"""Low-communication training: gossip with H local steps between syncs against DDP and DiLoCo.

H = 1, 10, 100 and 500, N = 8 nodes, the same data and the same number of samples for every
method.

Targets (at H = 100, for "gossip, outer step"): the language model's held-out loss within 2%
of DDP's on IID shards and no worse than DiLoCo's at the same H; within 4% of DDP's on shards
skewed by source file; the label-sorted digits' mean node accuracy within 5 points of DDP's.
H = 500 is reported, not judged.

Method
------
Tasks, each built by its own factory (:mod:`daemon.tasks`), so that every method trains the
same model from the same initial weights with the same inner optimizer:

- ``lm_iid``: the bundled byte-level transformer LM (``daemon.tasks.charlm``: AdamW, lr 3e-3)
  with smaller options than its defaults, the same for every method, so that the quick run
  fits its time: ``LM_OPTIONS`` (width 32, one block, 32 bytes of context, 8 windows a step:
  30K parameters, about 4 ms a step on one core instead of 19 at the task's defaults: width
  64, two blocks, 64 bytes, 16 windows). Every node trains on all the training files
  (``Shard(0, 1)``), each in its own batch order (one task seed per node), from node 0's
  initial weights.
- ``lm_skewed``: the same LM, node i on ``Shard(i, 8)``: the training files i, i + 8, ...,
  so each node sees different source files (skewed by file, not by token).
- ``digits``: the digits MLP (``daemon.tasks.digits``: SGD lr 0.05, momentum 0.9, batch 32),
  node i on ``Shard(i, 8)``: the training split sorted by label and cut in 8 blocks, so each
  node sees one or two classes.

Methods, side by side:

- DDP: no swarm; one model and one optimizer; each step takes the next batch of each of the
  8 shards (in the order that shard's node draws them) and steps on their concatenation,
  whose mean loss is the mean of the 8 batches' losses, as DDP's gradient averaging does at
  the same lr: 8 batches a step. It does not depend on H, so it is one run per task, the
  same figure in every column.
- DiLoCo: 8 replicas from the same initial weights, each with its own inner optimizer (the
  task's, its state kept per replica) on its shard; every H steps the pseudo-gradients
  ``anchor - replica`` are averaged (an exact all-reduce) and applied to the anchor by SGD
  with Nesterov momentum (lr 0.7, momentum 0.9: the open DiLoCo replication's values); every
  replica then takes the anchor. Plain torch, no network.
- gossip as today: :func:`gossip.testing.open_sim_swarm`, real protocol nodes on a simulated
  network (1 ms links, no bandwidth limit) under trio's ``MockClock``, each node starting a
  pairwise round every ``every = H`` local steps (x U(0.75, 1.25), no timer), the drift
  correction on (each node hands its optimizer to the swarm), ``outer=False``: plain
  pairwise averaging.
- gossip, outer step: the same with the library's defaults for everything but
  ``every``/``interval``/``start``: each committed exchange applied through the node's outer
  Nesterov step (``outer=True``, ``outer_lr``, ``outer_momentum`` as :class:`AveragingConfig`
  sets them).

- the codecs below 8 bits (:data:`CODECS`: ``mod4``, ``mod4/4``, ``mod4/8``, ``mod4/16``), at
  H = 100 and 500 only: "gossip, outer step" with ``averaging.codec`` set to each, on every
  node. Each node's first exchanges are ``int8`` (until its periods are measured), and the
  drift correction's estimate travels as ``int8`` cells of the carried blocks, all of which
  the bytes count.

A training step takes ``STEP_TIME`` virtual seconds in the swarms, so a round at H = 1 overlaps
the next step as it would on real links; H is imposed by ``every``, not by the links.

Budget: every method and every H trains the same samples: ``steps`` per node (1,000 in the
quick run, 2,000 in the full one; a multiple of every H, so that DiLoCo ends on a sync), x 8
nodes x the task's batch. At H = 500 DiLoCo syncs ``steps / 500`` times (2 quick, 4 full); a
gossip node starts about as many rounds and answers about as many of its peers' (the
"exchanges per node" row counts both). Both budgets stop early in the LM's training (DDP's
loss is still falling), so its figures say how much each method learns from the same
samples, not where each would level off.

Measure: at the end of the budget every node's model is evaluated on the task's fixed
held-out data with the task's own ``evaluate()`` (the LM: cross-entropy in nats on held-out
files; the digits: accuracy and loss on the 359 test images). A swarm is caught wherever each
node is between its rounds (the last training step of the swarm evaluates them all), so at
large H its nodes have drifted for up to H steps; DiLoCo's replicas all hold the anchor just
synced, and DDP has one model. Figures are the mean over nodes (and the worst node), then the
mean over seeds. For the swarms the mean model (the nodes' parameters averaged, which no node
holds) is evaluated too: it tells drift between the nodes apart from what the swarm learned.
The LM's held-out set is the task's: 32 windows of 32 bytes, the same for every run.

- LM gap to DDP: ``(L - L_ddp) / L_ddp`` of the mean node loss, in % (JSON: a fraction).
- vs DiLoCo: the method's mean node loss over DiLoCo's at the same H (below 1: better).
- digits gap: DDP's accuracy minus the mean node accuracy, in points.
- codecs: the gap to "gossip, outer step" in fp32 at the same H (LM: relative loss; digits:
  points), and bytes per committed exchange and side over fp32's, measured: the payloads
  (each exchange's codec and size as ``on_exchange`` reports them), and all a node sent
  (handshakes, messages and refused offers too: about 2 KB an exchange, as much as a
  ``mod4/16`` payload of this 30K-parameter model, nothing at 100M). The targets (H = 100,
  payload bytes): the LM within 1% of fp32 at <= 1/16 of its bytes and within 3% at <= 1/50
  (the best codec of each budget); the digits within 1 point at <= 1/16 (the LM's codec). JSON:
  ``lm_lowbit_codec_h100``, ``lm_lowbit_loss_gap_h100``, ``lm_lowbit_bytes_ratio_h100`` (and
  ``lm_lowbit50_*`` for 1/50), ``digits_lowbit_gap_h100_n8``, and each codec's gaps.

Runs are independent and single-threaded, so they go to ``--jobs`` processes (one per core);
the figures do not depend on how many.

Usage: python bench/lowcomm.py [--quick] [--seeds 2] [--steps 2000] [--jobs 2]
Tables on stdout, progress on stderr; the last line printed is one JSON object with the
headline figures. Writes bench/results/lowcomm.json and lowcomm.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

import torch
import trio
import trio.testing

from common import progress, pyplot, save_figure, save_json, table
from daemon.task import Context, Shard, Task
from daemon.tasks import charlm, digits
from gossip import AveragingConfig, NodeConfig
from gossip.averaging import Result
from gossip.testing import SimNode, open_sim_swarm

N = 8  # nodes (replicas, shards)
HS = (1, 10, 100, 500)  # local steps between syncs
STEP_TIME = 0.05  # virtual s per training step in the swarms
LM_OPTIONS = {"d_model": 32, "layers": 1, "context": 32, "batch_size": 8}  # 64, 2, 64, 16
DILOCO_LR, DILOCO_MOMENTUM = 0.7, 0.9  # the outer Nesterov SGD of the DiLoCo replication
TARGET_LM_IID = 0.02  # loss over DDP's, as a fraction, at H = 100
TARGET_LM_SKEWED = 0.04
TARGET_DIGITS = 5.0  # points of mean node accuracy below DDP's, at H = 100
TARGET_H = 100
CPU = torch.device("cpu")

METHODS = {"ddp": "DDP (all-reduce)", "diloco": "DiLoCo", "today": "gossip as today",
           "outer": "gossip, outer step"}
# The codecs below 8 bits (gossip.lowbit), each a method of its own: "gossip, outer step" with
# averaging.codec set to it, at CODEC_HS only. Their bytes are measured, not assumed.
CODECS = ("mod4", "mod4/4", "mod4/8", "mod4/16")
CODEC_HS = (100, 500)
SIXTEENTH, FIFTIETH = 1 / 16, 1 / 50  # the targets' byte budgets, of fp32's
TARGET_LOWBIT_LM = (0.01, 0.03)  # relative loss gap to fp32 at H = 100, within each budget
TARGET_LOWBIT_DIGITS = 1.0  # points below fp32, within 1/16 of its bytes

Run = dict[str, Any]  # one run: per-node "loss" (and "accuracy"), "exchanges", "mean_model_*"


@dataclass(frozen=True)
class Workload:
    """A task and how its data is split over the nodes."""

    name: str
    label: str
    factory: Callable[[Context], Task]
    options: Mapping[str, Any]
    iid: bool  # every node on all the data, each in its own order; else Shard(i, N)

    @property
    def classifier(self) -> bool:
        return self.factory is digits.task


WORKLOADS = [
    Workload("lm_iid", "char LM, IID (all files on every node)", charlm.task, LM_OPTIONS, True),
    Workload("lm_skewed", "char LM, skewed (node i: files i mod 8)", charlm.task, LM_OPTIONS,
             False),
    Workload("digits", "digits MLP, label-sorted shards", digits.task, {}, False),
]


def build(work: Workload, seed: int) -> tuple[list[Task], list[Iterator[Any]]]:
    """N tasks with the same initial weights and each node's batch iterator."""
    if work.iid:
        # A task's seed picks its batch order, so one seed per node; then node 0's initial
        # weights everywhere, as in the skewed runs, which share one seed.
        tasks = [work.factory(Context(seed * 1000 + i, CPU, work.options)) for i in range(N)]
        for t in tasks[1:]:
            t.model.load_state_dict(tasks[0].model.state_dict())
        return tasks, [t.batches(Shard(0, 1)) for t in tasks]
    tasks = [work.factory(Context(seed, CPU, work.options)) for _ in range(N)]
    return tasks, [t.batches(Shard(i, N)) for i, t in enumerate(tasks)]


def evaluate(tasks: list[Task]) -> Run:
    """Every node's held-out figures: ``loss`` and, for a classifier, ``accuracy`` in %."""
    results = [t.evaluate() for t in tasks]  # type: ignore[misc]  # both tasks have one
    out: Run = {"loss": [r["loss"] for r in results]}
    if "accuracy" in results[0]:
        out["accuracy"] = [100 * r["accuracy"] for r in results]
    return out


def mean_model(work: Workload, seed: int, tasks: list[Task]) -> Run:
    """The held-out figures of the nodes' parameters averaged, a model no node holds: it tells
    the nodes' drift from one another apart from what the swarm learned as a whole."""
    probe = work.factory(Context(seed, CPU, work.options))
    states = [t.model.state_dict() for t in tasks]
    probe.model.load_state_dict({k: torch.stack([s[k] for s in states]).mean(0)
                                 if v.is_floating_point() else v for k, v in states[0].items()})
    return {f"mean_model_{key}": values[0] for key, values in evaluate([probe]).items()}


def run_ddp(work: Workload, seed: int, steps: int) -> Run:
    """One model takes ``steps`` steps, each on one batch of each of the N shards."""
    tasks, batches = build(work, seed)
    model = tasks[0]
    for _ in range(steps):
        parts = [next(b) for b in batches]
        # Equal batches, so the mean loss over their concatenation is the mean of their N
        # mean losses: one call of the task's own step is DDP's averaged gradient.
        model.step(tuple(torch.cat(xs) for xs in zip(*parts)))
    return {**evaluate([model]), "exchanges": 0.0}


def run_diloco(work: Workload, seed: int, steps: int, h: int) -> Run:
    """N replicas, ``steps / h`` outer steps of ``h`` inner steps each."""
    tasks, batches = build(work, seed)
    anchor = [p.detach().clone() for p in tasks[0].model.parameters()]
    outer = torch.optim.SGD(anchor, lr=DILOCO_LR, momentum=DILOCO_MOMENTUM, nesterov=True)
    for _ in range(steps // h):
        for task, batch in zip(tasks, batches):
            for _ in range(h):
                task.step(next(batch))
        with torch.no_grad():
            replicas = [list(t.model.parameters()) for t in tasks]
            for k, a in enumerate(anchor):
                # The pseudo-gradient: how far the replicas moved from the anchor, averaged.
                a.grad = torch.stack([a - r[k] for r in replicas]).mean(0)
            outer.step()
            for params in replicas:
                for p, a in zip(params, anchor):
                    p.copy_(a)  # the inner optimizers' state stays as it is, per replica
    return {**evaluate(tasks), "exchanges": float(steps // h)}


def run_gossip(work: Workload, seed: int, steps: int, h: int, outer: bool,
               codec: str = "fp32") -> Run:
    """A sim swarm of N nodes until they have trained ``N * steps`` steps in all; every node
    is evaluated inside the step that reaches it, so none has stepped past it."""
    tasks, batches = build(work, seed)
    total = 0
    result: Run = {}

    def train(node: SimNode) -> float:
        nonlocal total, result
        if result:  # the budget is spent; the swarm is closing
            return 0.0
        loss = tasks[node.index].step(next(batches[node.index]))
        total += 1
        if total == N * steps:
            result = {**evaluate(tasks), **mean_model(work, seed, tasks)}
        return float(loss)

    async def main() -> None:
        # The outer step's settings are left to the library, so that the row follows them.
        averaging = AveragingConfig(every=h, interval=None, start="own", codec=codec)
        if not outer:
            averaging = dataclasses.replace(averaging, outer=False)
        config = dataclasses.replace(NodeConfig.local(), averaging=averaging)
        async with open_sim_swarm(N, seed=seed, model=lambda i: tasks[i].model,
                                  optimizer=lambda i: tasks[i].optimizer, train=train,
                                  step_time=STEP_TIME, config=config) as sim:
            await sim.wait_until(lambda: bool(result))
            # Both sides report an exchange, so this is per node, started or answered.
            result["exchanges"] = sum(e.result is Result.COMMITTED for e in sim.exchanges) / N
            # Bytes per committed exchange and side: its payload (the codec's, int8 while a
            # node is cold), and all a node sent (handshakes, messages and refused offers
            # too: about 2 KB an exchange, which at this model's 30K parameters is as much
            # as a mod4/16 payload, and nothing at 100M).
            committed = [e for e in sim.exchanges if e.result is Result.COMMITTED]
            result["bytes_per_exchange"] = (sum(e.nbytes or 0 for e in committed)
                                            / max(1, len(committed)))
            sent = sum(n.node.statistics().bytes_sent for n in sim.nodes if n.node is not None)
            result["wire_per_exchange"] = sent / max(1, len(committed))

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return result


def run(name: str, method: str, h: int, seed: int, steps: int) -> tuple[Run, float, float]:
    """One run of ``method`` on the workload named ``name``, its wall time and its CPU time
    in s (on a busy machine the CPU time says what the run costs; the wall time does not)."""
    began, cpu = time.perf_counter(), time.process_time()
    work = next(w for w in WORKLOADS if w.name == name)
    if method == "ddp":
        result = run_ddp(work, seed, steps)
    elif method == "diloco":
        result = run_diloco(work, seed, steps, h)
    elif method in CODECS:
        result = run_gossip(work, seed, steps, h, outer=True, codec=method)
    else:
        result = run_gossip(work, seed, steps, h, outer=method == "outer")
    return result, time.perf_counter() - began, time.process_time() - cpu


Job = tuple[str, str, int, int]  # workload, method, H, seed


def jobs(seeds: int) -> list[Job]:
    """Every run, the slowest first (the LM before the digits, swarms before the rest, small
    H first: a swarm's cost grows with its exchanges), so that the pool ends together."""
    out = [(w.name, m, h, seed) for w in WORKLOADS for m in METHODS
           for h in (HS[:1] if m == "ddp" else HS) for seed in range(1, seeds + 1)]
    out += [(w.name, c, h, seed) for w in WORKLOADS for c in CODECS for h in CODEC_HS
            for seed in range(1, seeds + 1)]
    cost = {"today": 0, "outer": 0, "diloco": 1, "ddp": 2, **{c: 0 for c in CODECS}}
    return sorted(out, key=lambda j: (j[0] == "digits", cost[j[1]], j[2]))


def run_all(seeds: int, steps: int, workers: int,
            started: float) -> dict[str, dict[str, dict[int, list[Run]]]]:
    """Every run, in ``workers`` processes; returns the runs by workload, method, H, seed."""
    out: dict[str, dict[str, dict[int, list[Run]]]] = {
        w.name: {m: {} for m in (*METHODS, *CODECS)} for w in WORKLOADS}
    todo = jobs(seeds)
    # Each run is independent, so separate processes use every core. One torch thread each:
    # these models are small enough that a second thread made a step slower, not faster.
    # Spawn, not fork: a forked child of a process that has run torch may hang in its pool.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=torch.set_num_threads,
                             initargs=(1,)) as pool:
        futures = {pool.submit(run, *job, steps): job for job in todo}
        for future in as_completed(futures):
            (name, method, h, seed), (result, wall, cpu) = futures[future], future.result()
            out[name][method].setdefault(h, []).append(
                {"seed": seed, **result, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1)})
            progress(f"[{time.perf_counter() - started:6.1f}s] {name} {method} H={h} seed "
                     f"{seed}: loss {sum(result['loss']) / len(result['loss']):.4f} "
                     f"({wall:.1f}s, CPU {cpu:.1f}s)")
    for by_method in out.values():
        for by_h in by_method.values():
            for runs in by_h.values():
                runs.sort(key=lambda r: r["seed"])
    return out


def summarize(runs: list[Run]) -> dict[str, float]:
    """Mean over seeds of the mean node's and the worst node's figures."""

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    out = {"loss": mean([mean(r["loss"]) for r in runs]),
           "worst_loss": mean([max(r["loss"]) for r in runs]),
           "exchanges": mean([r["exchanges"] for r in runs])}
    for key in ("bytes_per_exchange", "wire_per_exchange"):
        if key in runs[0]:
            out[key] = mean([r[key] for r in runs])
    if "accuracy" in runs[0]:
        out["accuracy"] = mean([mean(r["accuracy"]) for r in runs])
        out["worst_accuracy"] = mean([min(r["accuracy"]) for r in runs])
    for key in ("mean_model_loss", "mean_model_accuracy"):
        if key in runs[0]:
            out[key] = mean([r[key] for r in runs])
    return out


def gaps(work: Workload, s: dict[str, float], ddp: dict[str, float],
         diloco: dict[str, float]) -> dict[str, float]:
    """A method's gap to DDP (LM: relative loss, a fraction; digits: accuracy points) and
    its loss over DiLoCo's at the same H."""
    if work.classifier:
        return {"gap": ddp["accuracy"] - s["accuracy"],
                "worst_gap": ddp["accuracy"] - s["worst_accuracy"],
                "vs_diloco": s["loss"] / diloco["loss"]}
    return {"gap": (s["loss"] - ddp["loss"]) / ddp["loss"],
            "worst_gap": (s["worst_loss"] - ddp["loss"]) / ddp["loss"],
            "vs_diloco": s["loss"] / diloco["loss"]}


Summary = dict[str, dict[str, dict[int, dict[str, float]]]]  # workload, method, H: figures


def report(work: Workload, summary: dict[str, dict[int, dict[str, float]]]) -> str:
    """One workload's table: rows are (method, figure), columns the H values."""
    every, compared, swarms = set(METHODS), {"diloco", "today", "outer"}, {"today", "outer"}
    figures = ([("accuracy", "accuracy %, mean node", "{:.1f}", every),
                ("worst_accuracy", "accuracy %, worst node", "{:.1f}", every),
                ("mean_model_accuracy", "accuracy %, mean model", "{:.1f}", swarms),
                ("gap", "pts below DDP", "{:+.1f}", compared),
                ("loss", "loss, mean node", "{:.3f}", every)]
               if work.classifier else
               [("loss", "loss, mean node", "{:.3f}", every),
                ("worst_loss", "loss, worst node", "{:.3f}", every),
                ("mean_model_loss", "loss, mean model", "{:.3f}", swarms),
                ("gap", "gap to DDP %", "{:+.1f}", compared),
                ("vs_diloco", "loss / DiLoCo's", "{:.3f}", swarms)])
    figures.append(("exchanges", "exchanges per node", "{:.1f}", swarms))
    rows = []
    for method, label in METHODS.items():
        mine = [(key, name, fmt) for key, name, fmt, methods in figures if method in methods]
        for k, (key, name, fmt) in enumerate(mine):
            scale = 100 if key == "gap" and not work.classifier else 1
            rows.append([label if k == 0 else "", name,
                         *(fmt.format(scale * summary[method][h][key]) for h in HS)])
    return f"\n{work.label}\n" + table(["method", "figure", *(f"H={h}" for h in HS)], rows)


def headline(summary: Summary) -> dict[str, float]:
    """The JSON figures of the two gossip methods at the smallest H, ``TARGET_H`` and the
    largest."""
    out: dict[str, float] = {}
    for method, prefix in (("outer", ""), ("today", "today_")):
        for h in sorted({HS[0], TARGET_H, HS[-1]}):
            iid, skewed = summary["lm_iid"][method][h], summary["lm_skewed"][method][h]
            out[f"{prefix}lm_iid_gap_to_ddp_h{h}"] = round(iid["gap"], 4)
            out[f"{prefix}lm_iid_vs_diloco_h{h}"] = round(iid["vs_diloco"], 4)
            out[f"{prefix}lm_skewed_gap_to_ddp_h{h}"] = round(skewed["gap"], 4)
            out[f"{prefix}digits_sorted_gap_h{h}_n{N}"] = round(
                summary["digits"][method][h]["gap"], 2)
    return out


def verdicts(summary: Summary) -> dict[str, bool]:
    """The targets, for "gossip, outer step" at H = 100."""
    iid, skewed = summary["lm_iid"]["outer"][TARGET_H], summary["lm_skewed"]["outer"][TARGET_H]
    return {"lm_iid_gap": iid["gap"] <= TARGET_LM_IID,
            "lm_iid_vs_diloco": iid["vs_diloco"] <= 1.0,
            "lm_skewed_gap": skewed["gap"] <= TARGET_LM_SKEWED,
            "digits_gap": summary["digits"]["outer"][TARGET_H]["gap"] <= TARGET_DIGITS}


def lowbit(summary: Summary) -> dict[str, dict[str, dict[int, dict[str, float]]]]:
    """Per workload, codec and H in CODEC_HS: its bytes per exchange over fp32's (the outer
    step's run, measured the same way) and its gap to fp32 (LM: relative loss, a fraction;
    digits: accuracy points below)."""
    out: dict[str, dict[str, dict[int, dict[str, float]]]] = {}
    for work in WORKLOADS:
        mine = out[work.name] = {}
        for codec in CODECS:
            mine[codec] = {}
            for h in CODEC_HS:
                s, fp32 = summary[work.name][codec][h], summary[work.name]["outer"][h]
                gap = (fp32["accuracy"] - s["accuracy"] if work.classifier
                       else (s["loss"] - fp32["loss"]) / fp32["loss"])
                mine[codec][h] = {"bytes_ratio": s["bytes_per_exchange"]
                                  / fp32["bytes_per_exchange"],
                                  "wire_ratio": s["wire_per_exchange"]
                                  / fp32["wire_per_exchange"], "gap": gap,
                                  "loss": s["loss"], **({"accuracy": s["accuracy"]}
                                                        if work.classifier else {})}
    return out


def best(low: dict[str, dict[str, dict[int, dict[str, float]]]], budget: float) -> str | None:
    """The codec with the smallest LM gap at H = 100 among those within ``budget`` of fp32's
    bytes (on the IID LM), or None."""
    fits = [c for c in CODECS if low["lm_iid"][c][TARGET_H]["bytes_ratio"] <= budget]
    return min(fits, key=lambda c: low["lm_iid"][c][TARGET_H]["gap"], default=None)


def lowbit_report(low: dict[str, dict[str, dict[int, dict[str, float]]]]) -> str:
    """The codecs' table: rows (codec, figure), columns (workload, H)."""
    columns = [(w, h) for w in WORKLOADS for h in CODEC_HS]
    rows = []
    for codec in CODECS:
        for k, (key, name) in enumerate((("bytes_ratio", "payload / fp32's"),
                                         ("wire_ratio", "all bytes / fp32's"),
                                         ("gap", "gap to fp32"))):
            cells = []
            for work, h in columns:
                value = low[work.name][codec][h][key]
                cells.append(f"1/{1 / value:.1f}" if key != "gap" else
                             f"{value:+.1f} pts" if work.classifier else f"{100 * value:+.2f}%")
            rows.append([codec if k == 0 else "", name, *cells])
    head = ["codec", "figure", *(f"{w.name} H={h}" for w, h in columns)]
    return ("\nCodecs below 8 bits (gossip, outer step; gap to the same with fp32: LM relative "
            "loss, digits points)\n" + table(head, rows))


def lowbit_headline(low: dict[str, dict[str, dict[int, dict[str, float]]]]) -> dict[str, Any]:
    """The JSON figures of the best codec within 1/16 and within 1/50 of fp32's bytes."""
    out: dict[str, Any] = {}
    for budget, prefix in ((SIXTEENTH, "lm_lowbit"), (FIFTIETH, "lm_lowbit50")):
        codec = best(low, budget)
        out[f"{prefix}_codec_h100"] = codec
        lm = low["lm_iid"][codec][TARGET_H] if codec else None
        out[f"{prefix}_loss_gap_h100"] = None if lm is None else round(lm["gap"], 4)
        out[f"{prefix}_bytes_ratio_h100"] = None if lm is None else round(lm["bytes_ratio"], 4)
        out[f"{prefix}_wire_ratio_h100"] = None if lm is None else round(lm["wire_ratio"], 4)
    codec = out["lm_lowbit_codec_h100"]
    out[f"digits_lowbit_gap_h100_n{N}"] = (
        None if codec is None else round(low["digits"][codec][TARGET_H]["gap"], 2))
    out[f"digits_lowbit_bytes_ratio_h100_n{N}"] = (
        None if codec is None else round(low["digits"][codec][TARGET_H]["bytes_ratio"], 4))
    for codec in CODECS:
        name = codec.replace("/", "_")
        for work in WORKLOADS:
            out[f"{work.name}_{name}_gap_h100"] = round(low[work.name][codec][TARGET_H]["gap"], 4)
    return out


def lowbit_verdicts(lows: dict[str, Any]) -> str:
    """The codecs' targets, in words."""
    def said(value: float | None, limit: float) -> str:
        return "none within the bytes" if value is None else (
            "met" if value <= limit else "MISSED")

    return (f"codec targets at H = {TARGET_H}: LM within {TARGET_LOWBIT_LM[0]:.0%} of fp32 at "
            f"<= 1/16 of its bytes ({lows['lm_lowbit_codec_h100']}) "
            f"{said(lows['lm_lowbit_loss_gap_h100'], TARGET_LOWBIT_LM[0])}; within "
            f"{TARGET_LOWBIT_LM[1]:.0%} at <= 1/50 ({lows['lm_lowbit50_codec_h100']}) "
            f"{said(lows['lm_lowbit50_loss_gap_h100'], TARGET_LOWBIT_LM[1])}; digits within "
            f"{TARGET_LOWBIT_DIGITS:g} point at <= 1/16 "
            f"{said(lows[f'digits_lowbit_gap_h100_n{N}'], TARGET_LOWBIT_DIGITS)}")


def plot(summary: Summary) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(WORKLOADS), figsize=(5 * len(WORKLOADS), 4.5))
    for ax, work in zip(axes, WORKLOADS):
        key = "accuracy" if work.classifier else "loss"
        for k, (method, label) in enumerate(METHODS.items()):
            values = [summary[work.name][method][h][key] for h in HS]
            ax.plot(HS, values, marker="o", color="black" if method == "ddp" else f"C{k}",
                    linestyle="--" if method == "ddp" else "-", label=label)
        ax.set_xscale("log")
        ax.set_xticks(HS, [str(h) for h in HS])
        ax.minorticks_off()
        ax.set_xlabel("H, local steps between syncs")
        ax.set_ylabel("held-out accuracy %, mean node" if work.classifier
                      else "held-out loss (nats), mean node")
        ax.set_title(work.label, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"N = {N}, the same samples for every method and H")
    save_figure(fig, "lowcomm")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="1 seed, 1,000 steps per node (about 8 minutes on 2 idle cores)")
    parser.add_argument("--seeds", type=int, help="seeds per run (default 2, --quick 1)")
    parser.add_argument("--steps", type=int,
                        help="steps per node, a multiple of every H (default 2000, --quick 1000)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="runs at once, one process each (default: one per core)")
    args = parser.parse_args()
    seeds = args.seeds or (1 if args.quick else 2)
    steps = args.steps or (1000 if args.quick else 2000)
    if seeds < 1 or args.jobs < 1:
        parser.error("--seeds and --jobs must be at least 1")
    if steps < max(HS) or steps % max(HS):
        parser.error(f"--steps must be a multiple of {max(HS)}, so that DiLoCo ends on a sync")
    started = time.perf_counter()
    per_seed = run_all(seeds, steps, args.jobs, started)
    summary: Summary = {}
    for work in WORKLOADS:
        stats = {m: {h: summarize(runs) for h, runs in by_h.items()}
                 for m, by_h in per_seed[work.name].items()}
        stats["ddp"] = {h: stats["ddp"][HS[0]] for h in HS}  # DDP has no H
        for method in ("diloco", "today", "outer"):
            for h in HS:
                stats[method][h].update(gaps(work, stats[method][h], stats["ddp"][h],
                                             stats["diloco"][h]))
        summary[work.name] = stats
    plot(summary)
    elapsed = time.perf_counter() - started

    defaults = AveragingConfig()
    print(f"\nN = {N} nodes, {steps:,} steps per node (the same samples for every method and "
          f"H), {seeds} seed{'s' * (seeds > 1)}; LM options {LM_OPTIONS}; DiLoCo outer SGD lr "
          f"{DILOCO_LR}, Nesterov momentum {DILOCO_MOMENTUM}; gossip: {STEP_TIME * 1000:g} ms "
          f"per step (virtual), drift correction on, outer step lr {defaults.outer_lr}, "
          f"momentum {defaults.outer_momentum} (the library's defaults)")
    for work in WORKLOADS:
        print(report(work, summary[work.name]))
    low = lowbit(summary)
    print(lowbit_report(low))
    met = verdicts(summary)
    print(f"\nheld-out figures at the end of the budget, every node evaluated; mean over "
          f"seeds. gap to DDP: (L - L_ddp) / L_ddp of the mean node loss; pts below DDP: its "
          f"accuracy minus the mean node's.\nmean model: the nodes' parameters averaged (no "
          f"node holds it; DiLoCo's replicas and DDP's model are their own).\nexchanges per "
          f"node: committed exchanges each node took part in (started or answered). DiLoCo "
          f"syncs {steps}/H times.")
    print(f"targets at H = {TARGET_H} (gossip, outer step): LM IID within "
          f"{TARGET_LM_IID:.0%} of DDP {'met' if met['lm_iid_gap'] else 'MISSED'}, no worse "
          f"than DiLoCo {'met' if met['lm_iid_vs_diloco'] else 'MISSED'}; LM skewed within "
          f"{TARGET_LM_SKEWED:.0%} {'met' if met['lm_skewed_gap'] else 'MISSED'}; digits "
          f"within {TARGET_DIGITS:g} points {'met' if met['digits_gap'] else 'MISSED'}")
    cpu = sum(r["cpu_s"] for by_m in per_seed.values() for by_h in by_m.values()
              for runs in by_h.values() for r in runs)
    print(f"wall time {elapsed:.1f} s, {args.jobs} jobs; the runs' CPU time {cpu:.0f} s")

    lowbits = lowbit_headline(low)
    print(lowbit_verdicts(lowbits))
    out = {**headline(summary), **lowbits, "targets_met": all(met.values()),
           "quick": args.quick, "seconds": round(elapsed, 1)}
    save_json("lowcomm", {
        **out, "nodes": N, "hs": list(HS), "steps_per_node": steps, "seeds": seeds,
        "step_time": STEP_TIME, "lm_options": LM_OPTIONS, "jobs": args.jobs, "cpu_s": round(cpu),
        "diloco": {"lr": DILOCO_LR, "momentum": DILOCO_MOMENTUM},
        "gossip_averaging": {k: v for k, v in dataclasses.asdict(defaults).items()
                             if k in ("outer", "outer_lr", "outer_momentum", "correction",
                                      "weight", "codec")},
        "verdicts": met, "lowbit": {w: {c: {str(h): f for h, f in by_h.items()}
                                        for c, by_h in by_c.items()} for w, by_c in low.items()},
        "summary": {w: {m: {str(h): s for h, s in by_h.items()} for m, by_h in by_m.items()}
                    for w, by_m in summary.items()},
        "per_seed": {w: {m: {str(h): r for h, r in by_h.items()} for m, by_h in by_m.items()}
                     for w, by_m in per_seed.items()}})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
