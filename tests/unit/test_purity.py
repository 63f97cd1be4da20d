"""The sans-IO core is pure: checked, not just promised (docs/STYLE.md, rule 5).

A pure module takes ``now`` and bytes or messages and returns bytes, messages or effects; it
never waits, never touches a socket and never reads the clock, so it is tested without trio
and reasoned about as a state machine. Here that means: it imports no trio, socket or other
module that waits or does I/O, and the gossip modules it imports are pure too, so nothing
impure comes in through them.

The imports are read from the source (``ast``), not from ``sys.modules``: importing a module
to look at it would load everything it reaches, and an import inside a function counts as
much as one at the top. (``gossip/__init__.py``, which every ``import gossip.<module>`` runs
first, imports nothing at load time but ``gossip.lazy``, a few lines of the standard library:
``test_imports.py`` checks it.)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

GOSSIP = Path(__file__).resolve().parents[2] / "gossip"

# The pure modules. The first line is the sans-IO core the architecture rests on (the protocol
# state machines and the codec); the rest are what they import, and pure helpers beside them
# (limits, rates, standing, mixing's arithmetic, the settings tree). A gossip module that a
# pure one imports must be listed here as well: purity is only as good as the weakest import.
PURE = frozenset({
    "membership", "handshake", "wire", "mixing", "suspicion", "broadcast", "pushpull",
    "claims", "ourselves", "fields",
    "member", "probing", "effects", "seal", "limits", "linkrate", "config",
    "messages", "errors", "identity", "address", "rotation", "standing", "tensors", "int8",
    "schema", "codec", "mismatch", "correction", "spacing", "exchange_state", "lowbit",
    "plan",
})

# What a pure module may import from outside gossip: the standard library's computation, the
# codec (cbor2), the primitives of the handshake and the seal (cryptography), and torch for
# tensor arithmetic (synchronous, in the caller's thread: mixing's checks, the codecs).
ALLOWED = frozenset({
    "__future__", "base64", "bisect", "collections", "dataclasses", "enum", "functools",
    "hashlib", "hmac", "itertools", "math", "random", "re", "reprlib", "secrets", "struct",
    "typing",
    "cbor2", "cryptography", "torch",
})

# One module's own exceptions, each for a reason that keeps it off the protocol's path.
ALSO_ALLOWED = {
    "identity": {"os", "stat", "pathlib"},  # the node's key file: Identity.load and save
    "seal": {"os"},  # os.urandom, for each datagram's nonce
    "config": {"datetime"},  # the date and time types a free-form table holds; never the clock
    "codec": {"sys"},  # sys.byteorder: the codecs assume a little-endian host
}

# Never, in a pure module, whatever the lists above say: what waits, talks to the network,
# or reads the clock (time comes in as ``now``).
FORBIDDEN = frozenset({
    "trio", "socket", "asyncio", "selectors", "ssl", "threading", "multiprocessing",
    "concurrent", "subprocess", "time",
})


def imports(source: str, package: str = "gossip") -> set[str]:
    """Every module that ``source`` (a module of ``package``) imports, anywhere in it, as
    absolute dotted names; ``from . import x`` of a sibling module is that module."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: within the package (no pure module is in a subpackage)
                base = ".".join([package, *filter(None, [node.module])])
            else:
                base = node.module or ""
            if base == package:  # `from . import x`: x is a module, or a name of the package
                for alias in node.names:
                    is_module = (GOSSIP / f"{alias.name}.py").exists()
                    found.add(f"{package}.{alias.name}" if is_module else package)
            else:
                found.add(base)
    return found


def problems(name: str) -> list[str]:
    """What makes gossip module ``name`` impure, each with the chain of imports that brings
    it in (``membership -> probing -> trio``); empty if it is pure."""
    out: list[str] = []
    seen = {name}
    queue = [(name, [name])]
    while queue:
        module, chain = queue.pop(0)
        for imported in sorted(imports((GOSSIP / f"{module}.py").read_text())):
            top, _, rest = imported.partition(".")
            path = " -> ".join([*chain, imported])
            if top == "gossip":
                if rest not in PURE:
                    out.append(f"{path}: not a pure gossip module")
                elif rest not in seen:
                    seen.add(rest)
                    queue.append((rest, [*chain, rest]))
            elif top in FORBIDDEN:
                out.append(f"{path}: waits or does I/O")
            elif top not in ALLOWED | ALSO_ALLOWED.get(module, set()):
                out.append(f"{path}: not on the allow-list")
    return out


def test_every_pure_module_exists() -> None:
    missing = sorted(name for name in PURE if not (GOSSIP / f"{name}.py").exists())
    assert not missing, f"listed as pure but not in gossip/: {missing} (renamed? update PURE)"


def test_no_exception_lets_in_what_is_forbidden() -> None:
    assert not ALLOWED & FORBIDDEN
    assert not set().union(*ALSO_ALLOWED.values()) & FORBIDDEN
    assert set(ALSO_ALLOWED) <= PURE


@pytest.mark.parametrize("name", sorted(PURE))
def test_a_pure_module_imports_nothing_that_waits_or_does_io(name: str) -> None:
    assert problems(name) == []


# ---- the check itself ----------------------------------------------------------------------


def test_the_check_finds_trio_in_the_modules_that_do_io() -> None:
    # Not vacuous: the I/O glue does import trio, and is refused, directly or through a module.
    assert "channel -> trio: waits or does I/O" in problems("channel")
    assert "exchange -> gossip.channel: not a pure gossip module" in problems("exchange")


def test_imports_are_found_wherever_they_are_written() -> None:
    source = (
        "import os.path, socket\n"
        "from . import wire, not_a_module\n"
        "from .messages import Ping\n"
        "from gossip.errors import WireError\n"
        "def lazy():\n"
        "    import trio\n"
        "    from concurrent.futures import Future\n"
        "if False:\n"
        "    from .channel import connect\n"
    )
    assert imports(source) == {
        "os.path", "socket", "gossip.wire", "gossip", "gossip.messages", "gossip.errors",
        "trio", "concurrent.futures", "gossip.channel",
    }
