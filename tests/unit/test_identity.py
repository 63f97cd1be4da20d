import os
import stat

import pytest

from gossip.errors import IdentityError
from gossip.identity import Identity, peer_id_from_public_key, verify_signature


def test_peer_id_is_short_stable_and_printable():
    ident = Identity.generate()
    pid = ident.peer_id
    assert len(pid) == 26 and pid.isalnum() and pid == pid.lower()
    assert pid == peer_id_from_public_key(ident.public_key)
    assert pid.short == pid[:8]
    assert Identity.generate().peer_id != pid


def test_peer_id_of_a_fixed_key():
    # Pinned so that the derivation (docs/PROTOCOL.md) never changes by accident.
    assert peer_id_from_public_key(bytes(32)) == "mzuhvlpymk6xo3epygfy5h4oea"


def test_save_creates_0600_and_load_round_trips(tmp_path):
    path = tmp_path / "node.key"
    ident = Identity.generate()
    old = os.umask(0)  # even with a permissive umask the file is private
    try:
        ident.save(path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert Identity.load(path).peer_id == ident.peer_id
    assert list(tmp_path.iterdir()) == [path]  # no temp file left behind


def test_save_never_overwrites(tmp_path):
    path = tmp_path / "node.key"
    first = Identity.generate()
    first.save(path)
    with pytest.raises(IdentityError, match="exists already"):
        Identity.generate().save(path)
    assert Identity.load(path).peer_id == first.peer_id


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644])
def test_load_refuses_a_key_others_can_read(tmp_path, mode):
    path = tmp_path / "node.key"
    Identity.generate().save(path)
    path.chmod(mode)
    with pytest.raises(IdentityError, match="chmod 600"):
        Identity.load(path)


@pytest.mark.parametrize(
    "content, match",
    [(b"not a key", "not a readable private key"), (b"x" * 5000, "too large")],
)
def test_load_refuses_garbage(tmp_path, content, match):
    path = tmp_path / "node.key"
    path.write_bytes(content)
    path.chmod(0o600)
    with pytest.raises(IdentityError, match=match):
        Identity.load(path)


def test_load_missing_file(tmp_path):
    with pytest.raises(IdentityError, match="cannot open key file"):
        Identity.load(tmp_path / "nope.key")


def test_load_or_generate(tmp_path):
    path = tmp_path / "node.key"
    a = Identity.load_or_generate(path)
    assert Identity.load_or_generate(path).peer_id == a.peer_id


def test_signatures():
    ident = Identity.generate()
    sig = ident.sign(b"msg")
    assert verify_signature(ident.public_key, sig, b"msg")
    assert not verify_signature(ident.public_key, sig, b"other")
    assert not verify_signature(Identity.generate().public_key, sig, b"msg")
    assert not verify_signature(bytes(32), sig, b"msg")
