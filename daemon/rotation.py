"""Rotating a node's swarm key: ``gossipd rotate-key`` and ``gossipd retire-key`` (the files
they write and what they print), and what ``gossipd status`` says mid-rotation.

Theory of operation
-------------------
A rotation moves a running swarm from key K0 to key K1 in two rounds of restarts, one node at
a time (docs/OPERATIONS.md, "Rotate the swarm key"; the protocol side is
:mod:`gossip.rotation`):

1. *Start* (:func:`start_rotation`), on each node: the swarm key file gets K1; a file beside
   it, named by ``swarm.previous_key_file``, keeps K0. Restarted, the node accepts both keys,
   and initiates and seals under K1, falling back to K0 for peers that hold only K0.
2. *Finish* (:func:`finish_rotation`), on each node once every node holds K1:
   ``swarm.previous_key_file`` is cleared and its file deleted. Restarted, the node speaks K1
   only; a holder of K0 alone (an old join line) can no longer reach it.

The files are written so that a crash at any point leaves a node that either starts with keys
the swarm accepts or refuses to start with a one-line error, and a command that can simply be
run again:

* start: (a) the previous key file is created holding K0 (0600, fsynced); (b) the config
  names it (a temporary file renamed over the config); (c) the key file is replaced by K1 (the
  same way). A crash after (a) leaves the node as it was; running again finds the previous
  file holding the current key and goes on. A crash after (b) leaves both files holding K0,
  which the node refuses to start with (:func:`daemon.keys.load_swarm`); running again
  resumes at (c).
* finish: (a) the config clears ``swarm.previous_key_file``; (b) the file is deleted. A crash
  after (a) leaves the node on K1 alone, which is what finishing means, and a stray file.

The config is edited as text, one line in its ``[swarm]`` table, so the operator's comments
and layout stay; the result is parsed back and must differ from the original in that one key
only, or nothing is written and the error says what to set by hand.
"""

from __future__ import annotations

import json
import re
import secrets
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gossip import Swarm
from gossip.lowlevel import Holds

from .control import ControlError, query
from .files import atomic_write
from .keys import JoinLine, read_swarm_key, replace_swarm_key, same_owner, write_new

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = ["RotationError", "Started", "start_rotation", "finish_rotation", "previous_name",
           "set_swarm_key", "rotation_status", "rotate_key", "say_started", "retire_key",
           "rotation_line", "listed"]

KEY = "previous_key_file"
DOC = ("# only while rotating the swarm key: the key being replaced (gossipd rotate-key set "
       "this; gossipd retire-key clears it)")
_TABLE = re.compile(r"\s*\[\s*swarm\s*\]\s*(#.*)?")
_ANY_TABLE = re.compile(r"\s*\[")
_THE_KEY = re.compile(rf"\s*{KEY}\s*=")


class RotationError(Exception):
    """The rotation cannot go on as asked: the operator's to fix; one line says how."""


@dataclass(frozen=True)
class Started:
    """What :func:`start_rotation` did."""

    key_file: Path  # now holds the new key
    previous_key_file: Path  # holds the key it replaced
    resumed: bool  # an interrupted start was completed


def previous_name(key_file: str) -> str:
    """Where a rotation keeps the key ``key_file`` held: beside it, ``swarm.key`` becoming
    ``swarm.previous.key`` (relative stays relative, as ``key_file`` is written)."""
    path = Path(key_file)
    return str(path.with_name(f"{path.stem}.previous{path.suffix}"))


def start_rotation(config_path: Path, config: Any, new_key: bytes | None = None) -> Started:
    """Begin rotating this node's swarm key to ``new_key`` (a fresh random key if None).

    Args:
        config_path: the config file, edited in place.
        config: it, loaded (:class:`daemon.config.Config`).

    Raises:
        RotationError: a rotation is already under way, ``new_key`` is the current key, a
            stray previous key file is in the way, or the config cannot be edited.
        KeyFileError: a key file cannot be read or written.
    """
    key_path = config.path(config.swarm.key_file)
    current = read_swarm_key(key_path)
    if new_key is not None and new_key == current:
        raise RotationError(f"{key_path} already holds that key: this node has rotated to it")
    if config.swarm.previous_key_file:
        previous_path = config.path(config.swarm.previous_key_file)
        if read_swarm_key(previous_path) != current:
            raise RotationError(
                f"a rotation is already under way (swarm.previous_key_file = "
                f"{config.swarm.previous_key_file!r}): finish it first, with gossipd "
                "retire-key once every node holds the current key")
        # Interrupted after the config named the previous file: only the new key is missing.
        replace_swarm_key(key_path, new_key or secrets.token_bytes(32))
        return Started(key_path, previous_path, resumed=True)
    relative = previous_name(config.swarm.key_file)
    previous_path = config.path(relative)
    leftover = previous_path.exists()
    if leftover and read_swarm_key(previous_path) != current:
        raise RotationError(f"{previous_path} exists and holds another key than {key_path} (left "
                            "by an earlier rotation?): delete it if no node needs it, and run "
                            "this again")
    text = set_swarm_key(config_path, relative)
    if not leftover:  # a leftover holding the current key is what this step writes
        write_new(previous_path, current.hex().encode() + b"\n")
        same_owner(previous_path, key_path)
    _replace_text(config_path, text)
    replace_swarm_key(key_path, new_key or secrets.token_bytes(32))
    return Started(key_path, previous_path, resumed=False)


def finish_rotation(config_path: Path, config: Any) -> Path | None:
    """Drop the previous swarm key: clear ``swarm.previous_key_file`` and delete its file.
    Returns the file deleted, or None if no rotation was under way.

    Raises:
        RotationError: the config cannot be edited.
        KeyFileError: the swarm key file, which the node will then rely on alone, cannot be
            read.
    """
    if not config.swarm.previous_key_file:
        return None
    read_swarm_key(config.path(config.swarm.key_file))
    previous_path = config.path(config.swarm.previous_key_file)
    _replace_text(config_path, set_swarm_key(config_path, ""))
    previous_path.unlink(missing_ok=True)
    return previous_path


def set_swarm_key(config_path: Path, value: str) -> str:
    """The text of the config file with ``swarm.previous_key_file`` set to ``value``: its line
    in the ``[swarm]`` table replaced, or added under the table's header.

    Raises:
        RotationError: the file cannot be read, or the edit would change anything else (no
            ``[swarm]`` header, a multi-line value, ...): the message says what to set.
    """
    by_hand = (f"set swarm.previous_key_file = {json.dumps(value)} in {config_path} by hand, "
               "then run this again")
    try:
        text = config_path.read_text(encoding="utf-8")
        original = tomllib.loads(text)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise RotationError(f"cannot read {config_path}: {exc}") from None
    lines = text.splitlines(keepends=True)
    line = f"{KEY} = {json.dumps(value)}\n"  # a JSON string is a TOML basic string
    header = next((i for i, text_line in enumerate(lines)
                   if _TABLE.fullmatch(text_line.rstrip("\r\n"))), None)
    if header is None:
        raise RotationError(f"no [swarm] table header in {config_path}: {by_hand}")
    end = next((i for i in range(header + 1, len(lines)) if _ANY_TABLE.match(lines[i])),
               len(lines))
    found = next((i for i in range(header + 1, end) if _THE_KEY.match(lines[i])), None)
    if found is not None:
        lines[found] = line
    else:
        if not lines[header].endswith("\n"):  # the header is the file's last line
            lines[header] += "\n"
        lines[header + 1:header + 1] = [DOC + "\n", line]
    edited = "".join(lines)
    expected = dict(original, swarm={**original.get("swarm", {}), KEY: value})
    try:
        if tomllib.loads(edited) != expected:
            raise RotationError(f"editing {config_path} would change more than one key: {by_hand}")
    except tomllib.TOMLDecodeError:
        raise RotationError(f"editing {config_path} would break it: {by_hand}") from None
    return edited


def _replace_text(path: Path, text: str) -> None:
    """Write ``text`` over ``path`` atomically (:func:`daemon.files.atomic_write`), with the
    same mode and, for root, the same owner."""
    try:
        atomic_write(path, text.encode("utf-8"), mode=path.stat().st_mode & 0o777,
                     owner_like=path)
    except OSError as exc:
        raise RotationError(f"cannot write {path}: {exc.strerror or exc}") from None


def rotation_status(swarm: Swarm, addresses: Iterable[str]) -> dict[str, Any] | None:
    """For ``gossipd status``: None when the node holds one swarm key; mid-rotation, which of
    the peers at ``addresses`` (the alive members') have shown the new key, which only the
    old one, and which nothing yet (:mod:`gossip.rotation`), and the previous key's counters."""
    if swarm.previous is None:
        return None
    seen: dict[str, list[str]] = {"new_key": [], "old_key": [], "unknown": []}
    for address in sorted(set(addresses)):
        holds = swarm.peer_keys.holds(address)
        seen["new_key" if holds is Holds.CURRENT else "unknown" if holds is None
             else "old_key"].append(address)
    stats = swarm.peer_keys.statistics()
    return {**seen, "datagrams_previous": stats.datagrams_previous,
            "handshakes_previous": stats.handshakes_previous, "fallbacks": stats.fallbacks}


def listed(addresses: list[str], most: int = 5) -> str:
    """The first ``most`` of ``addresses``, and how many more."""
    shown = ", ".join(addresses[:most])
    return shown + (f" and {len(addresses) - most} more" if len(addresses) > most else "")


def rotation_line(r: dict[str, Any]) -> str:
    """The ``gossipd status`` line of a node mid-rotation (``r``: :func:`rotation_status`)."""
    total = len(r["new_key"]) + len(r["old_key"]) + len(r["unknown"])
    text = (f"mid-rotation, holding the previous swarm key too: {len(r['new_key'])} of {total} "
            "peers seen on the new key")
    if r["old_key"]:
        text += f"; on the old key only: {listed(r['old_key'])}"
    if r["unknown"]:
        text += f"; not heard from yet: {listed(r['unknown'])}"
    return text + "; once every node holds the new key: gossipd retire-key"


def rotate_key(config_path: Path, config: Any, *, key_file: str | None = None,
               join: str | None = None) -> Started:
    """``gossipd rotate-key``: start rotating to the key in ``key_file``, to the key of the
    join line ``join`` (``-``: read from standard input), or to a fresh one.

    Raises:
        RotationError: the join line is another swarm's, or as :func:`start_rotation`.
        KeyFileError: a key file or the join line cannot be read.
    """
    new_key = None
    if key_file:
        new_key = read_swarm_key(Path(key_file))
    elif join:
        line = JoinLine.parse(sys.stdin.readline() if join == "-" else join)
        if (line.name, line.cipher) != (config.swarm.name, config.swarm.cipher):
            raise RotationError(f"the join line is for swarm {line.name!r} with cipher "
                                f"{line.cipher}; this node is in {config.swarm.name!r} with "
                                f"cipher {config.swarm.cipher}")
        new_key = line.key
    return start_rotation(config_path, config, new_key)


def say_started(started: Started, config_path: Path) -> None:
    """Print what :func:`rotate_key` did and what the operator does next, up to the new join
    line (which the command prints after)."""
    print(f"{'finished an interrupted start: ' if started.resumed else ''}{started.key_file} "
          f"holds the new swarm key; {started.previous_key_file} the one it replaces "
          f"(swarm.previous_key_file in {config_path})")
    print("restart this node now: it accepts both keys and speaks the new one")
    print("then each other node in turn, restarted before the next, with the same key:")
    print("  gossipd rotate-key -c CONFIG --join -        and paste the join line below")
    print(f"  gossipd rotate-key -c CONFIG --key-file F   F a private copy of {started.key_file}")
    print("the new join line (it holds the new key: share it privately; lines with the old key "
          "stop working once the rotation is finished):")


def retire_key(config_path: Path, config: Any, *, force: bool = False) -> None:
    """``gossipd retire-key``: finish the rotation under way, unless the running daemon (if
    any) still hears peers on the old key only and not ``force``; prints what it did.

    Raises:
        RotationError: peers still on the old key, or as :func:`finish_rotation`.
        KeyFileError: as :func:`finish_rotation`.
    """
    if not config.swarm.previous_key_file:
        print(f"no swarm key rotation under way in {config_path} (swarm.previous_key_file is "
              "empty): nothing to finish")
        return
    try:
        rotation = query(config.path(config.node.control)).get("rotation") or {}
    except ControlError:
        rotation = {}  # not running: nothing to ask; the restart comes later anyway
    if rotation.get("old_key") and not force:
        raise RotationError(f"the running daemon still hears {listed(rotation['old_key'])} on "
                            "the old key only: rotate those nodes first (gossipd rotate-key), "
                            "or finish anyway with --force")
    previous = finish_rotation(config_path, config)
    print(f"dropped the previous swarm key: deleted {previous}; swarm.previous_key_file "
          f"cleared in {config_path}")
    print("restart this node now: it then speaks the new key only, and nodes or join lines "
          "with the old key alone can no longer reach it")
