"""The OCP MX codecs (k3train/quant/mx.py): exact decoding of every code, scale selection, round-to-nearest-even with
saturation, zero / subnormal / overflowing blocks, NaN handling, nibble packing -- against hand-computed values, a
brute-force nearest-value reference written here, and torch's own float8_e4m3fn / float8_e8m0fnu decodings."""
from __future__ import annotations

import math

import pytest
import torch

from k3train.quant import mx

E2M1_MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # codes 0..7 (OCP MX v1.0, table 5)
SCALE_CODES = [0, 1, 2, 50, 100, 120, 126, 127, 128, 130, 160, 200, 250, 253, 254]


def _e2m1_value(code: int) -> float:
    return (-1.0 if code & 8 else 1.0) * E2M1_MAGNITUDES[code & 7]


def _nearest_even(v: float, magnitudes: list[float], max_normal: float) -> tuple[float, int]:
    """Brute force: the representable magnitude nearest to |v| (ties: the even code), saturating; and its index."""
    a = min(abs(v), max_normal)
    best = min(range(len(magnitudes)), key=lambda i: (abs(magnitudes[i] - a), i % 2))
    return math.copysign(magnitudes[best], v), best


def _e4m3_magnitudes() -> list[float]:
    # codes 0..0x7E: every finite non-negative E4M3 value in code order, straight from torch's decoding
    return torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).double().tolist()


def _reference_fake_quant(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Spec algorithm, one block at a time in Python floats: X = 2**(floor(log2 amax) - emax) clamped to E8M0,
    then each element to the nearest value (ties to even), saturating."""
    f = mx.element_format(fmt)
    mags = E2M1_MAGNITUDES if fmt == "mxfp4" else _e4m3_magnitudes()
    out = []
    for block in x.double().reshape(-1, 32).tolist():
        amax = max(abs(v) for v in block)
        fl = math.floor(math.log2(amax)) if amax else -1000
        if amax and 2.0 ** fl > amax:  # math.log2 rounded up to the next power of two: the exact binade
            fl -= 1
        e = min(max(fl - f.emax, -127), 127)
        scale = 2.0 ** e
        out.append([_nearest_even(v / scale, mags, f.max_normal)[0] * scale for v in block])
    return torch.tensor(out, dtype=torch.float64).reshape(x.shape)


def _varied(shape: tuple[int, ...], seed: int, dtype=torch.float32) -> torch.Tensor:
    """Random blocks spanning magnitudes 2**-140 .. 2**60 (every block its own range) with exact zeros mixed in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    blk = torch.randint(-140, 60, (*shape[:-1], shape[-1] // 32, 1), generator=g).double()
    x = (x.reshape(*shape[:-1], -1, 32) * torch.exp2(blk)).reshape(shape)
    x[torch.rand(shape, generator=g) < 0.05] = 0.0
    return x.to(dtype)


# ---- decoding ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_e2m1_code_times_every_scale_decodes_exactly(dtype):
    codes = torch.arange(16, dtype=torch.uint8).repeat(2)  # one block holding all 16 codes twice
    for s in SCALE_CODES:
        got = mx.dequantize(codes, torch.tensor([s], dtype=torch.uint8), "mxfp4", dtype)
        want = torch.tensor([math.ldexp(_e2m1_value(int(c)), s - 127) for c in codes], dtype=torch.float64)
        assert torch.equal(got, want.to(dtype)), s  # fp32: 2**-128 is a subnormal, 6 * 2**127 overflows to inf
        assert torch.equal(torch.signbit(got), torch.signbit(want)), s  # code 8 is -0.0
        if torch.isfinite(got).all():  # the block holds +-6: its scale comes back, so every code does too
            c2, s2 = mx.quantize(got, "mxfp4")
            assert torch.equal(c2, codes) and int(s2) == s, s


def test_code_tables_match_torch_float8_decodings():
    e4m3 = mx.code_values("mxfp8", torch.float64)
    ref = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    assert torch.equal(torch.isnan(e4m3), torch.isnan(ref)) and torch.isnan(e4m3).sum() == 2  # 0x7F, 0xFF
    assert torch.equal(e4m3.nan_to_num(), ref.nan_to_num()) and float(e4m3.nan_to_num().max()) == 448.0
    assert e4m3[1].item() == 2.0 ** -9  # the smallest subnormal
    scales = torch.arange(256, dtype=torch.uint8)
    e8m0 = mx.e8m0_values(scales, torch.float64)
    ref8 = scales.view(torch.float8_e8m0fnu).double()
    assert torch.isnan(e8m0[255]) and torch.equal(e8m0[:255], ref8[:255])
    assert mx.code_values("mxfp4").tolist() == [_e2m1_value(c) for c in range(16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_e4m3_code_times_scales_decodes_exactly(dtype):
    all_codes = torch.arange(256, dtype=torch.uint8).reshape(8, 32)
    table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double().reshape(8, 32)
    for s in SCALE_CODES:
        got = mx.dequantize(all_codes, torch.full((8, 1), s, dtype=torch.uint8), "mxfp8", dtype)
        want = (table * 2.0 ** (s - 127)).to(dtype)
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num()), s
    nan_scale = mx.dequantize(all_codes, torch.full((8, 1), 0xFF, dtype=torch.uint8), "mxfp8")
    assert torch.isnan(nan_scale).all()


# ---- scale selection and rounding ---------------------------------------------------------------------------------
def test_scale_follows_floor_log2_amax_minus_emax():
    def scale_code(amax: float, fmt: str) -> int:
        x = torch.zeros(32, dtype=torch.float64)
        x[3] = -amax
        return int(mx.quantize(x, fmt)[1])

    assert scale_code(6.0, "mxfp4") == 127  # floor(log2 6) - 2 = 0
    assert scale_code(4.0, "mxfp4") == 127 and scale_code(7.99, "mxfp4") == 127
    assert scale_code(3.99, "mxfp4") == 126 and scale_code(8.0, "mxfp4") == 128
    assert scale_code(448.0, "mxfp8") == 127 and scale_code(256.0, "mxfp8") == 127 and scale_code(512.0, "mxfp8") == 128
    assert scale_code(2.0 ** -130, "mxfp4") == 0  # below E8M0's range: clamped to 2**-127
    assert scale_code(1e300, "mxfp4") == 254  # above it (fp64 input): clamped to 2**127, the elements saturate


def test_round_to_nearest_even_at_ties_e2m1():
    # amax 6 -> X = 1, so the elements are rounded as they are
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, -5.0]
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -2.0, -4.0]  # the neighbour with mantissa bit 0
    near = [0.26, 0.74, 1.24, 2.49, 2.51, 3.49, 5.01, 6.5]
    want_near = [0.5, 0.5, 1.0, 2.0, 3.0, 3.0, 6.0, 6.0]
    vals = ties + near
    for k in (0, -10, 20):  # the same at another scale
        x = torch.zeros(32, dtype=torch.float64)
        x[0] = 6.0 * 2.0 ** k
        x[1:1 + len(vals)] = torch.tensor(vals, dtype=torch.float64) * 2.0 ** k
        got = mx.fake_quant(x, "mxfp4")[1:1 + len(vals)]
        expected = torch.tensor(want + want_near, dtype=torch.float64) * 2.0 ** k
        assert torch.equal(got, expected) and torch.equal(got.signbit(), expected.signbit()), k
    codes, _ = mx.quantize(torch.tensor([6.0, 0.25, 0.75, 5.0, -0.25, -2.5] + [0.0] * 26), "mxfp4")
    assert codes[:6].tolist() == [7, 0, 2, 6, 8, 12]


def test_round_to_nearest_even_at_ties_e4m3():
    x = torch.zeros(32, dtype=torch.float64)
    x[0] = 448.0  # X = 1
    # ties at 8.5 (between 8 and 9: 8 is even), 9.5 (-> 10), 2**-9 * 0.5 (-> 0), 2**-9 * 1.5 (-> 2**-8),
    # 464 (halfway to the unrepresentable 480: 448, even); 470 and -460 saturate at +-448
    vals = [8.5, 9.5, 2.0 ** -10, 3 * 2.0 ** -10, 464.0, 470.0, -460.0, 13.0, 0.1]
    x[1:1 + len(vals)] = torch.tensor(vals, dtype=torch.float64)
    got = mx.fake_quant(x, "mxfp8")[1:1 + len(vals)]
    assert got.tolist() == [8.0, 10.0, 0.0, 2.0 ** -8, 448.0, 448.0, -448.0, 13.0,
                            float(torch.tensor(0.1).to(torch.float8_e4m3fn).double())]


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_brute_force_reference_on_varied_blocks(fmt, dtype):
    x = _varied((3, 64), seed=1 if fmt == "mxfp4" else 2, dtype=dtype)
    got = mx.fake_quant(x, fmt)
    assert got.dtype == dtype
    assert torch.equal(got.double(), _reference_fake_quant(x, fmt).to(dtype).double())


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_encode_decode_encode_is_stable_and_fake_quant_is_the_codec(fmt, dtype):
    x = _varied((4, 3, 96), seed=3, dtype=dtype)
    codes, scales = mx.quantize(x, fmt)
    assert codes.shape == x.shape and scales.shape == (4, 3, 3) and codes.dtype == scales.dtype == torch.uint8
    deq = mx.dequantize(codes, scales, fmt, dtype)
    fq = mx.fake_quant(x, fmt)
    assert torch.equal(fq, deq) and torch.equal(fq.signbit(), deq.signbit())  # bit for bit, -0.0 included
    c2, s2 = mx.quantize(deq, fmt)
    assert torch.equal(c2, codes) and torch.equal(s2, scales)
    assert torch.equal(mx.fake_quant(fq, fmt), fq)  # idempotent


def test_bf16_input_quantizes_like_its_fp32_value():
    x = _varied((2, 64), seed=4, dtype=torch.bfloat16)
    assert torch.equal(mx.fake_quant(x), mx.fake_quant(x.float()).to(torch.bfloat16))
    assert all(torch.equal(a, b) for a, b in zip(mx.quantize(x), mx.quantize(x.float())))


# ---- special blocks -----------------------------------------------------------------------------------------------
def test_zero_blocks():
    x = torch.zeros(2, 64)
    x[1, 32:] = torch.linspace(-3, 3, 32)  # a zero block beside a normal one: scales are per block
    codes, scales = mx.quantize(x)
    assert scales.tolist() == [[0, 0], [0, 126]]  # zero blocks: the smallest scale; the other: floor(log2 3) - 2
    assert (codes[0] == 0).all() and (codes[1, :32] == 0).all()
    deq = mx.dequantize(codes, scales)
    assert (deq[:, :32] == 0).all() and (deq[0] == 0).all() and not deq.signbit()[:, :32].any()
    neg = mx.quantize(-torch.zeros(32))[0]
    assert (neg == 8).all()  # -0.0 keeps its sign: code 8


def test_subnormal_range_blocks():
    # elements far below the block max land on E2M1's subnormal 0.5 * X or on zero
    x = torch.zeros(32, dtype=torch.float64)
    x[:6] = torch.tensor([6.0, 0.5, -0.5, 0.3, 0.25, -0.2])
    assert mx.fake_quant(x)[:6].tolist() == [6.0, 0.5, -0.5, 0.5, 0.0, -0.0]
    assert mx.quantize(x)[0][:6].tolist() == [7, 1, 9, 1, 0, 8]
    # a block whose max is below E8M0's smallest scale times 4: X clamps to 2**-127, fp32 subnormal inputs
    tiny = torch.tensor([3.0, 1.0, 0.5, 0.24, 1.2, -2.6] + [0.0] * 26, dtype=torch.float64) * 2.0 ** -127
    got = mx.fake_quant(tiny.float())
    want = torch.tensor([3.0, 1.0, 0.5, 0.0, 1.0, -3.0] + [0.0] * 26, dtype=torch.float64) * 2.0 ** -127
    assert int(mx.quantize(tiny.float())[1]) == 0 and torch.equal(got.double(), want)
    assert mx.dequantize(*mx.quantize(tiny.float()))[2].item() == 2.0 ** -128  # 0.5 * 2**-127, an fp32 subnormal


def test_values_past_the_largest_representable_saturate():
    x = torch.tensor([7.5, -7.9, 6.0, 5.5] + [0.0] * 28)  # amax 7.9 -> X = 1; 7.5 and 7.9 clamp to 6
    assert mx.fake_quant(x)[:4].tolist() == [6.0, -6.0, 6.0, 6.0]
    assert mx.quantize(x)[0][:2].tolist() == [7, 15]
    huge = torch.full((32,), 1e300, dtype=torch.float64)  # beyond 6 * 2**127: the largest MXFP4 value
    codes, scales = mx.quantize(huge)
    assert int(scales) == 254 and (codes == 7).all()
    assert (mx.fake_quant(huge) == 6.0 * 2.0 ** 127).all()
    big8 = torch.tensor([500.0, 300.0] + [0.0] * 30, dtype=torch.float64)  # X = 1: 500 rounds to 512, past 448
    assert mx.fake_quant(big8, "mxfp8")[:2].tolist() == [448.0, 288.0]  # E4M3 saturates at 448 (it has no inf)


def test_nan_and_inf_blocks():
    x = torch.ones(3, 32)
    x[0, 5] = float("nan")
    x[1, 0] = float("inf")
    for fmt, nan_code in (("mxfp4", 0), ("mxfp8", 0x7F)):
        codes, scales = mx.quantize(x, fmt)
        assert scales.squeeze(-1).tolist() == [0xFF, 0xFF, 127 - (2 if fmt == "mxfp4" else 8)]
        assert (codes[:2] == nan_code).all()
        deq, fq = mx.dequantize(codes, scales, fmt), mx.fake_quant(x, fmt)
        assert deq[:2].isnan().all() and fq[:2].isnan().all() and torch.equal(deq[2], fq[2]) and (fq[2] == 1).all()
    nan_elems = torch.tensor([0x7F, 0xFF] + [0x38] * 30, dtype=torch.uint8)  # E4M3 NaN codes in a finite block
    d = mx.dequantize(nan_elems, torch.tensor([127], dtype=torch.uint8), "mxfp8")
    assert d[:2].isnan().all() and (d[2:] == 1.0).all()


# ---- packing and errors -------------------------------------------------------------------------------------------
def test_pack_unpack_round_trip_and_known_bytes():
    codes = torch.randint(0, 16, (3, 5, 64), generator=torch.Generator().manual_seed(5), dtype=torch.uint8)
    packed = mx.pack_e2m1(codes)
    assert packed.shape == (3, 5, 32) and packed.dtype == torch.uint8
    assert torch.equal(mx.unpack_e2m1(packed), codes)
    # element 2j in the low nibble, 2j+1 in the high one (compressed-tensors mxfp4-pack-quantized)
    assert mx.pack_e2m1(torch.tensor([1, 7, 0x0F, 0x02], dtype=torch.uint8)).tolist() == [0x71, 0x2F]
    assert mx.unpack_e2m1(torch.tensor([0xA3], dtype=torch.uint8)).tolist() == [0x3, 0xA]
    # a known value: [0.5, 6, -1.5, 2] at X = 1 (block max 6) packs to bytes 0x71, 0x4B
    x = torch.tensor([0.5, 6.0, -1.5, 2.0] + [0.0] * 28)
    c, s = mx.quantize(x)
    assert mx.pack_e2m1(c)[:2].tolist() == [0x71, 0x4B] and int(s) == 127


def test_bad_inputs_raise_one_clear_error():
    with pytest.raises(ValueError, match="multiple of 32"):
        mx.quantize(torch.ones(4, 48))
    with pytest.raises(ValueError, match="multiple of 32"):
        mx.fake_quant(torch.ones(31))
    with pytest.raises(TypeError, match="float32"):
        mx.quantize(torch.ones(32, dtype=torch.int32))
    with pytest.raises(ValueError, match="format"):
        mx.quantize(torch.ones(32), "mxfp6")
    with pytest.raises(ValueError, match="scales shape"):
        mx.dequantize(torch.zeros(64, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="unpack"):
        mx.dequantize(torch.full((32,), 0x71, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="< 16"):
        mx.pack_e2m1(torch.tensor([16, 0], dtype=torch.uint8))
