"""Tests for gossip.schema, gossip.tensors and gossip.codec: schema, fingerprint, flat state,
codecs, streaming."""

from __future__ import annotations

import hashlib
import math
import sys

import cbor2
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gossip import tensors
from gossip.codec import CODECS, StateDecoder, encode_chunks, encoded_nbytes, itemsize
from gossip.errors import SchemaMismatch
from gossip.schema import StateSchema, TensorSpec
from tests.unit.test_int8 import reference as int8_reference

# These tests cut payloads into records finer than a peer may send (StateDecoder's
# min_record), to test how elements and cells are put together.
FINE = 1

HALF_TOL = {"bf16": 2.0**-8, "fp16": 2.0**-11}  # relative rounding error bound
ELEMENTWISE = ("fp32", "bf16", "fp16")  # codecs with a fixed size per element (int8: test_int8)


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))


class Mixed(torch.nn.Module):
    """A float32 Linear, a float64 and a bfloat16 parameter, and an int buffer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.lin = torch.nn.Linear(2, 3)
        self.w64 = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))
        self.w16 = torch.nn.Parameter(torch.randn(2, 2).to(torch.bfloat16))
        self.register_buffer("count", torch.tensor(7))


def schema_of(*entries: tuple[str, tuple[int, ...], str]) -> StateSchema:
    return StateSchema(tuple(TensorSpec(*e) for e in entries))


def encode(flat: torch.Tensor, codec: str, max_record: int = 1 << 20) -> bytes:
    return b"".join(bytes(c) for c in encode_chunks(flat, codec, max_record))


def decode(schema: StateSchema, codec: str, payload: bytes, step: int) -> torch.Tensor:
    dec = StateDecoder(schema, codec, min_record=FINE)
    for i in range(0, len(payload), step):
        dec.feed(payload[i : i + step])
    return dec.result()


def reference_bytes(flat: torch.Tensor, codec: str) -> bytes:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[codec]
    return bytes(flat.to(dtype).view(torch.uint8).tolist())


# --- schema and fingerprint ------------------------------------------------------------


def test_schema_from_module_skips_integer_buffers() -> None:
    schema = StateSchema.from_module(small_model())
    assert [e.name for e in schema.entries] == [
        "0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var",
    ]
    assert schema.entries[0] == TensorSpec("0.weight", (4, 3), "float32")
    assert schema.numel == 12 + 4 * 5
    assert schema.encoded_size("fp32") == 4 * schema.numel
    assert schema.encoded_size("bf16") == schema.encoded_size("fp16") == 2 * schema.numel
    assert schema.encoded_size("int8") == 4 + schema.numel  # one short block of 32
    assert StateSchema.from_state_dict(small_model().state_dict()) == schema


def test_tied_weights_appear_once_and_get_one_delta() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(4, 2), torch.nn.Linear(2, 4, bias=False))
    model[1].weight = model[0].weight
    schema = StateSchema.from_module(model)
    assert [e.name for e in schema.entries] == ["0.weight"]
    before = model[0].weight.detach().clone()
    tensors.add_(model, schema, torch.ones(schema.numel))
    assert torch.equal(model[1].weight, before + 1)


def test_fingerprint_test_vector_from_docstring() -> None:
    schema = schema_of(("w", (2, 3), "float32"))
    canon = cbor2.dumps([["w", [2, 3], "float32"]], canonical=True)
    assert canon.hex() == "818361778202036766" + "6c6f61743332"
    assert schema.fingerprint == hashlib.sha256(canon).digest()[:16]
    assert schema.fingerprint_hex == "9679fd51f362229c65de22dd47d2b393"


def test_fingerprint_equal_for_equal_schemas_and_sensitive_to_every_field() -> None:
    base = [("a", (2, 3), "float32"), ("b", (), "bfloat16"), ("c", (0, 4), "float64")]
    fp = schema_of(*base).fingerprint
    assert len(fp) == 16
    assert schema_of(*base).fingerprint == fp
    assert StateSchema.from_module(small_model()) == StateSchema.from_module(small_model())
    variants = [
        [("x", (2, 3), "float32"), *base[1:]],
        [("a", (3, 2), "float32"), *base[1:]],
        [("a", (6,), "float32"), *base[1:]],
        [("a", (2, 3), "float16"), *base[1:]],
        [base[0], ("b", (1,), "bfloat16"), base[2]],
        [base[1], base[0], base[2]],
        base[:2],
    ]
    fingerprints = {schema_of(*v).fingerprint for v in variants}
    assert len(fingerprints) == len(variants) and fp not in fingerprints


@pytest.mark.parametrize(
    "name, shape, dtype",
    [("", (1,), "float32"), ("a", (-1,), "float32"), ("a", (True,), "float32"),
     ("a", (1.0,), "float32"), ("a", (1,), "int64"), ("a", (1,), "torch.float32")],
)
def test_tensor_spec_validation(name: str, shape: tuple, dtype: str) -> None:
    with pytest.raises(ValueError):
        TensorSpec(name, shape, dtype)


def test_schema_rejects_duplicate_names_and_unsupported_dtypes() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        schema_of(("a", (1,), "float32"), ("a", (2,), "float32"))
    with pytest.raises(ValueError, match="float8"):
        StateSchema.from_state_dict({"a": torch.zeros(2, dtype=torch.float8_e4m3fn)})


def test_codecs_and_itemsize() -> None:
    assert CODECS == ("fp32", "bf16", "fp16", "int8")
    assert [itemsize(c) for c in ELEMENTWISE] == [4, 2, 2]
    with pytest.raises(ValueError, match="encoded_nbytes"):
        itemsize("int8")  # blocks: no whole bytes per element
    schema = schema_of(("a", (1,), "float32"))
    for bad in ("int4", "FP32", None):
        with pytest.raises(ValueError, match="codec"):
            itemsize(bad)
        with pytest.raises(ValueError, match="codec"):
            encode_chunks(torch.zeros(1), bad)
        with pytest.raises(ValueError, match="codec"):
            StateDecoder(schema, bad, min_record=FINE)


def test_big_endian_host_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "byteorder", "big")
    with pytest.raises(RuntimeError, match="big-endian"):
        encode_chunks(torch.zeros(1), "fp32")
    with pytest.raises(RuntimeError, match="big-endian"):
        StateDecoder(schema_of(("a", (1,), "float32")), "fp32")


# --- flat state: snapshot, unflatten, add_, load_ ------------------------------------------


def test_snapshot_unflatten_add_load_with_mixed_dtypes() -> None:
    model = Mixed()
    schema = StateSchema.from_module(model)
    assert [(e.name, e.dtype) for e in schema.entries] == [
        ("w64", "float64"), ("w16", "bfloat16"), ("lin.weight", "float32"), ("lin.bias", "float32"),
    ]
    flat = tensors.snapshot(model, schema)
    assert flat.dtype == torch.float32 and flat.shape == (schema.numel,)
    views = tensors.unflatten(flat, schema)
    for name, t in model.state_dict().items():
        if name != "count":
            assert torch.equal(views[name], t.float())
            assert views[name].data_ptr() >= flat.data_ptr()  # a view, not a copy

    before = {n: t.detach().clone() for n, t in model.state_dict().items()}
    delta = torch.linspace(-0.5, 0.5, schema.numel)
    tensors.add_(model, schema, delta)  # parameters require grad: must run under no_grad
    d = tensors.unflatten(delta, schema)
    assert torch.equal(model.w64.detach(), before["w64"] + d["w64"].double())
    assert torch.equal(model.w16.detach(), (before["w16"].float() + d["w16"]).bfloat16())
    assert torch.equal(model.lin.weight.detach(), before["lin.weight"] + d["lin.weight"])
    assert model.count.item() == 7

    target = torch.arange(schema.numel, dtype=torch.float32)
    tensors.load_(model, schema, target)
    assert torch.equal(tensors.snapshot(model, schema), target)
    assert model.w64.dtype == torch.float64 and model.w16.dtype == torch.bfloat16
    assert model.count.item() == 7


def test_snapshot_into_out_and_from_state_dict() -> None:
    model = small_model()
    schema = StateSchema.from_module(model)
    out = tensors.new_flat(schema)
    assert tensors.snapshot(model.state_dict(), schema, out=out) is out
    assert torch.equal(out, tensors.snapshot(model, schema))


def test_model_or_flat_that_does_not_match_raises_schema_mismatch() -> None:
    schema = StateSchema.from_module(small_model())
    other = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.BatchNorm1d(5))
    fewer = torch.nn.Sequential(torch.nn.Linear(3, 4))
    for model in (other, fewer, small_model().double()):
        with pytest.raises(SchemaMismatch):
            tensors.snapshot(model, schema)
        with pytest.raises(SchemaMismatch):
            tensors.add_(model, schema, torch.zeros(schema.numel))
        with pytest.raises(SchemaMismatch):
            tensors.load_(model, schema, torch.zeros(schema.numel))
    wrong = torch.zeros(schema.numel + 1)
    with pytest.raises(SchemaMismatch):
        tensors.snapshot(small_model(), schema, out=wrong)
    with pytest.raises(SchemaMismatch):
        tensors.add_(small_model(), schema, wrong)
    with pytest.raises(SchemaMismatch):
        tensors.unflatten(wrong, schema)
    with pytest.raises(ValueError):
        tensors.add_(small_model(), schema, torch.zeros(schema.numel, dtype=torch.float64))
    with pytest.raises(TypeError):
        tensors.snapshot([torch.zeros(1)], schema)  # type: ignore[arg-type]


# --- codecs ----------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ELEMENTWISE)
def test_round_trip_matches_reference_encoding(codec: str) -> None:
    schema = StateSchema.from_module(small_model())
    torch.manual_seed(2)
    flat = torch.randn(schema.numel) * 10
    payload = encode(flat, codec, max_record=10)
    assert len(payload) == schema.encoded_size(codec)
    assert payload == reference_bytes(flat, codec)
    got = decode(schema, codec, payload, step=12)
    if codec == "fp32":
        assert torch.equal(got, flat)
    else:
        assert torch.all((got - flat).abs() <= HALF_TOL[codec] * flat.abs())


@pytest.mark.parametrize("codec", ["bf16", "fp16"])
def test_half_codecs_saturate_finite_overflow_and_keep_nonfinite(codec: str) -> None:
    big = torch.finfo(torch.float32).max
    top = torch.finfo(torch.float16 if codec == "fp16" else torch.bfloat16).max
    flat = torch.tensor([70000.0, -1e6, 65519.0, 65520.0, big, -big, 1.5,
                         math.inf, -math.inf, math.nan])
    schema = schema_of(("x", (flat.numel(),), "float32"))
    got = decode(schema, codec, encode(flat, codec, max_record=4), step=4)
    expected = flat.to(torch.bfloat16 if codec == "bf16" else torch.float16).float()
    expected[:6] = torch.where(flat[:6].abs() > top, flat[:6].sign() * top, expected[:6])
    assert torch.equal(got[:9], expected[:9])
    assert math.isnan(got[9])
    if codec == "fp16":
        assert got[:6].tolist() == [65504.0, -65504.0, 65504.0, 65504.0, 65504.0, -65504.0]


@pytest.mark.parametrize("codec", ELEMENTWISE)
@pytest.mark.parametrize("max_record", [2, 3, 4, 5, 7, 8, 9, 63, 64, 1023, 1 << 20])
def test_chunks_hold_whole_elements_within_max_record(codec: str, max_record: int) -> None:
    size = itemsize(codec)
    if max_record < size:
        with pytest.raises(ValueError, match="max_record"):
            encode_chunks(torch.zeros(3), codec, max_record)
        return
    flat = torch.randn(301)
    chunks = [bytes(c) for c in encode_chunks(flat, codec, max_record)]
    per = max_record // size
    assert len(chunks) == math.ceil(301 / per)
    assert all(len(c) <= max_record and len(c) % size == 0 and c for c in chunks)
    assert all(len(c) == per * size for c in chunks[:-1])
    assert b"".join(chunks) == reference_bytes(flat, codec)


def test_encode_validates_its_arguments_eagerly() -> None:
    for bad in (torch.zeros(2, 2), torch.zeros(4, dtype=torch.float64), torch.zeros(8)[::2]):
        with pytest.raises(ValueError):
            encode_chunks(bad, "fp32")
    with pytest.raises(ValueError):
        encode_chunks(torch.zeros(4), "fp32", max_record=4.0)  # type: ignore[arg-type]


def test_fp32_chunks_alias_the_flat_buffer_without_copying() -> None:
    flat = torch.zeros(10)
    chunks = list(encode_chunks(flat, "fp32", max_record=16))
    assert [len(c) for c in chunks] == [16, 16, 8]
    assert chunks[0].readonly
    flat[5] = 1.0  # lands in the second chunk, bytes 4..8
    assert bytes(chunks[1][4:8]) == reference_bytes(torch.tensor([1.0]), "fp32")
    del flat  # the views keep the memory alive
    assert bytes(chunks[1][4:8]) == reference_bytes(torch.tensor([1.0]), "fp32")


def test_half_chunks_reuse_one_scratch_buffer() -> None:
    it = encode_chunks(torch.tensor([1.0, 2.0, 3.0, 4.0]), "bf16", max_record=4)
    first = next(it)
    assert bytes(first) == reference_bytes(torch.tensor([1.0, 2.0]), "bf16")
    next(it)
    assert bytes(first) == reference_bytes(torch.tensor([3.0, 4.0]), "bf16")  # overwritten


def test_empty_state_streams_nothing() -> None:
    schema = schema_of(("a", (0, 3), "float32"))
    assert schema.numel == 0
    flat = tensors.new_flat(schema)
    assert list(encode_chunks(flat, "fp16")) == []
    dec = StateDecoder(schema, "fp16", min_record=FINE)
    assert dec.done and dec.remaining_bytes == 0
    dec.feed(b"")
    assert dec.result().numel() == 0


# --- decoder ---------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ELEMENTWISE)
def test_decoder_tracks_progress_and_accepts_any_bytes_like(codec: str) -> None:
    schema = schema_of(("a", (3, 2), "float32"), ("b", (), "float64"))
    flat = torch.arange(7, dtype=torch.float32)
    payload = encode(flat, codec)
    size = itemsize(codec)
    out = torch.full((7,), -1.0)
    dec = StateDecoder(schema, codec, out=out, min_record=FINE)
    assert dec.total_bytes == dec.remaining_bytes == 7 * size and not dec.done
    dec.feed(payload[: 2 * size])  # bytes (read-only)
    dec.feed(bytearray(payload[2 * size : 3 * size]))  # writable
    dec.feed(memoryview(bytearray(payload))[3 * size : 5 * size])  # writable view
    assert dec.remaining_bytes == 2 * size
    with pytest.raises(SchemaMismatch, match="incomplete"):
        dec.result()
    dec.feed(memoryview(payload)[5 * size :])  # read-only view
    assert dec.done and dec.result() is out and torch.equal(out, flat)


@pytest.mark.parametrize("codec", ELEMENTWISE)
def test_decoder_rejects_oversize_and_misaligned_records(codec: str) -> None:
    schema = schema_of(("a", (4,), "float32"))
    size = itemsize(codec)
    with pytest.raises(SchemaMismatch, match="exceeds"):
        StateDecoder(schema, codec, min_record=FINE).feed(bytes(5 * size))
    dec = StateDecoder(schema, codec, min_record=FINE)
    dec.feed(bytes(3 * size))
    with pytest.raises(SchemaMismatch, match="exceeds"):
        dec.feed(bytes(2 * size))
    with pytest.raises(SchemaMismatch, match="already failed"):
        dec.feed(bytes(size))  # a failed decoder stays failed
    with pytest.raises(SchemaMismatch):
        dec.result()
    with pytest.raises(SchemaMismatch, match="not whole"):
        StateDecoder(schema, codec, min_record=FINE).feed(bytes(size + 1))


def test_decoder_rejects_wrong_out_and_non_contiguous_records() -> None:
    schema = schema_of(("a", (4,), "float32"))
    with pytest.raises(SchemaMismatch):
        StateDecoder(schema, "fp32", out=torch.zeros(5), min_record=FINE)
    with pytest.raises(ValueError):
        StateDecoder(schema, "fp32", out=torch.zeros(4, dtype=torch.float16), min_record=FINE)
    with pytest.raises(TypeError):
        StateDecoder(schema, "fp32", min_record=FINE).feed(memoryview(bytes(32))[::2])


# --- validation helpers ----------------------------------------------------------------


def test_all_finite_and_norm() -> None:
    flat = torch.tensor([3.0, -4.0, 0.0])
    assert tensors.all_finite(flat) and tensors.norm(flat) == 5.0
    huge = torch.full((1000,), torch.finfo(torch.float32).max)
    assert tensors.all_finite(huge)  # the float32 sum would overflow; ours must not
    assert tensors.norm(huge) == pytest.approx(torch.finfo(torch.float32).max * math.sqrt(1000))
    for bad in (math.nan, math.inf, -math.inf):
        assert not tensors.all_finite(torch.tensor([1.0, bad, 2.0]))
    assert not tensors.all_finite(torch.tensor([math.inf, -math.inf]))
    assert tensors.all_finite(torch.zeros(0)) and tensors.norm(torch.zeros(0)) == 0.0
    torch.manual_seed(3)
    x = torch.randn(3 << 20)  # several reduction chunks
    assert tensors.norm(x) == pytest.approx(x.double().norm().item(), rel=1e-5)


# --- properties ------------------------------------------------------------------------

shapes = st.lists(st.lists(st.integers(0, 5), max_size=3).map(tuple), min_size=0, max_size=5)


@settings(max_examples=150, deadline=None)
@given(
    shapes=shapes,
    codec=st.sampled_from(ELEMENTWISE),
    max_record=st.integers(1, 64),
    cuts=st.lists(st.integers(0, 400), max_size=8),
    seed=st.integers(0, 2**16),
)
def test_stream_round_trip_property(
    shapes: list[tuple[int, ...]], codec: str, max_record: int, cuts: list[int], seed: int
) -> None:
    schema = schema_of(*((f"t{i}", s, "float32") for i, s in enumerate(shapes)))
    size = itemsize(codec)
    gen = torch.Generator().manual_seed(seed)
    flat = torch.randn(schema.numel, generator=gen) * 100
    if max_record < size:
        with pytest.raises(ValueError):
            encode_chunks(flat, codec, max_record)
        return
    chunks = [bytes(c) for c in encode_chunks(flat, codec, max_record)]
    assert all(0 < len(c) <= max_record and len(c) % size == 0 for c in chunks)
    payload = b"".join(chunks)
    assert len(payload) == schema.encoded_size(codec)
    # Feed the payload re-cut at arbitrary element boundaries.
    bounds = sorted({min(c, schema.numel) * size for c in cuts} | {0, len(payload)})
    dec = StateDecoder(schema, codec, min_record=FINE)
    for lo, hi in zip(bounds, bounds[1:]):
        dec.feed(payload[lo:hi])
    got = dec.result()
    expected = flat.to({"fp32": torch.float32, "bf16": torch.bfloat16,
                        "fp16": torch.float16}[codec]).float()
    assert torch.equal(got, expected)
    assert torch.equal(torch.cat([v.reshape(-1) for v in tensors.unflatten(got, schema).values()]
                                 or [torch.zeros(0)]), got)


# --- CUDA (skipped without a GPU) ------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_cuda_model_pinned_flat_round_trip() -> None:
    model = Mixed().cuda()
    schema = StateSchema.from_module(model)
    flat = tensors.snapshot(model, schema, out=tensors.new_flat(schema, pin_memory=True))
    assert flat.is_pinned() and flat.device.type == "cpu"
    assert torch.equal(flat, tensors.snapshot(Mixed(), schema))
    for codec in CODECS:
        record = 68 if codec == "int8" else 6  # int8: one whole block
        payload = encode(flat, codec, max_record=record)
        assert payload == encode(flat.cuda(), codec, max_record=record)  # device flat too
        got = decode(schema, codec, payload, step=len(payload) if codec == "int8" else 12)
        dec = StateDecoder(schema, codec, out=torch.zeros(schema.numel, device="cuda"), min_record=FINE)
        dec.feed(payload)
        assert torch.equal(dec.result().cpu(), got)
    # A delta is added in each tensor's own dtype (w16 rounds in bfloat16): the same sums on
    # the GPU as on the CPU.
    on_cpu = Mixed()
    tensors.add_(model, schema, torch.ones(schema.numel))
    tensors.add_(on_cpu, schema, torch.ones(schema.numel))
    assert torch.equal(tensors.snapshot(model, schema), tensors.snapshot(on_cpu, schema))
    assert not torch.equal(tensors.snapshot(on_cpu, schema), flat + 1)  # bf16 rounding shows


DEVICES = ["cpu", *(f"cuda:{i}" for i in range(torch.cuda.device_count()))]
# SHA-256 of each codec's payload of golden(), as the CPU encodes it (int8: rounding to
# nearest; test_int8 checks that encoder against an independent one).
GOLDEN = {
    "fp32": "984f35b1be3990d2058697481165ec48c6f2f69a3e496af8840fbd32d306d336",
    "bf16": "bef0e29f6e596d436f81e2821e2678ed18f9e9f67684a2a835c01385b0f4f6cf",
    "fp16": "553f3cc8744b24ccf22d6ab005f0a86c01411fd86a376241adb8763ce62888b0",
    "int8": "c77ccc16d93e4162e2e6e0e0e0833f393ce6452a2048906d93936357471680b1",
}


def golden() -> torch.Tensor:
    """1,000 finite values whose magnitude changes every 64 (1e-6 to 1e4), with exact
    zeros, ties for rounding and values past fp16's range among them."""
    gen = torch.Generator().manual_seed(31)
    x = torch.randn(1000, generator=gen)
    x *= torch.pow(10.0, torch.randint(-6, 5, (16,), generator=gen)).repeat_interleave(64)[:1000]
    x[:64] = 0.0
    x[64:72] = torch.tensor([1.0, -2.0, 0.5, 3.14159, 100000.0, -1e-8, 70000.0, 1 + 2**-8])
    return x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", CODECS)
def test_golden_bytes_on_every_device(device: str, codec: str) -> None:
    """The bytes on the wire, and what they decode to, are the same on every device the
    machine has: docs/PROTOCOL.md defines them, not the hardware."""
    x = golden()
    payload = encode(x.to(device), codec, max_record=68 * 4)
    assert hashlib.sha256(payload).hexdigest() == GOLDEN[codec]
    if codec == "int8":
        assert payload == int8_reference(x.tolist())  # an encoder written from the spec
    schema = schema_of(("x", (1000,), "float32"))
    dec = StateDecoder(schema, codec, out=torch.zeros(1000, device=device), min_record=FINE)
    for at in range(0, len(payload), 68 * 4):
        dec.feed(payload[at : at + 68 * 4])
    assert torch.equal(dec.result().cpu(), decode(schema, codec, payload, 68 * 4))


def test_decoder_window_takes_records_in_place() -> None:
    schema = schema_of(("w", (2, 3), "float32"))
    dec = StateDecoder(schema, "fp32", min_record=FINE)
    assert len(dec.window(16)) == 16  # at most the limit
    window = dec.window(1 << 20)
    assert window is not None and len(window) == 24  # at most what remains
    window[:12] = torch.tensor([1.0, 2.0, 3.0]).numpy().tobytes()
    dec.wrote(12)
    assert len(dec.window(1 << 20)) == 12
    with pytest.raises(SchemaMismatch, match="not whole"):
        dec.wrote(5)
    assert dec.window(1 << 20) is None  # a failed decoder offers nowhere to write


@pytest.mark.parametrize("codec", ["bf16", "fp16"])
def test_decoder_window_of_a_half_codec_is_a_scratch_record(codec: str) -> None:
    schema = schema_of(("w", (5,), "float32"))
    values = torch.tensor([1.0, -2.5, 3.0, 0.125, 1024.0])
    payload = encode(values, codec)
    dec = StateDecoder(schema, codec, min_record=FINE)
    size = len(payload) // 5
    window = dec.window(3 * size)
    assert len(window) == 3 * size
    window[:] = payload[: 3 * size]
    dec.wrote(3 * size)
    assert len(dec.window(size)) == size
    with pytest.raises(ValueError, match="window"):
        dec.wrote(2 * size)  # more than the last window held
    window = dec.window(1 << 20)
    assert len(window) == 2 * size  # what remains
    window[:] = payload[3 * size :]
    dec.wrote(2 * size)
    assert torch.equal(dec.result(), values)  # all exactly representable


def test_decoder_window_checks_like_feed() -> None:
    schema = schema_of(("w", (2,), "float32"))
    dec = StateDecoder(schema, "fp32", min_record=FINE)
    with pytest.raises(SchemaMismatch, match="empty record"):
        dec.wrote(0)
    dec = StateDecoder(schema, "fp32", min_record=FINE)
    with pytest.raises(SchemaMismatch, match="exceeds"):
        dec.wrote(12)
    dec = StateDecoder(schema, "bf16", min_record=FINE)
    dec.window(2)
    with pytest.raises(SchemaMismatch, match="not whole"):
        dec.wrote(3)


def test_the_schema_and_the_codec_are_importable_from_tensors_too() -> None:
    import gossip.codec
    import gossip.schema

    for module in (gossip.schema, gossip.codec):
        for name in module.__all__:
            if name in tensors.__all__:
                assert getattr(tensors, name) is getattr(module, name), name
    assert {"StateSchema", "TensorSpec", "encode_chunks", "StateDecoder"} <= set(tensors.__all__)
