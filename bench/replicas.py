"""The all-reduce baselines of ``bench/lowcomm.py``, in plain torch: DDP and DiLoCo.

Both train the tasks :func:`workloads.build` makes (the same model, initial weights, inner
optimizer and batches as the swarm's nodes), with no network: what they would send is
counted (:func:`workloads.allreduce_bytes`, a ring all-reduce), and the time it would take
on the benchmark's link is added to their clocks, not simulated.

- :func:`run_ddp`: one model and one optimizer; each step takes the next batch of each of the
  N shards (in the order that shard's node draws them) and steps on their concatenation,
  whose mean loss is the mean of the N batches' losses, as DDP's gradient averaging does: N
  batches a step, at the task's learning rate. The DiLoCo paper's data-parallel baseline
  keeps its hyperparameters as the batch grows 8-fold; scaling the lr by sqrt(8) (AdamW's
  rule) was worse here (1.53 against 1.40 nats at 1,600 steps of the IID LM), so the task's
  lr is the stronger baseline.
- :func:`run_diloco`: N replicas from the same initial weights, each with its own inner
  optimizer (the task's, its state kept per replica) on its shard; every H steps the
  pseudo-gradients ``anchor - replica`` are averaged (an exact all-reduce) and applied to the
  anchor by SGD with Nesterov momentum (lr 0.7, momentum 0.9: the published values); every
  replica then takes the anchor.
"""

from __future__ import annotations

from typing import Any

import torch

from workloads import (STEP_TIME, Workload, allreduce_bytes, build, evaluate, figures, numel,
                       points)

__all__ = ["DILOCO_LR", "DILOCO_MOMENTUM", "blocking_time", "run_ddp", "run_diloco"]

DILOCO_LR, DILOCO_MOMENTUM = 0.7, 0.9  # the outer Nesterov SGD, as published


def run_ddp(work: Workload, seed: int, steps: int, device: torch.device,
            at: list[int]) -> dict[str, Any]:
    """One model, ``steps`` steps of N batches each; evaluated after each step in ``at``
    (and :func:`workloads.points`) as a curve: ``(step, figures)`` pairs."""
    tasks, batches = build(work, seed, device, steps)
    model = tasks[0]
    curve = []
    marks = set(at) | set(points(steps))
    for step in range(1, steps + 1):
        parts = [next(b) for b in batches]
        model.step(tuple(torch.cat(xs) for xs in zip(*parts)))
        if step in marks:
            curve.append((step, figures(evaluate([model]))))
    return {"curve": curve, "params": numel(model),
            "bytes_per_step": allreduce_bytes(numel(model))}


def run_diloco(work: Workload, seed: int, steps: int, h: int,
               device: torch.device) -> dict[str, Any]:
    """N replicas, ``steps / h`` outer steps of ``h`` inner steps each; evaluated at
    :func:`workloads.points` (rounded down to the last sync: the replicas then hold the
    anchor)."""
    tasks, batches = build(work, seed, device, steps)
    anchor = [p.detach().clone() for p in tasks[0].model.parameters()]
    outer = torch.optim.SGD(anchor, lr=DILOCO_LR, momentum=DILOCO_MOMENTUM, nesterov=True)
    marks = {max(h, p - p % h) for p in points(steps)}
    curve = []
    for done in range(h, steps + 1, h):
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
        if done in marks:
            curve.append((done, figures(evaluate(tasks))))
    return {"curve": curve, "rounds": steps // h, "params": numel(tasks[0]),
            "bytes_per_round": allreduce_bytes(numel(tasks[0]))}


def blocking_time(steps: int, syncs: int, sync_bytes: float, rate: float) -> float:
    """Virtual seconds to train ``steps`` steps with ``syncs`` blocking all-reduces of
    ``sync_bytes`` each on links of ``rate`` bytes/s."""
    return steps * STEP_TIME + syncs * sync_bytes / rate

