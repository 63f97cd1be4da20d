"""Gossip averaging in an ordinary PyTorch training loop: one node per process, no daemon.

Start a node; it prints the command that starts the next one into the same swarm:

    python examples/own_script.py
    python examples/own_script.py --shard 1/2 --key-hex KEY --bootstrap 127.0.0.1:PORT

Each node trains a small MLP on its shard of scikit-learn's digits. The shards are cut from
the training set sorted by label, so shard 0/2 sees only the zeros to the fives and, alone,
scores about 50% on the test set's ten classes; averaging with shard 1/2's node, and the
drift correction the node keeps through the optimizer it is given, lift both to 90% and more
while they train together (one that trains on alone drifts back towards its own classes). The
MLP steps in well under a millisecond, quicker than an exchange on most links, so each step
also sleeps --step-time to stand in for a real model.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

import gossip


def load_digits(index: int, count: int) -> tuple[torch.Tensor, ...]:
    """Shard ``index`` of ``count`` of the training set, sorted by label, and the test set."""
    from sklearn.datasets import load_digits  # pip install scikit-learn

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16  # pixels are 0..16
    y = torch.tensor(digits.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, train = order[:len(y) // 5], order[len(y) // 5:]  # the same split everywhere
    train = train[y[train].argsort(stable=True)].tensor_split(count)[index]
    return x[train], y[train], x[test], y[test]


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def arguments(description: str) -> argparse.ArgumentParser:
    """The options of a node (torchrun_averager.py adds its own)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT",
                        help="where this node listens (port 0 picks a free one)")
    parser.add_argument("--bootstrap", action="append", default=[], metavar="HOST:PORT",
                        help="a node of the swarm to join (repeatable); none starts a swarm")
    parser.add_argument("--key-hex", help="the swarm's 32-byte key in hex (a new swarm's "
                        "key is generated and printed when omitted)")
    parser.add_argument("--shard", default="0/2", metavar="INDEX/COUNT",
                        help="this node's part of the training data (default 0/2)")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--step-time", type=float, default=0.01, metavar="SECONDS",
                        help="sleep per step, standing in for a bigger model (default 0.01)")
    return parser


def main() -> None:
    args = arguments(__doc__.splitlines()[0]).parse_args()
    index, count = map(int, args.shard.split("/"))
    key_hex = args.key_hex or gossip.Swarm.generate("example").key.hex()

    x, y, x_test, y_test = load_digits(index, count)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    swarm = gossip.Swarm.from_hex("example", key_hex)
    config = gossip.NodeConfig(
        listen=args.listen, bootstrap=args.bootstrap,
        averaging=gossip.AveragingConfig(every=1))  # a round each step, or when the last ends
    # Returns once the node is ready: a joiner has downloaded the swarm's weights by then.
    # The optimizer is for the drift correction, added to its gradients before each step.
    with gossip.Averager(model, swarm, config, optimizer=opt) as avg:
        print(f"node {avg.node.peer_id.short} at {avg.node.address}, shard {index}/{count} "
              f"({len(y)} samples, classes {sorted(set(y.tolist()))})")
        print(f"start another node with:\n  {sys.executable} {sys.argv[0]} "
              f"--shard {(index + 1) % count}/{count} --key-hex {key_hex} "
              f"--bootstrap {avg.node.address}")

        for step in range(args.steps):
            batch = torch.randint(len(y), (32,))
            loss = F.cross_entropy(model(x[batch]), y[batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
            avg.step(samples=len(batch))  # adds the deltas exchanges queued; never blocks
            time.sleep(args.step_time)
            if step % 100 == 0:
                print(f"step {step:5d} (swarm's step {avg.global_step:5d}) loss "
                      f"{loss.item():.3f} test accuracy {accuracy(model, x_test, y_test):.2f} "
                      f"exchanges {avg.statistics().committed}")

        stats = avg.statistics()
    print(f"done: test accuracy {accuracy(model, x_test, y_test):.2f}, "
          f"{stats.committed} exchanges, {stats.bytes_sent / 1e3:.0f} kB sent")


if __name__ == "__main__":
    main()
