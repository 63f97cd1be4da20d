"""Gossip averaging in a DistributedDataParallel script: a node of several processes.

Start a node of two processes with torchrun; its first process prints the command that
starts the next node into the same swarm:

    torchrun --standalone --nproc-per-node 2 examples/torchrun_averager.py
    torchrun --standalone --nproc-per-node 2 examples/torchrun_averager.py \\
        --shard 1/2 --key-hex KEY --bootstrap 127.0.0.1:PORT

(``--standalone`` gives each node a rendezvous port of its own, so two fit on one machine.)

This is own_script.py as a torchrun script: a small MLP on the node's shard of scikit-learn's
digits, sorted by label so that each node alone sees half of the classes. Inside a node the
processes train synchronously, as any DDP script does: each takes every N-th sample of the
node's shard, and DDP averages their gradients at every step. Between nodes, gossip averages
the weights. Every process makes a ``gossip.Averager`` with the same arguments; rank 0 runs
the swarm node, the others follow it (each step, they take its weights when an exchange has
changed them), so the processes of a node always hold the same weights. It runs on the CPU
with gloo, or on the GPUs with NCCL when there are enough of them.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import gossip
from gossip.devices import resolve
from own_script import accuracy, arguments, load_digits  # this file's neighbour


def main() -> None:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto",
                        help="auto, cpu or cuda: each process takes GPU LOCAL_RANK (default auto)")
    parser.add_argument("--log-every", type=int, default=100, metavar="STEPS",
                        help="steps between progress lines (default 100)")
    args = parser.parse_args()
    index, count = map(int, args.shard.split("/"))

    # torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous address. "auto": GPU
    # LOCAL_RANK when there is CUDA (an error if there are fewer GPUs than processes), else
    # the CPU; "cpu" or --device would pick otherwise.
    device = resolve(args.device)
    cuda = device.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(device)
    # Every process needs the same key: rank 0 makes one for a new swarm and sends it.
    key = [args.key_hex or (gossip.Swarm.generate("example").key.hex() if rank == 0 else None)]
    dist.broadcast_object_list(key, src=0)
    key_hex = key[0]

    x, y, x_test, y_test = load_digits(index, count)
    shard_size, classes = len(y), sorted(set(y.tolist()))
    x, y = x[rank::world].to(device), y[rank::world].to(device)  # this process's share
    x_test, y_test = x_test.to(device), y_test.to(device)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10)).to(device)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    swarm = gossip.Swarm.from_hex("example", key_hex)
    config = gossip.NodeConfig(
        listen=args.listen, bootstrap=args.bootstrap,
        averaging=gossip.AveragingConfig(every=1))  # a round each step, or when the last ends
    # Every process makes one with the same arguments; it returns once the node is ready
    # and every process holds the node's weights (a joiner's, downloaded from the swarm).
    with gossip.Averager(ddp, swarm, config, optimizer=opt) as avg:
        if avg.speaker:
            print(f"node {avg.node.peer_id.short} at {avg.node.address}, {world} processes, "
                  f"shard {index}/{count} ({shard_size} samples, classes {classes})")
            print(f"start another node with:\n  torchrun --standalone --nproc-per-node {world} "
                  f"{sys.argv[0]} --shard {(index + 1) % count}/{count} --key-hex {key_hex} "
                  f"--bootstrap {avg.node.address}", flush=True)

        generator = torch.Generator().manual_seed(rank)  # each process its own batches
        for step in range(args.steps):
            batch = torch.randint(len(y), (32,), generator=generator).to(device)
            loss = F.cross_entropy(ddp(x[batch]), y[batch])
            opt.zero_grad()
            loss.backward()  # DDP averages the gradients over the node's processes
            opt.step()
            avg.step(samples=len(batch))  # every process: takes the node's weights if changed
            time.sleep(args.step_time)
            if avg.speaker and step % args.log_every == 0:
                print(f"step {step:5d} (swarm's step {avg.global_step:5d}) loss "
                      f"{loss.item():.3f} test accuracy {accuracy(model, x_test, y_test):.2f} "
                      f"exchanges {avg.statistics().committed}", flush=True)

        stats = avg.statistics() if avg.speaker else None
    if stats is not None:
        print(f"done: test accuracy {accuracy(model, x_test, y_test):.2f}, "
              f"{stats.committed} exchanges, {stats.bytes_sent / 1e3:.0f} kB sent")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
