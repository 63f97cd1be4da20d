"""Shared test helpers: a tapping stream, a handshaken channel pair, a signal to wait on,
local node settings, and identities from seeds."""

import functools
import hashlib
import sys

import trio
import trio.testing

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup
else:
    from builtins import BaseExceptionGroup  # noqa: F401 - re-exported for the tests

from gossip.endpoints import handshake
from gossip.handshake import Swarm
from gossip.identity import Identity

SWARM = Swarm.generate("test")
ALICE, BOB = Identity.generate(), Identity.generate()


@functools.lru_cache(maxsize=None)
def seeded_identity(n: int) -> Identity:
    """The ``n``-th of a fixed series of node identities: the same keys in every run, for
    tests that play many members and sign what each says of itself."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    seed = hashlib.sha256(b"gossipd test identity %d" % n).digest()
    return Identity(Ed25519PrivateKey.from_private_bytes(seed))


def local(**changes):
    """``gossip.NodeConfig.local()`` with ``changes`` (whole fields: ``averaging=...``): the
    settings of nodes on a simulated network or on one machine."""
    import dataclasses

    from gossip.config import NodeConfig  # imports torch: only for the tests that ask

    return dataclasses.replace(NodeConfig.local(), **changes)


class Signal:
    """Something to wait on for conditions that callbacks change: pass :meth:`fire` as the
    callback (``on_change``, ``on_exchange``) and :meth:`wait_until` re-checks the condition
    after every call. No polling, and no wakeup lost: the condition is checked and the wait
    begun with no checkpoint in between."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def fire(self, *_: object) -> None:
        self._event.set()
        self._event = trio.Event()

    async def wait_until(self, condition) -> None:
        while not condition():
            await self._event.wait()


class Tap(trio.abc.Stream):
    """Forwards to ``inner``; while ``captured`` is a list, sends are captured instead."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner = inner
        self.captured: list[bytes] | None = None

    async def send_all(self, data) -> None:
        if self.captured is not None:
            self.captured.append(bytes(data))
            await trio.lowlevel.checkpoint()
        else:
            await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes=None) -> bytes:
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()


def mutate(data: bytes, flips: list[tuple[int, int]], cut: int) -> bytes:
    """``data`` with the byte at each position (modulo its length) set to a value, then
    ``cut`` bytes dropped from its end: the fuzzers' way to spoil a valid encoding."""
    buf = bytearray(data)
    for pos, value in flips:
        buf[pos % len(buf)] = value
    return bytes(buf[: len(buf) - cut])


async def pair(*, swarm_a=SWARM, swarm_b=SWARM, allow_a=None, allow_b=None, record_timeout=10.0,
               make=trio.testing.memory_stream_pair):
    """Handshake over a stream pair; returns (alice, bob, alice's tap)."""
    s1, s2 = make()
    tap = Tap(s1)
    result = {}

    async def run(name, stream, ident, swarm, initiator, allow):
        result[name] = await handshake(stream, identity=ident, swarm=swarm, initiator=initiator,
                                       allow=allow, record_timeout=record_timeout)

    async with trio.open_nursery() as n:
        n.start_soon(run, "a", tap, ALICE, swarm_a, True, allow_a)
        n.start_soon(run, "b", s2, BOB, swarm_b, False, allow_b)
    return result["a"], result["b"], tap
