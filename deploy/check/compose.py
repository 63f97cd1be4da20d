"""The compose step of ``make deploy-check``: deploy/compose.yaml as it is, under
podman-compose, with the image deploy/check/image.py built."""

from __future__ import annotations

import os
import re
import subprocess
import time
from typing import Callable

from common import ROOT, Context, Failed, wait_for

PROJECT = "gossipd-check"
NODES = ("node1", "node2", "node3")
COMPOSE = ROOT / "deploy" / "compose.yaml"
STEPS = re.compile(r"^training\s+(\d+) own steps", re.M)
PEER = re.compile(r"^\s+\w+\s+(node\d):7070\s+alive\b", re.M)
# A checkpoint's name, one per line of ls: its step, and .<k> for a repeat save at that step
# (not .corrupt or .before-jump files, which are set aside).
CHECKPOINT = re.compile(r"^checkpoint-(\d+)(?:\.\d+)?\.ckpt$", re.M)


def container(service: str) -> str:
    return f"{PROJECT}_{service}_1"


def check_compose(ctx: Context) -> dict[str, object]:
    """Up; every node sees the other two and trains; the health check passes; the keys are
    the unprivileged user's, 0600; a node killed with SIGKILL is started again and resumes
    from its volume's checkpoint; down stops every node with exit 0 and a final checkpoint.
    The project's containers and volumes are removed at the end, whatever happened."""
    tool = str(ctx.cache / "compose-venv" / "bin" / "podman-compose")

    def compose(*args: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
        return ctx.sh([tool, "-f", str(COMPOSE), "-p", PROJECT, *args],
                      **kwargs)  # type: ignore[arg-type]

    compose("down", "-v", check=False, timeout=180)  # what a failed run may have left
    figures: dict[str, object] = {}
    try:
        started = time.monotonic()
        compose("up", "-d", timeout=300)
        for node in NODES:
            wait_for(f"{node} to see the other two nodes alive and train",
                     lambda node=node: _sees_peers_and_trains(ctx, node), timeout=90)
        figures["compose_joined_s"] = round(time.monotonic() - started, 1)
        # podman runs a health check on a timer only under systemd: run the image's own.
        for node in NODES:
            ctx.podman("healthcheck", "run", container(node), timeout=60)
        figures["compose_keys"] = _keys(ctx)
        figures["compose_resumed_step"] = _kill_and_restart(ctx, compose, "node2")
        figures["compose_down"] = _down(ctx, compose)
        return figures
    finally:
        compose("down", "-v", check=False, timeout=180)


def _status(ctx: Context, node: str) -> str:
    result = ctx.podman("exec", container(node), "gossipd", "status", check=False, timeout=60)
    return result.stdout if result.returncode == 0 else ""


def _sees_peers_and_trains(ctx: Context, node: str) -> bool:
    first = _status(ctx, node)
    peers = set(PEER.findall(first))
    if peers != set(NODES) - {node} or not STEPS.search(first):
        return False
    time.sleep(1)
    second = STEPS.search(_status(ctx, node))
    return second is not None and int(second[1]) > int(STEPS.findall(first)[0])


def _keys(ctx: Context) -> str:
    """The identity and swarm keys: 0600, the image's unprivileged user's (uid 10001)."""
    for node in NODES:
        for path in ("/var/lib/gossipd/identity.key", "/var/lib/gossipd-keys/swarm.key"):
            stat = ctx.podman("exec", container(node), "stat", "-c", "%a %u %U", path)
            if stat.stdout.split() != ["600", "10001", "gossipd"]:
                raise Failed(f"{node}:{path} is {stat.stdout.strip()}, not 600 10001 gossipd")
    return "0600 gossipd"


def _newest_checkpoint(ctx: Context, node: str) -> int | None:
    """The step of the newest checkpoint in the node's volume (its container running)."""
    result = ctx.podman("exec", container(node), "ls", "/var/lib/gossipd/checkpoints",
                        check=False)
    steps = [int(s) for s in CHECKPOINT.findall(result.stdout)]
    return max(steps) if steps else None


def _kill_and_restart(ctx: Context, compose: Callable[..., object], node: str) -> int:
    """SIGKILL the node's daemon (a crash; podman's own kill counts as a stop), see it exit
    137, start it again unless its restart policy already has, and see it resume its newest
    checkpoint."""
    step = wait_for(f"{node}'s first checkpoint (checkpoint.interval 60 s)",
                    lambda: _newest_checkpoint(ctx, node), timeout=120)

    def state() -> tuple[str, str, str, int]:
        out = ctx.podman("inspect", "--format", "{{.State.Status}} {{.State.ExitCode}} "
                         "{{.State.Pid}} {{.RestartCount}}", container(node)).stdout.split()
        return out[0], out[1], out[2], int(out[3])

    _, _, pid, restarts = state()
    since = str(int(time.time()))
    ctx.sh(["kill", "-KILL", pid])

    def died() -> str | None:
        status, code, now, count = state()
        if count > restarts or (status == "running" and now != pid):
            return "restarted by podman"  # on-failure: podman started it again itself
        if status in ("stopped", "exited"):
            if code != "137":
                raise Failed(f"{node} killed with SIGKILL exited {code}, not 137")
            return "exited 137"
        return None

    if wait_for(f"{node} to die", died, timeout=30, interval=0.2) == "exited 137":
        compose("start", node)
    resumed = re.compile(r"resuming checkpoint=\S+ step=(\d+)")

    def resumed_step() -> int | None:
        logs = ctx.podman("logs", "--since", since, container(node), check=False)
        found = resumed.findall(logs.stdout + logs.stderr)
        return int(found[-1]) if found else None

    got = wait_for(f"{node} to resume from its checkpoint", resumed_step, timeout=60)
    if got < step:
        raise Failed(f"{node} resumed step {got}, older than its checkpoint's {step}")
    wait_for(f"{node} to rejoin and train", lambda: _sees_peers_and_trains(ctx, node),
             timeout=90)
    return got


def _down(ctx: Context, compose: Callable[..., object]) -> dict[str, object]:
    """``down`` (without -v: the volumes stay), watching each node's log to its end: the
    node must stop on SIGTERM, write a checkpoint, and exit 0."""
    before = {node: _newest_checkpoint(ctx, node) or 0 for node in NODES}
    since = str(int(time.time()) - 1)
    logs = {node: subprocess.Popen(["podman", "logs", "--follow", "--since", since,
                                    container(node)], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True,
                                   env={**os.environ, **ctx.podman_env})
            for node in NODES}
    try:
        started = time.monotonic()
        compose("down", timeout=300)
        seconds = time.monotonic() - started
        outs = {node: proc.communicate(timeout=60)[0] for node, proc in logs.items()}
    finally:
        for proc in logs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    events = ctx.podman("events", "--since", since, "--until", str(int(time.time()) + 1),
                        "--filter", "event=died", "--format",
                        "{{.Name}} {{.ContainerExitCode}}").stdout
    codes = dict(line.split()[:2] for line in events.splitlines() if len(line.split()) >= 2)
    final: dict[str, int] = {}
    for node, out in outs.items():
        with ctx.log.open("a") as f:
            f.write(f"## {node}'s log while stopping\n{out}\n")
        if codes.get(container(node)) != "0":
            raise Failed(f"{node} exited {codes.get(container(node))} on down, not 0")
        stopping = out.find("stopping signal=SIGTERM")
        written = re.findall(r"checkpoint path=\S+ step=(\d+)", out[stopping:])
        if stopping < 0 or not written:
            raise Failed(f"{node} wrote no final checkpoint after SIGTERM")
        final[node] = int(written[-1])
        if final[node] < before[node]:
            raise Failed(f"{node}'s final checkpoint {final[node]} is older than {before[node]}")
    return {"seconds": round(seconds, 1), "exit_codes": [0, 0, 0],
            "final_checkpoint_steps": [final[n] for n in NODES]}
