"""The device side of a replica of a GPU model (gossip.staging; skipped without CUDA).

The staged paths must give the results the host paths give, bit for bit: a snapshot (state,
pending delta, drift-correction estimate) computed on the device and copied once is the
snapshot the host computed from per-tensor copies, and a delta uploaded on a side stream and
spread over steps leaves the model where the same adds from the host would.
"""

from __future__ import annotations

import pytest
import torch

from gossip import tensors
from gossip.replica import Replica

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class Mixed(torch.nn.Module):
    """Float32 layers, a BatchNorm (float buffers, no correction) and a bfloat16 weight."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.net = torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.BatchNorm1d(96),
                                       torch.nn.ReLU(), torch.nn.Linear(96, 7))
        self.w16 = torch.nn.Parameter(torch.randn(33).to(torch.bfloat16))


def corrected(device: str) -> tuple[Replica, torch.optim.Optimizer]:
    model = Mixed().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # steps move ĝ and c, not weights
    return Replica(model, optimizer=optimizer), optimizer


def gradients(replica: Replica, optimizer: torch.optim.Optimizer, seed: int) -> None:
    """One optimizer step on fixed gradients: ĝ moves, and c is added to them."""
    generator = torch.Generator().manual_seed(seed)
    for p in replica.model.parameters():
        p.grad = torch.randn(p.shape, generator=generator).to(p.device, p.dtype)
    optimizer.step()
    replica.advance()


def host_snapshot(replica: Replica) -> torch.Tensor:
    """What the host paths give for the replica's state right now (the reference)."""
    n = replica.schema.numel
    out = torch.zeros(replica.parts * n)
    with replica.lock:
        tensors.snapshot(replica.model, replica.schema, out[:n])
        pending = replica._pending is not None
        if pending:
            out[:n].add_(replica._pending[:n], alpha=replica._scales[0])
        if replica.correction is not None:
            replica._estimate(out[n:], pending)
    return out


def flat(replica: Replica, seed: int, scale: float = 0.05) -> torch.Tensor:
    """A delta as an exchange makes one: 0 in the estimate where nothing is corrected."""
    generator = torch.Generator().manual_seed(seed)
    buffer = replica.buffer()
    buffer.copy_(torch.randn(buffer.numel(), generator=generator) * scale)
    replica.clear_uncovered(buffer[replica.schema.numel:])
    return buffer


def test_a_gpu_replica_stages_and_a_cpu_one_does_not() -> None:
    assert corrected("cuda")[0]._staging is not None
    assert corrected("cpu")[0]._staging is None


def test_staged_snapshots_are_the_host_snapshots_bit_for_bit() -> None:
    replica, optimizer = corrected("cuda")
    for seed in range(3):
        gradients(replica, optimizer, seed)
    got = replica.buffer()
    replica.snapshot(got)
    assert torch.equal(got, host_snapshot(replica))
    for k in range(4):  # exchanges 3 steps apart: each delta spreads over 2 of them
        replica.queue(flat(replica, 10 + k), scale=0.5, correction=0.25, weight=None,
                      sent_weight=0.0)
        for _ in range(3):
            replica.snapshot(got)  # mid-spread: live state plus the rest of the delta
            assert torch.equal(got, host_snapshot(replica))
            replica.apply_step()
            gradients(replica, optimizer, 20 + k)
    replica.snapshot(got, parts=1)  # a download's: the state alone
    assert torch.equal(got[: replica.schema.numel], host_snapshot(replica)[: replica.schema.numel])


def test_staged_deltas_land_where_the_host_would_put_them() -> None:
    gpu, gpu_opt = corrected("cuda")
    cpu, cpu_opt = corrected("cpu")
    for replica, optimizer in ((gpu, gpu_opt), (cpu, cpu_opt)):
        for k in range(5):
            gradients(replica, optimizer, k)
            replica.queue(flat(replica, 30 + k), scale=0.5, correction=0.25, weight=None,
                          sent_weight=0.0)
            replica.apply_step()
            if k == 2:  # a second delta while the first is spread: merged on the host
                replica.queue(flat(replica, 40), scale=0.3, correction=0.1, weight=None,
                              sent_weight=0.0)
        replica.apply_pending()
    # The same adds on two devices: the float32 state agrees to rounding (the bfloat16
    # weight exactly, as rounding to bfloat16 hides it); the correction likewise.
    torch.testing.assert_close(tensors.snapshot(gpu.model, gpu.schema),
                               tensors.snapshot(cpu.model, cpu.schema))
    for name, value in gpu.correction_state().items():
        torch.testing.assert_close(value, cpu.correction_state()[name])


def test_a_non_finite_gradient_is_forgotten_on_the_device_as_on_the_host() -> None:
    replica, optimizer = corrected("cuda")
    gradients(replica, optimizer, 1)
    assert replica.correction is not None
    replica.correction._average[0].fill_(float("nan"))  # what an overflowing step leaves in ĝ
    got = replica.buffer()
    replica.snapshot(got)
    assert bool(torch.isfinite(got).all())
    assert not replica.estimating  # ĝ forgotten: no estimate until the next step measures
    assert torch.equal(got, host_snapshot(replica))


def test_a_download_mid_spread_waits_for_the_upload_and_drops_the_rest() -> None:
    replica, optimizer = corrected("cuda")
    gradients(replica, optimizer, 1)
    for _ in range(3):
        replica.queue(flat(replica, 50), scale=0.5, weight=None, sent_weight=0.0)
        replica.apply_pending()
        for _ in range(8):
            replica.advance()
    replica.queue(flat(replica, 51), scale=0.5, weight=None, sent_weight=0.0)
    replica.apply_step()
    source = tensors.snapshot(Mixed(), replica.schema)
    replica.load(source, step=0, buffers={})
    replica.apply_step()
    assert torch.equal(tensors.snapshot(replica.model, replica.schema),
                       tensors.snapshot(Mixed(), replica.schema))
