"""End to end: ``gossip.Averager`` in a node of two processes, averaging with a node of one.

The two-process node is what ``torchrun --nproc-per-node 2`` starts (its environment, without
torchrun's own process): both ranks make an Averager with the same arguments, rank 0 runs the
swarm node and rank 1 follows it. It joins a one-process node over real sockets on 127.0.0.1,
downloads its state, trains until an exchange's delta has reached both of its processes, and
both nodes close cleanly. Every wait has a deadline; nothing sleeps to wait.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from daemon.testing import free_port
from tests.unit.test_nodegroup import DEADLINE, finish, ranks

pytestmark = pytest.mark.slow

# Both nodes: a small classifier on random data of their own, an exchange every step.
COMMON = r"""
import dataclasses, json, os, sys, time
import torch
import torch.nn.functional as F
import gossip
from gossip.config import NodeConfig

STEP_TIME = 0.002  # s a step of a real model would take: leaves the CPU to the other node
role, address, key, out = sys.argv[1:5]
swarm = gossip.Swarm.from_hex("test", key)
# Leaving gossips the departure for up to leave_timeout (2 s), all of it for a node left alone.
config = NodeConfig(averaging=gossip.AveragingConfig(every=1, download_wait=30.0),
                    membership=gossip.MembershipConfig(leave_timeout=0.2))
torch.manual_seed(int(os.environ.get("RANK", "9")))  # different weights: start() evens them
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
data = torch.Generator().manual_seed(100 + int(os.environ.get("RANK", "9")))


def train_step():
    x, y = torch.randn(16, 8, generator=data), torch.randint(0, 3, (16,), generator=data)
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

# The one-process node starts the swarm and trains until the test closes its stdin.
SOLO = COMMON + r"""
import threading
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
with gossip.Averager(model, swarm, dataclasses.replace(config, listen=address),
                     optimizer=opt) as avg:
    while not stop.wait(STEP_TIME):
        train_step()
        avg.step(samples=16)
    print(json.dumps({"committed": avg.statistics().committed}), flush=True)
"""

# Each rank of the two-process node: trains until the speaker has applied an exchange's
# delta (and so broadcast it), then saves its parameters.
PAIR = COMMON + r"""
import torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
steps, applied = [], 0
with gossip.Averager(model, swarm, dataclasses.replace(config, bootstrap=[address]),
                     optimizer=opt, check_every=1) as avg:
    assert avg.speaker == (rank == 0) and avg.group.size == 2
    refused = []  # what only the speaker has
    if not avg.speaker:
        for call in (lambda: avg.node, avg.statistics, avg.average_now):
            try:
                call()
            except gossip.GossipError as exc:
                refused.append(str(exc))
    for _ in range(20000):
        train_step()
        applied += avg.step(samples=16)
        steps.append(avg.global_step)
        if avg.group.share(applied):  # the speaker's count, in both processes
            break
        time.sleep(STEP_TIME)
    committed = avg.statistics().committed if avg.speaker else None
torch.save({k: p.detach() for k, p in model.named_parameters()}, f"{out}/pair-{rank}.pt")
print(json.dumps({"committed": committed, "steps": steps, "refused": refused}), flush=True)
dist.destroy_process_group()
os._exit(0)  # past a teardown where gloo may abort: see EXIT in tests/unit/test_nodegroup.py
"""


def test_a_node_of_two_processes_averages_with_a_node_of_one(tmp_path: Path) -> None:
    (tmp_path / "solo.py").write_text(SOLO)
    (tmp_path / "pair.py").write_text(PAIR)
    address = f"127.0.0.1:{free_port()}"
    key = bytes(range(32)).hex()
    solo = subprocess.Popen([sys.executable, str(tmp_path / "solo.py"), "solo", address, key,
                             str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        # The pair's speaker retries the bootstrap address until the solo node listens.
        pair = ranks(tmp_path / "pair.py", 2, "pair", address, key, str(tmp_path),
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        outputs = finish(pair)
        assert [p.returncode for p in pair] == [0, 0], outputs
        solo_out = solo.communicate("", timeout=DEADLINE)[0]  # closing stdin stops it
        assert solo.returncode == 0, solo_out
    finally:
        if solo.poll() is None:
            solo.kill()
            solo.communicate()
    speaker, follower = (json.loads(out.splitlines()[-1]) for out in outputs)
    assert speaker["committed"] >= 1 and follower["committed"] is None
    assert speaker["refused"] == [] and len(follower["refused"]) == 3
    assert all("only rank 0 runs the swarm node" in text for text in follower["refused"])
    assert json.loads(solo_out.splitlines()[-1])["committed"] >= 1
    # One step for schedules in both processes, and the same weights (checked at every step
    # by the group, here once more as they were saved).
    assert speaker["steps"] == follower["steps"] == sorted(speaker["steps"])
    weights = [torch.load(tmp_path / f"pair-{r}.pt", weights_only=True) for r in (0, 1)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
