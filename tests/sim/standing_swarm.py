"""A digits swarm and a key holder's identities of standing in it, for the attack tests.

:func:`digits_swarm` opens ``n`` nodes of the digits task (:mod:`tests.sim.digits`) on
label-sorted shards with the default averaging settings (outer step and drift correction on),
each handing its optimizer to the swarm. :func:`standing_peers` makes a key holder's
identities on one host of its own, and :func:`stand` announces each to every node (a
push-pull, as an outbound-only member) and proves it there by one offer, a newcomer's: once
``trust_after`` has passed they are members of every node, their offers taken.
"""

from __future__ import annotations

import random
from contextlib import AsyncExitStack
from typing import Awaitable, Callable, TypeVar

import trio

from gossip.claims import alive_row, sign_alive
from gossip.config import NodeConfig
from gossip.errors import GossipError
from gossip.handshake import PROTOCOL_VERSION
from gossip.identity import Identity
from gossip.node import SwarmNode, open_swarm
from gossip.schema import StateSchema
from gossip.testing.hostile import HostilePeer
from gossip.testing.simnet import SimNetwork
from tests.sim.digits import Trainer, digits, make_model, shards
from tests.util import SWARM

NODES = 4  # honest nodes
STEP_TIME = 1.0  # virtual seconds per local step
RATIO = 30.0  # a push, in norms of what it is added to
IDENTITIES = 4  # the key holder's, on its one host

R = TypeVar("R")


async def with_calm(train: Callable[[int, str | None], Awaitable[R]], calm: dict[int, R],
                    seed: int, attack: str) -> tuple[R, R]:
    """The unattacked run of ``seed`` (made once, kept in ``calm``) and the ``attack``ed one."""
    if seed not in calm:
        calm[seed] = await train(seed, None)
    return calm[seed], await train(seed, attack)


async def digits_swarm(stack: AsyncExitStack, net: SimNetwork, seed: int, n: int,
                       steps: int, rng: random.Random) -> tuple[list[SwarmNode], list[Trainer]]:
    """``n`` ready nodes of the digits task, each on its shard, with ``steps`` to train."""
    nodes: list[SwarmNode] = []
    trainers: list[Trainer] = []
    for i, (x, y) in enumerate(shards(digits(), n)):
        model = make_model(seed)
        trainer = Trainer(model, x, y, steps=steps, seed=seed * 100 + i)
        config = NodeConfig(listen=f"n{i}:7000", bootstrap=[nodes[0].address] if nodes else [])
        nodes.append(await stack.enter_async_context(open_swarm(
            model, SWARM, config, network=net.host(f"n{i}"), optimizer=trainer.optimizer,
            rng=random.Random(rng.getrandbits(64)))))
        trainers.append(trainer)
    with trio.fail_after(60):
        for node in nodes:
            await node.wait_ready()
    return nodes, trainers


def standing_peers(net: SimNetwork, schema: StateSchema, seed: int,
                   count: int) -> list[HostilePeer]:
    """``count`` identities of one key holder, all on its host ``attacker``."""
    return [HostilePeer(SWARM, schema, network=net.host("attacker"),
                        identity=Identity.generate(), correction=True,
                        rng=random.Random(seed + k), patience=10.0, busy_tries=1)
            for k in range(count)]


async def stand(peers: list[HostilePeer], nodes: list[SwarmNode]) -> None:
    """Make each of ``peers`` a member of every node's table (outbound-only) and prove it
    there by one offer, a newcomer's."""
    for k, peer in enumerate(peers):
        # Signed by the identity it is about, as a key holder can for its own identities.
        record = alive_row(sign_alive(peer.identity, 1, f"attacker:{7000 + k}",
                                      PROTOCOL_VERSION, 0, True, reachable=False))
        for node in nodes:
            try:
                await peer.push_pull(node.address, [record])
                await peer.send_noise(node.address, 0.0)
            except GossipError:
                pass
