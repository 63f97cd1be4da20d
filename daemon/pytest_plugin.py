"""pytest fixtures for fault-injection tests of a swarm, registered through the ``pytest11``
entry point: installing gossipd makes them available to any test suite in the environment.

* ``sim_swarm``: an async factory of in-process swarms on the simulated network
  (``sim = await sim_swarm(n=8, seed=1)``), torn down with the test. The test also takes
  pytest-trio's ``autojump_clock`` (pytest-trio runs a test on a clock only when the test
  itself asks for it). See :func:`gossip.testing.open_sim_swarm`.
* ``daemon_swarm``: a :class:`daemon.testing.DaemonSwarm` in the test's temporary directory
  (real ``gossipd`` processes); every daemon still running is stopped after the test.
* ``fault_proxies``: a :class:`gossip.testing.ProxyClient` of a proxy server shared by the
  whole session (one process); the proxies a test made are removed after it.

Every import happens inside a fixture: loading the plugin costs pytest nothing (no torch),
and a suite that uses none of them never imports the project.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

import pytest


@pytest.fixture
async def sim_swarm(nursery: Any) -> AsyncIterator[Callable[..., Awaitable[Any]]]:
    """``await sim_swarm(n, **options)`` opens a :func:`gossip.testing.open_sim_swarm` that
    lives until the test ends. Needs pytest-trio, and the test must take ``autojump_clock``
    too: on the real clock a simulated minute would take a minute."""
    import trio.testing

    from gossip.testing import open_sim_swarm

    async def run(n: int, options: dict[str, Any], *, task_status: Any) -> None:
        async with open_sim_swarm(n, **options) as sim:
            task_status.started(sim)
            await _forever()

    async def factory(n: int = 8, **options: Any) -> Any:
        if not isinstance(trio.lowlevel.current_clock(), trio.testing.MockClock):
            raise RuntimeError("sim_swarm runs on virtual time: add the autojump_clock fixture "
                               "to the test's arguments")
        return await nursery.start(run, n, options)

    yield factory


async def _forever() -> None:
    import trio

    await trio.sleep_forever()


@pytest.fixture
def daemon_swarm(tmp_path: Any) -> Iterator[Any]:
    """Real daemons sharing one swarm key, under the test's ``tmp_path``."""
    from daemon.testing import DaemonSwarm

    with DaemonSwarm(tmp_path / "swarm") as swarm:
        yield swarm


@pytest.fixture(scope="session")
def _fault_proxy_server() -> Iterator[Any]:
    from gossip.testing import ProxyClient

    with ProxyClient.spawn() as client:
        yield client


@pytest.fixture
def fault_proxies(_fault_proxy_server: Any) -> Iterator[Any]:
    """The session's fault proxy server; proxies created in the test are removed after it."""
    client = _fault_proxy_server
    before = {p["name"] for p in client.list()}
    yield client
    for name in {p["name"] for p in client.list()} - before:
        client.remove(name)
