"""The digits task of the simulated training tests: data, shards, model, trainer, scores.

Data: scikit-learn's bundled digits (1797 8x8 images, 10 classes, shipped in the wheel),
split 75/25 into 1347 training and 450 test images, stratified, with a fixed seed; every
feature is standardized with the training set's mean and deviation. Model: an MLP
64 -> 64 -> 10 with ReLU. Trainer: SGD with momentum on batches of :data:`BATCH`, the
learning rate decayed linearly from :data:`LR` to zero over the run.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

BATCH = 32
LR = 0.1  # at step 0, decayed linearly to 0 at the last step
MOMENTUM = 0.9


@dataclass(frozen=True)
class Digits:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


@functools.lru_cache(maxsize=1)
def digits() -> Digits:
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, stratify=y,
                                                        random_state=0)
    mean, std = x_train.mean(axis=0), x_train.std(axis=0)
    std[std == 0] = 1.0  # pixels that are blank in every training image
    as_x = lambda a: torch.tensor((a - mean) / std, dtype=torch.float32)  # noqa: E731
    as_y = lambda a: torch.tensor(a, dtype=torch.long)  # noqa: E731
    return Digits(as_x(x_train), as_y(y_train), as_x(x_test), as_y(y_test))


def shards(data: Digits, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The training set sorted by label and cut into ``n`` contiguous pieces."""
    order = torch.argsort(data.y_train, stable=True)
    return [(data.x_train[part], data.y_train[part]) for part in order.chunk(n)]


def make_model(seed: int) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                   torch.nn.Linear(64, 10))


class Trainer:
    """SGD on one dataset for ``steps`` steps, batches drawn from epochs shuffled by ``seed``."""

    def __init__(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *,
                 steps: int, seed: int) -> None:
        self.model, self.x, self.y = model, x, y
        self.steps, self.done = steps, 0
        self.optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        self._generator = torch.Generator().manual_seed(seed)
        self._order = torch.empty(0, dtype=torch.long)

    def batch(self) -> torch.Tensor:
        """The indices of the next batch (each epoch reshuffled)."""
        if len(self._order) < BATCH:
            self._order = torch.randperm(len(self.y), generator=self._generator)
        batch, self._order = self._order[:BATCH], self._order[BATCH:]
        return batch

    def step(self) -> None:
        batch = self.batch()
        for group in self.optimizer.param_groups:
            group["lr"] = LR * (1 - self.done / self.steps)
        loss = F.cross_entropy(self.model(self.x[batch]), self.y[batch])
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.done += 1

    def run(self) -> torch.nn.Module:
        while self.done < self.steps:
            self.step()
        return self.model


@torch.no_grad()
def accuracy(model: torch.nn.Module, data: Digits) -> float:
    """Test accuracy in percent."""
    return 100.0 * (model(data.x_test).argmax(dim=1) == data.y_test).float().mean().item()


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, data: Digits) -> float:
    """Mean cross-entropy over the test set."""
    return F.cross_entropy(model(data.x_test), data.y_test).item()
