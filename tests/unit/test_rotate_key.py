"""Rotating the swarm key from the command line: ``gossipd rotate-key`` and
``gossipd retire-key`` (daemon.rotation), ``swarm.previous_key_file`` in the config and at
start-up (daemon.keys.load_swarm), and what ``gossipd status`` says mid-rotation. In process,
as tests/unit/test_cli.py runs the CLI: files, output, and one-line errors with exit code 2.
"""

from __future__ import annotations

import io
import stat
import sys
from pathlib import Path

import pytest
import trio

from daemon import config as config_module
from daemon.cli import main
from daemon.control import serve_control
from daemon.keys import KeyFileError, load_swarm, read_swarm_key, write_swarm_key
from daemon.rotation import RotationError, rotation_status, set_swarm_key
from daemon.status import format_status
from gossip.handshake import Swarm
from tests.unit.test_cli import init, one_line_error, status_reply

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@pytest.fixture(autouse=True)
def _no_config_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(config_module.ENV, raising=False)


@pytest.fixture
def node(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """A node's directory, as ``gossipd init --swarm lab`` leaves it."""
    d = tmp_path / "a"
    init(capsys, d, "--swarm", "lab", listen="127.0.0.1:7071")
    return d


def second_node(tmp_path: Path, capsys: pytest.CaptureFixture[str], first: Path) -> Path:
    """Another node of the same swarm (its own identity, the first node's swarm key)."""
    d = tmp_path / "b"
    init(capsys, d, "--swarm", "lab", listen="127.0.0.1:7072")
    (d / "swarm.key").write_bytes((first / "swarm.key").read_bytes())
    return d


def swarm_of(d: Path) -> Swarm:
    config = config_module.load(d / "gossipd.toml")
    previous = config.swarm.previous_key_file
    return load_swarm(config.swarm.name, config.path(config.swarm.key_file),
                      config.path(previous) if previous else None, config.swarm.cipher)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# --- rotate-key ---------------------------------------------------------------------------


def test_rotate_key_keeps_the_old_key_as_previous(node: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    old = read_swarm_key(node / "swarm.key")
    assert main(["rotate-key", "-c", str(node / "gossipd.toml")]) == 0
    out = capsys.readouterr().out
    new = read_swarm_key(node / "swarm.key")
    assert new != old and read_swarm_key(node / "swarm.previous.key") == old
    assert mode(node / "swarm.key") == mode(node / "swarm.previous.key") == 0o600
    swarm = swarm_of(node)
    assert (swarm.key, swarm.previous) == (new, old)
    # what to do next, and the new join line, which carries the new key
    assert "restart this node now" in out and "gossipd retire-key" in out
    assert f"key={new.hex()}" in out and old.hex() not in out
    assert main(["check-config", "-c", str(node / "gossipd.toml")]) == 0


def test_the_config_keeps_its_comments_and_layout(node: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = node / "gossipd.toml"
    before = path.read_text().replace('name = "lab"', 'name = "lab"  # my comment')
    path.write_text(before)
    assert main(["rotate-key", "-c", str(path)]) == 0
    after = path.read_text()
    changed = [(a, b) for a, b in zip(before.splitlines(), after.splitlines()) if a != b]
    assert changed == [('previous_key_file = ""', 'previous_key_file = "swarm.previous.key"')]
    assert main(["retire-key", "-c", str(path)]) == 0
    assert path.read_text() == before


def test_other_nodes_rotate_to_the_same_key(tmp_path: Path, node: Path,
                                            capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    b, c = second_node(tmp_path, capsys, node), tmp_path / "c"
    init(capsys, c, "--swarm", "lab", listen="127.0.0.1:7073")
    (c / "swarm.key").write_bytes((node / "swarm.key").read_bytes())
    assert main(["rotate-key", "-c", str(node / "gossipd.toml")]) == 0
    capsys.readouterr()
    assert main(["join-line", "-c", str(node / "gossipd.toml")]) == 0
    line = capsys.readouterr().out
    monkeypatch.setattr("sys.stdin", io.StringIO(line))
    assert main(["rotate-key", "-c", str(b / "gossipd.toml"), "--join", "-"]) == 0
    assert main(["rotate-key", "-c", str(c / "gossipd.toml"), "--key-file",
                 str(node / "swarm.key")]) == 0
    assert swarm_of(node) == swarm_of(b) == swarm_of(c)


@pytest.mark.parametrize("problem", ["twice", "same key", "other swarm", "stray file"])
def test_rotate_key_errors_are_one_line_and_write_nothing(
        tmp_path: Path, node: Path, capsys: pytest.CaptureFixture[str], problem: str) -> None:
    cfg = str(node / "gossipd.toml")
    argv = ["rotate-key", "-c", cfg]
    if problem == "twice":
        assert main(argv) == 0
    elif problem == "same key":
        argv += ["--key-file", str(node / "swarm.key")]
    elif problem == "other swarm":
        other = tmp_path / "other"
        line = init(capsys, other, "--swarm", "elsewhere")
        argv += ["--join", line]
    else:
        write_swarm_key(node / "swarm.previous.key", bytes(32))
    capsys.readouterr()
    files = {p.name: p.read_bytes() for p in node.iterdir()}
    assert main(argv) == 2
    err = one_line_error(capsys, "rotate-key")
    assert {"twice": "already under way", "same key": "already holds that key",
            "other swarm": "'elsewhere'", "stray file": "holds another key"}[problem] in err
    assert {p.name: p.read_bytes() for p in node.iterdir()} == files


def test_an_interrupted_start_is_completed_by_running_it_again(
        node: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old, path = read_swarm_key(node / "swarm.key"), node / "gossipd.toml"
    # As a crash leaves it after the previous key file and the config were written, before
    # the new key: both files hold the old key, which the node refuses to start with.
    write_swarm_key(node / "swarm.previous.key", old)
    path.write_text(set_swarm_key(path, "swarm.previous.key"))
    assert main(["check-config", "-c", str(path)]) == 2
    assert "hold the same key" in one_line_error(capsys, "check-config")
    assert main(["rotate-key", "-c", str(path)]) == 0
    assert "interrupted" in capsys.readouterr().out
    swarm = swarm_of(node)
    assert swarm.previous == old and swarm.key != old


def test_a_crash_after_the_previous_file_alone_is_completed_too(
        node: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = read_swarm_key(node / "swarm.key")
    write_swarm_key(node / "swarm.previous.key", old)  # the config does not name it yet
    assert main(["check-config", "-c", str(node / "gossipd.toml")]) == 0
    assert main(["rotate-key", "-c", str(node / "gossipd.toml")]) == 0
    assert swarm_of(node).previous == old


# --- retire-key ---------------------------------------------------------------------------


def test_retire_key_drops_the_previous_key(node: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    cfg = str(node / "gossipd.toml")
    assert main(["rotate-key", "-c", cfg]) == 0
    new = read_swarm_key(node / "swarm.key")
    assert main(["retire-key", "-c", cfg]) == 0
    assert "restart this node now" in capsys.readouterr().out
    assert not (node / "swarm.previous.key").exists()
    swarm = swarm_of(node)
    assert (swarm.key, swarm.previous) == (new, None)
    # Again: nothing to do, and that is no error (a script may run it on every node).
    assert main(["retire-key", "-c", cfg]) == 0
    assert "nothing to finish" in capsys.readouterr().out


async def test_retire_key_asks_the_running_daemon_first(
        node: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = str(node / "gossipd.toml")
    assert main(["rotate-key", "-c", cfg]) == 0
    config = config_module.load(node / "gossipd.toml")
    rotation = {"new_key": ["10.0.0.3:7070"], "old_key": ["10.0.0.9:7070"], "unknown": [],
                "datagrams_previous": 5, "handshakes_previous": 1, "fallbacks": 1}
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, config.path(config.node.control),
                            {"status": lambda: status_reply(rotation=rotation)})
        assert await trio.to_thread.run_sync(main, ["retire-key", "-c", cfg]) == 2
        assert "10.0.0.9:7070 on the old key only" in one_line_error(capsys, "retire-key")
        assert (node / "swarm.previous.key").exists()
        assert await trio.to_thread.run_sync(main, ["retire-key", "-c", cfg, "--force"]) == 0
        nursery.cancel_scope.cancel()
    assert swarm_of(node).previous is None


# --- the config and start-up ----------------------------------------------------------------


def test_previous_key_file_is_validated(node: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = str(node / "gossipd.toml")
    assert main(["check-config", "-c", cfg, "--set", "swarm.previous_key_file=swarm.key"]) == 2
    assert "swarm.previous_key_file" in one_line_error(capsys, "check-config")
    assert main(["check-config", "-c", cfg, "--set", "swarm.previous_key_file=gone.key"]) == 2
    assert "gone.key does not exist" in one_line_error(capsys, "check-config")
    (node / "bad.key").write_text("not hex\n")
    assert main(["check-config", "-c", cfg, "--set", "swarm.previous_key_file=bad.key"]) == 2
    assert "64 hex characters" in one_line_error(capsys, "check-config")
    assert main(["check-config", "-c", cfg, "--set", "swarm.previous_key_file=3"]) == 2
    assert "expected a string" in one_line_error(capsys, "check-config")


def test_load_swarm_refuses_the_same_key_twice(tmp_path: Path) -> None:
    write_swarm_key(tmp_path / "a.key", bytes(32))
    write_swarm_key(tmp_path / "b.key", bytes(32))
    with pytest.raises(KeyFileError, match="hold the same key"):
        load_swarm("s", tmp_path / "a.key", tmp_path / "b.key")
    assert load_swarm("s", tmp_path / "a.key").previous is None


# --- editing the config as text -----------------------------------------------------------


def test_the_key_is_added_under_the_swarm_header_when_missing(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[node]\nlisten = "127.0.0.1:1"\n[swarm]  # ours\nname = "s"\n[task]\n'
                    'entry = "m:f"\n')
    data = tomllib.loads(set_swarm_key(path, "p.key"))
    assert data["swarm"] == {"name": "s", "previous_key_file": "p.key"}
    path.write_text('[swarm]')  # a header on the last line, without a newline
    assert tomllib.loads(set_swarm_key(path, ""))["swarm"] == {"previous_key_file": ""}


@pytest.mark.parametrize("text", [
    'swarm.name = "s"\n',  # dotted keys: no [swarm] header to put the key under
    'swarm = {name = "s"}\n',
    '[swarm]\nname = "s"\nprevious_key_file = """\nx"""\n',  # a multi-line value
])
def test_a_config_that_cannot_be_edited_safely_is_left_alone(tmp_path: Path, text: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(RotationError, match="by hand"):
        set_swarm_key(path, "p.key")
    assert path.read_text() == text


# --- status -------------------------------------------------------------------------------


def test_status_mid_rotation() -> None:
    swarm = Swarm("s", bytes(range(32)), previous=bytes(32))
    swarm.peer_keys.heard("10.0.0.3:7070", previous=False)
    swarm.peer_keys.heard("10.0.0.9:7070", previous=True)
    status = rotation_status(swarm, ["10.0.0.3:7070", "10.0.0.9:7070", "10.0.0.5:7070"])
    assert status is not None
    assert (status["new_key"], status["old_key"], status["unknown"]) == (
        ["10.0.0.3:7070"], ["10.0.0.9:7070"], ["10.0.0.5:7070"])
    assert status["datagrams_previous"] == 1
    assert rotation_status(Swarm("s", bytes(32)), ["10.0.0.3:7070"]) is None
    line = next(x for x in format_status(status_reply(rotation=status)).splitlines()
                if x.startswith("rotation"))
    assert line == ("rotation  mid-rotation, holding the previous swarm key too: 1 of 3 peers "
                    "seen on the new key; on the old key only: 10.0.0.9:7070; not heard from "
                    "yet: 10.0.0.5:7070; once every node holds the new key: gossipd retire-key")
    assert not any(x.startswith("rotation") for x in format_status(status_reply()).splitlines())


# --- Kubernetes: the edits docs/OPERATIONS.md asks for --------------------------------------


def test_the_kubernetes_rotation_edits_name_a_file_of_the_secret() -> None:
    from tests.unit.test_deploy import KUBERNETES, container, manifests

    text = manifests()["ConfigMap"]["data"]["gossipd.toml"]
    assert tomllib.loads(text)["swarm"].get("previous_key_file", "") == ""  # not rotating
    commented = '# previous_key_file = "/etc/gossipd-secret/previous.key"'
    assert commented in text
    rotating = tomllib.loads(text.replace(commented, commented[2:]))
    mounts = {m["name"]: m["mountPath"] for m in container(manifests())["volumeMounts"]}
    assert rotating["swarm"]["previous_key_file"] == mounts["swarm-key"] + "/previous.key"
    kustomization = (KUBERNETES / "kustomization.yaml").read_text()
    assert "      - swarm.key\n      # - previous.key\n" in kustomization
    assert "previous.key" in (KUBERNETES / ".gitignore").read_text().split()
