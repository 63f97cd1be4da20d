"""Chaos: six real daemons behind fault proxies; kill -9 and restart, a 3|3 partition,
delayed links and occasional resets, all from one seed. What must hold is checked on every
node: restarts resume from a valid checkpoint, survivors never crash or stall, every
checkpoint ever written reads back, and the swarm still learns and agrees.

Each daemon has its own loopback address and dials from it, and advertises its proxy's
address (same IP, another port): every byte and datagram to a daemon crosses its proxy, and
the proxy knows the sender by source address, which is how a partition is expressed (each
proxy blocks the other side's addresses).
"""

from __future__ import annotations

import math
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from daemon.checkpoint import load
from daemon.task import Context
from daemon.tasks import digits
from daemon.testing import Daemon, free_port, wait_for
from gossip.testing import ProxyClient

SEED = 6
NODES = 6
CHAOS = 60.0  # s of kills (about 13), restarts and faults, the partition among them
KILL_EVERY = (3.0, 6.0)  # s between kills, uniform
MAX_DOWN = 3  # nodes down or restarting at once: a restart takes 10-30 s on two busy cores
PARTITION_AT, PARTITION_FOR = 15.0, 20.0  # s into the chaos, s
STALL = 15.0  # s: a daemon up this long must have trained in that time
SETTLE = 10  # committed exchanges per node after the faults are cleared, before stopping
# Each node's final evaluation loss must be below this fraction of the untrained model's on
# the same test split (digits: about 2.3; a swarm that learns ends near 0.1).
LOSS_MARGIN = 0.2
# Spread: each model's distance from the mean, relative to the mean's norm. Independent
# training from one initialization for the same time drifts by tens of percent; averaging
# every half second keeps a quiet swarm within a few parts in ten thousand.
SPREAD = 0.01
SETTINGS = [
    "checkpoint.interval=2",
    "checkpoint.keep=2",
    "task.progress_interval=2",
    "timeouts.connect=2",
    "timeouts.handshake=2",
    # Each daemon is dialed through its proxy, which hides the dialer's source address, and a
    # dial-back goes to the source address: the daemons are reachable, so they say so.
    "node.reachable=true",
]


def loopback_addresses(rng: random.Random) -> list[str]:
    """Six addresses of their own in 127/8 (Linux routes all of it to the loopback)."""
    block = rng.randrange(1, 250)
    return [f"127.{block}.{rng.randrange(1, 250)}.{10 + i}" for i in range(NODES)]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_swarm_survives_kills_partitions_and_bad_links(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    ips = loopback_addresses(rng)
    key = bytes(rng.getrandbits(8) for _ in range(32))
    tried: dict[str, int] = {"kill -9 + restart": 0, "3|3 partition": 0}
    with ProxyClient.spawn(seed=SEED) as proxy:
        ports = [free_port(ip) for ip in ips]
        fronts = [proxy.create(f"n{i}", listen=f"{ip}:0", upstream=f"{ip}:{ports[i]}")
                  for i, ip in enumerate(ips)]
        daemons = [Daemon(tmp_path / f"n{i}", f"n{i}", key, swarm="chaos",
                          bootstrap=[] if i == 0 else [fronts[0]], listen=f"{ip}:{ports[i]}",
                          advertise=fronts[i], dial_from=ip, settings=SETTINGS)
                   for i, ip in enumerate(ips)]
        others = {i: [f for j, f in enumerate(fronts) if j != i] for i in range(NODES)}
        try:
            run_chaos(rng, proxy, daemons, ips, others, tried)
        finally:
            for d in daemons:
                d.stop()

    # ---- what must hold -----------------------------------------------------------------
    report(daemons, tried)


def run_chaos(rng: random.Random, proxy: ProxyClient, daemons: list[Daemon], ips: list[str],
              others: dict[int, list[str]], tried: dict[str, int]) -> None:
    first = daemons[0].start()
    wait_for(lambda: first.last("start"), 120, [first], "n0 to start")
    for d in daemons[1:]:
        d.start()
    wait_for(lambda: all(d.of("checkpoint") and d.committed() for d in daemons), 240, daemons,
             "every node to checkpoint and commit an exchange")
    for i in range(NODES):
        proxy.faults(f"n{i}", delay=0.01, jitter=0.01, reset_probability=0.02)

    runs = {i: 0 for i in range(NODES)}  # restarts so far
    seen = {i: (time.monotonic(), daemons[i].own_steps(), (0, True)) for i in range(NODES)}
    scheduled = {i: daemons[i].progress()[:2] for i in range(NODES)}  # (runs started, step)
    start = time.monotonic()
    next_kill = start + rng.uniform(*KILL_EVERY)
    partitioned = healed = False
    while (now := time.monotonic()) < start + CHAOS:
        if not partitioned and now >= start + PARTITION_AT:
            left, right = ips[:3], ips[3:]
            for i in range(NODES):
                proxy.faults(f"n{i}", block=right if i < 3 else left)
            partitioned = True
            tried["3|3 partition"] += 1
        if partitioned and not healed and now >= start + PARTITION_AT + PARTITION_FOR:
            for i in range(NODES):
                proxy.faults(f"n{i}", block=[])
            healed = True
        if now >= next_kill:
            up = [i for i in range(NODES) if len(daemons[i].of("start")) == runs[i] + 1]
            if up and NODES - len(up) < MAX_DOWN:
                i = rng.choice(up)
                daemons[i].kill9()
                daemons[i].start(f"swarm.bootstrap={others[i]!r}".replace("'", '"'))
                runs[i] += 1
                tried["kill -9 + restart"] += 1
            next_kill = now + rng.uniform(*KILL_EVERY)
        for i, d in enumerate(daemons):
            # Survivors: every daemon is running (a killed one is restarted at once), and one
            # that has been up (same run, started) for STALL seconds has trained since: its
            # own steps, not the swarm's step, which a node ahead of the swarm holds (after
            # the partition, the side that trained faster holds it while the other catches
            # up), and which never goes back within a run (a restart resumes its last
            # checkpoint's).
            assert d.running, f"{d.name} died:\n{d.text()[-3000:]}"
            t0, own0, key0 = seen[i]
            started, step, own = d.progress()  # one look: the three belong together
            key = (runs[i], started == runs[i] + 1)
            if key != key0 or own > own0:
                seen[i] = (now, own, key)
            elif key[1] and now - t0 > STALL:
                raise AssertionError(f"{d.name} stalled at {own0} own steps for "
                                     f"{now - t0:.0f} s:\n{d.text()[-3000:]}")
            if started == scheduled[i][0]:
                assert step >= scheduled[i][1], f"{d.name}'s step went back:\n{d.text()[-3000:]}"
            scheduled[i] = (started, step)
        time.sleep(0.2)

    for i in range(NODES):
        proxy.clear(f"n{i}")
    marks = {d.name: len(d.events) for d in daemons}
    wait_for(lambda: all(len(d.of("start")) == runs[i] + 1 for i, d in enumerate(daemons)),
             120, daemons, "every restarted node to start")
    wait_for(lambda: all(d.committed(marks[d.name]) >= SETTLE for d in daemons), 180, daemons,
             f"{SETTLE} exchanges per node once the faults are cleared")
    for d in daemons:  # all at once: the final checkpoints are taken at about one moment
        d.signal(signal.SIGTERM)
    for d in daemons:
        assert d.wait_exit() == 0, f"{d.name} did not stop cleanly:\n{d.text()[-3000:]}"


def report(daemons: list[Daemon], tried: dict[str, int]) -> None:
    for d in daemons:
        starts = d.of("start")
        for restart in starts[1:]:
            assert restart["resumed"], f"{d.name} restarted without a checkpoint: {restart}"
        assert "set aside" not in d.text() and "corrupt" not in d.text().lower(), d.name
    # Every checkpoint on disk reads back (load verifies every byte before torch.load).
    states = []
    for d in daemons:
        files = d.checkpoints()
        assert files, f"{d.name} has no checkpoint"
        for path in files:
            load(path)
        states.append(load(files[-1])["model"])
    flat = [torch.cat([t.flatten().double() for t in s.values() if t.is_floating_point()])
            for s in states]
    mean = torch.stack(flat).mean(0)
    spread = max(float((f - mean).norm() / mean.norm()) for f in flat)
    # The reference is the model every node starts from, evaluated as the daemons evaluate
    # theirs (the first progress line's loss would depend on how fast the machine trained
    # before it).
    initial = digits.task(Context(seed=daemons[0].config.task.seed,
                                  device=torch.device("cpu"))).evaluate()["loss"]
    finals = [d.last("eval")["loss"] for d in daemons]
    print(f"\nchaos: {tried}; restarts resumed from checkpoints: "
          f"{sum(len(d.of('start')) - 1 for d in daemons)}")
    print(f"loss: untrained {initial:.3f}, final per node "
          f"{', '.join(f'{x:.3f}' for x in finals)}; spread {spread:.4f} (bound {SPREAD})")
    assert spread < SPREAD
    assert all(math.isfinite(x) and x < LOSS_MARGIN * initial for x in finals), finals
