"""Poisoned payloads from members of standing: held-out accuracy and loss stay put.

Four honest nodes train the digits task (:mod:`tests.sim.standing_swarm`, label-sorted
shards, outer step and drift correction on), one local step every virtual second. A key
holder on a host of its own announces four identities to every node and proves them on their
own channels (:func:`~tests.sim.standing_swarm.stand`); once they stand it takes turns with
them, offering to a random node as fast as it is answered, its payload the node's own state
back (as the node sent it in its last exchange with that identity) and a poisoned estimate:

* ``constant``: one fixed vector, :data:`RATIO` times the first estimate it saw, sent unchanged;
* ``bias+`` and ``bias-``: the node's own last estimate plus or minus :data:`RATIO` x its norm
  along one output bias;

from :data:`ATTACK_FROM` to :data:`ATTACK_UNTIL` local steps. Each estimate was clipped to
1.2 x the median and the correction to 3 x the node's gradient scale, but the steps added up,
and the swarm's sum of corrections, which no exchange between honest nodes changes, only the
leak fades: the constant push took every honest node from 96.9% held-out accuracy and loss
0.112 to 92.7% and 0.58, and 93.1% and 0.55 sixty steps after the attack; ``bias-`` to loss
0.128. Now an offer swaps estimates only with a member the node has picked for a round of its
own (:mod:`gossip.averaging`), which the key holder's identities, outbound-only, never are:
its estimates reach a correction only at its share of the hosts a node picks.

``young``: the identities are proven to the nodes in their first second, so that they count as
members from before each node started (:meth:`gossip.trust.Trust.clip`), and from
``trust_after`` on they offer the node's state plus :data:`RATIO` norms along one fixed
direction, the estimate honest, until every node's history is full (its young window, about
twenty steps here). Offers of such members were clipped to 5 medians instead of 1 for a
young node: the loss went from 0.11 to 0.5-0.7 and stayed; now the young clip is for members
the node has picked too.

Measured on the code before the fixes: ``constant`` and ``young`` fail (92.9% and 0.59,
93.3% and 0.71, against 96.9% and 0.11); ``bias+`` and ``bias-`` did less harm here (a loss
of 0.12-0.13) than on real daemons, and pass either way.

The claims, against the unattacked run of the same seeds in the same test, at the end of the
attack and at the end of the run: every honest node's held-out accuracy within
:data:`TOLERANCE` points of the unattacked swarm's mean, and its held-out loss at most
:data:`LOSS_RATIO` x the unattacked swarm's mean.
"""

from __future__ import annotations

import itertools
import random
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

import pytest
import torch
import trio
from trio.testing import MockClock

from gossip.config import AveragingConfig
from gossip.errors import GossipError
from gossip.node import SwarmNode
from gossip.testing.hostile import HostilePeer, Reaction
from gossip.testing.simnet import SimNetwork
from tests.sim.digits import BATCH, accuracy, digits, held_out_loss
from tests.sim.standing_swarm import (IDENTITIES, NODES, RATIO, STEP_TIME, digits_swarm, stand,
                                      standing_peers, with_calm)

STEPS = 200
ATTACK_FROM, ATTACK_UNTIL = 40, 140  # local steps (young: from trust_after to a full history)
TOLERANCE = 1.0  # accuracy points
LOSS_RATIO = 1.5


@dataclass
class Run:
    during: list[tuple[float, float]] = field(default_factory=list)  # (accuracy, loss) a node
    after: list[tuple[float, float]] = field(default_factory=list)
    taken: int = 0  # the key holder's exchanges that committed
    young: list[int] = field(default_factory=list)  # young: histories as the pushes began


def scores(models: list[torch.nn.Module]) -> list[tuple[float, float]]:
    data = digits()
    return [(accuracy(m, data), held_out_loss(m, data)) for m in models]


def history(node: SwarmNode) -> int:
    """The distances in the node's state history (its young window lasts until it is full)."""
    return len(node._averaging._histories[0])


async def train_swarm(seed: int, attack: str | None) -> Run:
    net = SimNetwork(seed=seed, latency=0.005)
    rng, run = random.Random(seed), Run()
    averaging = AveragingConfig()
    young = attack == "young"
    async with AsyncExitStack() as stack:
        nodes, trainers = await digits_swarm(stack, net, seed, NODES, STEPS, rng)
        schema = nodes[0].replica.schema
        bias = schema.places()["2.bias"].start  # an output bias
        fixed = torch.randn(schema.numel, generator=torch.Generator().manual_seed(seed))
        fixed /= torch.linalg.vector_norm(fixed)
        constant: list[torch.Tensor] = []  # the constant attack's vector, once it is made
        attacking, stopped = trio.Event(), trio.Event()

        async def train(i: int) -> None:
            trainer, node = trainers[i], nodes[i]
            while trainer.done < trainer.steps:
                trainer.step()
                node.step(samples=BATCH)
                if i == 0 and trainer.done == ATTACK_FROM:
                    attacking.set()
                if i == 0 and trainer.done == ATTACK_UNTIL:
                    stopped.set()
                    for other in nodes:
                        other.apply_pending()
                    run.during = scores([t.model for t in trainers])
                await trio.sleep(STEP_TIME)

        def poison(own: torch.Tensor, estimate: torch.Tensor) -> tuple[torch.Tensor,
                                                                        torch.Tensor]:
            if young:  # the estimate honest: the state is the poison
                return own + RATIO * float(torch.linalg.vector_norm(own)) * fixed, estimate
            size = max(float(torch.linalg.vector_norm(estimate)), 1e-3)
            if attack == "constant":
                if not constant:
                    constant.append(RATIO * size * fixed)
                return own, constant[0]
            poisoned = estimate.clone()
            poisoned[bias] += (RATIO if attack == "bias+" else -RATIO) * size
            return own, poisoned

        async def push(peer: HostilePeer, address: str) -> Reaction:
            own = peer.seen.get(address)
            estimate = peer.seen_estimate.get(address)
            if own is None or estimate is None and not young:  # nothing to poison yet: learn
                return (await peer.send_noise(address, 0.0)).reaction
            if estimate is None:  # the node swapped no estimate with us: zeros after the state
                estimate = torch.zeros_like(own)
            peer.honest, estimate = poison(own, estimate)
            return (await peer.send_correction(address, estimate)).reaction

        async def attacker() -> None:
            peers = standing_peers(net, schema, seed, IDENTITIES)
            # to a running swarm, or (young) to nodes in their first second
            await trio.sleep(0.5 if young else averaging.trust_after)
            await stand(peers, nodes)
            if young:  # they stand once trust_after has passed, the nodes' histories short
                await trio.sleep(averaging.trust_after + 1.0)
                run.young = [history(node) for node in nodes]
            else:
                await attacking.wait()  # they stand by now (trust_after is 10 steps)
            for peer in itertools.cycle(peers):
                if stopped.is_set() or young and all(
                        history(node) >= averaging.clip_window for node in nodes):
                    return
                try:
                    reaction = await push(peer, rng.choice(nodes).address)
                except GossipError:
                    reaction = None
                run.taken += reaction is Reaction.ACCEPTED
                await trio.sleep(0.05)

        async with trio.open_nursery() as nursery:
            if attack is not None:
                nursery.start_soon(attacker)
            async with trio.open_nursery() as training:
                for i in range(NODES):
                    training.start_soon(train, i)
        for node in nodes:
            node.apply_pending()
        run.after = scores([t.model for t in trainers])
    return run


CALM: dict[int, Run] = {}  # the unattacked run by seed: the same for every attack


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.mark.slow
@pytest.mark.parametrize("attack", ["constant", "bias+", "bias-", "young"])
async def test_poisoned_payloads_leave_accuracy_and_loss(autojump_clock: MockClock,
                                                         attack: str) -> None:
    calm, attacked = await with_calm(train_swarm, CALM, 2, attack)
    show = lambda s: [(round(a, 2), round(l, 3)) for a, l in s]  # noqa: E731
    print(f"\nunattacked: during {show(calm.during)} after {show(calm.after)}"
          f"\n{attack}: during {show(attacked.during)} after {show(attacked.after)} "
          f"exchanges taken {attacked.taken}"
          + (f", histories as they began {attacked.young}" if attacked.young else ""))
    assert attacked.taken > 20  # the key holder's exchanges really were taken
    if attack == "young":  # its offers came while every node was young
        assert attacked.young and max(attacked.young) < AveragingConfig().clip_window
    for when, ours, theirs in (("during", attacked.during, calm.during),
                               ("after", attacked.after, calm.after)):
        unattacked_accuracy = mean([a for a, _ in theirs])
        unattacked_loss = mean([l for _, l in theirs])
        for mine, loss in ours:
            assert mine >= unattacked_accuracy - TOLERANCE, (when, ours, theirs)
            assert loss <= LOSS_RATIO * unattacked_loss, (when, ours, theirs)
