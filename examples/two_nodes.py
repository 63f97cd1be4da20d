"""Two nodes on 127.0.0.1: a secure handshake, then one exchange and average of model state.

This is what every averaging step of gossipd does underneath: node A dials node B, both prove
they hold the swarm key and who they are, each sends its model's state while receiving the
other's, and each moves its weights halfway towards the peer's. An outsider without the
swarm key is turned away at the first message.

Run it with `make demo`, or: python examples/two_nodes.py [--codec fp32|bf16|fp16]
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch
import trio

from gossip import tensors
from gossip.channel import SecureChannel, connect, serve
from gossip.errors import GossipError
from gossip.handshake import PROTOCOL_NAME, Swarm
from gossip.identity import Identity
from gossip.network import TcpNetwork
from gossip.transfer import receive_state, send_state


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(784, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 256), torch.nn.BatchNorm1d(256), torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )


class Node:
    def __init__(self, name: str, seed: int, swarm: Swarm) -> None:
        self.name = name
        self.identity = Identity.generate()
        self.swarm = swarm
        self.model = make_model(seed)
        self.schema = tensors.StateSchema.from_module(self.model)

    async def exchange(self, channel: SecureChannel, codec: str) -> float:
        """Send our state while receiving the peer's; add half the difference. Returns seconds."""
        start = time.perf_counter()
        mine = tensors.snapshot(self.model, self.schema)
        received = {}

        async def receive() -> None:
            received["header"], received["state"] = await receive_state(channel, self.schema, codec)

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(receive)
                await send_state(channel, mine, self.schema, codec, step=100, samples=6400)
        delta = received["state"].sub_(mine).mul_(0.5)  # w * (s_peer - s), w = 1/2
        tensors.add_(self.model, self.schema, delta)
        return time.perf_counter() - start


def distance(a: Node, b: Node) -> float:
    return tensors.norm(tensors.snapshot(a.model, a.schema) - tensors.snapshot(b.model, b.schema))


async def main(codec: str) -> None:
    net = TcpNetwork()
    swarm = Swarm.generate("demo")
    a, b = Node("A", 1, swarm), Node("B", 2, swarm)
    size = a.schema.encoded_size(codec)
    print("gossipd demo: two nodes on 127.0.0.1, one secure exchange of model state\n")
    print(f"model   {a.schema.numel:,} float parameters and buffers, schema {a.schema.fingerprint_hex}")
    print(f"        {size / 1e6:.2f} MB per state in {codec}")
    before = distance(a, b)
    done = trio.Event()
    timings = {}

    async def on_channel(channel: SecureChannel) -> None:
        timings["B"] = await b.exchange(channel, codec)
        done.set()

    async with trio.open_nursery() as nursery:
        address = await nursery.start(partial(serve, net, "127.0.0.1:0", on_channel,
                                              identity=b.identity, swarm=swarm))
        print(f"node B  {b.identity.peer_id}  listening on {address}")
        print(f"node A  {a.identity.peer_id}  dialing {address}\n")

        t0 = time.perf_counter()
        channel = await connect(net, address, identity=a.identity, swarm=swarm)
        print(f"handshake  {(time.perf_counter() - t0) * 1e3:.1f} ms  {PROTOCOL_NAME.decode()}")
        print(f"           A authenticated B as {channel.peer.short}…; identity bound by Ed25519 signature")
        async with channel:
            timings["A"] = await a.exchange(channel, codec)
            await done.wait()
            stats = channel.statistics()
        print(f"exchange   A {timings['A'] * 1e3:.1f} ms, B {timings['B'] * 1e3:.1f} ms; "
              f"{stats.bytes_sent / 1e6:.2f} MB sent and {stats.bytes_received / 1e6:.2f} MB received "
              f"by A in {stats.records_sent} + {stats.records_received} encrypted records")
        print(f"distance   between the two models: {before:.4f} before, {distance(a, b):.2e} after averaging")

        outsider = Swarm("demo", bytes(32))
        try:
            await connect(net, address, identity=Identity.generate(), swarm=outsider)
            print("outsider   connected?! this should not happen")
        except GossipError as exc:
            print(f"outsider   without the swarm key: refused ({type(exc).__name__}: {exc})")
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codec", choices=tensors.CODECS, default="fp32")
    trio.run(main, parser.parse_args().codec)
