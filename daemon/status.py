"""``gossipd status``: the reply a running daemon builds, and how the command prints it.

Theory of operation
-------------------
The daemon answers a ``status`` request on its control socket (:mod:`daemon.control`) with
one JSON object, :func:`status_reply`, built from the running service; the command prints it
with :func:`format_status`, or says in one line what the node still waits for
(:func:`not_ready`, for ``status --ready``). The printer leaves out the keys a daemon of an
older version does not send, rather than guess them. Importing this module costs neither
torch nor trio: ``gossipd status`` is what a readiness probe runs every few seconds.

What it says of each peer's step is the freshest word of it, and its age. A member's step in
the roster (:attr:`gossip.Member.step`) is the one it last *announced*. A node re-announces a
changed step at most every ``membership.meta_interval`` seconds (30 by default: each
announcement is gossiped to every member), so a peer that trains thousands of steps a second
is listed thousands of steps behind: a joiner saw its donor listed at step 0 just after
downloading that donor's state at step 4,357. Yet every exchange tells the peer's step, both
ways (its ``Offer`` or ``Accept``: :attr:`gossip.Exchange.step`), and a download tells the
donor's. :class:`StepReports` keeps the latest of these per peer, and :meth:`StepReports.of`
answers with whichever is newer, that or the announcement, with its age. A peer this node
never exchanges with is as fresh as its announcements.

Newer wins, not higher: a peer that restarts from an older checkpoint goes back, and its
next word says so. Times are ``trio.current_time()``, the clock of
:attr:`gossip.Member.heard`. Memory: one entry per member of the roster (:meth:`StepReports.keep`
drops the others).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Protocol

import gossip

from .rotation import rotation_line, rotation_status

if TYPE_CHECKING:
    from .checkpoint import Checkpointer
    from .config import Config
    from .metrics import Metrics
    from .processes import Speaker
    from .train import Training

__all__ = ["StepReports", "Source", "format_status", "not_ready", "status_reply"]


class StepReports:
    """The step each peer last told this node outside membership, and when."""

    def __init__(self) -> None:
        self._told: dict[str, tuple[int, float]] = {}  # peer id -> (step, trio time)

    def heard(self, peer: str, step: int, now: float) -> None:
        """``peer`` said at ``now`` that it is at ``step`` (in an exchange or a download)."""
        self._told[str(peer)] = (step, now)

    def of(self, member: gossip.Member, now: float) -> dict[str, Any]:
        """``member``'s freshest step, as ``{"step": int, "step_age_s": float}``: seconds
        since this node heard it, from the member or from its announcement."""
        step, heard = member.step, member.heard
        told = self._told.get(str(member.peer))
        if told is not None and told[1] > heard:
            step, heard = told
        return {"step": step, "step_age_s": round(max(0.0, now - heard), 1)}

    def keep(self, peers: Iterable[str]) -> None:
        """Forget every peer but ``peers`` (the roster's members)."""
        members = {str(p) for p in peers}
        for peer in [p for p in self._told if p not in members]:
            del self._told[peer]


class Source(Protocol):
    """What a status reply is built from: the running daemon (:mod:`daemon.service`)."""

    config: Config
    node: gossip.SwarmNode | None
    training: Training | None
    metrics: Metrics
    peer_steps: StepReports
    speaker: Speaker
    checkpoints: Checkpointer
    started: float  # time.monotonic() at start
    prepared: Any  # daemon.service.Prepared: its swarm and device


def status_reply(source: Source, now: float) -> dict[str, Any]:
    """The reply to ``gossipd status`` (a JSON object), at trio time ``now``."""
    node, c, training = source.node, source.config, source.training
    assert node is not None and training is not None
    me = node.peer_id
    own = node.replica.local_steps  # read once: the trainer's thread goes on counting
    before = training.trainer.own_steps_before
    members = [m for m in node.roster.members() if m.peer != me]
    source.peer_steps.keep(m.peer for m in members)
    peers = [{"peer": m.peer, "address": m.address, "state": m.state.name.lower(),
              **source.peer_steps.of(m, now), "ready": m.ready,
              "shard": m.shard if m.shards else None, "reachable": m.reachable,
              "codec": node.codec_with(m.peer)}
             for m in members]
    evaluation = None
    if training.evaluation is not None:
        e = training.evaluation
        evaluation = {"metrics": e["metrics"], "step": e["step"],
                      "age_s": round(time.monotonic() - e["time"], 1)}
    return {
        "peer": me, "address": node.address, "swarm": source.prepared.swarm.name,
        "task": c.task.entry, "schema": node.replica.schema.fingerprint_hex,
        "device": str(source.prepared.device), "version": gossip.__version__,
        "uptime_s": round(time.monotonic() - source.started, 1),
        "data_dir": str(c.data_dir()),
        **source.metrics.sample(node),
        "every": c.averaging.every,  # as configured: "auto" means spacing is measured
        "own_steps": own,
        # Steps of ours still to take without counting: the step is ahead of the swarm's, held
        # while the swarm catches up (gossip.replica's debt).
        "step_held": node.replica.counters().debt,
        "own_steps_total": None if before is None else before + own,
        "evaluation": evaluation,
        "eval_every": c.task.eval_interval,  # the reply's key as older daemons send it
        "joined": node.roster.joined,
        "join_trouble": join_trouble(node, now),
        "clash": node.roster.clash,
        "rotation": rotation_status(source.prepared.swarm, (
            m.address for m in members
            if m.state in (gossip.State.ALIVE, gossip.State.SUSPECT))),
        "reachability": asdict(node.roster.reachability),
        "processes": source.speaker.status(),
        "members": peers,
        "downloaded_from": node.downloaded.peer if node.downloaded else None,
        # None: task.shard "auto", not chosen yet
        "shard": None if training.shard is None else training.shard.index,
        "shards": c.task.shards,
        "last_checkpoint": source.checkpoints.last,
    }


def join_trouble(node: gossip.SwarmNode, now: float) -> dict[str, Any] | None:
    """Why this node cannot join, for ``gossipd status``: None once it has joined."""
    trouble = node.roster.trouble
    if trouble is None or node.roster.joined:
        return None
    return {"seconds": round(now - trouble.since, 1),
            "attempts": trouble.attempts, "reasons": dict(trouble.reasons)}


def not_ready(s: dict[str, Any]) -> str:
    """What the node in status reply ``s`` is waiting for, or "" once it has joined the swarm
    (a bootstrap address answered, or it has none) and has its weights (resumed, downloaded
    or its own)."""
    if s.get("clash"):
        return (f"identity clash: the node at {s['clash']} runs with this node's identity key "
                "(a copied data directory?): see the log")
    if not s.get("joined", True):
        trouble = s.get("join_trouble")
        if not trouble:
            return "joining the swarm: no bootstrap address has answered yet"
        reasons = "; ".join(f"{address}: {why}" for address, why in trouble["reasons"].items())
        return (f"cannot join the swarm: {trouble['attempts']} attempt(s) in "
                f"{trouble['seconds']:.0f} s failed; {reasons}")
    if not s["ready"]:
        return "fetching the swarm's state"
    return ""


def format_status(s: dict[str, Any]) -> str:
    """The human-readable ``gossipd status``. Keys a daemon of an older version does not send
    are left out, not guessed."""
    loss = "-" if s.get("loss") is None else f"{s['loss']:.4f}"
    ex = s["exchanges"]
    ckpt = s.get("last_checkpoint")
    own, total = s.get("own_steps"), s.get("own_steps_total")
    training = [f"{s['samples']} samples", f"loss {loss}", f"{s['samples_per_s']:.0f} samples/s"]
    if own is not None:
        training.insert(0, f"{own} own steps since start"
                        + (f" ({total} in all)" if total is not None and total != own else ""))
    lines = [
        f"peer      {s['peer']}  {s['address']}  swarm {s['swarm']}",
        *([f"reach     {_reach(s['reachability'])}"] if s.get("reachability") else []),
        f"task      {s['task']} on {s['device']}, up {s['uptime_s']:.0f} s"
        + _shard(s),
        *([f"processes {_processes(s['processes'])}"] if s.get("processes") else []),
        *([f"NOT READY {not_ready(s)}"] if not_ready(s) else []),
        f"training  {', '.join(training)}",
        f"step      {s['step']} (the swarm's: the step the task's schedule follows)"
        + (f"; held for {s['step_held']} own steps: ahead of the swarm, which catches up"
           if s.get("step_held") else ""),
    ]
    if s.get("rotation"):
        lines.append(f"rotation  {rotation_line(s['rotation'])}")
    if "evaluation" in s:
        lines.append(f"eval      {_evaluation(s['evaluation'], s.get('eval_every', 0))}")
    lines += [
        f"averaging {ex['committed']} committed, {ex['busy']} busy, {ex['failed']} failed, "
        f"{ex['invalid']} invalid, {ex['rejected']} rejected; {s['pending']} pending"
        + _spacing(s),
        f"traffic   {s['bytes']['sent'] / 1e6:.1f} MB out, {s['bytes']['received'] / 1e6:.1f} MB in",
        "checkpoint " + (f"step {ckpt['step']} {ckpt['path']}" if ckpt else "none yet"),
        f"peers     {len(s['members'])}",
    ]
    for m in sorted(s["members"], key=lambda m: (m["state"], m["peer"])):
        age = f" ({m['step_age_s']:.0f} s ago)" if m.get("step_age_s") is not None else ""
        lines.append(f"  {m['peer'][:8]}  {m['address']:<22} {m['state']:<8} step {m['step']}"
                     + age + ("" if m["ready"] else "  not ready")
                     + ("  outbound only" if m.get("reachable") is False else "")
                     + (f"  {m['codec']}" if m.get("codec") else ""))
    return "\n".join(lines)


def _spacing(s: dict[str, Any]) -> str:
    """How many local steps apart this node starts its rounds (a daemon of an older version
    does not say: nothing then)."""
    if "spacing" not in s:
        return ""
    if s["spacing"] is None:
        return "; no rounds by steps (averaging.every = 0)"
    how = " (auto)" if s.get("every") == "auto" else ""
    peers = s.get("round_peers") or 1
    of = f" of {peers} exchanges" if peers > 1 else ""
    return f"; a round{of} every {s['spacing']} steps{how}"


def _processes(p: dict[str, Any]) -> str:
    """A node of several processes, in a line."""
    each = p["sync_seconds"] / p["syncs"] * 1e3 if p["syncs"] else 0.0
    if p.get("layout") == "pipeline":
        return (f"{p['count']} pipeline stages ({p['backend']}): {p['syncs']} copies of their "
                f"parts to and from the host, {each:.1f} ms each")
    checks = f", {p['checks']} checks passed" if p.get("checks") else ""
    return (f"{p['count']} ({p['backend']}): {p['syncs']} state broadcasts, {each:.1f} ms "
            f"each{checks}")


def _reach(r: dict[str, Any]) -> str:
    """Whether others can dial this node, and how we know."""
    if r["mode"] != "auto":
        return ("reachable (node.reachable = true)" if r["reachable"]
                else "outbound only (node.reachable = false): peers never dial this node")
    if r["reachable"]:
        return f"reachable: {r['detail']}"
    if not r["checked"]:
        return f"outbound only until a member dials us back ({r['detail']})"
    return (f"outbound only: {r['detail']}; this node starts every exchange itself (open the "
            "port to be a full member)")


def _shard(s: dict[str, Any]) -> str:
    if s.get("shards", 1) == 1:
        return ""
    return (f", data shard {s['shard']} of {s['shards']}" if s.get("shard") is not None
            else f", data shard of {s['shards']} not chosen yet")


def _evaluation(e: dict[str, Any] | None, every: float) -> str:
    if e is None:
        return (f"none yet (every {every:g} s)" if every
                else "none yet (task.eval_interval is 0: once, when stopping)")
    metrics = "  ".join(f"{k} {v:.4f}" for k, v in e["metrics"].items())
    return f"{metrics}  at step {e['step']}, {e['age_s']:.0f} s ago"
