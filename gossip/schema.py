"""What a model's state is: the float entries of its ``state_dict``, and their fingerprint.

Theory of operation
-------------------
Averaging works on *states*: the floating-point entries of ``module.state_dict()`` (parameters
and float buffers such as BatchNorm's running statistics), in ``state_dict()`` order. Integer
and bool buffers (``num_batches_tracked``) are counters, not weights: they are never averaged
and are not part of the state. Tied weights (two names viewing the same memory, as nanoGPT ties
``wte`` and ``lm_head``) appear once, under the first name, so a delta is never added twice.

A :class:`StateSchema` lists those entries (name, shape, dtype) and where each lies in the
state's flat buffer (:mod:`gossip.tensors`). Both sides of an exchange compare its 16-byte
:attr:`StateSchema.fingerprint` before sending anything, and a node only ever decodes into the
schema it already has (:mod:`gossip.codec`): nothing received chooses a shape or a size.
Nothing here does I/O or imports trio.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import cbor2
import torch

from .codec import encoded_nbytes

__all__ = ["DTYPES", "TensorSpec", "StateSchema", "float_items", "spec_of"]

# Dtypes a schema entry may have, by the name the fingerprint uses.
_DTYPES = {str(d).removeprefix("torch."): d
           for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}
DTYPES: tuple[str, ...] = tuple(_DTYPES)


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

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where each entry starts in the flat buffer, in entry order."""
        return self._offsets

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
        return cls(tuple(spec_of(n, t) for n, t in float_items(state_dict)))

    @classmethod
    def from_module(cls, module: torch.nn.Module) -> StateSchema:
        """The schema of ``module.state_dict()``; see :meth:`from_state_dict`."""
        return cls.from_state_dict(module.state_dict())


def spec_of(name: str, t: torch.Tensor) -> TensorSpec:
    """The schema entry of tensor ``t`` named ``name``.

    Raises:
        ValueError: ``t``'s dtype is not one of :data:`DTYPES`.
    """
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise ValueError(f"{name}: dtype {dtype} is not supported; expected one of {DTYPES}")
    return TensorSpec(name, tuple(t.shape), dtype)


def float_items(state_dict: Mapping[str, object]) -> list[tuple[str, torch.Tensor]]:
    """The entries of ``state_dict`` that a state holds, in order: its floating-point tensors,
    each tied weight once (under its first name)."""
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
