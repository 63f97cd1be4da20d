"""Tests for gossip.nodegroup: real two-process gloo groups on 127.0.0.1.

Each test starts its processes once (importing torch costs a second or so of CPU each) and
checks several things in that run. The processes write what they saw to files; the test
compares them. Every wait on a process has a deadline; nothing sleeps.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from daemon.testing import free_port


DEADLINE = 60.0  # s for a process to start, train a few steps and exit, on a loaded machine

# The checks of one run. Per wrapping (a plain model, whose gradients the group averages,
# and a DDP wrapper, which averages them itself): different initial weights per process,
# made identical by start(); a BatchNorm, AdamW, gradient clipping, a drift correction, and
# deltas queued on the speaker with step moves, all checked bit-identical at every boundary
# (check_every=1). Then a process that changes its weights outside a step. (The speaker
# applies deltas at every boundary here, not as the time its broadcasts take allows.)
TRAIN = r"""
import json, os, sys
import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
from gossip import nodegroup
from gossip.errors import ReplicasDiverged
from gossip.nodegroup import NodeGroup
from gossip.replica import Replica

out = sys.argv[1]
nodegroup.SYNC_SPACING = 0.0  # apply each delta at the next boundary, however long syncs take
dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
seen = {}
for wrap in ("plain", "ddp"):
    torch.manual_seed(rank)  # a different init in each process: start() must fix it
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    torch.save(model.state_dict(), f"{out}/{wrap}-init-{rank}.pt")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    net = nn.parallel.DistributedDataParallel(model) if wrap == "ddp" else model
    group = NodeGroup(net, opt, check_every=1)  # its hooks first, as the Averager makes it
    replica = Replica(model, optimizer=opt)
    group.start(replica)
    torch.save(model.state_dict(), f"{out}/{wrap}-start-{rank}.pt")
    data = torch.Generator().manual_seed(100 + rank)  # each process its own batches
    noise = torch.Generator().manual_seed(7)
    steps, applied = [], 0
    for step in range(12):
        applied += group.boundary() > 0
        if step == 2:  # the first delta's state broadcast: the buffers too, which drift
            torch.save(model.state_dict(), f"{out}/{wrap}-synced-{rank}.pt")
        steps.append(group.global_step)
        if rank == 0 and step % 4 == 1:  # an exchange commits: applied at the next boundary
            delta = replica.buffer()
            delta.normal_(generator=noise)
            replica.queue(delta, scale=0.1, correction=0.5, step_move=5, weight=None,
                          sent_weight=1.0)
        x, y = torch.randn(32, 8, generator=data), torch.randint(0, 3, (32,), generator=data)
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if rank == 0:
            replica.advance(1, 32 * size)
    group.finish()
    stopped_after = None
    if rank:
        stopped_before = group.stopped
        group.boundary()
        stopped_after = [stopped_before, group.stopped]
    # The parameters, not the buffers: each process's BatchNorm statistics follow its own
    # batches between state broadcasts.
    torch.save({"params": {k: p.detach() for k, p in model.named_parameters()},
                "correction": replica.correction_state()}, f"{out}/{wrap}-final-{rank}.pt")
    stats = group.statistics()
    seen[wrap] = {"steps": steps, "applied": applied, "stopped": stopped_after,
                  "syncs": stats.syncs, "checks": stats.checks,
                  "boundaries": stats.boundaries, "reductions": stats.reductions}
    group.close()
    replica.close()

model = nn.Linear(4, 2)
group = NodeGroup(model, torch.optim.SGD(model.parameters(), lr=0.1), check_every=1)
group.start(Replica(model))
group.boundary()
if rank == 1:
    with torch.no_grad():
        model.weight[0, 0] += 1e-3  # outside the protocol
try:
    group.boundary()
    seen["diverged"] = None
except ReplicasDiverged as exc:
    seen["diverged"] = str(exc)
group.close()
with open(f"{out}/seen-{rank}.json", "w") as f:
    json.dump(seen, f)
dist.destroy_process_group()
os._exit(0)  # past the interpreter's teardown, where gloo may abort: see EXIT below
"""

# EXIT: a process that averaged gradients over gloo in the backward pass (the group's hook,
# or DDP's: a DDP script without gossip does it too) aborts now and then as its interpreter
# shuts down, after all its work: "terminate called without an active exception". A gloo
# worker thread drops its last work object then, whose thread-local state holds a Python
# object, and releasing it needs the GIL that finalization no longer gives (torch 2.13; see
# pytorch/pytorch#190489). Not what these tests check: their scripts leave with os._exit once
# their results are written.

# The speaker passes boundaries until its collective fails; the follower says when it has
# started, then passes boundaries until it is killed.
KILLED = r"""
import os, sys
import torch, torch.distributed as dist
from gossip.errors import ProcessLost
from gossip.nodegroup import NodeGroup
from gossip.replica import Replica

dist.init_process_group("gloo")
model = torch.nn.Linear(4, 2)
group = NodeGroup(model, torch.optim.SGD(model.parameters(), lr=0.1))
group.start(Replica(model))
print("started", flush=True)
try:
    while True:
        group.boundary()
except ProcessLost as exc:
    print(f"lost: {exc}", flush=True)
try:
    dist.destroy_process_group()
except RuntimeError:  # a group whose other process is gone may refuse to be left
    pass
# As the daemon ends such a process (daemon.processes.exit_now): without the interpreter's
# finalization, where gloo's threads, still holding work for the dead peer, now and then
# abort the process after all was said.
os._exit(0)
"""


def ranks(script: Path, size: int, *args: str, **popen: object) -> list[subprocess.Popen]:
    """``size`` processes running ``script`` as the ranks of one ``torch.distributed`` group
    (the environment ``torchrun`` would give them), rendezvous on a free local port."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(size), "OMP_NUM_THREADS": "1"}
    return [subprocess.Popen([sys.executable, str(script), *args],
                             env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                             **popen)  # type: ignore[call-overload]
            for rank in range(size)]


def finish(procs: list[subprocess.Popen]) -> list[str]:
    """Each process's output, once all have exited (killed if one outlasts the deadline)."""
    try:
        return [p.communicate(timeout=DEADLINE)[0] or "" for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def load(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        equal(a[k], b[k]) if isinstance(a[k], dict) else torch.equal(a[k], b[k]) for k in a)


def test_processes_stay_bit_identical_through_steps_deltas_and_a_finish(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    procs = ranks(script, 2, str(tmp_path), stdout=subprocess.PIPE,
                  stderr=subprocess.STDOUT, text=True)
    outputs = finish(procs)
    assert [p.returncode for p in procs] == [0, 0], outputs
    speaker, follower = (json.loads((tmp_path / f"seen-{r}.json").read_text()) for r in (0, 1))

    for wrap in ("plain", "ddp"):
        init = [load(tmp_path / f"{wrap}-init-{r}.pt") for r in (0, 1)]
        assert not equal(*init)  # different seeds: start() had something to do
        for when in ("start", "synced", "final"):
            assert equal(*(load(tmp_path / f"{wrap}-{when}-{r}.pt") for r in (0, 1))), when
        s, f = speaker[wrap], follower[wrap]
        # Every boundary passed its check; both read the same steps, moved by the deltas.
        assert s["checks"] == f["checks"] == s["boundaries"] == f["boundaries"] == 12
        assert s["steps"] == f["steps"] and s["steps"][-1] == 11 + 3 * 5
        assert s["applied"] == 3 and f["applied"] == 0
        assert s["syncs"] == f["syncs"] == 1 + s["applied"]  # start, then each applied delta
        assert f["stopped"] == [False, True]
        # The group averages a plain model's gradients once per backward; DDP does its own.
        assert s["reductions"] == f["reductions"] == (12 if wrap == "plain" else 0)

    for seen in (speaker, follower):
        assert seen["diverged"] and "different parameters" in seen["diverged"]
    assert "process 1 differs" in follower["diverged"]


def test_a_killed_follower_fails_the_speakers_next_collective(tmp_path: Path) -> None:
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    speaker, follower = procs = ranks(script, 2, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT)
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(follower.stdout, selectors.EVENT_READ)
            assert sel.select(DEADLINE), "the follower did not start"
        assert follower.stdout.readline() == b"started\n"
        follower.send_signal(signal.SIGKILL)
        out = speaker.communicate(timeout=DEADLINE)[0].decode()
    finally:
        finish(procs)
    assert speaker.returncode == 0, out
    assert "lost: " in out and "another process of this node is gone" in out, out


@pytest.mark.parametrize("resumed", [None, 0, 12345])
def test_the_step_boundary_header_travels_as_seven_integers_and_back(resumed: int | None) -> None:
    from gossip.nodegroup import _Header

    header = _Header(flags=3, step=2**40 + 7, since=17, spacing=0.1 + 2**-30, parts=2,
                     resumed=resumed, elements=123_456_789)
    slots = header.encode()
    assert slots.dtype == torch.int64 and slots.shape == (7,)
    assert _Header.decode(slots) == header  # the spacing's float64 bits exactly
    assert _Header.decode(torch.zeros(7, dtype=torch.int64)) == _Header()  # a follower's
