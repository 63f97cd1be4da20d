"""End to end: nodes cut into pipeline stages, as library scripts and as daemons.

A two-stage node (two processes, as torchrun starts them) and a node of one exchange once,
both idle, and both land on the midpoint of their models: the swarm sees the pipelined node's
whole model. Then daemons: a two-stage node starts a swarm with a node of one, another
two-stage node joins and downloads, its second stage is killed, it stops naming it, and a
restart resumes its checkpoint; then each checkpoint resumes in the other layout. Every wait has a deadline; nothing sleeps to wait.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from daemon.testing import START, DaemonSwarm, free_port, wait_for
from tests.unit.test_nodegroup import DEADLINE, finish, ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

COMMON = r"""
import dataclasses, json, os, sys, threading
import torch
import torch.nn.functional as F
import gossip
from gossip.config import NodeConfig

role, address, key, out = sys.argv[1:5]
swarm = gossip.Swarm.from_hex("test", key)
# trust_after 0: no newcomer rule, which makes a new peer apply nothing at first.
config = NodeConfig(averaging=gossip.AveragingConfig(every=None, interval=None, outer=False,
                                                    trust_after=0.0),
                    membership=gossip.MembershipConfig(leave_timeout=0.2))


def build(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
"""

# The node of one starts the swarm, offers exchanges until one commits, takes its delta,
# saves its weights and waits for the test to close its stdin.
SOLO = COMMON + r"""
model, opt = build(1)
with gossip.Averager(model, swarm, dataclasses.replace(config, listen=address),
                     optimizer=opt) as avg:
    while avg.average_now() is not gossip.Result.COMMITTED:
        pass
    avg.step()
    torch.save(dict(model.named_parameters()), f"{out}/solo.pt")
    print("averaged", flush=True)
    sys.stdin.read()
"""

# Each stage of the two-stage node: idle step boundaries until the speaker has applied the
# exchange's delta; then the speaker saves its whole model.
PAIR = COMMON + r"""
import torch.distributed as dist
dist.init_process_group("gloo")
model, opt = build(0)
pipe = gossip.Pipeline(model, opt, gossip.Stages(loss=F.cross_entropy))
own = dataclasses.replace(config.averaging, start="own")  # its weights, not the swarm's
with gossip.Averager(pipe, swarm, dataclasses.replace(config, averaging=own,
                                                      bootstrap=[address])) as avg:
    applied = 0
    for _ in range(100000):
        applied += avg.step()
        if avg.group.share(applied):
            break
    if avg.speaker:
        avg.group.settle()
        torch.save(dict(model.named_parameters()), f"{out}/pair.pt")
    print(json.dumps({"applied": applied, "speaker": avg.speaker}), flush=True)
pipe.close()
dist.destroy_process_group()
os._exit(0)
"""


def test_a_pipelined_node_and_a_node_of_one_land_on_the_midpoint(tmp_path: Path) -> None:
    (tmp_path / "solo.py").write_text(SOLO)
    (tmp_path / "pair.py").write_text(PAIR)
    address = f"127.0.0.1:{free_port()}"
    key = bytes(range(32)).hex()
    solo = subprocess.Popen([sys.executable, str(tmp_path / "solo.py"), "solo", address, key,
                             str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        pair = ranks(tmp_path / "pair.py", 2, "pair", address, key, str(tmp_path),
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        outputs = finish(pair)
        assert [p.returncode for p in pair] == [0, 0], outputs
        solo_out = solo.communicate("", timeout=DEADLINE)[0]
        assert solo.returncode == 0 and "averaged" in solo_out, solo_out
    finally:
        if solo.poll() is None:
            solo.kill()
            solo.communicate()
    assert [json.loads(out.splitlines()[-1])["applied"] for out in outputs] == [1, 0]
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        models.append(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                          torch.nn.Linear(16, 3)))
    midpoint = {k: (p + q) / 2 for (k, p), q in zip(models[0].named_parameters(),
                                                   models[1].parameters())}
    for name in ("pair", "solo"):
        landed = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        for k, value in midpoint.items():
            torch.testing.assert_close(landed[k], value.detach(), rtol=0, atol=1e-6)


PIPE = ("task.pipeline=2", "checkpoint.interval=2")


def test_pipelined_daemons_train_download_and_restart_after_a_stage_dies(tmp_path: Path) -> None:
    with DaemonSwarm(tmp_path) as swarm:
        a = swarm.add("a", settings=PIPE, shard=0, shards=2).start()
        wait_for(lambda: a.last("start"), START, [a], "a to start")
        b = swarm.add("b", bootstrap=[a], shard=1, shards=2).start()
        wait_for(lambda: a.committed() >= 3 and b.committed() >= 3, START, [a, b],
                 "a and b to exchange")
        # c joins a swarm that has trained: it downloads into its stages.
        c = swarm.add("c", bootstrap=[a], settings=PIPE, shard=1, shards=2).start()
        wait_for(lambda: c.last("download"), START, [a, b, c], "c to download")
        wait_for(lambda: c.committed() >= 3 and c.checkpoints(), START, [a, b, c],
                 "c to exchange and checkpoint")
        for node in (a, c):
            group = node.status()["processes"]
            assert group["count"] == 2 and group["layout"] == "pipeline", group
            assert group["syncs"] >= 2  # the start, and takes of committed exchanges
            assert "ERROR" not in node.text()
        assert "is stage 1 of the node's pipeline" in c.text()

        # SIGKILL to c's second stage: c stops naming it, with no checkpoint of parts lost.
        stages = c.children()
        assert len(stages) == 1, stages
        os.kill(stages[0], signal.SIGKILL)
        assert c.wait_exit(60) == 1
        text = c.text()
        assert "process 1 of this node was killed by SIGKILL" in text
        assert "no final checkpoint" in text
        last = c.last("checkpoint")
        assert last is not None

        # A restart resumes that checkpoint in both stages, and averages again.
        since = len(c.events)
        c.restart()
        wait_for(lambda: c.committed(since) >= 2, START, [a, b, c], "c to resume and average")
        assert f"resuming checkpoint={last['path']}" in c.text()
        assert f"daemon.follower process 1 resuming checkpoint={last['path']}" in c.text()

        # Checkpoints hold the whole model and its optimizer: c's final one (its stages'
        # parts gathered) resumes in one process, and b's (one process) in two stages.
        assert c.stop() == 0 and b.stop() == 0
        finals = {node: node.last("checkpoint")["path"] for node in (b, c)}
        since = {node: len(node.events) for node in (b, c)}
        c.start("task.pipeline=1")
        b.start("task.pipeline=2")
        for node in (b, c):
            wait_for(lambda: node.committed(since[node]) >= 2, START, [a, b, c],
                     f"{node.name} to resume in another layout and average")
            assert f"resuming checkpoint={finals[node]}" in node.text()
        assert b.status()["processes"]["layout"] == "pipeline"
        assert c.status()["processes"] is None
        for node in (a, b, c):
            assert "Traceback" not in node.text()
        assert "ERROR" not in a.text() + b.text()
