"""A task written from scratch: an MLP fitting Friedman's first regression problem.

    y = 10 sin(pi x0 x1) + 20 (x2 - 0.5)^2 + 10 x3 + 5 x4 + noise,   x uniform in [0, 1]^10

Five of the ten features are noise that the model must learn to ignore. The data is generated,
not downloaded, and it is the same on every node: it is drawn from ``DATA_SEED``, never from
the swarm's seed. Training sample ``i`` belongs to shard ``i % count``. The learning rate warms
up over the swarm's first steps, following ``ctx.global_step()``.

Options (``[task.options]``):
    samples: training samples, all shards together (default 8192).
    hidden: width of the two hidden layers (default 64).
    lr: AdamW learning rate after the warm-up (default 3e-3).
    warmup: steps over which the learning rate rises to lr (default 200).
    batch_size: samples per step (default 64).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from daemon.task import Context, Shard, Task, TaskError, evaluating, read_options

__all__ = ["friedman1", "lr_at", "task"]

DEFAULTS = {"samples": 8192, "hidden": 64, "lr": 3e-3, "warmup": 200, "batch_size": 64}
FEATURES = 10
TEST_SAMPLES = 2048
NOISE = 1.0  # standard deviation of the noise in y (y itself varies by about 5)
DATA_SEED = 0  # the data never depends on the node or the swarm's seed


def task(ctx: Context) -> Task:
    """The MLP, its optimizer, this node's batches, a step and an evaluation.

    Raises:
        TaskError: an option is unknown or not a positive number of its default's type.
    """
    opts = read_options(ctx.options, DEFAULTS)
    data = torch.Generator().manual_seed(DATA_SEED)
    x_train, y_train = friedman1(opts["samples"], data)
    x_test, y_test = friedman1(TEST_SAMPLES, data)
    mean, std = y_train.mean(), y_train.std()  # standardized targets: a loss of 1 is a mean guess
    y_train, y_test = (y_train - mean) / std, (y_test - mean) / std

    torch.manual_seed(ctx.seed)  # every node starts from the same weights
    width = opts["hidden"]
    model = nn.Sequential(nn.Linear(FEATURES, width), nn.ReLU(), nn.Linear(width, width),
                          nn.ReLU(), nn.Linear(width, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=opts["lr"])
    batch_size = opts["batch_size"]

    def batches(shard: Shard) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        mine = torch.arange(shard.index, len(x_train), shard.count)  # this node's samples
        if len(mine) < batch_size:
            raise TaskError(f"friedman shard {shard.index}/{shard.count} holds {len(mine)} "
                            f"samples, fewer than a batch ({batch_size}): raise samples")
        shuffle = torch.Generator().manual_seed(ctx.seed)
        while True:  # endless: reshuffled every epoch, the last partial batch dropped
            order = mine[torch.randperm(len(mine), generator=shuffle)]
            for i in range(0, len(order) - batch_size + 1, batch_size):
                idx = order[i:i + batch_size]
                yield x_train[idx], y_train[idx]

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        for group in opt.param_groups:  # the schedule follows the swarm's step
            group["lr"] = lr_at(ctx.global_step(), opts["lr"], opts["warmup"])
        x, y = batch
        loss = F.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()  # a tensor: the daemon reads it once per chunk, not every step

    def evaluate() -> dict[str, float]:
        with evaluating(model) as device:  # eval mode, no gradients; the model's device
            mse = F.mse_loss(model(x_test.to(device)), y_test.to(device)).item()
        return {"mse": mse, "r2": 1 - mse / y_test.var().item()}

    return Task(model, opt, batches, step, batch_size=batch_size, evaluate=evaluate)


def friedman1(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` samples drawn with ``generator``: x of shape (n, 10), y of shape (n, 1)."""
    x = torch.rand(n, FEATURES, generator=generator)
    y = (10 * torch.sin(math.pi * x[:, 0] * x[:, 1]) + 20 * (x[:, 2] - 0.5) ** 2
         + 10 * x[:, 3] + 5 * x[:, 4] + NOISE * torch.randn(n, generator=generator))
    return x, y.unsqueeze(1)


def lr_at(step: int, lr: float, warmup: int) -> float:
    """The learning rate at the swarm's ``step``: linear warm-up over ``warmup`` steps."""
    return lr * min(1.0, (step + 1) / warmup)
