"""OCP Microscaling (MX v1.0) numerics: MXFP4 (E2M1 elements) and MXFP8 (E4M3 elements), 32 per E8M0 scale.

An MX block is 32 consecutive elements along the LAST dimension (callers put the matmul's reduction dimension
there) sharing one scale ``X = 2**(s - 127)``, ``s`` an unsigned byte (E8M0: exponent only, bias 127, ``0xFF`` =
NaN). Element ``i`` of the block is ``X * P_i`` with ``P_i`` in the element format:

    E2M1 (FP4, MXFP4): sign, 2 exponent bits (bias 1), 1 mantissa bit, no inf/NaN. Magnitudes by code 0..7:
        0, 0.5 (the one subnormal), 1, 1.5, 2, 3, 4, 6; codes 8..15 are the same with the sign bit (bit 3) set.
    E4M3 (FP8, MXFP8, the "fn" variant): sign, 4 exponent bits (bias 7), 3 mantissa bits, max normal 448,
        no inf; codes 0x7F and 0xFF are NaN. Subnormals 2**-9 * m.

Conversion (spec section 6.3, the algorithm that quantizes a vector of fp32/bf16 numbers to MX):

    shared_exp = floor(log2(max_i |V_i|)) - emax_elem      emax_elem = 2 (E2M1, 6 = 1.5 * 2**2), 8 (E4M3)
    X = 2**shared_exp, shared_exp clamped to E8M0's range [-127, 127]
    P_i = V_i / X rounded to the element format, round-to-nearest, ties to even, saturating at the max normal

A block whose max is 0 gets the smallest scale (code 0, ``2**-127``; its elements are all zero either way); a
block holding a NaN or an infinity gets the NaN scale 0xFF (the whole block decodes to NaN). Everything here is
exact: scales are built from their bits, and multiplying by a power of two in fp32/fp64 is exact where the
result is representable (down to 0.5 * 2**-127 and 2**-9 * 2**-127, both fp32 subnormals).

Packing (:func:`pack_e2m1` / :func:`unpack_e2m1`): two E2M1 codes per byte, element ``2j`` in the LOW nibble and
``2j + 1`` in the high nibble -- the layout of compressed-tensors' ``mxfp4-pack-quantized`` ``weight_packed``
(``[out, in/2]`` uint8 beside ``weight_scale`` ``[out, in/32]`` E8M0 bytes; vLLM reads low nibble first too).

Functions (``fmt`` is ``"mxfp4"`` or ``"mxfp8"``; ``x[..., K]`` with ``K % 32 == 0``, fp32 / bf16 / fp16 / fp64):

    quantize(x, fmt)            -> (codes uint8 [..., K], scales uint8 [..., K/32])   the reference path
    dequantize(codes, scales, fmt, dtype) -> [..., K]
    fake_quant(x, fmt)          -> [..., K] in x.dtype, == dequantize(*quantize(x, fmt)) bit for bit (the QAT path:
                                   no codes, no table look-ups)
    pack_e2m1(codes[..., K]) -> [..., K/2];  unpack_e2m1(packed[..., K/2]) -> [..., K]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # elements per shared scale (OCP MX: k = 32 for every concrete format)
E8M0_BIAS = 127
E8M0_NAN = 0xFF
SCALE_EXP_MIN, SCALE_EXP_MAX = -127, 127  # the exponents of E8M0 codes 0..254


@dataclass(frozen=True)
class ElementFormat:
    """A sign + ``ebits`` exponent + ``mbits`` mantissa minifloat (exponent field 0 = subnormal)."""

    name: str
    ebits: int
    mbits: int
    bias: int
    max_normal: float
    emax: int  # exponent of the largest normal (the spec's emax_elem)
    nan_codes: tuple[int, ...] = ()

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal (subnormals share its quantum)."""
        return 1 - self.bias

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits


E2M1 = ElementFormat("e2m1", ebits=2, mbits=1, bias=1, max_normal=6.0, emax=2)
E4M3 = ElementFormat("e4m3", ebits=4, mbits=3, bias=7, max_normal=448.0, emax=8, nan_codes=(0x7F, 0xFF))
FORMATS = {"mxfp4": E2M1, "mxfp8": E4M3}


def element_format(fmt: str | ElementFormat) -> ElementFormat:
    if isinstance(fmt, ElementFormat):
        return fmt
    if fmt not in FORMATS:
        raise ValueError(f"mx: format must be one of {sorted(FORMATS)}, got {fmt!r}")
    return FORMATS[fmt]


# ----------------------------------------------------------------------------------------------------------------
# Exact powers of two and the element tables
# ----------------------------------------------------------------------------------------------------------------
def pow2(k: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``2.0 ** k`` for an integer tensor ``k`` in [-1022, 1023], exact: the fp64 is built from its exponent bits,
    then cast (exact whenever the power is representable in ``dtype``, e.g. 2**-127 as an fp32 subnormal)."""
    bits = (k.to(torch.int64) + 1023) << 52
    return bits.view(torch.float64).to(dtype)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise TypeError(f"mx: expected a float32 / bfloat16 / float16 / float64 tensor, got {dtype}")
    return torch.float64 if dtype == torch.float64 else torch.float32


def code_values(fmt: str | ElementFormat, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The value of every code of ``fmt`` (``[2**bits]``; NaN at its NaN codes), computed from the bit fields."""
    f = element_format(fmt)
    codes = torch.arange(2 ** f.bits, dtype=torch.int64)
    sign = torch.where((codes >> (f.ebits + f.mbits)) & 1 == 1, -1.0, 1.0).to(torch.float64)
    exp_field = (codes >> f.mbits) & ((1 << f.ebits) - 1)
    mant = (codes & ((1 << f.mbits) - 1)).to(torch.float64)
    subnormal = mant * pow2(torch.full_like(codes, f.emin - f.mbits), torch.float64)
    normal = (1.0 + mant / 2 ** f.mbits) * pow2(exp_field - f.bias, torch.float64)
    vals = sign * torch.where(exp_field == 0, subnormal, normal)
    for c in f.nan_codes:
        vals[c] = float("nan")
    return vals.to(dtype)


def e8m0_values(scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """E8M0 codes (uint8) -> ``2**(s - 127)`` in ``dtype`` (NaN for 0xFF)."""
    s = scales.to(torch.int64)
    out = pow2(s - E8M0_BIAS, dtype)
    return torch.where(s == E8M0_NAN, torch.full_like(out, float("nan")), out)


# ----------------------------------------------------------------------------------------------------------------
# Scale selection and element rounding
# ----------------------------------------------------------------------------------------------------------------
def _blocks(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 0 or x.shape[-1] % BLOCK != 0:
        raise ValueError(f"mx: the last dimension must be a multiple of {BLOCK} (one scale per {BLOCK} elements), "
                         f"got shape {tuple(x.shape)}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """``floor(log2(a))`` (int64) for finite ``a > 0``, exact (frexp: ``a = m * 2**e``, ``m`` in [0.5, 1))."""
    return torch.frexp(a)[1].to(torch.int64) - 1


def shared_exponents(xb: torch.Tensor, f: ElementFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks ``xb[..., nb, 32]`` (compute dtype) -> ``(shared_exp[..., nb, 1] int64 clamped to [-127, 127],
    finite[..., nb, 1] bool)``. All-zero blocks get -127; non-finite blocks are flagged (their exponent is 0)."""
    amax = xb.abs().amax(dim=-1, keepdim=True)
    finite = torch.isfinite(amax)
    positive = finite & (amax > 0)
    safe = torch.where(positive, amax, torch.ones_like(amax))
    exp = torch.where(positive, _floor_log2(safe) - f.emax, torch.full_like(safe, SCALE_EXP_MIN, dtype=torch.int64))
    exp = torch.where(finite, exp, torch.zeros_like(exp))
    return exp.clamp(SCALE_EXP_MIN, SCALE_EXP_MAX), finite


def round_to_element(a: torch.Tensor, f: ElementFormat) -> torch.Tensor:
    """Magnitudes ``a >= 0`` (finite) -> the nearest value of ``f``, ties to even, saturating at ``max_normal``.

    The quantum of ``a``'s binade is ``2**(max(floor(log2 a), emin) - mbits)`` (subnormals share the smallest
    normal binade's); ``torch.round`` rounds half to even, and an even multiple of the quantum is exactly an even
    mantissa (a rounding that carries into the next binade lands on its even code too)."""
    e = _floor_log2(torch.where(a > 0, a, torch.ones_like(a))).clamp(min=f.emin)
    quantum = pow2(e - f.mbits, a.dtype)
    return (torch.round(a / quantum) * quantum).clamp(max=f.max_normal)


def _scaled_magnitudes(x: torch.Tensor, f: ElementFormat) -> tuple[torch.Tensor, ...]:
    """The shared steps of :func:`quantize` and :func:`fake_quant`: blocks, exponents, rounded ``|V_i| / X``."""
    cdt = _compute_dtype(x.dtype)
    xb = _blocks(x).to(cdt)
    exp, finite = shared_exponents(xb, f)
    mag = round_to_element(torch.where(finite, xb.abs(), torch.zeros_like(xb)) * pow2(-exp, cdt), f)
    return xb, exp, finite, mag


# ----------------------------------------------------------------------------------------------------------------
# The codec
# ----------------------------------------------------------------------------------------------------------------
def encode_magnitude(mag: torch.Tensor, negative: torch.Tensor, f: ElementFormat) -> torch.Tensor:
    """A representable magnitude of ``f`` (from :func:`round_to_element`) and its sign -> the code (int64)."""
    subnormal = mag < 2.0 ** f.emin
    e = _floor_log2(torch.where(subnormal, torch.ones_like(mag), mag))
    exp_field = torch.where(subnormal, torch.zeros_like(e), e + f.bias)
    quantum = pow2(torch.where(subnormal, torch.full_like(e, f.emin), e) - f.mbits, mag.dtype)
    implicit = torch.where(subnormal, torch.zeros_like(e), torch.full_like(e, 1 << f.mbits))  # the leading 1
    mant = (mag / quantum).to(torch.int64) - implicit
    return (negative.to(torch.int64) << (f.ebits + f.mbits)) | (exp_field << f.mbits) | mant


def quantize(x: torch.Tensor, fmt: str | ElementFormat = "mxfp4") -> tuple[torch.Tensor, torch.Tensor]:
    """``x[..., K]`` -> ``(codes[..., K] uint8, scales[..., K/32] uint8)`` (module docstring). A negative value that
    rounds to zero keeps its sign (code 8 in E2M1, 0x80 in E4M3); a non-finite block gets scale 0xFF and element
    codes 0 (E4M3: 0x7F, its NaN)."""
    f = element_format(fmt)
    xb, exp, finite, mag = _scaled_magnitudes(x, f)
    codes = encode_magnitude(mag, torch.signbit(xb), f)
    nan_code = f.nan_codes[0] if f.nan_codes else 0
    codes = torch.where(finite, codes, torch.full_like(codes, nan_code))
    scales = torch.where(finite, exp + E8M0_BIAS, torch.full_like(exp, E8M0_NAN))
    return codes.to(torch.uint8).reshape(x.shape), scales.squeeze(-1).to(torch.uint8)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, fmt: str | ElementFormat = "mxfp4",
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``codes[..., K]`` uint8 (one code per element, unpacked), ``scales[..., K/32]`` uint8 -> ``[..., K]`` in
    ``dtype`` (computed in fp32, fp64 for an fp64 ``dtype``, then cast)."""
    f = element_format(fmt)
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"mx.dequantize: codes and scales must be uint8, got {codes.dtype}, {scales.dtype}")
    cb = _blocks(codes)
    if scales.shape != cb.shape[:-1]:
        raise ValueError(f"mx.dequantize: scales shape {tuple(scales.shape)} does not match codes "
                         f"{tuple(codes.shape)} (one scale per {BLOCK} elements: {tuple(cb.shape[:-1])})")
    if f.bits < 8 and codes.numel() and int(codes.max()) >= 2 ** f.bits:
        raise ValueError(f"mx.dequantize: {f.name} codes must be < {2 ** f.bits} (unpack packed bytes first)")
    cdt = _compute_dtype(dtype)
    vals = code_values(f, cdt).to(codes.device)[cb.to(torch.int64)]
    return (vals * e8m0_values(scales, cdt).unsqueeze(-1)).reshape(codes.shape).to(dtype)


def fake_quant(x: torch.Tensor, fmt: str | ElementFormat = "mxfp4") -> torch.Tensor:
    """``dequantize(*quantize(x, fmt), dtype=x.dtype)``, bit for bit, without building codes: ``sign(V_i) *
    round(|V_i| / X) * X``. ``x[..., K]``, ``K % 32 == 0`` -> same shape and dtype. No gradient rule (see
    :mod:`k3train.quant.qat` for the straight-through estimator)."""
    f = element_format(fmt)
    xb, exp, finite, mag = _scaled_magnitudes(x, f)
    out = torch.where(torch.signbit(xb), -mag, mag) * pow2(exp, mag.dtype)
    out = torch.where(finite, out, torch.full_like(out, float("nan")))
    return out.reshape(x.shape).to(x.dtype)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes ``[..., K]`` (uint8, each < 16, ``K`` even) -> ``[..., K/2]`` uint8: element ``2j`` in the low
    nibble, ``2j + 1`` in the high nibble (compressed-tensors ``mxfp4-pack-quantized``)."""
    if codes.dtype != torch.uint8 or codes.dim() == 0 or codes.shape[-1] % 2 != 0:
        raise ValueError(f"mx.pack_e2m1: expected uint8 codes with an even last dimension, got {codes.dtype} "
                         f"{tuple(codes.shape)}")
    if codes.numel() and int(codes.max()) > 0x0F:
        raise ValueError("mx.pack_e2m1: E2M1 codes must be < 16")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_e2m1`: ``[..., K/2]`` uint8 -> ``[..., K]`` uint8 codes."""
    if packed.dtype != torch.uint8 or packed.dim() == 0:
        raise ValueError(f"mx.unpack_e2m1: expected uint8 bytes, got {packed.dtype} {tuple(packed.shape)}")
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


__all__ = ["BLOCK", "E2M1", "E4M3", "E8M0_BIAS", "E8M0_NAN", "ElementFormat", "FORMATS", "code_values",
           "dequantize", "e8m0_values", "element_format", "encode_magnitude", "fake_quant", "pack_e2m1", "pow2",
           "quantize", "round_to_element", "shared_exponents", "unpack_e2m1"]
