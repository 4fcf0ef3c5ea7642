"""GGUF's quantized blocks read as stored: integer codes, a scale and a minimum per block.

Every quantized GGML format the exporter keeps defines a weight as `scale * code + minimum`, with a small integer
code per weight and a scale (and for some formats a minimum) per block of 16 or 32 weights along a row. Here each
format's bytes are unpacked into those three arrays, computed in float32 exactly as ggml's own dequantization does
(the scales and minimums are products of half-precision and 6-bit numbers, exact in float32), so
`scales * codes + minimums` equals the dequantized tensor transformers loads, bit for bit. A K-quant's scales and
minimums are kept as their factors too (`Factors`): what the exporter stores instead of float32 scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK_K = 256  # the K-quants' super-block


@dataclass
class Factors:
    """A K-quant's scales and minimums as ggml computes them: per super-block of 256 weights a half-precision
    factor (`super_scales`; `super_minimums`, negated: the minimum is subtracted), times a small integer per block
    (`sub_scales`, `sub_minimums`: int8). Arrays [rows, super-blocks] and [rows, blocks]."""

    super_scales: np.ndarray
    sub_scales: np.ndarray
    super_minimums: np.ndarray | None
    sub_minimums: np.ndarray | None


@dataclass
class Blocks:
    """A quantized matrix [rows, columns] as stored: `codes` int8 [rows, columns], `scales` and `minimums`
    float32 [rows, columns // block] (`minimums` None where the format has none); a K-quant's `factors`."""

    format: str
    block: int
    codes: np.ndarray
    scales: np.ndarray
    minimums: np.ndarray | None
    factors: Factors | None = None

    def dequantized(self) -> np.ndarray:
        """The float32 weights the format defines."""
        rows, columns = self.codes.shape
        blocks = self.codes.reshape(rows, columns // self.block, self.block).astype(np.float32)
        values = self.scales[..., None] * blocks
        if self.minimums is not None:
            values = values + self.minimums[..., None]
        return values.reshape(rows, columns)


def _half(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 fields (two bytes along the last axis) as float32."""
    return np.ascontiguousarray(raw).view("<f2")[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """Bytes [..., n] -> their low nibbles then their high nibbles [..., 2n] (ggml's order in a block)."""
    return np.concatenate([packed & 0xF, packed >> 4], axis=-1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Bit j of little-endian uint32 fields qh [..., 4] for j < count, as [..., count] 0/1."""
    bits = qh.view("<u4")[..., 0:1] >> np.arange(count, dtype=np.uint32)
    return (bits & 1).astype(np.uint8)


def _q4_0(raw: np.ndarray):
    d = _half(raw[..., 0:2])
    return 32, _nibbles(raw[..., 2:18]).astype(np.int8) - 8, d, None


def _q4_1(raw: np.ndarray):
    d, m = _half(raw[..., 0:2]), _half(raw[..., 2:4])
    return 32, _nibbles(raw[..., 4:20]).astype(np.int8), d, m


def _q5_0(raw: np.ndarray):
    d = _half(raw[..., 0:2])
    high = _high_bits(np.ascontiguousarray(raw[..., 2:6]), 32)
    return 32, (_nibbles(raw[..., 6:22]) | (high << 4)).astype(np.int8) - 16, d, None


def _q5_1(raw: np.ndarray):
    d, m = _half(raw[..., 0:2]), _half(raw[..., 2:4])
    high = _high_bits(np.ascontiguousarray(raw[..., 4:8]), 32)
    return 32, (_nibbles(raw[..., 8:24]) | (high << 4)).astype(np.int8), d, m


def _q8_0(raw: np.ndarray):
    return 32, np.ascontiguousarray(raw[..., 2:34]).view(np.int8), _half(raw[..., 0:2]), None


def _k4_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and minimums of a Q4_K / Q5_K super-block from its 12 bytes."""
    low, high = packed[..., 0:4], packed[..., 8:12]
    scales = np.concatenate([low & 63, (high & 0xF) | ((low >> 6) << 4)], axis=-1)
    mins = np.concatenate([packed[..., 4:8] & 63, (high >> 4) | ((packed[..., 4:8] >> 6) << 4)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _q4_k(raw: np.ndarray):
    d, dmin = _half(raw[..., 0:2]), _half(raw[..., 2:4])
    scales, mins = _k4_scales(raw[..., 4:16])
    qs = raw[..., 16:144].reshape(*raw.shape[:-1], 4, 32)  # four groups of 32 bytes: 64 weights each
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1)  # per group: 32 low nibbles, then 32 high
    return 32, codes.reshape(*raw.shape[:-1], QK_K).astype(np.int8), (d, scales, -dmin, mins)


def _q5_k(raw: np.ndarray):
    d, dmin = _half(raw[..., 0:2]), _half(raw[..., 2:4])
    scales, mins = _k4_scales(raw[..., 4:16])
    qh = raw[..., 16:48]  # bit 2g of byte l: weight l of group g's first half; bit 2g+1: of its second half
    qs = raw[..., 48:176].reshape(*raw.shape[:-1], 4, 32)
    shifts = np.arange(8, dtype=np.uint8).reshape(4, 2, 1)
    high = (qh[..., None, None, :] >> shifts) & 1  # [..., group, half, 32]
    low = np.stack([qs & 0xF, qs >> 4], axis=-2)
    codes = (low | (high << 4)).reshape(*raw.shape[:-1], QK_K).astype(np.int8)
    return 32, codes, (d, scales, -dmin, mins)


def _q6_k(raw: np.ndarray):
    ql, qh = raw[..., 0:128], raw[..., 128:192]
    scales = np.ascontiguousarray(raw[..., 192:208]).view(np.int8).astype(np.float32)
    d = _half(raw[..., 208:210])
    codes = []
    for half in range(2):  # each 128 weights: ql 64 bytes, qh 32 bytes
        low, high = ql[..., 64 * half : 64 * half + 64], qh[..., 32 * half : 32 * half + 32]
        for nibbles, shift in (
            (low[..., :32] & 0xF, 0),
            (low[..., 32:] & 0xF, 2),
            (low[..., :32] >> 4, 4),
            (low[..., 32:] >> 4, 6),
        ):
            codes.append(nibbles | (((high >> shift) & 3) << 4))
    stacked = np.concatenate(codes, axis=-1).astype(np.int8) - 32
    return 16, stacked, (d, scales, None, None)


def _q2_k(raw: np.ndarray):
    packed_scales, qs = raw[..., 0:16], raw[..., 16:80]
    d, dmin = _half(raw[..., 80:82]), _half(raw[..., 82:84])
    codes = []
    for half in range(2):
        q = qs[..., 32 * half : 32 * half + 32]
        for shift in (0, 2, 4, 6):
            codes.append((q >> shift) & 3)
    scales = (packed_scales & 0xF).astype(np.float32)
    mins = (packed_scales >> 4).astype(np.float32)
    return 16, np.concatenate(codes, axis=-1).astype(np.int8), (d, scales, -dmin, mins)


def _q3_k_scales(packed: np.ndarray) -> np.ndarray:
    """The sixteen 6-bit scales of a Q3_K super-block (stored in 12 bytes), minus 32."""
    low = np.concatenate([packed[..., 0:8] & 0xF, packed[..., 0:8] >> 4], axis=-1)
    high = packed[..., 8:12]
    high = np.concatenate([(high >> shift) & 3 for shift in (0, 2, 4, 6)], axis=-1)
    return (low | (high << 4)).astype(np.float32) - 32


def _q3_k(raw: np.ndarray):
    hmask, qs = raw[..., 0:32], raw[..., 32:96]
    scales = _q3_k_scales(raw[..., 96:108])
    d = _half(raw[..., 108:110])
    codes = []
    bit = 0
    for half in range(2):
        q = qs[..., 32 * half : 32 * half + 32]
        for shift in (0, 2, 4, 6):
            high = (hmask >> bit) & 1
            codes.append(((q >> shift) & 3).astype(np.int8) - np.where(high == 1, 0, 4).astype(np.int8))
            bit += 1
    return 16, np.concatenate(codes, axis=-1), (d, scales, None, None)


# GGML type name -> (bytes per block, weights per block, unpacker)
FORMATS = {
    "Q4_0": (18, 32, _q4_0),
    "Q4_1": (20, 32, _q4_1),
    "Q5_0": (22, 32, _q5_0),
    "Q5_1": (24, 32, _q5_1),
    "Q8_0": (34, 32, _q8_0),
    "Q2_K": (84, QK_K, _q2_k),
    "Q3_K": (110, QK_K, _q3_k),
    "Q4_K": (144, QK_K, _q4_k),
    "Q5_K": (176, QK_K, _q5_k),
    "Q6_K": (210, QK_K, _q6_k),
}


# GGML type name -> (the range of its codes as unpacked here, its blocks' weights along a row, its minimums' type:
# None where it has none, "float16" where they are stored halves, "float32" where they are products of a half and a
# small integer, which float16 holds only by chance)
CODES = {
    "Q4_0": ((-8, 7), 32, None),
    "Q4_1": ((0, 15), 32, "float16"),
    "Q5_0": ((-16, 15), 32, None),
    "Q5_1": ((0, 31), 32, "float16"),
    "Q8_0": ((-128, 127), 32, None),
    "Q2_K": ((0, 3), 16, "float32"),
    "Q3_K": ((-4, 3), 16, None),
    "Q4_K": ((0, 15), 32, "float32"),
    "Q5_K": ((0, 31), 32, "float32"),
    "Q6_K": ((-32, 31), 16, None),
}


def unpack(format_name: str, raw: np.ndarray, columns: int) -> Blocks:
    """A quantized tensor's bytes [rows, bytes per row] -> its `Blocks` ([rows, columns] weights)."""
    block_bytes, block_weights, unpacker = FORMATS[format_name]
    rows = raw.shape[0]
    per_row = columns // block_weights
    blocks = np.ascontiguousarray(raw).reshape(rows, per_row, block_bytes)
    sub_block, codes, *fields = unpacker(blocks)
    factors = None
    if len(fields) == 1:  # a K-quant: (d, integer scales, -dmin, integer minimums) per super-block
        d, sub_scales, negated_dmin, sub_minimums = fields[0]
        scales = d[..., None] * sub_scales
        minimums = None if negated_dmin is None else negated_dmin[..., None] * sub_minimums
        factors = Factors(
            np.ascontiguousarray(d.reshape(rows, per_row)),
            np.ascontiguousarray(sub_scales.reshape(rows, -1).astype(np.int8)),
            None if negated_dmin is None else np.ascontiguousarray(negated_dmin.reshape(rows, per_row)),
            None
            if sub_minimums is None
            else np.ascontiguousarray(sub_minimums.reshape(rows, -1).astype(np.int8)),
        )
    else:
        scales, minimums = fields
    return Blocks(
        format_name,
        sub_block,
        np.ascontiguousarray(codes.reshape(rows, columns).astype(np.int8)),
        np.ascontiguousarray(scales.reshape(rows, columns // sub_block).astype(np.float32)),
        None
        if minimums is None
        else np.ascontiguousarray(minimums.reshape(rows, columns // sub_block).astype(np.float32)),
        factors,
    )
