"""The ``gossipd`` command line. Parsing and dispatch only; the work is in the other modules:
``run`` in :mod:`daemon.service` (a follower process's in :mod:`daemon.follower`), ``status``'s
reply and rendering in :mod:`daemon.status`, ``init`` and ``join-line`` in :mod:`daemon.init`,
``rotate-key`` and ``retire-key`` in :mod:`daemon.rotation`. Each command imports what it needs
when it runs: ``status`` must answer in milliseconds, without torch or trio.

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
import sys
from pathlib import Path
from typing import Any, Sequence

from gossip.lowlevel import CIPHERS

from .exits import EXIT_FAILED, EXIT_NOT_READY, EXIT_NOT_RUNNING, EXIT_OK, EXIT_USAGE

__all__ = ["main"]

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
    sp.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint-<step>[.<k>].ckpt file")
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
    from .service import run
    from .startup import StartupError
    from .task import TaskError
    try:
        where = placement(config.task.processes, pipeline=config.task.pipeline)
    except ProcessesError as exc:
        raise UsageError(str(exc)) from None
    live = logs.setup(args.log_level, process=where.rank if where.several else None)
    if not where.speaker:
        exit_now(follow(config, where))
    argv = ("run", *(("-c", args.config) if args.config else ()),
            *(x for value in args.set for x in ("--set", value)), "--log-level", args.log_level)
    code = EXIT_OK
    try:
        trio.run(lambda: run(config, argv, live=live))
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
    from .status import format_status, not_ready
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


def cmd_check_config(args: argparse.Namespace) -> int:
    config = _load(args)
    from .config import render
    from .keys import KeyFileError, load_swarm
    from .processes import ProcessesError, placement
    from .startup import StartupError, resolve_device
    from .task import TaskError, load_entry
    try:
        previous = config.swarm.previous_key_file
        load_swarm(config.swarm.name, config.path(config.swarm.key_file),
                   config.path(previous) if previous else None, config.swarm.cipher)
        # This process's device, with every process's GPU counted: what `run` resolves.
        where = placement(config.task.processes, pipeline=config.task.pipeline)
        device = resolve_device(config.task.device, where)
        load_entry(config.task.entry, config.data_dir())
    except (KeyFileError, TaskError, ProcessesError, StartupError) as exc:
        raise UsageError(str(exc)) from None
    print(render(config), end="")
    n = where.size
    where_text = (f"cuda:0 to cuda:{n - 1}, one per process" if device.type == "cuda" and n > 1
                  else str(device))
    print(f"# ok: {args.config or 'the config'} is valid; keys and task load; task.device "
          f"{config.task.device} is {where_text} here", file=sys.stderr)
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


def cmd_init(args: argparse.Namespace) -> int:
    from .init import InitError, init_node
    try:
        init_node(args, new_task=NEW_SWARM_TASK)
    except InitError as exc:
        raise UsageError(str(exc)) from None
    return EXIT_OK


def cmd_join_line(args: argparse.Namespace) -> int:
    config = _load(args)
    from .init import InitError, join_line
    from .keys import KeyFileError
    try:
        line, warning = join_line(config)
    except (InitError, KeyFileError) as exc:
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
    from .keys import KeyFileError
    from .rotation import RotationError, rotate_key, say_started
    config_path = _config_path(args)
    try:
        started = rotate_key(config_path, config, key_file=args.key_file, join=args.join)
    except (KeyFileError, RotationError) as exc:
        raise UsageError(str(exc)) from None
    say_started(started, config_path)
    try:
        cmd_join_line(argparse.Namespace(config=args.config))
    except UsageError as exc:
        print(f"  none: {exc}")
    print("once every node has restarted on the new key: gossipd retire-key on each, then "
          "restart it")
    return EXIT_OK


def cmd_retire_key(args: argparse.Namespace) -> int:
    config = _load(args)
    from .keys import KeyFileError
    from .rotation import RotationError, retire_key
    try:
        retire_key(_config_path(args), config, force=args.force)
    except (KeyFileError, RotationError) as exc:
        raise UsageError(str(exc)) from None
    return EXIT_OK


COMMANDS = {
    "init": cmd_init, "run": cmd_run, "status": cmd_status, "check-config": cmd_check_config,
    "keygen": cmd_keygen, "average": cmd_average, "export": cmd_export, "demo": cmd_demo,
    "join-line": cmd_join_line, "rotate-key": cmd_rotate_key,
    "retire-key": cmd_retire_key,
}
