"""Should a joiner copy its donor's optimizer state? A measurement, for both bundled tasks.

A swarm of ``NODES`` nodes trains a task on a simulated network (real protocol nodes under
trio's ``MockClock``, the default averaging settings, ``STEP_TIME`` virtual seconds a step) for
``WARM`` steps each; then a joiner with a fresh initialization joins, downloads the state of a
member as every joiner does, and trains on alongside them for ``AFTER`` steps. Two variants
from the same seeds, which differ in one thing only:

* fresh: the joiner's optimizer starts empty (what a daemon does: optimizer state never
  leaves a node);
* copied: once its download is in, the joiner's optimizer takes its donor's state (momentum
  buffers; Adam's moments and step counts), copied in-process, as a state transfer would.

Reported: the joiner's held-out loss after 1, 10, 50 and ``AFTER`` of its steps, and the
members' mean held-out loss at the end (does a joiner disturb the others?). Tasks:
``daemon.tasks.digits`` (SGD with momentum 0.9, label-sorted shards) and
``daemon.tasks.charlm`` (AdamW, a small transformer on disjoint files of text). Means over
``--seeds`` seeds.

Usage: python bench/joiner.py [--seeds 3]
The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from contextlib import AsyncExitStack
from typing import Any

import torch
import trio
import trio.testing

from common import progress, save_json, table
from daemon.task import Context, Shard
from daemon.tasks import charlm, digits
from gossip import AveragingConfig, NodeConfig, Swarm
from gossip.node import SwarmNode, open_swarm
from gossip.testing.simnet import SimNetwork

NODES = 4
STEP_TIME = 0.05  # virtual s per step
WARM = 300  # steps each member takes before the joiner comes
AFTER = 200  # steps the joiner takes
MARKS = (1, 10, 50, AFTER)  # joiner's steps at which its held-out loss is read
TASKS = {"digits (SGD, momentum)": digits.task, "charlm (AdamW)": charlm.task}
CPU = torch.device("cpu")


def run(make: Any, seed: int, copied: bool) -> dict[str, Any]:
    """One swarm with a joiner; returns the joiner's losses at MARKS and the members' mean
    held-out loss at the end."""
    tasks = [make(Context(seed, CPU)) for _ in range(NODES)]
    joiner_task = make(Context(seed + 1000, CPU))  # another initialization: it must download
    batches = [t.batches(Shard(i, NODES + 1)) for i, t in enumerate(tasks)]
    joiner_batches = joiner_task.batches(Shard(NODES, NODES + 1))
    swarm = Swarm("joiner", bytes(range(32)))
    out: dict[str, Any] = {"joiner": {}}

    async def main() -> None:
        net = SimNetwork(seed=seed, latency=0.005)
        config = AveragingConfig(start="own")
        async with AsyncExitStack() as stack:
            nodes: list[SwarmNode] = []
            for i, task in enumerate(tasks):
                node_config = NodeConfig(listen=f"n{i}:7000",
                                         bootstrap=[nodes[0].address] if nodes else [],
                                         averaging=config)
                nodes.append(await stack.enter_async_context(open_swarm(
                    task.model, swarm, node_config, network=net.host(f"n{i}"),
                    optimizer=task.optimizer, rng=random.Random(f"{seed}:{i}"))))

            async def member(i: int, steps: int) -> None:
                for _ in range(steps):
                    tasks[i].step(next(batches[i]))
                    nodes[i].step()
                    await trio.sleep(STEP_TIME)

            async with trio.open_nursery() as warmup:
                for i in range(NODES):
                    warmup.start_soon(member, i, WARM)
            joiner_config = NodeConfig(listen="joiner:7000", bootstrap=[nodes[0].address],
                                       averaging=AveragingConfig(start="download"))
            joiner = await stack.enter_async_context(open_swarm(
                joiner_task.model, swarm, joiner_config, network=net.host("joiner"),
                optimizer=joiner_task.optimizer, rng=random.Random(f"{seed}:j")))
            await joiner.wait_ready()
            assert joiner.downloaded is not None
            if copied:
                donor = next(i for i, n in enumerate(nodes) if n.peer_id == joiner.downloaded.peer)
                joiner_task.optimizer.load_state_dict(tasks[donor].optimizer.state_dict())

            async def join() -> None:
                for step in range(1, AFTER + 1):
                    joiner_task.step(next(joiner_batches))
                    joiner.step()
                    if step in MARKS:
                        out["joiner"][step] = joiner_task.evaluate()["loss"]
                    await trio.sleep(STEP_TIME)

            async with trio.open_nursery() as later:
                for i in range(NODES):
                    later.start_soon(member, i, AFTER)
                later.start_soon(join)
            out["members"] = sum(t.evaluate()["loss"] for t in tasks) / NODES

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    rows, figures = [], {}
    for name, make in TASKS.items():
        for copied in (False, True):
            runs = []
            for seed in range(1, args.seeds + 1):
                runs.append(run(make, seed, copied))
                progress(f"[{time.perf_counter() - started:5.0f}s] {name} "
                         f"{'copied' if copied else 'fresh'} seed {seed}: joiner "
                         f"{runs[-1]['joiner'][AFTER]:.4f}")
            joiner = {m: sum(r["joiner"][m] for r in runs) / len(runs) for m in MARKS}
            members = sum(r["members"] for r in runs) / len(runs)
            variant = "copied" if copied else "fresh"
            figures[f"{name.split()[0]}_{variant}"] = {
                "joiner_loss": {str(m): round(v, 4) for m, v in joiner.items()},
                "members_loss": round(members, 4)}
            rows.append([name, variant, *(f"{joiner[m]:.4f}" for m in MARKS), f"{members:.4f}"])
    print(f"\n{NODES} members train {WARM} steps, then a joiner downloads a member's state and "
          f"trains {AFTER} steps beside them; held-out loss, mean of {args.seeds} seeds")
    print(table(["task", "joiner's optimizer", *(f"joiner after {m}" for m in MARKS),
                 "members at the end"], rows))
    print(f"wall time {time.perf_counter() - started:.0f} s")
    save_json("joiner", {"figures": figures, "seeds": args.seeds, "nodes": NODES,
                         "warm_steps": WARM, "after_steps": AFTER})
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
