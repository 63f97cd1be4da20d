"""Node identity: an Ed25519 key pair and the peer id derived from it.

A node is known to the swarm by its peer id: the first 16 bytes of SHA-256 over the raw
32-byte Ed25519 public key, written as 26 lowercase base32 characters without padding
(``peer_id_from_public_key``). It is stable for as long as the key file is kept, short enough
to print in every log line, and cannot be chosen without the private key. The secure channel
binds each connection to this key (see :mod:`gossip.handshake`).

Key files hold the private key in PKCS#8 PEM, unencrypted, created with mode 0600. A key file
that other users can read is refused: a leaked node key lets anyone impersonate the node.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from .errors import IdentityError

__all__ = [
    "Identity",
    "PeerId",
    "peer_id_from_public_key",
    "verify_signature",
    "PEER_ID_BYTES",
]

# Bytes of SHA-256 kept for a peer id: 128 bits is far beyond any swarm's birthday bound.
PEER_ID_BYTES = 16
# The largest key file we read (a PKCS#8 Ed25519 PEM is 119 bytes).
MAX_KEY_FILE = 4096


class PeerId(str):
    """A peer id: 26 lowercase base32 characters. ``short`` gives the first 8, for logs."""

    __slots__ = ()

    @property
    def short(self) -> str:
        return self[:8]


def peer_id_from_public_key(public_key: bytes) -> PeerId:
    """The peer id of a raw 32-byte Ed25519 public key."""
    if len(public_key) != 32:
        raise ValueError("an Ed25519 public key is 32 bytes")
    digest = hashlib.sha256(public_key).digest()[:PEER_ID_BYTES]
    return PeerId(base64.b32encode(digest).decode("ascii").rstrip("=").lower())


def verify_signature(public_key: bytes, signature: bytes, message: bytes) -> bool:
    """True if ``signature`` is a valid Ed25519 signature of ``message`` by ``public_key``."""
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


@dataclass(frozen=True, eq=False)
class Identity:
    """A node's Ed25519 key pair."""

    private_key: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> "Identity":
        return cls(Ed25519PrivateKey.generate())

    @functools.cached_property
    def public_key(self) -> bytes:
        """The raw 32-byte public key."""
        return self.private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @functools.cached_property
    def peer_id(self) -> PeerId:
        return peer_id_from_public_key(self.public_key)

    def sign(self, message: bytes) -> bytes:
        return self.private_key.sign(message)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the key to a new file with mode 0600, atomically; never overwrites.

        Raises:
            IdentityError: the file exists already, or cannot be written.
        """
        path = Path(path)
        pem = self.private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            # O_EXCL + mode 0600 at creation: the key is never readable by others, not even
            # for an instant, whatever the umask.
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, pem)
                os.fsync(fd)
            finally:
                os.close(fd)
            # link() fails if the target exists, so a key is never silently replaced.
            os.link(tmp, path)
        except FileExistsError:
            raise IdentityError(f"{path}: a key file exists already; refusing to overwrite it") from None
        except OSError as exc:
            raise IdentityError(f"{path}: cannot write key file: {exc.strerror}") from None
        finally:
            try:
                os.unlink(tmp)
            except OSError:  # never created (or its directory is missing): nothing to clean
                pass

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "Identity":
        """Read a key file written by :meth:`save` (or any unencrypted PKCS#8 Ed25519 PEM).

        Raises:
            IdentityError: missing, unreadable, too large, not an Ed25519 key, or readable by
                group or others (fix with ``chmod 600 PATH``).
        """
        path = Path(path)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise IdentityError(f"{path}: cannot open key file: {exc.strerror}") from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise IdentityError(
                    f"{path}: key file is accessible by other users "
                    f"(mode {stat.S_IMODE(st.st_mode):04o}); run: chmod 600 {path}"
                )
            data = f.read(MAX_KEY_FILE + 1)
        if len(data) > MAX_KEY_FILE:
            raise IdentityError(f"{path}: too large for a key file")
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as exc:
            raise IdentityError(f"{path}: not a readable private key ({exc})") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise IdentityError(f"{path}: not an Ed25519 key")
        return cls(key)

    @classmethod
    def load_or_generate(cls, path: str | os.PathLike[str]) -> "Identity":
        """Load the key at ``path``, creating it first if there is none."""
        if not Path(path).exists():
            identity = cls.generate()
            try:
                identity.save(path)
                return identity
            except IdentityError:
                if not Path(path).exists():
                    raise
                # Lost a race with another process creating it: use theirs.
        return cls.load(path)

    def __repr__(self) -> str:
        return f"Identity(peer_id={self.peer_id!r})"
