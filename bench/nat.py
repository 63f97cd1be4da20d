"""Outbound-only nodes: a swarm of 2 reachable and 6 NAT'd nodes against 8 reachable ones.

Method: as ``bench/scale.py`` (read its docstring): real ``gossip.open_swarm`` nodes on the
simulated network under ``trio.testing.MockClock``, 1,000 float32 parameters, w_i = m + e_i,
one averaging round per node per INTERVAL virtual seconds on the daemon's jittered timer,
and the same criterion: rounds until the farthest node is within 1e-3 of the mean
(relative). Two swarms per seed, from the same weights:

* ``reachable``: 8 nodes anyone can dial, as bench/scale.py runs them;
* ``nat``: nodes 0 and 1 reachable, nodes 2..7 behind a NAT (``SimNetwork.nat``: dials to
  them hang, datagrams reach them only from addresses they sent to within 30 s). Every node
  runs with ``reachable=None``: it finds out with a dial-back check after joining, as the
  daemon's ``node.reachable = "auto"`` does. The rounds start once every check has run.

In the NAT'd swarm every exchange has a reachable end: the 6 outbound-only nodes can only
pick nodes 0 and 1, and those can only pick each other. What is measured besides rounds:

* ``commit/r``: exchanges a node initiated that committed, per node per round, for each kind
  of node (the target: outbound-only nodes commit >= 90% as many as reachable ones);
* ``busy``: the fraction of offers to a reachable node answered BUSY (it was in another
  exchange), the measure of how loaded the reachable nodes are; the initiator then tries
  another peer after a backoff, so a busy answer costs time, not a round;
* ``load/r``: exchanges a reachable node took part in, initiated or answered, per round;
* ``failed``: initiated exchanges that ended otherwise (expected 0).

Usage: python bench/nat.py [--quick] [--seed S]. The last line is one JSON object with the
headline figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import random
import statistics
import time
from collections import Counter

import trio
import trio.testing

from common import progress, save_json, table
from gossip import Result
from gossip.testing import open_sim_swarm
from scale import (CONFIG, INTERVAL, MAX_ROUNDS, TARGET, initial_weights, node_model,
                   relative_spread, timer, wait_joined, weights)

N = 8
REACHABLE = 2
SEEDS = {"quick": 3, "full": 8}


async def checked(sim, nat: bool) -> None:
    """Return once every node knows whether it can be dialed, and everyone agrees."""
    def done() -> bool:
        for node in sim.nodes:
            roster = node.node.roster
            if nat and node.index and not roster.reachability.checked:
                return False
            if any(m.reachable != (not nat or _index(sim, m.peer) < REACHABLE)
                   for m in roster.alive()):
                return False
        return True
    with trio.fail_after(600):
        await sim.wait_until(done)


def _index(sim, peer) -> int:
    return next(n.index for n in sim.nodes if n.peer_id == peer)


async def run_swarm(w0, seed: int, nat: bool) -> dict:
    config = dataclasses.replace(CONFIG, reachable=None if nat else True)
    async with open_sim_swarm(N, seed=seed, model=lambda i: node_model(w0, i), config=config,
                              nat=range(REACHABLE, N) if nat else ()) as sim:
        await wait_joined(sim)
        await checked(sim, nat)
        start = trio.current_time()
        curve = [relative_spread(weights(sim))]
        async with trio.open_nursery() as nursery:
            for node in sim.nodes:
                nursery.start_soon(timer, node, random.Random(f"{seed}:timer:{node.index}"))
            while curve[-1] > TARGET and len(curve) <= MAX_ROUNDS:
                await trio.sleep_until(start + len(curve) * INTERVAL)
                curve.append(relative_spread(weights(sim)))
            nursery.cancel_scope.cancel()
        rounds = len(curve) - 1
        mine = [e for e in sim.exchanges if e.initiated and e.started >= start]
        reachable = [n for n in sim.nodes if n.index < REACHABLE or not nat]
        outbound = [n for n in sim.nodes if n not in reachable]
        offers = [e for e in mine if e.peer in reachable]
        answered = Counter(e.node for e in sim.exchanges
                           if not e.initiated and e.started >= start
                           and e.result is Result.COMMITTED)

        def committed(nodes) -> float:
            count = sum(1 for e in mine if e.node in nodes and e.result is Result.COMMITTED)
            return count / (len(nodes) * rounds) if nodes else float("nan")

        load = [sum(1 for e in mine if e.node is n and e.result is Result.COMMITTED)
                + answered[n] for n in reachable]
        results = Counter(e.result for e in mine)
        return {
            "rounds": rounds if curve[-1] <= TARGET else MAX_ROUNDS + 1,
            "commit_reachable": committed(reachable),
            "commit_outbound": committed(outbound),
            "busy": sum(1 for e in offers if e.result is Result.BUSY) / max(1, len(offers)),
            "load": statistics.mean(load) / rounds,
            "failed": (len(mine) - results[Result.COMMITTED] - results[Result.BUSY]) / (N * rounds),
            "to_outbound": sum(1 for e in mine if e.peer in outbound),
            "deaths": sum(n.node.roster.statistics().deaths for n in sim.nodes),
            "setup_virtual_s": start,
        }


def measure(seeds: list[int]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {"reachable": [], "nat": []}
    for seed in seeds:
        w0 = initial_weights(N, seed)
        for kind in out:
            wall = time.perf_counter()
            r = trio.run(run_swarm, w0, seed, kind == "nat",
                         clock=trio.testing.MockClock(autojump_threshold=0))
            r["wall_s"] = time.perf_counter() - wall
            out[kind].append(r)
            progress(f"seed {seed} {kind}: {r['rounds']} rounds, commit/r reachable "
                     f"{r['commit_reachable']:.2f} outbound {r['commit_outbound']:.2f}, busy "
                     f"{r['busy']:.3f}, {r['wall_s']:.1f} s wall")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{SEEDS['quick']} seeds")
    parser.add_argument("--seed", type=int, default=1, help="first seed")
    args = parser.parse_args()
    logging.getLogger("gossip").setLevel(logging.ERROR)  # each NAT'd node warns it is one
    started = time.perf_counter()
    seeds = [args.seed + k for k in range(SEEDS["quick" if args.quick else "full"])]
    runs = measure(seeds)

    def mean(kind: str, key: str) -> float:
        return statistics.mean(r[key] for r in runs[kind])

    rows = []
    for kind, label in (("reachable", "8 reachable"), ("nat", "2 reachable + 6 NAT'd")):
        rounds = [r["rounds"] for r in runs[kind]]
        rows.append([label, len(rounds), f"{statistics.median(rounds):g}", max(rounds),
                     f"{mean(kind, 'commit_reachable'):.2f}",
                     "-" if kind == "reachable" else f"{mean(kind, 'commit_outbound'):.2f}",
                     f"{mean(kind, 'busy'):.3f}", f"{mean(kind, 'load'):.2f}",
                     f"{mean(kind, 'failed'):.3f}", sum(r["to_outbound"] for r in runs[kind]),
                     sum(r["deaths"] for r in runs[kind]), f"{mean(kind, 'setup_virtual_s'):.0f}"])
    print(f"Rounds until every node is within {TARGET:g} of the mean, N={N}, seeds from "
          f"{args.seed} (see the docstring for the method).")
    print()
    print(table(["swarm", "seeds", "rounds", "max", "commit/r reach", "commit/r outbound",
                 "busy", "load/r reach", "failed/r", "to outbound", "deaths", "setup vs"], rows))
    print()
    print("commit/r: initiated exchanges that committed, per node per round; busy: offers to "
          "reachable nodes answered BUSY; load/r: exchanges a reachable node took part in per "
          "round; to outbound: exchanges anyone initiated towards an outbound-only node (must be "
          "0); deaths: members declared dead (must be 0); setup vs: virtual s to join and check.")
    ratio = mean("nat", "commit_outbound") / mean("nat", "commit_reachable")
    nat_rounds = statistics.median(r["rounds"] for r in runs["nat"])
    all_rounds = statistics.median(r["rounds"] for r in runs["reachable"])
    print(f"outbound-only nodes commit {ratio:.2f}x as many exchanges as reachable ones "
          f"(target >= 0.9); rounds {nat_rounds:g} vs {all_rounds:g} all reachable.")
    print(f"wall time {time.perf_counter() - started:.1f} s")
    save_json("nat", {"seeds": seeds, "runs": runs})
    print(json.dumps({
        "rounds_nat": nat_rounds, "rounds_reachable": all_rounds,
        "rounds_nat_max": max(r["rounds"] for r in runs["nat"]),
        "outbound_commit_ratio": round(ratio, 3),
        "busy_reachable": round(mean("nat", "busy"), 4),
        "busy_all_reachable": round(mean("reachable", "busy"), 4),
        "load_per_round_reachable": round(mean("nat", "load"), 2),
        "to_outbound": sum(r["to_outbound"] for r in runs["nat"]),
        "false_deaths": sum(r["deaths"] for k in runs for r in runs[k]),
    }))


if __name__ == "__main__":
    main()
