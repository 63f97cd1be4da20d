"""Gossip averaging of a model cut into two pipeline stages: one node, one stage per process.

Start a node of two stages with torchrun; its first process prints the command that starts
the next node into the same swarm (of two stages too, or of one: plain own_script.py
cannot join, its model differs):

    torchrun --standalone --nproc-per-node 2 examples/torchrun_pipeline.py
    torchrun --standalone --nproc-per-node 2 examples/torchrun_pipeline.py \\
        --shard 1/2 --key-hex KEY --bootstrap 127.0.0.1:PORT

The model is an ``nn.Sequential`` MLP on the node's shard of scikit-learn's digits, sorted by
label. Every process builds the whole model on the CPU, then ``gossip.Pipeline`` keeps its
stage (process k: the k-th part, on GPU k with NCCL when there are enough GPUs, else on the
CPU with gloo) and an optimizer of the same class for it. ``pipe.step((x, y))`` runs one
step of the whole node: four micro-batches flow through the stages, forward then back, and
each stage steps its own optimizer. The swarm sees one ordinary model: rank 0 keeps the whole
of it on the host, which its stages write their parts into when an exchange needs it.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import gossip
from gossip.devices import resolve
from own_script import accuracy, arguments, load_digits  # this file's neighbour


def main() -> None:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto",
                        help="auto, cpu or cuda: each stage takes GPU LOCAL_RANK (default auto)")
    parser.add_argument("--log-every", type=int, default=100, metavar="STEPS",
                        help="steps between progress lines (default 100)")
    args = parser.parse_args()
    index, count = map(int, args.shard.split("/"))

    device = resolve(args.device)
    cuda = device.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, stages = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(device)
    key = [args.key_hex or (gossip.Swarm.generate("example").key.hex() if rank == 0 else None)]
    dist.broadcast_object_list(key, src=0)  # every stage needs the same key
    key_hex = key[0]

    x, y, x_test, y_test = load_digits(index, count)  # every stage draws the same batches
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    pipe = gossip.Pipeline(model, opt, gossip.Stages(loss=F.cross_entropy, micro_batches=4),
                           device=device)
    del model, opt  # a stage keeps its own part; rank 0 keeps the whole as pipe.mirror

    swarm = gossip.Swarm.from_hex("example", key_hex)
    config = gossip.NodeConfig(listen=args.listen, bootstrap=args.bootstrap,
                               averaging=gossip.AveragingConfig(every=1))
    with gossip.Averager(pipe, swarm, config) as avg:
        if avg.speaker:
            start, stop = pipe.bounds[0]
            print(f"node {avg.node.peer_id.short} at {avg.node.address}, {stages} stages "
                  f"(stage 0: modules {start}..{stop - 1}), shard {index}/{count}")
            print(f"start another node with:\n  torchrun --standalone --nproc-per-node "
                  f"{stages} {sys.argv[0]} --shard {(index + 1) % count}/{count} "
                  f"--key-hex {key_hex} --bootstrap {avg.node.address}", flush=True)
        generator = torch.Generator().manual_seed(index)  # the same in every stage
        for step in range(args.steps):
            batch = torch.randint(len(y), (32,), generator=generator)
            loss = pipe.step((x[batch], y[batch]))  # every stage, at once
            if avg.speaker and step % args.log_every == 0:
                # The host copy made whole, to evaluate it: between a step and the next
                # boundary (avg.step), where the other stages wait for one.
                avg.group.settle()
                print(f"step {step:5d} (swarm's step {avg.global_step:5d}) loss "
                      f"{float(loss):.3f} test accuracy "
                      f"{accuracy(pipe.mirror, x_test, y_test):.2f} exchanges "
                      f"{avg.statistics().committed}", flush=True)
            avg.step(samples=len(batch))
            time.sleep(args.step_time)
        stats = avg.statistics() if avg.speaker else None
        if avg.speaker:
            avg.group.settle()
    if stats is not None:
        print(f"done: test accuracy {accuracy(pipe.mirror, x_test, y_test):.2f}, "
              f"{stats.committed} exchanges, {stats.bytes_sent / 1e3:.0f} kB sent")
    pipe.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
