"""Nodes on quadratics with known optima, for simulated swarms: node i pulls its vector ``x``
towards its own target, so the swarm's optimum is the targets' mean and where the nodes
settle says what averaging and the drift correction did."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gossip.testing import SimNode


class Point(torch.nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.x = torch.nn.Parameter(torch.zeros(size))


@dataclass
class Quadratics:
    """``nodes`` points of ``size`` values, each with its SGD optimizer (lr 0.05, momentum
    0.9) and a target drawn from N(0, 9) with ``seed``."""

    nodes: int
    size: int
    seed: int

    def __post_init__(self) -> None:
        generator = torch.Generator().manual_seed(self.seed)
        self.targets = [3 * torch.randn(self.size, generator=generator)
                        for _ in range(self.nodes)]
        self.models = [Point(self.size) for _ in range(self.nodes)]
        self.optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
                           for m in self.models]

    def train(self, node: SimNode) -> float:
        """One SGD step of ``node`` on ½‖x − target‖² (``open_sim_swarm``'s ``train``)."""
        i = node.index
        loss = 0.5 * (self.models[i].x - self.targets[i]).square().sum()
        self.optimizers[i].zero_grad()
        loss.backward()
        self.optimizers[i].step()
        return float(loss.detach())
