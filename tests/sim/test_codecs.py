"""Every wire codec end to end: a simulated swarm on quadratics, drift correction on (so each
payload is two vectors: the state and the correction's estimate), commits its exchanges and
settles where the fp32 swarm does, within the codec's rounding. The mod codecs and "auto"
too: each node's first exchanges are int8, until its periods are measured."""

from __future__ import annotations

import pytest
import torch
from trio.testing import MockClock

from gossip.codec import encoded_nbytes
from gossip.config import AveragingConfig
from gossip.tensors import CODECS
from gossip.testing import open_sim_swarm
from tests.sim.quadratic import Quadratics
from tests.util import local

NODES = 4
SIZE = 200  # three whole int8 blocks and a short one of 8


@pytest.mark.parametrize("codec", (*CODECS, "mod4", "auto"))
async def test_a_swarm_commits_and_settles_in_every_codec(autojump_clock: MockClock,
                                                          codec: str) -> None:
    swarm = Quadratics(NODES, SIZE, seed=5)
    models, targets = swarm.models, swarm.targets
    config = local(averaging=AveragingConfig(start="own", trust_after=0.0, codec=codec))
    async with open_sim_swarm(NODES, seed=5, model=lambda i: models[i],
                              optimizer=lambda i: swarm.optimizers[i], train=swarm.train,
                              step_time=0.1, config=config) as sim:
        await sim.run_for(30.0)
        stats = [n.node.statistics() for n in sim.nodes if n.node]
        spread = sim.spread()
        committed = [e for e in sim.exchanges if e.result.value == "committed"]
    # Each reports its codec and its payload's size: the offered one, or int8 while cold.
    used = {e.codec for e in committed}
    assert used <= {codec, "int8"} | ({"fp32", "bf16", "mod4"} if codec == "auto" else set())
    for e in committed:
        assert e.nbytes in (encoded_nbytes(e.codec, SIZE, 1), encoded_nbytes(e.codec, SIZE, 2))
    assert all(s.committed > 10 and s.corrected > 10 for s in stats), stats
    assert all(s.invalid == 0 and s.failed == 0 for s in stats), stats
    # The optimum of the swarm is the mean target; the corrections take every node near it.
    center = torch.stack([m.x.detach() for m in models]).mean(0)
    optimum = torch.stack(targets).mean(0)
    scale = float(optimum.norm())
    # Measured: 2-8% of the scale (center) and 4-8% (spread) in every codec, varying from
    # run to run (trio's order of ready tasks varies). The targets lie about twice the
    # scale from their mean: a codec that broke the states or the estimates would show.
    assert float((center - optimum).norm()) < 0.2 * scale, (codec, center - optimum)
    assert spread < 0.2 * scale, (codec, spread)


@pytest.mark.parametrize("bandwidth, then", [(1e5, "mod4"), (None, "fp32")])
async def test_auto_picks_the_codec_the_measured_link_carries(
        autojump_clock: MockClock, bandwidth: float | None, then: str) -> None:
    # 260,000 parameters, below OFFLOAD_NUMEL (no worker threads on the virtual clock): an
    # exchange is 1.04 MB in fp32, 276 KB in int8 (enough to time the link), 138 KB in mod4.
    # Idle nodes give an exchange `interval` (2 s): at 100 KB/s only mod4 fits.
    numel = 260_000
    generator = torch.Generator().manual_seed(7)
    start = torch.randn(numel, generator=generator)
    models = []
    for _ in range(2):
        model = torch.nn.Linear(numel, 1, bias=False)
        with torch.no_grad():
            model.weight.copy_(start + 0.01 * torch.randn(numel, generator=generator))
        models.append(model)
    config = local(averaging=AveragingConfig(start="own", trust_after=0.0, codec="auto",
                                             correction=False, every=None, interval=2.0))
    async with open_sim_swarm(2, seed=7, model=lambda i: models[i], config=config,
                              bandwidth=bandwidth) as sim:
        await sim.run_for(60.0)
        committed = [e for e in sim.exchanges if e.result.value == "committed"]
    codecs = [e.codec for e in committed if e.initiated]
    # Nothing measured: int8, which times the link; then what the rate allows.
    assert codecs[0] == "int8" and len(codecs) >= 3, codecs
    assert set(codecs[1:]) == {then}, codecs
