"""The nodes of a simulated swarm as a test sees them (:class:`SimNode`), what a crash keeps
of one (its checkpoint), and the record of an exchange that ended at one (:class:`SimExchange`).

:class:`~gossip.testing.sim.SimSwarm` creates, starts, crashes and restarts the nodes, and
reads and sets their private state (whether one is down, paused, and its checkpoint): a
:class:`SimNode` is the swarm's bookkeeping of one node, not a process of its own.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import trio

from ..averaging import Result
from ..identity import Identity, PeerId
from ..node import SwarmNode
from ..replica import Counters

__all__ = ["SimNode", "SimExchange", "Checkpoint", "capture", "PORT"]

PORT = 7000


@dataclass(frozen=True)
class SimExchange:
    """One exchange as it ended at one node (what ``on_exchange`` reported)."""

    time: float  # when it ended, virtual seconds
    started: float  # when it began at this node
    node: SimNode  # where it was reported
    peer: SimNode | None  # the other side (None: not a node of this swarm)
    initiated: bool  # ``node`` made the offer
    result: Result
    distance: float | None  # ||peer - own|| when committed
    codec: str | None = None  # of both payloads, once the Offer named it
    nbytes: int | None = None  # one payload's size, once both were due


@dataclass(frozen=True)
class Checkpoint:
    """What a checkpoint would hold: the model's state, counters and optimizer state."""

    state: dict[str, torch.Tensor]
    counters: Counters
    steps: int
    correction: dict[str, torch.Tensor] | None
    outer: dict[str, torch.Tensor] | None
    optimizer: dict[str, Any] | None = None  # its state_dict(), copied


class SimNode:
    """One node of a :class:`~gossip.testing.sim.SimSwarm`, running or down.

    Attributes:
        name: its host's name, ``n<index>``.
        index: its position in :attr:`SimSwarm.nodes <gossip.testing.sim.SimSwarm.nodes>`.
        model: its live model, the same object across restarts.
        optimizer: its optimizer (the same object across restarts, which load the
            checkpoint's state into it), or None.
        identity: its key; a restart keeps it.
        node: the :class:`~gossip.SwarmNode` while it runs, else None.
        loss: what ``train`` returned at its latest step (None before the first).
        steps: training steps taken over all its lives (a restart resumes the count).
        restarts: how many times it was restarted.
    """

    def __init__(self, index: int, model: torch.nn.Module, identity: Identity,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        self.name = f"n{index}"
        self.index = index
        self.model = model
        self.optimizer = optimizer
        self.identity = identity
        self.node: SwarmNode | None = None
        self.loss: float | None = None
        self.steps = 0
        self.restarts = 0
        self._down: str | None = "starting"  # None while running, else what it is doing
        self._resumed: trio.Event | None = None  # while paused: set on resume
        self._scope: trio.CancelScope | None = None
        self._done = trio.Event()
        self._checkpoint: Checkpoint | None = None

    @property
    def running(self) -> bool:
        return self._down is None

    @property
    def paused(self) -> bool:
        return self._resumed is not None

    @property
    def peer_id(self) -> PeerId:
        return self.identity.peer_id

    @property
    def address(self) -> str:
        return f"{self.name}:{PORT}"

    def __repr__(self) -> str:
        state = "running" if self._down is None else self._down
        return f"<SimNode {self.name} {state}{' paused' if self.paused else ''}>"


def capture(node: SimNode, swarm_node: SwarmNode) -> Checkpoint:
    """What a checkpoint of ``node`` written now would hold (deltas not yet added are lost)."""
    state = {k: v.detach().clone() for k, v in node.model.state_dict().items()}
    optimizer = None if node.optimizer is None else copy.deepcopy(node.optimizer.state_dict())
    return Checkpoint(state, swarm_node.replica.counters(), node.steps,
                       swarm_node.replica.correction_state(), swarm_node.replica.outer_state(),
                       optimizer)
