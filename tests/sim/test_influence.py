"""Members of standing pushing one way, exchange after exchange: what it adds up to.

Four honest nodes train the digits task (:mod:`tests.sim.digits`, label-sorted shards, the
default averaging settings: outer step and drift correction on) for :data:`STEPS` local steps,
one every virtual second. A key holder on a host of its own comes to the running swarm (after
``trust_after``), announces four identities to every node (a push-pull each) and proves them
(one offer each, a newcomer's), waits ``trust_after`` so that they stand, and then takes
turns with them, offering to a random node as fast as it is answered:

* ``estimate``: the node's own state back (no harm there), with a drift-correction estimate
  ``z + RATIO·‖z‖·e``, ``z`` the node's own estimate from its last exchange with us and ``e``
  one output bias. Each exchange's step was clipped, but the steps added up and the history
  that sets the clip grew as the poison spread: ``‖c‖`` went from 0.0008 to 7.5e10, the weight
  norm from 24 to 4.6e12, accuracy fell 11 points and stayed 1-4.5 points down. Now a node
  swaps estimates only with members it has picked for a round of its own, which these
  identities never are: their offers swap states alone (the zeros it sends before it has
  seen an estimate; tests/sim/test_correction_poisoning.py mounts the estimate attacks).
* ``state``: the node's own state plus ``RATIO·‖state‖`` along one fixed random direction (the
  estimate honest). ``‖w‖`` went from 24 to 7,309, accuracy 98 to 90; here, with the members'
  budget already in place, from 11 to 280 and 96.7 to 92.2, until offers were clipped to one
  median step (:data:`gossip.mixing.OFFER_CLIP`).

The claims: every honest node ends within :data:`TOLERANCE` points of the unattacked run (the
same seeds, in the same test), and no correction is longer than ``REACH`` x its scale; against
the state's pushes, no honest weight norm passes the largest an unattacked one reaches by more
than :data:`NORM_SLACK`. Against the estimate's, the norm is printed, not bounded: a
correction held within ``REACH`` x its scale, but along one output bias, still walks that bias
(to about 30 in four virtual minutes here, accuracy unchanged), since a bias's gradient is
bounded and the pushes come to every node alike, so that no exchange between honest nodes
undoes them (docs/PROTOCOL.md section 12 says so).
"""

from __future__ import annotations

import itertools
import os
import random
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

import pytest
import torch
import trio
from trio.testing import MockClock

from gossip import tensors
from gossip.config import AveragingConfig
from gossip.correction import REACH
from gossip.errors import GossipError
from gossip.testing.simnet import SimNetwork
from gossip.testing.hostile import HostilePeer, Reaction
from tests.sim.digits import BATCH, accuracy, digits
from tests.sim.standing_swarm import (IDENTITIES, NODES, RATIO, STEP_TIME, digits_swarm, stand,
                                      standing_peers, with_calm)

STEPS = int(os.environ.get("INFLUENCE_STEPS", "240"))
TOLERANCE = 3.0  # accuracy points
NORM_SLACK = 1.10


@dataclass
class Run:
    accuracies: list[float] = field(default_factory=list)
    largest_norm: float = 0.0
    largest_correction: float = 0.0  # ‖c‖ / (REACH x scale), the largest seen
    taken: int = 0  # the key holder's exchanges that committed
    tried: int = 0


def correction_norm(node) -> float:
    state = node.replica.correction_state()
    return 0.0 if not state else float(torch.sqrt(sum((c.float() ** 2).sum()
                                                      for c in state.values())))


async def train_swarm(seed: int, attack: str | None) -> Run:
    net = SimNetwork(seed=seed, latency=0.005)
    data, rng, run = digits(), random.Random(seed), Run()
    trust_after = AveragingConfig().trust_after
    async with AsyncExitStack() as stack:
        nodes, trainers = await digits_swarm(stack, net, seed, NODES, STEPS, rng)
        schema = nodes[0].replica.schema
        bias = schema.places()["2.bias"].start  # an output bias: the estimate's direction
        fixed = torch.randn(schema.numel, generator=torch.Generator().manual_seed(seed))
        fixed /= torch.linalg.vector_norm(fixed)

        async def train(i: int) -> None:
            trainer, node = trainers[i], nodes[i]
            while trainer.done < trainer.steps:
                trainer.step()
                node.step(samples=BATCH)
                flat = tensors.snapshot(trainer.model, schema)
                run.largest_norm = max(run.largest_norm, tensors.norm(flat))
                scale = node.replica.correction.scale if node.replica.correction else 0.0
                if scale > 0:
                    run.largest_correction = max(run.largest_correction,
                                                 correction_norm(node) / (REACH * scale))
                await trio.sleep(STEP_TIME)

        async def push(peer: HostilePeer, address: str) -> Reaction:
            own = peer.seen.get(address)
            estimate = peer.seen_estimate.get(address)
            if own is None:  # nothing to echo yet: a first exchange that learns it
                return (await peer.send_noise(address, 0.0)).reaction
            peer.honest = own.clone()
            if attack == "state":
                peer.honest += RATIO * float(torch.linalg.vector_norm(own)) * fixed
                return (await peer.send_correction(address, estimate if estimate is not None
                                                   else torch.zeros_like(own))).reaction
            if estimate is None:
                return (await peer.send_noise(address, 0.0)).reaction
            poison = estimate.clone()
            poison[bias] += RATIO * max(float(torch.linalg.vector_norm(estimate)), 1e-3)
            return (await peer.send_correction(address, poison)).reaction

        async def attacker(done: trio.Event) -> None:
            peers = standing_peers(net, schema, seed, IDENTITIES)
            await trio.sleep(trust_after)  # it comes to a running swarm
            await stand(peers, nodes)
            await trio.sleep(trust_after + 1.0)  # now they stand
            for peer in itertools.cycle(peers):
                if done.is_set():
                    return
                try:
                    reaction = await push(peer, rng.choice(nodes).address)
                except GossipError:
                    reaction = None
                run.tried += 1
                run.taken += reaction is Reaction.ACCEPTED
                await trio.sleep(0.05)

        done = trio.Event()
        async with trio.open_nursery() as nursery:
            if attack is not None:
                nursery.start_soon(attacker, done)
            async with trio.open_nursery() as training:
                for i in range(NODES):
                    training.start_soon(train, i)
            done.set()
        for node, trainer in zip(nodes, trainers):
            node.apply_pending()
            run.accuracies.append(accuracy(trainer.model, data))
    return run


CALM: dict[int, Run] = {}  # the unattacked run by seed: the same for either attack


@pytest.mark.slow
@pytest.mark.parametrize("attack", ["estimate", "state"])
async def test_pushes_in_one_direction_do_not_add_up(autojump_clock: MockClock,
                                                      attack: str) -> None:
    calm, attacked = await with_calm(train_swarm, CALM, 2, attack)
    print(f"\nunattacked: accuracy {[round(a, 2) for a in calm.accuracies]} largest norm "
          f"{calm.largest_norm:.2f} largest |c|/reach {calm.largest_correction:.3f}"
          f"\n{attack}: accuracy {[round(a, 2) for a in attacked.accuracies]} largest norm "
          f"{attacked.largest_norm:.2f} largest |c|/reach {attacked.largest_correction:.3f} "
          f"pushes taken {attacked.taken} of {attacked.tried}")
    assert attacked.taken > 20  # the pushes really were taken
    unattacked = sum(calm.accuracies) / len(calm.accuracies)
    for mine in attacked.accuracies:
        assert mine >= unattacked - TOLERANCE, (attacked.accuracies, calm.accuracies)
    assert attacked.largest_correction <= 1.0 + 1e-6
    if attack == "state":
        assert attacked.largest_norm <= NORM_SLACK * calm.largest_norm
