"""Swarm key files and the join line a volunteer pastes into ``gossipd init --join``.

A swarm key file holds the 32-byte key as 64 hexadecimal characters and a newline, mode
0600. The join line carries everything a new node needs to take part::

    gossip://NAME@HOST:PORT,HOST:PORT?key=64HEX&task=MODULE:FUNCTION&seed=0

It holds the swarm key, so it is a secret: share it as you would a password (anyone holding
it can join the swarm and read its weights).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote

from gossip.address import parse_address

__all__ = ["KeyFileError", "JoinLine", "read_swarm_key", "write_swarm_key", "write_new"]

SCHEME = "gossip://"
MAX_KEY_FILE = 256  # bytes read from a key file at most


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

    def __str__(self) -> str:
        peers = ",".join(self.bootstrap)
        return (f"{SCHEME}{quote(self.name, safe='')}@{peers}?key={self.key.hex()}"
                f"&task={quote(self.task, safe=':/.')}&seed={self.seed}")

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
            name = unquote(name)
            if not name:
                raise ValueError("no swarm name")
        except (KeyError, IndexError):
            raise KeyFileError("the join line lacks key= or task=") from None
        except ValueError as exc:
            raise KeyFileError(f"bad join line: {exc}") from None
        return cls(name, key, bootstrap, task, seed)
