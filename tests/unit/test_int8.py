"""The int8 wire codec (gossip.int8 through gossip.codec): the byte layout against an
independent reference encoder, exact sizes, the error bound, vectors that restart blocking,
records of whole blocks, non-finite values, and whatever a hostile peer sends."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gossip import int8, tensors
from gossip.codec import StateDecoder, encode_chunks, encoded_nbytes
from gossip.errors import SchemaMismatch
from gossip.schema import StateSchema, TensorSpec

# These tests cut payloads into records finer than a peer may send (StateDecoder's
# min_record), to test how elements and cells are put together.
FINE = 1

CELL = 68  # bytes of a whole block: a float32 scale and 64 int8 values
MAX_SCALE = struct.unpack("<f", bytes.fromhex("0302017c"))[0]  # as docs/PROTOCOL.md says
SLACK = 2.0**-15  # float32 rounding of x / scale and of q * scale, in units of the scale


def schema_of(numel: int) -> StateSchema:
    return StateSchema((TensorSpec("w", (numel,), "float32"),))


def encode(flat: torch.Tensor, max_record: int = 1 << 20, parts: int = 1) -> bytes:
    return b"".join(bytes(r) for r in encode_chunks(flat, "int8", max_record,
                                                            parts=parts))


def decode(payload: bytes, numel: int, parts: int = 1, records: list[int] | None = None
           ) -> torch.Tensor:
    """Decode ``payload``, fed as records of the given sizes (default: one record per
    vector, as whole cells of one vector must be)."""
    dec = StateDecoder(schema_of(numel), "int8", parts=parts, min_record=FINE)
    sizes = records or [len(payload) // parts] * parts
    at = 0
    for size in sizes:
        dec.feed(payload[at : at + size])
        at += size
    return dec.result()


def f32(value: float) -> float:
    return struct.unpack("<f", struct.pack("<f", value))[0]


def reference(values: list[float]) -> bytes:
    """The layout as docs/PROTOCOL.md states it, one value at a time in plain Python
    (finite values only): per block of 64 (the last may be shorter), the float32 scale
    absmax / 127 (at most MAX_SCALE) and round-half-even(x / scale) as int8. Python's float
    division of two float32 values, rounded to float32, is the float32 division."""
    out = b""
    for start in range(0, len(values), 64):
        block = [f32(v) for v in values[start : start + 64]]
        scale = min(f32(max(abs(v) for v in block) / 127), MAX_SCALE)
        q = [max(-127, min(127, round(f32(v / scale)))) if scale else 0 for v in block]
        out += struct.pack("<f", scale) + struct.pack(f"<{len(q)}b", *q)
    return out


def scales_of(payload: bytes, numel: int) -> torch.Tensor:
    """Each value's block scale, read back from one vector's payload."""
    scales, at = [], 0
    for start in range(0, numel, 64):
        m = min(64, numel - start)
        scales += [struct.unpack_from("<f", payload, at)[0]] * m
        at += 4 + m
    return torch.tensor(scales, dtype=torch.float32)


def blocky(numel: int, seed: int) -> torch.Tensor:
    """Random values whose magnitude changes from block to block (1e-6 to 1e6)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen)
    exponents = torch.randint(-6, 7, (numel // 64 + 1,), generator=gen).repeat_interleave(64)
    return x * torch.pow(10.0, exponents[:numel].float())


# --- layout and sizes ------------------------------------------------------------------


def test_protocol_examples() -> None:
    # The examples of docs/PROTOCOL.md section 7.3: one short block of 6 values each.
    x = torch.tensor([1.0, -2.0, 0.5, 3.14159, 100000.0, -1e-8])
    assert encode(x).hex(" ") == "b3 d9 44 44 00 00 00 00 7f 00"
    assert decode(encode(x), 6).tolist() == [0.0, 0.0, 0.0, 0.0, 100000.0, 0.0]
    x = torch.tensor([1.0, -2.0, 0.5, 3.14159, 1.5, -1e-8])
    assert encode(x).hex(" ") == "1a a5 ca 3c 28 af 14 7f 3d 00"
    assert [f"{v:.9g}" for v in decode(encode(x), 6).tolist()] == [
        "0.989477158", "-2.0036912", "0.494738579", "3.14159012", "1.50895274", "0"]


@pytest.mark.parametrize("numel", [1, 2, 63, 64, 65, 127, 128, 129, 200, 1000])
def test_layout_matches_an_independent_reference_encoder(numel: int) -> None:
    x = blocky(numel, seed=numel)
    assert encode(x) == reference(x.tolist())
    y = blocky(numel, seed=numel + 1) * 1e-3
    assert encode(torch.cat([x, y]), parts=2) == reference(x.tolist()) + reference(y.tolist())


@pytest.mark.parametrize("numel", [0, 1, 2, 63, 64, 65, 127, 128, 129, 1000, 986_880, 986_881])
def test_encoded_size_is_known_from_numel_alone(numel: int) -> None:
    expected = 68 * (numel // 64) + (4 + numel % 64 if numel % 64 else 0)
    assert int8.nbytes(numel) == encoded_nbytes("int8", numel) == expected
    assert schema_of(numel).encoded_size("int8") == expected
    for parts in (1, 2, 3):
        assert encoded_nbytes("int8", numel, parts) == parts * expected
        assert StateDecoder(schema_of(numel), "int8", parts=parts, min_record=FINE).total_bytes == parts * expected
    if numel <= 1000:
        for parts in (1, 2):
            assert len(encode(torch.randn(parts * numel), parts=parts)) == parts * expected
    assert 1.0625 * numel <= expected <= 1.0625 * numel + 4


def test_max_scale_is_the_largest_whose_product_with_127_is_finite() -> None:
    assert int8.MAX_SCALE == MAX_SCALE
    s = torch.tensor(MAX_SCALE)
    assert bool(torch.isfinite(s * 127))
    assert not bool(torch.isfinite(torch.nextafter(s, torch.tensor(math.inf)) * 127))


def test_encoded_nbytes_validates() -> None:
    assert encoded_nbytes("fp32", 10, 2) == 80
    assert encoded_nbytes("bf16", 10) == 20
    for bad in ({"codec": "int4"}, {"numel": -1}, {"numel": 1.0}, {"parts": -1}):
        args = {"codec": "int8", "numel": 10, "parts": 1, **bad}
        with pytest.raises(ValueError):
            encoded_nbytes(args["codec"], args["numel"], args["parts"])


# --- values ----------------------------------------------------------------------------


@pytest.mark.parametrize("numel", [1, 63, 64, 65, 1000, 5000])
def test_round_trip_error_is_at_most_half_a_scale(numel: int) -> None:
    x = blocky(numel, seed=7)
    payload = encode(x)
    got = decode(payload, numel)
    scale = scales_of(payload, numel)
    absmax = torch.stack([b.abs().max() for b in x.split(64)]).repeat_interleave(64)[:numel]
    assert torch.equal(scale, absmax / 127)  # float32, rounded to nearest
    assert bool(((got - x).abs() <= scale * (0.5 + SLACK)).all())
    assert bool((got.abs() <= absmax * (1 + SLACK)).all())


def sr_encode(flat: torch.Tensor, seed: int, max_record: int = 1 << 20) -> bytes:
    generator = torch.Generator().manual_seed(seed)
    return b"".join(bytes(r) for r in encode_chunks(flat, "int8", max_record,
                                                            generator=generator))


@pytest.mark.parametrize("numel", [1, 63, 65, 5000])
def test_stochastic_rounding_stays_within_a_scale_and_keeps_the_scales(numel: int) -> None:
    x = blocky(numel, seed=8)
    nearest, payload = encode(x), sr_encode(x, seed=1, max_record=68 * 7)  # several records
    scale = scales_of(payload, numel)
    assert torch.equal(scale, scales_of(nearest, numel))  # only the q differ
    got = decode(payload, numel)
    assert bool(((got - x).abs() <= scale * (1 + SLACK)).all())
    absmax = torch.stack([b.abs().max() for b in x.split(64)]).repeat_interleave(64)[:numel]
    assert bool((got.abs() <= absmax * (1 + SLACK)).all())  # the extremes stay at +-127


def test_stochastic_rounding_is_unbiased_where_nearest_is_not() -> None:
    # 64 copies of one block whose values sit 0.3 of a step above a level: nearest rounds
    # every one down, every time; stochastic rounding lands on them on average.
    numel = 64 * 64
    levels = torch.randint(-126, 126, (64,), generator=torch.Generator().manual_seed(3))
    block = (levels + 0.3) / 127.0
    block[-1] = 1.0  # absmax 1: the step is 1/127, and this value is exact
    x = block.repeat(64)
    off = x != 1.0
    nearest = (decode(encode(x), numel) - x)[off]
    assert float(nearest.mean()) == pytest.approx(-0.3 / 127, rel=1e-3)  # always down
    draws = torch.stack([decode(sr_encode(x, seed), numel) - x for seed in range(40)])
    # Each of the block's values: 40 payloads x 64 copies, so the mean error is 0 within
    # about 0.46 / sqrt(2560) = 0.01 of a step, where nearest is 0.3 off.
    per_value = draws.view(40, 64, 64).mean(dim=(0, 1))[:-1]
    assert float(per_value.abs().max()) < 0.05 / 127


def test_each_payload_draws_its_own_rounding() -> None:
    x = blocky(5000, seed=9)
    assert sr_encode(x, seed=1) == sr_encode(x, seed=1)  # a seeded generator repeats
    assert sr_encode(x, seed=1) != sr_encode(x, seed=2)
    from gossip import int8  # exchanges take a generator seeded from the OS each time
    assert int8.dither().initial_seed() != int8.dither().initial_seed()


def test_parts_restart_blocks_so_a_small_vector_keeps_its_precision() -> None:
    numel = 1000  # 15 whole blocks and a short one of 40: blocking must restart
    state = torch.randn(numel)
    estimate = torch.randn(numel) * 1e-3
    payload = encode(torch.cat([state, estimate]), max_record=300, parts=2)
    assert payload == encode(state) + encode(estimate)
    got = decode(payload, numel, parts=2, records=[272] * 3 + [248] + [272] * 3 + [248])
    small = got[numel:]
    assert bool((small != 0).sum() > 0.9 * numel)  # not flushed to zero by a shared scale
    assert bool(((small - estimate).abs() <= scales_of(encode(estimate), numel) * 0.51).all())
    # One block straddling both vectors would have the state's scale, 1000x too coarse.
    assert float((small - estimate).abs().max()) <= float(estimate.abs().max()) / 250


def test_non_finite_values_turn_their_whole_block_into_nans() -> None:
    x = torch.randn(64 * 6 + 10)
    x[3] = math.nan  # block 0
    x[64 * 2 + 5] = math.inf  # block 2
    x[64 * 3 + 1] = -math.inf  # block 3
    x[64 * 4 + 1], x[64 * 4 + 2] = math.inf, math.nan  # block 4
    x[64 * 6 + 9] = math.inf  # the short last block
    payload = encode(x)
    scale = scales_of(payload, x.numel())
    got = decode(payload, x.numel())
    for block in (0, 2, 3, 4, 6):
        assert bool(got[64 * block : 64 * block + 64].isnan().all())
        cell = payload[CELL * block + 4 : CELL * block + CELL]
        assert cell == bytes(len(cell))  # defined values: q = 0, the scale says it all
    assert math.isnan(scale[0]) and math.isnan(scale[64 * 4])
    assert scale[64 * 2] == scale[64 * 3] == scale[64 * 6] == math.inf
    for block in (1, 5):
        part = slice(64 * block, 64 * block + 64)
        assert bool(((got[part] - x[part]).abs() <= scale[part] * (0.5 + SLACK)).all())
    assert not tensors.all_finite(got)


@pytest.mark.parametrize("bits", [0x7FC00000, 0xFFFFFFFF, 0x7F800001, 0xFFC01234])
def test_a_nan_block_s_scale_is_always_the_quiet_nan(bits: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # The bytes on the wire must not depend on the device, nor on the NaN the model held.
    # A CPU's max makes 7fc00000 of any NaN; CUDA's made ffffffff, which this stand-in does
    # (a CPU's division keeps those bits), so the test holds the encoder on a CPU too.
    amax = torch.amax

    def amax_as_on_cuda(*args: object, **kwargs: object) -> torch.Tensor:
        out = amax(*args, **kwargs)
        out.view(torch.int32)[out.isnan()] = -1  # ffffffff
        return out

    monkeypatch.setattr(torch, "amax", amax_as_on_cuda)
    x = torch.randn(64 * 2 + 7)
    raw = x.view(torch.int32)
    for i in (5, 64 + 9, 64 * 2 + 3):  # a whole block, another, the short last one
        raw[i] = struct.unpack("<i", struct.pack("<I", bits))[0]
    payload = encode(x)
    for start in (0, CELL, 2 * CELL):
        assert payload[start : start + 4] == bytes.fromhex("0000c07f")


def test_zero_huge_and_tiny_blocks() -> None:
    big = torch.finfo(torch.float32).max
    tiny = torch.finfo(torch.float32).tiny
    x = torch.cat([torch.zeros(64), torch.full((64,), -0.0),
                   torch.linspace(-1, 1, 64) * big,  # up to the largest finite value
                   torch.linspace(-1, 1, 64) * 1e-40,  # subnormals: scale 0 or subnormal
                   torch.linspace(-1, 1, 64) * tiny * 100,  # a subnormal scale
                   torch.tensor([1e-45, -1e-45, 3e-45])])
    payload = encode(x)
    assert payload == reference(x.tolist())
    got = decode(payload, x.numel())
    assert tensors.all_finite(got)
    assert torch.equal(got[:128], torch.zeros(128)) and payload[:4] == bytes(4)
    assert payload[CELL * 2 : CELL * 2 + 4] == bytes.fromhex("0302017c")  # MAX_SCALE
    top = float(torch.tensor(MAX_SCALE) * 127)  # float32's largest value or an ulp below
    assert -got[128] == got[191] == top and top >= big * (1 - 2**-23)
    assert bool(((got[128:192] - x[128:192]).abs() <= big / 127 * (0.5 + SLACK)).all())
    absmax = torch.stack([b.abs().max() for b in x.split(64)]).repeat_interleave(64)[:x.numel()]
    assert bool(((got - x).abs() <= absmax).all())
    for block in (3, 4):  # subnormal scales: the clamp keeps q within [-127, 127]
        q = struct.unpack("<64b", payload[CELL * block + 4 : CELL * block + CELL])
        assert max(map(abs, q)) <= 127


# --- records ---------------------------------------------------------------------------


@pytest.mark.parametrize("max_record", [68, 69, 135, 136, 137, 1000, 1 << 20])
@pytest.mark.parametrize("numel, parts", [(1000, 1), (1000, 2), (320, 2), (5, 3)])
def test_records_hold_whole_blocks_of_one_vector(max_record: int, numel: int,
                                                 parts: int) -> None:
    x = torch.randn(parts * numel)
    records = [bytes(r) for r in encode_chunks(x, "int8", max_record, parts=parts)]
    assert b"".join(records) == encode(x, parts=parts)  # the same bytes however cut
    part = int8.nbytes(numel)
    per = max_record // CELL
    at = 0
    for record in records:
        assert 0 < len(record) <= max_record
        end = at + len(record)
        assert at // part == (end - 1) // part  # never two vectors in one record
        if end % part:  # not the last of its vector: exactly `per` whole cells
            assert len(record) == per * CELL
        else:
            assert len(record) <= per * CELL and (len(record) - part % CELL) % CELL == 0
        at = end
    assert at == parts * part
    sizes = [len(r) for r in records]
    assert torch.equal(decode(b"".join(records), numel, parts, sizes), decode(
        b"".join(records), numel, parts))


def test_encode_validates_its_arguments_eagerly() -> None:
    with pytest.raises(ValueError, match="max_record"):
        encode_chunks(torch.zeros(10), "int8", 67)
    for parts in (0, 3, 2.0):
        with pytest.raises(ValueError, match="parts"):
            encode_chunks(torch.zeros(10), "int8", parts=parts)  # type: ignore[arg-type]
    assert list(encode_chunks(torch.zeros(0), "int8", parts=2)) == []


def test_records_are_views_of_one_reused_scratch_buffer() -> None:
    it = encode_chunks(torch.arange(128.0), "int8", max_record=68)
    first = next(it)
    assert first.readonly and bytes(first) == encode(torch.arange(64.0))
    next(it)
    assert bytes(first) == encode(torch.arange(64.0, 128.0))  # overwritten


def test_decoder_accepts_any_bytes_like_record() -> None:
    x = torch.randn(200)
    payload = encode(x)
    expected = decode(payload, 200)
    dec = StateDecoder(schema_of(200), "int8", min_record=FINE)
    dec.feed(payload[:68])  # bytes
    dec.feed(bytearray(payload[68:136]))  # writable
    dec.feed(memoryview(b"\0" + payload)[137:205])  # read-only, not 4-byte aligned
    unaligned = bytearray(b"\0" + payload[204:])
    dec.feed(memoryview(unaligned)[1:])  # writable, not 4-byte aligned
    assert torch.equal(dec.result(), expected)


def test_window_and_wrote_dequantize_from_a_scratch_record() -> None:
    x = torch.randn(200)
    payload = encode(x)  # 3 whole cells and a short one of 8: 216 bytes
    dec = StateDecoder(schema_of(200), "int8", min_record=FINE)
    window = dec.window(1 << 20)
    assert window is not None and len(window) == 216  # at most what remains
    window[:136] = payload[:136]
    dec.wrote(136)
    window = dec.window(68)
    assert len(window) == 68
    window[:] = payload[136:204]
    with pytest.raises(ValueError, match="window"):
        dec.wrote(80)  # not whole blocks would be refused anyway; more than the window
    window = dec.window(1 << 20)
    assert len(window) == 80
    window[:] = payload[136:]
    dec.wrote(80)  # a whole cell and the short one
    assert torch.equal(dec.result(), decode(payload, 200))


# --- what a hostile peer can send ------------------------------------------------------


@pytest.mark.parametrize("sizes, match", [
    ([67], "not whole int8 blocks"),
    ([69], "not whole int8 blocks"),
    ([1], "not whole int8 blocks"),
    ([12], "not whole int8 blocks"),  # the short cell's size, but where a whole one is due
    ([204, 68], "not whole int8 blocks"),  # into the next vector: runs past this one
    ([204, 12 + 68], "not whole int8 blocks"),  # the short cell and the next vector's first
    ([204, 11], "not whole int8 blocks"),
    ([216, 216, 1], "exceeds"),
    ([433], "exceeds"),
    ([0], "empty record"),
])
def test_decoder_refuses_records_that_are_not_whole_blocks(sizes: list[int],
                                                           match: str) -> None:
    # numel 200: three whole blocks and a short one of 8, 216 bytes; two vectors, 432.
    dec = StateDecoder(schema_of(200), "int8", parts=2, min_record=FINE)
    with pytest.raises(SchemaMismatch, match=match):
        for size in sizes:
            dec.feed(bytes(size))
    with pytest.raises(SchemaMismatch, match="already failed"):
        dec.feed(bytes(68))  # a failed decoder stays failed
    assert dec.window(1 << 20) is None
    with pytest.raises(SchemaMismatch):
        dec.result()


def test_decoder_takes_records_cut_at_any_cell_boundary() -> None:
    x = torch.randn(400)
    payload = encode(x, parts=2)  # per vector: 6 whole cells and a short one of 16, 428
    whole = decode(payload, 200, parts=2)
    for sizes in ([68, 136, 12, 216], [216, 68, 68, 68, 12], [204, 12, 204, 12]):
        assert torch.equal(decode(payload, 200, 2, sizes), whole)


def cell(scale: float | bytes, q: list[int]) -> bytes:
    head = scale if isinstance(scale, bytes) else struct.pack("<f", scale)
    return head + struct.pack(f"<{len(q)}b", *q)


def test_any_scale_and_any_byte_decode_without_error() -> None:
    big = torch.finfo(torch.float32).max
    cells = [cell(math.nan, [1] * 64), cell(math.inf, [0] * 64), cell(-math.inf, [5] * 64),
             cell(big, [-128] + [127] * 63), cell(-2.0, [-128] * 64),
             cell(1e-45, [100] * 64), cell(b"\xff\xff\xff\xff", [3] * 64),  # a NaN pattern
             cell(0.5, [-128, 127, 0, -1])]
    numel = 64 * 7 + 4
    got = decode(b"".join(cells), numel)
    assert bool(got[:64].isnan().all())  # NaN scale
    assert bool(got[64:128].isnan().all())  # 0 * inf
    assert bool((got[128:192] == -math.inf).all())
    assert got[192] == -math.inf and bool((got[193:256] == math.inf).all())  # overflow
    assert bool((got[256:320] == 256.0).all())  # -128 x -2: -128 is taken, not refused
    assert bool((got[320:384] == 100 * f32(1e-45)).all())
    assert bool(got[384:448].isnan().all())
    assert got[448:].tolist() == [-64.0, 63.5, 0.0, -0.5]
    assert not tensors.all_finite(got)


@settings(max_examples=100, deadline=None)
@given(data=st.data(), numel=st.integers(1, 300), parts=st.integers(1, 2))
def test_random_bytes_in_valid_records_always_decode(data: st.DataObject, numel: int,
                                                    parts: int) -> None:
    size = int8.nbytes(numel)
    payload = data.draw(st.binary(min_size=parts * size, max_size=parts * size))
    cells = [CELL] * (numel // 64) + ([size - numel // 64 * CELL] if numel % 64 else [])
    got = decode(payload, numel, parts, cells * parts)
    assert got.numel() == parts * numel and got.dtype == torch.float32
    assert tensors.all_finite(got) == bool(got.isfinite().all())


@settings(max_examples=100, deadline=None)
@given(data=st.data(), numel=st.integers(1, 300), parts=st.integers(1, 2),
       cuts=st.lists(st.integers(0, 700), max_size=6))
def test_records_of_any_size_decode_or_are_refused(data: st.DataObject, numel: int,
                                                   parts: int, cuts: list[int]) -> None:
    payload = encode(torch.randn(parts * numel), parts=parts)
    bounds = sorted({min(c, len(payload)) for c in cuts} | {0, len(payload)})
    dec = StateDecoder(schema_of(numel), "int8", parts=parts, min_record=FINE)
    try:
        for lo, hi in zip(bounds, bounds[1:]):
            dec.feed(payload[lo:hi])
    except SchemaMismatch:
        with pytest.raises(SchemaMismatch):
            dec.result()
        return
    assert torch.equal(dec.result(), decode(payload, numel, parts))


# --- properties ------------------------------------------------------------------------

shapes = st.lists(st.lists(st.integers(0, 9), max_size=3).map(tuple), min_size=0, max_size=4)


@settings(max_examples=150, deadline=None)
@given(shapes=shapes, parts=st.integers(1, 3), max_record=st.integers(68, 600),
       seed=st.integers(0, 2**16), magnitudes=st.lists(st.integers(-20, 20), min_size=3,
                                                      max_size=3))
def test_stream_round_trip_property(shapes: list[tuple[int, ...]], parts: int,
                                    max_record: int, seed: int, magnitudes: list[int]) -> None:
    schema = StateSchema(tuple(TensorSpec(f"t{i}", s, "float32") for i, s in enumerate(shapes)))
    numel = schema.numel
    gen = torch.Generator().manual_seed(seed)
    flat = torch.cat([torch.randn(numel, generator=gen) * 10.0**magnitudes[p]
                      for p in range(parts)])
    records = [bytes(r) for r in encode_chunks(flat, "int8", max_record, parts=parts)]
    payload = b"".join(records)
    assert len(payload) == encoded_nbytes("int8", numel, parts)
    assert all(0 < len(r) <= max_record for r in records)
    dec = StateDecoder(schema, "int8", parts=parts, min_record=FINE)
    for record in records:
        dec.feed(record)
    got = dec.result()
    for p in range(parts):
        part = slice(p * numel, (p + 1) * numel)
        mine = payload[p * len(payload) // parts : (p + 1) * len(payload) // parts]
        bound = scales_of(mine, numel) * (0.5 + SLACK)
        assert bool(((got[part] - flat[part]).abs() <= bound).all())


# --- CUDA (skipped without a GPU) ------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_flat_encodes_and_decodes_the_same_bytes() -> None:
    x = blocky(5000, seed=3)
    x[100] = math.nan
    payload = encode(x, max_record=1000, parts=2)
    assert encode(x.cuda(), max_record=1000, parts=2) == payload
    dec = StateDecoder(schema_of(2500), "int8", torch.zeros(5000, device="cuda"), parts=2, min_record=FINE)
    for record in encode_chunks(x, "int8", 1000, parts=2):
        dec.feed(record)
    cpu = decode(payload, 2500, 2)
    assert torch.equal(dec.result().cpu().nan_to_num(), cpu.nan_to_num())
