"""Statistical efficiency on non-IID shards: test accuracy vs total samples trained, for
swarms of N = 4 and 8 nodes, each node on a label-sorted shard, against one node on all data
and against synchronous all-reduce training on the same shards.

Targets (the project's issue): a swarm reaches the baseline's final accuracy within 1.15x the
samples the baseline needed to reach it, and at the baseline's budget its final accuracy is
within 1 point of the baseline's.

What the all-reduce reference shows (the default run, 5 seeds, horizon 8x, 2026-11-23): at
the budget, synchronous all-reduce on the same shards with the same hyperparameters is 0.8
(N = 4) and 1.3 (N = 8) points below the baseline's 97.8%, the swarms at 20 steps per round
38.6 and 71.1 points below it (the IID control 2.0). To reach 97.8% all-reduce needs 3.70x
and 6.00x the baseline's samples, the swarms more than 8x. So at these hyperparameters the
samples-ratio target is missed by synchronous training too, by close to N x; the final-gap
target is about where synchronous training lands (met at N = 4, missed by 0.3 points at
N = 8), and the swarms end 38 and 70 points below all-reduce on the same data.

Method
------
Task: ``daemon.tasks.digits`` with its defaults (MLP 64 -> 64 -> 10, SGD lr 0.05 momentum 0.9,
batch 32), built once per node by the task's own factory, so every N trains the same model
from the same initial weights with the same optimizer and hyperparameters; nothing is tuned
per N. Node i of N trains on ``Shard(i, N)``: the training split sorted by label and cut in N
blocks, so at N = 8 a node sees one or two classes. N = 1 is the baseline: one node on all
the data. Optimizer state (momentum) stays on its node; averaging moves only the parameters.

Swarms: :func:`gossip.testing.open_sim_swarm`, real protocol nodes (membership, encrypted
channels, push-pull averaging with weight 1/2, clipping on) on a simulated network with 1 ms
links, under trio's ``MockClock``. The baseline runs through the same code as a 1-node swarm
(it finds no peer to average with). A training step is a real SGD step that takes
``STEP_TIME`` = 0.05 virtual seconds, a GPU step's order of magnitude; a node starts an
averaging round every ``interval`` seconds on average (x U(0.75, 1.25)), and is also picked
by its peers about as often. What matters for drift is steps per round, ``interval /
STEP_TIME``: 20 (interval 1 s) for the headline, 5 and 100 in a sweep at N = 8. Mixing is
the default, fixed weight 1/2; push-sum (``mixing = "samples"``) weighs nodes by samples
trained, which here are equal (equal shards, equal step rates), so it would mix the same.

Control: N = 8 on IID data (every node on the whole training split, each in its own batch
order, from the same initial weights), at the headline steps per round. It separates what
non-IID drift costs from what any N-node swarm at the same learning rate costs: averaging N
nodes' steps of B samples is at best one step of N x B samples, so per sample the swarm moves
up to N times less far than the baseline wherever the baseline is limited by steps rather
than by gradient noise. It is not a target; no verdict is printed for it.

Reference: synchronous all-reduce ("DDP-equivalent") at N = 4 and 8 on the same label-sorted
shards, with no swarm: one model and one SGD optimizer built by the task (the same initial
weights, lr and momentum); each step draws the next batch of 32 from each of the N shards, in
the order that shard's node draws them, and steps on the mean of the N batches' losses, as
DDP's gradient averaging does at the same lr: N x 32 samples a step, evaluated at the same
total-sample points. It turns the argument above into a measurement: the baseline
to the reference is what N times fewer steps of N times the samples cost at these
hyperparameters, with no drift (the reference's model sees every shard at every step); the
reference to the swarm is what gossip costs on the same data. Verdicts are printed for it too.

Measure: every ``BUDGET / POINTS`` total samples (summed over nodes) every node's model is
evaluated on the fixed test split (359 images), from inside the training step that reaches
the point; the curve of a run is the mean over nodes (and, apart, the worst node at each
evaluation), then the mean over seeds. The mean model (the average of the nodes' parameters,
which no node holds) is evaluated too: it tells drift between nodes apart from what the swarm
as a whole learned.
A test accuracy moves by 0.3 points per image, so every figure is a mean over the last
``WINDOW`` evaluations: "final accuracy" is that mean at the budget, and a run "reaches" an
accuracy at the first point where that mean does. The baseline's budget, ``BUDGET`` = 40,960
samples (1,280 steps, 28 epochs), is where its accuracy has levelled off; swarms run on to
``--horizon`` x the budget, to measure how many samples they need when it is more than 1.15x
(beyond the horizon a miss is reported as not reached).

Usage: python bench/efficiency.py [--quick] [--seeds 5] [--horizon 8]
Table on stdout, progress on stderr; the last line printed is one JSON object with the
headline figures. Writes bench/results/efficiency.json and efficiency.png.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from typing import Any

import torch
import trio
import trio.testing

from common import progress, pyplot, save_figure, save_json, table
from daemon.task import Context, Shard
from daemon.tasks import digits
from gossip import AveragingConfig
from gossip.testing import SimNode, open_sim_swarm

STEP_TIME = 0.05  # virtual s per training step
BATCH = digits.DEFAULTS["batch_size"]  # samples per step
BUDGET = 40_960  # total samples of the baseline: 1,280 steps, ~28 epochs of 1,438 images
POINTS = 20  # evaluations per budget: every 2,048 samples (8 steps per node at N = 8)
WINDOW = 3  # evaluations averaged into one figure: the last 10% of the budget
TARGET_RATIO = 1.15  # samples to reach the baseline's final accuracy, x the baseline's
TARGET_GAP = 1.0  # points of final accuracy below the baseline's, at the same budget
HEADLINE_STEPS = 20  # steps per round of the N = 4 and 8 headline runs
CPU = torch.device("cpu")


@dataclass(frozen=True)
class Setting:
    """One curve: N nodes averaging every ``steps_per_round`` steps, or (``allreduce``) the
    synchronous reference on the same N shards, which needs no swarm."""

    n: int
    steps_per_round: int  # the all-reduce reference: 1 (its gradients are averaged every step)
    iid: bool = False  # the control: every node on all the data, each in its own order
    allreduce: bool = False  # the reference: see run_allreduce

    @property
    def label(self) -> str:
        if self.n == 1:
            return "N=1 (baseline)"
        if self.allreduce:
            return f"N={self.n} all-reduce (reference)"
        iid = " IID (control)" if self.iid else ""
        return f"N={self.n}{iid}, {self.steps_per_round} steps/round"


BASELINE = Setting(1, HEADLINE_STEPS)
CONTROL = Setting(8, HEADLINE_STEPS, iid=True)
SETTINGS = [BASELINE, Setting(4, HEADLINE_STEPS), Setting(4, 1, allreduce=True),
            Setting(8, HEADLINE_STEPS), Setting(8, 1, allreduce=True), CONTROL,
            Setting(8, 5), Setting(8, 100)]


def run_swarm(setting: Setting, seed: int, points: int) -> dict[str, list[float]]:
    """Train one swarm until ``points`` evaluations are taken; returns the curves ``mean``,
    ``worst`` (over nodes) and ``mean_model``, in percent, one value per evaluation."""
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
    total = 0

    def evaluate() -> None:
        accuracy = [100 * t.evaluate()["accuracy"] for t in tasks[:n]]
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

    async def main() -> None:
        config = AveragingConfig(interval=setting.steps_per_round * STEP_TIME, start="own")
        async with open_sim_swarm(n, seed=seed, model=lambda i: tasks[i].model, train=train,
                                  step_time=STEP_TIME, config=config) as sim:
            await sim.wait_until(lambda: len(curves["mean"]) >= points)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return curves


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


def seed_mean(runs: list[dict[str, list[float]]], key: str) -> list[float]:
    return [sum(values) / len(values) for values in zip(*(r[key] for r in runs))]


def summarize(curves: dict[Setting, dict[str, list[float]]]) -> dict[Setting, dict[str, Any]]:
    """Per setting: final accuracies at the budget, samples to reach the baseline's, and the
    verdicts."""
    base = smooth(curves[BASELINE]["mean"])[POINTS - 1]
    base_samples = samples_to_reach(curves[BASELINE]["mean"], base)
    assert base_samples is not None  # the smoothed curve equals base at the budget
    out = {}
    for setting, c in curves.items():
        final = {key: smooth(c[key])[POINTS - 1] for key in c}
        samples = samples_to_reach(c["mean"], base)
        ratio = None if samples is None else samples / base_samples
        gap = base - final["mean"]
        out[setting] = {
            "final_accuracy": final["mean"], "final_worst": final["worst"],
            "final_mean_model": final["mean_model"], "samples_to_reach": samples,
            "samples_ratio": ratio, "gap_points": gap,
            "ratio_met": ratio is not None and ratio <= TARGET_RATIO,
            "gap_met": gap <= TARGET_GAP,
            "horizon_ratio": len(c["mean"]) * BUDGET / POINTS / base_samples,
        }
    return out


def plot(curves: dict[Setting, dict[str, list[float]]], base: float, base_samples: int) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 6), sharey=True)
    panels = [(axes[0], [s for s in SETTINGS if s.steps_per_round == HEADLINE_STEPS
                         or s.allreduce], f"N = 1, 4, 8 at {HEADLINE_STEPS} steps per round"),
              (axes[1], [BASELINE] + [s for s in SETTINGS if s.n == 8 and not s.iid],
               "N = 8: steps per averaging round")]
    swarms = [s for s in SETTINGS if not s.allreduce]
    for ax, settings, title in panels:
        for setting in settings:
            c = curves[setting]
            x = [(k + 1) * BUDGET / POINTS for k in range(len(c["mean"]))]
            # The same in both panels; a reference takes the colour of the N it matches.
            match = Setting(setting.n, HEADLINE_STEPS) if setting.allreduce else setting
            color = f"C{swarms.index(match)}"
            dashed = setting.iid or setting.allreduce
            ax.plot(x, c["mean"], color=color, linestyle="--" if dashed else "-",
                    label=setting.label)
            if setting.n > 1 and not setting.allreduce:
                ax.plot(x, c["worst"], color=color, linestyle=":", linewidth=1)
        ax.axhline(base, color="black", linestyle="--", linewidth=1,
                   label=f"baseline final accuracy {base:.1f}%")
        ax.axvline(TARGET_RATIO * base_samples, color="grey", linestyle="-.", linewidth=1,
                   label=f"{TARGET_RATIO:g}x the baseline's samples to reach it")
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
                        help="2 seeds, horizon 4x the budget (about a minute)")
    parser.add_argument("--seeds", type=int, help="seeds per setting (default 5, --quick 2)")
    parser.add_argument("--horizon", type=int,
                        help="swarms run to this x the baseline's budget (default 8, --quick 4)")
    args = parser.parse_args()
    seeds = args.seeds or (2 if args.quick else 5)
    horizon = args.horizon or (4 if args.quick else 8)
    torch.set_num_threads(1)  # a tiny model: more threads only add overhead
    started = time.perf_counter()

    curves = {}
    for setting in SETTINGS:
        runs = []
        for seed in range(1, seeds + 1):
            run = run_allreduce if setting.allreduce else run_swarm
            runs.append(run(setting, seed, horizon * POINTS))
            progress(f"[{time.perf_counter() - started:5.1f}s] {setting.label} seed {seed}: "
                     f"accuracy at the budget {runs[-1]['mean'][POINTS - 1]:.1f}%")
        curves[setting] = {key: seed_mean(runs, key) for key in runs[0]}
        curves[setting]["per_seed"] = runs
    per_seed = {s: curves[s].pop("per_seed") for s in SETTINGS}
    summary = summarize(curves)
    base = summary[BASELINE]["final_accuracy"]
    base_samples = summary[BASELINE]["samples_to_reach"]
    plot(curves, base, base_samples)
    elapsed = time.perf_counter() - started

    verdict = {True: "met", False: "MISSED"}
    ratio = {setting: f"{s['samples_ratio']:.2f}" if s["samples_ratio"] is not None
             else f"> {s['horizon_ratio']:.0f}" for setting, s in summary.items()}
    rows = []
    for setting in SETTINGS:
        s = summary[setting]
        reach = (f"{s['samples_to_reach']:,}" if s["samples_to_reach"] is not None
                 else f"> {horizon * BUDGET:,}")
        is_target = setting.n > 1 and not setting.iid
        rows.append([setting.label, f"{s['final_accuracy']:.1f}", f"{s['final_worst']:.1f}",
                     f"{s['final_mean_model']:.1f}", reach, ratio[setting],
                     f"{s['gap_points']:.1f}",
                     verdict[s["ratio_met"]] if is_target else "-",
                     verdict[s["gap_met"]] if is_target else "-"])
    print(f"\ndigits MLP (lr 0.05, momentum 0.9, batch {BATCH}) on label-sorted shards, "
          f"{seeds} seeds; {STEP_TIME * 1000:g} ms per step (virtual), round every "
          f"steps/round x {STEP_TIME * 1000:g} ms; budget {BUDGET:,} samples, horizon "
          f"{horizon}x")
    print(table(["setting", "final %", "worst %", "mean model %", "samples to reach",
                 "ratio", "gap pts", f"ratio<={TARGET_RATIO:g}", f"gap<={TARGET_GAP:g}"], rows))
    print(f"final: mean of the last {WINDOW} evaluations up to {BUDGET:,} total samples, mean "
          f"over nodes (worst: the worst node; mean model: the nodes' parameters averaged), "
          f"mean over seeds.\nsamples to reach: the baseline's final accuracy "
          f"({base:.1f}%), which the baseline reaches at {base_samples:,}; ratio: x that.")
    print(f"all-reduce (reference): no swarm; one model and one SGD optimizer from the same "
          f"initial weights, lr and momentum, each step on the mean loss of one batch of "
          f"{BATCH} from each\nof the N shards, as DDP averages gradients: {BATCH}N samples "
          f"per step. One model, so worst and mean model are its accuracy.")
    headline = [s for s in SETTINGS if s.n > 1 and not s.iid and not s.allreduce
                and s.steps_per_round == HEADLINE_STEPS]
    references = {s.n: Setting(s.n, 1, allreduce=True) for s in headline}
    print("baseline to all-reduce: what N times fewer steps of N times the samples cost at "
          "the same lr; all-reduce to gossip: what averaging the drifting nodes' parameters "
          f"every {HEADLINE_STEPS} steps costs\ninstead of their gradients every step.")
    for s in headline:
        gossip, reference = summary[s], summary[references[s.n]]
        print(f"N={s.n} at the budget: all-reduce {reference['final_accuracy']:.1f}% (gap "
              f"{reference['gap_points']:.1f} pts, {verdict[reference['gap_met']]}), gossip "
              f"{gossip['final_accuracy']:.1f}% ({gossip['gap_points']:.1f} pts, "
              f"{verdict[gossip['gap_met']]}); to reach {base:.1f}%: all-reduce "
              f"{ratio[references[s.n]]}x, gossip {ratio[s]}x the baseline's samples.")
    print(f"wall time {elapsed:.1f} s")

    out = {"baseline_accuracy": round(base, 2),
           "samples_ratio": {str(s.n): _round(summary[s]["samples_ratio"]) for s in headline},
           "final_gap_points": {str(s.n): round(summary[s]["gap_points"], 2) for s in headline},
           "allreduce_samples_ratio": {
               str(n): _round(summary[r]["samples_ratio"]) for n, r in references.items()},
           "allreduce_final_gap_points": {
               str(n): round(summary[r]["gap_points"], 2) for n, r in references.items()},
           "iid_control_8": {"samples_ratio": _round(summary[CONTROL]["samples_ratio"]),
                             "final_gap_points": round(summary[CONTROL]["gap_points"], 2)},
           "steps_per_round": HEADLINE_STEPS, "seeds": seeds, "horizon": horizon,
           "targets_met": all(summary[s]["ratio_met"] and summary[s]["gap_met"]
                              for s in headline)}
    save_json("efficiency", {
        **out, "budget_samples": BUDGET, "points": POINTS, "window": WINDOW,
        "step_time": STEP_TIME, "batch_size": BATCH, "task_options": digits.DEFAULTS,
        "targets": {"samples_ratio": TARGET_RATIO, "gap_points": TARGET_GAP},
        "wall_s": round(elapsed, 1),
        "settings": [{"n": s.n, "steps_per_round": s.steps_per_round, "iid": s.iid,
                      "allreduce": s.allreduce,
                      "interval_s": None if s.allreduce else s.steps_per_round * STEP_TIME,
                      **summary[s],
                      "samples": [(k + 1) * BUDGET // POINTS for k in range(horizon * POINTS)],
                      "curves": curves[s], "per_seed": per_seed[s]} for s in SETTINGS]})
    print(json.dumps(out))


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


if __name__ == "__main__":
    main()
