"""The ``int8`` wire codec: blockwise absmax quantization of a flat float32 state.

Theory of operation
-------------------
A vector of ``numel`` float32 values is cut into **blocks** of :data:`BLOCK` = 64 values in
order; the last block is shorter when 64 does not divide ``numel``. Each block travels as a
**cell**: its scale, a little-endian IEEE 754 binary32, then one signed byte per value::

    cell = scale (4 bytes) | q[0] q[1] ... q[m-1] (m bytes, two's complement int8)

where ``m`` is 64, or the length of the short last block. The cells follow one another with
no padding, so a vector takes exactly :func:`nbytes` ``(numel)`` = ``68 * (numel // 64)``,
plus ``4 + numel % 64`` if that remainder is not 0: about 1.0625 bytes per value, a size
known from ``numel`` alone. A payload of several vectors (a state and a drift correction's
estimate) encodes each on its own: blocks restart at every vector, so a vector whose values
are a thousand times smaller never shares a scale with a larger one.

Encoding, per block: ``absmax`` is the largest ``|x|``, ``scale = absmax / 127`` (float32,
rounded to nearest) and ``q = round(x / scale)``, rounded to nearest with ties to even, which
lies in [-127, 127] (a clamp makes sure of it). A block of zeros has scale 0 and q = 0.
Decoding is ``q * scale`` in float32, so each decoded value is within ``scale / 2`` (plus
float32 rounding) of the original: the error is relative to the block's largest value, not
to each value, and a block's small values lose the most. One exception keeps finite values
finite: a scale is at most :data:`MAX_SCALE`, the largest float32 whose product with 127 is
finite (``absmax / 127`` rounds above it only for the few largest float32 values).

Rounding to nearest makes the encoding a pure function of the state, which the tests and a
second implementation check byte for byte, but it costs learning: with an exchange every step,
a slowly moving state rounds the same way round after round, so the errors do not average out
over the mixing (on the non-IID digits of ``bench/efficiency.py``, 0.3 points at four times
the budget, in every seed). An exchange therefore rounds **stochastically**:
``q = floor(x / scale + u)`` with ``u`` uniform in [0, 1), so that ``E[q · scale] = x`` and the
errors of successive exchanges are independent. One record's worth of ``u`` is drawn per
payload, from a generator of its own seeded from the OS (the model's own random streams are
never touched), and reused for each record: every value still gets a ``u`` independent of it,
which is all that unbiasedness needs, for one extra pass instead of a draw per value. The
error bound is then a whole ``scale`` instead of half of one. The decoder takes any ``q``, so
the choice is the encoder's alone (:func:`encode`'s ``generator``).

Non-finite values stay visible to the receiver's checks: a block holding a NaN has a NaN
scale (always the quiet NaN ``7fc00000``, whatever bits the device's kernel made), and one
holding ±inf (and no NaN) an infinite scale; such a block's q are all 0, so it decodes to NaN
values throughout (``0 * inf`` is NaN). The decoder takes any bytes: a hostile NaN, infinite
or huge scale gives non-finite or huge values, which the float32 checks above this layer
(finiteness, norm bounds, clipping) then see. The byte -128 is not produced but is accepted,
and decodes to ``-128 * scale``: refusing it would protect nothing, since the scale alone can
make a value anything.

Why one cell per block rather than all scales first: records (channel frames) then hold
whole cells, and the payload is the same bytes however it is cut into records, so nothing
about the record size has to be agreed on. 68 is a multiple of 4, so in a record of whole
cells every scale is 4-byte aligned: the record is viewed as a ``(cells, 17)`` float32 array
whose first column is the scales and as a ``(cells, 68)`` byte array whose last 64 columns
are the values, without copying either. Decoding a record is then two vectorized passes over
its output (widen the bytes into it, multiply by the scales in place) and encoding one is
six (absolute values, block maxima, divide, round, clamp, narrow to bytes), on scratch buffers
made once per payload: no Python loop per block, no allocation the size of a record. Nothing here does
I/O; :mod:`gossip.codec` streams records and checks their sizes.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import torch

__all__ = ["BLOCK", "CELL", "LEVELS", "MAX_SCALE", "nbytes", "cells_in", "span", "dither", "encode",
           "decode_into"]

BLOCK = 64  # values per block; the last block of a vector may be shorter
SCALE_BYTES = 4  # a float32 scale leads every cell
CELL = SCALE_BYTES + BLOCK  # bytes of a whole block's cell: 68
LEVELS = 127  # |q| <= LEVELS; scale = absmax / LEVELS
CANONICAL_NAN = 0x7FC00000  # a NaN block's scale: the quiet NaN, bytes 00 00 c0 7f
# The largest float32 s with 127 * s finite (bytes 03 02 01 7c); absmax / 127 of a block
# holding float32's largest value rounds one step above it, and would decode to infinity.
MAX_SCALE = 2.6793883890187504e36


def nbytes(numel: int) -> int:
    """Encoded size in bytes of one vector of ``numel`` values."""
    whole, tail = divmod(numel, BLOCK)
    return whole * CELL + (SCALE_BYTES + tail if tail else 0)


def cells_in(max_record: int) -> int:
    """How many whole cells the encoder puts in a record of at most ``max_record`` bytes."""
    return max_record // CELL


def span(numel: int, received: int, size: int) -> tuple[int, int, int]:
    """Where a record of ``size`` bytes, starting ``received`` bytes into a payload of
    vectors of ``numel`` values, lands in the decoded output.

    A record holds whole cells of one vector: any number of whole blocks' cells, and the
    short last block's cell only as the record's last. ``received`` must be where a record
    may start (0, or the end of a record that passed this check), and ``0 < size``.

    Returns:
        ``(start, blocks, tail)``: the index of the record's first value in the output, how
        many whole blocks it holds, and the length of the short block that ends it (0: none).

    Raises:
        ValueError: the record is not whole cells of one vector (the message says why).
    """
    part = nbytes(numel)
    index, offset = divmod(received, part)
    end = offset + size
    if end > part:
        raise ValueError(f"record of {size} bytes is not whole int8 blocks: it runs past the "
                         f"end of vector {index} ({part - offset} bytes of it remain)")
    tail = numel % BLOCK if end == part else 0
    body = size - (SCALE_BYTES + tail if tail else 0)
    if body < 0 or body % CELL:
        raise ValueError(f"record of {size} bytes is not whole int8 blocks "
                         f"({CELL} bytes each, {SCALE_BYTES + tail} for the short last one)")
    return index * numel + offset // CELL * BLOCK, body // CELL, tail


def dither(device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for :func:`encode`'s stochastic rounding, seeded from the OS, on
    ``device``: one per payload, so no two payloads share their ``u``."""
    return torch.Generator(device=device).manual_seed(secrets.randbits(63))


def encode(flat: torch.Tensor, parts: int, max_record: int,
           generator: torch.Generator | None = None) -> Iterator[memoryview]:
    """Records of whole cells, at most ``max_record`` bytes each, encoding ``flat`` as
    ``parts`` vectors back to back; a record never holds cells of two vectors.

    ``flat`` is a contiguous 1-D float32 tensor whose size ``parts`` divides, and
    ``max_record >= CELL`` (the caller checks). The quantization runs on ``flat``'s device, one
    record at a time, into scratch buffers made once; each record is a read-only view of one
    host buffer that the next record overwrites. Rounding is to nearest without
    ``generator``, else stochastic, with one record's worth of ``u`` drawn from it (on
    ``flat``'s device; see the module's docstring).
    """
    numel = flat.numel() // parts
    if numel == 0:
        return
    per = min(numel, cells_in(max_record) * BLOCK)  # values in a full record
    host = torch.empty(nbytes(per), dtype=torch.uint8)
    view = memoryview(host.numpy()).cast("B").toreadonly()
    device = host if flat.device.type == "cpu" else torch.empty_like(host, device=flat.device)
    work = torch.empty(per, dtype=torch.float32, device=flat.device)
    u = (None if generator is None else
         torch.rand(per, generator=generator, dtype=torch.float32, device=flat.device))
    for index in range(parts):
        vector = flat[index * numel : (index + 1) * numel]
        for start in range(0, numel, per):
            values = vector[start : start + per]
            size = _quantize(values, device, work, u)
            if device is not host:
                host[:size].copy_(device[:size])
            yield view[:size]


def _quantize(values: torch.Tensor, out: torch.Tensor, work: torch.Tensor,
              u: torch.Tensor | None) -> int:
    """Encode ``values`` as cells at the start of the byte tensor ``out``; returns their size.
    ``u``: the stochastic rounding's offsets (at least as many as ``values``), or None."""
    blocks, tail = divmod(values.numel(), BLOCK)
    body = blocks * CELL
    whole = blocks * BLOCK
    if blocks:
        cells = out[:body]
        _quantize_blocks(values[:whole].view(blocks, BLOCK),
                         cells.view(torch.float32).view(blocks, CELL // 4)[:, 0],
                         cells.view(blocks, CELL)[:, SCALE_BYTES:],
                         work[:whole].view(blocks, BLOCK),
                         None if u is None else u[:whole].view(blocks, BLOCK))
    if tail:
        _quantize_blocks(values[whole:].view(1, tail),
                         out[body : body + SCALE_BYTES].view(torch.float32),
                         out[body + SCALE_BYTES : body + SCALE_BYTES + tail].view(1, tail),
                         work[whole : whole + tail].view(1, tail),
                         None if u is None else u[whole : whole + tail].view(1, tail))
        body += SCALE_BYTES + tail
    return body


def _quantize_blocks(x: torch.Tensor, scales: torch.Tensor, q: torch.Tensor,
                     work: torch.Tensor, u: torch.Tensor | None) -> None:
    """Quantize the rows of ``x`` (one block each) into ``scales`` (float32, one per row) and
    ``q`` (bytes, shaped as ``x``), using ``work`` (float32, shaped as ``x``); rounding to
    nearest, or up with probability the fraction (``u``, shaped as ``x``)."""
    torch.abs(x, out=work)
    # NaN if the block has one; inf if ±inf. The divisor is a tensor on the values' device:
    # a Python number would let CUDA multiply by a rounded 1/127 instead of dividing, one
    # bit off for some blocks, and the bytes on the wire would depend on the device.
    levels = torch.full((1,), LEVELS, dtype=torch.float32, device=work.device)
    scale = torch.amax(work, dim=1).div_(levels)
    finite = None
    if not float(scale.max()) <= MAX_SCALE:  # one test for all the rare cases
        finite = torch.isfinite(scale)
        scale = torch.where(finite, scale.clamp(max=MAX_SCALE), scale)
    # Zero blocks divide by 1 (0 / 0 would be NaN); a NaN scale also gives 1, harmlessly:
    # its block is zeroed below. A subnormal scale may put x / scale past 127.5: the clamp.
    torch.div(x, torch.where(scale > 0, scale, 1.0).unsqueeze(1), out=work)
    if u is None:
        work.round_()
    else:
        work.add_(u).floor_()  # |x / scale| <= 127, so the floor stays within the clamp
    work.clamp_(-LEVELS, LEVELS)
    if finite is not None and not bool(finite.all()):
        work[~finite] = 0.0  # the scale carries the NaN or inf; the values must be defined
    scales.copy_(scale)
    if finite is not None and bool(scale.isnan().any()):
        # A NaN's bits are whatever the kernel made (7fc00000 on a CPU, ffffffff on CUDA):
        # the one quiet NaN of the protocol keeps the bytes the same on every device.
        scales.view(torch.int32)[scale.isnan()] = CANONICAL_NAN
    q.view(torch.int8).copy_(work)


def decode_into(record: torch.Tensor, out: torch.Tensor, blocks: int, tail: int) -> None:
    """Decode a record (a byte tensor on ``out``'s device, starting 4-byte aligned) of
    ``blocks`` whole cells then, if ``tail``, a short one into ``out``, a float32 tensor of
    ``blocks * BLOCK + tail`` values. Any bytes decode; nothing is allocated per record."""
    if blocks:
        cells = record[: blocks * CELL]
        dst = out[: blocks * BLOCK].view(blocks, BLOCK)
        dst.copy_(cells.view(blocks, CELL)[:, SCALE_BYTES:].view(torch.int8))
        dst.mul_(cells.view(torch.float32).view(blocks, CELL // 4)[:, :1])
    if tail:
        at = blocks * CELL
        dst = out[blocks * BLOCK : blocks * BLOCK + tail]
        dst.copy_(record[at + SCALE_BYTES : at + SCALE_BYTES + tail].view(torch.int8))
        dst.mul_(record[at : at + SCALE_BYTES].view(torch.float32))
