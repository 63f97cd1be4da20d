"""A model's state as one flat buffer, and the codecs that put it on the wire.

Theory of operation
-------------------
Averaging works on *states*: the floating-point entries of ``module.state_dict()`` (parameters
and float buffers such as BatchNorm's running statistics), in ``state_dict()`` order. Integer
and bool buffers (``num_batches_tracked``) are counters, not weights: they are never averaged
and are not part of the state. Tied weights (two names viewing the same memory, as nanoGPT ties
``wte`` and ``lm_head``) appear once, under the first name, so a delta is never added twice.

A :class:`StateSchema` lists those entries (name, shape, dtype). Both sides of an exchange
compare its 16-byte :attr:`StateSchema.fingerprint` before sending anything, and a node only
ever decodes into the schema it already has: nothing received chooses a shape or a size.

On the host the state lives in one flat, contiguous, 1-D float32 tensor (:func:`new_flat`),
whatever the dtypes and devices of the live tensors. :func:`snapshot` fills it from the model
(device to host, cast to float32), :func:`load_` copies it back and :func:`add_` adds a flat
delta into the live tensors in place; the float32 delta is added in the live tensor's dtype
with a single rounding.

The wire encoding of a flat buffer is one of :data:`CODECS`. Three are element-wise: each
element in order, little-endian, as ``fp32`` (exact, 4 bytes), ``bf16`` or ``fp16`` (2 bytes,
round to nearest even). Finite values beyond a codec's largest finite value saturate to it
(``fp16``: ±65504) instead of becoming infinite; ±inf and NaN pass through unchanged so that
the receiver's :func:`all_finite` check still sees them. The fourth, ``int8``, quantizes
blocks of 64 values to signed bytes against one float32 scale per block (about 1.06 bytes a
value, the codec for thin links; :mod:`gossip.int8` has its layout and error bound). Its
blocks never span two vectors of a payload, and a block holding NaN or ±inf decodes to NaNs,
so the same finiteness check still sees it. Big-endian hosts are refused.

The size of an encoding is known from the element count alone (:func:`encoded_nbytes`,
:meth:`StateSchema.encoded_size`), before a byte is read. The encoding is streamed in
records of whole elements (``int8``: of whole blocks of one vector), never materialized: for
``fp32``, :func:`encode_chunks` hands out memoryviews of the flat buffer itself (zero
copies); for the other codecs it encodes one record at a time into a reused scratch buffer.
The receiver feeds records to a :class:`StateDecoder`, which knows the exact payload size
before it reads a byte and writes each record straight into its flat float32 output.

Memory for one exchange: the local snapshot and the received state, two float32 copies of the
model (the delta is then computed in place in the received buffer). Nothing here does I/O or
imports trio; the functions are synchronous and CPU-heavy, so trio code runs them in a thread.
"""

from __future__ import annotations

import hashlib
import math
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import NoReturn, Union

import cbor2
import torch

from . import int8
from .config import CODECS
from .errors import SchemaMismatch

__all__ = [
    "CODECS", "DTYPES", "TensorSpec", "StateSchema", "StateDecoder", "itemsize",
    "encoded_nbytes", "new_flat", "snapshot", "unflatten", "add_", "load_", "live", "views",
    "encode_chunks",
    "all_finite", "norm", "sum_of_squares", "REDUCE_CHUNK",
]

# Element-wise wire codecs: name -> element dtype. Each element is little-endian on the wire.
_CODEC_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Every wire codec is named in gossip.config.CODECS, which the averaging.codec setting checks;
# "int8" is blockwise (gossip.int8), so it has no dtype above.
assert CODECS == (*_CODEC_DTYPES, "int8"), "gossip.config.CODECS and the encoders differ"

# Dtypes a schema entry may have, by the name the fingerprint uses.
_DTYPES = {str(d).removeprefix("torch."): d
           for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}
DTYPES: tuple[str, ...] = tuple(_DTYPES)

# Chunk size (elements) for the reductions: their temporaries stay small, and a chunk (1 MiB
# of float32) stays in cache from one operation on it to the next.
REDUCE_CHUNK = 1 << 18

Target = Union[torch.nn.Module, Mapping[str, torch.Tensor]]


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
    dtype = _codec_dtype(codec)
    for name, value in (("numel", numel), ("parts", parts)):
        if type(value) is not int or value < 0:
            raise ValueError(f"{name} must be a non-negative int, not {value!r}")
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


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One entry of a state: its ``state_dict`` name, shape and dtype name (``"float32"``).

    Raises:
        ValueError: empty name, a negative or non-integer dimension, or a dtype that is not
            one of :data:`DTYPES`.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"tensor name must be a non-empty string, not {self.name!r}")
        shape = tuple(self.shape)
        if any(type(d) is not int or d < 0 for d in shape):
            raise ValueError(f"{self.name}: dimensions must be non-negative ints, not {shape}")
        object.__setattr__(self, "shape", shape)
        if self.dtype not in _DTYPES:
            raise ValueError(f"{self.name}: dtype {self.dtype!r} is not one of {DTYPES}")

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class StateSchema:
    """The float entries of a model's state, in the order they lie in the flat buffer.

    Attributes:
        entries: the entries, in ``state_dict()`` order.
        numel: total number of elements.
        fingerprint: 16 bytes that name the schema on the wire (cited by docs/PROTOCOL.md):
            the first 16 bytes of SHA-256 over the canonical CBOR (RFC 8949 section 4.2.1)
            encoding of an array holding, per entry in order, the 3-element array [name as a
            text string, shape as an array of unsigned integers (empty for a scalar), dtype
            name as a text string, one of "float16", "bfloat16", "float32", "float64"], i.e.
            ``cbor2.dumps([[name, list(shape), dtype], ...], canonical=True)``. Test vector:
            the single entry ("w", (2, 3), "float32") encodes as 81 83 61 77 82 02 03 67
            66 6c 6f 61 74 33 32, fingerprint 9679fd51f362229c65de22dd47d2b393.

    Raises:
        ValueError: two entries share a name.
    """

    entries: tuple[TensorSpec, ...]
    numel: int = field(init=False, compare=False)
    fingerprint: bytes = field(init=False, compare=False, repr=False)
    _offsets: tuple[int, ...] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        entries = tuple(self.entries)
        object.__setattr__(self, "entries", entries)
        names = [e.name for e in entries]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"duplicate tensor name {dup!r} in schema")
        offsets, total = [], 0
        for e in entries:
            offsets.append(total)
            total += e.numel
        object.__setattr__(self, "_offsets", tuple(offsets))
        object.__setattr__(self, "numel", total)
        canon = cbor2.dumps([[e.name, list(e.shape), e.dtype] for e in entries], canonical=True)
        object.__setattr__(self, "fingerprint", hashlib.sha256(canon).digest()[:16])

    @property
    def fingerprint_hex(self) -> str:
        """:attr:`fingerprint` as 32 lowercase hex digits (for logs and config)."""
        return self.fingerprint.hex()

    def places(self) -> dict[str, slice]:
        """Where each entry lies in the flat buffer, by name."""
        return {e.name: slice(offset, offset + e.numel)
                for e, offset in zip(self.entries, self._offsets)}

    def encoded_size(self, codec: str) -> int:
        """Exact size in bytes of the state encoded with ``codec``.

        Raises:
            ValueError: unknown codec.
        """
        return encoded_nbytes(codec, self.numel)

    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, object]) -> StateSchema:
        """The schema of the floating-point tensors of ``state_dict``, in its order.

        Non-tensor values and integer or bool tensors are skipped; a tensor that views exactly
        the same memory as an earlier one (a tied weight) is skipped too.

        Raises:
            ValueError: a floating-point tensor has a dtype outside :data:`DTYPES`.
        """
        return cls(tuple(_spec(n, t) for n, t in _float_items(state_dict)))

    @classmethod
    def from_module(cls, module: torch.nn.Module) -> StateSchema:
        """The schema of ``module.state_dict()``; see :meth:`from_state_dict`."""
        return cls.from_state_dict(module.state_dict())


def _spec(name: str, t: torch.Tensor) -> TensorSpec:
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise ValueError(f"{name}: dtype {dtype} is not supported; expected one of {DTYPES}")
    return TensorSpec(name, tuple(t.shape), dtype)


def _float_items(state_dict: Mapping[str, object]) -> list[tuple[str, torch.Tensor]]:
    items, seen = [], set()
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            continue
        if t.numel() and t.device.type != "meta":
            key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
            if key in seen:
                continue  # tied weight: same memory under a second name
            seen.add(key)
        items.append((name, t))
    return items


def _tensors(target: Target, schema: StateSchema,
             flat: torch.Tensor | None) -> list[torch.Tensor]:
    """The live tensors of ``target`` in schema order, after checking them and ``flat``."""
    if isinstance(target, torch.nn.Module):
        target = target.state_dict()
    elif not isinstance(target, Mapping):
        raise TypeError(f"expected a torch.nn.Module or a state dict, not {type(target).__name__}")
    items = _float_items(target)
    if len(items) != len(schema.entries):
        raise SchemaMismatch(f"model has {len(items)} float tensors, schema has "
                             f"{len(schema.entries)} ({schema.fingerprint_hex})")
    for (name, t), spec in zip(items, schema.entries):
        if _spec(name, t) != spec:
            raise SchemaMismatch(f"model tensor {_spec(name, t)} does not match schema {spec}")
    if flat is not None:
        _check_flat(flat, schema)
    return [t for _, t in items]


def _check_flat(flat: torch.Tensor, schema: StateSchema | None = None) -> None:
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


def new_flat(schema: StateSchema, pin_memory: bool = False) -> torch.Tensor:
    """A new flat buffer for ``schema``: a 1-D float32 CPU tensor of ``schema.numel`` zeros.

    Page-locked (faster device copies) when ``pin_memory`` is true and CUDA is available. Any
    contiguous CPU float32 tensor of the right size works as a flat buffer, pinned or not:
    :func:`encode_chunks` aliases its memory, so no ``bytearray`` is needed.
    """
    pin = pin_memory and torch.cuda.is_available()
    return torch.zeros(schema.numel, dtype=torch.float32, pin_memory=pin)


def snapshot(target: Target, schema: StateSchema, out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy the float entries of a model (any devices, any float dtypes) into a flat buffer.

    Args:
        target: a module or a state dict; must match ``schema``.
        schema: the local schema.
        out: the flat buffer to fill; a new one from :func:`new_flat` if omitted.

    Returns:
        The filled flat buffer.

    Raises:
        SchemaMismatch: the model or ``out`` does not match ``schema``.
    """
    flat = new_flat(schema) if out is None else out
    tensors = _tensors(target, schema, flat)
    with torch.no_grad():
        for t, view in zip(tensors, _views(flat, schema)):
            view.copy_(t)
    return flat


def unflatten(flat: torch.Tensor, schema: StateSchema) -> dict[str, torch.Tensor]:
    """Views of ``flat`` shaped as the schema's entries, by name (float32, sharing memory).

    Raises:
        SchemaMismatch: ``flat`` has the wrong number of elements.
    """
    _check_flat(flat, schema)
    return {spec.name: view for spec, view in zip(schema.entries, _views(flat, schema))}


def _views(flat: torch.Tensor, schema: StateSchema) -> Iterator[torch.Tensor]:
    for spec, offset in zip(schema.entries, schema._offsets):
        yield flat[offset : offset + spec.numel].view(spec.shape)


def live(target: Target, schema: StateSchema) -> list[torch.Tensor]:
    """The model's live float tensors, in schema order (the tensors :func:`snapshot` reads).

    Raises:
        SchemaMismatch: the model does not match ``schema``.
    """
    return _tensors(target, schema, None)


def views(flat: torch.Tensor, schema: StateSchema) -> list[torch.Tensor]:
    """The schema's entries as views of a flat buffer, shaped as the live tensors."""
    _check_flat(flat, schema)
    return list(_views(flat, schema))


def add_(target: Target, schema: StateSchema, delta: torch.Tensor, alpha: float = 1.0) -> None:
    """Add ``alpha`` times a flat float32 delta into the model's live tensors, in place.

    Each slice moves to its tensor's device and is added in float32 (float64 for float64
    tensors), rounding once into the tensor's dtype. Runs under ``torch.no_grad()``.

    Raises:
        SchemaMismatch: the model or ``delta`` does not match ``schema``.
    """
    tensors = _tensors(target, schema, delta)
    with torch.no_grad():
        for t, view in zip(tensors, _views(delta, schema)):
            t.add_(view.to(t.device), alpha=alpha)


def load_(target: Target, schema: StateSchema, flat: torch.Tensor) -> None:
    """Copy a flat state into the model's live tensors, in place (cast to each dtype).

    Raises:
        SchemaMismatch: the model or ``flat`` does not match ``schema``.
    """
    tensors = _tensors(target, schema, flat)
    with torch.no_grad():
        for t, view in zip(tensors, _views(flat, schema)):
            t.copy_(view)


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
        flat: a contiguous 1-D float32 tensor (a CPU buffer from :func:`new_flat` or
            :func:`snapshot`; a device tensor works, one record-sized copy at a time).
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
    dtype = _codec_dtype(codec)
    _check_flat(flat)
    if type(parts) is not int or parts < 1 or flat.numel() % parts:
        raise ValueError(f"parts must be a positive int dividing {flat.numel()}, not {parts!r}")
    least = int8.CELL if dtype is None else dtype.itemsize
    if type(max_record) is not int or max_record < least:
        raise ValueError(f"max_record must be an int >= {least}, not {max_record!r}")
    if dtype is None:
        return int8.encode(flat, parts, max_record, generator)
    return _encode(flat, dtype, max_record // dtype.itemsize)


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


class StateDecoder:
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
    payload (:func:`gossip.int8.span`). Any values decode: what they are is for the caller's
    checks (:func:`all_finite`, norms) to judge.

    Not thread-safe; one decoder per payload. After a :class:`SchemaMismatch` the decoder is
    failed and every later call raises again.

    Args:
        schema: the local schema; nothing received can change the size or shape.
        codec: one of :data:`CODECS`.
        out: the flat float32 buffer to fill (contiguous, ``parts × schema.numel``
            elements, any device); a new one if omitted.
        parts: how many vectors of the schema's size the payload holds, back to back.

    Raises:
        ValueError: unknown codec, or ``out`` is not a contiguous 1-D float32 tensor.
        SchemaMismatch: ``out`` has the wrong number of elements.
        RuntimeError: a big-endian host.
    """

    def __init__(self, schema: StateSchema, codec: str, out: torch.Tensor | None = None, *,
                 parts: int = 1) -> None:
        _require_little_endian()
        self._dtype = _codec_dtype(codec)  # None: int8
        if type(parts) is not int or parts < 1:
            raise ValueError(f"parts must be an int >= 1, not {parts!r}")
        if out is None:
            out = torch.zeros(parts * schema.numel, dtype=torch.float32)
        _check_flat(out)
        if out.numel() != parts * schema.numel:
            raise SchemaMismatch(f"flat buffer has {out.numel()} elements, {parts} part(s) of "
                                 f"the schema have {parts * schema.numel}")
        self._out = out
        self._codec = codec
        self._numel = schema.numel
        self.total_bytes = encoded_nbytes(codec, schema.numel, parts)
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
    def remaining_bytes(self) -> int:
        """Bytes still expected."""
        return self.total_bytes - self._received

    @property
    def done(self) -> bool:
        """Whether the whole payload has been fed."""
        return self._received == self.total_bytes

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


def all_finite(flat: torch.Tensor) -> bool:
    """Whether every element of a flat state is finite (no NaN, no ±inf).

    Chunk by chunk, so no model-sized temporary: a chunk whose sum is finite holds only finite
    values; a chunk whose float32 sum is not (a non-finite value, or an overflow) gets the
    exact elementwise test.
    """
    for start in range(0, flat.numel(), REDUCE_CHUNK):
        chunk = flat[start : start + REDUCE_CHUNK]
        if not bool(torch.isfinite(chunk.sum())) and not bool(chunk.isfinite().all()):
            return False
    return True


def norm(flat: torch.Tensor) -> float:
    """The Euclidean norm of a flat state (inf or NaN if it holds such values)."""
    return math.sqrt(sum_of_squares(flat))


def sum_of_squares(flat: torch.Tensor) -> float:
    """The squared Euclidean norm of a flat float32 tensor (inf or NaN if it holds such values).

    Float32 dot products chunk by chunk (relative error about 1e-6), added in float64; a chunk
    whose float32 sum of squares overflows is redone in float64, so huge values are right too.
    """
    total = 0.0
    for start in range(0, flat.numel(), REDUCE_CHUNK):
        chunk = flat[start : start + REDUCE_CHUNK]
        part = float(torch.dot(chunk, chunk))
        if math.isinf(part):
            part = float(torch.linalg.vector_norm(chunk, dtype=torch.float64)) ** 2
        total += part
    return total
