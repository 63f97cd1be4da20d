"""A key holder with a fresh identity for every offer, against a training swarm.

Eight honest nodes train the digits task (:mod:`tests.sim.digits`: each node a label-sorted
shard of one or two classes, the learning rate decayed to zero over the run) for
:data:`MINUTES` virtual minutes with the default averaging settings, a local step every
:data:`STEP_TIME` virtual seconds. One attacker, on a host of its own, offers exchanges as
fast as it is answered: each offer under a new identity (no strikes, no quarantine, no
standing), to an honest node picked at random, its payload noise :data:`RATIO` times the
norm of the state that node sent it last (within the 100x norm check, so never refused, and
growing with whatever it did to the node). The same swarm, from the same
seeds, also runs without the attacker, in the same test.

The claims (issue: fresh identities must not poison a model): every honest node's accuracy
ends within :data:`TOLERANCE` points of the unattacked run's (its nodes' mean); no honest node
quarantines another; and no honest model's norm ever goes past the largest an unattacked one
reaches by more than a few percent (the largest is printed: before the attack was bounded, it
went from 30 to 587,225 in 40 offers).
"""

from __future__ import annotations

import os
import random
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

import pytest
import torch
import trio
from trio.testing import MockClock

from gossip import tensors
from gossip.config import NodeConfig
from gossip.node import open_swarm
from gossip.testing.simnet import SimNetwork
from gossip.testing.hostile import HostilePeer, Reaction
from tests.sim.digits import BATCH, Trainer, accuracy, digits, make_model, shards
from tests.util import SWARM

NODES = 8
# The run is 30 virtual minutes (POISONING_MINUTES=30: minutes of CPU for the two
# swarms); the suite runs 3, past the point where the unattacked nodes agree.
MINUTES = float(os.environ.get("POISONING_MINUTES", "3"))
STEP_TIME = 1.0  # virtual seconds per local step
STEPS = int(MINUTES * 60 / STEP_TIME)
RATIO = 30.0  # the poison's norm, in honest norms
TOLERANCE = 1.0  # accuracy points


@dataclass
class Run:
    accuracies: list[float] = field(default_factory=list)
    largest_norm: float = 0.0
    quarantined: int = 0  # honest peers in quarantine at honest nodes, at the end
    newcomers: int = 0  # exchanges the honest nodes committed with a newcomer
    committed: int = 0
    attacks: dict[Reaction, int] = field(default_factory=dict)


async def train_swarm(seed: int, *, attacked: bool) -> Run:
    net = SimNetwork(seed=seed, latency=0.005)
    data, rng, run = digits(), random.Random(seed), Run()
    async with AsyncExitStack() as stack:
        nodes, models = [], []
        for i in range(NODES):
            model = make_model(seed)
            config = NodeConfig(listen=f"n{i}:7000",
                                bootstrap=[nodes[0].address] if nodes else [])
            node = await stack.enter_async_context(open_swarm(
                model, SWARM, config, network=net.host(f"n{i}"),
                rng=random.Random(rng.getrandbits(64))))
            nodes.append(node)
            models.append(model)
        with trio.fail_after(60):
            for node in nodes:
                await node.wait_ready()
        schema = nodes[0].replica.schema

        async def train(i: int, x: torch.Tensor, y: torch.Tensor) -> None:
            trainer = Trainer(models[i], x, y, steps=STEPS, seed=seed * 100 + i)
            while trainer.done < trainer.steps:
                trainer.step()
                nodes[i].step(samples=BATCH)
                flat = tensors.snapshot(models[i], schema)
                run.largest_norm = max(run.largest_norm, tensors.norm(flat))
                await trio.sleep(STEP_TIME)

        async def attack(done: trio.Event) -> None:
            hostile = HostilePeer(SWARM, make_model(seed), network=net.host("attacker"),
                                  rng=random.Random(seed), patience=30.0)
            while not done.is_set():
                hostile.renew()
                outcome = await hostile.send_noise(rng.choice(nodes).address, RATIO)
                run.attacks[outcome.reaction] = run.attacks.get(outcome.reaction, 0) + 1

        done = trio.Event()
        async with trio.open_nursery() as nursery:
            if attacked:
                nursery.start_soon(attack, done)
            async with trio.open_nursery() as trainers:
                for i, (x, y) in enumerate(shards(data, NODES)):
                    trainers.start_soon(train, i, x, y)
            done.set()
        for node, model in zip(nodes, models):
            node.apply_pending()
            run.accuracies.append(accuracy(model, data))
            stats = node.statistics()
            run.quarantined += stats.quarantined
            run.newcomers += stats.newcomers
            run.committed += stats.committed
    return run


@pytest.mark.slow
async def test_fresh_identities_do_not_poison_a_training_swarm(autojump_clock: MockClock) -> None:
    seed = 1
    calm = await train_swarm(seed, attacked=False)
    attacked = await train_swarm(seed, attacked=True)
    print(f"\nunattacked: accuracy {[round(a, 2) for a in calm.accuracies]} largest norm "
          f"{calm.largest_norm:.2f} committed {calm.committed}"
          f"\nattacked:   accuracy {[round(a, 2) for a in attacked.accuracies]} largest norm "
          f"{attacked.largest_norm:.2f} committed {attacked.committed} "
          f"(with newcomers {attacked.newcomers}) attacks "
          f"{ {r.value: n for r, n in attacked.attacks.items()} }")
    assert attacked.attacks.get(Reaction.ACCEPTED, 0) > 100  # the poison really was taken
    # Within a point of the unattacked run, whose nodes agree to about half a point among
    # themselves: which of two offers wins a race is not seeded (trio's scheduling), and the
    # attacker's exchanges change which races happen, not the models.
    unattacked = sum(calm.accuracies) / len(calm.accuracies)
    for mine in attacked.accuracies:
        assert abs(mine - unattacked) <= TOLERANCE, (attacked.accuracies, calm.accuracies)
    assert attacked.quarantined == calm.quarantined == 0
    assert attacked.largest_norm <= 1.05 * calm.largest_norm
