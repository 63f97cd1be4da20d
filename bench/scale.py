"""Rounds to consensus against swarm size: real nodes, simulated network, virtual time.

Method: per swarm size N, ``gossip.testing.open_sim_swarm`` runs N real ``gossip.open_swarm``
nodes (SWIM membership, Noise channels, the averaging protocol, exchanges at weight 1/2) on
an in-memory ``SimNetwork`` (1 ms one-way latency, no loss, unlimited bandwidth) under
``trio.testing.MockClock(autojump_threshold=0)``: every delay is virtual, and the wall time
is only the CPU work of N nodes in one process.

* Model: 1,000 float32 parameters (``torch.nn.Linear(39, 25)``); the point is rounds, not
  bytes. Initial weights: a common mean vector m ~ N(0, I), the same for every node, plus
  independent noise e_i ~ N(0, I) per node: w_i = m + e_i, so that the initial relative
  spread ||w_i - mean|| / ||mean|| is about 1 (about 1.1 for the farthest node).
* Membership first: the nodes join through node 0 (membership's LAN profile, as a daemon
  runs it) and the bench waits until every node sees every other alive and ready (no
  exchange happens before: ``every=None, interval=None``).
* Round: one averaging interval (INTERVAL virtual seconds). Each node runs the daemon's
  timer, as ``Averaging.run`` does: its first round at a uniform random instant in the first
  interval, then ``average_now()`` (up to 3 peers tried, a randomized backoff after a BUSY or
  a failure) followed by a pause of INTERVAL x U(0.75, 1.25). So in one round every node
  initiates about one exchange with a uniformly random peer, and answers about one. Every
  exchange is a full protocol exchange: dial, Noise handshake, Offer/Accept, both payloads,
  the checks, the Commit round trip; the deltas are added as each exchange ends.
* Criterion: after round r (at virtual time r x INTERVAL from the start of averaging), the
  largest relative distance of a node from the swarm's mean, max_i ||w_i - w_bar|| /
  ||w_bar||, is at most 1e-3. Reported: the first such r (median and max over seeds).
* Exchanges per node per round, as their initiators saw them: committed, busy (the peer was
  in another exchange; the initiator tries another), failed (anything else, expected 0).
  ``drift``: ||w_bar - w_bar(0)|| / ||w_bar(0)|| after the last round. Pairwise averaging at
  weight 1/2 keeps the mean; an exchange applied at one end only would move it for good
  (one in flight at the last round, committed at one end and not yet at the other, moves it
  by about its distance / 2N, below 1e-3 / 2N by then).

Theory, for comparison (printed with the measurement):

* Random perfect matching (every node in exactly one pairwise average per round): the
  variance of the w_i halves per round, so the RMS distance shrinks by 1/sqrt(2) per round
  and 1e-3 takes log2(1e6) = 19.9, about 20 rounds; about one more for the farthest node
  rather than the RMS: the issue's ~21, independent of N.
* Asynchronous pairwise gossip (what the daemon's timer approximates): each of N exchanges
  per round averages a uniformly random pair, which removes (w_i - w_j)^2 / 2 from the sum of
  squared distances to the mean, 1/N of it on average; N of them shrink it by
  (1 - 1/N)^N = e^-1, i.e. the RMS by e^-1/2 per round: 2 ln(1e3) = 13.8, about 14 rounds to
  1e-3 in RMS. Nodes left out of a round by chance (about e^-2 of them, as the number of
  exchanges a node takes part in is about Poisson(2)) make the farthest node lag, more so
  as N grows; an exchange refused as BUSY and not retried would slow it down further.
* Exact models, run numerically per N and seed from the same weights (no network, instant
  exchanges, max over nodes as above): ``matching`` (n/2 disjoint random pairs a round),
  ``random`` (n exchanges a round, each a uniformly random node with a uniformly random other:
  the textbook asynchronous model) and ``timer`` (each node once a round, in random order,
  with a uniformly random other: the daemon's timer without BUSY or overlap).

Cost: the wall time is CPU time, quadratic in N twice over. The join: every node must hear
of every other (N^2 records, each gossiped several times). The rounds: an exchange costs some
5 ms of CPU (the handshake's X25519 and Ed25519, trio's scheduling of a dozen messages), and
picking its peer lists the node's whole table, O(N). On the 2-core machine this was written
on, N = 256 took about 12 s to join and 18 s for its rounds, N = 512 about 85 s and 55 s,
so 1024 takes several minutes: ``--quick`` (what ``make bench`` runs) stops at 256, with
fewer seeds (see SEEDS); the default goes to 1024.

Usage: python bench/scale.py [--quick] [--seed S]
Progress goes to stderr; the table to stdout; the last line printed is one JSON object with
the headline figures. Results: bench/results/scale.json and scale.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import time
from collections import Counter

import torch
import trio
import trio.testing

from common import progress, pyplot, save_figure, save_json, table
from gossip import AveragingConfig, MembershipConfig, NodeConfig, Result
from gossip.testing import open_sim_swarm

TARGET = 1e-3  # relative distance of the farthest node from the mean
PARAMS = 1000  # float32 parameters: Linear(39, 25) has 39 * 25 + 25
INTERVAL = 1.0  # virtual s: one round, the mean time between a node's rounds
MAX_ROUNDS = 60  # a swarm that has not converged by then is reported as such
JOIN_POLL = 0.5  # virtual s between checks that every node sees every other
JOIN_LIMIT = 600.0  # virtual s the join may take
THEORY_MATCHING = math.log2(1 / TARGET**2)  # 19.9: rounds of a perfect matching (RMS)
THEORY_ASYNC = 2 * math.log(1 / TARGET)  # 13.8: rounds of asynchronous gossip (RMS)
THEORY = round(THEORY_MATCHING) + 1  # the issue's ~21: matching, farthest node
AVERAGING = AveragingConfig(every=None, interval=None, start="own")  # rounds come from the bench's timers
# Membership is not what is measured here, only what lets the nodes find each other: the LAN
# profile as it is (its join is as cheap as any tried: fewer gossip retransmissions leave gaps
# that only the push-pulls 5 and 30+ periods later fill, and slower probes delay those).
MEMBERSHIP = MembershipConfig()
CONFIG = dataclasses.replace(NodeConfig.local(), averaging=AVERAGING, membership=MEMBERSHIP)
IDEAL = {  # the exact models: what happens in one round
    "matching": "n/2 disjoint random pairs",
    "random": "n exchanges, a random node with a random other",
    "timer": "each node, in random order, with a random other",
}
SEEDS = {  # seeds per N
    "quick": {16: 3, 32: 3, 64: 2, 128: 2, 256: 1},
    "full": {16: 5, 32: 5, 64: 5, 128: 3, 256: 2, 512: 1, 1024: 1},
}


def initial_weights(n: int, seed: int) -> torch.Tensor:
    """``n`` rows of PARAMS: one common mean vector plus independent noise of the same size."""
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(PARAMS, generator=g)
    return mean + torch.randn(n, PARAMS, generator=g)


def relative_spread(w: torch.Tensor) -> float:
    """max_i ||w_i - mean|| / ||mean|| over the rows of ``w``."""
    mean = w.mean(0)
    return float((w - mean).norm(dim=1).max() / mean.norm())


def ideal_rounds(w: torch.Tensor, seed: int, model: str) -> int:
    """Rounds until ``relative_spread`` <= TARGET under exact, instantaneous pairwise
    averaging (see IDEAL), from weights ``w``."""
    w = w.clone().double()
    n, rng = len(w), random.Random(f"{seed}:{model}")
    nodes = list(range(n))
    for r in range(1, MAX_ROUNDS + 1):
        if model == "matching":
            rng.shuffle(nodes)
            a, b = torch.tensor(nodes[0:n - 1:2]), torch.tensor(nodes[1::2])
            w[a] = w[b] = (w[a] + w[b]) / 2
        else:
            if model == "timer":
                rng.shuffle(nodes)
            for k in range(n):
                i = nodes[k] if model == "timer" else rng.randrange(n)
                j = rng.randrange(n - 1)
                j += j >= i  # a uniformly random other node
                w[i] = w[j] = (w[i] + w[j]) / 2
        if relative_spread(w) <= TARGET:
            return r
    return MAX_ROUNDS + 1


def node_model(w: torch.Tensor, i: int) -> torch.nn.Module:
    model = torch.nn.Linear(39, 25)
    # A copy: vector_to_parameters makes the parameters views of the vector it is given.
    torch.nn.utils.vector_to_parameters(w[i].clone(), model.parameters())
    return model


def weights(sim) -> torch.Tensor:
    return torch.stack([torch.nn.utils.parameters_to_vector(n.model.parameters()).detach()
                        for n in sim.nodes])


async def wait_joined(sim) -> None:
    """Return once every node sees every other alive and ready. Listing a node's table costs
    O(N), so the nodes are checked in turn, each until it first sees all, and only the last
    check looks at all of them at once."""
    pending = list(sim.nodes)
    with trio.fail_after(JOIN_LIMIT):
        while True:
            while pending and len(pending[-1].node.roster.alive(ready=True)) == len(sim.nodes) - 1:
                pending.pop()
            if not pending:
                if sim.all_ready():
                    return
                pending = list(sim.nodes)  # somebody lost sight of somebody: start over
            await trio.sleep(JOIN_POLL)


async def timer(node, rng: random.Random) -> None:
    """The daemon's averaging timer (``Averaging.run``), from a random phase."""
    await trio.sleep(INTERVAL * rng.random())
    while True:
        await node.node.average_now()
        await trio.sleep(INTERVAL * rng.uniform(0.75, 1.25))


async def run_swarm(w0: torch.Tensor, seed: int) -> dict:
    """One swarm from weights ``w0``: join, then rounds until TARGET or MAX_ROUNDS."""
    n = len(w0)
    wall = time.perf_counter()
    async with open_sim_swarm(n, seed=seed, model=lambda i: node_model(w0, i),
                              config=CONFIG) as sim:
        await wait_joined(sim)
        joined_wall, start = time.perf_counter(), trio.current_time()
        if sim.exchanges:
            raise RuntimeError("an exchange before the rounds began")
        mean0 = w0.mean(0)
        curve = [relative_spread(w0)]
        async with trio.open_nursery() as nursery:
            for node in sim.nodes:
                nursery.start_soon(timer, node, random.Random(f"{seed}:timer:{node.index}"))
            while curve[-1] > TARGET and len(curve) <= MAX_ROUNDS:
                await trio.sleep_until(start + len(curve) * INTERVAL)
                w = weights(sim)
                curve.append(relative_spread(w))
            nursery.cancel_scope.cancel()
        drift = float((w.mean(0) - mean0).norm() / mean0.norm())
        rounds = len(curve) - 1
        mine = [e for e in sim.exchanges if e.initiated]
        results = Counter(e.result for e in mine)
        committed = [e.time - e.started for e in mine if e.result is Result.COMMITTED]
        per = n * rounds
        return {
            "rounds": rounds if curve[-1] <= TARGET else MAX_ROUNDS + 1,
            "curve": curve,
            "committed": results[Result.COMMITTED] / per,
            "busy": results[Result.BUSY] / per,
            "failed": (len(mine) - results[Result.COMMITTED] - results[Result.BUSY]) / per,
            "exchange_ms": 1e3 * statistics.mean(committed) if committed else math.nan,
            "clipped": sum(node.node.statistics().clipped for node in sim.nodes),
            "drift": drift,
            "join_virtual_s": start,
            "join_wall_s": joined_wall - wall,
            "virtual_s": trio.current_time(),
            "rounds_wall_s": time.perf_counter() - joined_wall,
        }


def measure(n: int, seeds: list[int]) -> dict:
    """Every seed's run at size ``n``, and the ideal models from the same weights."""
    runs = []
    for seed in seeds:
        w0 = initial_weights(n, seed)
        wall = time.perf_counter()
        r = trio.run(run_swarm, w0, seed, clock=trio.testing.MockClock(autojump_threshold=0))
        r["wall_s"] = time.perf_counter() - wall
        for model in IDEAL:
            r[f"ideal_{model}"] = ideal_rounds(w0, seed, model)
        runs.append(r)
        progress(f"[{time.perf_counter() - STARTED:6.1f}s] n={n} seed={seed}: {r['rounds']} "
                 f"rounds (ideal: " + ", ".join(f"{m} {r[f'ideal_{m}']}" for m in IDEAL)
                 + f"); join {r['join_wall_s']:.1f} s wall ({r['join_virtual_s']:.1f} s "
                 f"virtual), rounds {r['rounds_wall_s']:.1f} s wall")
    rounds = [r["rounds"] for r in runs]
    summary = {"seeds": seeds, "rounds_median": statistics.median(rounds),
               "rounds_max": max(rounds), "rounds_min": min(rounds)}
    for key in ("ideal_matching", "ideal_random", "ideal_timer"):
        summary[key] = statistics.median(r[key] for r in runs)
    for key in ("committed", "busy", "failed", "exchange_ms", "join_virtual_s", "join_wall_s",
                "virtual_s", "rounds_wall_s", "wall_s"):
        summary[key] = statistics.mean(r[key] for r in runs)
    summary["clipped"] = sum(r["clipped"] for r in runs)
    summary["drift"] = max(r["drift"] for r in runs)  # the worst seed
    return {**summary, "runs": runs}


def report(results: dict[int, dict], args, elapsed: float) -> None:
    print(f"Rounds until every node is within {TARGET:g} of the mean (relative): real nodes on "
          f"a simulated network (virtual time, 1 ms latency),")
    print(f"{PARAMS} float32 parameters, w_i = m + e_i with m, e_i ~ N(0, I); a round is one "
          f"{INTERVAL:g} s averaging interval, in which each node")
    print(f"initiates one exchange on the daemon's jittered timer. Seeds from {args.seed}"
          f"{', --quick' if args.quick else ''}.")
    rows = [[n, len(r["seeds"]), f"{r['rounds_median']:g}", r["rounds_max"],
             f"{r['ideal_matching']:g}", f"{r['ideal_random']:g}", f"{r['ideal_timer']:g}",
             f"{r['committed']:.2f}", f"{r['busy']:.3f}", f"{r['failed']:.3f}",
             r["exchange_ms"], f"{r['drift']:.0e}", r["join_virtual_s"], r["virtual_s"],
             r["join_wall_s"], r["rounds_wall_s"]] for n, r in results.items()]
    print()
    print(table(["N", "seeds", "rounds", "max", "matching", "random", "timer", "commit/n/r",
                 "busy/n/r", "failed/n/r", "exch ms", "drift", "join vs", "total vs",
                 "join wall s", "rounds wall s"], rows))
    print()
    print("rounds, max: measured, median and largest over seeds. matching, random, timer: the "
          "exact models on the same weights (median):")
    for model, what in IDEAL.items():
        print(f"  {model}: per round, {what}")
    print("commit, busy, failed: exchanges per node per round, as their initiators saw them; "
          "exch ms: virtual duration of a committed one;")
    print("drift: how far the mean moved, relative, worst seed; vs: virtual seconds (join: until "
          "everyone sees everyone; total: join and rounds);")
    print("wall s: means over seeds.")
    print(f"theory: perfect matching {THEORY_MATCHING:.1f} rounds (RMS), ~{THEORY} for the "
          f"farthest node (the issue's figure); asynchronous")
    print(f"pairwise gossip, N exchanges a round: {THEORY_ASYNC:.1f} rounds (RMS). Both "
          f"independent of N.")
    clipped = sum(r["clipped"] for r in results.values())
    if clipped:
        print(f"NOTE: {clipped} committed exchanges were clipped (the mean may have moved)")
    for n, r in results.items():
        if r["rounds_max"] > MAX_ROUNDS:
            print(f"ANOMALY n={n}: a swarm did not reach {TARGET:g} in {MAX_ROUNDS} rounds")
    print(f"wall time {elapsed:.1f} s")


def plot(results: dict[int, dict]) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    sizes = list(results)
    med = [results[n]["rounds_median"] for n in sizes]
    low = [m - results[n]["rounds_min"] for m, n in zip(med, sizes)]
    high = [results[n]["rounds_max"] - m for m, n in zip(med, sizes)]
    left.errorbar(sizes, med, yerr=[low, high], fmt="o-", color="k", capsize=3,
                  label="gossipd (median, min-max over seeds)")
    for model, style in zip(IDEAL, ("s--", "v--", "^--")):  # hollow: gossipd may hide them
        left.plot(sizes, [results[n][f"ideal_{model}"] for n in sizes], style, alpha=0.8,
                  markersize=10, markerfacecolor="none", label=f"exact {model}: {IDEAL[model]}")
    left.axhline(THEORY, color="tab:red", lw=1, label=f"theory, matching, farthest: ~{THEORY}")
    left.axhline(THEORY_ASYNC, color="tab:green", lw=1,
                 label=f"theory, asynchronous, RMS: {THEORY_ASYNC:.1f}")
    left.set_xscale("log", base=2)
    left.set_xticks(sizes, [str(n) for n in sizes])
    left.set_ylim(0, max(THEORY + 4, *[results[n]["rounds_max"] + 2 for n in sizes]))
    left.set_xlabel("nodes N")
    left.set_ylabel(f"rounds until max relative distance <= {TARGET:g}")
    left.legend(fontsize=7, loc="lower right")
    left.grid(alpha=0.3)
    for n in sizes:
        curve = results[n]["runs"][0]["curve"]
        right.semilogy(range(len(curve)), curve, label=f"N={n}")
    rounds = max(len(results[n]["runs"][0]["curve"]) for n in sizes)
    s0 = results[sizes[0]]["runs"][0]["curve"][0]
    r = list(range(rounds))
    right.semilogy(r, [s0 * 2 ** (-k / 2) for k in r], "k:", label="matching: 2^(-r/2)")
    right.semilogy(r, [s0 * math.exp(-k / 2) for k in r], "k--", label="asynchronous: e^(-r/2)")
    right.axhline(TARGET, color="tab:red", lw=1)
    right.set_xlabel("round")
    right.set_ylabel("max_i |w_i - mean| / |mean| (first seed)")
    right.legend(fontsize=7)
    right.grid(alpha=0.3)
    fig.suptitle("gossipd averaging: rounds to consensus vs swarm size (simulated network)")
    save_figure(fig, "scale")


STARTED = time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="N up to 256, fewer seeds (about 2 minutes)")
    parser.add_argument("--seed", type=int, default=1, help="first seed; seeds are S, S+1, ...")
    args = parser.parse_args()
    seeds = SEEDS["quick" if args.quick else "full"]
    results = {n: measure(n, [args.seed + k for k in range(count)])
               for n, count in seeds.items()}
    elapsed = time.perf_counter() - STARTED
    report(results, args, elapsed)
    plot(results)
    config = {"interval_s": INTERVAL, "params": PARAMS, "target": TARGET,
              "membership": dataclasses.asdict(MEMBERSHIP), "quick": args.quick,
              "seed": args.seed}
    save_json("scale", {"config": config, "sizes": {str(n): r for n, r in results.items()},
                        "theory": {"matching_rms": THEORY_MATCHING, "matching_farthest": THEORY,
                                   "asynchronous_rms": THEORY_ASYNC},
                        "wall_s": elapsed})
    print(json.dumps({
        "rounds_to_1e-3": {str(n): r["rounds_median"] for n, r in results.items()},
        "rounds_max": {str(n): r["rounds_max"] for n, r in results.items()},
        "ideal_timer": {str(n): r["ideal_timer"] for n, r in results.items()},
        "rounds_theory": THEORY,
        "rounds_theory_async_rms": round(THEORY_ASYNC, 1),
        "max_rounds": max(r["rounds_max"] for r in results.values()),
        "committed_per_node_round": round(statistics.mean(
            r["committed"] for r in results.values()), 3),
        "busy_per_node_round": round(max(r["busy"] for r in results.values()), 3),
        "wall_s": round(elapsed, 1),
    }))


if __name__ == "__main__":
    main()
