"""Swarm key files and the join line a volunteer pastes into ``gossipd init --join``.

A swarm key file holds the 32-byte key as 64 hexadecimal characters and a newline, mode
0600. While the swarm key is rotated, a node reads two: ``swarm.key_file``, the new key, and
``swarm.previous_key_file``, the one it replaces (:func:`load_swarm`; the rotation itself is
:mod:`daemon.rotation`). The join line carries everything a new node needs to take part::

    gossip://NAME@HOST:PORT,HOST:PORT?key=64HEX&task=MODULE:FUNCTION&seed=0&shards=8

``shards`` (how many shards the swarm cuts its data into) is left out when it is 1.
:data:`SETTINGS` are the config settings every node of a swarm must share (``cipher=``,
``profile=``, ``codec=``, ``mixing=``, ``weight=``, ``correction=``), each left out when it is
the config's default, so that a line of a swarm that keeps the defaults reads as before.
``options`` carries the task's options (the config's ``[task.options]``), left out when there
are none: their canonical JSON (sorted keys, no spaces, ASCII) in URL-safe base64 without
padding, at most :data:`MAX_OPTIONS` bytes of JSON. Only what both JSON and TOML hold travels:
tables, arrays, text, booleans, finite numbers and 64-bit integers, nested at most
:data:`MAX_OPTIONS_DEPTH` deep.

Nothing machine-local travels. The addresses are ones other machines dial (the node's
advertised address, never a wildcard host or port 0); a task file named by an absolute path
travels as its name alone (``daemon.init.shareable_entry``); the writer's identity, data
directory, control socket, listen address and device stay on its machine. A line is refused
whole if any field is malformed, unknown (a newer gossipd's setting, which this one would
silently drop) or given twice.

It holds the swarm key, so it is a secret: share it as you would a password (anyone holding
it can join the swarm and read its weights).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import os
import re
import reprlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote

from gossip import MAX_SHARDS, Swarm
from gossip.lowlevel import DEFAULT_CIPHER, parse_address

from .config import WILDCARDS, AveragingSection, Config, ConfigError, SwarmSection
from .files import atomic_write

__all__ = ["KeyFileError", "JoinLine", "read_swarm_key", "write_swarm_key", "write_new",
           "replace_swarm_key", "same_owner", "load_swarm", "encode_options", "decode_options",
           "SETTINGS"]

SCHEME = "gossip://"
MAX_KEY_FILE = 256  # bytes read from a key file at most
MAX_OPTIONS = 4096  # bytes of the task options' JSON in a join line (a line is pasted in a shell)
MAX_OPTIONS_DEPTH = 8  # tables and arrays inside one another, the options table included
_BASE64URL = re.compile(r"[A-Za-z0-9_-]*")
_NUMBER = re.compile(r"[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?")  # a weight= as the line writes it

# The settings every node of a swarm must share besides its name, key, task, seed and shards:
# the line's field and the config key it sets. A node that differs in one cannot take part, or
# pulls the swarm off course: another cipher cannot connect (it is never negotiated); another
# membership profile suspects its peers falsely (LAN timing against WAN delays); an offer in
# another codec or mixing mode is refused and its sender quarantined (PROTOCOL.md 9.3);
# another fixed weight moves the swarm's mean at each of its exchanges, and a node without
# the drift correction swaps no estimates, so its partners' corrections stop tracking the
# swarm (9.5). Their defaults, and what values they take, are the config's.
SETTINGS = (("cipher", "swarm.cipher"), ("profile", "swarm.profile"),
            ("codec", "averaging.codec"), ("mixing", "averaging.mixing"),
            ("weight", "averaging.weight"), ("correction", "averaging.correction"))
_SECTIONS = {"swarm": SwarmSection, "averaging": AveragingSection}
_FIELDS = frozenset({"key", "task", "seed", "shards", "options", *(name for name, _ in SETTINGS)})


class KeyFileError(Exception):
    """A key file is missing, unreadable or malformed, or a join line is (the operator's)."""


def read_swarm_key(path: Path) -> bytes:
    """Read a swarm key file.

    Raises:
        KeyFileError: missing, unreadable, or not 64 hex characters.
    """
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_KEY_FILE + 1)
    except FileNotFoundError:
        raise KeyFileError(f"swarm key file {path} does not exist") from None
    except OSError as exc:
        raise KeyFileError(f"cannot read swarm key file {path}: {exc.strerror}") from None
    text = data.decode("ascii", "replace").strip()
    if len(data) > MAX_KEY_FILE or len(text) != 64:
        raise KeyFileError(f"swarm key file {path} must hold 64 hex characters")
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != 32:  # fromhex skips inner spaces: "00 00 ..." is 64 characters, fewer bytes
        raise KeyFileError(f"swarm key file {path} must hold 64 hex characters")
    return key


def write_new(path: Path, data: bytes) -> None:
    """Create ``path`` with mode 0600 holding ``data``, fsynced with its directory; never
    overwrite.

    Raises:
        KeyFileError: the file exists, or cannot be written.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, data, exclusive=True)
    except FileExistsError:
        raise KeyFileError(f"{path} exists; not overwriting it") from None
    except OSError as exc:
        raise KeyFileError(f"cannot create {path}: {exc.strerror}") from None


def write_swarm_key(path: Path, key: bytes) -> None:
    """Write a new swarm key file (0600); refuses to overwrite one."""
    if len(key) != 32:
        raise ValueError("a swarm key is 32 bytes")
    write_new(path, key.hex().encode() + b"\n")


def replace_swarm_key(path: Path, key: bytes) -> None:
    """Put ``key`` in the swarm key file ``path`` (0600, and for root the owner of the file it
    replaces) in place of what it holds, atomically (:func:`daemon.files.atomic_write`), so
    that a crash leaves either key whole, never a torn file.

    Raises:
        KeyFileError: it cannot be written.
    """
    if len(key) != 32:
        raise ValueError("a swarm key is 32 bytes")
    path.with_name(path.name + ".new").unlink(missing_ok=True)  # an older version's temp file
    try:
        atomic_write(path, key.hex().encode() + b"\n", owner_like=path if path.exists() else None)
    except OSError as exc:
        raise KeyFileError(f"cannot replace {path}: {exc.strerror}") from None


def same_owner(path: Path, like: Path) -> None:
    """Give ``path`` the owner of ``like`` when we run as root (``sudo gossipd rotate-key``):
    a key file the daemon's own user cannot read would stop the daemon at its next start.

    Raises:
        KeyFileError: the owner cannot be changed.
    """
    if os.geteuid() != 0:
        return
    try:
        st = like.stat()
        os.chown(path, st.st_uid, st.st_gid)
    except OSError as exc:
        raise KeyFileError(f"cannot give {path} the owner of {like}: {exc.strerror}") from None


def load_swarm(name: str, key_path: Path, previous_path: Path | None = None,
               cipher: str = DEFAULT_CIPHER) -> Swarm:
    """The swarm a node runs in: its key from ``key_path`` and, mid-rotation, the key being
    replaced from ``previous_path``.

    Raises:
        KeyFileError: a key file is missing, unreadable or malformed, or both hold the same
            key (one line, naming the files).
    """
    key = read_swarm_key(key_path)
    previous = None if previous_path is None else read_swarm_key(previous_path)
    if previous is not None and previous == key:
        raise KeyFileError(f"swarm key files {key_path} and {previous_path} hold the same key: "
                           "the previous key must be the one being replaced (gossipd "
                           "rotate-key writes a new one)")
    return Swarm(name, key, cipher, previous)


@dataclass(frozen=True)
class JoinLine:
    """What a volunteer needs to join a swarm (see the module's docstring).

    Raises:
        KeyFileError: a field no line may carry: options (:func:`encode_options`), a setting
            of :data:`SETTINGS` its config key refuses, a bootstrap address nobody can dial.
    """

    name: str
    key: bytes
    bootstrap: tuple[str, ...]
    task: str
    seed: int = 0
    shards: int = 1  # task.shards: every node cuts the data the same way
    options: Mapping[str, Any] = field(default_factory=dict)  # [task.options]
    # SETTINGS, their defaults the config's:
    cipher: str = SwarmSection.cipher
    profile: str = SwarmSection.profile
    codec: str = AveragingSection.codec
    mixing: str = AveragingSection.mixing
    weight: float = AveragingSection.weight
    correction: bool = AveragingSection.correction

    def __post_init__(self) -> None:  # a KeyFileError now, not when the line is printed
        encode_options(self.options)
        if not self.bootstrap:
            raise KeyFileError("a join line needs a bootstrap address")
        for address in self.bootstrap:
            _check_dialable(address)
        tables: dict[str, dict[str, Any]] = {}
        for config_key, value in self.settings().items():
            section, setting = config_key.split(".")
            tables.setdefault(section, {})[setting] = value
        try:
            for section, table in tables.items():
                _SECTIONS[section](**table)  # the config's checks: one declaration of each
        except ConfigError as exc:  # "averaging.codec: expected ..., got 'x'"
            field_name = dict((k, n) for n, k in SETTINGS).get(exc.key or "")
            raise KeyFileError(f"{field_name}= ({exc})" if field_name else str(exc)) from None

    def settings(self, *, changed: bool = False) -> dict[str, Any]:
        """The :data:`SETTINGS` of the line by config key (``{"swarm.profile": "wan", ...}``):
        what ``gossipd init --join`` writes into the joiner's config. ``changed``: only those
        that differ from the config's defaults (those the line's text names)."""
        return {config_key: getattr(self, name) for name, config_key in SETTINGS
                if not changed or getattr(self, name) != _default(config_key)}

    @classmethod
    def of(cls, config: Config, key: bytes, bootstrap: Iterable[str], task: str) -> JoinLine:
        """The line of the swarm ``config`` runs in: its name, seed, shards, options and
        :data:`SETTINGS`, with the swarm ``key``, the ``bootstrap`` addresses (duplicates
        dropped) and the ``task`` volunteers run (``config.task.entry``, unless that names a
        path on this machine).

        Raises:
            KeyFileError: the config holds options a line cannot carry.
        """
        settings = {name: getattr(getattr(config, config_key.split(".")[0]),
                                  config_key.split(".")[1]) for name, config_key in SETTINGS}
        return cls(config.swarm.name, key, tuple(dict.fromkeys(bootstrap)), task,
                   config.task.seed, config.task.shards, dict(config.task.options), **settings)

    def __str__(self) -> str:
        peers = ",".join(self.bootstrap)
        changed = self.settings(changed=True)
        settings = "".join(f"&{name}={_setting_text(changed[config_key])}"
                           for name, config_key in SETTINGS if config_key in changed)
        return (f"{SCHEME}{quote(self.name, safe='')}@{peers}?key={self.key.hex()}"
                f"&task={quote(self.task, safe=':/.')}&seed={self.seed}"
                + (f"&shards={self.shards}" if self.shards != 1 else "")
                + settings
                + (f"&options={encode_options(self.options)}" if self.options else ""))

    def __repr__(self) -> str:  # never print the key
        return f"JoinLine(name={self.name!r}, bootstrap={self.bootstrap!r}, task={self.task!r})"

    @classmethod
    def parse(cls, text: str) -> JoinLine:
        """Read a join line. A field left out takes its default: lines written before a field
        existed stay valid.

        Raises:
            KeyFileError: it is not a well-formed join line (one line, never the key).
        """
        text = text.strip()
        if not text.startswith(SCHEME) or "@" not in text or "?" not in text:
            raise KeyFileError(f"a join line looks like {SCHEME}NAME@HOST:PORT?key=...&task=...")
        rest = text[len(SCHEME):]
        head, _, query = rest.partition("?")
        name, _, peers = head.rpartition("@")
        fields = parse_qs(query, keep_blank_values=True)
        try:
            unknown = sorted(set(fields) - _FIELDS)
            if unknown:  # a newer gossipd's setting, which a node must not silently go without
                raise ValueError(f"unknown field {reprlib.repr(unknown[0])}: a line from a "
                                 "newer gossipd? Upgrade this one")
            twice = sorted(given for given, values in fields.items() if len(values) > 1)
            if twice:
                raise ValueError(f"{twice[0]}= is given twice")
            bootstrap = tuple(p for p in peers.split(",") if p)
            for address in bootstrap:
                parse_address(address)
            if not bootstrap:
                raise ValueError("no bootstrap address")
            key = bytes.fromhex(fields["key"][0])
            if len(key) != 32:
                raise ValueError("the key must be 64 hex characters")
            task = fields["task"][0]  # parse_qs has decoded it
            if not task:
                raise ValueError("task= is empty")
            seed_text = fields.get("seed", ["0"])[0]
            if not (seed_text.isascii() and seed_text.isdigit()):
                raise ValueError(f"the seed must be a non-negative integer, not {seed_text!r}")
            seed = int(seed_text)
            shards_text = fields.get("shards", ["1"])[0]
            if not (shards_text.isascii() and shards_text.isdigit()
                    and 1 <= int(shards_text) <= MAX_SHARDS):
                raise ValueError(f"shards must be an integer in 1..{MAX_SHARDS}, not "
                                 f"{shards_text!r}")
            shards = int(shards_text)
            options = decode_options(fields["options"][0]) if "options" in fields else {}
            settings = {setting: _setting_value(setting, fields[setting][0], _default(config_key))
                        for setting, config_key in SETTINGS if setting in fields}
            name = unquote(name)
            if not name:
                raise ValueError("no swarm name")
        except (KeyError, IndexError):
            raise KeyFileError("the join line lacks key= or task=") from None
        except ValueError as exc:
            raise KeyFileError(f"bad join line: {exc}") from None
        try:
            return cls(name, key, bootstrap, task, seed, shards, options, **settings)
        except KeyFileError as exc:  # a setting the config refuses, an address nobody dials
            raise KeyFileError(f"bad join line: {exc}") from None


def _default(config_key: str) -> Any:
    """The config's default for one of :data:`SETTINGS`."""
    section, setting = config_key.split(".")
    return getattr(_SECTIONS[section], setting)


def _setting_text(value: Any) -> str:
    """A setting's value as a line writes it: ``true``/``false``, a float's repr, or text."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(float(value))
    return quote(str(value), safe="")


def _setting_value(name: str, text: str, default: Any) -> Any:
    """A setting's value from its text in a line, of its default's type; whether the setting
    takes it is the config's check (in :meth:`JoinLine.__post_init__`).

    Raises:
        ValueError: not text of that type.
    """
    if isinstance(default, bool):
        if text not in ("true", "false"):
            raise ValueError(f"{name}= must be true or false, not {reprlib.repr(text)}")
        return text == "true"
    if isinstance(default, float):
        if not _NUMBER.fullmatch(text):
            raise ValueError(f"{name}= must be a number, not {reprlib.repr(text)}")
        return float(text)
    return text


def _check_dialable(address: str) -> None:
    """Refuse a bootstrap address that no other machine can dial.

    Raises:
        KeyFileError: malformed, port 0, or a wildcard host.
    """
    try:
        host, port = parse_address(address)
    except ValueError as exc:
        raise KeyFileError(str(exc)) from None
    if port == 0:
        raise KeyFileError(f"bootstrap address {address} has port 0, which nobody can dial")
    if host in WILDCARDS:
        raise KeyFileError(f"bootstrap address {address} cannot be dialed: {host} means every "
                           "address of the machine that listens, not one to reach it at")


def encode_options(options: Mapping[str, Any]) -> str:
    """The task options as a join line carries them (see the module's docstring).

    Raises:
        KeyFileError: a value the line cannot carry (a date or a time, a number that is not
            finite, an integer beyond 64 bits), nesting too deep, or more than MAX_OPTIONS
            bytes of JSON. The message names the option.
    """
    problem = _option_problem(options, "task.options", 1)
    if problem:
        raise KeyFileError(f"{problem}: a join line carries tables, arrays, text, booleans and "
                           "numbers (64-bit integers, finite floats); write it another way, or "
                           "set it on each node")
    data = json.dumps(options, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode()
    if len(data) > MAX_OPTIONS:
        raise KeyFileError(f"task.options take {len(data)} bytes as JSON, more than a join "
                           f"line carries ({MAX_OPTIONS}): send them to volunteers another way")
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def decode_options(text: str) -> dict[str, Any]:
    """The task options of a join line's ``options=`` field.

    Raises:
        KeyFileError: not base64url of a JSON table of at most MAX_OPTIONS bytes, or a value
            :func:`encode_options` would refuse (duplicate keys included).
    """
    if len(text) > (MAX_OPTIONS * 4 + 2) // 3 or not _BASE64URL.fullmatch(text):
        raise KeyFileError("bad join line: options= is not the base64url of at most "
                           f"{MAX_OPTIONS} bytes")
    try:
        data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode("utf-8")
        # Bounded before parsing: how deep a parser may recurse depends on the Python build.
        if _json_depth(data) > MAX_OPTIONS_DEPTH:
            raise KeyFileError(f"bad join line: options= is nested more than "
                               f"{MAX_OPTIONS_DEPTH} deep")
        options = json.loads(data, object_pairs_hook=_unique, parse_constant=_no_constant)
    except (binascii.Error, ValueError, RecursionError) as exc:
        raise KeyFileError(f"bad join line: options= does not decode: {exc}") from None
    if type(options) is not dict:
        raise KeyFileError("bad join line: options= is not a table")
    problem = _option_problem(options, "options", 1)
    if problem:
        raise KeyFileError(f"bad join line: {problem}")
    return options


def _json_depth(text: str) -> int:
    """How deep the arrays and objects of the JSON ``text`` nest (brackets inside strings do
    not count); any text gives a number, the parser judges the rest."""
    depth = deepest = 0
    quoted = escaped = False
    for char in text:
        if quoted:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                quoted = False
        elif char == '"':
            quoted = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    table = dict(pairs)
    if len(table) != len(pairs):
        raise ValueError("a key is given twice")
    return table


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number a task option may have")


def _option_problem(value: Any, where: str, depth: int) -> str:
    """What JSON and TOML do not both hold the same way in ``value``, or nesting too deep;
    "" if nothing."""
    if isinstance(value, (Mapping, list, tuple)) and depth > MAX_OPTIONS_DEPTH:
        return f"{where} is nested more than {MAX_OPTIONS_DEPTH} deep"
    items: Any = ()
    if isinstance(value, Mapping):
        bad = [key for key in value if not isinstance(key, str)]
        if bad:
            return f"{where} has a key that is not text, {bad[0]!r}"
        items = ((f"{where}.{key}", item) for key, item in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{where}[{i}]", item) for i, item in enumerate(value))
    elif isinstance(value, int) and not isinstance(value, bool):
        if not -2**63 <= value < 2**63:
            return f"{where} = {value} is beyond a 64-bit integer"
    elif isinstance(value, float):
        if not math.isfinite(value):
            return f"{where} = {value} is not a finite number"
    elif not isinstance(value, (bool, str)):  # a TOML date or time, a JSON null
        kind = "null" if value is None else type(value).__name__
        return f"{where} is a {kind}"
    for inner, item in items:
        problem = _option_problem(item, inner, depth + 1)
        if problem:
            return problem
    return ""
