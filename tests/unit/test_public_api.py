"""The daemon and the examples use the library through its public API only.

``gossip/__init__.py`` and the public modules below are the whole public API (docs/STYLE.md,
rule 2): if the program that ships with the library needs a name that is not there, users
writing their own driver need it too, so it is exported, not reached around. Checked by
reading the imports and the ``gossip.<name>`` attribute uses of every module of ``daemon/`` and
``examples/``.

``gossip`` itself holds what a training program needs, at most :data:`MOST` names. Four modules
are public as modules, each by its own ``__all__``: ``gossip.lowlevel``, the building blocks
under ``open_swarm`` (what ``gossipd`` and programs like it use); ``gossip.testing``, the
fault toolkit; ``gossip.config``, whose ``setting()`` and checks let a program declare settings
of its own the way the library declares its (the daemon's config file is built that way); and
``gossip.devices``, the one resolver of device names, for the daemon and a user's script alike.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gossip
import gossip.config
import gossip.devices
import gossip.lowlevel
import gossip.testing

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = sorted([*(ROOT / "daemon").glob("*.py"), *(ROOT / "examples").glob("*.py")])
PUBLIC_MODULES = {"gossip": gossip.__all__, "gossip.testing": gossip.testing.__all__,
                  "gossip.config": gossip.config.__all__, "gossip.devices": gossip.devices.__all__,
                  "gossip.lowlevel": gossip.lowlevel.__all__}
MOST = 40  # names in gossip.__all__


def _reaches(path: Path) -> list[str]:
    """Where ``path`` uses gossip other than through its public names."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "gossip":
            if node.module not in PUBLIC_MODULES:
                found.append(f"line {node.lineno}: from {node.module} import ...")
            else:
                found += [f"line {node.lineno}: {node.module}.{a.name} is not public"
                          for a in node.names if a.name not in PUBLIC_MODULES[node.module]]
        elif isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names
                      if a.name.startswith("gossip.") and a.name not in PUBLIC_MODULES]
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id == "gossip" and node.attr not in gossip.__all__
              and f"gossip.{node.attr}" not in PUBLIC_MODULES and node.attr != "__version__"):
            found.append(f"line {node.lineno}: gossip.{node.attr} is not public")
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
              and isinstance(node.value.value, ast.Name) and node.value.value.id == "gossip"
              and f"gossip.{node.value.attr}" in PUBLIC_MODULES
              and node.attr not in PUBLIC_MODULES[f"gossip.{node.value.attr}"]):
            found.append(f"line {node.lineno}: gossip.{node.value.attr}.{node.attr} is not public")
    return found


@pytest.mark.parametrize("path", CLIENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_uses_only_the_public_api(path: Path) -> None:
    assert _reaches(path) == []


def test_the_check_sees_a_reach_around(tmp_path: Path) -> None:
    client = tmp_path / "client.py"
    client.write_text("import gossip\nimport gossip.replica\nfrom gossip.groups import one_error\n"
                      "from gossip import Swarm, leaves\nx = gossip.nodegroup.NodeGroup\n"
                      "y = gossip.lowlevel.Roster\nz = gossip.lowlevel.Membership\n")
    assert sorted(_reaches(client)) == [
        "line 2: import gossip.replica", "line 3: from gossip.groups import ...",
        "line 4: gossip.leaves is not public", "line 5: gossip.nodegroup is not public",
        "line 7: gossip.lowlevel.Membership is not public"]


def test_the_top_level_api_stays_small() -> None:
    assert len(gossip.__all__) <= MOST, sorted(gossip.__all__)
    # Each name is in one public place only, and the moved ones still load from gossip.
    assert not set(gossip.__all__) & set(gossip.lowlevel.__all__)
    with pytest.warns(DeprecationWarning, match=r"gossip\.TcpNetwork has moved to gossip\.lowlevel"):
        assert gossip.TcpNetwork is gossip.lowlevel.TcpNetwork  # type: ignore[attr-defined]
