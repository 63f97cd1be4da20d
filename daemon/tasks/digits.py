"""A small classifier on scikit-learn's digits (1,797 8x8 images, bundled with the package).

The train/test split is fixed (the same on every node); the training set is sharded by
label, so that with ``count`` shards each node sees only a few classes (non-IID data): the
case where a node alone cannot learn the task and averaging with its peers can. Each step
takes well under a millisecond on one CPU core, which makes it the daemon's smoke test.

Options (``[task.options]``):
    hidden: width of the MLP's hidden layer (default 64).
    lr: SGD learning rate, momentum 0.9 (default 0.05).
    batch_size: samples per step (default 32).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from gossip import Stages

from daemon.task import Context, Shard, Task, TaskError, classifier_step, evaluating, read_options

__all__ = ["load", "shard_indices", "task"]

DEFAULTS: dict[str, Any] = {"hidden": 64, "lr": 0.05, "batch_size": 32}
TEST_FRACTION = 0.2
SPLIT_SEED = 0  # the split never depends on the node or the swarm's seed


def task(ctx: Context) -> Task:
    """The digits MLP, its optimizer and this node's label-skewed batches.

    Raises:
        TaskError: scikit-learn is missing, or an option is unknown or not a positive number.
    """
    opts = read_options(ctx.options, DEFAULTS)
    x_train, y_train, x_test, y_test = (torch.from_numpy(a) for a in load())

    torch.manual_seed(ctx.seed)  # every node starts from the same weights
    model = torch.nn.Sequential(torch.nn.Linear(64, opts["hidden"]), torch.nn.ReLU(),
                                torch.nn.Linear(opts["hidden"], 10))
    opt = torch.optim.SGD(model.parameters(), lr=opts["lr"], momentum=0.9)
    batch_size = opts["batch_size"]

    def batches(shard: Shard) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        mine = shard_indices(y_train.numpy(), shard)
        if len(mine) == 0:
            raise TaskError(f"digits shard {shard.index}/{shard.count} is empty: the training "
                            f"split has only {len(y_train)} samples")
        rng = np.random.default_rng([ctx.seed % 2**64, shard.index])
        while True:  # one epoch per pass, reshuffled; the last partial batch is dropped
            order = torch.from_numpy(rng.permutation(mine))
            for i in range(0, max(len(order) - batch_size, 0) + 1, batch_size):
                idx = order[i:i + batch_size]
                yield x_train[idx], y_train[idx]

    def evaluate() -> dict[str, float]:
        with evaluating(model) as device:
            logits = model(x_test.to(device))
            y = y_test.to(device)
            return {"accuracy": (logits.argmax(1) == y).float().mean().item(),
                    "loss": F.cross_entropy(logits, y).item()}

    # task.pipeline = 2 cuts it after the first layer (its stages: a demonstration).
    return Task(model, opt, batches, classifier_step(model, opt), batch_size=batch_size,
                evaluate=evaluate, pipeline=Stages(loss=F.cross_entropy))


def load() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The fixed split: x_train, y_train, x_test, y_test (x float32 in [0, 1], y int64).

    Raises:
        TaskError: scikit-learn is not installed.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise TaskError("the digits task needs scikit-learn: pip install 'gossipd[demo]'") from None
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)  # pixels are 0..16
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(y))
    n_test = round(len(y) * TEST_FRACTION)
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def shard_indices(labels: np.ndarray, shard: Shard) -> np.ndarray:
    """The training samples of ``shard``: with the samples sorted by label, its contiguous
    block of ``count`` near-equal blocks (so shard 0 of 2 holds the zeros to the fours)."""
    by_label = np.argsort(labels, kind="stable")
    return np.array_split(by_label, shard.count)[shard.index]
