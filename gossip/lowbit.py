"""The ``mod`` wire codecs: a state in 4 bits a value, decoded against the receiver's own.

Theory of operation
-------------------
The codecs below 8 bits in the literature (SparseLoCo, Streaming DiLoCo's FP4, DeMo) send an
*update* against a reference every receiver holds, the last synchronized model. A gossip pair
has none: A and B met other peers since they last met each other, if they ever did, and no
node holds what another holds. What a pair does share is its **closeness**: two replicas of
one model differ by the training since their last exchanges and the disagreement the swarm
has not yet averaged away, much less than the weights themselves. So the receiver's own
state is the reference, and the sender does not need to know it: the sender codes each value
**modulo a period** θ, and the receiver lifts it to the representative of its residue class
nearest its own value. This is coding with side information at the decoder (Wyner and Ziv's
setting; the modulo construction is Moniqua's, Lu and De Sa 2020). It needs no memory per
peer, no extra round trip, and works for any pair, a joiner included.

A codec is named ``mod<b>`` or ``mod<b>/<F>:<f>``:

* ``b`` in {2, 3, 4}: bits per value, ``K = 2^b`` levels per period (only ``mod4`` is a
  setting, :data:`gossip.config.MOD_SETTING` says why; the others decode);
* ``F`` in 1..64 and ``0 <= f < F``: the payload carries **fragment** ``f`` of ``F``: the
  blocks whose index is ``f`` modulo ``F`` (blocks interleave, so a fragment samples every
  layer). ``mod<b>`` is ``mod<b>/1:0``. The initiator picks ``f`` and names it in its
  ``Offer``; both payloads carry the same fragment, and the values of other blocks decode to
  the receiver's own (they do not move in this exchange).

The state is cut into blocks of :data:`BLOCK` = 64 values, the last shorter. A selected block
of ``m`` values travels as a **cell**: its period θ as a little-endian bfloat16, then the ``m``
codes, ``b`` bits each, as one bit string, least significant bit first, padded with zero bits
to a whole byte::

    cell = θ (2 bytes, bf16 LE) | codes (ceil(m·b / 8) bytes)

``mod4``: 34 bytes per 64 values, 4.25 bits a value, 34/256 = 1/7.53 of ``fp32``; ``mod4/8``:
1/60.2.

A payload's later vectors (the drift correction's estimate) travel as ``int8`` cells
(:mod:`gossip.int8`) of the same blocks, gathered in order (:func:`gather`): an estimate is a
gradient, two nodes' estimates differ about as much as they are large, so the receiver's own
is no side information; and a rounding error in it is added to every gradient step until the
next exchange (on the character LM, estimates coded like the state cost as much as periods
that wrap). :func:`payload_nbytes` has the sizes.

**Encoding** a block of values ``y`` with period θ (float32 arithmetic, each operation
rounded to nearest even, in this order, so that every device writes the same bytes):
``step = θ / K``; ``n = round(y / step)`` (ties to even); ``c = n − K · floor(n / K)``, in
[0, K). **Decoding** against the receiver's values ``r``: ``v = c · step``;
``k = round((r − v) / θ)``; ``x = v + k · θ``. If ``|n · step − r| < θ / 2`` the receiver
gets ``n · step``, within ``step / 2`` of ``y``, whatever ``r`` is; and whatever the bytes
are, ``|x − r| <= θ / 2`` (plus rounding): a payload cannot move a value further than half its
period from the receiver's own.

θ is the sender's choice (:func:`periods`; :mod:`gossip.feedback` keeps what it needs):
``2 · MARGIN`` times the largest difference it saw in that block at its last exchange that
carried it, so that a pair up to :data:`MARGIN` (4) times as far apart still decodes exactly;
a block never measured takes four times its largest value (a node offers ``int8`` until it
has measured every block: such periods are as coarse as the weights). A value further than
θ/2 from the receiver's comes in *wrapped*, off by a whole period, but never by more than θ/2
from the receiver's own; the largest difference the receiver then sees is about θ/2, so the
next period it sends in that block grows up to :data:`MARGIN` fold: a period that was too
small recovers at the next exchange. Why 4: the largest difference of a block of 64 changes
from one exchange to the next (a different peer, other batches), and a wrapped value is
nearly as wrong as the difference itself; on the character LM of ``bench/lowcomm.py`` (H =
100, drift correction on) ``mod4`` ended 1.2% above ``fp32``'s held-out loss with a margin of
2 (4 seeds) and 0.3% with 4 (3 seeds), where each doubling of the margin costs one bit.

**Error feedback.** Rounding to nearest is a pure function of the values (the bytes are the
same on every device), but a value that moves slowly rounds the same way exchange after
exchange. So the sender adds what rounding left out of its last payload to its next one:
``y = own + e`` and ``e ← y − n · step`` on the blocks sent, once the exchange commits
(:func:`encode` computes the new ``e``). Over a node's exchanges what its peers received adds
up to what they would have received exactly, less the last ``e``, at most ``step / 2`` a value.

The encoder never uses a period below 2^-16 of the block's largest value (:data:`FLOOR`), so
that ``n`` stays an exact float32 integer. The decoder refuses a period that is not a
positive normal finite bfloat16 of at least :data:`MIN_PERIOD` (a NaN, an infinity, 0, a
negative or a subnormal one): with every period valid, every decoded value is finite when
the receiver's is (clamped to float32's range, which only a reference within θ/2 of its
largest value can reach), within θ/2 of it.
Nothing here does I/O.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from . import int8
from .config import MOD_SETTING

__all__ = ["BLOCK", "MARGIN", "MIN_PERIOD", "MIN_RECORD", "Spec", "parse", "parse_setting",
           "is_lowbit", "is_lowbit_setting", "nbytes", "carried", "estimate_nbytes",
           "payload_nbytes", "gather", "scatter", "blocks", "selected", "periods", "encode",
           "decode_into"]

BLOCK = 64  # values per block; the last block of a vector may be shorter
PERIOD_BYTES = 2  # a bfloat16 period leads every cell
MAX_FRAGMENTS = 64
MARGIN = 4.0  # θ = 2 · MARGIN · the largest difference last seen in the block
MIN_PERIOD = 2.0 ** -100  # smaller periods are refused (and never sent)
MAX_PERIOD = float(torch.finfo(torch.bfloat16).max)
FLOOR = 2.0 ** -16  # the least period, relative to the block's largest value sent
# Bytes a data record of any codec holds at the least, but one that ends a vector (for a mod
# payload, its last; gossip.codec's decoders hold every codec to it): each record costs the
# receiver an AEAD open and a turn of its receive loop, so a payload cut into one-byte records
# would cost 21 bytes on the wire and a loop's turn per byte of it.
MIN_RECORD = 1 << 14
_FLOAT_MAX = float(torch.finfo(torch.float32).max)

_NAME = re.compile(r"mod([234])(?:/([1-9][0-9]?):([0-9]{1,2}))?")


@dataclass(frozen=True)
class Spec:
    """A parsed ``mod`` codec name: ``bits`` per value, fragment ``fragment`` of
    ``fragments``."""

    bits: int
    fragments: int = 1
    fragment: int = 0

    @property
    def levels(self) -> int:
        return 1 << self.bits

    @property
    def name(self) -> str:
        if self.fragments == 1:
            return f"mod{self.bits}"
        return f"mod{self.bits}/{self.fragments}:{self.fragment}"

    def cell_bytes(self, m: int) -> int:
        """Bytes of the cell of a block of ``m`` values."""
        return PERIOD_BYTES + -(-m * self.bits // 8)


def parse(name: object) -> Spec:
    """The :class:`Spec` of a ``mod`` codec name.

    Raises:
        ValueError: not ``mod<b>`` or ``mod<b>/<F>:<f>`` with b in 2..4, F in 1..64, f < F
            (``mod<b>/1:0`` is spelled ``mod<b>``, so that every codec has one name).
    """
    match = _NAME.fullmatch(name) if isinstance(name, str) else None
    if match is None:
        raise ValueError(f"not a mod codec: {name!r}")
    bits = int(match[1])
    if match[2] is None:
        return Spec(bits)
    fragments, fragment = int(match[2]), int(match[3])
    if not 2 <= fragments <= MAX_FRAGMENTS or fragment >= fragments or match[3] != str(fragment):
        raise ValueError(f"not a mod codec: {name!r} (fragments 2..{MAX_FRAGMENTS}, "
                         "fragment below them, no leading zeros)")
    return Spec(bits, fragments, fragment)




def parse_setting(name: object) -> Spec:
    """The :class:`Spec` (fragment 0) of a configured ``mod`` codec: ``mod<b>`` or
    ``mod<b>/<F>``, the node then naming the fragment of each exchange in its offer.

    Raises:
        ValueError: not ``mod4`` or ``mod4/<F>`` with F in 2..64 (``gossip.config.MOD_SETTING``:
            mod3 and mod2 decode, but are no settings).
    """
    match = MOD_SETTING.fullmatch(name) if isinstance(name, str) else None
    if match is None or (match[2] is not None and not 2 <= int(match[2]) <= MAX_FRAGMENTS):
        raise ValueError(f"not a mod codec setting: {name!r} (mod4, or mod4/<F> "
                         f"with F in 2..{MAX_FRAGMENTS})")
    return Spec(int(match[1]), int(match[2] or 1))


def is_lowbit_setting(name: object) -> bool:
    """Whether ``name`` is a ``mod`` codec setting (``mod4``, ``mod4/8``)."""
    return _parses(parse_setting, name)


def is_lowbit(name: object) -> bool:
    """Whether ``name`` is a ``mod`` codec (a wire name: ``mod4``, ``mod4/8:3``)."""
    return _parses(parse, name)


def _parses(parser, name: object) -> bool:
    try:
        parser(name)
    except ValueError:
        return False
    return True


def blocks(numel: int) -> int:
    """How many blocks a vector of ``numel`` values has."""
    return -(-numel // BLOCK)


def selected(spec: Spec, numel: int) -> torch.Tensor:
    """The indices of the blocks of a vector of ``numel`` values that ``spec`` carries."""
    return torch.arange(spec.fragment, max(blocks(numel), spec.fragment), spec.fragments)


def nbytes(spec: Spec, numel: int) -> int:
    """Encoded size in bytes of one vector of ``numel`` values."""
    count = blocks(numel)
    chosen = len(range(spec.fragment, count, spec.fragments))
    tail = numel % BLOCK
    if tail and (count - 1) % spec.fragments == spec.fragment:
        return (chosen - 1) * spec.cell_bytes(BLOCK) + spec.cell_bytes(tail)
    return chosen * spec.cell_bytes(BLOCK)


def carried(spec: Spec, numel: int) -> int:
    """How many of a vector's ``numel`` values the blocks ``spec`` carries hold."""
    count = blocks(numel)
    chosen = len(range(spec.fragment, count, spec.fragments))
    tail = numel % BLOCK
    if tail and (count - 1) % spec.fragments == spec.fragment:
        return (chosen - 1) * BLOCK + tail
    return chosen * BLOCK


def estimate_nbytes(spec: Spec, numel: int) -> int:
    """Encoded size of the second vector of a payload (the drift correction's estimate): the
    blocks ``spec`` carries, as ``int8`` cells (:mod:`gossip.int8`)."""
    return int8.nbytes(carried(spec, numel))


def payload_nbytes(spec: Spec, numel: int, parts: int) -> int:
    """Encoded size of a payload of ``parts`` vectors: the state in ``mod`` cells, each
    vector after it in ``int8`` cells of the same blocks."""
    return nbytes(spec, numel) + (parts - 1) * estimate_nbytes(spec, numel)


def gather(vector: torch.Tensor, spec: Spec) -> torch.Tensor:
    """The values of the blocks ``spec`` carries, in order, as one vector (a short last block
    stays short)."""
    numel = vector.numel()
    index = selected(spec, numel).to(vector.device)
    if spec.fragments == 1:
        return vector
    values = _rows(vector)[index].reshape(-1)
    tail = numel % BLOCK
    if tail and index.numel() and int(index[-1]) == blocks(numel) - 1:
        values = values[: values.numel() - BLOCK + tail]
    return values


def scatter(values: torch.Tensor, spec: Spec, out: torch.Tensor) -> None:
    """Write what :func:`gather` took back into its blocks of ``out`` (the others unchanged)."""
    numel = out.numel()
    if spec.fragments == 1:
        out.copy_(values)
        return
    index = selected(spec, numel).to(out.device)
    rows = _rows(out.clone()) if numel % BLOCK else out.view(-1, BLOCK)
    padded = torch.nn.functional.pad(values, (0, index.numel() * BLOCK - values.numel()))
    rows[index] = padded.view(-1, BLOCK)
    if numel % BLOCK:
        out.copy_(rows.view(-1)[:numel])


def _rows(vector: torch.Tensor) -> torch.Tensor:
    """``vector`` as (blocks, 64), the short last block padded with zeros."""
    pad = (-vector.numel()) % BLOCK
    if pad:
        vector = torch.nn.functional.pad(vector, (0, pad))
    return vector.view(-1, BLOCK)


def periods(values: torch.Tensor, spread: torch.Tensor | None) -> torch.Tensor:
    """The periods a sender uses for one vector: per block, ``2 · MARGIN · spread`` where
    ``spread`` (one float per block, NaN where unknown) is the largest difference last seen
    there, else four times the block's largest value; within [MIN_PERIOD, MAX_PERIOD]."""
    cold = _rows(values).abs().amax(dim=1).mul_(4.0)
    if spread is not None:
        warm = spread.to(cold.device, torch.float32) * (2.0 * MARGIN)
        cold = torch.where(torch.isnan(warm), cold, warm)
    cold = torch.nan_to_num(cold, nan=MAX_PERIOD, posinf=MAX_PERIOD)
    return cold.clamp_(MIN_PERIOD, MAX_PERIOD)


def _bf16_up(theta: torch.Tensor) -> torch.Tensor:
    """``theta`` (float32) as bfloat16 no smaller than it (but the largest one)."""
    rounded = theta.to(torch.bfloat16)
    low = rounded.float() < theta
    if bool(low.any()):
        bits = rounded.view(torch.int16)
        bits[low] += 1  # the next bfloat16 up, for positive values
    return rounded.clamp(max=MAX_PERIOD)


def encode(values: torch.Tensor, spec: Spec, theta: torch.Tensor,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """The cells of one vector of ``values`` (float32, any device) for ``spec``, as a CPU
    byte tensor of :func:`nbytes` bytes.

    Args:
        values: the vector to send (the state plus what rounding left out before).
        theta: the wanted period of each *selected* block (:func:`selected`), float32, each
            in [MIN_PERIOD, MAX_PERIOD]; each is rounded up to a bfloat16.
        residual: if given (a float32 vector like ``values``), its selected blocks are set to
            what rounding left out, ``values − n · step`` (error feedback); the others are
            left alone.
    """
    numel = values.numel()
    index = selected(spec, numel).to(values.device)
    if index.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    if theta.numel() != index.numel():
        raise ValueError(f"expected {index.numel()} periods, got {theta.numel()}")
    rows = _rows(values)[index]
    # A period at least 2^-16 of the block's largest value keeps every |n| below 2^20, an
    # exact float32 integer: a huge value in a tiny period would round to infinity.
    least = rows.abs().amax(dim=1).mul_(FLOOR)
    period = _bf16_up(torch.maximum(theta.to(values.device, torch.float32), least))
    width = period.float().unsqueeze(1)
    levels = torch.full((1,), spec.levels, dtype=torch.float32, device=values.device)
    step = width / levels
    n = torch.round(rows / step)
    codes = n - levels * torch.floor(n / levels)
    if residual is not None:
        left = rows - n * step
        flat = _rows(residual)
        flat[index] = left
        residual.copy_(flat.view(-1)[:numel])
    cells = torch.cat([period.view(torch.uint8).view(-1, PERIOD_BYTES).cpu(),
                       _pack(codes.to(torch.int64), spec.bits).cpu()], dim=1)
    tail = numel % BLOCK
    if tail and int(index[-1]) == blocks(numel) - 1:
        short = cells[-1, : spec.cell_bytes(tail)]
        return torch.cat([cells[:-1].reshape(-1), short])
    return cells.reshape(-1)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(rows, 64) codes < 2^bits as (rows, 8 · bits) bytes: 8 codes make ``bits`` bytes, the
    little-endian bytes of ``Σ c_i << (bits · i)``: the codes' bits, least significant first."""
    groups = codes.view(codes.shape[0], 8, 8)
    shifts = torch.arange(8, device=codes.device) * bits
    word = (groups << shifts).sum(dim=2)  # (rows, 8) < 2^24
    out = torch.stack([(word >> (8 * k)) & 0xFF for k in range(bits)], dim=2)
    return out.to(torch.uint8).view(codes.shape[0], 8 * bits)


def _unpack(data: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of :func:`_pack`: (rows, 8 · bits) bytes to (rows, 64) codes."""
    grouped = data.to(torch.int64).view(data.shape[0], 8, bits)
    shifts = torch.arange(bits, device=data.device) * 8
    word = (grouped << shifts).sum(dim=2)
    codes = (word.unsqueeze(2) >> (torch.arange(8, device=data.device) * bits)) & ((1 << bits) - 1)
    return codes.view(data.shape[0], BLOCK)


def decode_into(data: torch.Tensor, spec: Spec, reference: torch.Tensor,
                out: torch.Tensor) -> None:
    """Decode one vector's cells (``data``, a CPU byte tensor of :func:`nbytes` bytes) against
    the receiver's own values ``reference`` into ``out`` (float32, like ``reference``; the
    blocks not carried get ``reference``'s values).

    Raises:
        ValueError: a period that is not a positive normal finite bfloat16 of at least
            MIN_PERIOD, or ``data`` of the wrong size.
    """
    numel = reference.numel()
    if data.numel() != nbytes(spec, numel):
        raise ValueError(f"{data.numel()} bytes, expected {nbytes(spec, numel)}")
    out.copy_(reference)
    index = selected(spec, numel)
    if index.numel() == 0:
        return
    full = spec.cell_bytes(BLOCK)
    tail = numel % BLOCK
    short = bool(tail) and int(index[-1]) == blocks(numel) - 1
    whole = index.numel() - short
    cells = torch.zeros(index.numel(), full, dtype=torch.uint8)
    cells[:whole] = data[: whole * full].view(whole, full)
    if short:
        rest = data[whole * full:]
        cells[whole, : rest.numel()] = rest
    period = cells[:, :PERIOD_BYTES].contiguous().view(torch.bfloat16).view(-1).float()
    bad = ~((period >= MIN_PERIOD) & (period <= MAX_PERIOD))  # NaN fails both
    if bool(bad.any()):
        first = int(bad.nonzero()[0])
        raise ValueError(f"cell {first} has period {float(period[first])!r}: a period is a "
                         f"finite bfloat16 in [2^-100, {MAX_PERIOD:.4g}]")
    device = reference.device
    codes = _unpack(cells[:, PERIOD_BYTES:].to(device), spec.bits).to(torch.float32)
    width = period.to(device).unsqueeze(1)
    levels = torch.full((1,), spec.levels, dtype=torch.float32, device=device)
    v = codes * (width / levels)
    ref = _rows(reference)[index.to(device)]
    k = torch.round((ref - v) / width)
    lifted = v + k * width
    # Only a reference within θ/2 of float32's largest value can overflow here: clamp.
    lifted = torch.nan_to_num(lifted, posinf=_FLOAT_MAX, neginf=-_FLOAT_MAX)
    rows = _rows(out.clone()) if numel % BLOCK else out.view(-1, BLOCK)
    rows[index.to(device)] = lifted
    if numel % BLOCK:
        out.copy_(rows.view(-1)[:numel])


def ratio(spec: Spec, numel: int = 1 << 20) -> float:
    """Bytes of ``spec`` over ``fp32``'s for a vector of ``numel`` values (informative)."""
    return nbytes(spec, numel) / (4 * numel) if numel else math.nan
