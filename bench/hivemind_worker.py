"""hivemind's side of ``bench/averaging.py --hivemind PYTHON``: one peer of a two-peer
``DecentralizedAverager`` averaging the bench's model, run by PYTHON, the interpreter of a
separate environment with hivemind installed.

hivemind pins old versions of the libraries the project uses, so it never enters the
project's environment, and this file imports nothing from the project (nor from ``bench/``):
it is run by the other interpreter, and talks to the bench only through JSON lines on
stdin/stdout, which the bench's parent process relays, as it does for its own workers.

Two of these run, *ha* and *hb*. Each builds the bench's model (``--numel`` float32 values in
``--parts`` equal tensors, random, seeded 1 on *ha* and 2 on *hb*, as the bench's workers
seed theirs), a ``hivemind.DHT`` on 127.0.0.1 (*hb*'s bootstraps from *ha*'s visible
multiaddrs) and an averager over the model's tensors in groups of exactly two, hivemind's
default uncompressed fp32 all-reduce. The bench's worker *a* drives: at its set-up it sends
*ha* ``hivemind set up``, and for each trial of the method ``hivemind``, in its turn in the
bench's rounds, one ``hivemind`` message. *ha* then has *hb* start its step
(``averager.step(wait=False)``, so *hb* is already looking for a group, as the bench's
responder is already listening) and times its own ``averager.step()``, from the call to the
return: matchmaking through the DHT, the all-reduce and the update of the tensors in place,
what a hivemind user waits for in one averaging round. It waits for *hb*'s step to end too,
then reports to *a*.

CPU time is that of the peer's whole process tree, which is where hivemind's work runs: the
script, the DHT's process, the averager's process and the ``p2pd`` daemon (user + system, all
threads, from ``/proc``; 10 ms ticks). *ha*'s covers its step call; *hb*'s its step call
from before *ha*'s started to its return.

Usage (by the bench only): PYTHON bench/hivemind_worker.py --role ha|hb --numel N --parts P
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

PREFIX = "bench"  # the averagers' group key prefix
STEP_TIMEOUT = 120.0  # s for a step to find its group; a failure ends the bench
ALLREDUCE_TIMEOUT = 120.0  # s for the all-reduce once the group is formed
# hivemind's defaults, spelled out: a step looks for peers for this long unless its group
# fills first (with target_group_size 2 it fills as soon as the peers meet), and a join
# request waits this long for the leader's answer (hivemind asks for less than the former).
MIN_MATCHMAKING_S = 5.0
REQUEST_TIMEOUT = 3.0


class Link:
    """JSON lines to and from the bench's parent, which relays them: ``to`` names the
    receiver (``a``, or the other peer when left out)."""

    def __init__(self) -> None:
        # hivemind's processes (and its p2pd) inherit file descriptor 1; whatever they print
        # must not land in the message stream, so that goes to stderr and the messages keep
        # a private copy of the real stdout.
        self.out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr

    def send(self, op: str, **fields) -> None:
        self.out.write(json.dumps({"op": op, **fields}) + "\n")
        self.out.flush()

    def receive(self, op: str | None = None) -> dict:
        line = sys.stdin.readline()
        if not line:
            raise SystemExit("hivemind worker: the bench is gone")
        message = json.loads(line)
        if op is not None and message["op"] != op:
            raise SystemExit(f"hivemind worker: expected {op!r}, got {message['op']!r}")
        return message

    def result(self, **data) -> None:
        self.out.write(json.dumps({"result": data}) + "\n")
        self.out.flush()


def tree_cpu() -> float:
    """CPU seconds (user + system, all threads) used so far by this process and all of its
    descendants that are alive."""
    ticks = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    spent: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:  # it ended while we looked
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # from field 3, the state, on
        pid = int(name)
        children.setdefault(int(fields[1]), []).append(pid)
        spent[pid] = int(fields[11]) + int(fields[12])  # utime, stime
    total, todo = 0, [os.getpid()]
    while todo:
        pid = todo.pop()
        total += spent.get(pid, 0)
        todo.extend(children.get(pid, ()))
    return total / ticks


def build(role: str, numel: int, parts: int, dht):
    """The peer's model and its averager (started, ready to step)."""
    import torch
    from hivemind.averaging import DecentralizedAverager

    torch.manual_seed(1 if role == "ha" else 2)
    tensors = [torch.randn(numel // parts) for _ in range(parts)]
    return DecentralizedAverager(
        averaged_tensors=tensors, dht=dht, prefix=PREFIX, start=True,
        target_group_size=2, min_group_size=2, min_matchmaking_time=MIN_MATCHMAKING_S,
        request_timeout=REQUEST_TIMEOUT, allreduce_timeout=ALLREDUCE_TIMEOUT,
        allow_state_sharing=False)  # nobody downloads state here: no declarations for it


def step(averager) -> None:
    if averager.step(timeout=STEP_TIMEOUT) is None:
        raise SystemExit("hivemind step failed")


def initiator(link: Link, numel: int, parts: int) -> None:
    """*ha*: set up when *a* asks, then time one step per ``hivemind`` message from *a*."""
    import hivemind
    import torch

    link.receive("hivemind set up")
    started = time.perf_counter()
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    link.send("dht", maddrs=[str(m) for m in dht.get_visible_maddrs()])
    averager = build("ha", numel, parts, dht)
    link.receive("ready")
    link.send("hivemind ready", to="a")
    setup_s = time.perf_counter() - started
    while (message := link.receive())["op"] != "done":
        if message["op"] != "hivemind":
            raise SystemExit(f"hivemind worker: unexpected {message['op']!r}")
        link.send("step")
        link.receive("stepping")
        cpu = tree_cpu()  # first: reading /proc takes a few ms
        start = time.perf_counter()
        step(averager)
        seconds, cpu = time.perf_counter() - start, tree_cpu() - cpu
        other = link.receive("stepped")
        link.send("hivemind done", to="a", seconds=seconds, cpu=cpu, cpu_b=other["cpu"])
    link.send("done")
    link.result(role="ha", hivemind=hivemind.__version__, torch=torch.__version__,
                python=sys.version.split()[0], setup_s=setup_s)
    averager.shutdown()
    dht.shutdown()


def responder(link: Link, numel: int, parts: int) -> None:
    """*hb*: join *ha*'s DHT, then step whenever *ha* says so."""
    import hivemind

    maddrs = link.receive("dht")["maddrs"]
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=maddrs)
    averager = build("hb", numel, parts, dht)
    link.send("ready")
    while (message := link.receive())["op"] != "done":
        if message["op"] != "step":
            raise SystemExit(f"hivemind worker: unexpected {message['op']!r}")
        cpu = tree_cpu()
        control = averager.step(timeout=STEP_TIMEOUT, wait=False)
        link.send("stepping")
        if control.result() is None:
            raise SystemExit("hivemind step failed")
        link.send("stepped", cpu=tree_cpu() - cpu)
    link.result(role="hb")
    averager.shutdown()
    dht.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=["ha", "hb"], required=True)
    parser.add_argument("--numel", type=int, required=True)
    parser.add_argument("--parts", type=int, required=True)
    args = parser.parse_args()
    link = Link()
    import torch

    # One intra-op thread, as the bench's own workers (two processes share the machine).
    torch.set_num_threads(1)
    (initiator if args.role == "ha" else responder)(link, args.numel, args.parts)


if __name__ == "__main__":
    main()
