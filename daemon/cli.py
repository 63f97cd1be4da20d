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

from gossip.handshake import CIPHERS, DEFAULT_CIPHER

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

    sp = sub.add_parser("average", help="average checkpoints or state-dict files of one model")
    sp.add_argument("inputs", nargs="+", metavar="FILE")
    sp.add_argument("-o", "--output", required=True, metavar="OUT")
    sp.add_argument("--weights", metavar="W1,W2,...", help="relative weights (default equal)")

    sp = sub.add_parser("export", help="write a checkpoint's model as a plain state-dict file "
                        "(for torch.load and load_state_dict)")
    sp.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint-<step>.ckpt file")
    sp.add_argument("output", metavar="OUT", help="the state-dict file to write")

    sp = sub.add_parser("demo", help="run a swarm of real daemons on 127.0.0.1 and report")
    sp.add_argument("--nodes", type=int, default=3)
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

    from . import logs
    from .service import StartupError, prepare, run
    from .task import TaskError
    live = logs.setup(args.log_level)
    try:
        prepared = prepare(config)
        if prepared.resumed:
            log.info("resuming checkpoint=%s step=%d", prepared.resumed, prepared.counters.step)
        trio.run(lambda: run(prepared, live=live))
    except StartupError as exc:
        raise UsageError(str(exc)) from None
    except TaskError as exc:  # the task broke its contract while training: one line says how
        log.error("the daemon failed: %s", exc)
        return EXIT_FAILED
    except Exception:
        log.exception("the daemon failed")
        return EXIT_FAILED
    finally:
        if live is not None:
            live.close()
    return EXIT_OK


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
        f"task      {s['task']} on {s['device']}, up {s['uptime_s']:.0f} s"
        + _shard(s),
        *([f"NOT READY {not_ready(s)}"] if not_ready(s) else []),
        f"training  {', '.join(training)}",
        f"step      {s['step']} (the swarm's: the step the task's schedule follows)",
    ]
    if "evaluation" in s:
        lines.append(f"eval      {_evaluation(s['evaluation'], s.get('eval_every', 0))}")
    lines += [
        f"averaging {ex['committed']} committed, {ex['busy']} busy, {ex['failed']} failed, "
        f"{ex['invalid']} invalid, {ex['rejected']} rejected; {s['pending']} pending",
        f"traffic   {s['bytes']['sent'] / 1e6:.1f} MB out, {s['bytes']['received'] / 1e6:.1f} MB in",
        "checkpoint " + (f"step {ckpt['step']} {ckpt['path']}" if ckpt else "none yet"),
        f"peers     {len(s['members'])}",
    ]
    for m in sorted(s["members"], key=lambda m: (m["state"], m["peer"])):
        age = f" ({m['step_age_s']:.0f} s ago)" if m.get("step_age_s") is not None else ""
        lines.append(f"  {m['peer'][:8]}  {m['address']:<22} {m['state']:<8} step {m['step']}"
                     + age + ("" if m["ready"] else "  not ready"))
    return "\n".join(lines)


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
    from .keys import KeyFileError, read_swarm_key
    from .task import TaskError, load_entry, pick_device
    try:
        read_swarm_key(config.path(config.swarm.key_file))
        pick_device(config.task.device)
        load_entry(config.task.entry, config.data_dir())
    except (KeyFileError, TaskError) as exc:
        raise UsageError(str(exc)) from None
    print(render(config), end="")
    print(f"# ok: {args.config or 'the config'} is valid; keys and task load", file=sys.stderr)
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

    from .config import ConfigError, from_dict, render
    from .keys import JoinLine, KeyFileError, write_new, write_swarm_key
    from .entry import entry_file
    from gossip.address import format_address, parse_address
    directory = Path(args.dir)
    config_path = directory / "gossipd.toml"
    if config_path.exists():
        raise UsageError(f"{config_path} exists; not overwriting it")
    try:
        host, port = parse_address(args.listen)
    except ValueError as exc:
        raise UsageError(f"--listen: {exc}") from None
    advertise = args.advertise or format_address(
        guess_address() if host in ("0.0.0.0", "::") else host, port)
    if args.join:
        text = sys.stdin.readline() if args.join == "-" else args.join
        try:
            line = JoinLine.parse(text)
        except KeyFileError as exc:
            raise UsageError(str(exc)) from None
        name, key, bootstrap = line.name, line.key, list(line.bootstrap)
        entry, seed, options = args.task or line.task, line.seed, dict(line.options)
        shards = line.shards if args.shards is None else args.shards
        cipher = line.cipher
        if args.cipher is not None and args.cipher != cipher:
            raise UsageError(f"the join line's swarm uses cipher {cipher}; a node of "
                             f"{args.cipher} could not connect to it")
    else:
        name, key, bootstrap = args.swarm, secrets.token_bytes(32), []
        entry, seed, options = args.task or NEW_SWARM_TASK, 0, {}
        shards = 1 if args.shards is None else args.shards
        cipher = args.cipher or DEFAULT_CIPHER
    data = {"node": {"listen": args.listen, "advertise": advertise},
            "swarm": {"name": name, "bootstrap": bootstrap, "cipher": cipher},
            "task": {"entry": entry, "seed": seed, "shard": "auto", "shards": shards,
                     "options": options}}
    try:
        config = from_dict(data, directory.resolve(), str(config_path))
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    import gossip
    key_path, identity_path = config.path(config.swarm.key_file), config.path(config.node.identity)
    if key_path.exists():  # checked before anything is written: a failed init leaves nothing
        raise UsageError(f"{key_path} exists; not overwriting it")
    try:
        directory.mkdir(parents=True, exist_ok=True)
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
    if not args.join and not args.advertise and host in ("0.0.0.0", "::"):
        print(f"node.advertise = {advertise} (guessed: edit it if peers reach this machine by "
              "another address)")
    if options:
        print(f"task.options from the join line: {json.dumps(options, sort_keys=True)}")
    task_file = entry_file(entry, config.data_dir())
    if task_file is not None:
        missing = ("" if task_file.is_file() else " (not there yet)"
                   if Path(entry.rpartition(":")[0]).is_absolute() else
                   " (not there yet: a relative path starts from node.data_dir)")
        print(f"note: task.entry {entry} runs the code in {task_file}{missing}: read it before "
              "you start")
        if args.join and not args.task and Path(line.task.rpartition(":")[0]).is_absolute():
            print(f"warning: the join line names its task file by a path on the machine that "
                  f"wrote it: check that {task_file} holds the swarm's task, or put the file "
                  f"in {config.data_dir()} and set task.entry to its name (\"{task_file.name}:"
                  f"{entry.rpartition(':')[2]}\")", file=sys.stderr)
    shared, warning = shareable_entry(entry)
    if warning and not args.join:
        print(warning, file=sys.stderr)
    join = JoinLine(name, key, (advertise,) if not args.join else tuple(bootstrap), shared, seed,
                    shards, options, cipher)
    print("start it:   gossipd run -c", config_path)
    print("a volunteer joins with (this line holds the swarm key: share it privately):")
    print(f"  gossipd init --join '{join}'")
    print(f"after editing the config's [task.options]: gossipd join-line -c {config_path}")
    return EXIT_OK


def shareable_entry(entry: str) -> tuple[str, str]:
    """The task entry a join line carries, and a warning when it is not ``entry`` ("" else).

    A task file named by an absolute path is a path on this machine, which a volunteer's
    machine rarely has: the line carries the file's name alone, which a volunteer's node looks
    for in its own node.data_dir (where a relative task.entry starts), and the warning says to
    send the file along. Refusing the line instead would leave the operator with no line at
    all, and the file has to reach the volunteer whichever way."""
    from .entry import is_file_entry, parse_entry
    try:
        target, function = parse_entry(entry)
    except ValueError:
        return entry, ""
    if not (is_file_entry(target) and Path(target).is_absolute()):
        return entry, ""
    name = Path(target).name
    return f"{name}:{function}", (
        f"warning: task.entry {entry} is a path on this machine; the join line names the file "
        f"alone, {name}:{function}, which a volunteer's node looks for in its own data "
        f"directory: send {name} with the line, or make the task a module volunteers install "
        f"(package.module:{function})")


def cmd_join_line(args: argparse.Namespace) -> int:
    config = _load(args)
    from .keys import JoinLine, KeyFileError, read_swarm_key
    from gossip.address import parse_address
    address = config.node.advertise or config.node.listen
    if parse_address(address)[1] == 0:
        raise UsageError(f"node.listen {address} has port 0, which nobody can dial: set "
                         "node.advertise")
    entry, warning = shareable_entry(config.task.entry)
    try:
        key = read_swarm_key(config.path(config.swarm.key_file))
        line = JoinLine(config.swarm.name, key, tuple(dict.fromkeys(
            (address, *config.swarm.bootstrap))), entry, config.task.seed, config.task.shards,
            dict(config.task.options), config.swarm.cipher)
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


COMMANDS = {
    "init": cmd_init, "run": cmd_run, "status": cmd_status, "check-config": cmd_check_config,
    "keygen": cmd_keygen, "average": cmd_average, "export": cmd_export, "demo": cmd_demo,
    "join-line": cmd_join_line,
}
