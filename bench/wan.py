"""Swarms on internet links: exchange time, local steps between exchanges, bytes per node per
hour and time to consensus for models of 10M to 1B parameters; the WAN membership profile over
two hours of lossy links; and one real exchange over a rate-shaped veth pair.

Links: 10, 50 and 1,000 Mbit/s each way, round trips of 20 to 200 ms, 1% loss. Models: 10M,
100M and 1B float32 parameters, exchanged with the drift correction on (the daemon's default:
each payload is the state and the correction's estimate, twice the codec's bytes per
parameter) in each ``averaging.codec`` of CODECS: fp32 (4 bytes a value), bf16 (2), int8
(~1.06: blocks of 64 against a scale), and, on the links up to LOWBIT_MAX_MBIT only, the mod
codecs (gossip.lowbit): mod4 (4.25 bits a value: 4-bit codes plus a bfloat16 period per
block of 64, coded modulo the period and decoded against the receiver's own state; 1/7.5 of
fp32 for the state, 1/5 with the correction's estimate, which travels as int8 cells of the
same blocks) and mod4/F for F = 2, 4, 8 (one F-th of the blocks per exchange, on the wire
``mod4/F:f``, the node picking the fragment f; with the estimate 1/10, 1/20, 1/40 of fp32).
Every figure counts the bytes on the wire, periods included; none counts the CPU to encode
or decode (on the simulated links CPU costs no virtual time, below).

**The target** (the issue's): 100M parameters at 10 Mbit/s (the 200 ms round trip, on every
run), one exchange in under a minute; 10.7 min in fp32, 2.8 min in int8. The last JSON line
gives, for each codec, ``exchange_s_100m_<codec>_10mbit_200ms``,
``exchange_min_100m_10mbit_<codec>`` (minutes) and ``bytes_per_exchange_100m_<codec>`` (the
payload each way), and ``first_codec_under_1min_100m_10mbit``: the first codec in CODECS'
order (most bytes first, the order ``codec = "auto"`` tries them in) that meets the target.
In keys, ``/`` becomes ``_`` (mod4/8: ``mod4_8``).

**Scaled simulation.** The library's code (channels, the exchange protocol, whole nodes for
the swarms) runs on :class:`gossip.testing.SimNetwork` under trio's MockClock: an hour of link costs
only the CPU of its messages. A 1B-parameter payload (8 GB in fp32) does not fit in memory
twice per node, so every simulation moves SIM_NUMEL parameters (1 MB in fp32) over a link
whose rate is cut by ``f = real payload / simulated payload``, and whose TCP window by the
same factor: the payload then takes the time the real one takes, and round trips are
unchanged. For the mod codecs both payloads are in the same wire format (a fragment's
payload over a fragment's), and a mod4/F exchange moves F x SIM_NUMEL parameters, so that
its simulated payload is mod4's. Each payload's periods come from its own values (as
a node's first exchange: four times a block's largest value) and each side decodes against
its own random values; the bytes, all the timing depends on, are the same whatever the
periods. The codecs encode and decode in worker threads, which under MockClock's autojump
would let the clock run to the next deadline meanwhile: in the simulations that work runs
inline, at no virtual time (:func:`inline_threads`). Where the scaling is wrong, and by how
much:

* every byte is f times slower, the fixed-size ones too (handshake, Offer, Accept, Commit,
  record framing: about 1 KB an exchange): they add 1 KB / simulated payload to an exchange,
  0.1% in fp32, 0.4% in int8, 0.8% in the mod codecs. An offer answered busy costs the same
  1 KB x f, so the swarms retry a busy peer after BUSY_BACKOFF exchange times, not the
  daemon's 0.2 s.
* the sim loses whole segments (64 KiB, or the window if smaller) and delivers a lost one a
  round trip late, with no congestion control, as a sender that does not slow down on loss
  (BBR) would see it: the loss costs a recovery, hidden while the window has room. A Reno or
  CUBIC sender halves its window on each loss and at 1% loss reaches only about MSS / RTT x
  1.22 / sqrt(0.01) (Mathis et al. 1997): 7 Mbit/s at 20 ms, 0.7 at 200 ms, whatever the
  link. The "CUBIC" column is the exchange simulated at that rate.
* the window: WINDOW (3 MiB, about what Linux's default largest receive buffer of 6 MiB
  advertises) caps one flow at WINDOW / RTT: a 1 Gbit/s link at 200 ms gives 126 Mbit/s
  unless ``net.ipv4.tcp_rmem`` is raised. The sim returns credit at once, so it gets half the
  window for the same rate. Where the window cannot bind (it is over twice what a round trip
  and a recovery keep in flight), and in the swarms, it is left large: the same times from
  fewer, larger segments, at a fraction of the CPU.

Figures per link, model and codec:

* payload: bytes each way (state and correction), what the codec's ``encoded_nbytes`` gives
  (for mod4/F, fragment 0's; the others differ by at most a block's cell); vs fp32: that
  over fp32's payload.
* exchange: dial, Noise handshake, offer, both payloads at once, commit, in virtual time
  (two hosts, one exchange). CPU work costs no virtual time; on loopback it is 0.1 to 0.2 s
  per 100 MB (bench/exchange.py). ideal: payload / min(rate, WINDOW / RTT).
* steps/exch: local steps during one exchange, exchange / step time. At the daemon's
  default ``every = 1`` every link here is the bottleneck: rounds run back to back and this
  is the period. Step times: the 10M model (an MLP, batch 64, SGD) measured on this machine's
  CPU, as a volunteer without a GPU would train it; 100M and 1B given, for a GPU at
  GPU_FLOPS training a transformer on TOKENS tokens a step: 6 x params x TOKENS / GPU_FLOPS
  (0.1 and 1.0 s).
* GB/node/h and exch/node/h: what one node sends plus receives, and its exchanges, in an
  hour, measured in the swarm below (times f); where no swarm ran, the most a node can do
  (one exchange after another), marked <=.
* consensus: NODES nodes (the library's nodes, on QUIET membership once joined), weights
  w_i = m + e_i (relative spread about 1), each starting a round as soon as its last one
  ends, until max_i ||w_i - mean|| / ||mean|| <= 1e-3, or MAX_EXCHANGES exchange times. Two
  nodes that end an exchange together find everyone else busy and each other free, and pick
  each other again ("same peer again", 1/7 if picks were independent): the swarm splits into
  pairs that re-average what they already share. random pairs: the same weights averaged in
  exact pairs drawn anew every exchange time, what a scheduler that avoided that would
  approach. bf16 and int8 round every exchange (to 8 significant bits, to 1/127 of a block's
  largest value), so their swarms agree only to about that. Swarms run for fp32, bf16 and
  int8 (SWARM_CODECS) only: a mod codec's would cost minutes (:func:`consensus` takes a mod
  setting, ``mod4/8``, all the same).

The membership check: NODES_MEMBERSHIP nodes with ``MembershipConfig.wan()`` for two virtual
hours over 200 ms round trips and 1% loss, each averaging a 1 MB model every ~30 s over
5 Mbit/s links (payloads queue datagrams behind them, up to the window: 0.4 s): deaths and
suspicions from the nodes' statistics. Every node lives throughout, so every death is false.

The real-socket check: two processes in two network namespaces joined by a veth pair, each
end shaped by ``tc qdisc ... tbf rate 50mbit``, run ``gossip.open_swarm`` over TCP; one times
``average_now()`` of a TBF_NUMEL-parameter fp32 model without correction. The figure is its
time over payload bytes / link rate, which the issue wants within 1.3 (TCP/IP headers alone
cost 4.5% at 1448-byte segments). Skipped, with the reason, where ``ip netns`` is not allowed;
the namespaces are deleted on every exit path (SIGTERM included).

Usage: python bench/wan.py [--quick] [--seed S] [--no-netns]
``--quick`` (what ``make bench`` runs, about 2 minutes): three links (the mod codecs on the 10
and 50 Mbit/s ones), a swarm for 100M on the 50 Mbit/s link only (fp32, bf16, int8),
membership for 30 minutes with 8 nodes. Progress on stderr, the tables on stdout, and last
one JSON line of headline figures. Results: bench/results/wan.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass
from functools import partial

import torch
import trio
import trio.testing

from common import progress, save_json, table
import gossip.endpoints
from gossip import AveragingConfig, MembershipConfig, NodeConfig, Swarm, Timeouts, open_swarm
from gossip import lowbit
from gossip.config import MOD_SETTING
from gossip.testing import SimNetwork
from gossip import exchange as protocol
from gossip.averaging import Result
from gossip.endpoints import connect, serve
from gossip.exchange import Deadlines, Result
from gossip.identity import Identity
from gossip.messages import Accept, Offer
from gossip.tensors import StateSchema, TensorSpec, encoded_nbytes

LOSS = 0.01
LINKS = [(10, 20), (10, 200), (50, 20), (50, 100), (50, 200), (1000, 20), (1000, 200)]
QUICK_LINKS = [(10, 200), (50, 100), (1000, 20)]  # Mbit/s each way, round trip ms
HEADLINE = (50, 100)
SIZES = {"10M": 10_000_000, "100M": 100_000_000, "1B": 1_000_000_000}
# As set in AveragingConfig.codec; a mod<b>/<F> setting travels as fragment 0 (wire name
# mod<b>/<F>:0, see wire()): every fragment has the same size, to a block.
CODECS = ("fp32", "bf16", "int8", "mod4", "mod4/2", "mod4/4", "mod4/8")
SWARM_CODECS = ("fp32", "bf16", "int8")  # the codecs that get consensus swarms (see swarm_run)
LOWBIT_MAX_MBIT = 50  # the mod codecs only on links this slow or slower (the table's length)
TARGET_LINK = (10, 200)  # the target: 100M parameters, one exchange under a minute
PARTS = 2  # the state and the drift correction's estimate
SIM_NUMEL = 250_000  # parameters a simulation moves (mod4/F: F times as many; sim_numel)
WINDOW = 3 << 20  # bytes: one TCP flow's window
MSS = 1448  # bytes of payload in a TCP segment with timestamps
GPU_FLOPS, TOKENS = 1e14, 16_384  # the given step times' assumption (see the docstring)
NODES = 8
TARGET = 1e-3
MAX_EXCHANGES = 100  # consensus runs stop after this many exchange times
BUSY_BACKOFF = 0.05  # x exchange time: a busy peer is tried again after this (see docstring)
NODES_MEMBERSHIP = 12
TBF_RATE = 50e6  # bits/s
TBF_NUMEL = 5_000_000  # 20 MB a way: 3.2 s at 50 Mbit/s
# On scaled links every byte is f times slower, so the deadlines sized for real bytes (the
# handshake's, a record's, the first handshake message's) are off: what the runs measure is
# time, and tests/sim/test_wan.py checks the default deadlines at full scale.
LOOSE = Timeouts(connect=1e6, handshake=1e6, record=1e9)
gossip.endpoints.FIRST_MESSAGE_TIMEOUT = 1e6
LOOSE_DEADLINES = Deadlines(offer=1e9, transfer=1e9, min_rate=1.0, commit=1e9, stall=1e9)
KEY = bytes(range(32))
STARTED = time.perf_counter()


@dataclass(frozen=True)
class Link:
    mbit: float
    rtt_ms: float

    @property
    def rate(self) -> float:  # bytes/s each way
        return self.mbit * 1e6 / 8

    @property
    def rtt(self) -> float:
        return self.rtt_ms / 1e3

    @property
    def cubic(self) -> float:  # bytes/s of one Reno/CUBIC flow at LOSS (Mathis)
        return min(self.rate, MSS / self.rtt * math.sqrt(1.5) / math.sqrt(LOSS))

    def __str__(self) -> str:
        return f"{self.mbit:g} Mbit/s {self.rtt_ms:g} ms"


def say(message: str) -> None:
    progress(f"[{time.perf_counter() - STARTED:6.1f}s] {message}")


def scaled_network(seed: int, link: Link, factor: float, rate: float | None = None,
                   window: bool = True) -> SimNetwork:
    """A network whose links move the simulated payload as ``link`` moves the real one: the
    rate and the window cut by ``factor``, a lost segment delivered one round trip late (a
    retransmission after duplicate acks). Where the window cannot bind (twice what one
    round trip and one recovery keep in flight), or with ``window`` False, it is left large:
    fewer, larger segments, a fraction of the CPU."""
    rate = rate or link.rate
    binds = window and WINDOW / 2 < 2 * rate * 1.5 * link.rtt
    window = WINDOW / 2 if binds else 64 * WINDOW
    return SimNetwork(seed, latency=link.rtt / 2, bandwidth=rate / factor, loss=LOSS,
                      window=max(1, round(window / factor)), rto=link.rtt)


def wire(codec: str) -> str:
    """The wire name of a codec setting: ``mod4/8`` -> ``mod4/8:0``, the others unchanged."""
    return lowbit.parse_setting(codec).name if MOD_SETTING.fullmatch(codec) else codec


def slug(codec: str) -> str:
    """A codec setting in a JSON key: ``mod4/8`` -> ``mod4_8``."""
    return codec.replace("/", "_")


def sim_numel(codec: str) -> int:
    """Parameters one simulated exchange moves: SIM_NUMEL, times F for ``mod<b>/<F>``, so
    that a fragment's simulated payload is as large as ``mod<b>``'s (the fixed bytes of an
    exchange, scaled by ``f`` with the rest, then weigh no more than in ``mod<b>``)."""
    return SIM_NUMEL * lowbit.parse_setting(codec).fragments if MOD_SETTING.fullmatch(codec) \
        else SIM_NUMEL


def factor(numel: int, codec: str, simulated: int | None = None) -> float:
    """Real payload (``numel`` parameters, state and correction) over the simulated one
    (``simulated`` parameters, :func:`sim_numel` by default, one vector), in one codec
    setting's wire format."""
    name = wire(codec)
    return (encoded_nbytes(name, numel, PARTS)
            / encoded_nbytes(name, simulated or sim_numel(codec), 1))


@contextmanager
def inline_threads():
    """Run ``trio.to_thread.run_sync`` work inline while a simulation runs. The mod codecs
    encode and decode in a worker thread; under MockClock's autojump a thread's work leaves
    every task blocked, so the clock jumps to the next deadline (the stall guard's, 1e9 s:
    the exchange fails). Inline, the work costs no virtual time, as every CPU cost here."""
    original = trio.to_thread.run_sync

    async def run_sync(fn, *args, **_):
        await trio.lowlevel.checkpoint()
        return fn(*args)

    trio.to_thread.run_sync = run_sync
    try:
        yield
    finally:
        trio.to_thread.run_sync = original


# ---- step times ------------------------------------------------------------------------


def step_times() -> dict[str, float]:
    """Seconds a step: the 10M model measured on this CPU, the others given."""
    torch.manual_seed(0)
    width = 1581  # four square layers: 4 x (1581^2 + 1581) = 10.0M parameters
    model = torch.nn.Sequential(*[m for _ in range(4)
                                  for m in (torch.nn.Linear(width, width), torch.nn.ReLU())])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, width), torch.randn(64, width)
    times = []
    for i in range(7):
        start = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return {"10M": statistics.median(times),
            **{size: 6 * SIZES[size] * TOKENS / GPU_FLOPS for size in ("100M", "1B")}}


# ---- one exchange ----------------------------------------------------------------------


@dataclass
class _Taken:
    refused: str | None = None


async def _check(*_: object) -> _Taken:
    return _Taken()


async def one_exchange(net: SimNetwork, codec: str) -> float:
    """Virtual seconds of one exchange of :func:`sim_numel` parameters from host a to host b,
    dial to commit, in a codec setting's wire format. Without an encoder, gossip.exchange
    takes a mod payload's periods from the values (as a node does before its first exchange
    with anyone), and each side decodes against its own values."""
    swarm = Swarm("wan", KEY)
    a, b = Identity.generate(), Identity.generate()
    ended = trio.Event()
    numel = sim_numel(codec)
    schema = StateSchema((TensorSpec("w", (numel,), "float32"),))

    async def respond(channel) -> None:
        offer = await channel.receive_message()
        await protocol.respond(channel, offer, Accept(0, 0, 0.0, False), torch.randn(numel),
                               torch.empty(numel), schema, _check, LOOSE_DEADLINES)
        ended.set()

    async with trio.open_nursery() as nursery:
        await nursery.start(partial(serve, net.host("b"), "b:7000", respond, identity=b,
                                    swarm=swarm, timeouts=LOOSE))
        start = trio.current_time()
        channel = await connect(net.host("a"), "b:7000", identity=a, swarm=swarm, timeouts=LOOSE)
        async with channel:
            outcome = await protocol.initiate(
                channel, Offer(schema.fingerprint, wire(codec), 0, 0, 0.0, False),
                torch.randn(numel), torch.empty(numel), schema, _check, LOOSE_DEADLINES)
        seconds = trio.current_time() - start
        await ended.wait()
        nursery.cancel_scope.cancel()
    if outcome.ending is not Result.COMMITTED:
        raise RuntimeError(f"the exchange ended {outcome.ending}: {outcome.reason}")
    return seconds


def exchange_seconds(link: Link, numel: int, codec: str, seed: int,
                     rate: float | None = None) -> float:
    f = factor(numel, codec)
    with inline_threads():
        return trio.run(lambda: one_exchange(scaled_network(seed, link, f, rate), codec),
                        clock=trio.testing.MockClock(autojump_threshold=0))


# ---- a swarm to consensus --------------------------------------------------------------


class Flat(torch.nn.Module):
    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(w.clone())


def relative_spread(models: list[Flat]) -> float:
    return spread_of(torch.stack([m.w.detach() for m in models]))


def spread_of(w: torch.Tensor) -> float:
    """max_i ||w_i - mean|| / ||mean|| over the rows of ``w``."""
    mean = w.mean(0)
    return float((w - mean).norm(dim=1).max() / mean.norm())


def initial_weights(seed: int) -> torch.Tensor:
    """NODES rows of SIM_NUMEL: one common mean vector plus noise of the same size."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(SIM_NUMEL, generator=g)
    return torch.stack([m + torch.randn(SIM_NUMEL, generator=g) for _ in range(NODES)])


def random_pair_rounds(seed: int) -> int:
    """Rounds to TARGET from :func:`initial_weights` if every exchange time paired all
    nodes anew at random (NODES / 2 disjoint pairs, each averaged exactly): what the swarm
    would do if nobody ever picked the same peer twice in a row by necessity."""
    w, rng = initial_weights(seed).double(), random.Random(f"{seed}:pairs")
    nodes = list(range(NODES))
    for r in range(1, MAX_EXCHANGES + 1):
        rng.shuffle(nodes)
        a, b = torch.tensor(nodes[0::2]), torch.tensor(nodes[1::2])
        w[a] = w[b] = (w[a] + w[b]) / 2
        if spread_of(w) <= TARGET:
            return r
    return MAX_EXCHANGES + 1


# Membership only lets the nodes find each other (on fast links, before the measurement);
# then its periodic traffic is off, since on the scaled links each datagram would weigh f
# times its size.
# (Every update goes to every member, so that no join announcement is missed: no push-pull
# repairs a gap.)
QUIET = MembershipConfig(probe_interval=1e6, probe_timeout=10.0, push_pull_interval=1e6,
                         reconnect_interval=1e6, gossip_nodes=NODES, retransmit_mult=8)


async def consensus(link: Link, numel: int, codec: str, exchange: float, seed: int) -> dict:
    """NODES nodes exchanging back to back over ``link`` until TARGET (or MAX_EXCHANGES
    exchange times); virtual seconds and the bytes each node moved (scaled back). ``codec``
    is the setting (``mod4/8``: each node picks the fragment of each exchange; ``f`` is
    fragment 0's, within a block of every other's). Run it under :func:`inline_threads`."""
    f = factor(numel, codec, SIM_NUMEL)
    net = SimNetwork(seed, latency=0.001)
    models = [Flat(w) for w in initial_weights(seed)]
    config = AveragingConfig(every=None, interval=None, start="own", codec=codec,
                             correction=False, trust_after=0.0, backoff=BUSY_BACKOFF * exchange,
                             offer_timeout=1e9, transfer_timeout=1e9, commit_timeout=1e9,
                             stall_timeout=1e9, min_rate=1.0)
    partners: list[list[object]] = [[] for _ in models]  # each node's committed peers, in order
    measuring = False

    def exchanged(i: int, ended) -> None:
        if measuring and ended.result is Result.COMMITTED:
            partners[i].append(ended.peer)

    async with AsyncExitStack() as stack:
        nodes = []
        for i, model in enumerate(models):
            node_config = NodeConfig(listen=f"n{i}:7000",
                                     bootstrap=[nodes[0].address] if nodes else [],
                                     averaging=config, membership=QUIET, timeouts=LOOSE)
            nodes.append(await stack.enter_async_context(open_swarm(
                model, Swarm("wan", KEY), node_config, network=net.host(f"n{i}"),
                rng=random.Random(f"{seed}:{i}"), on_exchange=partial(exchanged, i))))
        with trio.fail_after(600):
            while any(len(n.roster.alive(ready=True)) < NODES - 1 for n in nodes):
                await trio.sleep(0.5)
        slow = scaled_network(seed, link, f, window=False)  # see the docstring
        for i in range(NODES):
            for j in range(i + 1, NODES):
                net.set_link(f"n{i}", f"n{j}", latency=link.rtt / 2, bandwidth=link.rate / f,
                             loss=LOSS)
        net.window, net.rto = slow.window, slow.rto
        before = [n.statistics() for n in nodes]
        measuring, start = True, trio.current_time()
        spread = relative_spread(models)

        async def rounds(node, rng: random.Random) -> None:
            await trio.sleep(rng.uniform(0, BUSY_BACKOFF * exchange))
            while True:
                await node.average_now()
                await trio.sleep(rng.uniform(0.5, 1.5) * BUSY_BACKOFF * exchange)

        async with trio.open_nursery() as nursery:
            for i, node in enumerate(nodes):
                nursery.start_soon(rounds, node, random.Random(f"{seed}:rounds:{i}"))
            lowest = spread
            while spread > TARGET and trio.current_time() - start < MAX_EXCHANGES * exchange:
                await trio.sleep(exchange / 4)
                for node in nodes:
                    node.apply_pending()
                spread = relative_spread(models)
                lowest = min(lowest, spread)
            nursery.cancel_scope.cancel()
        elapsed = trio.current_time() - start
        after = [n.statistics() for n in nodes]
    moved = [(a.bytes_sent + a.bytes_received - b.bytes_sent - b.bytes_received) * f
             for a, b in zip(after, before)]
    committed = [a.committed - b.committed for a, b in zip(after, before)]
    repeats = sum(a == b for history in partners for a, b in zip(history, history[1:]))
    pairs = sum(max(0, len(history) - 1) for history in partners)
    return {"seconds": elapsed if spread <= TARGET else math.nan, "floor": lowest,
            "bytes_per_hour": statistics.mean(moved) / elapsed * 3600,
            "exchanges_per_hour": statistics.mean(committed) / elapsed * 3600,
            "repeat_share": repeats / pairs if pairs else math.nan,
            "busy": sum(a.busy - b.busy for a, b in zip(after, before)),
            "failed": sum(a.failed - b.failed for a, b in zip(after, before))}


# ---- the WAN membership profile --------------------------------------------------------


async def membership(hours: float, nodes: int, seed: int) -> dict:
    """``nodes`` members with the WAN profile over 200 ms, 1% loss, 5 Mbit/s links, each
    averaging a 1 MB model about every 30 s, for ``hours`` virtual hours."""
    net = SimNetwork(seed, latency=0.1, loss=LOSS, bandwidth=625_000.0)
    config = AveragingConfig(every=None, interval=30.0, start="own", correction=False)
    g = torch.Generator().manual_seed(seed)
    async with AsyncExitStack() as stack:
        members = []
        for i in range(nodes):
            node_config = NodeConfig(listen=f"n{i}:7000",
                                     bootstrap=[members[0].address] if members else [],
                                     averaging=config, membership=MembershipConfig.wan())
            members.append(await stack.enter_async_context(open_swarm(
                Flat(torch.randn(SIM_NUMEL, generator=g)), Swarm("wan", KEY), node_config,
                network=net.host(f"n{i}"), rng=random.Random(f"{seed}:{i}"),
                on_exchange=lambda e, i=i: members[i].apply_pending())))
        await trio.sleep(hours * 3600)
        stats = [m.roster.statistics() for m in members]
        averaging = [m.statistics() for m in members]
    return {"nodes": nodes, "hours": hours,
            "false_deaths": sum(s.deaths for s in stats),
            "suspicions": sum(s.suspicions for s in stats),
            "refutations": sum(s.refutations for s in stats),
            "probes": sum(s.probes for s in stats),
            "probes_failed": sum(s.probes_failed for s in stats),
            "alive_min": min(s.alive for s in stats),
            "exchanges": sum(a.committed for a in averaging) // 2,
            "exchanges_failed": sum(a.failed for a in averaging)}


# ---- the real-socket check: two namespaces, a veth pair, tbf ---------------------------


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def tbf_check(quick: bool) -> dict:
    """One exchange between two processes over a tbf-shaped veth pair (see the docstring)."""
    tag = f"gw{os.getpid() % 100000}"
    spaces = (f"{tag}a", f"{tag}b")
    addresses = ("10.99.0.1", "10.99.0.2")
    try:
        _ip("netns", "add", spaces[0])
    except (OSError, subprocess.CalledProcessError) as exc:
        reason = getattr(exc, "stderr", "") or str(exc)
        return {"skipped": f"ip netns is not permitted here: {reason.strip()}"}
    try:
        _ip("netns", "add", spaces[1])
        _ip("link", "add", spaces[0], "type", "veth", "peer", "name", spaces[1])
        for space, address in zip(spaces, addresses):
            _ip("link", "set", space, "netns", space)
            _ip("-n", space, "addr", "add", f"{address}/24", "dev", space)
            _ip("-n", space, "link", "set", space, "up")
            _ip("-n", space, "link", "set", "lo", "up")
            subprocess.run(["ip", "netns", "exec", space, "tc", "qdisc", "add", "dev", space,
                            "root", "tbf", "rate", f"{TBF_RATE / 1e6:g}mbit", "burst", "64kb",
                            "latency", "100ms"], check=True, capture_output=True, text=True)
        return _tbf_exchange(spaces, addresses, trials=2 if quick else 4)
    except subprocess.CalledProcessError as exc:
        return {"skipped": f"could not set up the veth pair: {exc.stderr.strip()}"}
    finally:
        for space in spaces:  # deleting a namespace deletes its end of the veth pair
            subprocess.run(["ip", "netns", "del", space], capture_output=True)


def _tbf_exchange(spaces: tuple[str, str], addresses: tuple[str, str], trials: int) -> dict:
    def worker(role: str, space: str, address: str) -> subprocess.Popen:
        return subprocess.Popen(
            ["ip", "netns", "exec", space, sys.executable, os.path.abspath(__file__),
             "--tbf-worker", role, "--listen", f"{address}:7070",
             "--peer", f"{addresses[0]}:7070", "--trials", str(trials)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    b = worker("b", spaces[0], addresses[0])
    a = worker("a", spaces[1], addresses[1])
    try:
        out, _ = a.communicate(timeout=300)
        b.communicate(timeout=30)  # its stdin closes: it leaves
    except subprocess.TimeoutExpired:
        return {"skipped": "the exchange between the namespaces did not end within 300 s"}
    finally:
        for process in (a, b):
            if process.poll() is None:
                process.kill()
            process.wait()
    if a.returncode != 0:
        return {"skipped": f"the worker failed (exit {a.returncode})"}
    result = json.loads(out.strip().splitlines()[-1])
    ideal = result["payload_bytes"] / (TBF_RATE / 8)
    result.update(rate_bits=TBF_RATE, ideal_s=ideal, ratio=result["exchange_s"] / ideal,
                  wire_ratio=result["exchange_s"] / (result["wire_bytes"] / (TBF_RATE / 8)))
    return result


async def tbf_worker(role: str, listen: str, peer: str, trials: int) -> None:
    """One side of the real-socket check. b serves until its stdin closes; a times
    ``trials`` exchanges after a warm-up and prints them as JSON."""
    model = Flat(torch.randn(TBF_NUMEL))
    config = AveragingConfig(every=None, interval=None, start="own", correction=False,
                             trust_after=0.0)
    node_config = NodeConfig(listen=listen, bootstrap=[peer] if role == "a" else [],
                             averaging=config)
    async with open_swarm(model, Swarm("wan", KEY), node_config) as node:
        if role == "b":
            await trio.to_thread.run_sync(sys.stdin.read)
            return
        with trio.fail_after(60):
            while not node.roster.alive(ready=True):
                await node.roster.wait_changed()
        times, before = [], None
        for trial in range(trials + 1):
            if trial == 1:
                before = node.statistics()
            start = time.perf_counter()
            result = await node.average_now()
            if result is not Result.COMMITTED:
                raise RuntimeError(f"the exchange ended {result.value}, not committed")
            node.apply_pending()
            if trial:
                times.append(time.perf_counter() - start)
        after = node.statistics()
    assert before is not None
    print(json.dumps({"exchange_s": statistics.median(times), "times": times,
                      "payload_bytes": 4 * TBF_NUMEL,
                      "wire_bytes": (after.bytes_sent - before.bytes_sent) / trials}))


# ---- the report ------------------------------------------------------------------------


def duration(seconds: float) -> str:
    if math.isnan(seconds):
        return "-"
    if seconds < 100:
        return f"{seconds:.3g} s"
    if seconds < 6000:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"


def swarm_run(link: Link, size: str, codec: str, quick: bool) -> bool:
    """Whether this row gets a consensus swarm: every model and codec of SWARM_CODECS on the
    headline link (100M only with --quick), and 100M fp32 on the others (not with --quick).
    (The mod codecs get none: minutes each. consensus() takes their settings all the same.)"""
    if codec not in SWARM_CODECS:
        return False
    if (link.mbit, link.rtt_ms) == HEADLINE:
        return size == "100M" or not quick
    return not quick and size == "100M" and codec == "fp32"


def key(link: Link, size: str, codec: str) -> str:
    return f"{size.lower()}_{slug(codec)}_{link.mbit:g}mbit_{link.rtt_ms:g}ms"


def codecs_for(link: Link) -> tuple[str, ...]:
    """The codecs simulated on ``link``: the mod ones only up to LOWBIT_MAX_MBIT."""
    return tuple(c for c in CODECS
                 if link.mbit <= LOWBIT_MAX_MBIT or not MOD_SETTING.fullmatch(c))


def fraction(ratio: float) -> str:
    """A size relative to fp32's: ``1``, ``1/2``, ``1/5.02``, ``1/40.2``."""
    return "1" if ratio >= 0.9995 else f"1/{1 / ratio:.3g}"


def nbytes(n: float) -> str:
    return f"{n / 1e9:.3g} GB" if n >= 1e9 else f"{n / 1e6:.3g} MB"


def consensus_cell(row: dict) -> str:
    if "seconds" not in row:
        return ""
    if math.isnan(row["seconds"]):
        return f"> {duration(MAX_EXCHANGES * row['exchange_s'])} (at {row['floor']:.1g})"
    return f"{duration(row['seconds'])}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="3 links, consensus at 50 Mbit/s only, 30 min of membership")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-netns", action="store_true", help="skip the real-socket check")
    parser.add_argument("--tbf-worker", choices=["a", "b"], help=argparse.SUPPRESS)
    parser.add_argument("--listen", help=argparse.SUPPRESS)
    parser.add_argument("--peer", help=argparse.SUPPRESS)
    parser.add_argument("--trials", type=int, default=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    # SIGTERM unwinds like Ctrl-C, so that the namespaces are deleted on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    if args.tbf_worker:
        trio.run(tbf_worker, args.tbf_worker, args.listen, args.peer, args.trials)
        return
    logging.getLogger("gossip").setLevel(logging.ERROR)  # teardowns cut exchanges short
    links = [Link(*link) for link in (QUICK_LINKS if args.quick else LINKS)]
    steps = step_times()  # on every core, as a trainer would
    torch.set_num_threads(1)  # the simulated models are small: intra-op threads only spin
    say("step times: " + ", ".join(f"{k} {v:.3f} s" for k, v in steps.items()))
    pair_rounds = random_pair_rounds(args.seed)
    say(f"random pairs: {pair_rounds} exchange times to {TARGET:g}")

    rows = []
    for link in links:
        for size, numel in SIZES.items():
            for codec in codecs_for(link):
                payload = encoded_nbytes(wire(codec), numel, PARTS)
                seconds = exchange_seconds(link, numel, codec, args.seed)
                cubic = exchange_seconds(link, numel, codec, args.seed, rate=link.cubic)
                row = {"link": str(link), "mbit": link.mbit, "rtt_ms": link.rtt_ms,
                       "size": size, "codec": codec, "wire_codec": wire(codec),
                       "payload_bytes": payload,
                       "vs_fp32": payload / encoded_nbytes("fp32", numel, PARTS),
                       "exchange_s": seconds, "cubic_s": cubic,
                       "ideal_s": payload / min(link.rate, WINDOW / link.rtt),
                       "steps": seconds / steps[size], "random_pairs_s": pair_rounds * seconds}
                if swarm_run(link, size, codec, args.quick):
                    with inline_threads():
                        row.update(trio.run(consensus, link, numel, codec, seconds, args.seed,
                                            clock=trio.testing.MockClock(autojump_threshold=0)))
                    say(f"{link} {size} {codec}: exchange {duration(seconds)}, consensus "
                        f"{duration(row['seconds'])} (lowest spread {row['floor']:.2g}; "
                        f"same peer again {row['repeat_share']:.0%}; busy {row['busy']}, "
                        f"failed {row['failed']})")
                rows.append(row)
        say(f"{link}: exchanges simulated")

    hours = 0.5 if args.quick else 2.0
    members = NODES if args.quick else NODES_MEMBERSHIP
    wall = time.perf_counter()
    check = trio.run(membership, hours, members, args.seed,
                     clock=trio.testing.MockClock(autojump_threshold=0))
    check["wall_s"] = time.perf_counter() - wall
    say(f"membership: {check}")
    tbf = {"skipped": "--no-netns"} if args.no_netns else tbf_check(args.quick)
    say(f"tbf: {tbf}")
    report(rows, steps, pair_rounds, check, tbf, args)


def report(rows: list[dict], steps: dict, pair_rounds: int, check: dict, tbf: dict,
           args) -> None:
    print(f"\nOne exchange each way of the state and drift correction (payload = codec bytes x "
          f"params x 2), {LOSS:.0%} loss, simulated at a cut rate (see the docstring); step "
          "times: " + ", ".join(f"{k} {v:.3g} s" for k, v in steps.items())
          + f" (10M measured on this CPU; 100M, 1B: 6 N x {TOKENS} tokens at "
          f"{GPU_FLOPS:.0e} FLOP/s)")
    print(table(
        ["link", "params", "codec", "payload", "vs fp32", "exchange", "ideal", "CUBIC",
         "steps/exch", "GB/node/h", "exch/node/h", "consensus", "random pairs"],
        [[r["link"], r["size"], r["codec"], nbytes(r["payload_bytes"]),
          fraction(r["vs_fp32"]),
          duration(r["exchange_s"]), duration(r["ideal_s"]), duration(r["cubic_s"]),
          f"{r['steps']:,.0f}",
          f"{r['bytes_per_hour'] / 1e9:,.0f}" if "seconds" in r
          else f"<={7200 / r['exchange_s'] * r['payload_bytes'] / 1e9:,.0f}",
          f"{r['exchanges_per_hour']:,.1f}" if "seconds" in r
          else f"<={3600 / r['exchange_s']:,.1f}",
          consensus_cell(r), duration(r["random_pairs_s"])] for r in rows]))
    print("\n".join([
        "payload: bytes each way, state and correction; vs fp32: that over fp32's. mod4: 4.25 "
        "bits a value (a bf16 period per block of 64 included);",
        f"mod4/F: one F-th of the blocks per exchange (fragment 0 simulated; the mod codecs only "
        f"up to {LOWBIT_MAX_MBIT} Mbit/s). Times count bytes on the wire, not the CPU to "
        "encode or decode.",
        "exchange: dial to commit, simulated at the link's rate (window 3 MiB: one flow gets "
        "at most 3 MiB / RTT); ideal: payload / min(rate, window / RTT);",
        "CUBIC: the same exchange at the rate one Reno/CUBIC flow reaches at 1% loss (Mathis: "
        "MSS / RTT x 1.22 / 0.1); BBR gets about the 'exchange' column.",
        "steps/exch: local steps during one exchange (rounds run back to back at every = 1); "
        "GB/node/h, exch/node/h: sent + received by one node, back to back,",
        f"measured in the {NODES}-node swarm (<=: one exchange after another, the most a node "
        "can do); consensus: that swarm, from a relative spread of about 1 to 1e-3,",
        f"or '> limit (at x)': not within {MAX_EXCHANGES} exchange times, x the lowest spread "
        "reached (see 'same peer again' in the progress lines and the report);",
        f"random pairs: {pair_rounds} exchange times, the rounds to 1e-3 if every exchange time "
        "re-paired the nodes at random (exact fp32 averaging, same weights).",
    ]))
    print(f"\nWAN membership profile, {check['nodes']} nodes, {check['hours']:g} h virtual, "
          f"200 ms RTT, 1% loss, 5 Mbit/s links carrying an exchange per node every ~30 s: "
          f"false deaths {check['false_deaths']}, suspicions {check['suspicions']} "
          f"(refuted {check['refutations']}), probes {check['probes']} "
          f"({check['probes_failed']} failed), exchanges {check['exchanges']} "
          f"({check['exchanges_failed']} failed); {check['wall_s']:.0f} s wall")
    if "skipped" in tbf:
        print(f"\nReal sockets over tbf: skipped: {tbf['skipped']}")
    else:
        print(f"\nReal sockets, two namespaces, veth shaped by tbf at {TBF_RATE / 1e6:g} Mbit/s "
              f"each way: one exchange of {tbf['payload_bytes'] / 1e6:g} MB each way took "
              f"{tbf['exchange_s']:.2f} s (median of {len(tbf['times'])}), "
              f"{tbf['ratio']:.3f}x payload / rate ({tbf['ideal_s']:.2f} s; target <= 1.3), "
              f"{tbf['wire_ratio']:.3f}x wire bytes / rate")
    head = {f"exchange_s_{key(Link(*HEADLINE), '100M', c)}": None
            for c in codecs_for(Link(*HEADLINE))}
    for r in rows:
        if (r["mbit"], r["rtt_ms"]) == HEADLINE:
            link = Link(*HEADLINE)
            if r["size"] == "100M":
                head[f"exchange_s_{key(link, '100M', r['codec'])}"] = round(r["exchange_s"], 2)
            if r["size"] == "100M" and "seconds" in r:
                head[f"consensus_s_{key(link, '100M', r['codec'])}"] = (
                    None if math.isnan(r["seconds"]) else round(r["seconds"], 1))
                head[f"consensus_lowest_spread_{key(link, '100M', r['codec'])}"] = float(
                    f"{r['floor']:.2g}")
                head[f"same_peer_again_{key(link, '100M', r['codec'])}"] = round(
                    r["repeat_share"], 2)
    fp32 = next(r for r in rows if (r["mbit"], r["rtt_ms"]) == HEADLINE
                and r["size"] == "100M" and r["codec"] == "fp32")
    head.update({
        "steps_per_exchange_100m_fp32_50mbit_100ms": round(fp32["steps"], 1),
        "gb_per_node_hour_100m_fp32_50mbit_100ms": round(fp32["bytes_per_hour"] / 1e9, 1),
        "exchange_vs_ideal_100m_fp32_50mbit_100ms": round(fp32["exchange_s"] / fp32["ideal_s"], 3),
        "cubic_s_100m_fp32_50mbit_100ms": round(fp32["cubic_s"], 1),
        "consensus_random_pairs_s_100m_fp32_50mbit_100ms": round(fp32["random_pairs_s"], 1),
        "false_deaths_2h" if check["hours"] == 2 else f"false_deaths_{check['hours']:g}h":
            check["false_deaths"],
        "suspicions": check["suspicions"],
        "tbf_ratio": None if "skipped" in tbf else round(tbf["ratio"], 3),
        "step_s_10m_cpu": round(steps["10M"], 4),
    })
    # The target: 100M parameters at 10 Mbit/s, one exchange in under a minute.
    target = [r for r in rows if (r["mbit"], r["rtt_ms"]) == TARGET_LINK and r["size"] == "100M"]
    mbit = f"{TARGET_LINK[0]:g}mbit"
    for r in target:
        head[f"exchange_s_{key(Link(*TARGET_LINK), '100M', r['codec'])}"] = round(
            r["exchange_s"], 2)
    for r in target:
        head[f"exchange_min_100m_{mbit}_{slug(r['codec'])}"] = round(r["exchange_s"] / 60, 2)
    for r in target:
        head[f"bytes_per_exchange_100m_{slug(r['codec'])}"] = r["payload_bytes"]
    # The first codec, in CODECS' order (most bytes first, as codec = "auto" tries them),
    # whose exchange takes under a minute there; None if none does, or the link did not run.
    head[f"first_codec_under_1min_100m_{mbit}"] = next(
        (r["codec"] for r in target if r["exchange_s"] < 60), None)
    save_json("wan", {"quick": args.quick, "seed": args.seed, "rows": rows, "steps": steps,
                      "random_pair_rounds": pair_rounds,
                      "membership": check, "tbf": tbf, "headline": head})
    print(json.dumps(head))


if __name__ == "__main__":
    main()
