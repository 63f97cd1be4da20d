"""``make gpu-check``: everything that needs a GPU to check, in one command, offline.

For a machine with an NVIDIA GPU and a CUDA build of torch, and possibly no network (an
air-gapped cluster node): it installs what else gossipd needs from a folder of wheels, then
runs, each with its own time limit and log:

1. every test in the test files that touch CUDA (the CUDA tests themselves, and the CPU tests
   beside them, which must still pass with a GPU present: the device resolver picks it up);
2. ``gossipd demo`` twice at once with the default config (``task.device = "auto"``: the
   GPU), three daemons for ``--demo-seconds`` each, scored against the central baseline;
3. ``bench/overhead.py`` with both daemons on the GPU and a 100.7M-parameter model (403 MB);
4. ``bench/exchange.py`` with each worker's 100M-parameter model on the GPU, fp32, bf16 and
   int8;
5. ``bench/lowcomm.py --gpu`` in short: the 25M-parameter LM, DiLoCo and gossipd at H = 20
   for 400 steps a node (its ``gpu_*`` figures).

It prints a table and, last, one JSON line with the figures. On a machine without a GPU (no
torch, a CPU build, or no driver) it says so and exits 0 without running anything. Exit code
1 when a test failed or a step did not finish; 2 when a dependency is missing.

The wheels: on a machine with network access and the target's Python version, ``make
gpu-wheels WHEELS=dir PYVER=3.12`` downloads them (docs/DAEMON.md, "Devices"); copy the
folder over and run ``make gpu-check WHEELS=dir``. Wheels for torch and its CUDA libraries in
the folder are skipped (the machine's own torch is used), and so is every package the machine
already has at a version gossipd accepts; the rest go into a folder of their own (``--site``,
a temporary one by default), never into the system's packages.

Usage: python3 bench/gpu_check.py [--wheels DIR] [--out DIR] [--only tests,demo,...]
       [--demo-seconds 45] [--site DIR] [--cpu]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("tests", "demo", "overhead", "exchange", "lowcomm")
# Imports every step needs, with the lowest version gossipd accepts (pyproject.toml): the
# distribution, the module, the version (None: any).
NEEDED = [
    ("trio", "trio", "0.25"), ("cbor2", "cbor2", "6.1"), ("cryptography", "cryptography", "42"),
    ("prometheus_client", "prometheus_client", "0.17"), ("numpy", "numpy", None),
    ("pytest", "pytest", "8"), ("pytest-trio", "pytest_trio", "0.8"),
    ("pytest-timeout", "pytest_timeout", "2.3"), ("hypothesis", "hypothesis", "6.100"),
    ("scikit-learn", "sklearn", "1.3"), ("PyYAML", "yaml", None),
]
SKIPPED_WHEELS = re.compile(r"^(torch|torchvision|torchaudio|triton|nvidia[-_].*)$", re.I)
# Seconds each step may take; the first four steps took 5 minutes on one H200, lowcomm is
# sized (not yet measured on a GPU) to end within its limit.
LIMITS = {"tests": 180, "demo": 150, "overhead": 170, "exchange": 110, "lowcomm": 360}
OVERHEAD = ["--quick", "--device", "cuda", "--width", "4096", "--depth", "6", "--batch", "256"]
EXCHANGE = ["--sizes", "100", "--trials", "3", "--device", "cuda", "--codecs", "fp32,bf16,int8"]
# The 25M-parameter LM of bench/lowcomm.py --gpu, DiLoCo and gossipd, at H = 20 (the wide
# plan's smallest spacing) for 400 steps a node, 20 syncs: the short form that fits the check
# (the swarm's 480 exchanges of 27 MB run one after another in one process); the full one
# (every method, H = 100 and 500) is bench/lowcomm.py --gpu, hours of one GPU.
LOWCOMM = ["--gpu", "--hs", "20", "--least", "400", "--methods", "diloco,gossipd",
           "--device", "cuda"]


def say(text: str) -> None:
    print(text, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", type=Path, help="a folder of wheels to install from")
    parser.add_argument("--site", type=Path, help="where to install them (default: a new "
                        "temporary folder)")
    parser.add_argument("--out", type=Path, help="where the logs go (default: a new "
                        "temporary folder)")
    parser.add_argument("--only", default=",".join(STEPS),
                        help=f"steps to run, comma-separated (default {','.join(STEPS)})")
    parser.add_argument("--demo-seconds", type=float, default=45.0,
                        help="how long each demo trains (default 45)")
    parser.add_argument("--cpu", action="store_true",
                        help="a dry run of every step on the CPU, small (to try this script "
                             "on a machine without a GPU): no figure of it means anything")
    args = parser.parse_args()
    steps = [s for s in args.only.split(",") if s]
    if any(s not in STEPS for s in steps):
        parser.error(f"--only: each of {', '.join(STEPS)}")

    gpu = ({"name": "cpu (dry run)", "torch": "", "cuda": "none"} if args.cpu
           else cuda_device())
    if args.cpu:
        global OVERHEAD, EXCHANGE, LOWCOMM
        OVERHEAD = ["--quick", "--device", "cpu"]
        EXCHANGE = ["--sizes", "1", "--trials", "2", "--device", "cpu",
                    "--codecs", "fp32,bf16,int8"]
        LOWCOMM = ["--gpu", "--hs", "2", "--least", "8", "--methods", "diloco,gossipd",
                   "--device", "cpu", "--lm", "d_model=32",
                   "--lm", "layers=1", "--lm", "heads=2", "--lm", "context=16",
                   "--lm", "eval_windows=8"]
    if gpu is None:
        say("gpu-check: no CUDA device here (no torch, a CPU build of torch, or no driver): "
            "nothing to check")
        say(json.dumps({"gpu": None, "skipped": "no CUDA device"}))
        return 0
    out = args.out or Path(tempfile.mkdtemp(prefix="gossipd-gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    paths = [str(ROOT)]
    if args.wheels is not None:
        site = args.site or Path(tempfile.mkdtemp(prefix="gossipd-site-"))
        install(args.wheels, site)
        paths.insert(0, str(site))
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    missing = check_imports(env)
    if missing:
        say("gpu-check: missing or too old here: " + ", ".join(missing) + ". Make a folder of "
            "wheels on a connected machine (make gpu-wheels WHEELS=dir PYVER=<this Python's "
            "version>, docs/DAEMON.md) and run make gpu-check WHEELS=dir")
        return 2
    say(f"gpu-check: {gpu['name']}, torch {gpu['torch']} (CUDA {gpu['cuda']}), Python "
        f"{sys.version.split()[0]}; logs in {out}")

    started = time.monotonic()
    figures: dict[str, Any] = {"gpu": gpu["name"], "torch": gpu["torch"]}
    ok = True
    for step in steps:
        t0 = time.monotonic()
        result = STEP_FUNCTIONS[step](env, out, args)
        result["seconds"] = round(time.monotonic() - t0, 1)
        figures[step] = result
        ok &= result.get("ok", False)
        say(f"  {step:<9} {'ok' if result.get('ok') else 'FAILED':<7} {result['seconds']:>6.1f} s  "
            + summary(step, result))
    figures["seconds"] = round(time.monotonic() - started, 1)
    say(f"gpu-check: {'everything ran' if ok else 'something FAILED'} in "
        f"{figures['seconds']:.0f} s")
    say(json.dumps(flatten(figures)))
    return 0 if ok else 1


# ---- the machine ------------------------------------------------------------------------


def cuda_device() -> dict[str, str] | None:
    """The first GPU's name and the torch and CUDA versions, or None without one."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return {"name": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "cuda": str(torch.version.cuda)}


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def have(distribution: str, minimum: str | None) -> bool:
    try:
        found = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return minimum is None or version_tuple(found) >= version_tuple(minimum)


def install(wheels: Path, site: Path) -> None:
    """Install the wheels of ``wheels`` that this machine needs into ``site``."""
    files = sorted(wheels.glob("*.whl"))
    if not files:
        raise SystemExit(f"gpu-check: no wheels in {wheels}")
    minimum = {name.lower().replace("_", "-"): v for name, _, v in NEEDED}
    chosen = []
    for wheel in files:
        name = wheel.name.split("-")[0]
        key = name.lower().replace("_", "-")
        if SKIPPED_WHEELS.match(name):
            continue  # the machine's own torch and CUDA libraries stay
        if have(key, minimum.get(key)):
            continue
        chosen.append(wheel)
    site.mkdir(parents=True, exist_ok=True)
    say(f"gpu-check: installing {len(chosen)} of {len(files)} wheels into {site}: "
        + (", ".join(w.name.split("-")[0] for w in chosen) or "none needed"))
    if not chosen:
        return
    pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True)
    if pip.returncode == 0:
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index",
                               "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade",
                               "--target", str(site), *map(str, chosen)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            said = (done.stderr.strip().splitlines() or ["(nothing)"])[-1]
            raise SystemExit(f"gpu-check: the wheels in {wheels} do not install here (made "
                             f"for another Python version or platform? this is Python "
                             f"{sys.version.split()[0]}): pip said: {said}")
        return
    for wheel in chosen:  # no pip: a wheel is a zip of what goes into site-packages
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(site)


def check_imports(env: dict[str, str]) -> list[str]:
    """What is missing or too old, as the steps' processes will see it."""
    code = ("import importlib, importlib.metadata, json, re, sys\n"
            f"needed = {NEEDED!r}\n"
            "bad = []\n"
            "v = lambda t: tuple(int(p) for p in re.findall(r'\\d+', t)[:3])\n"
            "for dist, module, least in needed:\n"
            "    try:\n"
            "        importlib.import_module(module)\n"
            "        found = importlib.metadata.version(dist)\n"
            "    except Exception:\n"
            "        bad.append(dist); continue\n"
            "    if least and v(found) < v(least):\n"
            "        bad.append(f'{dist} {found} (needs >= {least})')\n"
            "print(json.dumps(bad))\n")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        return [f"python itself ({done.stderr.strip()[-200:]})"]
    return json.loads(done.stdout)


def run(command: list[str], env: dict[str, str], log: Path, limit: float) -> tuple[int, str]:
    """Run ``command`` in the repository, its output into ``log``; (exit code, output). A
    command past ``limit`` seconds is stopped (code 124)."""
    return finish(start(command, env, log), log, limit)


def start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """Start ``command`` in the repository, in a session of its own, its output into ``log``."""
    with open(log, "w") as f:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)


def finish(process: subprocess.Popen, log: Path, deadline: float) -> tuple[int, str]:
    """Wait for ``process`` until ``deadline`` seconds from now, then stop it (code 124);
    (exit code, its log)."""
    try:
        code = process.wait(deadline)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 15)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()
        code = 124
    return code, log.read_text(errors="replace")


def last_json(text: str) -> dict[str, Any] | None:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


# ---- the steps --------------------------------------------------------------------------


def cuda_test_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                  if "cuda" in p.read_text())


def step_tests(env: dict[str, str], out: Path, args: argparse.Namespace) -> dict[str, Any]:
    files = cuda_test_files()
    # The project's pytest plugin (fixtures some tests use) comes by its entry point once the
    # project is installed; from the checkout alone, it is named here.
    installed = any(e.name == "gossipd"
                    for e in importlib.metadata.entry_points(group="pytest11"))
    plugin = [] if installed else ["-p", "daemon.pytest_plugin"]
    # Two pytest processes at once: the end-to-end files (daemons in subprocesses, most of
    # the time) beside the unit files.
    groups = {"tests": [f for f in files if "/e2e/" not in f],
              "tests-e2e": [f for f in files if "/e2e/" in f]}
    started = {name: start([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            *plugin, f"--junitxml={out / name}.xml", *group], env,
                           out / f"{name}.log")
               for name, group in groups.items() if group}
    until = time.monotonic() + LIMITS["tests"]
    codes, cuda = [], 0
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures = []
    for name, process in started.items():
        code, text = finish(process, out / f"{name}.log", max(1.0, until - time.monotonic()))
        codes.append(code)
        cuda += sum(1 for line in text.splitlines() if "needs CUDA" in line)
        junit = out / f"{name}.xml"
        if not junit.exists():
            continue
        import xml.etree.ElementTree as ElementTree
        for case in ElementTree.parse(junit).iter("testcase"):
            kinds = {child.tag for child in case}
            if kinds & {"failure", "error"}:
                counts["failed"] += 1
                failures.append(f"{case.get('classname')}::{case.get('name')}"[:160])
            elif "skipped" in kinds:
                counts["skipped"] += 1
            else:
                counts["passed"] += 1
    code = next((c for c in codes if c != 0), 0)
    return {"ok": code == 0 and counts["failed"] == 0 and counts["passed"] > 0, "exit": code,
            "files": len(files), **counts, "skipped_for_no_cuda": cuda,
            "failures": failures[:20]}


def step_demo(env: dict[str, str], out: Path, args: argparse.Namespace) -> dict[str, Any]:
    # Both runs at once: six daemons of a small model are far from filling a GPU or sixteen
    # cores, and the check stays within its minutes.
    dry = ["--set", "task.device=cpu"] if args.cpu else []
    started = {i: start([sys.executable, "-m", "daemon", "demo", "--nodes", "3", "--seconds",
                         f"{args.demo_seconds:g}", "--dir", str(out / f"demo{i}"), *dry], env,
                        out / f"demo{i}.log") for i in (1, 2)}
    until = time.monotonic() + LIMITS["demo"]
    runs = []
    for i, process in started.items():
        directory = out / f"demo{i}"
        code, text = finish(process, out / f"demo{i}.log", max(1.0, until - time.monotonic()))
        figures = last_json(text) or {}  # the demo's closing line
        logs = sorted(directory.glob("node*/daemon.log"))
        devices = sorted({m.group(1) for log in logs
                          for m in re.finditer(r"device=(\S+)", log.read_text(errors="replace"))})
        runs.append({"exit": code, "devices": devices,
                     "nodes": {name: node["result"]
                               for name, node in (figures.get("nodes") or {}).items()
                               if node.get("result") is not None},
                     "central": figures.get("central"),
                     "worst_points": figures.get("worst_points"),
                     "worst_dip_points": figures.get("worst_dip_points"),
                     "departed": figures.get("departed"), "joined": figures.get("joined")})
    ok = all(r["exit"] == 0 and r["worst_points"] is not None and r["devices"]
             and all(d.startswith("cpu" if args.cpu else "cuda") for d in r["devices"])
             for r in runs)
    return {"ok": ok, "runs": runs,
            "within_2_points": all(r["worst_points"] is not None and r["worst_points"] <= 2.0
                                   for r in runs)}


def step_overhead(env: dict[str, str], out: Path, args: argparse.Namespace) -> dict[str, Any]:
    code, text = run([sys.executable, "bench/overhead.py", *OVERHEAD], env,
                     out / "overhead.log", LIMITS["overhead"])
    figures = last_json(text) or {}
    return {"ok": code == 0 and bool(figures), "exit": code, **{
        k: figures.get(k) for k in ("overhead_ratio", "lost_per_exchange_s", "first_exchange_s",
                                    "first_exchange_max_s", "exchange_s", "steps_per_s_alone",
                                    "params", "device")}}


def step_exchange(env: dict[str, str], out: Path, args: argparse.Namespace) -> dict[str, Any]:
    code, text = run([sys.executable, "bench/exchange.py", *EXCHANGE], env,
                     out / "exchange.log", LIMITS["exchange"])
    figures = last_json(text) or {}
    keep = {k: v for k, v in figures.items() if k.startswith(("exchange_s_", "exchange_vs_tcp_"))}
    return {"ok": code == 0 and bool(figures), "exit": code, **keep}


def step_lowcomm(env: dict[str, str], out: Path, args: argparse.Namespace) -> dict[str, Any]:
    # Without --resume every run is run again: a rerun of the check never reads old runs.
    code, text = run([sys.executable, "bench/lowcomm.py", *LOWCOMM], env, out / "lowcomm.log",
                     LIMITS["lowcomm"])
    figures = last_json(text) or {}
    keep = {k: v for k, v in figures.items() if k.startswith("gpu_") and v is not None}
    return {"ok": code == 0 and bool(keep), "exit": code, **keep}


STEP_FUNCTIONS = {"tests": step_tests, "demo": step_demo, "overhead": step_overhead,
                  "exchange": step_exchange, "lowcomm": step_lowcomm}


def summary(step: str, r: dict[str, Any]) -> str:
    if step == "tests":
        return (f"{r['passed']} passed, {r['failed']} failed, {r['skipped']} skipped in "
                f"{r['files']} files" + (f"; failed: {', '.join(r['failures'])}"
                                         if r["failures"] else ""))
    if step == "demo":
        return "; ".join(
            f"run {i}: worst {run['worst_points']} points below central {run['central']}, "
            f"nodes {run['nodes']} on {','.join(run['devices']) or '?'} (exit {run['exit']})"
            for i, run in enumerate(r["runs"], 1))
    if step == "overhead":
        return (f"ratio {r.get('overhead_ratio')}, lost per exchange {r.get('lost_per_exchange_s')}"
                f" s, first exchange {r.get('first_exchange_s')} s (exit {r.get('exit')})")
    if step == "lowcomm":
        return ", ".join(f"{k} {v}" for k, v in r.items() if k.startswith("gpu_")) + \
            f" (exit {r.get('exit')})"
    return ", ".join(f"{k} {v}" for k, v in r.items() if k.startswith("exchange_s_")) + \
        f" (exit {r.get('exit')})"


def flatten(figures: dict[str, Any]) -> dict[str, Any]:
    """The JSON line: the headline figures, one level deep."""
    line: dict[str, Any] = {"gpu": figures["gpu"], "torch": figures["torch"],
                            "seconds": figures["seconds"]}
    tests = figures.get("tests")
    if tests:
        line |= {"cuda_tests_passed": tests["passed"], "cuda_tests_failed": tests["failed"],
                 "cuda_tests_skipped": tests["skipped"]}
    demo = figures.get("demo")
    if demo:
        line["demo_worst_points"] = [r["worst_points"] for r in demo["runs"]]
        line["demo_worst_dip_points"] = [r["worst_dip_points"] for r in demo["runs"]]
        line["demo_node_accuracy"] = [sorted(r["nodes"].values()) for r in demo["runs"]]
        line["demo_central_accuracy"] = [r["central"] for r in demo["runs"]]
        line["demo_devices"] = sorted({d for r in demo["runs"] for d in r["devices"]})
    for step in ("overhead", "exchange", "lowcomm"):
        r = figures.get(step)
        if r:
            line |= {k: v for k, v in r.items() if k not in ("ok", "exit", "seconds")}
    line["ok"] = all(figures[s].get("ok") for s in STEPS if s in figures)
    return line


if __name__ == "__main__":
    sys.exit(main())
