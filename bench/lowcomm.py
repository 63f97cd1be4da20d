"""Low-communication training: gossip with H local steps between syncs against DDP and DiLoCo.

N = 8 nodes; H = 1, 50, 100 and 500; a 1M-parameter byte-level transformer LM on real text
(IID and skewed by package) and label-sorted digits; the same samples for every method at
each H.

Targets (the issue on learning at internet spacing), for "gossipd" (the library's defaults):
the LM's held-out loss no worse than DiLoCo's at H = 100 and at H = 500, IID and skewed, and
within 5% of DDP's at H = 100 (IID); the label-sorted digits within 10 points of DDP's
accuracy at H = 100 and no worse than DiLoCo's.

Method
------
The tasks, their shards, the budgets, the held-out data and the link are
:mod:`workloads`'s; DDP and DiLoCo are :mod:`replicas`'s (plain torch, what they would send
counted). Methods, side by side:

- DDP: one model, one optimizer, each step on one batch of each of the 8 shards (8 batches a
  step), at the task's learning rate. It does not depend on H: one run per task and seed,
  evaluated at every budget the columns use (with ``--schedule cosine``, one run per budget,
  each on its own schedule).
- DiLoCo: all-reduce of the pseudo-gradients every H steps, outer Nesterov SGD lr 0.7,
  momentum 0.9, inner AdamW (the task's optimizer), every replica restarting from the anchor.
- gossip, plain: :func:`gossip.testing.open_sim_swarm`, real protocol nodes (membership,
  encrypted channels, the exchange and its checks) on a simulated network under trio's
  ``MockClock``, each starting a pairwise round every ``every = H`` local steps (x U(0.75,
  1.25)), averaging weights only, one exchange a round in fp32 at every spacing: ``outer =
  False``, ``correction = False``, ``peers = 1``, ``wide_codec = "fp32"``.
- gossipd: the same swarm with the library's defaults for everything but ``every``,
  ``interval`` and ``start`` (the node hands its optimizer to the swarm, as the daemon does).

The link: every pair of nodes is joined by a link of :func:`workloads.link_rate` bytes/s each
way, 20 ms one way: the link on which an exchange of the model in float32 takes H/2 steps,
where ``every = "auto"`` picks this H for plain averaging (:func:`payload_bytes`), so each
column is what a volunteer's link of that speed gives. An exchange runs while both nodes
train on (the steps it overlaps stay on top of what it brings). DiLoCo and DDP block for their
all-reduce: on the same link a ring all-reduce of the model takes ``2 (N - 1) / N`` of a
payload's time, which the time-to-loss plot adds to their clocks (DiLoCo once per H steps,
DDP at every step); their learning is not affected.

Budget: at each H every method trains ``max(2,000, 20 H)`` steps per node (``--least``) x 8
nodes x the task's batch: at least 20 syncs for every method at every H, and 10,000 steps at
H = 500. ``--quick`` runs one seed, DDP, DiLoCo and gossipd on the LM at H = 100 only and every
method on the digits at every H: 2,540 s of CPU, about 21 minutes of two cores (a run of
2,000 steps of 8 nodes of the LM takes 400-450 s of CPU, one of 10,000 about 1,900 s, so the
full run is about 13 CPU-hours; ``--resume`` takes it in parts).

Measure: 8 times per run every node is evaluated on the fixed held-out data with the task's
own ``evaluate()`` (the LM: cross-entropy in nats on 256 windows of 64 bytes of files never
trained on; the digits: accuracy on the 359 test images), from inside the training step that
reaches the point, so a swarm's nodes are caught wherever they are between rounds; DiLoCo is
evaluated just after a sync (its replicas hold the anchor), DDP has one model. Figures are
the mean over nodes (and the worst node), then the mean over seeds. For the swarms the mean
model (the nodes' parameters averaged, which no node holds) is evaluated at the end too: it
tells the drift between nodes apart from what the swarm learned; and so are the nodes'
anchors (the state each node's last outer step left it, before its local steps since: the
swarm's counterpart of the state DiLoCo is evaluated in), mean over nodes.

``--schedule cosine`` runs every method's inner learning rate down a cosine to 10% of the
task's at the budget (the published runs' recipe; by default it is constant): at the end of a
run each node's last local steps then move it little, and what is left of the nodes' drift
is what the exchanges did not mix.

- LM gap to DDP: ``(L - L_ddp) / L_ddp`` of the mean node loss, in % (JSON: a fraction).
- vs DiLoCo: the method's mean node loss over DiLoCo's at the same H (below 1: better), at
  the same steps; and at the same time on the column's link ("same time", JSON ``..._same_time``):
  the swarm's figure at its budget against DiLoCo's, interpolated between its evaluations, at
  the moment the swarm got there, DiLoCo's clock counting its blocking all-reduces (the
  time-to-loss plot's reading at that moment).
- digits gap: DDP's accuracy minus the mean node accuracy, in points.
- communication per node: MB each node sent over the budget (the swarms: measured, every
  byte on the wire; DDP and DiLoCo: their ring all-reduces).

Runs are independent and single-threaded, so they go to ``--jobs`` processes (one per core);
the figures do not depend on how many. ``--gpu`` runs the IID LM at 25M parameters
(:data:`workloads.GPU_LM_OPTIONS`) at H = 100 and 500 on ``cuda`` (``--device`` to override),
each run in turn on the one device, and prints its own JSON keys (``gpu_*``).

Usage: python bench/lowcomm.py [--quick | --gpu] [--seeds 2] [--least 2000] [--jobs 2]
       [--hs 1,50,100,500] [--schedule constant|cosine] [--resume] [--lm KEY=VALUE ...]
       [--set KEY=VALUE ...]
Tables on stdout, progress on stderr; the last line printed is one JSON object with the
headline figures. Writes bench/results/lowcomm.json, lowcomm.png and lowcomm_curves.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any

import torch
import trio
import trio.testing

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

import gossip.replica
import gossip.tensors
from common import progress, pyplot, results_path, save_figure, save_json, table
from daemon.task import Context, Task, TaskError
from daemon.tasks import charlm
from gossip import AveragingConfig, NodeConfig
from gossip.averaging import Result
from gossip.config import LARGE_SPACING
from gossip.plan import plan
from gossip.testing import SimNode, open_sim_swarm
from replicas import DILOCO_LR, DILOCO_MOMENTUM, blocking_time, run_ddp, run_diloco
from workloads import (GPU_LM_OPTIONS, LM_OPTIONS, N, SCHEDULES, STEP_TIME, WORKLOADS, Workload,
                       allreduce_bytes, budget, build, evaluate, figures, link_rate, lm_workloads,
                       mean_model, numel, points, spread)

HS = (1, 50, 100, 500)  # local steps between syncs
QUICK_LM_HS = (100,)
GPU_HS = (100, 500)
LEAST = 2000  # steps per node at the smallest budget (then ROUNDS x H)
LATENCY = 0.02  # s one way on every link
TARGET_H = (100, 500)  # the H values the targets judge
TARGET_DDP_GAP = 0.05  # the IID LM's loss over DDP's, at H = 100
TARGET_DIGITS = 10.0  # points below DDP, at H = 100
CPU = torch.device("cpu")

METHODS = {"ddp": "DDP (all-reduce every step)", "diloco": "DiLoCo (all-reduce every H)",
           "plain": "gossip, plain averaging", "gossipd": "gossipd (defaults)"}
SWARMS = ("plain", "gossipd")

Run = dict[str, Any]  # one run: "curve" [(step, figures)], "final", "bytes", ...


def gossip_config(method: str, h: int, overrides: Mapping[str, Any]) -> NodeConfig:
    """A node's settings: the library's defaults (WAN membership timing, as on the
    internet) with rounds every ``h`` steps and no timer; "plain" averages weights only;
    ``overrides`` (``--set``) change gossipd's."""
    averaging = AveragingConfig(every=h, interval=None, start="own")
    if method == "plain":  # classic pairwise gossip, whatever the spacing
        averaging = dataclasses.replace(averaging, outer=False, correction=False, peers=1,
                                        wide_codec="fp32")
    else:
        averaging = dataclasses.replace(averaging, **overrides)
    return dataclasses.replace(NodeConfig.wan(), averaging=averaging)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``key=value`` pairs of :class:`AveragingConfig` fields, each value in TOML.

    Raises:
        ValueError: not key=value, a key that is no averaging setting, or a bad value.
    """
    out: dict[str, Any] = {}
    names = {f.name for f in dataclasses.fields(AveragingConfig)}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in names:
            raise ValueError(f"--set {item!r}: expected key=value with key one of "
                             f"{', '.join(sorted(names))}")
        try:
            out[key] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            out[key] = value  # a bare word: a string
    dataclasses.replace(AveragingConfig(), **out)  # validates: ValueError names the field
    return out


def parse_lm(items: list[str], base: Mapping[str, Any]) -> dict[str, Any]:
    """``base``, the LM's options (``daemon.tasks.charlm``), with ``key=value`` options over
    it, each value in TOML.

    Raises:
        ValueError: not key=value, or an option the task does not take (its own check, on a
            model built with them, names the option).
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--lm {item!r}: expected key=value")
        try:
            out[key] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            out[key] = value
    if out:
        try:
            charlm.task(Context(0, CPU, {**base, **out}))
        except TaskError as exc:
            raise ValueError(f"--lm: {exc}") from None
    return {**base, **out}


def payload_bytes(parameters: int) -> int:
    """Bytes of the payload a column's link is sized for: the weights in float32, what plain
    averaging sends each way per exchange and what DiLoCo all-reduces. gossipd's wide plan
    (three exchanges a round, int8: :mod:`gossip.plan`) sends 3 x 1.06 bytes a parameter a
    round, 0.8 of it, so on this link ``every = "auto"`` would space its rounds a little
    closer than H; the columns fix ``every = H`` so that every method starts its syncs equally
    often (a gossipd node takes part in about six exchanges a round, three it starts and about
    as many it answers, plain gossip's in two; the table counts them)."""
    return 4 * parameters


def run_gossip(work: Workload, method: str, seed: int, steps: int, h: int, tag: str,
               overrides: Mapping[str, Any]) -> Run:
    """A sim swarm of N nodes until they have trained ``N * steps`` steps in all, evaluated
    at :func:`workloads.points` (every node inside the step that reaches the point)."""
    tasks, batches = build(work, seed, CPU, steps)
    probe = work.factory(Context(seed, CPU, work.options))
    parameters = numel(tasks[0])
    rate = link_rate(payload_bytes(parameters), h)
    marks = {N * p: p for p in points(steps)}
    total = 0
    curve: list[tuple[int, dict[str, float]]] = []
    clock: list[float] = []
    out: Run = {}
    swarm: list[Any] = []  # the sim, once open

    def train(node: SimNode) -> float:
        nonlocal total
        if out:  # the budget is spent; the swarm is closing
            return 0.0
        loss = tasks[node.index].step(next(batches[node.index]))
        total += 1
        if total in marks:
            result = evaluate(tasks)
            curve.append((marks[total], figures(result) | {"spread": spread(tasks)}))
            clock.append(trio.current_time())
            progress(f"  {tag}: step {marks[total]}/{steps} loss {curve[-1][1]['loss']:.4f}")
            if total == N * steps:
                out.update(final=result, **mean_model(work, tasks, probe),
                           **anchors(swarm[0], probe))
        return float(loss)

    async def main() -> None:
        async with open_sim_swarm(N, seed=seed, model=lambda i: tasks[i].model,
                                  optimizer=lambda i: tasks[i].optimizer, train=train,
                                  step_time=STEP_TIME,
                                  config=gossip_config(method, h, overrides),
                                  latency=LATENCY, bandwidth=rate) as sim:
            swarm.append(sim)
            began = trio.current_time()
            await sim.wait_until(lambda: bool(out))
            committed = [e for e in sim.exchanges if e.result is Result.COMMITTED]
            # Both sides report an exchange, so this is per node, started or answered.
            out["exchanges"] = len(committed) / N
            sent = [n.node.statistics().bytes_sent for n in sim.nodes if n.node is not None]
            out["bytes"] = sum(sent) / len(sent)
            out["clock"] = [t - began for t in clock]

    # Every node's copies and mixing run inline, on the virtual clock: in a worker thread
    # (the library's choice from 1 MiB of float32 up) trio would jump the clock while the
    # thread works, so an exchange's length would depend on this machine's speed.
    gossip.replica.OFFLOAD_NUMEL = 1 << 62
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return {**out, "curve": curve, "params": parameters, "rate": rate}


def anchors(sim: Any, probe: Task) -> dict[str, float]:
    """The held-out figures of the nodes' outer anchors (the state each node's last outer step
    left, before the local steps since: what DiLoCo's replicas hold when it is evaluated),
    mean over the nodes that have one, loaded into ``probe``; empty where none has."""
    results = []
    for n in sim.nodes:
        replica = n.node.replica if n.node is not None else None
        state = replica.outer_state() if replica is not None else None
        if state:
            gossip.tensors.load_(probe.model, replica.schema, state["anchor"])
            results.append(evaluate([probe]))
    if not results:
        return {}
    return {f"anchor_{key}": mean([r[key][0] for r in results]) for key in results[0]}


Job = tuple[str, str, int, int]  # workload, method, H (DDP: 0, all budgets; or the budget), seed


def ddp_key(work: Workload, h: int, least: int) -> int:
    """The H of the DDP run that column ``h`` compares with: 0, one run evaluated at every
    budget, where the learning rate does not depend on the budget; else the budget's own."""
    return 0 if work.schedule == "constant" else budget(h, least)


def run_key(work: Workload, method: str, h: int, least: int) -> int:
    """The H under which column ``h``'s runs of ``method`` are kept."""
    return ddp_key(work, h, least) if method == "ddp" else h


def run(job: Job, workloads: list[Workload], hs: dict[str, tuple[int, ...]], least: int,
        device: str, overrides: Mapping[str, Any]) -> tuple[Run, float, float]:
    """One run, its wall time and its CPU time in s (on a busy machine the CPU time says what
    the run costs; the wall time does not)."""
    began, cpu = time.perf_counter(), time.process_time()
    name, method, h, seed = job
    work = next(w for w in workloads if w.name == name)
    if method == "ddp":
        budgets = [budget(x, least) for x in hs[name]] if h == 0 else [h]
        result = run_ddp(work, seed, max(budgets), torch.device(device), budgets)
    elif method == "diloco":
        result = run_diloco(work, seed, budget(h, least), h, torch.device(device))
    else:
        result = run_gossip(work, method, seed, budget(h, least), h,
                            f"{name} {method} H={h} seed {seed}", overrides)
    return result, time.perf_counter() - began, time.process_time() - cpu


def jobs(workloads: list[Workload], hs: dict[str, tuple[int, ...]], seeds: int, least: int,
         methods: Mapping[str, tuple[str, ...]] | None = None) -> list[Job]:
    """Every run of each workload's ``methods`` (default: all), the slowest first (the longest
    budgets, swarms before DiLoCo before DDP, the LM before the digits), so that the pool ends
    together."""
    ran = {w.name: tuple(METHODS) if methods is None else methods[w.name] for w in workloads}
    out = [(w.name, "ddp", k, s) for w in workloads if "ddp" in ran[w.name]
           for k in sorted({ddp_key(w, h, least) for h in hs[w.name]})
           for s in range(1, seeds + 1)]
    out += [(w.name, m, h, s) for w in workloads for m in ("diloco", *SWARMS)
            if m in ran[w.name] for h in hs[w.name] for s in range(1, seeds + 1)]
    cost = {"gossipd": 0, "plain": 0, "diloco": 1, "ddp": 2}
    return sorted(out, key=lambda j: (j[0] == "digits", j[1] != "ddp" and -j[2], cost[j[1]]))


def journal_key(job: Job, workloads: list[Workload], hs: dict[str, tuple[int, ...]],
                least: int, device: str, overrides: Mapping[str, Any]) -> str:
    """What makes a run the same run: its job and every setting its figures depend on."""
    name, method, h, seed = job
    work = next(w for w in workloads if w.name == name)
    return json.dumps({"job": job, "least": least, "device": device, "options": dict(work.options),
                       "schedule": work.schedule,
                       "hs": list(hs[name]) if method == "ddp" else None,
                       "overrides": dict(overrides) if method == "gossipd" else None},
                      sort_keys=True)


def run_all(workloads: list[Workload], hs: dict[str, tuple[int, ...]], seeds: int,
            least: int, workers: int, device: str, overrides: Mapping[str, Any],
            started: float, journal: Path, resume: bool,
            methods: Mapping[str, tuple[str, ...]]) -> dict[str, dict[str, dict[int, list[Run]]]]:
    """Every run, in ``workers`` processes; returns the runs by workload, method, H, seed.
    Each run is appended to ``journal`` as it ends; with ``resume``, the runs found there
    with the same settings are taken from it, not run again."""
    out: dict[str, dict[str, dict[int, list[Run]]]] = {
        w.name: {m: {} for m in METHODS} for w in workloads}
    done: dict[str, Run] = {}
    if resume and journal.exists():
        for line in journal.read_text().splitlines():
            entry = json.loads(line)
            done[entry["key"]] = entry["run"]
    todo = []
    for job in jobs(workloads, hs, seeds, least, methods):
        found = done.get(journal_key(job, workloads, hs, least, device, overrides))
        if found is None:
            todo.append(job)
        else:
            name, method, h, _ = job
            out[name][method].setdefault(h, []).append(found)
    if len(todo) < len(jobs(workloads, hs, seeds, least, methods)):
        taken = len(jobs(workloads, hs, seeds, least, methods)) - len(todo)
        progress(f"{taken} runs taken from {journal}")
    # Spawn, not fork: a forked child of a process that has run torch may hang in its pool.
    # One torch thread each: a second thread made these small models' steps no faster.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=torch.set_num_threads,
                             initargs=(1,)) as pool:
        futures = {pool.submit(run, job, workloads, hs, least, device, overrides): job
                   for job in todo}
        for future in as_completed(futures):
            job, (result, wall, cpu) = futures[future], future.result()
            name, method, h, seed = job
            mine = {"seed": seed, **result, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1)}
            out[name][method].setdefault(h, []).append(mine)
            with journal.open("a") as file:
                key = journal_key(job, workloads, hs, least, device, overrides)
                file.write(json.dumps({"key": key, "run": mine}) + "\n")
            last = result["curve"][-1][1]
            progress(f"[{time.perf_counter() - started:6.0f}s] {name} {method} "
                     f"{'H=' + str(h) if h else ''} seed {seed}: loss {last['loss']:.4f} "
                     f"({wall:.0f}s, CPU {cpu:.0f}s)")
    for by_method in out.values():
        for by_h in by_method.values():
            for runs in by_h.values():
                runs.sort(key=lambda r: r["seed"])
    return out


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def at_step(curve: list[tuple[int, dict[str, float]]], step: int) -> dict[str, float]:
    """The figures of the evaluation at ``step``."""
    return next(f for s, f in curve if s == step)


def summarize(work: Workload, runs: dict[str, dict[int, list[Run]]], h: int,
              least: int) -> dict[str, dict[str, float]]:
    """Per method that ran, at spacing ``h``: the figures at the budget, mean over seeds, the
    gaps (where DDP, DiLoCo ran), and the communication per node."""
    steps = budget(h, least)
    out: dict[str, dict[str, float]] = {}
    for method in METHODS:
        mine = runs[method].get(run_key(work, method, h, least))
        if not mine:
            continue
        finals = [at_step(r["curve"], steps) for r in mine]
        s = {key: mean([f[key] for f in finals]) for key in finals[0] if key != "spread"}
        params = mine[0]["params"]
        if method == "ddp":
            s["mb_per_node"] = allreduce_bytes(params) * steps / 1e6
        elif method == "diloco":
            s["mb_per_node"] = allreduce_bytes(params) * steps // h / 1e6
            s["syncs"] = steps // h
        else:
            s["mb_per_node"] = mean([r["bytes"] for r in mine]) / 1e6
            s["syncs"] = mean([r["exchanges"] for r in mine])
            s["spread"] = mean([r["curve"][-1][1]["spread"] for r in mine])
            for key in ("mean_model_loss", "mean_model_accuracy", "anchor_loss",
                        "anchor_accuracy"):
                if key in mine[0]:
                    s[key] = mean([r[key] for r in mine])
        out[method] = s
    ddp, diloco = out.get("ddp"), out.get("diloco")
    for method in SWARMS:
        swarm, theirs = runs[method].get(h), runs["diloco"].get(h)
        if method in out and swarm and theirs:
            out[method]["vs_diloco_same_time"] = same_time(work, swarm, theirs, h, least)
    for method, s in out.items():
        if work.classifier:
            if ddp:
                s["gap"] = ddp["accuracy"] - s["accuracy"]
            if diloco:
                s["vs_diloco"] = s["accuracy"] - diloco["accuracy"]  # points, above 0: better
        else:
            if ddp:
                s["gap"] = (s["loss"] - ddp["loss"]) / ddp["loss"]
            if diloco:
                s["vs_diloco"] = s["loss"] / diloco["loss"]
    return out


Summary = dict[str, dict[int, dict[str, dict[str, float]]]]  # workload, H, method: figures


def report(work: Workload, summary: dict[int, dict[str, dict[str, float]]],
           least: int) -> str:
    """One workload's table: rows are (method, figure), columns the H values."""
    hs = sorted(summary)
    swarms, compared = set(SWARMS), {"diloco", *SWARMS}
    every = set(METHODS)
    if work.classifier:
        figures = [("accuracy", "accuracy %, mean node", "{:.1f}", every),
                   ("worst_accuracy", "accuracy %, worst node", "{:.1f}", every),
                   ("mean_model_accuracy", "accuracy %, mean model", "{:.1f}", swarms),
                   ("anchor_accuracy", "accuracy %, anchors", "{:.1f}", swarms),
                   ("gap", "pts below DDP", "{:+.1f}", compared),
                   ("vs_diloco", "pts above DiLoCo", "{:+.1f}", swarms),
                   ("vs_diloco_same_time", "pts above DiLoCo, same time", "{:+.1f}", swarms)]
    else:
        figures = [("loss", "loss, mean node", "{:.4f}", every),
                   ("worst_loss", "loss, worst node", "{:.4f}", every),
                   ("mean_model_loss", "loss, mean model", "{:.4f}", swarms),
                   ("anchor_loss", "loss, anchors", "{:.4f}", swarms),
                   ("gap", "gap to DDP %", "{:+.2f}", compared),
                   ("vs_diloco", "loss / DiLoCo's", "{:.4f}", swarms),
                   ("vs_diloco_same_time", "loss / DiLoCo's, same time", "{:.4f}", swarms)]
    figures += [("syncs", "syncs per node", "{:.1f}", compared),
                ("spread", "spread of nodes", "{:.4f}", swarms),
                ("mb_per_node", "MB sent per node", "{:.0f}", every)]
    def cell(h: int, method: str, key: str, fmt: str) -> str:
        value = summary[h].get(method, {}).get(key)
        scale = 100 if key == "gap" and not work.classifier else 1
        return "-" if value is None else fmt.format(scale * value)

    rows = []
    for method, label in METHODS.items():
        if not any(method in summary[h] for h in hs):
            continue
        mine = [(key, name, fmt) for key, name, fmt, methods in figures if method in methods]
        for k, (key, name, fmt) in enumerate(mine):
            rows.append([label if k == 0 else "", name, *(cell(h, method, key, fmt) for h in hs)])
    head = ["method", "figure", *(f"H={h} ({budget(h, least):,} steps)" for h in hs)]
    return f"\n{work.label}\n" + table(head, rows)


def headline(summary: Summary, params: int, prefix: str = "") -> dict[str, Any]:
    """The JSON figures of gossipd (and of plain gossip, ``plain_``) against DiLoCo and DDP,
    at the targets' H values (None where not run) and at every other H the LM ran."""
    out: dict[str, Any] = {f"{prefix}lm_params": params}
    ran = {h for work in ("lm_iid", "lm_skewed") for h in summary.get(work, {})}
    for method, name in (("gossipd", ""), ("plain", "plain_")):
        for h in sorted(ran | set(TARGET_H)):
            for work in ("lm_iid", "lm_skewed"):
                s = summary.get(work, {}).get(h, {}).get(method, {})
                out[f"{prefix}{name}{work}_vs_diloco_h{h}"] = rounded(s.get("vs_diloco"), 4)
                out[f"{prefix}{name}{work}_vs_diloco_h{h}_same_time"] = rounded(
                    s.get("vs_diloco_same_time"), 4)
                out[f"{prefix}{name}{work}_gap_to_ddp_h{h}"] = rounded(s.get("gap"), 4)
        digits = summary.get("digits", {}).get(100, {}).get(method, {})
        if not prefix:
            out[f"{name}digits_sorted_gap_h100_n{N}"] = rounded(digits.get("gap"), 2)
            out[f"{name}digits_sorted_vs_diloco_h100_n{N}"] = rounded(digits.get("vs_diloco"), 2)
            out[f"{name}digits_sorted_vs_diloco_h100_n{N}_same_time"] = rounded(
                digits.get("vs_diloco_same_time"), 2)
    return out


def rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def verdicts(summary: Summary) -> dict[str, bool | None]:
    """The targets, for gossipd (None: not run, or the baseline it is judged against not)."""
    def judged(work: str, h: int, test: Any) -> bool | None:
        s = summary.get(work, {}).get(h, {}).get("gossipd")
        try:
            return None if s is None else bool(test(s))
        except KeyError:
            return None

    out: dict[str, bool | None] = {}
    for work in ("lm_iid", "lm_skewed"):
        for h in TARGET_H:
            out[f"{work}_vs_diloco_h{h}"] = judged(work, h, lambda s: s["vs_diloco"] <= 1.0)
    out["lm_iid_gap_to_ddp_h100"] = judged("lm_iid", 100,
                                           lambda s: s["gap"] <= TARGET_DDP_GAP)
    out["digits_gap_h100"] = judged("digits", 100, lambda s: s["gap"] <= TARGET_DIGITS)
    out["digits_vs_diloco_h100"] = judged("digits", 100, lambda s: s["vs_diloco"] >= 0)
    return out


def wall_clock(method: str, runs: list[Run], h: int, least: int) -> list[float]:
    """Virtual seconds at each point of the first seed's curve on the column's link: the
    swarms' measured clock; DiLoCo's and DDP's compute plus their blocking all-reduces."""
    return run_clock(method, runs[0], h, least)


def run_clock(method: str, run: Run, h: int, least: int) -> list[float]:
    """:func:`wall_clock` of one run."""
    if method in SWARMS:
        return run["clock"]
    rate = link_rate(payload_bytes(run["params"]), h)
    steps = [s for s, _ in run["curve"] if s <= budget(h, least)]
    sync = allreduce_bytes(run["params"])
    return [blocking_time(s, s if method == "ddp" else s // h, sync, rate) for s in steps]


def at_time(curve: list[tuple[int, dict[str, float]]], clock: list[float], seconds: float,
            key: str) -> float | None:
    """The figure ``key`` of a run at ``seconds`` on its clock, interpolated between its
    evaluations (from the start's, taken as its first); None past its last."""
    if seconds > clock[-1]:
        return None
    times = [0.0, *clock]
    values = [curve[0][1][key], *(f[key] for _, f in curve[:len(clock)])]
    for k in range(1, len(times)):
        if seconds <= times[k]:
            part = (seconds - times[k - 1]) / max(times[k] - times[k - 1], 1e-12)
            return values[k - 1] + part * (values[k] - values[k - 1])
    return values[-1]


def same_time(work: Workload, swarm: list[Run], diloco: list[Run], h: int,
              least: int) -> float | None:
    """The swarm's figure at its budget against DiLoCo's at the same time on the same link
    (its blocking all-reduces counted), mean over the seeds both ran: a loss ratio, or points
    above DiLoCo; None where DiLoCo had not got as far by then (it would have to be
    extrapolated)."""
    key = "accuracy" if work.classifier else "loss"
    ratios = []
    by_seed = {r["seed"]: r for r in diloco}
    for mine in swarm:
        theirs = by_seed.get(mine["seed"])
        if theirs is None:
            continue
        then = at_time(theirs["curve"], run_clock("diloco", theirs, h, least),
                       mine["clock"][-1], key)
        if then is None:
            return None
        own = at_step(mine["curve"], budget(h, least))[key]
        ratios.append(own - then if work.classifier else own / then)
    return mean(ratios) if ratios else None


def plot(workloads: list[Workload], per_seed: dict[str, dict[str, dict[int, list[Run]]]],
         summary: Summary, least: int, name: str) -> None:
    """Held-out figure against H per method (``name``.png) and the time-to-loss curves at
    each H (``name``_curves.png)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4.5),
                             squeeze=False, constrained_layout=True)
    for ax, work in zip(axes[0], workloads):
        key = "accuracy" if work.classifier else "loss"
        hs = sorted(summary[work.name])
        for k, (method, label) in enumerate(METHODS.items()):
            ran = [h for h in hs if method in summary[work.name][h]]
            if not ran:
                continue
            ax.plot(ran, [summary[work.name][h][method][key] for h in ran], marker="o",
                    color="black" if method == "ddp" else f"C{k}",
                    linestyle="--" if method == "ddp" else "-", label=label)
        ax.set_xscale("log")
        ax.set_xticks(hs, [str(h) for h in hs])
        ax.minorticks_off()
        ax.set_xlabel("H, local steps between syncs")
        ax.set_ylabel("held-out accuracy %, mean node" if work.classifier
                      else "held-out loss (nats), mean node")
        ax.set_title(work.label, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"N = {N}, the same samples for every method at each H")
    save_figure(fig, name)

    columns = sorted({h for w in workloads for h in summary[w.name]})
    fig, axes = plt.subplots(len(workloads), len(columns), squeeze=False,
                             figsize=(4.2 * len(columns), 3.6 * len(workloads)),
                             constrained_layout=True)
    for row, work in zip(axes, workloads):
        key = "accuracy" if work.classifier else "loss"
        for ax, h in zip(row, columns):
            if h not in summary[work.name]:
                ax.set_visible(False)
                continue
            for k, (method, label) in enumerate(METHODS.items()):
                runs = per_seed[work.name][method].get(run_key(work, method, h, least))
                if not runs:
                    continue
                seconds = wall_clock(method, runs, h, least)
                values = [mean([at_step(r["curve"], s)[key] for r in runs])
                          for s, _ in runs[0]["curve"][:len(seconds)]]
                ax.plot([t / 60 for t in seconds], values, marker=".",
                        color="black" if method == "ddp" else f"C{k}",
                        linestyle="--" if method == "ddp" else "-", label=label)
            ax.set_xscale("log")
            ax.set_title(f"{work.name}, H = {h} (the link that gives it)", fontsize=9)
            ax.set_xlabel(f"virtual minutes ({STEP_TIME * 1000:g} ms a step)")
            ax.set_ylabel("accuracy %, mean node" if work.classifier else "loss, mean node")
            ax.grid(alpha=0.3)
    labelled: dict[str, Any] = {}  # one legend of every method drawn in any panel
    for ax in (ax for row in axes for ax in row if ax.get_visible()):
        for line in ax.lines:
            labelled.setdefault(str(line.get_label()), line)
    if labelled:
        fig.legend(list(labelled.values()), list(labelled), loc="outside lower center",
                   ncols=len(labelled), fontsize=8)
    fig.suptitle("Time to loss: held-out figure against time on the link where every = "
                 "\"auto\" picks H\n(all-reduces block; exchanges overlap training)")
    save_figure(fig, f"{name}_curves")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true",
                      help="1 seed, the LM at H = 100 only, without plain gossip (about 21 "
                      "minutes on 2 cores)")
    mode.add_argument("--gpu", action="store_true",
                      help="the IID LM at 25M parameters, H = 100 and 500, on one GPU")
    parser.add_argument("--seeds", type=int, help="seeds per run (default 2, --quick and "
                        "--gpu 1)")
    parser.add_argument("--least", type=int, default=LEAST,
                        help=f"steps per node at the smallest budget (default {LEAST}; "
                        "each H gets at least 20 syncs)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="runs at once, one process each (default: one per core; "
                        "--gpu: 1)")
    parser.add_argument("--device", default="cuda", help="--gpu's device (default cuda)")
    parser.add_argument("--hs", help="the H values to run, comma-separated (default 1,50,100,"
                        "500; --quick: the LM at 100 only; --gpu: 100,500)")
    parser.add_argument("--resume", action="store_true",
                        help="take the runs already in bench/results/lowcomm_runs.jsonl (or "
                        "lowcomm_gpu_runs.jsonl) with the same settings instead of running "
                        "them again (every run is appended there as it ends)")
    parser.add_argument("--lm", action="append", default=[], metavar="KEY=VALUE",
                        help="an option of the LM (charlm's, a TOML value: d_model=512, "
                        "layers=8, ...), over the mode's")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an averaging setting for the gossipd rows (AveragingConfig's "
                        "name, a TOML value), to measure another choice than the defaults")
    parser.add_argument("--methods",
                        help=f"the methods to run, comma-separated (default {','.join(METHODS)}"
                        "; --quick: the LM without plain; the gaps need ddp, the ratios "
                        "diloco, here or in the journal with --resume)")
    parser.add_argument("--schedule", choices=SCHEDULES, default="constant",
                        help="the inner learning rate over each run's budget, every method "
                        "alike: the task's throughout (default), or a cosine to 10%% of it")
    parser.add_argument("--tasks", help="the workloads to run, comma-separated (default "
                        "lm_iid,lm_skewed,digits; --gpu: lm_iid)")
    args = parser.parse_args()
    chosen_methods = tuple(m for m in (args.methods or ",".join(METHODS)).split(",") if m)
    if not chosen_methods or any(m not in METHODS for m in chosen_methods):
        parser.error(f"--methods: each of {', '.join(METHODS)}")
    seeds = args.seeds or (1 if args.quick or args.gpu else 2)
    if seeds < 1 or args.jobs < 1 or args.least < 1:
        parser.error("--seeds, --jobs and --least must be at least 1")
    try:
        overrides = parse_overrides(args.set)
        lm_options = parse_lm(args.lm, GPU_LM_OPTIONS if args.gpu else LM_OPTIONS)
        chosen = tuple(int(h) for h in args.hs.split(",")) if args.hs else None
    except ValueError as exc:
        parser.error(str(exc))
    if chosen is not None and (not chosen or min(chosen) < 1):
        parser.error("--hs: positive integers, comma-separated")
    if args.gpu:
        workloads, device, jobs_at_once = lm_workloads(lm_options)[:1], args.device, 1
        hs = {workloads[0].name: chosen or GPU_HS}
        if device.startswith("cuda") and not torch.cuda.is_available():
            parser.error("--gpu: torch sees no CUDA device (--device cpu runs it here)")
    else:
        workloads = [*lm_workloads(lm_options), *(w for w in WORKLOADS if w.classifier)]
        device, jobs_at_once = "cpu", args.jobs
        hs = {w.name: chosen or (QUICK_LM_HS if args.quick and not w.classifier else HS)
              for w in workloads}
    if args.tasks:
        names = [t for t in args.tasks.split(",") if t]
        if not names or any(t not in {w.name for w in workloads} for t in names):
            parser.error(f"--tasks: each of {', '.join(w.name for w in workloads)}")
        workloads = [w for w in workloads if w.name in names]
    workloads = [dataclasses.replace(w, schedule=args.schedule) for w in workloads]
    # --quick leaves plain gossip's LM runs out (a third of its CPU time): a reference, no target.
    methods = {w.name: tuple(m for m in chosen_methods if args.methods or not args.quick
                             or w.classifier or m != "plain") for w in workloads}
    started = time.perf_counter()
    name = "lowcomm_gpu" if args.gpu else "lowcomm"
    per_seed = run_all(workloads, hs, seeds, args.least, jobs_at_once, device, overrides,
                       started, results_path(f"{name}_runs.jsonl"), args.resume, methods)
    summary: Summary = {w.name: {h: summarize(w, per_seed[w.name], h, args.least)
                                 for h in hs[w.name]} for w in workloads}
    plot(workloads, per_seed, summary, args.least, name)
    elapsed = time.perf_counter() - started

    lm = next((w for w in workloads if not w.classifier), None)
    params = next((r[0]["params"] for w in workloads if not w.classifier
                   for by_h in per_seed[w.name].values() for r in by_h.values()), None)
    used = gossip_config("gossipd", 1, overrides).averaging
    wide = plan(used, max(TARGET_H))  # what gossipd's rounds do at the targets' spacings
    print(f"\nN = {N} nodes, {seeds} seed{'s' * (seeds > 1)}, max({args.least:,}, 20 H) steps "
          f"per node at each H, the same samples for every method; "
          f"{f'LM {params:,} parameters {dict(lm.options)}; ' if lm and params else ''}"
          f"inner lr {'cosine to 10% at the budget' if args.schedule == 'cosine' else 'constant'}"
          "; "
          f"DiLoCo outer SGD lr {DILOCO_LR}, Nesterov momentum "
          f"{DILOCO_MOMENTUM}; gossipd: the defaults{f' with {overrides}' if overrides else ''}"
          f" (outer {used.outer}, lr {used.outer_lr}; from H = {LARGE_SPACING}: {wide.peers} "
          f"exchanges a round, outer momentum {wide.momentum} "
          f"{'once a round' if wide.by_round else 'at each exchange'}, codec "
          f"{wide.codec or used.codec}, drift correction {used.correction and wide.correct}); "
          f"links: an fp32 model's time = H/2 "
          f"steps of {STEP_TIME * 1000:g} ms, {LATENCY * 1000:g} ms one way")
    for work in workloads:
        print(report(work, summary[work.name], args.least))
    met = verdicts(summary)
    print("\nheld-out figures at each budget, every node evaluated, mean over seeds. gap to DDP:"
          " (L - L_ddp) / L_ddp of the mean node loss; pts below DDP: its accuracy minus the "
          "mean node's.\nmean model: the nodes' parameters averaged (no node holds it). syncs:"
          " DiLoCo's all-reduces; a swarm's committed exchanges per node (started or "
          "answered). spread: mean ||x_i - mean|| / ||mean|| at the end. MB sent per node: the"
          " swarms measured, DDP and DiLoCo their ring all-reduces.")
    print("targets (gossipd): " + "; ".join(
        f"{k} {'not run' if v is None else 'met' if v else 'MISSED'}" for k, v in met.items()))
    cpu = sum(r["cpu_s"] for by_m in per_seed.values() for by_h in by_m.values()
              for runs in by_h.values() for r in runs)
    print(f"wall time {elapsed:.0f} s, {jobs_at_once} jobs; the runs' CPU time {cpu:.0f} s")

    out = {**headline(summary, params, "gpu_" if args.gpu else ""),
           # None where no target could be judged (a subset of the runs).
           "targets_met": (all(v for v in met.values() if v is not None)
                           if any(v is not None for v in met.values()) else None),
           "overrides": overrides, "schedule": args.schedule,
           "quick": args.quick, "seconds": round(elapsed, 1)}
    save_json(name, {
        **out, "nodes": N, "hs": hs, "least": args.least, "seeds": seeds, "device": device,
        "step_time": STEP_TIME, "latency": LATENCY, "lm_options": dict(lm.options) if lm else None,
        "jobs": jobs_at_once, "cpu_s": round(cpu), "overrides": overrides,
        "diloco": {"lr": DILOCO_LR, "momentum": DILOCO_MOMENTUM},
        "gossip_averaging": {k: v for k, v in dataclasses.asdict(used).items()
                             if k in ("outer", "outer_lr", "outer_momentum", "correction",
                                      "weight", "codec")},
        "wide_plan": dataclasses.asdict(wide), "verdicts": met,
        "summary": {w: {str(h): s for h, s in by_h.items()} for w, by_h in summary.items()},
        "per_seed": {w: {m: {str(h): r for h, r in by_h.items()} for m, by_h in by_m.items()}
                     for w, by_m in per_seed.items()}})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
