"""Three nodes on 127.0.0.1 learn one task together by gossip averaging.

Each node is an ordinary training loop with `gossip.Averager`: it trains on its own data, and
in the background averages its weights with a random peer every half second. Node A starts
the swarm, node B joins it; each sees only half of the classes (non-IID data), so alone
neither could classify the other half. Then node C joins with an untrained model: it
downloads the swarm's weights before its first step. An outsider without the swarm key is
turned away at the first message.

Run it with `make demo`, or: python examples/train_together.py [--steps N] [--codec fp32|bf16|fp16]
"""

from __future__ import annotations

import argparse
import threading
import time

import torch
import trio

import gossip

CLASSES, FEATURES = 10, 32


def make_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ten Gaussian clusters in 32 dimensions: a training and a test split."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(CLASSES, FEATURES, generator=g) * 1.2
    labels = torch.randint(0, CLASSES, (6000,), generator=g)
    points = centres[labels] + torch.randn(6000, FEATURES, generator=g)
    return points[:5000], labels[:5000], points[5000:], labels[5000:]


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, CLASSES))


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item() * 100


def train(name: str, avg: gossip.Averager, model: torch.nn.Module, x: torch.Tensor,
          y: torch.Tensor, steps: int, test: tuple[torch.Tensor, torch.Tensor],
          log: list[str]) -> None:
    """The training loop a user writes: a step, then avg.step(); nothing else changes."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(hash(name) % 2**31)
    for i in range(1, steps + 1):
        batch = torch.randint(0, len(x), (32,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
        opt.zero_grad()
        loss.backward()
        with avg.lock:  # snapshots never straddle an optimizer step
            opt.step()
        avg.step(samples=32)  # adds what the last exchanges queued; never blocks
        time.sleep(0.005)  # the rest of a real step: data loading, logging, ...
        if i % (steps // 4) == 0:
            s = avg.statistics()
            log.append(f"  {name}  step {i:4d}  loss {loss.item():.3f}  test accuracy "
                       f"{accuracy(model, *test):5.1f}%  exchanges {s.committed}")


def main(steps: int, codec: str) -> None:
    torch.set_num_threads(1)
    x, y, tx, ty = make_data()
    swarm = gossip.Swarm.generate("demo")
    config = gossip.AveragingConfig(interval=0.5, codec=codec, download_wait=0.5)
    low, high = y < 5, y >= 5  # A sees classes 0-4, B sees 5-9
    a_model, b_model = make_model(1), make_model(2)
    print("gossipd demo: three nodes on 127.0.0.1 train one model by gossip averaging\n")
    log: list[str] = []
    with gossip.Averager(a_model, swarm, config=config) as a:
        print(f"node A  {a.node.peer_id}  started the swarm at {a.node.address}")
        with gossip.Averager(b_model, swarm, bootstrap=[a.node.address], config=config) as b:
            print(f"node B  {b.node.peer_id}  joined; "
                  f"{'downloaded A' if b.node.downloaded else 'own weights'}")
            print(f"        A trains on classes 0-4 only, B on 5-9 only ({steps} steps each)\n")
            threads = [threading.Thread(target=train, args=(n, avg, m, x[mask], y[mask], steps,
                                                            (tx, ty), log))
                       for n, avg, m, mask in (("A", a, a_model, low), ("B", b, b_model, high))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            print("\n".join(log))
            stats = a.statistics()
            print(f"\naveraging  A: {stats.committed} exchanges committed, "
                  f"{stats.bytes_sent / 1e6:.2f} MB sent, mean {stats.mean_duration * 1e3:.1f} ms "
                  f"each; global step {a.global_step}")

            c_model = make_model(3)
            untrained = accuracy(c_model, tx, ty)
            with gossip.Averager(c_model, swarm, bootstrap=[b.node.address], config=config) as c:
                source = c.node.downloaded
                print(f"node C  {c.node.peer_id}  joined with an untrained model "
                      f"({untrained:.1f}% test accuracy)")
                print(f"        downloaded peer {source.peer.short if source else '?'}'s state "
                      f"at step {source.step if source else '?'}: {accuracy(c_model, tx, ty):.1f}% "
                      f"before its first step")
        trio.run(outsider, a.node.address)


async def outsider(address: str) -> None:
    try:
        await gossip.connect(gossip.TcpNetwork(), address, identity=gossip.Identity.generate(),
                             swarm=gossip.Swarm("demo", bytes(32)))
        print("outsider   connected?! this should not happen")
    except gossip.GossipError as exc:
        print(f"outsider   without the swarm key: refused ({type(exc).__name__})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--codec", choices=("fp32", "bf16", "fp16"), default="fp32")
    args = parser.parse_args()
    main(args.steps, args.codec)
