"""``gossipd init`` and ``gossipd join-line``: a node's first files, and the line that lets
another node join its swarm.

Theory of operation
-------------------
``init`` writes what a node needs to start, in one directory: its config (``gossipd.toml``),
its identity key (kept if ``gossipd keygen --identity`` made one) and the swarm key. A new
swarm gets a fresh key; a joiner takes the name, key, bootstrap addresses, task, seed, shards,
options and the swarm-wide settings of a join line (:class:`daemon.keys.JoinLine`), and may
not ``--set`` them otherwise. Everything is checked before anything is written — the config
built and validated, the swarm key file absent — so a failed ``init`` leaves nothing behind.
It then prints what it wrote, what to check (a guessed ``node.advertise``, a task file to read
first, a task module not installed here, loopback addresses) and the join line.

A join line carries a task file by its name alone (:func:`shareable_entry`): a path on this
machine means nothing on a volunteer's. Nothing here imports torch or trio: ``init`` must be
quick, and runs where neither is installed yet.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import secrets
import socket
import sys
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import gossip
from gossip.lowlevel import DEFAULT_CIPHER, format_address, parse_address

from .config import WILDCARDS, Config, ConfigError, apply_override, from_dict, render
from .entry import entry_file, is_file_entry, parse_entry
from .keys import JoinLine, KeyFileError, read_swarm_key, write_new, write_swarm_key

__all__ = ["InitError", "guess_address", "init_node", "is_loopback",
           "join_line", "loopback_note", "module_installed", "shareable_entry"]

class InitError(Exception):
    """``init`` or ``join-line`` cannot go on as asked: the operator's to fix; one line says
    how (exit code 2)."""


@dataclass(frozen=True)
class _Swarm:
    """The swarm a new node's config describes: a join line's (``line``), or a new one."""

    line: JoinLine | None
    name: str
    key: bytes
    bootstrap: list[str]
    entry: str
    seed: int
    options: dict[str, Any]
    shards: int
    settings: dict[str, Any]  # swarm-wide settings: the line's, or a new swarm's cipher


def guess_address() -> str:
    """This machine's address on its default route (no packet is sent), else 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: never routed, only used to pick a route
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def init_node(args: argparse.Namespace, new_task: str) -> None:
    """``gossipd init``: write the config, the identity key and the swarm key into
    ``args.dir``, then print what was written and the join line.

    Args:
        args: the command's arguments (``gossipd init --help``).
        new_task: the task entry of a new swarm when ``--task`` names none.

    Raises:
        InitError: a file is in the way, an argument or the join line is wrong, or a file
            cannot be written.
    """
    directory = Path(args.dir)
    config_path = directory / "gossipd.toml"
    if config_path.exists():
        raise InitError(f"{config_path} exists; not overwriting it")
    try:
        host, port = parse_address(args.listen)
    except ValueError as exc:
        raise InitError(f"--listen: {exc}") from None
    swarm = _swarm(args, new_task)
    guessed = not args.advertise and host in WILDCARDS
    advertise = args.advertise or format_address(guess_address() if guessed else host, port)
    if guessed and is_loopback(advertise) and not (
            swarm.line is not None and all(map(is_loopback, swarm.bootstrap))):  # this machine
        raise InitError("cannot tell this machine's address (it has no route to other "
                        "machines): give --advertise HOST:PORT, the address other nodes reach "
                        "it at, or --listen 127.0.0.1:PORT for a swarm on this machine alone")
    config, join, warning = _config(args, swarm, directory, config_path, advertise)
    identity = _write(config, config_path, swarm.key, directory)
    print(f"wrote {config_path}, {config.path(config.node.identity)} (peer id "
          f"{identity.peer_id}) and {config.path(config.swarm.key_file)}")
    if guessed and config.node.advertise == advertise:
        print(f"node.advertise = {advertise} (guessed: edit it if peers reach this machine by "
              "another address)")
    _notes(args, swarm, config, warning, join)
    print("start it:   gossipd run -c", config_path)
    print("a volunteer joins with (this line holds the swarm key: share it privately):")
    print(f"  gossipd init --join '{join}'")
    print(f"after editing the config's [task.options]: gossipd join-line -c {config_path}")


def _swarm(args: argparse.Namespace, new_task: str) -> _Swarm:
    """The swarm of ``--join`` (``-``: read the line from standard input), or a new one."""
    if not args.join:
        return _Swarm(None, args.swarm, secrets.token_bytes(32), [],
                      args.task or new_task, 0, {},
                      1 if args.shards is None else args.shards,
                      {"swarm.cipher": args.cipher or DEFAULT_CIPHER})
    text = sys.stdin.readline() if args.join == "-" else args.join
    try:
        line = JoinLine.parse(text)
    except KeyFileError as exc:
        raise InitError(str(exc)) from None
    swarm = _Swarm(line, line.name, line.key, list(line.bootstrap), args.task or line.task,
                   line.seed, dict(line.options),
                   line.shards if args.shards is None else args.shards,
                   line.settings())  # the swarm's: written into our config as they are
    if args.cipher is not None and args.cipher != line.cipher:
        raise InitError(f"the join line's swarm uses cipher {line.cipher}; a node of "
                        f"{args.cipher} could not connect to it")
    return swarm


def _config(args: argparse.Namespace, swarm: _Swarm, directory: Path, config_path: Path,
            advertise: str) -> tuple[Config, JoinLine, str]:
    """The new node's config (``--set`` applied), its join line, and the warning of
    :func:`shareable_entry` ("" if none), all checked before anything is written."""
    data: dict[str, Any] = {
        "node": {"listen": args.listen, "advertise": advertise},
        "swarm": {"name": swarm.name, "bootstrap": swarm.bootstrap},
        "task": {"entry": swarm.entry, "seed": swarm.seed, "shard": "auto",
                 "shards": swarm.shards, "options": swarm.options}}
    for config_key, value in swarm.settings.items():
        section, setting = config_key.split(".")
        data.setdefault(section, {})[setting] = value
    shared, warning = shareable_entry(swarm.entry)
    line = swarm.line
    try:
        for text in args.set:
            apply_override(data, text)  # as `gossipd run --set` does to the file's table
        config = from_dict(data, directory.resolve(), str(config_path))
        # A new swarm's first line names this node; a joiner's, the swarm it joins through.
        join = JoinLine.of(config, swarm.key, config.swarm.bootstrap if line else
                           [config.node.advertise], shared)
    except (ConfigError, KeyFileError) as exc:
        raise InitError(str(exc)) from None
    if line is not None:
        for config_key, value in line.settings().items():
            if join.settings()[config_key] != value:
                raise InitError(f"the join line's swarm has {config_key} = {json.dumps(value)};"
                                f" a node with {json.dumps(join.settings()[config_key])} could "
                                f"not take part in it (leave out --set {config_key})")
    return config, join, warning


def _write(config: Config, config_path: Path, key: bytes, directory: Path) -> gossip.Identity:
    """Write the swarm key, the identity (unless one is there) and the config; returns the
    identity."""
    key_path, identity_path = config.path(config.swarm.key_file), config.path(config.node.identity)
    if key_path.exists():  # checked before anything is written: a failed init leaves nothing
        raise InitError(f"{key_path} exists; not overwriting it")
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
        raise InitError(str(exc)) from None
    return identity


def _notes(args: argparse.Namespace, swarm: _Swarm, config: Config, warning: str,
           join: JoinLine) -> None:
    """What the operator should know of the config just written: what the join line
    carried, the task's code, and addresses only this machine can dial."""
    line, entry = swarm.line, swarm.entry
    if line is not None:
        carried = line.settings(changed=True)
        if carried:
            print("swarm settings from the join line: " + ", ".join(
                f"{k} = {json.dumps(v)}" for k, v in carried.items()))
        if line.options:
            print(f"task.options from the join line: {json.dumps(swarm.options, sort_keys=True)}")
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


def is_loopback(address: str) -> bool:
    """Whether ``host:port`` names this machine only (127.0.0.0/8, ::1, localhost)."""
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


def join_line(config: Config) -> tuple[JoinLine, str]:
    """The join line of this node's swarm as ``config`` stands, and the warning of
    :func:`shareable_entry` ("" if none).

    Raises:
        InitError: nobody could dial the node's address (port 0).
        KeyFileError: the swarm key cannot be read, or the line cannot carry the config.
    """
    address = config.node.advertise or config.node.listen
    if parse_address(address)[1] == 0:
        raise InitError(f"node.listen {address} has port 0, which nobody can dial: set "
                        "node.advertise")
    # A node nobody can dial (node.reachable = false) is no address to join through.
    own = [] if config.node.reachable is False and config.swarm.bootstrap else [address]
    entry, warning = shareable_entry(config.task.entry)
    key = read_swarm_key(config.path(config.swarm.key_file))
    return JoinLine.of(config, key, [*own, *config.swarm.bootstrap], entry), warning
