"""Tasks for the benchmarks: ``bench/tasks.py:mlp10m``, a 10.5M-parameter MLP on synthetic data.

The model is ten 1024x1024 linear layers with ReLUs and a 1024 -> 10 head (10,506,250 float32
parameters, 42 MB), trained with plain SGD. Its batches are drawn from a seeded generator:
standard normal inputs, labelled by a fixed random linear "teacher" (the argmax of ten
projections), so no dataset is needed. The task is learnable but slowly so for a plain MLP
this deep (the loss barely moves from ln 10 in thousands of steps): it is for measuring
speed, not learning. With one torch thread a step at the default batch size takes about
50 ms on one core of a 2-core cloud machine.

``idle = true`` makes a stand-in for a peer on another machine, for a benchmark whose
machine has no core to spare for a second trainer. Its ``step()`` only sleeps (``IDLE_STEP``)
and returns a constant loss, never touching the model; everything else is a real daemon:
it joins, downloads the swarm's state, and its exchanges serialize, encrypt, check and mix
40 MB each way as any peer's would. It sleeps longer than a trainer's step lasts, so its
step counter stays behind the trainer's and the step merged as a max across the swarm stays
the trainer's own.

Options (``[task.options]``):
    width: width of the input and hidden layers (default 1024).
    depth: hidden layers of width x width (default 10).
    batch_size: samples per step (default 64).
    lr: SGD learning rate (default 0.01).
    idle: true for the idle stand-in peer described above (default false).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from daemon.task import Context, Shard, Task, TaskError, read_options

__all__ = ["mlp10m"]

DEFAULTS: dict[str, Any] = {"width": 1024, "depth": 10, "batch_size": 64, "lr": 0.01}
CLASSES = 10
IDLE_STEP = 0.1  # s an idle step sleeps: longer than a trainer's step on this model
TEACHER_SEED = 12345  # the labelling function is the same on every node, whatever its seed


def mlp10m(ctx: Context) -> Task:
    """The MLP, its optimizer and this node's synthetic batches.

    Raises:
        TaskError: an unknown option or a bad value.
    """
    given = dict(ctx.options)
    idle = given.pop("idle", False)  # read_options takes positive numbers only
    if type(idle) is not bool:
        raise TaskError(f"task option idle must be true or false, not {idle!r}")
    opts = read_options(given, DEFAULTS)
    width, batch_size = opts["width"], opts["batch_size"]

    torch.manual_seed(ctx.seed)  # every node starts from the same weights
    layers: list[torch.nn.Module] = []
    for _ in range(opts["depth"]):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, CLASSES))
    opt = torch.optim.SGD(model.parameters(), lr=opts["lr"])
    teacher = torch.randn(width, CLASSES, generator=torch.Generator().manual_seed(TEACHER_SEED))

    def batches(shard: Shard) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if idle:  # step() ignores its batch: do not spend CPU making one
            while True:
                yield ()
        generator = torch.Generator().manual_seed(ctx.seed * 1_000_003 + shard.index)
        while True:
            x = torch.randn(batch_size, width, generator=generator)
            yield x, (x @ teacher).argmax(1)

    def step(batch: Any) -> Any:
        if idle:
            time.sleep(IDLE_STEP)
            return 0.0
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()

    return Task(model, opt, batches, step, batch_size=batch_size)
