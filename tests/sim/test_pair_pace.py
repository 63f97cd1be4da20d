"""A quiet pair trips no limit of its own (virtual time).

Two honest nodes alone, stepping fast and starting a round every step: each node's every
round goes to the same peer, as fast as the exchanges allow, far more often than the
``peer_rate`` (10 channels a second) each lets one peer open. Measured on the code before the
initiator paced its offers: the pair had hundreds of channels cut off at the handshake in 10
s (38 and 41, each a failed round: the "connection reset at the offer" of the logs). Now each
offers the other at most 0.9 x that rate (the rest is for push-pulls), and nothing is refused:
195-196 commits in 10 s, against 226 and 79 refused before.
"""

from __future__ import annotations

import dataclasses

import torch

from gossip.config import AveragingConfig, NodeConfig
from gossip.testing import open_sim_swarm


async def test_two_nodes_alone_stay_within_each_others_channel_limit(autojump_clock) -> None:
    config = dataclasses.replace(NodeConfig.local(), averaging=AveragingConfig(
        every=1, start="own", trust_after=0.0))
    async with open_sim_swarm(2, seed=1, model=lambda i: torch.nn.Linear(8, 8),
                              train=lambda node: 0.0, step_time=0.002, config=config) as sim:
        await sim.run_for(10.0)
        limited = [n.node.roster.statistics().channels_limited for n in sim.nodes]
        committed = [n.node.statistics().committed for n in sim.nodes]
    print(f"\nchannels refused for the rate {limited}, committed {committed}")
    assert limited == [0, 0]
    assert min(committed) >= 0.8 * 2 * 10 * 10.0  # near the rate the pair allows, both ways
