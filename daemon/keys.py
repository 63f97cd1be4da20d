"""Swarm key files and the join line a volunteer pastes into ``gossipd init --join``.

A swarm key file holds the 32-byte key as 64 hexadecimal characters and a newline, mode
0600. The join line carries everything a new node needs to take part::

    gossip://NAME@HOST:PORT,HOST:PORT?key=64HEX&task=MODULE:FUNCTION&seed=0&shards=8

``shards`` (how many shards the swarm cuts its data into) is left out when it is 1, and
``cipher`` (the channel cipher, ``swarm.cipher``) when it is the default, ``aesgcm``.
``options`` carries the task's options (the config's ``[task.options]``), left out when there
are none: their canonical JSON (sorted keys, no spaces, ASCII) in URL-safe base64 without
padding, at most :data:`MAX_OPTIONS` bytes of JSON. Only what both JSON and TOML hold travels:
tables, arrays, text, booleans, finite numbers and 64-bit integers, nested at most
:data:`MAX_OPTIONS_DEPTH` deep. A line is refused whole if its options are malformed.

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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote

from gossip.address import parse_address
from gossip.handshake import CIPHERS, DEFAULT_CIPHER
from gossip.messages import MAX_SHARDS

__all__ = ["KeyFileError", "JoinLine", "read_swarm_key", "write_swarm_key", "write_new",
           "encode_options", "decode_options"]

SCHEME = "gossip://"
MAX_KEY_FILE = 256  # bytes read from a key file at most
MAX_OPTIONS = 4096  # bytes of the task options' JSON in a join line (a line is pasted in a shell)
MAX_OPTIONS_DEPTH = 8  # tables and arrays inside one another, the options table included
_BASE64URL = re.compile(r"[A-Za-z0-9_-]*")


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
    """Create ``path`` with mode 0600 holding ``data``; never overwrite.

    Raises:
        KeyFileError: the file exists, or cannot be written.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise KeyFileError(f"{path} exists; not overwriting it") from None
    except OSError as exc:
        raise KeyFileError(f"cannot create {path}: {exc.strerror}") from None
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_swarm_key(path: Path, key: bytes) -> None:
    """Write a new swarm key file (0600); refuses to overwrite one."""
    if len(key) != 32:
        raise ValueError("a swarm key is 32 bytes")
    write_new(path, key.hex().encode() + b"\n")


@dataclass(frozen=True)
class JoinLine:
    """What a volunteer needs to join a swarm."""

    name: str
    key: bytes
    bootstrap: tuple[str, ...]
    task: str
    seed: int = 0
    shards: int = 1  # task.shards: every node cuts the data the same way
    options: Mapping[str, Any] = field(default_factory=dict)  # [task.options]
    cipher: str = DEFAULT_CIPHER  # swarm.cipher: never negotiated, so the line must carry it

    def __post_init__(self) -> None:
        encode_options(self.options)  # a KeyFileError now, not when the line is printed
        if self.cipher not in CIPHERS:
            raise KeyFileError(f"the cipher must be one of {', '.join(CIPHERS)}, not "
                               f"{self.cipher!r}")

    def __str__(self) -> str:
        peers = ",".join(self.bootstrap)
        return (f"{SCHEME}{quote(self.name, safe='')}@{peers}?key={self.key.hex()}"
                f"&task={quote(self.task, safe=':/.')}&seed={self.seed}"
                + (f"&shards={self.shards}" if self.shards != 1 else "")
                + (f"&cipher={self.cipher}" if self.cipher != DEFAULT_CIPHER else "")
                + (f"&options={encode_options(self.options)}" if self.options else ""))

    def __repr__(self) -> str:  # never print the key
        return f"JoinLine(name={self.name!r}, bootstrap={self.bootstrap!r}, task={self.task!r})"

    @classmethod
    def parse(cls, text: str) -> "JoinLine":
        """Read a join line.

        Raises:
            KeyFileError: it is not a well-formed join line.
        """
        text = text.strip()
        if not text.startswith(SCHEME) or "@" not in text or "?" not in text:
            raise KeyFileError(f"a join line looks like {SCHEME}NAME@HOST:PORT?key=...&task=...")
        rest = text[len(SCHEME):]
        head, _, query = rest.partition("?")
        name, _, peers = head.rpartition("@")
        fields = parse_qs(query, strict_parsing=False)
        try:
            bootstrap = tuple(p for p in peers.split(",") if p)
            for address in bootstrap:
                parse_address(address)
            if not bootstrap:
                raise ValueError("no bootstrap address")
            key = bytes.fromhex(fields["key"][0])
            if len(key) != 32:
                raise ValueError("the key must be 64 hex characters")
            task = fields["task"][0]  # parse_qs has decoded it
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
            cipher = fields.get("cipher", [DEFAULT_CIPHER])[0]
            if cipher not in CIPHERS:
                raise ValueError(f"the cipher must be one of {', '.join(CIPHERS)}, not "
                                 f"{cipher!r}")
            name = unquote(name)
            if not name:
                raise ValueError("no swarm name")
        except (KeyError, IndexError):
            raise KeyFileError("the join line lacks key= or task=") from None
        except ValueError as exc:
            raise KeyFileError(f"bad join line: {exc}") from None
        return cls(name, key, bootstrap, task, seed, shards, options, cipher)


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
        data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        options = json.loads(data.decode("utf-8"), object_pairs_hook=_unique,
                             parse_constant=_no_constant)
    except (binascii.Error, ValueError, RecursionError) as exc:
        raise KeyFileError(f"bad join line: options= does not decode: {exc}") from None
    if type(options) is not dict:
        raise KeyFileError("bad join line: options= is not a table")
    problem = _option_problem(options, "options", 1)
    if problem:
        raise KeyFileError(f"bad join line: {problem}")
    return options


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
