"""Copies between a model on one CUDA device and a replica's host buffers, kept off the
training stream's back.

Theory of operation
-------------------
A replica of a model on a GPU exchanges page-locked host buffers over the network; the model,
its drift correction and the trainer's kernels live on the device. Two copies cross between
them at every exchange, and each used to stop the trainer:

* **The snapshot** (device to host): the state, plus the deltas committed and not yet
  applied, and the correction's estimate ``z = ĝ + decay·c``. It was one synchronous copy per
  tensor, then an add and a finiteness pass over the whole model on the CPU, all under the
  replica's lock, which the trainer's next step waits for (a tenth to a fifth of a second at
  100M parameters, measured on an H100). :meth:`Staging.snapshot` computes both parts on the
  device, in the same arithmetic the host did (``torch.add`` with ``alpha``: one fused
  multiply-add per element, on either device), starts every copy at once without waiting
  (``non_blocking`` into page-locked memory), and waits once, for the last: the lock is held
  for the transfer alone, and the only thing read back besides is one flag that says whether
  the estimate is finite.
* **The delta** (host to device): a committed exchange's delta is applied over the next
  steps (:mod:`gossip.replica`), a fraction at every step, so it has to sit on the device.
  :meth:`Staging.upload` starts its copy on a side stream as soon as the exchange commits,
  while the trainer's kernels run; the trainer's stream waits for it on the GPU (an event,
  never the host) at the step that first uses it (:meth:`Staging.staged`).

Ordering: the trainer and the network's threads issue their work on the device's current
stream (the same one, unless the caller chose another); a snapshot's copies are ordered after
every kernel the trainer queued before it, and since the replica's lock is held until they
complete, no later optimizer step of a trainer that takes the lock (every trainer of a replica
with a correction: its step pre-hook does) can overwrite a tensor being read. The side stream
waits, before it overwrites the device copy of the delta, until every read of the previous one
is done (the last read on each stream that read it), and the host waits before it changes the host buffer an upload
may still be reading (:meth:`wait_upload`).

Memory: one device buffer the size of a replica's host buffers (the state, and with a
correction its estimate: 4 or 8 bytes a parameter), made at the first exchange and kept, and,
during a snapshot, the temporaries of one tensor at a time. A CPU model has no staging at all.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

__all__ = ["Staging", "device_of"]


def device_of(tensors: Sequence[torch.Tensor]) -> torch.device | None:
    """The one CUDA device every tensor is on, or None (a CPU model, or one spread over
    several devices: those use the host's copies and arithmetic)."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        return None
    (device,) = devices
    return device if device.type == "cuda" else None


class Staging:
    """The device side of a replica of a model on ``device``; every method is called with
    the replica's lock held.

    Args:
        device: the model's CUDA device (with its index).
        numel: the size of the replica's host buffers, in float32 values.
    """

    def __init__(self, device: torch.device, numel: int) -> None:
        self.device = device
        self._numel = numel
        self._stream = torch.cuda.Stream(device)
        self._buffer: torch.Tensor | None = None  # the device copy of the pending delta
        self._uploaded: torch.cuda.Event | None = None  # its copy is complete
        # The last read of it on each stream that read it (the trainer's and the network's
        # are the same stream unless a caller chose its own).
        self._released: dict[int, torch.cuda.Event] = {}

    # ---- the delta, host to device -----------------------------------------------------

    def wait_upload(self) -> None:
        """Return once no copy reads the host buffer last uploaded (before it changes)."""
        if self._uploaded is not None:
            self._uploaded.synchronize()

    def upload(self, pending: torch.Tensor) -> None:
        """Start copying ``pending`` (page-locked, the replica's buffer size) to the device,
        on the side stream: nothing waits for it here."""
        if self._buffer is None:
            with torch.cuda.device(self.device):
                self._buffer = torch.empty(self._numel, dtype=torch.float32,
                                           device=self.device)
        with torch.cuda.stream(self._stream):
            for read in self._released.values():  # the reads of the previous copy are done
                self._stream.wait_event(read)
            self._released.clear()
            self._buffer[: pending.numel()].copy_(pending, non_blocking=True)
            self._uploaded = torch.cuda.Event()
            self._uploaded.record(self._stream)

    def staged(self) -> torch.Tensor:
        """The device copy of the pending delta, for work on the current stream: the stream
        waits for the copy on the device, and :meth:`done` must follow that work."""
        assert self._buffer is not None and self._uploaded is not None
        torch.cuda.current_stream(self.device).wait_event(self._uploaded)
        return self._buffer

    def done(self) -> None:
        """Mark the end of the current stream's reads of :meth:`staged`'s buffer."""
        stream = torch.cuda.current_stream(self.device)
        read = torch.cuda.Event()
        read.record(stream)
        self._released[stream.stream_id] = read

    # ---- the snapshot, device to host --------------------------------------------------

    def snapshot(self, live: Sequence[torch.Tensor], views: Iterator[torch.Tensor],
                 delta: torch.Tensor | None, scale: float,
                 estimates: Iterator[tuple[torch.Tensor, torch.Tensor]] | None) -> bool:
        """Copy the live tensors, plus ``scale`` x the state part of ``delta`` (the staged
        pending delta, or None), into their ``views`` of a page-locked host buffer, and each
        (estimate on the device, its host view) pair; returns once every copy is complete,
        with whether every estimate was finite.

        Args:
            live: the model's float tensors, in schema order.
            views: their float32 views in the host buffer, in the same order.
            delta: :meth:`staged`'s buffer when a delta is pending (the caller calls
                :meth:`done` after), else None.
            scale: the pending state delta's scale.
            estimates: (z on the device, its host view) pairs, or None.
        """
        finite = torch.ones((), dtype=torch.bool, device=self.device)
        at = 0
        for t, view in zip(live, views):
            size = view.numel()
            if delta is not None:
                value = torch.add(t.to(torch.float32), delta[at : at + size].view(t.shape),
                                  alpha=scale)
            else:
                value = t.to(torch.float32)  # the tensor itself when it is float32
            view.copy_(value, non_blocking=True)
            at += size
        for z, view in estimates or ():
            finite &= torch.isfinite(z).all()
            view.copy_(z, non_blocking=True)
        flag = finite.to("cpu", non_blocking=True)  # into page-locked memory, as the rest
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(self.device))
        copied.synchronize()
        return bool(flag)
