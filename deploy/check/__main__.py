"""``make deploy-check``: the deployment files under deploy/, run for real on this machine.

1. tools: podman, debootstrap, systemd-nspawn and runc (installed with apt where missing),
   podman-compose (into a venv in the cache);
2. base: a minimal Debian made with debootstrap and imported into podman, the image's base
   without a registry (the Dockerfile's BASE_CPU argument);
3. image: deploy/container/Dockerfile built with podman, torch's CPU build from PyTorch's
   index or, where that does not answer, the one this machine's pip finds;
4. compose: deploy/compose.yaml under podman-compose (deploy/check/compose.py);
5. systemd: a booted Debian under systemd-nspawn running deploy/systemd/ as the docs
   install it (deploy/check/systemd.py);
6. kubernetes: the StatefulSet's pods under ``podman kube play`` (deploy/check/kube.py).

Not part of ``make test``: it needs root and about 20 minutes the first time (the base
system and the torch wheel are cached, in ~/.cache/gossipd-deploy-check by default; later
runs take about 10). It prints a table (step, result, seconds) and, last, one JSON line. A
step that cannot run here (no root, no podman, no nspawn) is skipped, saying why; exit code 0
unless a step failed. Every command and its output go to the log it names.

Usage: python3 deploy/check [--only image,compose,systemd,kubernetes] [--cache DIR] [--keep]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

from common import Context, Failed, Skip
from image import restore_image

STEPS: list[tuple[str, str, tuple[str, ...]]] = [
    # name, the function it runs (module:name in deploy/check/), the steps it needs
    ("tools", "image:check_tools", ()),
    ("base", "image:make_base", ("tools",)),
    ("image", "image:build_image", ("base",)),
    ("compose", "compose:check_compose", ("image",)),
    ("systemd", "systemd:check_systemd", ("tools",)),
    ("kubernetes", "kube:check_kube", ("image",)),
]
CHOSEN = ("image", "compose", "systemd", "kubernetes")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deploy-check", description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=",".join(CHOSEN),
                        help="comma-separated: " + ", ".join(CHOSEN) + " (the steps they "
                        "need run too)")
    parser.add_argument("--cache", type=Path,
                        default=Path.home() / ".cache" / "gossipd-deploy-check")
    parser.add_argument("--keep", action="store_true", help="keep this run's work folder")
    args = parser.parse_args(argv)
    chosen = set(args.only.split(","))
    unknown = chosen - set(CHOSEN)
    if unknown:
        parser.error(f"unknown step {', '.join(sorted(unknown))}; choose from "
                     + ", ".join(CHOSEN))
    wanted = _with_needs(chosen)
    if sys.platform != "linux" or os.geteuid() != 0:
        why = "needs root on Linux (podman's networks, debootstrap, systemd-nspawn)"
        print(f"deploy-check: skipped: {why}")
        _table([(name, "skipped", 0.0, why) for name, _, _ in STEPS if name in wanted], 0.0)
        print(json.dumps({"check": "deploy", "ok": True, "seconds": 0.0, "results": {
            name: "skipped" for name, _, _ in STEPS if name in wanted}, "skipped": why}))
        return 0
    args.cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gossipd-deploy-check-", dir="/var/tmp"))
    ctx = Context(cache=args.cache, work=work, log=args.cache / "deploy-check.log")
    ctx.log.write_text("")
    ctx.say(f"log: {ctx.log}")
    rows: list[tuple[str, str, float, str]] = []
    results: dict[str, str] = {}
    found: dict[str, dict[str, object]] = {}  # each step's figures
    started = time.monotonic()
    try:
        for name, step, needs in STEPS:
            if name not in wanted:
                continue
            missing = [n for n in needs if results.get(n) != "ok"]
            if missing:
                results[name] = "skipped"
                rows.append((name, "skipped", 0.0, f"needs {', '.join(missing)}"))
                continue
            ctx.say(f"{name} ...")
            begun = time.monotonic()
            try:
                module, function = step.split(":")
                run: Callable[[Context], dict[str, object]] = getattr(
                    importlib.import_module(module), function)
                figures = run(ctx)
                results[name], note = "ok", _brief(figures)
                found[name] = figures
            except Skip as e:
                results[name], note = "skipped", str(e)
            except Failed as e:
                results[name], note = "FAILED", str(e)
            except Exception as e:  # a defect of the check, or of the machine: the rest runs
                results[name], note = "FAILED", f"{type(e).__name__}: {e}"
                with ctx.log.open("a") as f:
                    f.write(traceback.format_exc())
            seconds = time.monotonic() - begun
            rows.append((name, results[name], seconds, note))
            ctx.say(f"{name}: {results[name]} in {seconds:.0f} s" + (f": {note}" if note else ""))
    finally:
        restore_image(ctx)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    total = time.monotonic() - started
    _table(rows, total)
    failed = [n for n, r in results.items() if r == "FAILED"]
    passed = [n for n, r in results.items() if r == "ok"]
    print(json.dumps({"check": "deploy", "ok": not failed, "passed": passed,
                      "seconds": round(total, 1), "results": results, **found}, default=str))
    return 1 if failed else 0


def _with_needs(chosen: set[str]) -> set[str]:
    needs = {name: n for name, _, n in STEPS}
    wanted, todo = set(), list(chosen)
    while todo:
        name = todo.pop()
        if name not in wanted:
            wanted.add(name)
            todo.extend(needs[name])
    return wanted


def _brief(figures: dict[str, object]) -> str:
    return ", ".join(f"{k}={v}" for k, v in figures.items()
                     if isinstance(v, (int, float, str)))[:90]


def _table(rows: list[tuple[str, str, float, str]], total: float) -> None:
    print(f"\n{'step':<12} {'result':<8} {'seconds':>8}  note")
    for name, result, seconds, note in rows:
        first = note.splitlines()[0] if note else ""
        print(f"{name:<12} {result:<8} {seconds:>8.1f}  {first}")
    print(f"{'total':<12} {'':<8} {total:>8.1f}")


if __name__ == "__main__":
    sys.exit(main())
