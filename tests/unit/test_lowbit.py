"""Tests for gossip.lowbit, the ``mod`` codecs: names, sizes, exact bytes, decoding against
the receiver's own values, refused periods, the streaming decoder and the transfer of a payload
(the state in ``mod`` cells, an estimate in ``int8`` cells of the same blocks). An encoder and
a decoder written from the spec (docs/PROTOCOL.md section 7.3) in numpy float32 arithmetic
check the bytes and the decoded values of the implementation."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
import trio
import trio.testing

from gossip import codec, int8, lowbit
from gossip.errors import SchemaMismatch
from gossip.messages import StateHeader
from gossip.schema import StateSchema, TensorSpec
from gossip.transfer import receive_state, send_state
from tests.util import pair

BITS = (2, 3, 4)
EPS = 2.0**-23


def schema(numel: int) -> StateSchema:
    return StateSchema((TensorSpec("w", (numel,), "float32"),))


def bf16_periods(count: int, gen: torch.Generator, low: float = 0.25, high: float = 4.0):
    """``count`` periods that are bfloat16 values already (so nothing rounds them up)."""
    theta = low + (high - low) * torch.rand(count, generator=gen)
    return theta.to(torch.bfloat16).float().clamp(min=low)


def carried(spec: lowbit.Spec, numel: int) -> torch.Tensor:
    """Which values of a vector of ``numel`` lie in the blocks ``spec`` carries."""
    return torch.arange(numel) // 64 % spec.fragments == spec.fragment


def int8_close(decoded: torch.Tensor, values: torch.Tensor) -> bool:
    """Within a whole int8 scale (absmax / 127 of its block of ``values``): stochastic rounding."""
    rows = torch.nn.functional.pad(values.abs(), (0, (-values.numel()) % 64)).view(-1, 64)
    scale = (rows.amax(dim=1) / 127).repeat_interleave(64)[: values.numel()]
    return bool(((decoded - values).abs() <= scale * (1 + 1e-5) + EPS * values.abs()).all())


# --- the spec, in numpy float32 (each operation rounded to nearest even) -------------------


def spec_encode(values, bits: int, periods, fragments: int = 1, fragment: int = 0) -> bytes:
    vals, levels, out = np.asarray(values, dtype=np.float32), np.float32(1 << bits), bytearray()
    chosen = range(fragment, -(-len(vals) // 64), fragments)
    assert len(chosen) == len(periods)
    for j, theta in zip(chosen, periods):
        block = vals[64 * j : 64 * j + 64]
        step = np.float32(theta) / levels
        n = np.rint(block / step)
        c = n - levels * np.floor(n / levels)
        word = sum(int(ci) << (bits * i) for i, ci in enumerate(c))
        out += struct.pack("<f", theta)[2:]  # a bfloat16 is the top half of a binary32
        out += word.to_bytes(-(-len(block) * bits // 8), "little")
    return bytes(out)


def spec_decode(data: bytes, bits: int, reference, fragments: int = 1, fragment: int = 0,
                parts: int = 1):
    """A payload of ``parts`` vectors against ``reference``: the state's mod cells, then each
    later vector's values of the same blocks gathered into one vector in int8 cells (a float32
    LE scale, a signed byte a value; as only a last block is short, one cell per block)."""
    ref = np.asarray(reference, dtype=np.float32)
    out, numel = ref.copy(), len(ref) // parts
    levels, at = np.float32(1 << bits), 0
    chosen = [(64 * j, min(64 * j + 64, numel)) for j in range(fragment, -(-numel // 64),
                                                               fragments)]
    for a, b in chosen:
        theta = np.float32(struct.unpack("<f", b"\0\0" + data[at : at + 2])[0])
        size = -(-(b - a) * bits // 8)
        word = int.from_bytes(data[at + 2 : at + 2 + size], "little")
        at += 2 + size
        c = np.array([(word >> (bits * i)) & ((1 << bits) - 1) for i in range(b - a)], np.float32)
        v = c * (theta / levels)
        k = np.rint((ref[a:b] - v) / theta)
        out[a:b] = v + k * theta
    for a, b in ((a + part * numel, b + part * numel) for part in range(1, parts)
                 for a, b in chosen):
        scale = np.frombuffer(data[at : at + 4], "<f4")[0]
        with np.errstate(invalid="ignore", over="ignore"):
            out[a:b] = np.frombuffer(data[at + 4 : at + 4 + b - a], np.int8) * scale
        at += 4 + b - a
    assert at == len(data)
    return out


# --- names ------------------------------------------------------------------------------


@pytest.mark.parametrize("name, spec", [
    ("mod2", lowbit.Spec(2)), ("mod3", lowbit.Spec(3)), ("mod4", lowbit.Spec(4)),
    ("mod4/8:3", lowbit.Spec(4, 8, 3)), ("mod3/2:1", lowbit.Spec(3, 2, 1)),
    ("mod2/64:63", lowbit.Spec(2, 64, 63)), ("mod4/10:0", lowbit.Spec(4, 10, 0)),
])
def test_parse_valid_names(name, spec) -> None:
    assert lowbit.parse(name) == spec and spec.name == name
    assert lowbit.is_lowbit(name) and codec.known(name)
    assert spec.levels == 1 << spec.bits


@pytest.mark.parametrize("name", [
    "mod5", "mod1", "mod0", "mod8", "mod4/1:0", "mod4/8:8", "mod4/65:0", "mod4/8:03", "mod4/08:3",
    "mod4/0:0", "mod4/8", "mod4/8:", "mod4/:3", "mod4/8:-1", "MOD4", "Mod4", "mod4 ", " mod4",
    "mod4\n", "", None, 4, b"mod4", ["mod4"],
])
def test_parse_refuses(name) -> None:
    for call in (lowbit.parse, lambda name: codec.encoded_nbytes(name, 64, 1)):
        with pytest.raises(ValueError):
            call(name)
    assert not lowbit.is_lowbit(name) and not codec.known(name)
    assert codec.known("int8") and not lowbit.is_lowbit("int8")


def test_parse_setting_names_fragments_without_one() -> None:
    for name, spec in (("mod4", lowbit.Spec(4)), ("mod4/8", lowbit.Spec(4, 8)),
                       ("mod4/64", lowbit.Spec(4, 64))):
        assert lowbit.parse_setting(name) == spec and lowbit.is_lowbit_setting(name)
    # mod3 and mod2 decode but are no settings (gossip.config.MOD_SETTING says why).
    for name in ("mod4/8:3", "mod4/1", "mod4/65", "mod4/0", "mod4/08", "mod5", "MOD4", None, 2,
                 "mod2", "mod2/8", "mod3", "mod3/8"):
        with pytest.raises(ValueError):
            lowbit.parse_setting(name)
        assert not lowbit.is_lowbit_setting(name)


# --- sizes ------------------------------------------------------------------------------


# The state's mod cells, and an estimate's int8 cells of the values of the same blocks.
@pytest.mark.parametrize("name, numel, size, estimate", [
    ("mod4", 0, 0, 0), ("mod4", 1, 3, 5), ("mod4", 6, 5, 10), ("mod4", 64, 34, 68),
    ("mod4", 65, 37, 68 + 5), ("mod3", 6, 5, 10), ("mod3", 63, 26, 67), ("mod3", 64, 26, 68),
    ("mod3", 65, 29, 73), ("mod2", 6, 4, 10), ("mod2", 1000, 15 * 18 + 2 + 10, 15 * 68 + 44),
    # blocks 0 and 2 (2 values): 66 values in int8 | block 1
    ("mod4/2:0", 130, 34 + 3, 68 + 4 + 2), ("mod4/2:1", 130, 34, 68),
    ("mod4/8:3", 192, 0, 0), ("mod4/8:3", 200, 6, 12), ("mod4/8:2", 200, 34, 68),
    ("mod4/8:0", 64, 34, 68), ("mod2/4:1", 64, 0, 0),
])
def test_nbytes_examples(name, numel, size, estimate) -> None:
    spec = lowbit.parse(name)
    assert lowbit.nbytes(spec, numel) == size
    assert lowbit.estimate_nbytes(spec, numel) == estimate
    assert codec.encoded_nbytes(name, numel, 0) == 0
    for parts in (1, 2, 3):
        total = size + (parts - 1) * estimate
        assert lowbit.payload_nbytes(spec, numel, parts) == total
        assert codec.encoded_nbytes(name, numel, parts) == total
    for bad_numel, bad_parts in ((-1, 1), (1.0, 1), (numel, -1), (True, 1)):
        with pytest.raises(ValueError):
            codec.encoded_nbytes(name, bad_numel, bad_parts)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("fragments", [1, 2, 3, 8])
def test_nbytes_is_the_sum_of_the_selected_cells(bits, fragments) -> None:
    for fragment in range(fragments):
        spec = lowbit.Spec(bits, fragments, fragment)
        for numel in (0, 1, 63, 64, 65, 127, 128, 129, 200, 513, 1000):
            values = torch.randn(numel)
            rows = list(torch.split(values, 64) if numel else ())[fragment::fragments]
            sizes = [2 + -(-len(b) * bits // 8) for b in rows]
            assert lowbit.nbytes(spec, numel) == sum(sizes), (spec, numel)
            theta = lowbit.periods(values, None)[lowbit.selected(spec, numel)]
            assert lowbit.encode(values, spec, theta).numel() == lowbit.nbytes(spec, numel)
            # The estimate: the carried blocks' values, in order, as one int8 vector.
            taken = torch.cat(rows) if rows else torch.zeros(0)
            assert torch.equal(lowbit.gather(values, spec), taken)
            assert lowbit.estimate_nbytes(spec, numel) == int8.nbytes(taken.numel())
            out, mask = torch.full((numel,), 7.0), carried(spec, numel)
            lowbit.scatter(taken, spec, out)
            assert torch.equal(out[mask], values[mask]) and bool((out[~mask] == 7).all())


# --- exact bytes --------------------------------------------------------------------------

# docs/PROTOCOL.md section 7.3: these values against this receiver, with a period of 1.
EXAMPLE = torch.tensor([1.0, -0.75, 0.5, 3.14159, 1.5, 0.09375])
RECEIVER = torch.tensor([1.2, -0.9, 0.4, 3.3, 2.2, 0.0])


@pytest.mark.parametrize("name, theta, data, decoded", [
    ("mod4", 1.0, "80 3f 40 28 28", [1.0, -0.75, 0.5, 3.125, 2.5, 0.125]),
    ("mod3", 1.0, "80 3f 10 c3 00", [1.0, -0.75, 0.5, 3.125, 2.5, 0.125]),
    ("mod2", 1.0, "80 3f 64 02", [1.0, -0.75, 0.5, 3.25, 2.5, 0.0]),
    # 4 × 3.14159 = 12.56636, rounded up to the bfloat16 12.625 (414a)
    ("mod4", 12.56636, "4a 41 f1 41 02", [0.7890625, -0.7890625, 0.7890625, 3.15625, 1.578125, 0]),
])
def test_exact_bytes_example(name, theta, data, decoded) -> None:
    spec = lowbit.parse(name)
    payload = lowbit.encode(EXAMPLE, spec, torch.tensor([theta]))
    sent = float(payload[:2].view(torch.bfloat16))
    assert bytes(payload.tolist()).hex(" ") == data
    assert bytes(payload.tolist()) == spec_encode(EXAMPLE, spec.bits, [sent])
    out = torch.empty(6)
    lowbit.decode_into(payload, spec, RECEIVER, out)
    assert out.tolist() == decoded
    if theta == 1.0:  # the fifth value is wrapped: 0.7 from the receiver's, > θ/2
        assert out[4] == EXAMPLE[4] + 1.0 and abs(out[4] - RECEIVER[4]) <= 0.5
    else:  # the period the reference takes for a block never measured: 4 × its largest value
        assert torch.equal(codec.lowbit_payload(EXAMPLE, name), payload)


def test_fragment_example_state_in_mod_cells_then_estimate_in_int8_cells() -> None:
    # Section 7.3: two vectors of 130 values, each in blocks of 64, 64 and 2 of its own.
    x = torch.arange(260, dtype=torch.float32) / 100
    reference = x + 0.003
    for f, size, taken, cells in ((0, 37, torch.cat([x[130:194], x[258:]]), 68 + 4 + 2),
                                  (1, 34, x[194:258], 68)):
        name, spec = f"mod4/2:{f}", lowbit.Spec(4, 2, f)
        payload = codec.lowbit_payload(x, name, parts=2)
        data = bytes(payload.tolist())
        assert len(data) == size + cells
        # The state: mod cells, periods from its values alone, as in a payload of one vector.
        assert torch.equal(payload[:size], codec.lowbit_payload(x[:130], name))
        # The estimate: the same blocks' values gathered (the short one stays short), in int8
        # cells rounded stochastically: the scales of rounding to nearest, values within one.
        assert torch.equal(lowbit.gather(x[130:], spec), taken)
        nearest = bytes(next(iter(int8.encode(taken, 1, 1 << 20))))
        assert [data[size + at : size + at + 4] for at in range(0, cells, 68)] == [
            nearest[at : at + 4] for at in range(0, cells, 68)]
        decoder = codec.LowbitDecoder(schema(130), name, reference, parts=2)
        decoder.feed(data)
        decoder.finish()
        got, mask = decoder.result(), carried(spec, 130)
        assert np.array_equal(got.numpy(), spec_decode(data, 4, reference, 2, f, parts=2))
        assert int8_close(got[130:][mask], taken)
        assert torch.equal(got[130:][~mask], reference[130:][~mask])  # the receiver's own


def test_periods_from_the_spread_or_the_values_rounded_up_to_a_bfloat16() -> None:
    values = torch.cat([torch.zeros(64), torch.full((64,), -2.0), torch.tensor([float("nan")])])
    assert lowbit.periods(values, None).tolist() == [lowbit.MIN_PERIOD, 8.0, lowbit.MAX_PERIOD]
    spread = torch.tensor([0.5, float("nan"), 0.25])
    assert lowbit.periods(values, spread).tolist() == [2 * lowbit.MARGIN * 0.5, 8.0,
                                                       2 * lowbit.MARGIN * 0.25]
    # Sent rounded up to a bfloat16, never below 2^-16 of the block's largest value
    # (lowbit.FLOOR: a value of 1 gets at least 2^-16).
    for value, wanted, sent in ((2.0**-120, 1.0, 1.0), (2.0**-120, 1.001, 1.0078125),
                                (2.0**-120, 12.56636, 12.625), (1.0, lowbit.MIN_PERIOD, 2.0**-16),
                                (2.0**-120, lowbit.MIN_PERIOD, lowbit.MIN_PERIOD),
                                (2.0**-120, 3.4e38, lowbit.MAX_PERIOD)):
        data = lowbit.encode(torch.full((1,), value), lowbit.Spec(4), torch.tensor([wanted]))
        assert float(data[:2].view(torch.bfloat16)) == sent


# --- decoding against the receiver's own values -------------------------------------------


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("tail, numel", [("", 1), ("", 7), ("", 63), ("", 64), ("", 1000),
                                         ("/3:2", 1000), ("/2:1", 130), ("/4:0", 65),
                                         ("/8:7", 64 * 9 + 5), ("/4:2", 64 * 9 + 5)])
def test_bytes_are_the_spec_s_and_a_receiver_gets_the_rounded_value(bits, tail, numel) -> None:
    spec = lowbit.parse(f"mod{bits}{tail}")
    gen = torch.Generator().manual_seed(bits * 1000 + numel + spec.fragment)
    values = torch.randn(numel, generator=gen) * 3  # several periods wide
    special = torch.tensor([0.5, 1.5, -0.5, -1.5, 2.5, 0.0, -0.0, 1e-30]) / spec.levels
    values[: min(8, numel)] = special[:numel]  # in block 0's steps, if sent: ties, zeros, tiny
    theta = bf16_periods(lowbit.blocks(numel), gen)  # of every block; the carried ones are sent
    theta[0] = 1.0
    per_value, chosen = theta.repeat_interleave(64)[:numel], theta[lowbit.selected(spec, numel)]
    residual = torch.full((numel,), 7.0)
    payload = lowbit.encode(values, spec, chosen, residual)
    data = bytes(payload.tolist())
    assert data == bytes(lowbit.encode(values.clone(), spec, chosen.clone()).tolist())  # pure
    assert data == spec_encode(values, bits, chosen.tolist(), spec.fragments, spec.fragment)
    step, sent = per_value / spec.levels, carried(spec, numel)
    rounded = torch.round(values / step) * step  # n · step, as the spec computes it in float32
    sign = torch.randint(0, 2, (numel,), generator=gen) * 2 - 1
    close = values + (torch.rand(numel, generator=gen) * 2 - 1) * 0.3 * per_value
    far = values + (0.75 + 2 * torch.rand(numel, generator=gen)) * per_value * sign  # wrapped
    for receiver in (close, far):
        out = torch.full((numel,), float("nan"))
        lowbit.decode_into(payload, spec, receiver, out)
        assert out.tolist() == spec_decode(data, bits, receiver, spec.fragments,
                                           spec.fragment).tolist()
        assert torch.equal(out[~sent], receiver[~sent])  # the blocks not carried
        assert bool(((out - receiver).abs() <= per_value / 2 + EPS * (1 + receiver.abs())).all())
        off = ((out - rounded) / per_value)[sent]  # whole periods: none, or not 0
        assert bool(((off == 0) if receiver is close else (off.round().abs() >= 1)).all())
        assert bool(((off - off.round()).abs() < 1e-4).all())
    assert torch.equal(residual[sent], (values - rounded)[sent])  # error feedback
    assert bool((residual.abs() <= step / 2 + EPS * values.abs())[sent].all())
    assert bool((residual[~sent] == 7).all())


@pytest.mark.parametrize("name", ["mod2", "mod3", "mod4", "mod3/2:1", "mod4/3:2"])
def test_any_bytes_with_valid_periods_stay_within_half_a_period(name) -> None:
    spec = lowbit.parse(name)
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    numel = 64 * 12 + 37
    reference = torch.randn(numel, generator=gen) * 10.0 ** (torch.rand(numel, generator=gen)
                                                             * 6 - 3)
    payload = torch.randint(0, 256, (lowbit.nbytes(spec, numel),), generator=gen,
                            dtype=torch.uint8)
    bits = torch.randint(0x0D80, 0x7F80, (lowbit.selected(spec, numel).numel(),), generator=gen)
    bits[:2] = torch.tensor([0x0D80, 0x7F7F])  # MIN_PERIOD and the largest bfloat16: accepted
    for cell, pattern in enumerate(bits.tolist()):  # each cell is whole but a short last one
        at = cell * spec.cell_bytes(64)
        payload[at : at + 2] = torch.tensor([pattern & 0xFF, pattern >> 8], dtype=torch.uint8)
    out = torch.empty(numel)
    lowbit.decode_into(payload, spec, reference, out)
    assert out.tolist() == spec_decode(bytes(payload.tolist()), spec.bits, reference,
                                       spec.fragments, spec.fragment).tolist()
    per_value = torch.zeros(lowbit.blocks(numel), dtype=torch.float64)
    per_value[lowbit.selected(spec, numel)] = bits.to(torch.int16).view(torch.bfloat16).double()
    per_value = per_value.repeat_interleave(64)[:numel]
    gap = (out.double() - reference.double()).abs()
    assert bool(torch.isfinite(out).all())
    assert bool((gap <= per_value / 2 + 2 * EPS * (per_value + reference.double().abs())).all())


# Bit patterns of bfloat16 periods a decoder refuses.
HOSTILE = {
    "nan": 0x7FC0, "signalling nan": 0x7F81, "negative nan": 0xFFC0, "nan all ones": 0xFFFF,
    "+inf": 0x7F80, "-inf": 0xFF80, "0": 0x0000, "-0": 0x8000, "-1": 0xBF80,
    "-MIN_PERIOD": 0x8D80, "smallest subnormal": 0x0001, "largest subnormal": 0x007F,
    "smallest normal": 0x0080, "2^-101": 0x0D00, "just below MIN_PERIOD": 0x0D7F,
}


@pytest.mark.parametrize("pattern", HOSTILE.values(), ids=HOSTILE.keys())
@pytest.mark.parametrize("cell", [0, 1, 2])  # the first, a middle, the short last
def test_hostile_periods_are_refused_in_the_state_s_cells(pattern, cell) -> None:
    spec, numel, size = lowbit.Spec(4), 64 * 2 + 10, 34 * 2 + 7
    values = torch.randn(numel)
    # In a payload of two vectors, the same bytes at the same place in the estimate's int8
    # cells are values like any others: only the state's cells have periods.
    for at in (34 * cell, size + 34 * cell):
        data = codec.lowbit_payload(torch.cat([values, values]), "mod4", 2)
        data[at : at + 2] = torch.tensor([pattern & 0xFF, pattern >> 8], dtype=torch.uint8)
        decoder = codec.LowbitDecoder(schema(numel), "mod4", torch.cat([values, values]),
                                      parts=2)
        decoder.feed(bytes(data.tolist()))
        if at >= size:
            decoder.finish()
            continue
        with pytest.raises(ValueError, match="period"):
            lowbit.decode_into(data[:size], spec, values, torch.empty(numel))
        with pytest.raises(SchemaMismatch, match="vector 0"):
            decoder.finish()
        with pytest.raises(SchemaMismatch, match="failed"):
            decoder.result()


def test_the_estimate_s_int8_cells_decode_any_bytes() -> None:
    # mod4/2:1 over 330 values carries blocks 1, 3 and 5 (10 values): int8 cells of 68, 68
    # and 14 bytes. A NaN scale makes its block NaN, and only that block (left to the value
    # checks of section 9.4); -128 decodes; the blocks not carried are the receiver's own.
    spec, numel = lowbit.parse("mod4/2:1"), 64 * 5 + 10
    reference, mask = torch.randn(2 * numel), carried(spec, numel)
    state = codec.lowbit_payload(reference, "mod4/2:1", 2)[: lowbit.nbytes(spec, numel)]
    for seed in range(4):
        rest = torch.randint(0, 256, (lowbit.estimate_nbytes(spec, numel),), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(seed))
        rest[:4] = torch.tensor([0, 0, 0, 0x3F], dtype=torch.uint8)  # 0.5
        if seed == 0:
            rest[68:72] = torch.tensor([0, 0, 0xC0, 0x7F], dtype=torch.uint8)  # NaN
            rest[136:141] = torch.tensor([0, 0, 0x80, 0x3F, 0x80], dtype=torch.uint8)  # 1, -128
        data = bytes(torch.cat([state, rest]).tolist())
        decoder = codec.LowbitDecoder(schema(numel), "mod4/2:1", reference, parts=2)
        decoder.feed(data)
        decoder.finish()  # never refused
        got = decoder.result()[numel:]
        expected = spec_decode(data, 4, reference, 2, 1, parts=2)[numel:]
        assert np.array_equal(got, expected, equal_nan=True)
        assert torch.equal(got[~mask], reference[numel:][~mask])
        assert bool(torch.isfinite(got[:192]).all()) and got[64:128].abs().max() <= 64
        if seed == 0:
            assert bool(got[192:256].isnan().all()) and bool(torch.isfinite(got[256:]).all())
            assert got[320] == -128


def test_decode_wants_the_exact_size_ignores_the_padding_bits_and_stays_finite() -> None:
    spec, values = lowbit.Spec(4), torch.linspace(-1, 1, 65)
    payload = lowbit.encode(values, spec, torch.ones(2))
    for data in (payload[:-1], torch.cat([payload, payload[:1]])):
        with pytest.raises(ValueError, match="bytes"):
            lowbit.decode_into(data, spec, values, torch.empty(65))
    assert int(payload[-1]) >> 4 == 0  # the short cell's last byte: one code, 4 zero bits
    padded, out, other = payload.clone(), torch.empty(65), torch.empty(65)
    padded[-1] |= 0xF0
    lowbit.decode_into(payload, spec, values, out)
    lowbit.decode_into(padded, spec, values, other)
    assert torch.equal(out, other)
    # The largest θ, code 15, against a receiver near float32's least value: clamped. A large
    # value in a small period (error feedback): the period is floored.
    out, residual = torch.empty(1), torch.zeros(1)
    lowbit.decode_into(torch.tensor([0x7F, 0x7F, 0x0F], dtype=torch.uint8), spec,
                       torch.tensor([-3e38]), out)
    lowbit.encode(torch.tensor([1e30]), spec, torch.tensor([lowbit.MIN_PERIOD]), residual)
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(residual).all())


# --- the streaming decoder ----------------------------------------------------------------


def test_records_may_cut_the_payload_anywhere_and_go_in_place() -> None:
    n = 40000  # a payload of three least records and more
    flat = torch.randn(2 * n)
    reference = flat + 0.01 * torch.randn(2 * n)
    data = bytes(codec.lowbit_payload(flat, "mod3", 2).tolist())
    assert len(data) == lowbit.nbytes(lowbit.Spec(3), n) + int8.nbytes(n) > 3 * lowbit.MIN_RECORD
    expected = spec_decode(data, 3, reference, parts=2).tolist()
    whole = codec.LowbitDecoder(schema(n), "mod3", reference, parts=2)
    whole.feed(data)
    assert whole.done and whole.decoded == 0
    whole.finish()
    assert whole.decoded == 2 * n and whole.result().tolist() == expected
    assert int8_close(whole.result()[n:], flat[n:])  # the estimate, in int8
    cut = codec.LowbitDecoder(schema(n), "mod3", reference, parts=2)
    at = 0
    for size in (lowbit.MIN_RECORD + 1, lowbit.MIN_RECORD + 7, len(data)):  # inside cells
        assert cut.remaining_bytes == len(data) - at
        cut.feed(memoryview(data)[at : at + size])
        at = min(at + size, len(data))
    cut.finish()
    assert cut.result().tolist() == expected
    out = torch.full((2 * n,), float("nan"))
    windows = codec.LowbitDecoder(schema(n), "mod3", reference, out, parts=2)
    for limit in (lowbit.MIN_RECORD, lowbit.MIN_RECORD + 7, 1 << 20):
        window = windows.window(limit)
        assert len(window) == min(limit, windows.remaining_bytes)
        window[:] = data[len(data) - windows.remaining_bytes :][: len(window)]
        windows.wrote(len(window))
    assert windows.done and len(windows.window(10)) == 0
    windows.finish()
    windows.finish()  # once done, finishing again changes nothing
    assert windows.result() is out and out.tolist() == expected


def test_decoder_refuses_what_does_not_fit() -> None:
    reference = torch.randn(100)
    data = bytes(codec.lowbit_payload(reference + 0.01, "mod3").tolist())
    decoder = codec.LowbitDecoder(schema(100), "mod3", reference)
    with pytest.raises(SchemaMismatch, match="finish"):
        decoder.result()
    with pytest.raises(SchemaMismatch, match="incomplete"):
        decoder.finish()
    with pytest.raises(SchemaMismatch, match="remaining"):
        decoder.feed(data + b"\0")  # past the payload's size
    assert decoder.window(1 << 20) is None  # a failed decoder offers nowhere to write
    with pytest.raises(SchemaMismatch, match="failed"):
        decoder.feed(data)
    for empty in (lambda d: d.feed(b""), lambda d: d.wrote(0)):
        with pytest.raises(SchemaMismatch, match="0 bytes"):
            empty(codec.LowbitDecoder(schema(100), "mod3", reference))
    with pytest.raises(SchemaMismatch):
        codec.LowbitDecoder(schema(100), "mod3", reference, parts=2)  # a reference too short
    with pytest.raises(ValueError):
        codec.LowbitDecoder(schema(100), "int8", reference)


def test_encode_chunks_of_a_mod_codec_is_the_payload_in_records_of_any_size() -> None:
    flat = torch.randn(1000)
    payload = bytes(codec.lowbit_payload(flat, "mod4/3:1").tolist())
    assert len(payload) == codec.encoded_nbytes("mod4/3:1", 1000)
    for size in (1, 7, 34, 1 << 20):
        records = [bytes(r) for r in codec.encode_chunks(flat, "mod4/3:1", size)]
        assert b"".join(records) == payload and max(map(len, records)) <= size
        records = [len(r) for r in codec.encode_chunks(flat, "mod4/3:1", size, parts=2)]
        assert sum(records) == codec.encoded_nbytes("mod4/3:1", 500, 2) and max(records) <= size
    with pytest.raises(ValueError):
        list(codec.encode_chunks(flat, "mod4", 0))


def test_lowbit_payload_with_error_feedback() -> None:
    # Periods and error feedback are the state's: the estimate travels in int8, as it is.
    gen = torch.Generator().manual_seed(5)
    flat = torch.randn(300, generator=gen)
    size = 34 + 34 + 13  # the state's 150 values in mod4
    for length in (150, 300):  # the state's residual (gossip.feedback), or one like flat
        residual = 0.01 * torch.randn(length, generator=gen)
        before = residual.clone()
        payload = codec.lowbit_payload(flat, "mod4", 2, [torch.full((3,), 0.1), None], residual)
        assert payload.numel() == size + int8.nbytes(150) == codec.encoded_nbytes("mod4", 150, 2)
        periods = {float(payload[at : at + 2].view(torch.bfloat16)) for at in (0, 34, 68)}
        want = 2 * lowbit.MARGIN * 0.1  # rounded up to a bfloat16 (8 significant bits)
        assert len(periods) == 1 and want <= periods.pop() < want * (1 + 2**-7)
        sent = flat[:150] + before[:150]
        out = torch.from_numpy(spec_decode(bytes(payload.tolist()), 4, torch.cat([sent, sent]),
                                           parts=2))
        assert torch.equal(residual[:150], sent - out[:150])
        assert not torch.equal(residual[:150], before[:150])
        assert torch.equal(residual[150:], before[150:])
        assert int8_close(out[150:], flat[150:])


# --- transfer -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mod4", "mod2/4:1"])
async def test_full_duplex_exchange_of_mod_payloads(name) -> None:
    alice, bob, _ = await pair()
    numel, spec = 1_100_000, lowbit.parse(name)  # in mod4, 1.75 MB: two records
    state, mask, gen = schema(numel), carried(spec, numel), torch.Generator().manual_seed(9)
    mine = {"a": torch.randn(2 * numel, generator=gen)}
    mine["b"] = mine["a"] + 0.01 * torch.randn(2 * numel, generator=gen)
    got = {}

    async def side(me, channel):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_state, channel, mine[me], state, name)
            got[me] = await receive_state(channel, state, name, parts=2,
                                          reference=mine[me].clone())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(side, "a", alice)
        nursery.start_soon(side, "b", bob)
    for me, peer in (("a", "b"), ("b", "a")):
        header, flat = got[me]
        assert header.codec == name and header.nbytes == codec.encoded_nbytes(name, numel, 2)
        assert header.nbytes == lowbit.nbytes(spec, numel) + lowbit.estimate_nbytes(spec, numel)
        # The state: mod cells with periods from the values alone, decoded against our own.
        expected = torch.empty(numel)
        lowbit.decode_into(codec.lowbit_payload(mine[peer][:numel], name), spec,
                           mine[me][:numel], expected)
        assert torch.equal(flat[:numel], expected)
        assert not torch.equal(flat[:numel], mine[me][:numel])  # the peer's values did arrive
        # The estimate: the peer's carried blocks within an int8 scale; the others our own.
        estimate, own, theirs = flat[numel:], mine[me][numel:], mine[peer][numel:]
        assert int8_close(estimate[mask], theirs[mask])
        assert torch.equal(estimate[~mask], own[~mask])


async def test_a_receiver_decodes_once_its_reference_is_ready_and_refuses_bad_sizes() -> None:
    alice, bob, _ = await pair()
    numel, state = 1000, schema(1000)
    sent = torch.randn(numel)
    own = sent + 0.01 * torch.randn(numel)
    reference = torch.full((numel,), 1e6)  # not the snapshot yet
    ready, got, residual = trio.Event(), [], torch.zeros(numel)
    payload = codec.lowbit_payload(sent, "mod4", 1, [torch.full((16,), 0.05)], residual)
    for wrong in (payload[:-1], torch.cat([payload, payload[:1]])):
        with pytest.raises(ValueError, match="payload"):  # before anything is sent
            await send_state(alice, sent, state, "mod4", payload=wrong)

    async def receive():
        got.append(await receive_state(bob, state, "mod4", reference=reference,
                                       reference_ready=ready))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(receive)
        await send_state(alice, sent, state, "mod4", payload=payload)
        await trio.testing.wait_all_tasks_blocked()
        assert not got  # every byte is in, but the reference is not ready
        reference.copy_(own)
        ready.set()
    expected = torch.empty(numel)
    lowbit.decode_into(payload, lowbit.Spec(4), own, expected)
    assert torch.equal(got[0][1], expected) and torch.equal(expected, sent - residual)
    await alice.send_message(StateHeader(state.fingerprint, "mod4", 0, 0, payload.numel()))
    await alice.send(b"")
    with pytest.raises(SchemaMismatch, match="0 bytes"):
        await receive_state(bob, state, "mod4", reference=own)


# --- devices ------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("name", ["mod2", "mod3", "mod4", "mod4/3:1"])
def test_the_same_bytes_and_values_on_cuda(name) -> None:
    spec = lowbit.parse(name)
    gen = torch.Generator().manual_seed(3)
    numel = 64 * 40 + 21
    values = torch.randn(numel, generator=gen) * 10.0 ** torch.randint(-4, 4, (numel,),
                                                                      generator=gen)
    reference = values + 0.001 * torch.randn(numel, generator=gen)
    spread = [torch.rand(lowbit.blocks(numel), generator=gen) * 1e-3]
    res_cpu, res_gpu = torch.zeros(numel), torch.zeros(numel, device="cuda")
    cpu = codec.lowbit_payload(values, name, 1, spread, res_cpu)
    gpu = codec.lowbit_payload(values.cuda(), name, 1, spread, res_gpu)
    assert gpu.device.type == "cpu" and torch.equal(cpu, gpu)
    assert torch.equal(res_cpu, res_gpu.cpu())
    out_cpu, out_gpu = torch.empty(numel), torch.empty(numel, device="cuda")
    lowbit.decode_into(cpu, spec, reference, out_cpu)
    lowbit.decode_into(cpu, spec, reference.cuda(), out_gpu)
    assert torch.equal(out_cpu, out_gpu.cpu())
    # With an estimate, in int8 cells of the same blocks: decoded alike on either device.
    estimate = codec.lowbit_payload(torch.cat([values, values]), name, 2)[cpu.numel() :]
    outs, both = [], torch.cat([reference, reference])
    for device in ("cpu", "cuda"):
        decoder = codec.LowbitDecoder(schema(numel), name, both.to(device),
                                      torch.empty(2 * numel, device=device), parts=2)
        decoder.feed(bytes(torch.cat([cpu, estimate]).tolist()))
        decoder.finish()
        outs.append(decoder.result().cpu())
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1][:numel], out_cpu)
