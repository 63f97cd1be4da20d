"""The ``gossipd`` command line. Parsing and messages only; the work is in the other modules.

Exit codes:
    0   success (``run``: stopped cleanly by a signal or ``task.max_steps``)
    1   the daemon failed while running (a bug or an environment failure; see the log)
    2   bad usage, config, file or key; an address in use; a task that cannot be loaded
    3   ``status``: no daemon is running with this config
    4   ``status --ready``: the daemon answers but is not ready (joining, or fetching the
        swarm's state)
    128+N  ``run``: stopped at once by a second signal N (no checkpoint written)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any, Sequence

from gossip import CIPHERS, DEFAULT_CIPHER

__all__ = ["main"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOT_RUNNING, EXIT_NOT_READY = 0, 1, 2, 3, 4
NEW_SWARM_TASK = "daemon.tasks.digits:task"

log = logging.getLogger("daemon")


class UsageError(Exception):
    """Printed as one line; exit code 2."""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("gossipd")
    except PackageNotFoundError:
        return "unknown"


class _Version(argparse.Action):
    """``--version``, which reads the installed package's metadata only when asked: reading
    it costs every other command tens of milliseconds (``status`` must stay quick)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help="show the version and exit",
                         **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        print(f"gossipd {_version()}")
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gossipd", description="Peer-to-peer training daemon: train locally, average "
        "weights with random peers.", epilog="Exit codes: 0 ok, 1 failed while running, 2 bad "
        "usage/config/file/key or address in use, 3 no daemon running (status), 4 not ready "
        "(status --ready).")
    p.add_argument("--version", action=_Version)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def with_config(sp: argparse.ArgumentParser, overrides: bool = True) -> None:
        sp.add_argument("-c", "--config", help="config file (default: $GOSSIPD_CONFIG or "
                        "./gossipd.toml)")
        if overrides:
            sp.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                            help="override one config value (repeatable)")

    sp = sub.add_parser("init", help="write a config, an identity key and (for a new swarm) "
                        "a swarm key; print the join line")
    group = sp.add_mutually_exclusive_group(required=True)
    group.add_argument("--swarm", metavar="NAME", help="start a new swarm with this name")
    group.add_argument("--join", metavar="LINE", help="join the swarm a join line describes "
                       "('-' reads it from standard input, keeping the key out of the shell "
                       "history)")
    sp.add_argument("--dir", default=".", help="directory for the config and keys (default .)")
    sp.add_argument("--listen", default="0.0.0.0:7070", help="host:port to listen on")
    sp.add_argument("--advertise", help="host:port peers dial (default: this machine's "
                    "address on the listen port)")
    sp.add_argument("--task", help=f"task entry point module:function (default "
                    f"{NEW_SWARM_TASK}; a join line names its own)")
    sp.add_argument("--shards", type=int, metavar="N", help="how many shards the swarm's data "
                    "is cut into (default 1; a join line names its own); each node takes one "
                    "with task.shard = \"auto\"")
    sp.add_argument("--cipher", choices=CIPHERS, help="a new swarm's channel cipher (default "
                    "aesgcm; chachapoly for machines without AES instructions; a join line "
                    "names its own)")
    sp.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="write this value into the config (repeatable): swarm.profile=wan or "
                    "averaging.codec=bf16 for a new swarm, whose join line then carries them; "
                    "a joiner cannot change what its line carries")

    sp = sub.add_parser("join-line", help="print the join line of this node's swarm as its "
                        "config stands (after editing [task.options], say)")
    with_config(sp, overrides=False)

    sp = sub.add_parser("run", help="run the daemon")
    with_config(sp)
    sp.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING"])

    sp = sub.add_parser("status", help="ask the running daemon what it is doing")
    with_config(sp)
    sp.add_argument("--json", action="store_true", help="print the raw JSON reply")
    sp.add_argument("--ready", action="store_true", help="print one line and exit 0 if the "
                    "node has joined the swarm and trains, else exit 4 (a readiness probe)")

    sp = sub.add_parser("check-config", help="validate a config (and its key files and task)")
    with_config(sp)

    sp = sub.add_parser("keygen", help="write a new key file (0600)")
    group = sp.add_mutually_exclusive_group(required=True)
    group.add_argument("--identity", metavar="PATH", help="a node identity (Ed25519) key")
    group.add_argument("--swarm-key", metavar="PATH", help="a swarm key (32 random bytes)")

    sp = sub.add_parser("rotate-key", help="start rotating the swarm key: a new key, the "
                        "current one kept as the previous key (docs/OPERATIONS.md)")
    with_config(sp, overrides=False)
    group = sp.add_mutually_exclusive_group()
    group.add_argument("--key-file", metavar="PATH", help="rotate to the key in this swarm key "
                       "file (a copy of the first rotated node's) instead of a fresh one")
    group.add_argument("--join", metavar="LINE", help="rotate to the key of this join line "
                       "(the first rotated node's new line; '-' reads it from standard input)")

    sp = sub.add_parser("retire-key", help="finish rotating the swarm key: drop the previous "
                        "key, once every node holds the new one")
    with_config(sp, overrides=False)
    sp.add_argument("--force", action="store_true", help="finish even if the running daemon "
                    "still hears peers on the old key only")

    sp = sub.add_parser("average", help="average checkpoints or state-dict files of one model")
    sp.add_argument("inputs", nargs="+", metavar="FILE")
    sp.add_argument("-o", "--output", required=True, metavar="OUT")
    sp.add_argument("--weights", metavar="W1,W2,...", help="relative weights (default equal)")

    sp = sub.add_parser("export", help="write a checkpoint's model as a plain state-dict file "
                        "(for torch.load and load_state_dict)")
    sp.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint-<step>.ckpt file")
    sp.add_argument("output", metavar="OUT", help="the state-dict file to write")

    sp = sub.add_parser("demo", help="run a swarm of real daemons on 127.0.0.1 and report")
    sp.add_argument("--nodes", type=int, default=3, help="how many train at once; node1 "
                    "leaves halfway and one more joins in its place")
    sp.add_argument("--seconds", type=float, default=60.0, help="how long they train")
    sp.add_argument("--dir", help="where to keep the nodes' files (default: a new temp dir)")
    sp.add_argument("--task", default=NEW_SWARM_TASK, help="task entry point")
    sp.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override one config value on every node (repeatable)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        code = COMMANDS[args.command](args)
    except UsageError as exc:
        print(f"gossipd {args.command}: {exc}", file=sys.stderr)
        code = EXIT_USAGE
    except KeyboardInterrupt:
        code = 130
    except BrokenPipeError:  # `gossipd status | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        code = EXIT_OK
    return code


def _load(args: argparse.Namespace, complete: bool = True) -> Any:
    from .config import ConfigError, load
    try:
        return load(args.config, getattr(args, "set", ()), complete=complete)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None


def cmd_run(args: argparse.Namespace) -> int:
    config = _load(args)
    import trio

    import gossip

    from . import logs
    from .follower import follow
    from .processes import ProcessesError, exit_now, placement
    from .service import StartupError, prepare, run
    from .task import TaskError
    try:
        where = placement(config.task.processes)
    except ProcessesError as exc:
        raise UsageError(str(exc)) from None
    live = logs.setup(args.log_level, process=where.rank if where.several else None)
    if not where.speaker:
        exit_now(follow(config, where))
    argv = ("run", *(("-c", args.config) if args.config else ()),
            *(x for value in args.set for x in ("--set", value)), "--log-level", args.log_level)
    code = EXIT_OK
    try:
        prepared = prepare(config, argv)
        if prepared.resumed:
            log.info("resuming checkpoint=%s step=%d", prepared.resumed, prepared.counters.step)
        trio.run(lambda: run(prepared, live=live))
    except StartupError as exc:
        raise UsageError(str(exc)) from None
    except TaskError as exc:  # the task broke its contract while training: one line says how
        log.error("the daemon failed: %s", exc)
        code = EXIT_FAILED
    except (gossip.ProcessLost, gossip.ReplicasDiverged) as exc:  # said when it happened
        log.error("the node stopped: %s", exc)
        code = EXIT_FAILED
    except Exception:
        log.exception("the daemon failed")
        code = EXIT_FAILED
    finally:
        if live is not None:
            live.close()
    if where.several:
        exit_now(code)
    return code


def cmd_status(args: argparse.Namespace) -> int:
    config = _load(args, complete=False)  # only the control socket's path is needed
    from .control import ControlError, query
    try:
        reply = query(config.path(config.node.control))
    except ControlError as exc:
        print(f"gossipd status: {exc}", file=sys.stderr)
        return EXIT_NOT_RUNNING
    if args.ready:
        waiting = not_ready(reply)
        if waiting:
            print(f"gossipd status: not ready: {waiting}", file=sys.stderr)
            return EXIT_NOT_READY
        print(f"ready: step {reply['step']}, {len(reply['members'])} peers")
        return EXIT_OK
    if args.json:
        print(json.dumps(reply, indent=2))
    else:
        print(format_status(reply))
    return EXIT_OK


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
        f"step      {s['step']} (the swarm's: the step the task's schedule follows)",
    ]
    if s.get("rotation"):
        lines.append(f"rotation  {_rotation(s['rotation'])}")
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
                     + ("  outbound only" if m.get("reachable") is False else ""))
    return "\n".join(lines)


def _spacing(s: dict[str, Any]) -> str:
    """How many local steps apart this node starts its rounds (a daemon of an older version
    does not say: nothing then)."""
    if "spacing" not in s:
        return ""
    if s["spacing"] is None:
        return "; no rounds by steps (averaging.every = 0)"
    how = " (auto)" if s.get("every") == "auto" else ""
    return f"; a round every {s['spacing']} steps{how}"


def _processes(p: dict[str, Any]) -> str:
    """A node of several processes, in a line."""
    each = p["sync_seconds"] / p["syncs"] * 1e3 if p["syncs"] else 0.0
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
                else "none yet (task.eval_every is 0: once, when stopping)")
    metrics = "  ".join(f"{k} {v:.4f}" for k, v in e["metrics"].items())
    return f"{metrics}  at step {e['step']}, {e['age_s']:.0f} s ago"


def cmd_check_config(args: argparse.Namespace) -> int:
    config = _load(args)
    from .config import render
    from .keys import KeyFileError, load_swarm
    from gossip.devices import DeviceError, resolve
    
    from .task import TaskError, load_entry
    try:
        previous = config.swarm.previous_key_file
        load_swarm(config.swarm.name, config.path(config.swarm.key_file),
                   config.path(previous) if previous else None, config.swarm.cipher)
        # Rank 0's device, with every process's GPU counted: what `run` resolves.
        device = resolve(config.task.device, local_rank=0, processes=config.task.processes,
                         what="task.device")
        load_entry(config.task.entry, config.data_dir())
    except (KeyFileError, TaskError, DeviceError) as exc:
        raise UsageError(str(exc)) from None
    print(render(config), end="")
    n = config.task.processes
    where = (f"cuda:0 to cuda:{n - 1}, one per process" if device.type == "cuda" and n > 1
             else str(device))
    print(f"# ok: {args.config or 'the config'} is valid; keys and task load; task.device "
          f"{config.task.device} is {where} here", file=sys.stderr)
    return EXIT_OK


def cmd_keygen(args: argparse.Namespace) -> int:
    import secrets

    from gossip import Identity, IdentityError

    from .keys import KeyFileError, write_swarm_key
    try:
        if args.swarm_key:
            write_swarm_key(Path(args.swarm_key), secrets.token_bytes(32))
            print(f"wrote swarm key {args.swarm_key}")
        else:
            identity = Identity.generate()
            Path(args.identity).parent.mkdir(parents=True, exist_ok=True)
            identity.save(args.identity)
            print(f"wrote identity {args.identity}  peer id {identity.peer_id}")
    except (KeyFileError, IdentityError, OSError) as exc:
        raise UsageError(str(exc)) from None
    return EXIT_OK


def cmd_average(args: argparse.Namespace) -> int:
    from .merge import MergeError, average_files
    weights = None
    if args.weights:
        try:
            weights = [float(w) for w in args.weights.split(",")]
        except ValueError:
            raise UsageError(f"--weights {args.weights!r} is not a comma-separated list of "
                             "numbers") from None
        if len(weights) != len(args.inputs):
            raise UsageError(f"{len(weights)} weights for {len(args.inputs)} files")
    try:
        merged = average_files([Path(p) for p in args.inputs], Path(args.output), weights)
    except MergeError as exc:
        raise UsageError(str(exc)) from None
    print(f"wrote {args.output}: the average of {len(args.inputs)} files, "
          f"{len(merged)} tensors")
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    from .merge import MergeError, export_file
    try:
        state = export_file(Path(args.checkpoint), Path(args.output))
    except MergeError as exc:
        raise UsageError(str(exc)) from None
    counters = state.get("counters")
    step = counters.get("step") if isinstance(counters, dict) else None
    print(f"wrote {args.output}: the model of {args.checkpoint}"
          + (f" at step {step}" if step is not None else "")
          + f", {len(state['model'])} tensors (a state dict: torch.load, then load_state_dict)")
    return EXIT_OK


def guess_address() -> str:
    """This machine's address on its default route (no packet is sent), else 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: never routed, only used to pick a route
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def cmd_init(args: argparse.Namespace) -> int:
    import secrets

    from .config import WILDCARDS, ConfigError, _apply_override, from_dict, render
    from .keys import JoinLine, KeyFileError, write_new, write_swarm_key
    from .entry import entry_file
    from gossip import format_address, parse_address
    directory = Path(args.dir)
    config_path = directory / "gossipd.toml"
    if config_path.exists():
        raise UsageError(f"{config_path} exists; not overwriting it")
    try:
        host, port = parse_address(args.listen)
    except ValueError as exc:
        raise UsageError(f"--listen: {exc}") from None
    line = None
    if args.join:
        text = sys.stdin.readline() if args.join == "-" else args.join
        try:
            line = JoinLine.parse(text)
        except KeyFileError as exc:
            raise UsageError(str(exc)) from None
        name, key, bootstrap = line.name, line.key, list(line.bootstrap)
        entry, seed, options = args.task or line.task, line.seed, dict(line.options)
        shards = line.shards if args.shards is None else args.shards
        settings = line.settings()  # the swarm's: written into our config as they are
        if args.cipher is not None and args.cipher != line.cipher:
            raise UsageError(f"the join line's swarm uses cipher {line.cipher}; a node of "
                             f"{args.cipher} could not connect to it")
    else:
        name, key, bootstrap = args.swarm, secrets.token_bytes(32), []
        entry, seed, options = args.task or NEW_SWARM_TASK, 0, {}
        shards = 1 if args.shards is None else args.shards
        settings = {"swarm.cipher": args.cipher or DEFAULT_CIPHER}
    guessed = not args.advertise and host in WILDCARDS
    advertise = args.advertise or format_address(guess_address() if guessed else host, port)
    if guessed and is_loopback(advertise) and not (
            line is not None and all(map(is_loopback, bootstrap))):  # a swarm on this machine
        raise UsageError("cannot tell this machine's address (it has no route to other "
                         "machines): give --advertise HOST:PORT, the address other nodes reach "
                         "it at, or --listen 127.0.0.1:PORT for a swarm on this machine alone")
    data: dict[str, Any] = {
        "node": {"listen": args.listen, "advertise": advertise},
        "swarm": {"name": name, "bootstrap": bootstrap},
        "task": {"entry": entry, "seed": seed, "shard": "auto", "shards": shards,
                 "options": options}}
    for config_key, value in settings.items():
        section, setting = config_key.split(".")
        data.setdefault(section, {})[setting] = value
    shared, warning = shareable_entry(entry)
    try:
        for text in args.set:
            _apply_override(data, text)  # as `gossipd run --set` does to the file's table
        config = from_dict(data, directory.resolve(), str(config_path))
        # A new swarm's first line names this node; a joiner's, the swarm it joins through.
        join = JoinLine.of(config, key, config.swarm.bootstrap if line else
                           [config.node.advertise], shared)
    except (ConfigError, KeyFileError) as exc:
        raise UsageError(str(exc)) from None
    if line is not None:
        for config_key, value in line.settings().items():
            if join.settings()[config_key] != value:
                raise UsageError(f"the join line's swarm has {config_key} = {json.dumps(value)};"
                                 f" a node with {json.dumps(join.settings()[config_key])} could "
                                 f"not take part in it (leave out --set {config_key})")
    import gossip
    key_path, identity_path = config.path(config.swarm.key_file), config.path(config.node.identity)
    if key_path.exists():  # checked before anything is written: a failed init leaves nothing
        raise UsageError(f"{key_path} exists; not overwriting it")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        config.data_dir().mkdir(parents=True, exist_ok=True)  # --set node.data_dir=...
        if identity_path.exists():  # made by `gossipd keygen --identity`: keep it
            identity = gossip.Identity.load(identity_path)
        else:
            identity = gossip.Identity.generate()
            identity.save(identity_path)
        write_swarm_key(key_path, key)
        write_new(config_path, render(config).encode())
    except (KeyFileError, OSError, gossip.IdentityError) as exc:
        raise UsageError(str(exc)) from None
    print(f"wrote {config_path}, {config.path(config.node.identity)} (peer id "
          f"{identity.peer_id}) and {config.path(config.swarm.key_file)}")
    if guessed and config.node.advertise == advertise:
        print(f"node.advertise = {advertise} (guessed: edit it if peers reach this machine by "
              "another address)")
    if line is not None:
        carried = line.settings(changed=True)
        if carried:
            print("swarm settings from the join line: " + ", ".join(
                f"{k} = {json.dumps(v)}" for k, v in carried.items()))
        if line.options:
            print(f"task.options from the join line: {json.dumps(options, sort_keys=True)}")
    task_file = entry_file(entry, config.data_dir())
    if task_file is not None:
        missing = ("" if task_file.is_file() else " (not there yet)"
                   if Path(entry.rpartition(":")[0]).is_absolute() else
                   " (not there yet: a relative path starts from node.data_dir)")
        print(f"note: task.entry {entry} runs the code in {task_file}{missing}: read it before "
              "you start")
        if line is not None and not args.task and Path(
                line.task.rpartition(":")[0]).is_absolute():
            print(f"warning: the join line names its task file by a path on the machine that "
                  f"wrote it: check that {task_file} holds the swarm's task, or put the file "
                  f"in {config.data_dir()} and set task.entry to its name (\"{task_file.name}:"
                  f"{entry.rpartition(':')[2]}\")", file=sys.stderr)
    elif line is not None and not module_installed(entry):
        print(f"warning: task module {entry.rpartition(':')[0]} is not installed here: install "
              "the package that provides it (ask the swarm's operator which) before gossipd "
              "run", file=sys.stderr)
    if warning and line is None:
        print(warning, file=sys.stderr)
    note = loopback_note(join)
    if note:
        print(note, file=sys.stderr)
    print("start it:   gossipd run -c", config_path)
    print("a volunteer joins with (this line holds the swarm key: share it privately):")
    print(f"  gossipd init --join '{join}'")
    print(f"after editing the config's [task.options]: gossipd join-line -c {config_path}")
    return EXIT_OK


def is_loopback(address: str) -> bool:
    """Whether ``host:port`` names this machine only (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    from gossip import parse_address
    host = parse_address(address)[0]
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


def loopback_note(line: Any) -> str:
    """A note when some of the join line's addresses are loopback ones, "" else: another
    machine dials itself there."""
    local = [address for address in line.bootstrap if is_loopback(address)]
    if not local:
        return ""
    return (f"note: the join line's {', '.join(local)} {'is' if len(local) == 1 else 'are'} "
            "loopback: only nodes on this machine can join through "
            f"{'it' if len(local) == 1 else 'them'} (node.advertise names the address others "
            "reach)")


def module_installed(entry: str) -> bool:
    """Whether the top-level package of a module entry can be found on this Python path,
    without importing anything (so without torch)."""
    from importlib.util import find_spec
    top = entry.rpartition(":")[0].split(".")[0]
    try:
        return find_spec(top) is not None
    except (ImportError, ValueError):
        return False


def shareable_entry(entry: str) -> tuple[str, str]:
    """The task entry a join line carries, and a warning when it is not ``entry`` ("" else).

    A task file named by an absolute path is a path on this machine, which a volunteer's
    machine rarely has: the line carries the file's name alone, which a volunteer's node looks
    for in its own node.data_dir (where a relative task.entry starts), and the warning says to
    send the file along. Refusing the line instead would leave the operator with no line at
    all, and the file has to reach the volunteer whichever way. A relative path travels as it
    is, with the same warning: it too names a file the volunteer does not have yet."""
    from .entry import is_file_entry, parse_entry
    try:
        target, function = parse_entry(entry)
    except ValueError:
        return entry, ""
    if not is_file_entry(target):
        return entry, ""
    if not Path(target).is_absolute():
        return entry, (
            f"warning: task.entry {entry} is a file of this node's; a volunteer's node looks "
            f"for {target} in its own data directory: send it with the line, or make the task "
            f"a module volunteers install (package.module:{function})")
    name = Path(target).name
    return f"{name}:{function}", (
        f"warning: task.entry {entry} is a path on this machine; the join line names the file "
        f"alone, {name}:{function}, which a volunteer's node looks for in its own data "
        f"directory: send {name} with the line, or make the task a module volunteers install "
        f"(package.module:{function})")


def cmd_join_line(args: argparse.Namespace) -> int:
    config = _load(args)
    from .keys import JoinLine, KeyFileError, read_swarm_key
    from gossip import parse_address
    address = config.node.advertise or config.node.listen
    if parse_address(address)[1] == 0:
        raise UsageError(f"node.listen {address} has port 0, which nobody can dial: set "
                         "node.advertise")
    # A node nobody can dial (node.reachable = false) is no address to join through.
    own = [] if config.node.reachable is False and config.swarm.bootstrap else [address]
    entry, warning = shareable_entry(config.task.entry)
    try:
        key = read_swarm_key(config.path(config.swarm.key_file))
        line = JoinLine.of(config, key, [*own, *config.swarm.bootstrap], entry)
    except KeyFileError as exc:
        raise UsageError(str(exc)) from None
    if warning:
        print(warning, file=sys.stderr)
    print(line)
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import DemoError, run_demo
    try:
        return run_demo(nodes=args.nodes, seconds=args.seconds, directory=args.dir,
                        entry=args.task, overrides=args.set)
    except DemoError as exc:
        raise UsageError(str(exc)) from None


def _config_path(args: argparse.Namespace) -> Path:
    """The config file ``_load`` read: the one to edit."""
    from .config import DEFAULT_PATH, ENV
    return Path(args.config if args.config is not None else os.environ.get(ENV) or DEFAULT_PATH)


def cmd_rotate_key(args: argparse.Namespace) -> int:
    config = _load(args)
    from .keys import JoinLine, KeyFileError, read_swarm_key
    from .rotation import RotationError, start_rotation
    config_path = _config_path(args)
    try:
        new_key = None
        if args.key_file:
            new_key = read_swarm_key(Path(args.key_file))
        elif args.join:
            line = JoinLine.parse(sys.stdin.readline() if args.join == "-" else args.join)
            if (line.name, line.cipher) != (config.swarm.name, config.swarm.cipher):
                raise UsageError(f"the join line is for swarm {line.name!r} with cipher "
                                 f"{line.cipher}; this node is in {config.swarm.name!r} with "
                                 f"cipher {config.swarm.cipher}")
            new_key = line.key
        started = start_rotation(config_path, config, new_key)
    except (KeyFileError, RotationError) as exc:
        raise UsageError(str(exc)) from None
    print(f"{'finished an interrupted start: ' if started.resumed else ''}{started.key_file} "
          f"holds the new swarm key; {started.previous_key_file} the one it replaces "
          f"(swarm.previous_key_file in {config_path})")
    print("restart this node now: it accepts both keys and speaks the new one")
    print("then each other node in turn, restarted before the next, with the same key:")
    print("  gossipd rotate-key -c CONFIG --join -        and paste the join line below")
    print(f"  gossipd rotate-key -c CONFIG --key-file F   F a private copy of {started.key_file}")
    print("the new join line (it holds the new key: share it privately; lines with the old key "
          "stop working once the rotation is finished):")
    try:
        cmd_join_line(argparse.Namespace(config=args.config))
    except UsageError as exc:
        print(f"  none: {exc}")
    print("once every node has restarted on the new key: gossipd retire-key on each, then "
          "restart it")
    return EXIT_OK


def cmd_retire_key(args: argparse.Namespace) -> int:
    config = _load(args)
    from .control import ControlError, query
    from .keys import KeyFileError
    from .rotation import RotationError, finish_rotation
    config_path = _config_path(args)
    if not config.swarm.previous_key_file:
        print(f"no swarm key rotation under way in {config_path} (swarm.previous_key_file is "
              "empty): nothing to finish")
        return EXIT_OK
    try:
        rotation = query(config.path(config.node.control)).get("rotation") or {}
    except ControlError:
        rotation = {}  # not running: nothing to ask; the restart comes later anyway
    if rotation.get("old_key") and not args.force:
        raise UsageError(f"the running daemon still hears {_listed(rotation['old_key'])} on the "
                         "old key only: rotate those nodes first (gossipd rotate-key), or "
                         "finish anyway with --force")
    try:
        previous = finish_rotation(config_path, config)
    except (KeyFileError, RotationError) as exc:
        raise UsageError(str(exc)) from None
    print(f"dropped the previous swarm key: deleted {previous}; swarm.previous_key_file "
          f"cleared in {config_path}")
    print("restart this node now: it then speaks the new key only, and nodes or join lines "
          "with the old key alone can no longer reach it")
    return EXIT_OK


def _listed(addresses: list[str], most: int = 5) -> str:
    shown = ", ".join(addresses[:most])
    return shown + (f" and {len(addresses) - most} more" if len(addresses) > most else "")


def _rotation(r: dict[str, Any]) -> str:
    """The ``gossipd status`` line of a node mid-rotation."""
    total = len(r["new_key"]) + len(r["old_key"]) + len(r["unknown"])
    text = (f"mid-rotation, holding the previous swarm key too: {len(r['new_key'])} of {total} "
            "peers seen on the new key")
    if r["old_key"]:
        text += f"; on the old key only: {_listed(r['old_key'])}"
    if r["unknown"]:
        text += f"; not heard from yet: {_listed(r['unknown'])}"
    return text + "; once every node holds the new key: gossipd retire-key"


COMMANDS = {
    "init": cmd_init, "run": cmd_run, "status": cmd_status, "check-config": cmd_check_config,
    "keygen": cmd_keygen, "average": cmd_average, "export": cmd_export, "demo": cmd_demo,
    "join-line": cmd_join_line, "rotate-key": cmd_rotate_key,
    "retire-key": cmd_retire_key,
}
