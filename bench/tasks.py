"""Tasks for the benchmarks, named in a daemon's config as ``bench/tasks.py:<function>``.

``mlp10m``: a 10.5M-parameter MLP on synthetic data, for measuring speed.

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
step counter stays behind the trainer's.

Options (``[task.options]``):
    width: width of the input and hidden layers (default 1024).
    depth: hidden layers of width x width (default 10).
    batch_size: samples per step (default 64).
    lr: SGD learning rate (default 0.01).
    idle: true for the idle stand-in peer described above (default false).

``teacher``: the same kind of labelling on a small MLP that learns it within seconds, for
time-to-loss comparisons (``bench/straggler.py``). :class:`Teacher` holds the problem (the
model, each worker's batches, the held-out set), so that the benchmark's torch.distributed
workers train exactly what the daemons train. ``delay`` (busy seconds after each step) makes
a straggler, and ``start_file`` holds the first step until that file exists, so that every
method starts its clock with all of its workers up.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from daemon.task import (Context, Shard, Task, TaskError, classifier_step, evaluating,
                         read_options)

__all__ = ["Teacher", "burn", "delayed", "mlp10m", "teacher"]

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

    train = classifier_step(model, opt)

    def step(batch: Any) -> Any:
        if idle:
            time.sleep(IDLE_STEP)
            return 0.0
        return train(batch)

    return Task(model, opt, batches, step, batch_size=batch_size)


TEACHER_DEFAULTS: dict[str, Any] = {"width": 256, "hidden": 512, "batch_size": 256, "lr": 0.05}
TEST_SAMPLES = 1024  # the held-out set: an evaluation costs about 1% of a worker's time
START_POLL = 0.01  # s between looks for start_file


class Teacher:
    """Inputs in ``width`` dimensions labelled by a fixed random linear teacher (the argmax
    of ten projections), and an MLP ``width -> hidden -> hidden -> 10`` to learn them, with
    SGD (momentum 0.9).

    Worker ``i`` draws its own endless stream (seeded by the swarm's seed and ``i``): the
    workers' data are independent samples of one distribution. The held-out set is fixed.
    """

    def __init__(self, seed: int, width: int, hidden: int, batch_size: int, lr: float) -> None:
        torch.manual_seed(seed)  # every worker starts from the same weights
        self.model = torch.nn.Sequential(
            torch.nn.Linear(width, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
            torch.nn.ReLU(), torch.nn.Linear(hidden, CLASSES))
        self.seed, self.width, self.batch_size, self.lr = seed, width, batch_size, lr
        generator = torch.Generator().manual_seed(TEACHER_SEED)
        self.teacher = torch.randn(width, CLASSES, generator=generator)
        self.x_test = torch.randn(TEST_SAMPLES, width, generator=generator)
        self.y_test = (self.x_test @ self.teacher).argmax(1)

    def optimizer(self, parameters: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(parameters, lr=self.lr, momentum=0.9)

    def batches(self, worker: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + worker)
        while True:
            x = torch.randn(self.batch_size, self.width, generator=generator)
            yield x, (x @ self.teacher).argmax(1)

    def evaluate(self) -> dict[str, float]:
        """The model's loss and accuracy on the held-out set."""
        with evaluating(self.model) as device:
            logits = self.model(self.x_test.to(device))
            y = self.y_test.to(device)
            return {"loss": F.cross_entropy(logits, y).item(),
                    "accuracy": (logits.argmax(1) == y).float().mean().item()}


def burn(seconds: float) -> None:
    """Keep a core busy for ``seconds``, as a slower machine is busy for longer with the same
    step: small matrix products, which release the GIL, so the daemon's other threads run
    beside it as they would beside a slow GPU. (A sleep would instead hand the core to the
    other workers of a benchmark sharing one machine, and speed them up.)"""
    end = time.perf_counter() + seconds
    a = torch.ones(96, 96)
    while time.perf_counter() < end:
        torch.mm(a, a)


def delayed(step: Callable[[Any], Any], delay: float) -> Callable[[Any], Any]:
    """``step`` followed by :func:`burn` for ``delay`` seconds (0: ``step`` itself)."""
    if not delay:
        return step

    def slow_step(batch: Any) -> Any:
        loss = step(batch)
        burn(delay)
        return loss

    return slow_step


def teacher(ctx: Context) -> Task:
    """:class:`Teacher` as a daemon's task; the shard index picks the worker's stream.

    Options (``[task.options]``): width (256), hidden (512), batch_size (256), lr (0.05),
    delay (0.0: seconds of busy CPU after each step, to make a straggler), start_file ("":
    no wait).

    Raises:
        TaskError: an unknown option or a bad value.
    """
    given = dict(ctx.options)
    start_file, delay = given.pop("start_file", ""), given.pop("delay", 0.0)
    if type(start_file) is not str:
        raise TaskError(f"task option start_file must be a path, not {start_file!r}")
    if type(delay) not in (int, float) or not 0 <= delay < 60:
        raise TaskError(f"task option delay must be seconds in [0, 60), not {delay!r}")
    opts = read_options(given, TEACHER_DEFAULTS)
    problem = Teacher(ctx.seed, opts["width"], opts["hidden"], opts["batch_size"], opts["lr"])
    model, opt = problem.model, problem.optimizer(problem.model.parameters())

    slow_step = delayed(classifier_step(model, opt), delay)
    waiting = bool(start_file)

    def gated_step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        nonlocal waiting
        while waiting and not os.path.exists(start_file):
            time.sleep(START_POLL)
        waiting = False
        return slow_step(batch)

    return Task(model, opt, lambda shard: problem.batches(shard.index), gated_step,
                batch_size=opts["batch_size"], evaluate=problem.evaluate)
