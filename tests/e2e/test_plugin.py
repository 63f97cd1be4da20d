"""The ``daemon_swarm`` and ``fault_proxies`` fixtures of the pytest plugin, together: a
scenario as a user writes one against real daemons."""

from __future__ import annotations

import pytest

from daemon.testing import START, free_port, wait_for

pytestmark = pytest.mark.slow


def test_daemons_average_through_a_slow_proxy_and_stop_while_it_blocks(
        daemon_swarm, fault_proxies) -> None:
    ip_a, ip_b = "127.0.3.1", "127.0.3.2"
    port = free_port(ip_a)
    front = fault_proxies.create("a", listen=f"{ip_a}:0", upstream=f"{ip_a}:{port}")
    a = daemon_swarm.add("a", listen=f"{ip_a}:{port}", advertise=front, dial_from=ip_a).start()
    wait_for(lambda: a.last("start"), START, [a], "a to start")
    fault_proxies.faults("a", delay=0.05)
    b = daemon_swarm.add("b", bootstrap=[a], listen=f"{ip_b}:0", dial_from=ip_b).start()
    wait_for(lambda: a.committed() >= 3 and b.committed() >= 3, 120, [a, b],
             "exchanges through the slow proxy")
    assert fault_proxies.get("a")["statistics"]["bytes_upstream"] > 0

    # b is cut off from a: a's proxy black-holes b's address. b's offers to a now fail.
    fault_proxies.faults("a", block=[ip_b])
    mark = len(b.events)
    wait_for(lambda: any(e["result"] != "committed" for e in b.of("exchange", mark)), 60,
             [a, b], "b's exchanges with a to fail")
    fault_proxies.faults("a", block=[])
    mark = len(b.events)
    wait_for(lambda: b.committed(mark) >= 2, 90, [a, b], "exchanges once the block is lifted")
    assert a.stop() == 0 and b.stop() == 0
