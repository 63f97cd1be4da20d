"""The wire codecs of a flat state: what an exchange's payload is, byte for byte.

Theory of operation
-------------------
A flat state (:mod:`gossip.tensors`: one contiguous 1-D float32 tensor, :func:`check_flat`)
travels encoded with one of :data:`CODECS`. Three are element-wise: each element in order,
little-endian, as ``fp32`` (exact, 4 bytes), ``bf16`` or ``fp16`` (2 bytes, round to nearest
even). Finite values beyond a codec's largest finite value saturate to it (``fp16``: ±65504)
instead of becoming infinite; ±inf and NaN pass through unchanged so that the receiver's
:func:`~gossip.tensors.all_finite` check still sees them. The fourth, ``int8``, quantizes
blocks of 64 values to signed bytes against one float32 scale per block (about 1.06 bytes a
value, the codec for thin links; :mod:`gossip.int8` has its layout and error bound). Its
blocks never span two vectors of a payload, and a block holding NaN or ±inf decodes to NaNs,
so the same finiteness check still sees it. Big-endian hosts are refused.

The size of an encoding is known from the element count alone (:func:`encoded_nbytes`,
:meth:`StateSchema.encoded_size <gossip.schema.StateSchema.encoded_size>`), before a byte is
read. The encoding is streamed in records of whole elements (``int8``: of whole blocks of one
vector), never materialized: for ``fp32``, :func:`encode_chunks` hands out memoryviews of the
flat buffer itself (zero copies); for the other codecs it encodes one record at a time into a
reused scratch buffer. The receiver feeds records to a :class:`StateDecoder`, which knows the
exact payload size before it reads a byte and writes each record straight into its flat
float32 output; a node only ever decodes into the schema it already has, so nothing received
chooses a shape or a size.

Nothing here does I/O or imports trio; the functions are synchronous and CPU-heavy, so trio
code runs them in a thread (:mod:`gossip.transfer` sends and receives the records).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, NoReturn

import torch

from . import int8, lowbit
from .config import CODECS
from .errors import SchemaMismatch

if TYPE_CHECKING:
    from .schema import StateSchema

__all__ = ["CODECS", "StateDecoder", "itemsize", "encoded_nbytes", "encode_chunks", "check_flat",
           "known"]

# Element-wise wire codecs: name -> element dtype. Each element is little-endian on the wire.
_CODEC_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Every wire codec is named in gossip.config.CODECS, which the averaging.codec setting checks;
# "int8" is blockwise (gossip.int8), so it has no dtype above.
assert CODECS == (*_CODEC_DTYPES, "int8"), "gossip.config.CODECS and the encoders differ"


def known(codec: object) -> bool:
    """Whether ``codec`` names a wire codec: one of :data:`CODECS` or a ``mod`` codec
    (:mod:`gossip.lowbit`, with its fragment: ``mod4``, ``mod4/8:3``)."""
    return codec in CODECS or lowbit.is_lowbit(codec)


def itemsize(codec: str) -> int:
    """Bytes per element of an element-wise ``codec`` on the wire. Sizes of payloads come
    from :func:`encoded_nbytes`, which knows ``int8`` too.

    Raises:
        ValueError: ``codec`` is not one of :data:`CODECS`, or is ``int8``, whose blocks have
            no whole number of bytes per element.
    """
    dtype = _codec_dtype(codec)
    if dtype is None:
        raise ValueError(f"codec {codec!r} has no fixed size per element; "
                         "use encoded_nbytes(codec, numel)")
    return dtype.itemsize


def encoded_nbytes(codec: str, numel: int, parts: int = 1) -> int:
    """Exact size in bytes of ``parts`` vectors of ``numel`` elements each, encoded back to
    back with ``codec`` (for ``int8`` each vector is blocked on its own).

    Raises:
        ValueError: unknown codec, or a negative or non-integer ``numel`` or ``parts``.
    """
    spec = lowbit.parse(codec) if lowbit.is_lowbit(codec) else None
    dtype = None if spec is not None else _codec_dtype(codec)
    for name, value in (("numel", numel), ("parts", parts)):
        if type(value) is not int or value < 0:
            raise ValueError(f"{name} must be a non-negative int, not {value!r}")
    if spec is not None:
        return lowbit.payload_nbytes(spec, numel, parts) if parts else 0
    return parts * (int8.nbytes(numel) if dtype is None else numel * dtype.itemsize)


def _codec_dtype(codec: str) -> torch.dtype | None:
    """The element dtype of ``codec``, None for ``int8``."""
    if codec == "int8":
        return None
    try:
        return _CODEC_DTYPES[codec]
    except (KeyError, TypeError):
        raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}") from None


def _require_little_endian() -> None:
    if sys.byteorder != "little":
        raise RuntimeError(
            "gossip.tensors encodes tensors as little-endian bytes and does not support "
            f"this {sys.byteorder}-endian host"
        )


def check_flat(flat: torch.Tensor, schema: StateSchema | None = None) -> None:
    """Check that ``flat`` is a flat state: a contiguous 1-D float32 tensor (of
    ``schema.numel`` elements, if ``schema`` is given).

    Raises:
        ValueError: ``flat`` is not a contiguous 1-D float32 tensor.
        SchemaMismatch: it has the wrong number of elements.
    """
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.float32 or flat.dim() != 1:
        raise ValueError("a flat state must be a 1-D float32 tensor")
    if not flat.is_contiguous():
        raise ValueError("a flat state must be contiguous")
    if schema is not None and flat.numel() != schema.numel:
        raise SchemaMismatch(f"flat state has {flat.numel()} elements, schema has {schema.numel}")


def _host_view(t: torch.Tensor) -> memoryview:
    """A writable byte memoryview aliasing a contiguous CPU tensor's memory (zero-copy).

    Goes through numpy, which shares the tensor's memory and keeps it alive, so the view stays
    valid after the caller drops ``t``. numpy has no bfloat16: such tensors are viewed as int16.
    """
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return memoryview(t.detach().numpy()).cast("B")


def encode_chunks(
    flat: torch.Tensor, codec: str, max_record: int = 1 << 20, *, parts: int = 1,
    generator: torch.Generator | None = None,
) -> Iterator[memoryview]:
    """Stream the ``codec`` encoding of a flat state as records of whole elements.

    The concatenation of the records is the encoding of ``flat``, :func:`encoded_nbytes`
    ``(codec, flat.numel() // parts, parts)`` bytes. For an element-wise codec each record
    holds ``max_record // itemsize(codec)`` elements except possibly the last; for ``int8``
    each holds ``max_record // 68`` whole blocks of one of the ``parts`` vectors, except
    possibly the last of each vector, which ends with its short block if it has one. For
    ``fp32`` and a CPU ``flat`` the records are read-only views of ``flat`` itself: no copy,
    and ``flat`` must not change until they are sent. Otherwise each record is a view of one
    scratch buffer that the next record overwrites: it is valid only until the next is
    requested.

    Args:
        flat: a contiguous 1-D float32 tensor (a CPU buffer from
            :func:`~gossip.tensors.new_flat` or :func:`~gossip.tensors.snapshot`; a device
            tensor works, one record-sized copy at a time).
        codec: one of :data:`CODECS`.
        max_record: the largest record in bytes; at least one element (``int8``: one whole
            block, 68 bytes).
        parts: how many vectors of equal size ``flat`` holds back to back; only ``int8``
            encodes them differently from one long vector.
        generator: ``int8`` only: round stochastically with it (:func:`gossip.int8.dither`),
            as exchanges do; without it, to nearest (the same bytes every time).

    Returns:
        An iterator of byte memoryviews, each at most ``max_record`` bytes long.

    Raises:
        ValueError: unknown codec, ``max_record`` smaller than one element, ``parts`` not a
            positive int dividing ``flat``'s size, or ``flat`` not a contiguous 1-D float32
            tensor.
        RuntimeError: a big-endian host.
    """
    _require_little_endian()
    check_flat(flat)
    if type(parts) is not int or parts < 1 or flat.numel() % parts:
        raise ValueError(f"parts must be a positive int dividing {flat.numel()}, not {parts!r}")
    if lowbit.is_lowbit(codec):
        if type(max_record) is not int or max_record < 1:
            raise ValueError(f"max_record must be an int >= 1, not {max_record!r}")
        return _records(lowbit_payload(flat, codec, parts), max_record)
    dtype = _codec_dtype(codec)
    least = int8.CELL if dtype is None else dtype.itemsize
    if type(max_record) is not int or max_record < least:
        raise ValueError(f"max_record must be an int >= {least}, not {max_record!r}")
    if dtype is None:
        return int8.encode(flat, parts, max_record, generator)
    return _encode(flat, dtype, max_record // dtype.itemsize)


def lowbit_payload(flat: torch.Tensor, codec: str, parts: int = 1,
                   spreads: list[torch.Tensor | None] | None = None,
                   residual: torch.Tensor | None = None) -> torch.Tensor:
    """The whole ``mod`` payload of ``parts`` vectors of ``flat`` (a CPU byte tensor): the
    state's cells (:func:`gossip.lowbit.encode`), then each later vector's carried blocks as
    ``int8`` cells, rounded stochastically.

    Args:
        spreads: ``[spread]``: the largest difference last seen in each block of the state
            (:func:`gossip.lowbit.periods`), or None: periods from the values alone.
        residual: the state's error feedback (its first ``numel`` values are used): added to
            the state sent, and set, on the blocks sent, to what rounding left out of them.
    """
    spec = lowbit.parse(codec)
    numel = flat.numel() // parts
    state = flat[:numel]
    values = state if residual is None else state + residual[:numel]
    spread = None if spreads is None else spreads[0]
    theta = lowbit.periods(values, spread)[lowbit.selected(spec, numel).to(values.device)]
    out = [lowbit.encode(values, spec, theta, None if residual is None else residual[:numel])]
    for index in range(1, parts):
        # The estimate: int8 cells of the same blocks, rounded stochastically as int8 is in
        # exchanges (gossip.lowbit: a gradient is not close to the receiver's own).
        carried = lowbit.gather(flat[index * numel : (index + 1) * numel], spec).contiguous()
        if carried.numel():
            size = int8.nbytes(carried.numel())
            out.extend(torch.frombuffer(bytearray(record), dtype=torch.uint8) for record in
                       int8.encode(carried, 1, max(size, int8.CELL), int8.dither(flat.device)))
    return torch.cat(out) if out else torch.empty(0, dtype=torch.uint8)


def _records(payload: torch.Tensor, max_record: int) -> Iterator[memoryview]:
    """``payload`` (a CPU byte tensor) as read-only views of at most ``max_record`` bytes."""
    view = _host_view(payload).toreadonly()
    for start in range(0, len(view), max_record):
        yield view[start : start + max_record]


def _encode(flat: torch.Tensor, dtype: torch.dtype, per: int) -> Iterator[memoryview]:
    total, size = flat.numel(), dtype.itemsize
    if total == 0:
        return
    if dtype == torch.float32 and flat.device.type == "cpu":
        view = _host_view(flat).toreadonly()
        for start in range(0, total, per):
            yield view[start * 4 : min(start + per, total) * 4]
        return
    scratch = torch.empty(min(per, total), dtype=dtype)
    scratch_view = _host_view(scratch).toreadonly()
    limit = torch.finfo(dtype).max
    for start in range(0, total, per):
        n = min(per, total - start)
        src, out = flat[start : start + n], scratch[:n]
        out.copy_(src)
        # The cast turns values beyond the codec's range into ±inf. Every |x| is at most the
        # chunk's norm, so a norm within range rules that out in one fast pass (it can only
        # err towards the exact check below: NaN, inf, or one large value).
        if dtype != torch.float32 and not float(torch.dot(src, src)) <= limit * limit:
            src = src.cpu()
            over = out.isinf() & src.isfinite()
            out[over] = src[over].clamp(-limit, limit).to(dtype)
        yield scratch_view[: n * size]


class _Received:
    """How much of a payload of known size has come: the part both decoders share."""

    total_bytes: int
    _received: int

    @property
    def remaining_bytes(self) -> int:
        """Bytes still expected."""
        return self.total_bytes - self._received

    @property
    def done(self) -> bool:
        """Whether the whole payload has been fed."""
        return self._received == self.total_bytes


class StateDecoder(_Received):
    """Decode a streamed ``codec`` payload for ``schema`` into a flat float32 buffer.

    The payload size, :func:`encoded_nbytes`, is known before anything is read, so a caller
    can bound every read by :attr:`remaining_bytes`. A record is either handed over
    (:meth:`feed`) or written by the caller where :meth:`window` says (then :meth:`wrote`),
    which for ``fp32`` into host memory is the output itself. Writable ``bf16``/``fp16``
    records are cast straight into the output; a read-only one (``bytes``) is first copied
    into a record-sized scratch buffer, because torch cannot view read-only memory. ``int8``
    records always pass through that scratch buffer (and, for a device output, one
    record-sized buffer on the device) and are dequantized from it into the output.

    A record must hold whole elements; for ``int8``, whole blocks of one vector of the
    payload (:func:`gossip.int8.span`); and at least :data:`~gossip.lowbit.MIN_RECORD` bytes
    unless it ends one of the ``parts`` vectors (the payload's last record does). Any values decode: what they are is for the caller's
    checks (:func:`~gossip.tensors.all_finite`, norms) to judge.

    Not thread-safe; one decoder per payload. After a :class:`SchemaMismatch` the decoder is
    failed and every later call raises again.

    Args:
        schema: the local schema; nothing received can change the size or shape.
        codec: one of :data:`CODECS`.
        out: the flat float32 buffer to fill (contiguous, ``parts × schema.numel``
            elements, any device); a new one if omitted.
        parts: how many vectors of the schema's size the payload holds, back to back.
        min_record: the fewest bytes a record that ends no vector may hold (records cut
            finer only to test how cells and elements are put together: 1).

    Raises:
        ValueError: unknown codec, or ``out`` is not a contiguous 1-D float32 tensor.
        SchemaMismatch: ``out`` has the wrong number of elements.
        RuntimeError: a big-endian host.
    """

    def __init__(self, schema: StateSchema, codec: str, out: torch.Tensor | None = None, *,
                 parts: int = 1, min_record: int = lowbit.MIN_RECORD) -> None:
        _require_little_endian()
        self._dtype = _codec_dtype(codec)  # None: int8
        self._min_record = min_record
        if type(parts) is not int or parts < 1:
            raise ValueError(f"parts must be an int >= 1, not {parts!r}")
        if out is None:
            out = torch.zeros(parts * schema.numel, dtype=torch.float32)
        check_flat(out)
        if out.numel() != parts * schema.numel:
            raise SchemaMismatch(f"flat buffer has {out.numel()} elements, {parts} part(s) of "
                                 f"the schema have {parts * schema.numel}")
        self._out = out
        self._codec = codec
        self._numel = schema.numel
        self.total_bytes = encoded_nbytes(codec, schema.numel, parts)
        self._vector_bytes = max(encoded_nbytes(codec, schema.numel, 1), 1)
        self._received = 0
        self._decoded = 0  # int8: the end of the last dequantized record
        self._error: str | None = None
        # Records to cast, copy over or dequantize: int8 ones are bytes.
        self._scratch = torch.empty(0, dtype=self._dtype or torch.uint8)
        self._scratch_view = memoryview(b"")
        self._window = 0  # bytes of scratch the last window() offered
        fp32_host = self._dtype == torch.float32 and self._out.device.type == "cpu"
        self._out_view = _host_view(self._out) if fp32_host and out.numel() else None
        # int8 into a device output: each record is copied over, then dequantized there.
        self._device_scratch = (torch.empty(0, dtype=torch.uint8, device=out.device)
                                if self._dtype is None and out.device.type != "cpu" else None)

    @property
    def decoded(self) -> int:
        """How many leading elements of the output hold their final values."""
        if self._dtype is not None:
            return self._received // self._dtype.itemsize
        return self._decoded

    def feed(self, record: bytes | bytearray | memoryview) -> None:
        """Decode one record (a whole number of elements) into the output.

        Raises:
            SchemaMismatch: the record is not a whole number of elements (``int8``: whole
                blocks of one vector), it runs past the expected size, or the decoder
                already failed.
            TypeError: ``record`` is not a contiguous bytes-like object.
        """
        data = memoryview(record).cast("B")
        nbytes = len(data)
        place = self._check_record(nbytes)
        if nbytes == 0:
            return
        if self._out_view is not None:
            self._out_view[self._received : self._received + nbytes] = data
        elif self._dtype is None:
            self._grow_scratch(nbytes)
            self._scratch_view[:nbytes] = data
            self._dequantize(nbytes, place)
        else:
            size = self._dtype.itemsize
            start, n = self._received // size, nbytes // size
            self._out[start : start + n].copy_(self._as_tensor(data, n))
        self._received += nbytes

    def window(self, limit: int) -> memoryview | None:
        """Where the next record, of at most ``limit`` bytes, can be written directly (say by
        ``SecureChannel.receive_into``), to be followed by :meth:`wrote`: the output itself for
        ``fp32`` into host memory (no intermediate copy at all), else a record-sized scratch
        buffer that :meth:`wrote` casts, copies or dequantizes into the output. None once the
        decoder has failed."""
        if self._error is not None:
            return None
        if self._out_view is not None:
            return self._out_view[self._received : self._received + limit]
        nbytes = min(limit, self.remaining_bytes)
        self._grow_scratch(-(-nbytes // self._scratch.itemsize))
        self._window = nbytes
        return self._scratch_view[:nbytes]

    def wrote(self, nbytes: int) -> None:
        """Account for a record of ``nbytes`` written into :meth:`window`, with the checks of
        :meth:`feed`, and decode it.

        Raises:
            SchemaMismatch: as :meth:`feed`.
            ValueError: more bytes than the last window held.
        """
        place = self._check_record(nbytes)
        if self._out_view is None:
            if nbytes > self._window:
                raise ValueError(f"wrote {nbytes} bytes into a window of {self._window}")
            self._window = 0
            if self._dtype is None:
                self._dequantize(nbytes, place)
            else:
                size = self._dtype.itemsize
                start, n = self._received // size, nbytes // size
                self._out[start : start + n].copy_(self._scratch[:n])
        self._received += nbytes

    def _check_record(self, nbytes: int) -> tuple[int, int, int]:
        """The size checks of a record; for a non-empty ``int8`` one, where it lands
        (:func:`gossip.int8.span`), else ``(0, 0, 0)``."""
        self._check_ok()
        if self._dtype is not None and nbytes % self._dtype.itemsize:
            self._fail(f"record of {nbytes} bytes is not whole {self._codec} elements")
        if nbytes > self.remaining_bytes:
            self._fail(f"record of {nbytes} bytes exceeds the {self.remaining_bytes} bytes "
                       f"remaining of a {self.total_bytes}-byte payload")
        if nbytes == 0:
            if self.total_bytes:
                # A record carries at least one element; empty ones would only let a peer
                # spin our receive loop until the caller's deadline.
                self._fail("empty record in a tensor payload")
            return (0, 0, 0)
        end = self._received + nbytes
        if nbytes < self._min_record and end % self._vector_bytes:
            self._fail(f"record of {nbytes} bytes, not a vector's last, under the "
                       f"{self._min_record} bytes a data record holds at the least")
        if self._dtype is not None:
            return (0, 0, 0)
        try:
            return int8.span(self._numel, self._received, nbytes)
        except ValueError as exc:
            self._fail(str(exc))

    def _dequantize(self, nbytes: int, place: tuple[int, int, int]) -> None:
        start, blocks, tail = place
        record = self._scratch[:nbytes]
        if self._device_scratch is not None:
            if self._device_scratch.numel() < nbytes:
                self._device_scratch = torch.empty(self._scratch.numel(), dtype=torch.uint8,
                                                   device=self._out.device)
            record = self._device_scratch[:nbytes]
            record.copy_(self._scratch[:nbytes])
        int8.decode_into(record, self._out[start : start + blocks * int8.BLOCK + tail],
                         blocks, tail)
        self._decoded = start + blocks * int8.BLOCK + tail

    def _as_tensor(self, data: memoryview, n: int) -> torch.Tensor:
        if not data.readonly:
            return torch.frombuffer(data, dtype=self._dtype)
        self._grow_scratch(n)
        self._scratch_view[: len(data)] = data
        return self._scratch[:n]

    def _grow_scratch(self, n: int) -> None:
        if self._scratch.numel() < n:
            self._scratch = torch.empty(n, dtype=self._scratch.dtype)
            self._scratch_view = _host_view(self._scratch)

    def result(self) -> torch.Tensor:
        """The decoded flat float32 state.

        Raises:
            SchemaMismatch: the payload is incomplete, or the decoder failed.
        """
        self._check_ok()
        if not self.done:
            raise SchemaMismatch(f"incomplete payload: {self._received} of {self.total_bytes}")
        return self._out

    def _check_ok(self) -> None:
        if self._error is not None:
            raise SchemaMismatch(f"decoder already failed: {self._error}")

    def _fail(self, message: str) -> NoReturn:
        self._error = message
        raise SchemaMismatch(message)


class LowbitDecoder(_Received):
    """Decode a ``mod`` payload (:mod:`gossip.lowbit`) against the receiver's own vectors.

    The interface of :class:`StateDecoder` (:meth:`feed`, :meth:`window` and :meth:`wrote`,
    :attr:`remaining_bytes`, :attr:`done`, :meth:`result`), but records may cut the payload
    anywhere, each of at least :data:`~gossip.lowbit.MIN_RECORD` bytes but the last (a
    shorter one fails the decoder): it is a few bytes a value, so it is gathered whole and
    decoded by :meth:`finish` once the ``reference`` (the receiver's own payload, ``parts``
    vectors of the schema, not changed) is final. Until then :attr:`decoded` is 0.

    Raises:
        ValueError: ``codec`` is not a ``mod`` codec, or ``reference`` and ``out`` are not
            contiguous 1-D float32 tensors of ``parts`` vectors of the schema.
    """

    def __init__(self, schema: StateSchema, codec: str, reference: torch.Tensor,
                 out: torch.Tensor | None = None, *, parts: int = 1) -> None:
        self._spec = lowbit.parse(codec)
        if type(parts) is not int or parts < 1:
            raise ValueError(f"parts must be an int >= 1, not {parts!r}")
        if out is None:
            out = torch.zeros(parts * schema.numel, dtype=torch.float32)
        for name, tensor in (("out", out), ("reference", reference)):
            check_flat(tensor)
            if tensor.numel() != parts * schema.numel:
                raise SchemaMismatch(f"{name} has {tensor.numel()} elements, {parts} part(s) of "
                                     f"the schema have {parts * schema.numel}")
        self._out, self._reference = out, reference
        self._numel, self._parts = schema.numel, parts
        self.total_bytes = encoded_nbytes(codec, schema.numel, parts)
        self._payload = torch.empty(self.total_bytes, dtype=torch.uint8)
        self._view = _host_view(self._payload) if self.total_bytes else memoryview(bytearray())
        self._received = 0
        self._window = 0  # bytes the last window() offered
        self._finished = False
        self._error: str | None = None

    @property
    def decoded(self) -> int:
        return self._parts * self._numel if self._finished else 0

    def feed(self, record: bytes | bytearray | memoryview) -> None:
        data = memoryview(record).cast("B")
        self._check(len(data))
        self._view[self._received : self._received + len(data)] = data
        self._received += len(data)

    def window(self, limit: int) -> memoryview | None:
        if self._error is not None:
            return None
        self._window = min(limit, self.remaining_bytes)
        return self._view[self._received : self._received + self._window]

    def wrote(self, nbytes: int) -> None:
        self._check(nbytes)
        if nbytes > self._window:
            raise ValueError(f"wrote {nbytes} bytes into a window of {self._window}")
        self._window = 0
        self._received += nbytes

    def _check(self, nbytes: int) -> None:
        if self._error is not None:
            raise SchemaMismatch(f"decoder already failed: {self._error}")
        if nbytes > self.remaining_bytes or (nbytes == 0 and self.total_bytes):
            self._error = (f"record of {nbytes} bytes with {self.remaining_bytes} of a "
                           f"{self.total_bytes}-byte payload remaining")
            raise SchemaMismatch(self._error)
        if nbytes < lowbit.MIN_RECORD and nbytes != self.remaining_bytes:
            self._error = (f"record of {nbytes} bytes, not the payload's last, under the "
                           f"{lowbit.MIN_RECORD} bytes a mod record holds at the least")
            raise SchemaMismatch(self._error)

    def finish(self) -> None:
        """Decode the whole payload against the reference (CPU-heavy: in a thread).

        Raises:
            SchemaMismatch: the payload is incomplete, or a cell's period is refused.
        """
        if not self.done:
            raise SchemaMismatch(f"incomplete payload: {self._received} of {self.total_bytes}")
        if self._finished:
            return
        spec, numel = self._spec, self._numel
        size = lowbit.nbytes(spec, numel)
        try:
            lowbit.decode_into(self._payload[:size], spec, self._reference[:numel],
                               self._out[:numel])
        except ValueError as exc:
            self._error = f"vector 0: {exc}"
            raise SchemaMismatch(self._error) from None
        rest = lowbit.estimate_nbytes(spec, numel)
        for index in range(1, self._parts):
            part = slice(index * numel, (index + 1) * numel)
            self._out[part].copy_(self._reference[part])
            carried = lowbit.gather(self._reference[part], spec).clone()
            if carried.numel():
                start = size + (index - 1) * rest
                # A copy: int8 cells are read as float32 scales, which must be 4-byte aligned.
                record = self._payload[start : start + rest].to(carried.device, copy=True)
                blocks_, tail = divmod(carried.numel(), int8.BLOCK)
                int8.decode_into(record, carried, blocks_, tail)
                lowbit.scatter(carried, spec, self._out[part])
        self._finished = True

    def result(self) -> torch.Tensor:
        """The decoded flat state (:meth:`finish` first).

        Raises:
            SchemaMismatch: not finished, or failed.
        """
        if self._error is not None:
            raise SchemaMismatch(f"decoder already failed: {self._error}")
        if not self._finished:
            raise SchemaMismatch("a mod payload is decoded by finish() against the reference")
        return self._out
