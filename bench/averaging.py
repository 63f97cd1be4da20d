"""One averaging exchange of a 25M-parameter fp32 state against gloo, plain TCP and hivemind,
on 127.0.0.1.

Two worker processes, *a* and *b*, each build a model of 25,000,000 float32 parameters (five
tensors, 100 MB; seeded differently), set up every method below side by side, and then run
them in rounds: each round times one trial of every method, in an order that rotates from
round to round, so that other work on the machine (a shared 2-core box) weighs on all methods
alike. The parent process (which imports no torch) starts the workers and relays their
messages; it measures nothing itself.

* exchange fp32 / bf16 / int8: each worker opens a node per method, ``open_swarm(model, swarm,
  NodeConfig(averaging=AveragingConfig(every=None, interval=None, codec=..., start="own",
  correction=False, trust_after=0), ...))``, one swarm per method (int8 only once
  ``gossip.tensors`` has that codec; the row is left out until then); *b* bootstraps to *a*,
  and both wait until each sees the other alive and ready (``trust_after=0``: at once a
  member whose offers count, as in a swarm that has run a while, not a newcomer). *a* times ``await node.average_now()``, which must
  return ``COMMITTED``: connect, Noise handshake, Offer/Accept, both snapshots, both payloads
  at once (encrypted, 1 MiB records), the checks and the delta on each side, the Commit round
  trip. That is what a user pays for one exchange. Both then apply the delta (not timed).
  ``statistics().mean_duration`` of both sides is reported too (a's from before its
  snapshot, b's from the Offer, to the commit).
* exchange + correction, fp32 / bf16 / int8: the full payload of a training node, which keeps
  a drift correction (:mod:`gossip.correction`): the same, with ``correction=True`` and the
  model's optimizer handed to ``open_swarm(optimizer=...)`` as the daemon does (plain SGD at
  learning rate 0, so the model never moves), stepped once on a random gradient at set-up so
  that the correction holds an estimate. Every exchange then carries the state and the
  estimate, twice the values (a worker checks that every timed exchange did).
* gloo all_reduce: ``torch.distributed`` with the gloo backend, world size 2, on a TCPStore at
  127.0.0.1 (what ``init_method="tcp://..."`` builds; port 0 here, so no port can clash); a
  barrier, then ``dist.all_reduce`` (sum) of one flat 25M float32 tensor, timed on rank 0.
  Unencrypted C++; the flat copy of the model it reduces counts in its memory. gloo 2x: the
  same on a 50M flat tensor, the model twice, what the full payload holds.
* plain TCP, full duplex: *a* connects to *b* and both send the model's 100 MB (1 MiB
  ``send_all`` calls straight from the parameters' memory) while receiving the other's into a
  100 MB buffer (``recv_into``); *b* sends one byte once it has received and sent all. Timed
  on *a* from before the connect to that byte: the fp32 exchange's bytes with no encryption,
  no protocol and no arithmetic.
* plain TCP, one way: the same, *a* sending and *b* only receiving.
* hivemind (with ``--hivemind PYTHON``): hivemind's ``DecentralizedAverager`` averaging the
  same model (same shapes, seeds and thread setting) between two more processes, run by
  PYTHON, the interpreter of a separate environment with hivemind installed (never the
  project's: hivemind pins old versions of its libraries). Timed from the call of
  ``averager.step()`` on one peer to its return, the other peer already stepping: matchmaking
  through hivemind's DHT, the all-reduce of uncompressed fp32 (its default) and the update in
  place. Those processes run ``bench/hivemind_worker.py`` (which says more) and import nothing
  from the project; *a* has them run each trial in its turn in the rounds, through the parent.
  Without the option, hivemind's row is a reference figure (:data:`HIVEMIND_S`, measured on
  this kind of machine elsewhere), not measured in this run, and marked so.

Each worker runs torch with one intra-op thread (``torch.set_num_threads(1)``), as torchrun sets
up several processes on one machine: two workers that each spread every operation over all the
cores of a small machine would have their threads wait on each other.

Every method gets one warm-up, then ``--trials`` timed trials; the table shows medians. The
exchanges are timed around a call that also touches the network and threads, so the other
methods are timed the same way: wall clock on *a*. CPU time (user + system, all threads) is
reported for each side: *a*'s during the timed call; *b*'s from a go-ahead message that *a*
sends it just before the call to the end of *b*'s part (the commit seen, the last byte sent),
idle waits included, which cost none; gloo's on both sides around ``all_reduce`` itself;
hivemind's over each peer's whole process tree, where its work runs (the script, its DHT's
and its averager's processes and the ``p2pd`` daemon).

Memory: the peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs``) from
just before a method is set up to the end of its warm-up, which allocates all of its buffers,
minus the resident set just before; the larger of the two workers, in model sizes. The first
method set up, fp32, starts right after the model is built. hivemind's is not measured (its
work is spread over four processes).

Targets (from the issue): the fp32 exchange within 1.5x of gloo's all_reduce, the bf16 one no
slower than it and the int8 one within 0.8x of it; the fp32 exchange within 2x of the plain
full-duplex TCP time; at least 5x faster than hivemind's averaging of the same state between
two peers; peak memory beyond the model at most 3x the model. The full payload is reported
against gloo 2x (the same values in fp32), with no target. Nothing here asserts on time.

Usage: python bench/averaging.py [--quick] [--trials 15] [--hivemind PYTHON]
Progress goes to stderr; the last line printed is one JSON object with the figures (time
ratios are ours / baseline: below 1 is faster; ``speedup_vs_hivemind`` is hivemind / ours,
measured in this run, and null without ``--hivemind``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from contextlib import AsyncExitStack
from functools import partial
from pathlib import Path

import trio

from common import table

NUMEL = 25_000_000
PARTS = 5  # tensors in the model (5 x 5M)
CHUNK = 1 << 20  # bytes per send_all for plain TCP, as the secure channel's records
HIVEMIND_S = 1.3  # hivemind averaging of 100 MB between two peers, measured elsewhere
HIVEMIND_WORKER = Path(__file__).resolve().with_name("hivemind_worker.py")
TARGET_VS_GLOO = 1.5  # fp32 exchange <= this x gloo all_reduce
TARGET_BF16_VS_GLOO = 1.0  # bf16 exchange <= this x gloo
TARGET_INT8_VS_GLOO = 0.8  # int8 exchange <= this x gloo
TARGET_VS_TCP = 2.0  # fp32 exchange <= this x plain full-duplex TCP
TARGET_VS_HIVEMIND = 5.0  # at least this many times faster than hivemind
TARGET_EXTRA_RSS = 3.0  # peak RSS beyond the model <= this x the model
CODECS = ("fp32", "bf16")  # the codecs every exchange bench times
NEW_CODECS = ("int8",)  # timed here too where gossip.tensors has them
GLOO = {"gloo": 1, "gloo 2x": 2}  # gloo methods: the copies of the model they all-reduce
METHODS = ("fp32", "bf16", "gloo", "duplex", "oneway")  # a Bench's methods unless given
LABELS = {
    "fp32": "exchange fp32 (encrypted)",
    "bf16": "exchange bf16 (encrypted)",
    "int8": "exchange int8 (encrypted)",
    "full fp32": "exchange + correction, fp32",
    "full bf16": "exchange + correction, bf16",
    "full int8": "exchange + correction, int8",
    "gloo": "gloo all_reduce (world 2)",
    "gloo 2x": "gloo all_reduce, 2x the model",
    "duplex": "plain TCP, 100 MB each way",
    "oneway": "plain TCP, 100 MB one way",
    "hivemind": "hivemind DecentralizedAverager",
}
SLUGS = {"duplex": "tcp", "oneway": "tcp_oneway"}  # JSON names, where not the method's


def exchange_spec(method: str) -> tuple[str, bool] | None:
    """``(codec, full)`` for an exchange method (``"fp32"``, ``"full bf16"``: with the drift
    correction), None for the others."""
    codec = method.removeprefix("full ")
    return (codec, codec != method) if codec in CODECS + NEW_CODECS else None


def copies(method: str) -> int:
    """How many times the model's values a method moves: 2 for the full payload."""
    return 2 if method.startswith("full ") else GLOO.get(method, 1)


def slug(method: str) -> str:
    return SLUGS.get(method, method.replace(" ", "_"))


# ---- the parent: start the workers, relay their messages, print the table ---------------

PEERS = {"a": "b", "b": "a", "ha": "hb", "hb": "ha"}  # where a message without "to" goes


def relay(source: str, workers: dict, locks: dict, results: dict) -> None:
    """Forward the lines of worker ``source`` to the worker each names (``to``; its peer
    when it names none), except its results, which are kept (a list per role); at the end
    of its output close its peer's input, so a worker that dies stops the other."""
    for line in workers[source].stdout:
        message = json.loads(line)
        if "result" in message:
            results.setdefault(message["result"]["role"], []).append(message["result"])
            continue
        target = message.get("to", PEERS[source])
        try:
            with locks[target]:
                workers[target].stdin.write(line)
                workers[target].stdin.flush()
        except (BrokenPipeError, ValueError):
            break
    try:
        with locks[PEERS[source]]:
            workers[PEERS[source]].stdin.close()
    except BrokenPipeError:
        pass


def hivemind_env() -> dict[str, str]:
    """The environment of hivemind's processes: nothing of the project's environment (its
    import path) reaches them, and their log says only warnings unless told otherwise."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
    return env


def run_workers(script: str, *options: str, hivemind: str | None = None) -> dict:
    """Run ``script --worker a|b --key KEY *options`` twice, and with ``hivemind`` (an
    interpreter) the two hivemind peers, relaying between them all; returns each role's
    results, in the order its worker reported them."""
    key = os.urandom(32).hex()
    commands = {role: [sys.executable, script, "--worker", role, "--key", key, *options]
                for role in ("a", "b")}
    if hivemind:
        commands |= {role: [hivemind, str(HIVEMIND_WORKER), "--role", role, "--numel",
                            str(NUMEL), "--parts", str(PARTS)] for role in ("ha", "hb")}
    ours = ("a", "b")
    workers = {
        # hivemind's peers run in their own environment and process group (to be ended with
        # their children if the run fails).
        role: subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, bufsize=1, env=None if role in ours else hivemind_env(),
                               start_new_session=role not in ours)
        for role, command in commands.items()
    }
    locks = {role: threading.Lock() for role in workers}
    results: dict = {}
    threads = [threading.Thread(target=relay, args=(role, workers, locks, results))
               for role in workers]
    for thread in threads:
        thread.start()
    # A worker that fails ends the run: the others may be waiting on it in a way their closed
    # input does not interrupt (a node waiting for its peer to join), so they are stopped.
    try:
        while True:
            codes = [worker.poll() for worker in workers.values()]
            if any(codes) or None not in codes:
                break
            time.sleep(0.1)
    finally:
        if any(worker.poll() != 0 for worker in workers.values()):
            for role, worker in workers.items():
                if worker.poll() is None:
                    if role in ours:
                        worker.terminate()
                    else:
                        os.killpg(worker.pid, signal.SIGTERM)
    codes = {role: worker.wait() for role, worker in workers.items()}
    for thread in threads:
        thread.join()
    if any(codes.values()) or set(results) != set(workers):
        raise SystemExit(f"a worker failed (exit codes {codes})")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="5 trials per method (1 to 2 minutes)")
    parser.add_argument("--trials", type=int,
                        help="timed trials per method (default 15, 5 with --quick)")
    parser.add_argument("--hivemind", metavar="PYTHON",
                        help="also time hivemind's averaging, run by PYTHON: the interpreter "
                             "of a separate environment with hivemind installed")
    parser.add_argument("--worker", choices=["a", "b"], help=argparse.SUPPRESS)
    parser.add_argument("--key", help=argparse.SUPPRESS)
    parser.add_argument("--with-hivemind", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    trials = args.trials or (5 if args.quick else 15)
    if args.worker:
        worker(args.worker, bytes.fromhex(args.key), trials, args.with_hivemind)
        return
    if args.hivemind:
        python = shutil.which(args.hivemind)
        check = python and subprocess.run([python, "-c", "import hivemind"], env=hivemind_env(),
                                          capture_output=True, text=True)
        if not check or check.returncode:
            why = ((check.stderr.strip().splitlines() or [f"exit code {check.returncode}"])[-1]
                   if check else "no such interpreter")
            parser.error(f"--hivemind {args.hivemind}: cannot import hivemind ({why})")
        args.hivemind = python

    started, load_before = time.perf_counter(), os.getloadavg()[0]
    results = run_workers(__file__, "--trials", str(trials),
                          *(["--with-hivemind"] if args.hivemind else []),
                          hivemind=args.hivemind)
    elapsed, load_after = time.perf_counter() - started, os.getloadavg()[0]
    (a,), (b,) = results["a"], results["b"]
    methods = a["methods"]
    model_bytes = a["model_bytes"]
    mb = model_bytes / 1e6
    median = {m: statistics.median(a["times"][m]) for m in methods}
    cpu_a = {m: statistics.median(a["cpu"][m]) for m in methods}
    cpu_b = {m: statistics.median(a["cpu_b"][m]) for m in methods}
    extra = {m: max(a["extra_rss"][m], b["extra_rss"][m]) / model_bytes for m in a["extra_rss"]}
    gloo = {m: median["gloo 2x" if copies(m) == 2 else "gloo"] for m in methods}

    def memory(m: str) -> str:
        if m in extra:
            return f"{extra[m]:.2f} x"
        return "not measured" if m == "hivemind" else "(as above)"

    print(f"\n{NUMEL:,} float32 parameters ({mb:.0f} MB) between two processes on 127.0.0.1, "
          f"median of {trials} after a warm-up, methods interleaved")
    rows = [[LABELS[m], f"{median[m]:.3f}", f"{min(a['times'][m]):.3f}",
             f"{copies(m) * mb / median[m]:.0f}", f"{median[m] / gloo[m]:.2f}",
             f"{median[m] / median['duplex']:.2f}" if copies(m) == 1 else "-",
             f"{cpu_a[m]:.3f}", f"{cpu_b[m]:.3f}", memory(m)] for m in methods]
    if "hivemind" not in methods:
        rows.append(["hivemind (ref., not this run)", f"{HIVEMIND_S:.3f}", "",
                     f"{mb / HIVEMIND_S:.0f}", f"{HIVEMIND_S / median['gloo']:.2f}",
                     f"{HIVEMIND_S / median['duplex']:.2f}", "", "", ""])
    print(table(["method", "median s", "min s", "MB/s", "vs gloo", "vs TCP", "CPU s a",
                 "CPU s b", "peak extra RSS"], rows))
    print("\n".join([
        "MB/s: the fp32 state's MB per direction (the model's, twice that with the "
        "correction; bf16 puts half of that on the wire, int8 about a quarter).",
        "vs gloo, vs TCP: time ratios, below 1 is faster; vs gloo: against gloo all-reducing "
        "the same values (the 2x row for the full payload); vs TCP: the full-duplex row.",
        "CPU s a, b: CPU time (user + system, all threads) of each side, median; a's during "
        "the timed call, b's from a's go-ahead to the end of its part (gloo: all_reduce only; "
        "hivemind: each peer's whole process tree).",
        "exchange: connect + handshake + offer + snapshots + both payloads + checks + delta + "
        "commit, timed on the initiator; + correction: the payload holds the drift "
        "correction's estimate too.",
        "gloo: all_reduce only (no division to average), unencrypted. TCP: connect + bytes + "
        "a 1-byte ack, unencrypted.",
        "hivemind: averager.step() on one peer, the other already stepping: matchmaking + "
        "all-reduce (uncompressed fp32) + update in place, unencrypted."
        if "hivemind" in methods else
        f"hivemind: {HIVEMIND_S} s median for 100 MB between two peers, a reference measured "
        "on this kind of machine elsewhere, NOT in this run (--hivemind PYTHON measures it).",
        "peak extra RSS: peak resident set beyond what was there before the method's set-up "
        "and warm-up, the larger worker's, in model sizes (gloo's includes its flat copy, "
        "TCP's its receive buffer, shared by both TCP rows).",
    ]))
    for m, ours in a["exchange"].items():
        theirs = b["exchange"][m]
        print(f"{m} statistics(), timed trials: mean_duration a {ours['mean_duration']:.3f} s, "
              f"b {theirs['mean_duration']:.3f} s; per exchange {ours['bytes_sent'] / 1e6:.1f}"
              f" MB sent, {ours['bytes_received'] / 1e6:.1f} MB received on the wire")
    if "hivemind" in methods:
        h = results["ha"][0]
        print(f"hivemind {h['hivemind']} (torch {h['torch']}, Python {h['python']}); its two "
              f"peers' set-up took {h['setup_s']:.1f} s")

    def ratio(m: str, base: str) -> float | None:
        return median[m] / median[base] if m in median else None

    vs_gloo, vs_tcp = ratio("fp32", "gloo"), ratio("fp32", "duplex")
    bf16_vs_gloo, int8_vs_gloo = ratio("bf16", "gloo"), ratio("int8", "gloo")
    measured = "hivemind" in methods
    speedup = median["hivemind"] / median["fp32"] if measured else None
    reference = HIVEMIND_S / median["fp32"]
    verdict = {True: "met", False: "MISSED"}
    print(f"target: fp32 exchange <= {TARGET_VS_GLOO:g}x gloo: "
          f"{verdict[vs_gloo <= TARGET_VS_GLOO]} ({vs_gloo:.2f}x)")
    print(f"target: bf16 exchange <= {TARGET_BF16_VS_GLOO:g}x gloo: "
          f"{verdict[bf16_vs_gloo <= TARGET_BF16_VS_GLOO]} ({bf16_vs_gloo:.2f}x)")
    if int8_vs_gloo is None:
        print(f"target: int8 exchange <= {TARGET_INT8_VS_GLOO:g}x gloo: not measured "
              "(gossip.tensors has no int8 codec yet)")
    else:
        print(f"target: int8 exchange <= {TARGET_INT8_VS_GLOO:g}x gloo: "
              f"{verdict[int8_vs_gloo <= TARGET_INT8_VS_GLOO]} ({int8_vs_gloo:.2f}x)")
    print(f"target: fp32 exchange <= {TARGET_VS_TCP:g}x plain duplex TCP: "
          f"{verdict[vs_tcp <= TARGET_VS_TCP]} ({vs_tcp:.2f}x)")
    if measured:
        print(f"target: >= {TARGET_VS_HIVEMIND:g}x faster than hivemind (measured in this "
              f"run): {verdict[speedup >= TARGET_VS_HIVEMIND]} ({speedup:.1f}x)")
    else:
        print(f"target: >= {TARGET_VS_HIVEMIND:g}x faster than hivemind: not measured in this "
              f"run; against the reference {HIVEMIND_S} s from elsewhere {reference:.1f}x")
    plain = [m for m in methods if exchange_spec(m) and copies(m) == 1]
    full = [m for m in methods if m.startswith("full ")]
    print(f"target: peak extra RSS <= {TARGET_EXTRA_RSS:g}x model: "
          f"{verdict[extra['fp32'] <= TARGET_EXTRA_RSS]} ("
          + ", ".join(f"{m} {extra[m]:.2f}x" for m in plain) + ")")
    print("no target, the full payload (state + correction): vs gloo 2x "
          + ", ".join(f"{m.removeprefix('full ')} {median[m] / median['gloo 2x']:.2f}x"
                      for m in full)
          + "; peak extra RSS (the correction's two model-sized tensors included) "
          + ", ".join(f"{m.removeprefix('full ')} {extra[m]:.2f}x" for m in full))
    print(f"wall time {elapsed:.1f} s; {os.cpu_count()} CPUs, 1-minute load average "
          f"{load_before:.2f} before, {load_after:.2f} after (other work on the machine slows "
          "the CPU-bound methods most)")

    def rounded(value: float | None, digits: int) -> float | None:
        return None if value is None else round(value, digits)

    figures = {
        "exchange_vs_gloo": rounded(vs_gloo, 3),
        "bf16_vs_gloo": rounded(bf16_vs_gloo, 3),
        "int8_vs_gloo": rounded(int8_vs_gloo, 3),
        "exchange_vs_tcp": rounded(vs_tcp, 3),
        "speedup_vs_hivemind": rounded(speedup, 2),
        "vs_hivemind": rounded(None if speedup is None else 1 / speedup, 3),
        "hivemind_measured": measured,
        "hivemind_s": rounded(median.get("hivemind"), 4),
        "speedup_vs_hivemind_reference": None if measured else round(reference, 2),
        "hivemind_reference_s": None if measured else HIVEMIND_S,
    }
    for codec in CODECS + NEW_CODECS:
        figures[f"full_{codec}_vs_gloo"] = rounded(ratio(f"full {codec}", "gloo 2x"), 3)
    figures |= {
        "exchange_s": round(median["fp32"], 4),
        **{f"{slug(m)}_s": round(median[m], 4) for m in methods if m not in ("fp32", "hivemind")},
        "peak_extra_rss_x_model": round(extra["fp32"], 2),
        **{f"{slug(m)}_peak_extra_rss_x_model": round(extra[m], 2)
           for m in methods if exchange_spec(m) and m != "fp32"},
        **{f"cpu_s_{side}_{slug(m)}": round(cpu[m], 4)
           for m in methods for side, cpu in (("a", cpu_a), ("b", cpu_b))},
        "exchange_cpu_s": round(cpu_a["fp32"], 4),
        "gloo_cpu_s": round(cpu_a["gloo"], 4),
        "trials": trials,
        "bytes": model_bytes,
        "loadavg": round(load_before, 2),
    }
    print(json.dumps(figures))


# ---- the workers ------------------------------------------------------------------------


class Link:
    """Messages to the other workers, relayed by the parent through stdin/stdout (to the
    peer unless ``to`` names another), and the worker's result for the parent."""

    def send(self, op: str, **fields) -> None:
        print(json.dumps({"op": op, **fields}), flush=True)

    async def receive(self, op: str | None = None) -> dict:
        line = await trio.to_thread.run_sync(sys.stdin.readline)
        if not line:
            raise SystemExit("the other worker is gone")
        message = json.loads(line)
        if op is not None and message["op"] != op:
            raise SystemExit(f"expected {op!r} from the other worker, got {message['op']!r}")
        return message

    def result(self, **data) -> None:
        print(json.dumps({"result": data}), flush=True)


def worker(role: str, key: bytes, trials: int, hivemind: bool) -> None:
    prepare(role)
    from gossip.tensors import CODECS as AVAILABLE

    codecs = CODECS + tuple(c for c in NEW_CODECS if c in AVAILABLE)
    methods = (*codecs, *(f"full {c}" for c in codecs), *GLOO, "duplex", "oneway",
               *(["hivemind"] if hivemind else []))
    Bench(Link(), build_model(NUMEL), key, methods).run(role, trials)


def prepare(role: str) -> None:
    """Import and set up torch in a worker, before any model is built."""
    # Imported here so that the parent stays small; everything is imported before the model
    # is built, so that the resident set measured after it holds the libraries too.
    import torch
    import torch.distributed  # noqa: F401

    import gossip  # noqa: F401

    # Two processes share this machine's cores, as torchrun's workers do, and like torchrun
    # each gets one intra-op thread: otherwise both would spread every torch operation over
    # all cores, and their threads would wait on each other (every method here pays alike).
    torch.set_num_threads(1)
    torch.manual_seed(1 if role == "a" else 2)


def build_model(numel: int, device: str = "cpu"):
    """A module of ``numel`` float32 parameters in :data:`PARTS` equal tensors, random, on
    ``device``."""
    import torch

    model = torch.nn.Module()
    for i in range(PARTS):
        model.register_parameter(f"w{i}", torch.nn.Parameter(torch.randn(numel // PARTS)))
    return model.to(device)


def _cpu() -> float:
    """CPU seconds this process has used so far, user and system, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _status(field: str) -> int:
    """A ``/proc/self/status`` size in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


class Bench:
    """One worker's side of every method. *a* (:meth:`initiator`) drives and times; *b*
    (:meth:`responder`) follows the messages *a* sends it.

    Args:
        methods: what the rounds time, in their first round's order (the class's
            :attr:`methods` if None): exchanges (:func:`exchange_spec`), :data:`GLOO`'s,
            the keys of :attr:`tcp`, and ``hivemind`` (whose peers the parent runs).
    """

    methods = METHODS
    who = "a"  # how a's progress lines begin

    def __init__(self, link: Link, model, key: bytes, methods=None) -> None:
        if methods is not None:
            self.methods = tuple(methods)
        self.link = link
        self.model = model
        self.key = key
        self.model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        # Plain TCP sends the parameters' bytes from host memory (a copy, for a GPU model).
        self.payload = [memoryview(p.detach().cpu().numpy()).cast("B")
                        for p in model.parameters()]
        self.nodes: dict = {}  # by exchange method
        self.warm: dict = {}  # statistics() after each exchange method's warm-up
        self.optimizer = None  # what the nodes keeping a drift correction hook into
        self.flats: dict = {}  # gloo's tensors, by method
        self.inbox: memoryview | None = None  # plain TCP's receive buffer
        self.port = 0  # b's plain TCP server
        # The plain TCP methods: whether b sends too, and the bytes each way. Their order
        # numbers them on the wire and is that of their warm-ups; the last one's peak RSS
        # is measured, and it covers all of them (they share the receive buffer).
        self.tcp: dict[str, tuple[bool, int]] = {"oneway": (False, self.model_bytes),
                                                 "duplex": (True, self.model_bytes)}
        self.extra_rss: dict[str, int] = {}
        self._rss = 0
        self._marked = 0.0  # b: our CPU time at a's last go-ahead

    # ---- memory -----------------------------------------------------------------------

    def mark(self) -> None:
        """Hand freed heap memory back to the system (glibc's ``malloc_trim``), so that a
        method's buffers cannot reuse what an earlier one freed, then reset the peak
        resident set to the current one (Linux: 5 into clear_refs)."""
        trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc only
        if trim is not None:
            trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self._rss = _status("VmRSS")

    def peak(self, method: str) -> None:
        self.extra_rss[method] = _status("VmHWM") - self._rss
        self.gradients(False)  # the set-up's, if any

    # ---- set-up -----------------------------------------------------------------------

    def gradients(self, on: bool) -> None:
        """Give every parameter a random gradient, or none. A node that keeps a drift
        correction sends its estimate only once it has one, after an optimizer step; the
        gradient is made before a method's memory is marked, and dropped after its peak."""
        import torch

        for p in self.model.parameters():
            p.grad = torch.randn_like(p) if on else None

    async def open_node(self, stack: AsyncExitStack, method: str, bootstrap: str | None):
        import torch

        from gossip import AveragingConfig, NodeConfig, Swarm, open_swarm

        codec, full = exchange_spec(method)
        config = NodeConfig(listen="127.0.0.1:0", bootstrap=[bootstrap] if bootstrap else [],
                            averaging=AveragingConfig(every=None, interval=None, codec=codec,
                                                      start="own", correction=full,
                                                      trust_after=0.0))
        if full and self.optimizer is None:
            # Learning rate 0: the step that gives the correction its estimate moves nothing.
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.0)
        node = await stack.enter_async_context(open_swarm(
            self.model, Swarm(f"bench-{method.replace(' ', '-')}", self.key), config,
            optimizer=self.optimizer if full else None))
        if full:
            self.optimizer.step()  # through the node's hook: its estimate, from the gradient
        self.nodes[method] = node
        return node

    @staticmethod
    async def wait_for_peer(node) -> None:
        while not node.roster.alive(ready=True):
            await node.roster.wait_changed()

    async def join_gloo(self, stack: AsyncExitStack, store, rank: int) -> None:
        import torch.distributed as dist

        await trio.to_thread.run_sync(partial(dist.init_process_group, "gloo", store=store,
                                              rank=rank, world_size=2))
        stack.callback(dist.destroy_process_group)

    def flatten(self, method: str) -> None:
        """Build ``method``'s flat tensor: the model, :data:`GLOO` times over."""
        import torch

        with torch.no_grad():
            self.flats[method] = torch.cat(
                [p.detach().reshape(-1) for p in self.model.parameters()] * GLOO[method])

    async def gloo_step(self, method: str) -> tuple[float, float]:
        import torch.distributed as dist

        flat = self.flats[method]

        def step() -> tuple[float, float]:
            dist.barrier()
            start, cpu = time.perf_counter(), _cpu()
            dist.all_reduce(flat)
            return time.perf_counter() - start, _cpu() - cpu

        timing = await trio.to_thread.run_sync(step)
        flat.div_(2)  # the average, so values stay where they were (not timed)
        return timing

    async def send_payload(self, stream: trio.SocketStream, nbytes: int) -> None:
        """Send the first ``nbytes`` of the model's memory."""
        for view in self.payload:
            view = view[:nbytes]
            for offset in range(0, len(view), CHUNK):
                await stream.send_all(view[offset : offset + CHUNK])
            nbytes -= len(view)

    async def receive(self, stream: trio.SocketStream, nbytes: int) -> None:
        got = 0
        while got < nbytes:
            n = await stream.socket.recv_into(self.inbox[got:nbytes])
            if n == 0:
                raise SystemExit("plain TCP: connection closed early")
            got += n

    # ---- a --------------------------------------------------------------------------------

    def run(self, role: str, trials: int) -> None:
        """Run this worker's side to the end: ``trials`` rounds, driven by *a*."""
        if role == "a":
            trio.run(self.initiator, trials)
        else:
            trio.run(self.responder)

    async def initiator(self, trials: int) -> None:
        times: dict[str, list[float]] = {m: [] for m in self.methods}
        cpu: dict[str, list[float]] = {m: [] for m in self.methods}
        cpu_b: dict[str, list[float]] = {m: [] for m in self.methods}
        async with AsyncExitStack() as stack:
            for method in self.methods:
                if exchange_spec(method):
                    await self.set_up_node(stack, method)
            for method in self.methods:
                if method in GLOO:
                    await self.set_up_gloo(stack, method)
            await self.set_up_tcp()
            if "hivemind" in self.methods:
                self.link.send("hivemind set up", to="ha")
                await self.link.receive("hivemind ready")
                await self.warm_up("hivemind", peak=False)

            for round_ in range(trials):
                turn = round_ % len(self.methods)
                for method in self.methods[turn:] + self.methods[:turn]:
                    seconds, cpu_a, cpu_other = await self.trial(method)
                    times[method].append(seconds)
                    cpu[method].append(cpu_a)
                    cpu_b[method].append(cpu_other)
                    print(f"{self.who}: round {round_ + 1}/{trials} {method:9s} {seconds:.3f} s",
                          file=sys.stderr, flush=True)
            self.link.send("done")
            if "hivemind" in self.methods:
                self.link.send("done", to="ha")
            self.report("a", methods=self.methods, times=times, cpu=cpu, cpu_b=cpu_b)

    async def set_up_node(self, stack: AsyncExitStack, method: str) -> None:
        """Open a's node for ``method``, have b join it, and warm it up."""
        self.gradients(exchange_spec(method)[1])
        self.mark()
        node = await self.open_node(stack, method, None)
        self.link.send("join", method=method, address=node.address)
        await self.wait_for_peer(node)
        await self.link.receive("ready")
        await self.warm_up(method)  # which allocates the node's buffers
        self.warm[method] = node.statistics()

    async def set_up_gloo(self, stack: AsyncExitStack, method: str) -> None:
        """Join the gloo process group with b (the first gloo method), build ``method``'s
        tensor on both sides, and warm it up."""
        import torch.distributed as dist

        self.mark()
        if dist.is_initialized():
            self.link.send("gloo set up", method=method)
        else:
            store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
            self.link.send("gloo set up", method=method, port=store.port)
            await self.join_gloo(stack, store, 0)
        self.flatten(method)
        await self.warm_up(method)

    async def set_up_tcp(self) -> None:
        """Start b's plain TCP server and warm up every plain TCP method."""
        self.mark()
        self.inbox = memoryview(bytearray(self.model_bytes + 1))
        self.link.send("tcp")
        self.port = (await self.link.receive("tcp"))["port"]
        for method in self.tcp:
            await self.warm_up(method, peak=method == list(self.tcp)[-1])

    async def warm_up(self, method: str, peak: bool = True) -> None:
        seconds, _, _ = await self.trial(method)
        if peak:
            self.link.send("peak", method=method)
            self.peak(method)
        print(f"{self.who}: {method:9s} warm-up {seconds:.3f} s", file=sys.stderr, flush=True)

    async def trial(self, method: str) -> tuple[float, float, float]:
        """One timed trial of ``method``; returns wall seconds, and a's and b's CPU seconds."""
        from gossip import Result

        link = self.link
        if exchange_spec(method):
            node = self.nodes[method]
            link.send("mark")
            await link.receive("marked")
            start, cpu = time.perf_counter(), _cpu()
            result = await node.average_now()
            timing = time.perf_counter() - start, _cpu() - cpu
            if result is not Result.COMMITTED:
                raise SystemExit(f"{method} exchange: {result}")
            node.apply_pending()
            link.send("apply", method=method, committed=node.statistics().committed)
            return (*timing, (await link.receive("applied"))["cpu"])
        if method in GLOO:
            link.send("gloo", method=method)
            timing = await self.gloo_step(method)
            return (*timing, (await link.receive("gloo done"))["cpu"])
        if method == "hivemind":
            link.send("hivemind", to="ha")
            reply = await link.receive("hivemind done")
            return reply["seconds"], reply["cpu"], reply["cpu_b"]
        duplex, nbytes = self.tcp[method]
        link.send("mark")
        await link.receive("marked")
        start, cpu = time.perf_counter(), _cpu()
        stream = await trio.open_tcp_stream("127.0.0.1", self.port)
        async with stream:
            await stream.send_all(bytes([list(self.tcp).index(method)]))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.send_payload, stream, nbytes)
                await self.receive(stream, nbytes + 1 if duplex else 1)
            timing = time.perf_counter() - start, _cpu() - cpu
        return (*timing, (await link.receive("closed"))["cpu"])

    def report(self, role: str, **fields) -> None:
        exchange = {}
        for method, node in self.nodes.items():
            # statistics() after the warm-up and now, so that the warm-up counts in neither.
            now, warm = node.statistics(), self.warm[method]
            n = now.committed - warm.committed
            if exchange_spec(method)[1] and now.corrected - warm.corrected != n:
                raise SystemExit(f"{method}: {now.corrected - warm.corrected} of {n} exchanges "
                                 "carried the drift correction, not all")
            exchange[method] = {
                "mean_duration": (now.mean_duration * now.committed
                                  - warm.mean_duration * warm.committed) / n,
                "bytes_sent": (now.bytes_sent - warm.bytes_sent) / n,
                "bytes_received": (now.bytes_received - warm.bytes_received) / n,
            }
        self.link.result(role=role, model_bytes=self.model_bytes, extra_rss=self.extra_rss,
                         exchange=exchange, **fields)

    # ---- b --------------------------------------------------------------------------------

    async def responder(self) -> None:
        # The TCP server's nursery outlives the nodes, whose contexts open later inside it.
        async with trio.open_nursery() as nursery:
            async with AsyncExitStack() as stack:
                while (message := await self.link.receive())["op"] != "done":
                    await self.follow(message, stack, nursery)
                self.report("b")
            nursery.cancel_scope.cancel()

    async def follow(self, message: dict, stack: AsyncExitStack, nursery: trio.Nursery) -> None:
        """Do b's part of what a's ``message`` asks."""
        op, link = message["op"], self.link
        if op == "join":
            self.gradients(exchange_spec(message["method"])[1])
            self.mark()
            node = await self.open_node(stack, message["method"], message["address"])
            await self.wait_for_peer(node)
            link.send("ready")
        elif op == "mark":
            self._marked = _cpu()
            link.send("marked")
        elif op == "apply":
            node = self.nodes[message["method"]]
            # a returns on our Commit and we apply on its Commit, which may still be in
            # flight: poll for it (not timed).
            while node.statistics().committed < message["committed"]:
                await trio.sleep(0.001)
            cpu = _cpu() - self._marked
            node.apply_pending()
            self.warm.setdefault(message["method"], node.statistics())
            link.send("applied", cpu=cpu)
        elif op == "gloo set up":
            import torch.distributed as dist

            self.mark()
            if "port" in message:
                store = await trio.to_thread.run_sync(
                    partial(dist.TCPStore, "127.0.0.1", message["port"], 2, is_master=False))
                await self.join_gloo(stack, store, 1)
            self.flatten(message["method"])
        elif op == "gloo":
            _, cpu = await self.gloo_step(message["method"])
            link.send("gloo done", cpu=cpu)
        elif op == "tcp":
            self.mark()
            self.inbox = memoryview(bytearray(self.model_bytes))
            listeners = await nursery.start(
                partial(trio.serve_tcp, self.serve_tcp, 0, host="127.0.0.1"))
            link.send("tcp", port=listeners[0].socket.getsockname()[1])
        elif op == "peak":
            self.peak(message["method"])
        else:
            raise SystemExit(f"unexpected message {op!r}")

    async def serve_tcp(self, stream: trio.SocketStream) -> None:
        async with stream:
            mode = bytearray(1)  # a's first byte: which of self.tcp (0 one way, 1 full duplex)
            if await stream.socket.recv_into(mode) != 1:
                raise SystemExit("plain TCP: connection closed early")
            duplex, nbytes = list(self.tcp.values())[mode[0]]
            async with trio.open_nursery() as nursery:
                if duplex:
                    nursery.start_soon(self.send_payload, stream, nbytes)
                await self.receive(stream, nbytes)
            await stream.send_all(b"\x01")
            await stream.receive_some(1)  # a's close
        # so that a's next trial cannot overlap this one
        self.link.send("closed", cpu=_cpu() - self._marked)


if __name__ == "__main__":
    main()
