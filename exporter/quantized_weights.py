"""A GGUF's quantized matrices kept as stored: what `pipeshard export FILE.gguf OUT` (`--dtype auto`) writes.

The model is traced over transformers' dequantized float32 weights; here every product and embedding weight whose
rows are rows of a quantized GGUF tensor (found by their exact float32 values, so fused projections made of several
tensors are found too) is stored back as that tensor's blocks, in ONNX Runtime's own block-quantized ops:

- a product `x @ W` becomes `com.microsoft::MatMulNBits` over 4-bit planes: codes of 4 bits or fewer are one plane
  (zero point 8 for signed codes, 0 for unsigned ones); wider codes (Q5, Q6, Q8) are split exactly into
  `16 * high + low`, two planes whose products are summed (MatMulNBits computes 8-bit weights and float zero
  points on the CPU by widening all of B to float32 at every call, and 3, 5 and 6 bits not at all); a product whose
  codes are all 2-bit (Q2_K's 0..3) is one 2-bit plane instead (`bits` 2, zero point 0), at its own bytes (the
  CPU computes it with pipeshard's BlockMatMul, ONNX Runtime's 2-bit kernel being as slow as the 8-bit one);
- a format's per-block minimum (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K) adds `blocksum(x) @ minimums`;
- an embedding gathers the rows of the same planes, zero points, scales and minimums its tokens need and dequantizes
  only those, with standard ops (a tied output layer and its embedding share the parts).

Every plane holds the format's integers. A scale is stored as the format stores it: a K-quant's (Q2_K .. Q6_K) as an
int8 per block times a float16 factor per super-block of 256 weights, multiplied in the graph in float32 as ggml
multiplies them (its minimums likewise); another format's as its float16 value, read through a Cast. The graph
computes `scale * code + minimum` as ggml defines it, summed in another order (float rounding). Weights that are no
quantized tensor's rows (norms, float tensors) stay as they are. A shape-only export at a GGUF format writes the same
nodes and parts without values (describe_weights_quantized); `Layout` is the one description of the parts both use.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from pipeshard.exporter.gguf_blocks import CODES, FORMATS, QK_K, Blocks, Factors, unpack
from pipeshard.formats.io_names import (
    HIGH_PLANE_SUFFIX,
    LOW_PLANE_SUFFIXES,
    MINIMUM_TERM_SUFFIX,
    module_path,
)

log = logging.getLogger(__name__)

MS_DOMAIN = "com.microsoft"
_HIGH = HIGH_PLANE_SUFFIX
INT8, FLOAT16 = TensorProto.INT8, TensorProto.FLOAT16


@dataclass
class StoredRows:
    """Every quantized row of a GGUF, found by the digest of its float32 values."""

    tensors: list[Blocks]
    names: list[str]
    rows: dict[bytes, tuple[int, int]]  # digest -> (tensor index, row)
    kept: dict[str, int] = field(default_factory=dict)  # weights stored as blocks, by their rows' formats

    def find(self, matrix: np.ndarray) -> list[tuple[int, int]] | None:
        """Where each row of `matrix` [rows, columns] is stored, or None if any row is not a quantized row."""
        found = []
        for row in matrix:
            place = self.rows.get(hashlib.blake2b(row.tobytes(), digest_size=16).digest())
            if place is None:
                return None
            found.append(place)
        return found


def read_stored_rows(reader) -> StoredRows:
    """The quantized tensors of a GGUF (its `gguf.GGUFReader`), unpacked, with every row's digest."""
    tensors, names, rows = [], [], {}
    for tensor in reader.tensors:
        format_name = tensor.tensor_type.name
        if format_name not in FORMATS or len(tensor.shape) != 2:
            continue
        blocks = unpack(format_name, np.asarray(tensor.data), int(tensor.shape[0]))
        index = len(tensors)
        tensors.append(blocks)
        names.append(tensor.name)
        for row, values in enumerate(blocks.dequantized()):
            rows.setdefault(hashlib.blake2b(values.tobytes(), digest_size=16).digest(), (index, row))
    return StoredRows(tensors, names, rows)


@dataclass(frozen=True)
class Layout:
    """What a matrix [rows, columns] stored as 4-bit planes holds, without its values: one shape for the real export
    (Planes.layout) and the shape-only one (format_layout), so both store the same parts under the same names."""

    rows: int
    columns: int
    block: int
    zero_points: bool  # the low plane has zero points: some block's codes are not all in -8..7
    high: bool  # a high plane: some block's codes need more than 4 bits
    minimums: int | None  # the minimums' TensorProto type (INT8: factored), None where the rows have none
    scales: int  # the scales' TensorProto type: FLOAT, FLOAT16, or INT8 (factored)
    bits: int = 4  # of the low plane's codes: 4, or 2 where every code is 0..3 (no high plane then)

    @property
    def bits_per_weight(self) -> float:
        """The stored bits of a product's parts per weight of the matrix."""
        parts = self.parts("W").values()
        total = sum(
            math.prod(shape) * helper.tensor_dtype_to_np_dtype(kind).itemsize for _, shape, kind in parts
        )
        return 8 * total / (self.rows * self.columns)

    @property
    def blocks_per_super(self) -> int:
        """A factored scale's blocks per super-block (one float16 factor)."""
        return QK_K // self.block

    def parts(self, weight: str, gathered: bool = False) -> dict[str, tuple[str, list[int], int]]:
        """Role -> (initializer name, shape, TensorProto type) of what `weight` is stored as; `gathered`: with the
        zero points an embedding's rows read ([rows, blocks, 1], one per byte)."""
        blocks = self.columns // self.block
        plane = [self.rows, blocks, self.block * self.bits // 8]
        low = weight + LOW_PLANE_SUFFIXES[self.bits]
        parts = {"low": (low, plane, TensorProto.UINT8)}
        if self.scales == TensorProto.INT8:
            supers = self.columns // QK_K
            parts["scales_sub"] = (
                low + "_scales_sub",
                [self.rows, supers, self.blocks_per_super],
                INT8,
            )
            parts["scales_super"] = (low + "_scales_super", [self.rows, supers, 1], FLOAT16)
        else:
            parts["low_scales"] = (low + "_scales", [self.rows, blocks], self.scales)
        if self.zero_points:
            parts["low_zero_points"] = (
                low + "_zero_points",
                [self.rows, -(-blocks * self.bits // 8)],  # MatMulNBits' layout: packed as the codes are
                TensorProto.UINT8,
            )
            if gathered and self.bits == 4:  # a 2-bit plane is never gathered (format_layout, make_planes)
                parts["gather_zero_points"] = (
                    f"{weight}_low_gather_zero_points",
                    [self.rows, blocks, 1],
                    TensorProto.UINT8,
                )
        if self.high:
            parts["high"] = (weight + _HIGH, plane, TensorProto.UINT8)
        if self.minimums == TensorProto.INT8:
            supers = self.columns // QK_K
            parts["minimums_sub"] = (
                weight + "_minimums_sub",
                [supers, self.blocks_per_super, self.rows],
                INT8,
            )
            parts["minimums_super"] = (weight + "_minimums_super", [supers, 1, self.rows], FLOAT16)
        elif self.minimums is not None:
            parts["minimums"] = (weight + "_minimums", [blocks, self.rows], self.minimums)
        return parts


def format_layout(format_name: str, rows: int, columns: int, gathered: bool = False) -> Layout:
    """The layout of a matrix whose rows are all in GGML format `format_name`, as make_planes makes it from codes
    spanning the format's range (the general case; a matrix whose codes happen to span less may store less);
    `gathered`: an embedding reads it (its rows are dequantized from 4-bit planes only)."""
    (lowest, highest), block, minimums = CODES[format_name]
    signed = lowest >= -8 and highest <= 7
    unsigned = lowest >= 0 and highest <= 15
    factored = FORMATS[format_name][1] == QK_K
    # zero point 0, given (2-bit planes default to 2)
    two_bits = lowest >= 0 and highest <= 3 and not gathered
    return Layout(
        rows,
        columns,
        block,
        zero_points=two_bits or not signed,
        high=not (signed or unsigned),
        minimums=None if minimums is None else INT8 if factored else FLOAT16,
        scales=INT8 if factored else FLOAT16,
        bits=2 if two_bits else 4,
    )


@dataclass
class Planes:
    """A matrix [N rows, K columns] as 4-bit planes in MatMulNBits' layout: uint8 [N, blocks, block / 2] per plane,
    `scales` float32 [N, blocks] (the high plane's are 16 times them: its product is scaled by 16, exactly), the
    low plane's zero points (None: 8 everywhere), `minimums`; where every row is a K-quant's, `factors`: the
    scales' (and minimums') int8 per block and float16 per super-block, [N, blocks] and [N, super-blocks]."""

    block: int
    low: np.ndarray
    low_scales: np.ndarray
    low_zero_points: np.ndarray | None
    high: np.ndarray | None
    minimums: np.ndarray | None
    formats: tuple[str, ...]
    factors: Factors | None = None
    bits: int = 4  # of the low plane's codes (Layout.bits)

    @property
    def rows(self) -> int:
        return self.low.shape[0]

    @property
    def columns(self) -> int:
        return self.low_scales.shape[1] * self.block

    @property
    def stored_minimums(self) -> np.ndarray | None:
        """The minimums as stored: [blocks, rows], in float16 where it holds every one exactly."""
        return None if self.minimums is None else _narrowest(np.ascontiguousarray(self.minimums.T))

    @property
    def layout(self) -> Layout:
        if self.factors is not None:
            scales, minimums = INT8, None if self.minimums is None else INT8
        else:
            scales = helper.np_dtype_to_tensor_dtype(_narrowest(self.low_scales).dtype)
            stored = self.stored_minimums
            minimums = None if stored is None else helper.np_dtype_to_tensor_dtype(stored.dtype)
        return Layout(
            self.rows,
            self.columns,
            self.block,
            zero_points=self.low_zero_points is not None,
            high=self.high is not None,
            minimums=minimums,
            scales=scales,
            bits=self.bits,
        )

    def values(self) -> dict[str, np.ndarray]:
        """Role (Layout.parts) -> stored values."""
        values = {"low": self.low}
        supers = self.columns // QK_K
        if self.factors is not None:
            factors = self.factors
            values["scales_sub"] = factors.sub_scales.reshape(self.rows, supers, -1)
            values["scales_super"] = factors.super_scales.astype(np.float16)[..., None]
        else:
            values["low_scales"] = _narrowest(self.low_scales)
        if self.low_zero_points is not None:
            values["low_zero_points"] = self.low_zero_points
            if self.bits == 4:
                values["gather_zero_points"] = _gather_zero_points(self)
        if self.high is not None:
            values["high"] = self.high
        if self.minimums is not None and self.factors is not None:
            values["minimums_sub"] = np.ascontiguousarray(
                self.factors.sub_minimums.T.reshape(supers, -1, self.rows)
            )
            values["minimums_super"] = np.ascontiguousarray(
                self.factors.super_minimums.astype(np.float16).T[:, None]
            )
        elif self.minimums is not None:
            values["minimums"] = self.stored_minimums
        return values


def _pack_nibbles(values: np.ndarray) -> np.ndarray:
    """Values 0..15 [..., 2n] -> bytes [..., n], the even element in the low nibble (MatMulNBits' order)."""
    return (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8)


def _pack_crumbs(values: np.ndarray) -> np.ndarray:
    """Values 0..3 [..., 4n] -> bytes [..., n], element 4i + j in bits 2j, 2j + 1 of byte i (MatMulNBits' order)."""
    packed = np.zeros((*values.shape[:-1], values.shape[-1] // 4), np.uint8)
    for j in range(4):
        packed |= (values[..., j::4].astype(np.uint8) << (2 * j)).astype(np.uint8)
    return packed


def make_planes(stored: StoredRows, places: list[tuple[int, int]], gathered: bool = False) -> Planes:
    """The rows at `places` (in order) as 4-bit planes (one 2-bit plane where every code is 0..3 and no embedding
    reads them: `gathered`); a block of 32 is two blocks of 16 where a row of a 16-block format is among them."""
    used = sorted({tensor for tensor, _ in places})
    block = min(stored.tensors[t].block for t in used)
    columns = stored.tensors[used[0]].codes.shape[1]
    codes = np.empty((len(places), columns), np.int8)
    scales = np.empty((len(places), columns // block), np.float32)
    minimums = np.zeros_like(scales) if any(stored.tensors[t].minimums is not None for t in used) else None
    factors = None
    if all(stored.tensors[t].factors is not None for t in used):
        supers = (len(places), columns // QK_K)
        factors = Factors(
            np.empty(supers, np.float32),
            np.empty(scales.shape, np.int8),
            None if minimums is None else np.zeros(supers, np.float32),
            None if minimums is None else np.zeros(scales.shape, np.int8),
        )
    by_tensor: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for position, (tensor, row) in enumerate(places):
        by_tensor[tensor].append((position, row))
    for tensor, pairs in by_tensor.items():
        blocks = stored.tensors[tensor]
        positions, rows = (np.array(p) for p in zip(*pairs, strict=True))
        repeat = blocks.block // block
        codes[positions] = blocks.codes[rows]
        scales[positions] = np.repeat(blocks.scales[rows], repeat, axis=1)
        if blocks.minimums is not None:
            minimums[positions] = np.repeat(blocks.minimums[rows], repeat, axis=1)
        if factors is not None:
            factors.super_scales[positions] = blocks.factors.super_scales[rows]
            factors.sub_scales[positions] = np.repeat(blocks.factors.sub_scales[rows], repeat, axis=1)
            if blocks.factors.super_minimums is not None:
                factors.super_minimums[positions] = blocks.factors.super_minimums[rows]
                factors.sub_minimums[positions] = np.repeat(blocks.factors.sub_minimums[rows], repeat, axis=1)
    grouped = codes.reshape(len(places), -1, block).astype(np.int16)
    lowest, highest = grouped.min(axis=-1), grouped.max(axis=-1)
    formats = tuple(stored.names[t] for t in used)
    if not gathered and (lowest >= 0).all() and (highest <= 3).all():
        blocks = grouped.shape[1]
        return Planes(
            block,
            _pack_crumbs(grouped.astype(np.uint8)),
            scales,
            np.zeros((len(places), -(-blocks // 4)), np.uint8),  # zero point 0 (MatMulNBits' default is 2)
            None,
            minimums,
            formats,
            factors,
            bits=2,
        )
    signed = (lowest >= -8) & (highest <= 7)  # one plane, zero point 8
    unsigned = ~signed & (lowest >= 0) & (highest <= 15)  # one plane, zero point 0
    wide = ~signed & ~unsigned
    low = np.where(signed[..., None], grouped + 8, grouped & 15)
    zero_points = np.where(signed, 8, 0).astype(np.uint8)
    high = None
    if wide.any():
        high = np.where(wide[..., None], (grouped >> 4) + 8, 8)
    packed_zero_points = None
    if not signed.all():
        padded = np.zeros((len(places), (zero_points.shape[1] + 1) // 2 * 2), np.uint8)
        padded[:, : zero_points.shape[1]] = zero_points
        packed_zero_points = _pack_nibbles(padded)
    return Planes(
        block,
        _pack_nibbles(low.astype(np.uint8)),
        scales,
        packed_zero_points,
        None if high is None else _pack_nibbles(high.astype(np.uint8)),
        minimums,
        formats,
        factors,
    )


class _Rewriter:
    """Builds the replacement nodes and initializers of one graph."""

    def __init__(self, model: onnx.ModelProto, reference=None) -> None:
        self.model = model
        # a shape-only export's: (name, TensorProto type, shape) -> a reference to a weight never written
        self.reference = reference
        self.new_initializers: list[TensorProto] = []
        self.before: dict[int, list[onnx.NodeProto]] = defaultdict(list)
        self.replaced: set[int] = set()

    def constant(self, name: str, values: np.ndarray) -> str:
        self.new_initializers.append(numpy_helper.from_array(values, name))
        return name

    def node(
        self, like: onnx.NodeProto, op: str, inputs: list[str], output: str, **attributes
    ) -> onnx.NodeProto:
        domain = MS_DOMAIN if op == "MatMulNBits" else ""
        made = helper.make_node(op, inputs, [output], name=output, domain=domain, **attributes)
        made.metadata_props.extend(like.metadata_props)
        self.before[id(like)].append(made)
        return made

    def part(self, role: str, name: str, shape: list[int], kind: int, values: dict | None) -> str:
        """One stored part of a weight as an initializer: its values (whose shape must be the layout's), or with no
        values a reference of the layout's shape and type."""
        if values is None:
            self.new_initializers.append(self.reference(name, kind, shape))
            return name
        if list(values[role].shape) != shape or helper.np_dtype_to_tensor_dtype(values[role].dtype) != kind:
            raise AssertionError(
                f"{name}: stored {values[role].dtype} {values[role].shape}, layout {kind} {shape}"
            )
        return self.constant(name, values[role])

    def stored(self, weight: str, layout: Layout, values: dict | None) -> dict[str, str]:
        """The parts' initializers (made once per weight): name by role."""
        parts = layout.parts(weight)
        if parts["low"][0] not in {t.name for t in self.new_initializers}:
            for role, (name, shape, kind) in parts.items():
                self.part(role, name, shape, kind, values)
        return {role: name for role, (name, _, _) in parts.items()}

    def product(self, node: onnx.NodeProto, x: str, weight: str, layout: Layout, values: dict | None) -> None:
        """`node`'s output = x @ W^T for W [N, K] stored as `layout` (Planes.values, or None: references)."""
        names = self.stored(weight, layout, values)
        output = node.output[0]
        scales = self._scales(node, names, layout)
        attributes = {"K": layout.columns, "N": layout.rows, "bits": layout.bits, "block_size": layout.block}
        low_inputs = [x, names["low"], scales]
        if "low_zero_points" in names:
            low_inputs.append(names["low_zero_points"])
        low = output + LOW_PLANE_SUFFIXES[layout.bits]
        terms = [self.node(node, "MatMulNBits", low_inputs, low, **attributes).output[0]]
        if "high" in names:
            high = self.node(node, "MatMulNBits", [x, names["high"], scales], output + _HIGH, **attributes)
            terms.append(self._times_16(node, high.output[0]))
        if layout.minimums is not None:
            shape = self.constant(output + "_block_shape", np.array([0, 0, -1, layout.block], np.int64))
            blocks = self.node(node, "Reshape", [x, shape], output + "_blocks").output[0]
            axes = self.constant(output + "_block_axis", np.array([-1], np.int64))
            sums = self.node(node, "ReduceSum", [blocks, axes], output + "_block_sums", keepdims=0).output[0]
            minimums = self._minimums(node, names, layout)
            terms.append(self.node(node, "MatMul", [sums, minimums], output + MINIMUM_TERM_SUFFIX).output[0])
        self._sum(node, terms, output)
        self.replaced.add(id(node))

    def gather(self, node: onnx.NodeProto, weight: str, layout: Layout, values: dict | None) -> None:
        """`node`'s output = rows of W [N, K] stored as `layout`, gathered by `node`'s indices [batch, tokens].
        Every stored part is gathered to the step's rows first and only those rows are dequantized, as
        MatMulNBits reads its planes: a Cast or factored scale over the whole table would be folded by ONNX Runtime
        into a float32 copy of it in every session that reads the table."""
        names = self.stored(weight, layout, values)
        indices, output = node.input[1], node.output[0]
        blocks = layout.columns // layout.block

        def rows(part: str, axis: int = 0) -> str:
            return self.node(node, "Gather", [part, indices], f"{part}_rows_of_{output}", axis=axis).output[0]

        def as_float(tensor: str) -> str:
            return self.node(node, "Cast", [tensor], tensor + "_float", to=TensorProto.FLOAT).output[0]

        def shaped(tensor: str, shape: list[int], name: str) -> str:
            target = self.constant(name + "_shape", np.array(shape, np.int64))
            return self.node(node, "Reshape", [tensor, target], name).output[0]

        def last_axis(tensor: str, name: str) -> str:
            axis = self.constant(name + "_axis", np.array([-1], np.int64))
            return self.node(node, "Unsqueeze", [tensor, axis], name).output[0]

        # The rows' scales [batch, tokens, blocks, 1] (a K-quant's: ggml's d * sc over the gathered rows).
        if layout.scales == INT8:
            factor, sub = as_float(rows(names["scales_super"])), as_float(rows(names["scales_sub"]))
            scales = self.node(node, "Mul", [factor, sub], output + "_row_scales").output[0]
            scales = shaped(scales, [0, 0, blocks, 1], output + "_row_scales_by_block")
        else:
            scales = rows(names["low_scales"])
            scales = as_float(scales) if layout.scales == FLOAT16 else scales
            scales = last_axis(scales, output + "_row_scales_by_block")
        # Each plane's codes, two a byte (the even element in the low nibble): (code - zero point) x scale, the zero
        # point 8 where none is stored.
        terms = []
        for plane in ("low", "high"):
            if plane not in names:
                continue
            packed = rows(names[plane])  # [batch, tokens, blocks, block / 2]
            mask = self.constant(f"{output}_{plane}_mask", np.array(15, np.uint8))
            shift = self.constant(f"{output}_{plane}_shift", np.array(4, np.uint8))
            even = self.node(node, "BitwiseAnd", [packed, mask], f"{output}_{plane}_even").output[0]
            odd = self.node(
                node, "BitShift", [packed, shift], f"{output}_{plane}_odd", direction="RIGHT"
            ).output[0]
            pairs = [last_axis(codes, codes + "_paired") for codes in (even, odd)]
            both = self.node(node, "Concat", pairs, f"{output}_{plane}_pairs", axis=-1).output[0]
            codes = as_float(shaped(both, [0, 0, 0, layout.block], f"{output}_{plane}_codes"))
            if plane == "low" and "low_zero_points" in names:
                role = "gather_zero_points"
                zero_points = as_float(
                    rows(self.part(role, *layout.parts(weight, gathered=True)[role], values))
                )
            else:
                zero_points = self.constant(f"{output}_{plane}_zero_point", np.array(8.0, np.float32))
            centred = self.node(node, "Sub", [codes, zero_points], f"{output}_{plane}_centred").output[0]
            dequantized = self.node(node, "Mul", [centred, scales], f"{output}_{plane}_rows").output[0]
            terms.append(dequantized if plane == "low" else self._times_16(node, dequantized))
        if (
            layout.minimums == INT8
        ):  # [supers, blocks per super or 1, batch, tokens] -> [batch, tokens, blocks]
            factor = as_float(rows(names["minimums_super"], axis=2))
            sub = as_float(rows(names["minimums_sub"], axis=2))
            product = self.node(node, "Mul", [factor, sub], output + "_row_minimums").output[0]
            moved = self.node(node, "Transpose", [product], output + "_minimums_moved", perm=[2, 3, 0, 1])
            terms.append(
                last_axis(
                    shaped(moved.output[0], [0, 0, blocks], output + "_minimums"), output + "_minimum_term"
                )
            )
        elif layout.minimums is not None:  # [blocks, batch, tokens] -> [batch, tokens, blocks]
            minimums = rows(names["minimums"], axis=1)
            minimums = as_float(minimums) if layout.minimums == FLOAT16 else minimums
            moved = self.node(node, "Transpose", [minimums], output + "_minimums_moved", perm=[1, 2, 0])
            terms.append(last_axis(moved.output[0], output + "_minimum_term"))
        summed = output + "_blocks"
        self._sum(node, terms, summed)
        shaped(summed, [0, 0, layout.columns], output)
        self.replaced.add(id(node))

    def _times_16(self, like: onnx.NodeProto, tensor: str) -> str:
        """The high plane's term: its codes count 16 low-plane steps."""
        sixteen = self.constant(tensor + "_step", np.array(16.0, np.float32))
        return self.node(like, "Mul", [tensor, sixteen], tensor + "_times_16").output[0]

    def _scales(self, like: onnx.NodeProto, names: dict[str, str], layout: Layout) -> str:
        """The float32 scales [N, blocks] `like`'s replacement reads, computed in its own sub-layer (a weight read by
        an embedding and a tied output layer is read in two)."""
        output = like.output[0] + "_scales"
        if layout.scales == INT8:
            shape = [layout.rows, layout.columns // layout.block]
            return self._factored(like, names["scales_sub"], names["scales_super"], shape, output)
        if layout.scales == FLOAT16:
            return self.node(like, "Cast", [names["low_scales"]], output, to=TensorProto.FLOAT).output[0]
        return names["low_scales"]

    def _minimums(self, like: onnx.NodeProto, names: dict[str, str], layout: Layout) -> str:
        """The float32 minimums [blocks, N] `like`'s replacement reads: a Cast reads stored halves (on the CPU,
        BlockMatMul then reads them as stored)."""
        output = like.output[0] + "_minimums"
        if layout.minimums == INT8:
            shape = [layout.columns // layout.block, layout.rows]
            return self._factored(like, names["minimums_sub"], names["minimums_super"], shape, output)
        if layout.minimums == FLOAT16:
            return self.node(
                like, "Cast", [names["minimums"]], output + "_as_float", to=TensorProto.FLOAT
            ).output[0]
        return names["minimums"]

    def _factored(self, like: onnx.NodeProto, sub: str, factor: str, shape: list[int], output: str) -> str:
        """float32(factor) * float32(sub), as ggml computes a K-quant's scale (`d * sc`) or minimum, reshaped."""
        factor_float = self.node(like, "Cast", [factor], output + "_super", to=TensorProto.FLOAT).output[0]
        sub_float = self.node(like, "Cast", [sub], output + "_sub", to=TensorProto.FLOAT).output[0]
        product = self.node(like, "Mul", [factor_float, sub_float], output + "_product").output[0]
        target = self.constant(output + "_shape", np.array(shape, np.int64))
        return self.node(like, "Reshape", [product, target], output).output[0]

    def _sum(self, like: onnx.NodeProto, terms: list[str], output: str) -> None:
        total = terms[0]
        for index, term in enumerate(terms[1:], start=1):
            name = output if index == len(terms) - 1 else f"{output}_partial{index}"
            total = self.node(like, "Add", [total, term], name).output[0]
        if total != output:
            self.node(like, "Identity", [total], output)


def _narrowest(values: np.ndarray) -> np.ndarray:
    """float16 where it holds every value exactly (Q4_1's and Q5_1's minimums are stored so), else float32."""
    half = values.astype(np.float16)
    return half if np.array_equal(half.astype(np.float32), values) else values


def _gather_zero_points(planes: Planes) -> np.ndarray:
    """The low plane's zero points as an embedding's rows read them: [N, blocks, 1], one per byte."""
    packed = planes.low_zero_points
    unpacked = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    return np.ascontiguousarray(unpacked[:, : planes.low_scales.shape[1], None])


def _uses(model: onnx.ModelProto) -> dict[str, list[tuple[onnx.NodeProto, int]]]:
    """Tensor name -> (node, input position) of its readers. The caller keeps it until _apply: the rewriter knows
    nodes by id, which protobuf keeps only while a reference to the node lives."""
    uses: dict[str, list[tuple[onnx.NodeProto, int]]] = defaultdict(list)
    for node in model.graph.node:
        for position, name in enumerate(node.input):
            uses[name].append((node, position))
    return uses


def _quantizable(model: onnx.ModelProto, uses):
    """(name, TensorProto, users, by_rows) of every 2-D float32 weight read only by products or only by
    embeddings: `by_rows` where it is read as W [N, K] (an embedding, a transposed product), else as W [K, N]."""
    for tensor in list(model.graph.initializer):
        if tensor.data_type != TensorProto.FLOAT or len(tensor.dims) != 2:
            continue
        users = _weight_users(tensor.name, uses)
        if users is None:
            continue
        by_rows = any(kind != "product" for kind, _, _ in users)
        if by_rows and any(kind == "product" for kind, _, _ in users):
            continue
        yield tensor.name, tensor, users, by_rows


def _rewrite(
    rewriter: _Rewriter, name: str, users, layout: Layout, values: dict | None, dropped: set[str]
) -> None:
    """Every read of weight `name` by its `users` rewritten over its stored parts; the weight goes."""
    for kind, node, x in users:
        if kind == "gather":
            rewriter.gather(node, name, layout, values)
        else:
            rewriter.product(node, x, name, layout, values)
            if kind == "transposed":
                dropped.add(node.input[1])  # the Transpose's output: the node goes
    dropped.add(name)


def store_weights_quantized(model: onnx.ModelProto, stored: StoredRows) -> dict[str, int]:
    """Store, in place, every product and embedding weight of `model` whose rows are quantized GGUF rows as
    those rows' blocks (module doc). Returns (and records in `stored.kept`) how many weights were stored, by the
    formats of their rows."""
    rewriter = _Rewriter(model)
    counts: dict[str, int] = defaultdict(int)
    dropped: set[str] = set()
    uses = _uses(model)
    for name, tensor, users, by_rows in _quantizable(model, uses):
        values = numpy_helper.to_array(tensor)
        places = stored.find(np.ascontiguousarray(values if by_rows else values.T))
        if places is None:
            continue
        planes = make_planes(stored, places, gathered=any(kind == "gather" for kind, _, _ in users))
        _rewrite(rewriter, name, users, planes.layout, planes.values(), dropped)
        counts["+".join(sorted({stored.tensors[t].format for t, _ in places}))] += 1
    _apply(model, rewriter, dropped)
    stored.kept = dict(counts)
    return stored.kept


def describe_weights_quantized(model: onnx.ModelProto, format_name: str, reference) -> dict[str, int]:
    """A shape-only export's `store_weights_quantized`: every product and embedding weight of `model` (references,
    no values) whose rows fit the format's blocks, but a MoE router's gate (llama.cpp's quantize keeps
    `ffn_gate_inp` in float32), described as a GGUF whose matrices are all in `format_name` would have it stored:
    the same nodes, and references (`reference(name, TensorProto type, shape)`) of format_layout's parts."""
    rewriter = _Rewriter(model, reference)
    dropped: set[str] = set()
    block = CODES[format_name][1]
    count = 0
    uses = _uses(model)
    for name, tensor, users, by_rows in _quantizable(model, uses):
        rows, columns = tensor.dims if by_rows else reversed(tensor.dims)
        if columns % block or any(_in_router(node) for _, node, _ in users):
            continue
        gathered = any(kind == "gather" for kind, _, _ in users)
        _rewrite(rewriter, name, users, format_layout(format_name, rows, columns, gathered), None, dropped)
        count += 1
    _apply(model, rewriter, dropped)
    return {format_name: count}


def _in_router(node: onnx.NodeProto) -> bool:
    """Whether the exporter traced `node` in a MoE router (its module `layers.N.mlp.router`)."""
    return re.search(r"\.mlp\.router$", module_path(node) or "") is not None


def _weight_users(name: str, uses) -> list[tuple[str, onnx.NodeProto, str]] | None:
    """How a weight is read: ("product", MatMul, x), ("transposed", MatMul after a Transpose, x) or
    ("gather", Gather, ""); None if it is read any other way."""
    users = []
    for node, position in uses.get(name, []):
        if node.op_type == "MatMul" and position == 1:
            users.append(("product", node, node.input[0]))
        elif node.op_type == "Gather" and position == 0 and _attribute(node, "axis", 0) == 0:
            users.append(("gather", node, ""))
        elif node.op_type == "Transpose" and _attribute(node, "perm", None) in (None, [1, 0]):
            after = uses.get(node.output[0], [])
            if not after or any(n.op_type != "MatMul" or p != 1 for n, p in after):
                return None
            users.extend(("transposed", n, n.input[0]) for n, _ in after)
        else:
            return None
    return users or None


def _attribute(node: onnx.NodeProto, name: str, default):
    for attribute in node.attribute:
        if attribute.name == name:
            return helper.get_attribute_value(attribute)
    return default


def _apply(model: onnx.ModelProto, rewriter: _Rewriter, dropped: set[str]) -> None:
    """Swap the replaced nodes for their replacements and the dropped weights for the new initializers."""
    nodes = []
    for node in model.graph.node:
        nodes.extend(rewriter.before[id(node)])
        if id(node) in rewriter.replaced:
            continue
        if node.op_type == "Transpose" and node.output[0] in dropped:
            continue
        nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    initializers = model.graph.initializer  # in place: rebuilding the list would copy every kept weight
    for i in reversed([i for i, tensor in enumerate(initializers) if tensor.name in dropped]):
        del initializers[i]
    initializers.extend(rewriter.new_initializers)
    kept_info = [v for v in model.graph.value_info if v.name not in dropped]
    del model.graph.value_info[:]
    model.graph.value_info.extend(kept_info)
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
