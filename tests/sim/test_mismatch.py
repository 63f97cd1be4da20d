"""A node whose model is not the swarm's (another model, or other task options) is told what
differs, once: a joiner's download and a ready node's offer, in simulated swarms."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import trio
from trio.testing import MockClock

from gossip.averaging import Result
from tests.sim.averaging_swarm import ROUNDS, open_averaging_swarm, start_all

SWARM_TASK = {"entry": "pkg.mod:task", "options": {"hidden": 4}}
ODD_TASK = {"entry": "pkg.mod:task", "options": {"hidden": 5}}
NAMED = "weight: (5, 8) here, (4, 8) there"


def said(caplog: pytest.LogCaptureFixture, text: str, level: int | None = None) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if text in r.getMessage() and (level is None or r.levelno == level)]


async def test_a_joiner_with_another_model_is_told_what_differs_once_per_peer(
        autojump_clock: MockClock, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="gossip")
    torch.manual_seed(0)
    async with open_averaging_swarm(latency=0.005) as swarm:
        own = dataclasses.replace(ROUNDS, start="own")
        first = await swarm.start(torch.nn.Linear(8, 4), config=own, task=SWARM_TASK)
        servers = [first, await swarm.start(torch.nn.Linear(8, 4), bootstrap=[first],
                                            config=own, task=SWARM_TASK)]
        with trio.fail_after(10):
            await swarm.wait_until(lambda: swarm.sees_ready(servers, servers))
        joiner = await swarm.start(torch.nn.Linear(8, 5), bootstrap=[servers[0]],
                                   config=dataclasses.replace(ROUNDS, start="download"),
                                   task=ODD_TASK)
        # The joiner asks again every second: wait (in virtual time) until it has been
        # refused ten times over by each server.
        with trio.fail_after(60):
            while len(said(caplog, "state download refused")) < 10 * len(servers):
                await trio.sleep(1)
        assert not joiner.swarm_node.ready

    refusals = said(caplog, "state download refused")
    loud = said(caplog, "state download refused", logging.WARNING)
    assert len(refusals) >= 20  # it went on asking...
    assert len(loud) == len(servers)  # ...and said so out loud once per server
    for text in loud:
        assert NAMED in text and "bias: (5,) here, (4,) there" in text
        assert "task metadata differs: options.hidden: 5 here, 4 there" in text
    summary = said(caplog, "no state download succeeded")
    assert len(summary) >= 9 and len(said(caplog, "no state download succeeded",
                                          logging.WARNING)) == 1
    assert not said(caplog, "no state download succeeded", logging.INFO)


async def test_an_offer_of_another_model_is_refused_with_what_differs(
        autojump_clock: MockClock, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gossip")
    torch.manual_seed(0)
    async with open_averaging_swarm(latency=0.005) as swarm:
        with trio.fail_after(10):
            peers = await start_all(swarm, [torch.nn.Linear(8, 4), torch.nn.Linear(8, 5)])
            assert await swarm.average(peers[1]) is Result.REJECTED
    refused = said(caplog, "averaging refused by peer=")
    assert len(refused) == 1 and "reason=schema differs: 2 tensors differ" in refused[0]
    assert NAMED in refused[0]
