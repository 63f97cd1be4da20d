"""What the light commands import, and gossip's lazy public API.

``gossipd status`` is what an operator types and what a readiness probe runs every few
seconds; it, ``init`` and ``keygen`` must not import torch (seconds) or trio (a tenth of a
second and more): each runs here in a fresh interpreter, the only honest ``sys.modules``,
and reports what it loaded. No timing is asserted: a loaded machine would make that flaky,
and the imports are what decide it.

``gossip/__init__.py`` and ``gossip/lowlevel.py`` load each public name on first use, from
their ``_API`` tables; their ``TYPE_CHECKING`` blocks say the same for type checkers, and must
not drift from the tables.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import gossip
import gossip.lowlevel
from daemon.cli import main
from tests.unit.test_cli import status_reply

HEAVY = ("torch", "numpy", "trio")

# Runs one command, with a stand-in daemon on the control socket when asked (a thread of
# plain sockets: a real daemon, or trio, would load what is being checked for), then prints
# the exit code and the heavy modules loaded as the last line.
SCRIPT = """
import json, socket, sys, threading
argv, reply = json.loads(sys.argv[1]), sys.argv[2]
if reply:
    from daemon.config import load
    config = load(argv[argv.index("-c") + 1], complete=False)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(config.path(config.node.control)))
    server.listen(1)

    def answer():
        conn, _ = server.accept()
        conn.recv(4096)
        conn.sendall(reply.encode() + b"\\n")
        conn.close()

    threading.Thread(target=answer, daemon=True).start()
from daemon.cli import main
code = main(argv)
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(%r))
print(json.dumps({"code": code, "heavy": heavy}))
""" % (HEAVY,)


def run(argv: list[str], reply: dict[str, Any] | None = None) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(argv), json.dumps(reply) if reply else ""],
        capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[2])
    assert out.stdout, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


@pytest.fixture
def config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["init", "--swarm", "s", "--dir", str(tmp_path), "--listen",
                 "127.0.0.1:7070"]) == 0
    capsys.readouterr()
    return str(tmp_path / "gossipd.toml")


@pytest.mark.parametrize("argv, code", [
    (["status"], 0),
    (["status", "--json"], 0),
    (["status", "--ready"], 0),
], ids=["status", "json", "ready"])
def test_status_imports_neither_torch_nor_trio(config: str, argv: list[str], code: int) -> None:
    assert run([*argv, "-c", config], status_reply(joined=True)) == {"code": code, "heavy": []}


def test_status_with_no_daemon_imports_neither(config: str) -> None:
    assert run(["status", "-c", config]) == {"code": 3, "heavy": []}


@pytest.mark.parametrize("kind", ["init", "identity", "swarm-key"])
def test_init_and_keygen_import_neither(tmp_path: Path, kind: str) -> None:
    argv = {"init": ["init", "--swarm", "s", "--dir", str(tmp_path / "n"), "--advertise", "192.0.2.1:7070"],
            "identity": ["keygen", "--identity", str(tmp_path / "id.key")],
            "swarm-key": ["keygen", "--swarm-key", str(tmp_path / "swarm.key")]}[kind]
    assert run(argv) == {"code": 0, "heavy": []}


# --- gossip's public API -------------------------------------------------------------------


@pytest.mark.parametrize("namespace", [gossip, gossip.lowlevel], ids=["gossip", "lowlevel"])
def test_the_type_checking_block_names_the_api_table(namespace) -> None:
    tree = ast.parse(Path(namespace.__file__).read_text())
    (block,) = [node for node in tree.body if isinstance(node, ast.If)
                and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"]
    declared = {(node.module, alias.name) for node in block.body
                if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert declared == {(module, name) for module, names in namespace._API.items()
                        for name in names}


@pytest.mark.parametrize("namespace", [gossip, gossip.lowlevel], ids=["gossip", "lowlevel"])
def test_every_public_name_loads_from_its_module(namespace) -> None:
    for module, names in namespace._API.items():
        for name in names:
            value = getattr(namespace, name)
            assert value is getattr(sys.modules[f"gossip.{module}"], name), name
    assert set(namespace.__all__) <= set(dir(namespace))
    with pytest.raises(AttributeError, match="no_such_name"):
        namespace.no_such_name  # noqa: B018
    from gossip import Identity, open_swarm  # noqa: F401  (the from-import form works too)
    from gossip.lowlevel import Replica, connect  # noqa: F401
