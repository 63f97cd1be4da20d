"""Statistical efficiency on non-IID shards: test accuracy vs total samples trained, for
swarms of N = 4 and 8 nodes, each node on a label-sorted shard, against synchronous
all-reduce training on the same shards and one node on all the data.

Targets (the project's issue on learning quality): at the baseline's budget, the swarm's mean
node accuracy is within 2 points of the all-reduce reference at N = 4 and N = 8 and its worst
node within 4; the same within 3 points with 2 of the 8 nodes crashing and rejoining during
training; at 8x the budget within 0.5 point; the IID control no worse than before the drift
correction (96.0% at the budget, 2.1 points below the baseline).

Method
------
Task: ``daemon.tasks.digits`` with its defaults (MLP 64 -> 64 -> 10, SGD lr 0.05 momentum 0.9,
batch 32), built once per node by the task's own factory, so every N trains the same model
from the same initial weights with the same optimizer and hyperparameters; nothing is tuned
per N. Node i of N trains on ``Shard(i, N)``: the training split sorted by label and cut in N
blocks, so at N = 8 a node sees one or two classes. N = 1 is the baseline: one node on all
the data. Optimizer state (momentum) stays on its node.

Swarms: :func:`gossip.testing.open_sim_swarm`, real protocol nodes (membership, encrypted
channels, push-pull averaging with weight 1/2, clipping, standing) on a simulated network with
1 ms links, under trio's ``MockClock``, with the library's default averaging settings: a round
every ``every`` local steps (the default, 1) and the drift correction on, each node handing
its optimizer to the swarm as the daemon does. A training step is a real SGD step that takes
``STEP_TIME`` = 0.05 virtual seconds. Rows beside the headline change one thing: the drift
correction off (the averaging of weights alone, at the same period), the period (2 and 10
steps), or the swarm (IID shards; two nodes that crash and rejoin).

Churn: in the "crash and rejoin" row, node 1 crashes at 20% of the budget and node 5 at 50%,
each for 15% of the budget (24 of its 160 steps at N = 8); each comes back from what a
checkpoint written at the crash holds (model, counters, drift correction; the deltas not yet
applied are lost) and rejoins through the running nodes. Meanwhile the others train on, so
the swarm trains fewer samples of those two shards than the reference does. The dip is
:mod:`daemon.churn`'s, as ``gossipd demo`` reports it: a crash is a departure and a restart a
join, each between two evaluations; for each of them and each other node running across it,
how far the node's accuracy fell, at its lowest mean of ``LEVEL_EVALS`` evaluations in a row
after the event (up to the budget, or its own crash), below its level before it (the mean of
its last ``LEVEL_EVALS`` evaluations since it last came up). A crashed node's model, which the
bench still holds, is not counted while it is down. The churn row runs at least
``CHURN_SEEDS`` seeds (``--quick`` too): its figure is ``worst_dip_points_by_seed``, the
largest dip over events and nodes of each seed, and ``worst_dip_points`` the largest of those
(target ``TARGET_DIP`` in every seed: ``dip_target_met``, apart from ``targets_met``, the
accuracy targets). Beside it, ``dip_without_churn_by_seed``: the same measure at the same
evaluations, with the same events, of the N = 8 run at the defaults where nothing crashed
(the headline run's seeds, and runs to the budget for the others), which is how far nodes
fall at those moments anyway, one evaluation swinging from the next as a node's own steps on
its one or two classes move it between exchanges (0 to 2.5 points in ten seeds; 0.8 to 10.3
when the low was a single evaluation, :mod:`daemon.churn` says why).

Reference: synchronous all-reduce ("DDP-equivalent") at N = 4 and 8 on the same label-sorted
shards, with no swarm: one model and one SGD optimizer built by the task (the same initial
weights, lr and momentum); each step draws the next batch of 32 from each of the N shards, in
the order that shard's node draws them, and steps on the mean of the N batches' losses, as
DDP's gradient averaging does at the same lr: N x 32 samples a step, evaluated at the same
total-sample points. Every gap is measured against the reference of the same N.

Control: N = 8 on IID data (every node on the whole training split, each in its own batch
order, from the same initial weights), at the default settings.

Codecs: every run uses the library's default wire codec (``fp32``) unless ``--codecs`` names
others (``--codecs bf16,int8``): then the headline rows, N = 4 and 8 at the defaults, are run
again in each of them, with the same seeds (so the same initial weights and batch orders),
and printed beside the default ones, with a table of each seed's final accuracy per codec:
the gap to the first codec named, seed by seed, against the spread between seeds. The simulated
links have no bandwidth limit, so a codec changes only what arrives, not when.

Measure: every ``BUDGET / POINTS`` total samples (summed over nodes) every node's model is
evaluated on the fixed test split (359 images), from inside the training step that reaches
the point, so a node is caught wherever it is between exchanges; the curve of a run is the mean
over nodes (and, apart, the worst node at each evaluation), then the mean over seeds. The mean
model (the average of the nodes' parameters, which no node holds) is evaluated too: it tells
drift between nodes apart from what the swarm as a whole learned. A test accuracy moves by 0.3
points per image, so every figure is a mean over the last ``WINDOW`` evaluations: "final
accuracy" is that mean at the budget. The baseline's budget, ``BUDGET`` = 40,960 samples
(1,280 steps, 28 epochs of 1,438 images), is where its accuracy has levelled off; everything
runs on to ``--horizon`` x the budget, where the 8x figures are read.

Usage: python bench/efficiency.py [--quick] [--seeds 5] [--horizon 8] [--codecs bf16,int8]
(``--quick``: 2 seeds, the churn row 5, horizon 4x: about 5 minutes on one core)
Table on stdout, progress on stderr; the last line printed is one JSON object with the
headline figures (with ``--codecs``, also ``"codecs"``: the headline figures per codec).
Writes bench/results/efficiency.json and efficiency.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any

import torch
import trio
import trio.testing

from common import progress, pyplot, save_figure, save_json, table
from daemon.churn import LEVEL_EVALS, ChurnEvent, dips, worst_dip_points
from daemon.task import Context, Shard
from daemon.tasks import digits
from gossip import AveragingConfig, NodeConfig
from gossip.tensors import CODECS
from gossip.testing import SimNode, SimSwarm, open_sim_swarm

STEP_TIME = 0.05  # virtual s per training step
BATCH = digits.DEFAULTS["batch_size"]  # samples per step
BUDGET = 40_960  # total samples of the baseline: 1,280 steps, ~28 epochs of 1,438 images
POINTS = 20  # evaluations per budget: every 2,048 samples (8 steps per node at N = 8)
WINDOW = 3  # evaluations averaged into one figure: the last 10% of the budget
TARGET_GAP = 2.0  # points of mean node accuracy below all-reduce, at the budget
TARGET_WORST = 4.0  # points of the worst node below all-reduce, at the budget
TARGET_CHURN = 3.0  # points below all-reduce with two nodes crashing and rejoining
TARGET_HORIZON = 0.5  # points below all-reduce at 8x the budget
TARGET_DIP = 2.0  # points a running node falls below its own level after a crash or restart
EVERY = AveragingConfig().every  # the library's default period, in local steps
CODEC = AveragingConfig().codec  # the library's default wire codec
CHURN = [(1, 0.20, 0.35), (5, 0.50, 0.65)]  # node, crash and restart, in budget fractions
CHURN_SEEDS = 5  # the churn row's seeds at least, whatever --seeds says
CURVES = ("mean", "worst", "mean_model")  # what run_swarm and run_allreduce both return
CPU = torch.device("cpu")


@dataclass(frozen=True)
class Setting:
    """One curve: N nodes averaging every ``every`` local steps, or (``allreduce``) the
    synchronous reference on the same N shards, which needs no swarm."""

    n: int
    every: int | None = EVERY
    correction: bool = True
    iid: bool = False  # the control: every node on all the data, each in its own order
    churn: bool = False  # two nodes crash and rejoin (CHURN)
    allreduce: bool = False  # the reference: see run_allreduce
    codec: str = CODEC  # the wire codec of the swarm's exchanges

    @property
    def label(self) -> str:
        if self.n == 1:
            return "N=1 (baseline)"
        if self.allreduce:
            return f"N={self.n} all-reduce (reference)"
        label = f"N={self.n}"
        if self.iid:
            label += " IID (control)"
        if self.every != EVERY:
            label += f", every {self.every} steps"
        if not self.correction:
            label += ", no drift correction"
        if self.churn:
            label += ", 2 crash and rejoin"
        if self.codec != CODEC:
            label += f", {self.codec}"
        return label if label != f"N={self.n}" else f"N={self.n} (defaults)"

    @property
    def headline(self) -> bool:
        return (self.n > 1 and not self.allreduce and not self.iid and not self.churn
                and self.correction and self.every == EVERY)


BASELINE = Setting(1)
CONTROL = Setting(8, iid=True)
CHURNED = Setting(8, churn=True)
SETTINGS = [BASELINE, Setting(4), Setting(4, allreduce=True), Setting(8),
            Setting(8, allreduce=True), CHURNED, CONTROL, Setting(8, correction=False),
            Setting(8, every=2), Setting(8, every=10)]


def with_codecs(codecs: list[str]) -> list[Setting]:
    """:data:`SETTINGS`, each headline row followed by the same row in each of ``codecs``
    (other than the default, which the headline row already is)."""
    out = []
    for setting in SETTINGS:
        out.append(setting)
        if setting.headline:
            out += [Setting(setting.n, codec=c) for c in codecs if c != CODEC]
    return out


def run_swarm(setting: Setting, seed: int, points: int) -> dict[str, Any]:
    """Train one swarm until ``points`` evaluations are taken; returns the curves ``mean``,
    ``worst`` (over nodes) and ``mean_model``, in percent, one value per evaluation, and for
    :func:`worst_dip`: ``nodes``, per node its accuracy at each evaluation (None while it is
    down), and ``events``, an ``(evaluations taken, node, "crash" or "restart")`` triple per
    crash and restart."""
    n = setting.n
    if setting.iid:
        # A task's seed picks its batch order, so one seed per node; then node 0's initial
        # weights everywhere, as in every other run.
        tasks = [digits.task(Context(seed * 1000 + i, CPU)) for i in range(n + 1)]
        for t in tasks[1:]:
            t.model.load_state_dict(tasks[0].model.state_dict())
        batches = [t.batches(Shard(0, 1)) for t in tasks[:n]]
    else:
        tasks = [digits.task(Context(seed, CPU)) for _ in range(n + 1)]  # the last: mean model
        batches = [t.batches(Shard(i, n)) for i, t in enumerate(tasks[:n])]
    curves: dict[str, list[float]] = {"mean": [], "worst": [], "mean_model": []}
    per_node: list[list[float | None]] = [[] for _ in range(n)]
    events: list[tuple[int, int, str]] = []
    down: set[int] = set()  # crashed, by index: their models are still evaluated, not kept
    total = 0

    def evaluate() -> None:
        accuracy = [100 * t.evaluate()["accuracy"] for t in tasks[:n]]
        for i, value in enumerate(accuracy):
            per_node[i].append(None if i in down else value)
        with torch.no_grad():
            nodes = (t.model.parameters() for t in tasks[:n])
            for mean, *ps in zip(tasks[n].model.parameters(), *nodes):
                mean.copy_(torch.stack(ps).mean(0))
        curves["mean"].append(sum(accuracy) / n)
        curves["worst"].append(min(accuracy))
        curves["mean_model"].append(100 * tasks[n].evaluate()["accuracy"])

    def train(node: SimNode) -> float:
        nonlocal total
        loss = tasks[node.index].step(next(batches[node.index]))
        total += BATCH
        if total % (BUDGET // POINTS) == 0 and len(curves["mean"]) < points:
            evaluate()
        return float(loss)

    async def churn(sim: SimSwarm) -> None:
        schedule = sorted([(crash, "crash", i) for i, crash, _ in CHURN]
                          + [(back, "restart", i) for i, _, back in CHURN])
        for fraction, what, i in schedule:
            await sim.wait_until(lambda: total >= fraction * BUDGET)
            events.append((len(curves["mean"]), i, what))
            if what == "crash":
                sim.crash(i)
                down.add(i)
            else:
                down.discard(i)  # from here its model is the checkpoint's, then its own
                await sim.restart(i)

    async def main() -> None:
        config = dataclasses.replace(NodeConfig.local(), averaging=AveragingConfig(
            every=setting.every, interval=None, start="own", correction=setting.correction,
            codec=setting.codec))
        async with open_sim_swarm(n, seed=seed, model=lambda i: tasks[i].model,
                                  optimizer=lambda i: tasks[i].optimizer, train=train,
                                  step_time=STEP_TIME, config=config) as sim:
            async with trio.open_nursery() as nursery:
                if setting.churn:
                    nursery.start_soon(churn, sim)
                await sim.wait_until(lambda: len(curves["mean"]) >= points)
                nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return {**curves, "nodes": per_node, "events": events}


def run_allreduce(setting: Setting, seed: int, points: int) -> dict[str, list[float]]:
    """What synchronous data parallelism (DDP) does with the swarm's data and hyperparameters:
    one model and one optimizer, built by the task as every swarm node's are (same initial
    weights, lr, momentum); each step takes the next batch of each of the N shards, in the
    order that shard's node draws them, and steps on the mean of the N batches' losses, so
    on the mean of their gradients at the same lr, as DDP's gradient averaging does.
    Evaluated every ``BUDGET / POINTS`` total samples (N x ``BATCH`` per step) until
    ``points`` evaluations are taken; returns the curves as :func:`run_swarm` does, all three
    the one model's (every DDP replica holds it)."""
    n = setting.n
    per_step = n * BATCH
    assert (BUDGET // POINTS) % per_step == 0, "evaluations fall between steps"
    task = digits.task(Context(seed, CPU))
    shards = [task.batches(Shard(i, n)) for i in range(n)]
    accuracy: list[float] = []
    while len(accuracy) < points:
        for _ in range(BUDGET // POINTS // per_step):
            xs, ys = zip(*(next(shard) for shard in shards))
            # The batches are all BATCH samples, so cross-entropy's mean over them concatenated
            # is the mean of their n means: one call of the task's own step.
            task.step((torch.cat(xs), torch.cat(ys)))
        accuracy.append(100 * task.evaluate()["accuracy"])
    return {"mean": accuracy, "worst": accuracy, "mean_model": accuracy}


def smooth(curve: list[float]) -> list[float]:
    """The trailing mean over ``WINDOW`` evaluations (fewer at the start)."""
    return [sum(curve[max(0, k - WINDOW + 1):k + 1]) / len(curve[max(0, k - WINDOW + 1):k + 1])
            for k in range(len(curve))]


def samples_to_reach(curve: list[float], accuracy: float) -> int | None:
    """Total samples at the first evaluation where the smoothed curve reaches ``accuracy``."""
    for k, value in enumerate(smooth(curve)):
        if value >= accuracy - 1e-9:
            return (k + 1) * BUDGET // POINTS
    return None


def churn_events(schedule: list[tuple[int, int, str]]) -> list[ChurnEvent]:
    """:mod:`daemon.churn`'s events of a run's crashes (departures) and restarts (joins):
    ``(k, node, what)``, between evaluations ``k - 1`` and ``k``, is at time ``k - 1/2`` of
    a clock on which evaluation ``k`` is at ``k``."""
    return [ChurnEvent("departure" if what == "crash" else "join", f"n{i}", k - 0.5)
            for k, i, what in schedule]


def worst_dip(per_node: list[list[float | None]],
               schedule: list[tuple[int, int, str]]) -> float:
    """The worst dip of one run, in points, by :mod:`daemon.churn`'s definition.

    Args:
        per_node: per node, its accuracy in percent at each evaluation, None while it is down.
        schedule: ``(k, node, "crash" or "restart")`` per event after evaluation ``k - 1``
            and before evaluation ``k`` (:func:`churn_events`).
    Returns:
        :func:`daemon.churn.worst_dip_points` of those evaluations and events.
    """
    series = {f"n{i}": [(k, v / 100) for k, v in enumerate(values) if v is not None]
              for i, values in enumerate(per_node)}
    return worst_dip_points(dips(series, churn_events(schedule)))


def without_churn(calm: list[dict[str, Any]], churned: list[dict[str, Any]],
                  started: float) -> list[float]:
    """:func:`worst_dip` of the N = 8 run at the defaults, where nothing crashed, at the
    evaluations and with the events of the churn run of the same seed: the runs ``calm`` holds
    (its first seeds), and for the churn row's other seeds runs to the budget made here."""
    dips = []
    for seed, run in enumerate(churned, start=1):
        if seed <= len(calm):
            nodes = calm[seed - 1]["nodes"]
        else:
            nodes = run_swarm(Setting(8), seed, POINTS)["nodes"]
            progress(f"[{time.perf_counter() - started:6.1f}s] {Setting(8).label} seed {seed}, "
                     f"to the budget: the churn row's evaluations without churn")
        dips.append(worst_dip([s[:POINTS] for s in nodes], run["events"]))
    return dips


def seed_mean(runs: list[dict[str, list[float]]], key: str) -> list[float]:
    return [sum(values) / len(values) for values in zip(*(r[key] for r in runs))]


def reference(setting: Setting) -> Setting:
    """The all-reduce run a setting is measured against (itself for the baseline)."""
    return setting if setting.n == 1 else Setting(setting.n, allreduce=True)


def summarize(curves: dict[Setting, dict[str, list[float]]],
              horizon: int) -> dict[Setting, dict[str, Any]]:
    """Per setting: accuracies at the budget and at the horizon, gaps to its all-reduce
    reference, samples to reach the baseline's final accuracy, and the verdicts."""
    at = {s: {key: smooth(c[key]) for key in c} for s, c in curves.items()}
    end = horizon * POINTS - 1
    base = at[BASELINE]["mean"][POINTS - 1]
    out = {}
    for setting in curves:
        mine, ref = at[setting], at[reference(setting)]["mean"]
        gap, worst = ref[POINTS - 1] - mine["mean"][POINTS - 1], ref[POINTS - 1] - mine["worst"][POINTS - 1]
        late = ref[end] - mine["mean"][end]
        samples = samples_to_reach(curves[setting]["mean"], base)
        verdicts = {}
        if setting.headline:
            verdicts = {"gap": gap <= TARGET_GAP, "worst": worst <= TARGET_WORST,
                        "horizon": late <= TARGET_HORIZON if horizon >= 8 else None}
        elif setting.churn:
            verdicts = {"gap": gap <= TARGET_CHURN}
        out[setting] = {
            "final_accuracy": mine["mean"][POINTS - 1], "final_worst": mine["worst"][POINTS - 1],
            "final_mean_model": mine["mean_model"][POINTS - 1],
            "horizon_accuracy": mine["mean"][end], "horizon_worst": mine["worst"][end],
            "gap_to_allreduce": gap, "worst_gap_to_allreduce": worst,
            "horizon_gap_to_allreduce": late, "gap_to_baseline": base - mine["mean"][POINTS - 1],
            "samples_to_reach_baseline": samples, "verdicts": verdicts,
        }
    return out


def plot(curves: dict[Setting, dict[str, list[float]]], base: float) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 6), sharey=True)
    left = [s for s in curves if s.n == 1 or s.headline or s.allreduce]
    right = [BASELINE, Setting(8, allreduce=True)] + [
        s for s in SETTINGS if s.n == 8 and not s.allreduce and not s.headline] + [Setting(8)]
    for ax, settings, title in [(axes[0], left, "N = 1, 4, 8 at the defaults"),
                                (axes[1], right, "N = 8: what each part contributes")]:
        for k, setting in enumerate(settings):
            c = curves[setting]
            x = [(j + 1) * BUDGET / POINTS for j in range(len(c["mean"]))]
            color = "black" if setting.allreduce else f"C{k}"
            ax.plot(x, c["mean"], color=color, linestyle="--" if setting.allreduce else "-",
                    label=setting.label)
            if setting.n > 1 and not setting.allreduce:
                ax.plot(x, c["worst"], color=color, linestyle=":", linewidth=1)
        ax.axhline(base, color="grey", linestyle="-.", linewidth=1,
                   label=f"baseline final accuracy {base:.1f}%")
        ax.axvline(BUDGET, color="grey", linewidth=0.5)
        ax.set_xscale("log")
        ax.set_xlabel("total samples trained (summed over nodes)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    axes[0].set_ylabel("test accuracy, %: mean over nodes (solid), worst node (dotted)")
    axes[0].set_ylim(0, 100)
    fig.suptitle(f"digits MLP on label-sorted shards, mean over seeds; "
                 f"{STEP_TIME * 1000:g} ms per step (virtual)")
    save_figure(fig, "efficiency")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"2 seeds ({CHURN_SEEDS} for the churn row), horizon 4x the "
                             f"budget (a few minutes)")
    parser.add_argument("--seeds", type=int, help=f"seeds per setting (default 5, --quick 2; "
                                                  f"the churn row at least {CHURN_SEEDS})")
    parser.add_argument("--horizon", type=int,
                        help="runs go on to this x the baseline's budget (default 8, --quick 4)")
    parser.add_argument("--codecs", type=codec_list, default=[],
                        help=f"comma-separated wire codecs ({', '.join(CODECS)}) to run the "
                             f"headline rows in too, beside the default {CODEC}")
    args = parser.parse_args()
    seeds = args.seeds or (2 if args.quick else 5)
    horizon = args.horizon or (4 if args.quick else 8)
    settings = with_codecs(args.codecs)
    torch.set_num_threads(1)  # a tiny model: more threads only add overhead
    started = time.perf_counter()

    curves = {}
    per_seed = {}
    for setting in settings:
        runs = []
        for seed in range(1, (max(seeds, CHURN_SEEDS) if setting.churn else seeds) + 1):
            run = run_allreduce if setting.allreduce else run_swarm
            runs.append(run(setting, seed, horizon * POINTS))
            progress(f"[{time.perf_counter() - started:6.1f}s] {setting.label} seed {seed}: "
                     f"accuracy at the budget {smooth(runs[-1]['mean'])[POINTS - 1]:.1f}%")
        curves[setting] = {key: seed_mean(runs, key) for key in CURVES}
        per_seed[setting] = runs
    summary = summarize(curves, horizon)
    base = summary[BASELINE]["final_accuracy"]
    # Up to the budget, as the churn schedule is; per seed, and the largest over seeds.
    dips_by_seed = [worst_dip([s[:POINTS] for s in run["nodes"]], run["events"])
                    for run in per_seed[CHURNED]]
    dip = max(dips_by_seed)
    calm = without_churn(per_seed[Setting(8)], per_seed[CHURNED], started)
    plot(curves, base)
    elapsed = time.perf_counter() - started

    def verdict(s: dict[str, Any], key: str) -> str:
        value = s["verdicts"].get(key)
        return "-" if value is None else "met" if value else "MISSED"

    rows = []
    for setting in settings:
        s = summary[setting]
        reach = s["samples_to_reach_baseline"]
        rows.append([setting.label, f"{s['final_accuracy']:.1f}", f"{s['final_worst']:.1f}",
                     f"{s['final_mean_model']:.1f}", f"{s['gap_to_allreduce']:.1f}",
                     f"{s['worst_gap_to_allreduce']:.1f}",
                     f"{s['horizon_accuracy']:.1f}", f"{s['horizon_gap_to_allreduce']:.1f}",
                     f"{reach:,}" if reach else f"> {horizon * BUDGET:,}",
                     verdict(s, "gap"), verdict(s, "worst"), verdict(s, "horizon")])
    print(f"\ndigits MLP (lr 0.05, momentum 0.9, batch {BATCH}) on label-sorted shards, "
          f"{seeds} seeds (the churn row {len(dips_by_seed)}); {STEP_TIME * 1000:g} ms per step "
          f"(virtual); defaults: a round every "
          f"{EVERY} local steps, drift correction on; budget {BUDGET:,} samples, horizon "
          f"{horizon}x")
    print(table(["setting", "final %", "worst %", "mean model %", "gap pts", "worst gap",
                 f"{horizon}x %", f"{horizon}x gap", "samples to baseline's",
                 f"gap<={TARGET_GAP:g}", f"worst<={TARGET_WORST:g}",
                 f"{horizon}x<={TARGET_HORIZON:g}"], rows))
    print(f"final: mean of the last {WINDOW} evaluations up to {BUDGET:,} total samples, mean "
          f"over nodes (worst: the worst node; mean model: the nodes' parameters averaged), "
          f"mean over seeds.\ngap: the all-reduce reference of the same N minus this "
          f"(worst gap: minus the worst node); the churn row's target is "
          f"{TARGET_CHURN:g} points. samples to baseline's: to reach the baseline's final "
          f"accuracy ({base:.1f}%).")
    print(f"all-reduce (reference): no swarm; one model and one SGD optimizer from the same "
          f"initial weights, lr and momentum, each step on the mean loss of one batch of "
          f"{BATCH} from each\nof the N shards, as DDP averages gradients: {BATCH}N samples "
          f"per step. One model, so worst and mean model are its accuracy.")
    print(f"churn: largest fall of a node below its own level before a crash or restart, per "
          f"seed: {' '.join(f'{d:.1f}' for d in dips_by_seed)} points (target {TARGET_DIP:g} in "
          f"every seed: {'met' if dip <= TARGET_DIP else 'MISSED'}); at the same evaluations "
          f"of the N=8 run\nwhere nothing crashed: {' '.join(f'{d:.1f}' for d in calm)} points "
          f"(how far a node falls there anyway)")
    # The first codec named is the one the others are compared with; the default's rows last.
    codecs = args.codecs + [CODEC] * (CODEC not in args.codecs) if args.codecs else []
    if codecs:
        print(compare_codecs(codecs, per_seed, horizon))
    print(f"wall time {elapsed:.1f} s")

    n8, n4 = summary[Setting(8)], summary[Setting(4)]
    out = {"gap_to_allreduce_n8": round(n8["gap_to_allreduce"], 2),
           "worst_gap_n8": round(n8["worst_gap_to_allreduce"], 2),
           "gap_to_allreduce_n4": round(n4["gap_to_allreduce"], 2),
           "worst_gap_n4": round(n4["worst_gap_to_allreduce"], 2),
           "churn_gap_n8": round(summary[CHURNED]["gap_to_allreduce"], 2),
           "worst_dip_points": round(dip, 1),
           "worst_dip_points_by_seed": [round(d, 1) for d in dips_by_seed],
           "dip_without_churn_by_seed": [round(d, 1) for d in calm],
           "dip_target_met": dip <= TARGET_DIP,
           f"gap_{horizon}x_n8": round(n8["horizon_gap_to_allreduce"], 2),
           f"gap_{horizon}x_n4": round(n4["horizon_gap_to_allreduce"], 2),
           "iid_control_n8": round(summary[CONTROL]["final_accuracy"], 2),
           "no_correction_gap_n8": round(
               summary[Setting(8, correction=False)]["gap_to_allreduce"], 2),
           "baseline_accuracy": round(base, 2), "every": EVERY, "seeds": seeds,
           "churn_seeds": len(dips_by_seed),
           "horizon": horizon,
           "targets_met": all(v for s in SETTINGS for v in summary[s]["verdicts"].values()
                              if v is not None)}
    if codecs:
        out["codecs"] = {c: codec_figures(c, summary, per_seed, horizon) for c in codecs}
    save_json("efficiency", {
        **out, "budget_samples": BUDGET, "points": POINTS, "window": WINDOW,
        "step_time": STEP_TIME, "batch_size": BATCH, "task_options": digits.DEFAULTS,
        "targets": {"gap": TARGET_GAP, "worst": TARGET_WORST, "churn": TARGET_CHURN,
                    "horizon": TARGET_HORIZON, "dip": TARGET_DIP},
        "wall_s": round(elapsed, 1),
        "settings": [{"label": s.label, "n": s.n, "every": s.every, "correction": s.correction,
                      "iid": s.iid, "churn": s.churn, "allreduce": s.allreduce,
                      "codec": s.codec, **summary[s],
                      "samples": [(k + 1) * BUDGET // POINTS for k in range(horizon * POINTS)],
                      "curves": curves[s], "per_seed": per_seed[s]} for s in settings]})
    print(json.dumps(out))


def codec_list(text: str) -> list[str]:
    """``--codecs``: comma-separated names from :data:`gossip.tensors.CODECS`."""
    codecs = [c.strip() for c in text.split(",") if c.strip()]
    unknown = [c for c in codecs if c not in CODECS]
    if unknown or not codecs:
        raise argparse.ArgumentTypeError(f"expected codecs from {', '.join(CODECS)}, "
                                         f"not {text!r}")
    return list(dict.fromkeys(codecs))


def final(run: dict[str, list[float]], at: int) -> float:
    """One run's smoothed mean node accuracy at evaluation ``at``."""
    return smooth(run["mean"])[at]


def compare_codecs(codecs: list[str], per_seed: dict[Setting, list[dict[str, list[float]]]],
                   horizon: int) -> str:
    """The codec table: per headline N and codec, each seed's final accuracy (at the budget
    and at the horizon), their spread, and the gap to the first codec seed by seed."""
    rows = []
    for n in sorted({s.n for s in per_seed if s.headline}):
        first = per_seed[Setting(n, codec=codecs[0])]
        for codec in codecs:
            runs = per_seed[Setting(n, codec=codec)]
            for at, when in ((POINTS - 1, "budget"), (horizon * POINTS - 1, f"{horizon}x")):
                mine = [final(r, at) for r in runs]
                worst = [smooth(r["worst"])[at] for r in runs]
                gaps = [final(r0, at) - final(r, at) for r0, r in zip(first, runs)]
                rows.append([f"N={n} {codec}", when, " ".join(f"{v:.1f}" for v in mine),
                             f"{sum(mine) / len(mine):.2f}", f"{max(mine) - min(mine):.2f}",
                             "-" if codec == codecs[0] else " ".join(f"{g:+.1f}" for g in gaps),
                             "-" if codec == codecs[0] else f"{sum(gaps) / len(gaps):+.2f}",
                             f"{sum(worst) / len(worst):.1f}"])
    return ("\ncodecs, seed by seed (mean node accuracy, %):\n" + table(
        ["N, codec", "at", "per seed", "mean", "seed spread", f"{codecs[0]} minus this",
         "mean gap", "worst node"], rows)
        + f"\nseed spread: the largest minus the smallest seed's figure; {codecs[0]} minus "
          f"this: per seed (same initial weights and batch order), positive when this codec "
          f"ends lower; worst node: its accuracy, mean over seeds.")


def codec_figures(codec: str, summary: dict[Setting, dict[str, Any]],
                  per_seed: dict[Setting, list[dict[str, list[float]]]],
                  horizon: int) -> dict[str, Any]:
    """The headline figures of one codec, for the JSON line."""
    out: dict[str, Any] = {}
    for n in (4, 8):
        s = summary[Setting(n, codec=codec)]
        runs = per_seed[Setting(n, codec=codec)]
        out[f"gap_to_allreduce_n{n}"] = round(s["gap_to_allreduce"], 2)
        out[f"worst_gap_n{n}"] = round(s["worst_gap_to_allreduce"], 2)
        out[f"gap_{horizon}x_n{n}"] = round(s["horizon_gap_to_allreduce"], 2)
        out[f"final_per_seed_n{n}"] = [round(final(r, POINTS - 1), 2) for r in runs]
    return out


if __name__ == "__main__":
    main()
