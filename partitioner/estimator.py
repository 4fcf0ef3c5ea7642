"""The cost model: seconds for a sub-layer on a device, from the pack's shapes and the profile DB.

A sub-layer's time is the sum, over its matrix products, of
    max(2·T·K·N / achieved FLOP/s(T, K, N),  K·N·element / achieved read bandwidth)
(element: the bytes of the weight's stored dtype, whose read bandwidth the profile measures per dtype),
plus its attention, max(4·heads·head_dim·T·C / achieved attention FLOP/s(T, C), KV bytes / bandwidth) (the
attention rate, measured at one ratio of query to KV heads, scaled to the model's: AttentionTable),
plus one hop and a measured per-node cost for each of its graph nodes. The KV bytes are the
manifest's cost-model traffic per context token. Where the profile timed this very pack (profile --pack) at a
placement, its times are used instead (docs/profile-db.md). Achieved rates come from the profile's tables: the
measured shape nearest in log(K·N) (and aspect) is taken, and between measured token counts M the
rate is interpolated as a power law (linear in log-log; clamped at the ends). CPU sub-layers that
overlap a copy use the rates measured under copy load. A copy takes bytes / link bandwidth at that size.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from pipeshard.core.errors import UserError
from pipeshard.formats.io_names import LOW_PLANE_SUFFIXES
from pipeshard.formats.manifest import ModelFacts, SubLayer
from pipeshard.formats.plans import Placement
from pipeshard.formats.profile_db import (
    COPY_KIND,
    QUANTIZED_MATMUL,
    STEP_KIND,
    AttentionRow,
    MatmulRow,
    PackTimings,
    ProfileDb,
    quantized_rows,
)

# q4: a GGUF's quantized product as 4-bit planes (exporter/quantized_weights.py); its bytes are counted as stored
ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "q4": 0.5}
WEIGHT_DTYPES = {
    "float32": "fp32",
    "float16": "fp16",
    "bfloat16": "bf16",
}  # manifest weight dtype -> short name
QUANTIZED_PARTS = (
    "_q4_",
    "_q2_",
    "_minimums",
)  # names of a quantized product's stored parts: WEIGHT + one of these...


def _bracket(points: list[tuple[float, float]], x: float) -> tuple[tuple[float, float], tuple[float, float]]:
    """The sorted (x, y) points either side of x; the same point twice outside them (interpolation clamps)."""
    xs = [p[0] for p in points]
    if x <= xs[0]:
        return points[0], points[0]
    if x >= xs[-1]:
        return points[-1], points[-1]
    i = bisect.bisect_left(xs, x)
    return points[i - 1], points[i]


def _interpolate_log(points: list[tuple[float, float]], x: float) -> float:
    """y at x, linear in log(y) over log(x) between sorted (x, y) points, clamped outside them.
    Rates grow in proportion to M while memory-bound, so a power law between points fits them."""
    (x0, y0), (x1, y1) = _bracket(points, x)
    if x0 == x1:
        return y0
    w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + w * (math.log(y1) - math.log(y0)))


def _interpolate_linear(points: list[tuple[float, float]], x: float) -> float:
    """y at x, linear between sorted (x, y) points, clamped outside them: a step's time is affine in the context its
    attention reads, where a power law through two points would overstate every context between them."""
    (x0, y0), (x1, y1) = _bracket(points, x)
    return y0 if x0 == x1 else y0 + (x - x0) / (x1 - x0) * (y1 - y0)


class RateTable:
    """Achieved GFLOP/s of MatMul by (M, K, N) from a profile's rows."""

    def __init__(self, rows: tuple[MatmulRow, ...]) -> None:
        if not rows:
            raise UserError("the profile has no MatMul rates for this device and dtype")
        self.by_shape: dict[tuple[int, int], list[tuple[float, float]]] = {}
        for row in rows:
            self.by_shape.setdefault((row.K, row.N), []).append((float(row.M), float(row.gflops)))
        for points in self.by_shape.values():
            points.sort()
        self._nearest: dict[tuple[int, int], tuple[int, int]] = {}

    def nearest_shape(self, k: int, n: int) -> tuple[int, int]:
        if (k, n) not in self._nearest:
            self._nearest[k, n] = self._find_nearest(k, n)
        return self._nearest[k, n]

    def _find_nearest(self, k: int, n: int) -> tuple[int, int]:
        def distance(shape: tuple[int, int]) -> float:
            return abs(math.log(shape[0] * shape[1] / (k * n))) + 0.25 * abs(
                math.log(shape[0] / shape[1] * n / k)
            )

        return min(self.by_shape, key=distance)

    def gflops(self, m: int, k: int, n: int, narrower: float = 1.0) -> float:
        """The rate at M rows; over weights `narrower` times fewer bytes than the table's (half-precision weights
        against the fp32 table), the memory-bound rate that many times higher, up to the shape's best measured."""
        points = self.by_shape[self.nearest_shape(k, n)]
        rate = _interpolate_log(points, m)
        return min(rate * narrower, max(g for _, g in points)) if narrower > 1.0 else rate

    def peak_gflops(self, k: int, n: int) -> float:
        """The best rate measured for the shape (its compute-bound rate at large M)."""
        return max(rate for _, rate in self.by_shape[self.nearest_shape(k, n)])


class AttentionTable:
    """Achieved attention GFLOP/s by (T, C), measured with `heads` query heads sharing `kv_heads` KV heads (the
    profile's kernel: the pack's ratio when it profiled a pack, else one KV head per query head)."""

    def __init__(self, rows: tuple[AttentionRow, ...]) -> None:
        self.by_context: dict[int, list[tuple[float, float]]] = {}
        for row in rows:
            self.by_context.setdefault(row.C, []).append((float(row.T), float(row.gflops)))
        for points in self.by_context.values():
            points.sort()
        self.peak_gflops = max((float(row.gflops) for row in rows), default=0.0)
        self.queries_per_kv_head = rows[0].queries_per_kv_head if rows else 1.0  # one ratio per table

    def gflops(self, tokens: int, context: int, queries_per_kv_head: float = 1.0) -> float:
        """The rate at (T, C) for a model whose query heads share KV heads `queries_per_kv_head` to one: the same
        FLOPs read `factor` = that ratio over the measured one times fewer KV bytes, so where the measured rate is
        bound by reading the KV it is that many times higher, up to the best rate the table measured (factor >= 1),
        or that many times lower (a model sharing its KV heads less than the kernel measured)."""
        contexts = sorted(self.by_context)
        per_context = [(float(c), _interpolate_log(self.by_context[c], tokens)) for c in contexts]
        rate = _interpolate_log(per_context, context)
        factor = queries_per_kv_head / self.queries_per_kv_head
        return max(rate, min(rate * factor, self.peak_gflops)) if factor >= 1.0 else rate * factor


@dataclass
class ComputeRates:
    """Everything the estimator needs about one compute device."""

    matmul: RateTable
    matmul_loaded: RateTable | None
    attention: AttentionTable
    read_gbps: float
    read_gbps_loaded: float
    hop_s: float
    op_s: float = 0.0
    weight_read_gbps: dict[str, float] | None = None  # M=1 products over half-precision weights, by dtype
    quantized: RateTable | None = (
        None  # products over a GGUF pack's 4-bit planes, where the profile measured them
    )


class Estimator:
    """Seconds per sub-layer (CPU or device) and per copy, for one pack, profile and thread count."""

    def __init__(
        self,
        profile: ProfileDb,
        model: ModelFacts,
        threads: int | None = None,
        model_sha256: str | None = None,
        weight_bits: float | None = None,
    ) -> None:
        self.profile = profile
        self.dtype = model.dtype  # the weights' (a half-precision pack computes in float32)
        self.element = ELEMENT_BYTES[model.compute_dtype]  # activations and KV
        self.weight_bits = weight_bits  # planning only: every weight read as this many bits
        self.weight_scale = (
            weight_bits / 8 / ELEMENT_BYTES.get(self.dtype, ELEMENT_BYTES[QUANTIZED_MATMUL])
            if weight_bits
            else 1.0
        )  # of stored bytes
        self.model = model
        available = profile.thread_counts
        self.threads = threads if threads in profile.cpu.threads else available[-1]
        if threads and threads not in profile.cpu.threads:
            self.threads = min(available, key=lambda t: abs(t - threads))
        cpu = profile.cpu.threads[self.threads]
        self.cpu = ComputeRates(
            matmul=RateTable(cpu.matmul[self._table_dtype(cpu.matmul)]),
            matmul_loaded=RateTable(cpu.under_copy_load.matmul[self._table_dtype(cpu.matmul)]),
            attention=AttentionTable(cpu.attention),
            read_gbps=cpu.memory_read_gbps,
            read_gbps_loaded=cpu.under_copy_load.memory_read_gbps,
            hop_s=cpu.hop_us * 1e-6,
            op_s=cpu.op_us * 1e-6,
            weight_read_gbps=cpu.weight_read_gbps,
            quantized=RateTable(quantized_rows(cpu.matmul)) if quantized_rows(cpu.matmul) else None,
        )
        device = profile.device
        if device.kind == "sim" or not device.matmul:
            launch_us = cpu.hop_us if device.launch_us is None else device.launch_us
            self.device = ComputeRates(
                self.cpu.matmul,
                None,
                self.cpu.attention,
                self.cpu.read_gbps,
                self.cpu.read_gbps,
                launch_us * 1e-6,
                # the simulated device's own sessions unpack 4-bit planes at every call
                quantized=RateTable(quantized_rows(device.matmul)) if quantized_rows(device.matmul) else None,
            )
        else:
            self.device = ComputeRates(
                matmul=RateTable(device.matmul[self._table_dtype(device.matmul)]),
                matmul_loaded=None,
                attention=AttentionTable(device.attention),
                read_gbps=device.memory_read_gbps or 500.0,
                read_gbps_loaded=device.memory_read_gbps or 500.0,
                hop_s=(10.0 if device.launch_us is None else device.launch_us) * 1e-6,
            )
        self.pack_timings = self._pack_timings(profile.pack_timings, model_sha256)
        h2d = profile.link.h2d
        self.link_rows = sorted((r.bytes, r.gbps) for r in h2d if r.pinned or not any(x.pinned for x in h2d))
        self.copy_slowdown = profile.contention.copy_slowdown_under_cpu_matmul
        # The pack's own streaming run on the simulated device: its copies beside its compute (pack_timing).
        copies = self.pack_timings.get(Placement.STREAMED, {}).get(COPY_KIND, {})
        self.streamed_copy_rows = sorted(point for points in copies.values() for point in points)
        factors = profile.contention.cpu_matmul_slowdown_under_copy.get(self.threads)
        self._cpu_slowdown = max(1.0, factors.memory_read if factors else 1.0)

    def _pack_timings(self, timings: PackTimings | None, model_sha256: str | None) -> dict[str, dict]:
        """Measured seconds of this very pack's sub-layer kinds (profile --pack), by placement, kind, past length
        and T; kind "step" holds the whole step's time over its parts' (what running them joined saves)."""
        rows = timings.threads.get(self.threads, ()) if timings else ()
        if not rows or model_sha256 is None or timings.model_sha256 != model_sha256:
            return {}
        table: dict[str, dict[str, dict[int, list[tuple[float, float]]]]] = {}
        for row in rows:
            table.setdefault(row.placement, {}).setdefault(row.kind, {}).setdefault(row.C - row.T, []).append(
                (float(row.T), row.value)
            )
        for by_kind in table.values():
            for by_past in by_kind.values():
                for points in by_past.values():
                    points.sort()
        return table

    def _measured_seconds(self, kind: str, tokens: int, context: int, placement: str) -> float | None:
        """Interpolated from the pack's own timings at this placement (log-log in T, then linear in the past
        length), scaled by how much faster the whole step ran than its parts timed apart."""
        by_kind = self.pack_timings.get(placement, {})
        if not by_kind.get(kind):
            return None

        def interpolated(by_past: dict[int, list[tuple[float, float]]]) -> float:
            past = max(context - tokens, 1)
            per_past = [
                (float(max(p, 1)), _interpolate_log(points, tokens)) for p, points in sorted(by_past.items())
            ]
            return _interpolate_linear(per_past, past)

        step = by_kind.get(STEP_KIND)
        return interpolated(by_kind[kind]) * (interpolated(step) if step else 1.0)

    def _table_dtype(self, table: dict[str, tuple[MatmulRow, ...]]) -> str:
        """The rate table of the products' arithmetic: the model's dtype where it computes in it (an fp16 graph),
        else fp32 (fp32 packs, and half-precision weights computed in fp32)."""
        compute = self.model.compute_dtype
        return compute if compute in table else "fp32"

    def _matmuls(self, entry: SubLayer) -> list[tuple[int, int, str, int]]:
        """(K, N, weight dtype, stored bytes) of each matrix product: weights are [K, N] for MatMul, [N, K] for
        the lm_head Gemm; a quantized product's low plane is [N, blocks, block / 2] uint8, and its other parts
        (a high plane, scales, zero points, minimums) are counted in its bytes; a 2-bit plane's blocks hold four
        codes a byte."""
        shapes = []
        quantized = [w for w in entry.weights if w.dtype == "uint8" and len(w.shape) == 3]
        for weight in quantized:
            bits = next((b for b, tail in LOW_PLANE_SUFFIXES.items() if weight.name.endswith(tail)), None)
            if bits is None:
                continue
            product = weight.name[: -len(LOW_PLANE_SUFFIXES[bits])]
            parts = [
                w for w in entry.weights if w.name.startswith(tuple(product + p for p in QUANTIZED_PARTS))
            ]
            n, blocks, block_bytes = weight.shape
            shapes.append((blocks * block_bytes * 8 // bits, n, "q4", sum(w.bytes for w in parts)))
        for weight in entry.weights:
            if len(weight.shape) != 2 or any(part in weight.name for part in QUANTIZED_PARTS):
                continue
            k, n = weight.shape
            if entry.kind in ("final", "embed") and n == self.model.hidden_size:
                k, n = n, k  # stored [vocab, hidden]: read transposed
            dtype = WEIGHT_DTYPES.get(weight.dtype, self.dtype)
            shapes.append((k, n, dtype, k * n * ELEMENT_BYTES[dtype]))
        return shapes

    def _weight_read_gbps(self, rates: ComputeRates, dtype: str, under_copy: bool) -> float:
        """How fast products stream weights of `dtype`: the profile's rate for that dtype where it measured one
        (pipeshard's half-precision product on the CPU), else the fp32 MatMul's."""
        read_gbps = rates.read_gbps_loaded if under_copy else rates.read_gbps
        measured = (rates.weight_read_gbps or {}).get(dtype)
        return measured * read_gbps / rates.read_gbps if measured else read_gbps

    def compute_seconds(
        self, entry: SubLayer, tokens: int, context: int, on_device: bool, under_copy: bool = False
    ) -> float:
        """Time of sub-layer `entry` for T=tokens new tokens at context C on the CPU or the device."""
        rates = self.device if on_device else self.cpu
        if entry.kind in ("prologue",):
            return rates.hop_s
        if entry.kind == "embed":
            row_bytes = (
                self.model.hidden_size * self.weight_bits / 8
                if self.weight_bits
                else sum(w.bytes for w in entry.weights) / self.model.vocab_size
            )
            return rates.hop_s + tokens * row_bytes / (rates.read_gbps * 1e9)
        measured = self._measured_seconds(entry.kind, tokens, context, "device" if on_device else "cpu")
        if measured is None and on_device and self.profile.device.kind == "sim":
            measured = self._measured_seconds(entry.kind, tokens, context, "cpu")  # sim computes on the CPU
        if measured is not None:
            return measured * (self._cpu_slowdown if under_copy else 1.0)
        read_gbps = rates.read_gbps_loaded if under_copy else rates.read_gbps
        seconds = (
            rates.hop_s + entry.nodes * rates.op_s + self._products_seconds(entry, tokens, rates, under_copy)
        )
        if entry.kind == "attn":
            flops = 4.0 * self.model.num_attention_heads * self.model.head_dim * tokens * context
            queries_per_kv_head = self.model.num_attention_heads / max(self.model.num_key_value_heads, 1)
            # The cost model's KV traffic per context token (its C term), else the KV's own bytes per token.
            per_context_token = entry.cost.bytes_per_context_token
            if per_context_token is None:
                per_context_token = entry.kv.bytes_per_token if entry.kv else 0
            kv_bytes = per_context_token * context
            seconds += max(
                flops / (rates.attention.gflops(tokens, context, queries_per_kv_head) * 1e9),
                kv_bytes / (read_gbps * 1e9),
            )
        return seconds

    def _products_seconds(self, entry: SubLayer, tokens: int, rates: ComputeRates, under_copy: bool) -> float:
        """The roofline of the sub-layer's matrix products over `tokens` rows."""
        table = rates.matmul_loaded if under_copy and rates.matmul_loaded else rates.matmul
        read_gbps = rates.read_gbps_loaded if under_copy else rates.read_gbps
        seconds = 0.0
        for k, n, dtype, stored_bytes in self._matmuls(entry):
            if self.weight_bits:
                # With assumed bits the measured rates at small M are bound by reading weights of the pack's dtype:
                # the roofline of the shape's peak rate and the weights' own bytes stands in for them.
                compute = 2.0 * tokens * k * n / (table.peak_gflops(k, n) * 1e9)
                memory = k * n * self.weight_bits / 8 / (read_gbps * 1e9)
            elif dtype == "q4" and rates.quantized is not None:
                compute = 2.0 * tokens * k * n / (rates.quantized.gflops(tokens, k, n) * 1e9)
                memory = stored_bytes / (self._weight_read_gbps(rates, dtype, under_copy) * 1e9)
            else:
                narrower = self.element / ELEMENT_BYTES[dtype]  # > 1: half-precision weights computed in fp32
                compute = 2.0 * tokens * k * n / (table.gflops(tokens, k, n, narrower) * 1e9)
                memory = stored_bytes / (self._weight_read_gbps(rates, dtype, under_copy) * 1e9)
            seconds += max(compute, memory)
        return seconds

    def vision_seconds(
        self, entry: SubLayer, tokens: int, context: int, on_device: bool, under_copy: bool = False
    ) -> float:
        """A vision block over `tokens` patches that each attend to `context` patches: its products' roofline as a
        sub-layer's, FLOPs its cost model counts beyond them (the patch embedding's convolution) at the rate of a
        square product of the tower's width, its attention (the cost model's T x C term) at the attention rate,
        one hop and its nodes."""
        rates = self.device if on_device else self.cpu
        table = rates.matmul_loaded if under_copy and rates.matmul_loaded else rates.matmul
        seconds = (
            rates.hop_s + entry.nodes * rates.op_s + self._products_seconds(entry, tokens, rates, under_copy)
        )
        products = sum(2.0 * k * n for k, n, _, _ in self._matmuls(entry))
        if (other := entry.cost.flops_per_token - products) > 0:
            width = max((w.shape[0] for w in entry.weights if len(w.shape) >= 2), default=1)
            seconds += other * tokens / (table.gflops(tokens, width, width) * 1e9)
        if attention := entry.cost.flops_per_token_and_context:
            seconds += attention * tokens * context / (rates.attention.gflops(tokens, context) * 1e9)
        return seconds

    def link_seconds(self, size_bytes: int) -> float:
        """One copy of `size_bytes` over the link, idle (activations crossing between the CPU and the device)."""
        if size_bytes <= 0:
            return 0.0
        return size_bytes / (_interpolate_log([(float(b), g) for b, g in self.link_rows], size_bytes) * 1e9)

    def copy_seconds(self, size_bytes: int, under_cpu_load: bool = False, tokens: int = 1) -> float:
        """Host-to-device copy of `size_bytes` (beside compute of `tokens`-token steps: at the rate the pack's
        streaming run achieved on the simulated device, where it was timed)."""
        if size_bytes <= 0:
            return 0.0
        if under_cpu_load and self.streamed_copy_rows:
            return size_bytes / (_interpolate_log(self.streamed_copy_rows, tokens) * 1e9)
        gbps = _interpolate_log([(float(b), g) for b, g in self.link_rows], size_bytes)
        return size_bytes / (gbps * 1e9) * (self.copy_slowdown if under_cpu_load else 1.0)
