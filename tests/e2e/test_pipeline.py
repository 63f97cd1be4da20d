"""End to end: nodes cut into pipeline stages, as library scripts and as daemons.

A two-stage node (two processes, as torchrun starts them) and a node of one exchange once,
both idle, and both land on the midpoint of their models: the swarm sees the pipelined node's
whole model. Then daemons: a two-stage node joins a node of one and downloads into its
stages, its second stage is killed and it stops naming it; then each node's checkpoint
resumes in the other layout, the two-stage node's in one process and the other's in two
stages, and they average again. Every wait has a deadline; nothing sleeps to wait.
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

pytestmark = pytest.mark.slow

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


def test_pipelined_daemons_download_restart_and_resume_in_any_layout(tmp_path: Path) -> None:
    with DaemonSwarm(tmp_path) as swarm:
        a = swarm.add("a", shard=0, shards=2, settings=("checkpoint.interval=2",)).start()
        wait_for(lambda: a.last("start"), START, [a], "a to start")
        # c joins a swarm that has trained: it downloads into its stages, and averages.
        c = swarm.add("c", bootstrap=[a], settings=PIPE, shard=1, shards=2).start()
        wait_for(lambda: c.last("download"), START, [a, c], "c to download")
        wait_for(lambda: c.committed() >= 3 and c.checkpoints(), START, [a, c],
                 "c to exchange and checkpoint")
        group = c.status()["processes"]
        assert group["count"] == 2 and group["layout"] == "pipeline", group
        assert group["syncs"] >= 2  # the start, and the stages' copies for exchanges
        assert "is stage 1 of the node's pipeline" in c.text() and "ERROR" not in c.text()

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

        # Checkpoints hold the whole model and its optimizer: c's (its stages' parts
        # gathered) resumes in one process, and then a's (one process) in two stages,
        # joining c where it listens now.
        since = len(c.events)
        c.start("task.pipeline=1")
        wait_for(lambda: c.committed(since) >= 2, START, [a, c],
                 "c to resume in one process and average")
        assert f"resuming checkpoint={last['path']}" in c.text()
        assert a.stop() == 0
        final = a.last("checkpoint")["path"]
        since = len(a.events)
        a.start("task.pipeline=2", f'swarm.bootstrap=["{c.address}"]')
        wait_for(lambda: a.committed(since) >= 2, START, [a, c],
                 "a to resume in two stages and average")
        assert f"resuming checkpoint={final}" in a.text()
        assert f"daemon.follower process 1 resuming checkpoint={final}" in a.text()
        assert a.status()["processes"]["layout"] == "pipeline"
        assert c.status()["processes"] is None
        assert "Traceback" not in a.text() + c.text() and "ERROR" not in a.text()
