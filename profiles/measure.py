"""Measure this machine: CPU-EP kernel rates per thread count, the copy link, and their contention.

Without a usable CUDA EP the accelerator is `sim`: its link is a memcpy on a separate thread (what the
sim device's prefetcher does) and its compute is the CPU EP; the DB says so. With CUDA, `measure_cuda`
adds the device sweeps, the PCIe link and the EP's memory overhead.
"""

from __future__ import annotations

import logging
import tempfile
import threading
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path

import numpy as np

from pipeshard.formats.manifest import Manifest
from pipeshard.profiles.db import fingerprint_id, machine_fingerprint, now_iso, physical_cores
from pipeshard.profiles.kernels import (
    NUMPY_FLOAT,
    BoundSession,
    attention_rows,
    cpu_matmul_load,
    hop_model,
    matmul_model,
    median_seconds,
    op_chain_model,
    quantized_matmul_model,
    quantized_planes,
    weight_matmul_model,
)
from pipeshard.runtime.ort import cpu_session_options, cuda_usable, import_onnxruntime

log = logging.getLogger(__name__)
MiB = 1024**2


PACK_TIERS = (1, 4, 16, 64, 256)  # the pack's own sub-layers are timed at every tier the planner uses most


@dataclass(frozen=True)
class Sweep:
    """What a profile run measures."""

    tiers: tuple[int, ...]
    shapes: tuple[tuple[int, int], ...]
    dtypes: tuple[str, ...]
    attention_tokens: tuple[int, ...]
    attention_contexts: tuple[int, ...]
    copy_sizes: tuple[int, ...]
    bandwidth_bytes: int
    seconds_per_point: float
    heads: int = 16
    kv_heads: int = 16  # as many as query heads, unless a pack's ratio is swept (`sweep_for_pack`)
    head_dim: int = 64
    pack_pasts: tuple[int, ...] = (64, 1024)  # contexts at which `--pack` times the pack's own sub-layers
    # `--pack` times the pack at every thread count, or only at the largest (what a run uses by default; the
    # estimator keeps its roofline rates at the others)
    pack_every_thread_count: bool = True
    pack_repeat: int = 3  # timed runs per point of `--pack` (their median)

    def pack_thread_counts(self, thread_counts: list[int]) -> list[int]:
        return thread_counts if self.pack_every_thread_count else [max(thread_counts)]


QUICK = Sweep(
    tiers=(1, 16, 256),
    shapes=((576, 1536), (2048, 2048), (4096, 4096)),
    dtypes=("fp32", "fp16"),
    attention_tokens=(1, 64),
    attention_contexts=(512, 4096),
    copy_sizes=(1 * MiB, 16 * MiB, 128 * MiB),
    bandwidth_bytes=128 * MiB,  # beyond the last-level cache of client CPUs (96 MiB at most)
    seconds_per_point=0.05,
    pack_pasts=(32, 512),
    pack_every_thread_count=False,
    pack_repeat=2,
)
FULL = Sweep(
    tiers=(1, 4, 16, 64, 256, 1024),
    shapes=(
        (576, 576),
        (576, 1536),
        (1536, 576),
        (2048, 2048),
        (2048, 8192),
        (8192, 2048),
        (4096, 4096),
        (4096, 14336),
        (14336, 4096),
    ),
    dtypes=("fp32", "fp16"),
    attention_tokens=(1, 16, 256),
    attention_contexts=(256, 1024, 4096, 16384),
    copy_sizes=(256 * 1024, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB),
    bandwidth_bytes=512 * MiB,
    seconds_per_point=0.15,
)


def sweep_for_pack(base: Sweep, manifest: Manifest) -> Sweep:
    """The pack's own matrix shapes and attention dimensions (its query and KV head counts) instead of the generic
    grid."""
    shapes = sorted({w.shape for e in manifest.sub_layers for w in e.weights if len(w.shape) == 2})
    model = manifest.model
    return Sweep(
        **{
            **base.__dict__,
            "shapes": tuple(shapes),
            "heads": model.num_attention_heads,
            "kv_heads": model.num_key_value_heads,
            "head_dim": model.head_dim,
        }
    )


class CopyLoop:
    """Background memcpy loop: the sim device's link, used as the contention load for CPU kernels."""

    def __init__(self, size_bytes: int = 64 * MiB) -> None:
        self.source = np.ones(size_bytes, dtype=np.uint8)
        self.target = np.empty_like(self.source)
        self.copied_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            np.copyto(self.target, self.source)
            self.copied_bytes += self.source.nbytes

    def __enter__(self) -> CopyLoop:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def sim_copy_gbps(size_bytes: int, seconds: float) -> float:
    """Bandwidth of a memcpy of `size_bytes` on another thread."""
    source = np.ones(size_bytes, dtype=np.uint8)
    target = np.empty_like(source)
    result: list[float] = []
    worker = threading.Thread(
        target=lambda: result.append(median_seconds(lambda: np.copyto(target, source), seconds))
    )
    worker.start()
    worker.join()
    return size_bytes / result[0] / 1e9


def sim_upload_gbps(size_bytes: int, seconds: float, blob: Path | None = None) -> float:
    """Bandwidth of the sim device's own upload of a streamed unit: from a memory-mapped file on its copy thread,
    the file's pages let go after each copy (so each copy maps them in again from the page cache, as a unit's does
    in a run). `blob`: a pack's weight file to copy from (how fast the page cache gives back a file depends on how
    it was written); else a file written here."""
    from pipeshard.runtime.devices import SimDevice

    device = SimDevice(1 << 60)
    target = np.empty(size_bytes, dtype=np.uint8)
    with tempfile.TemporaryDirectory() as folder:
        if blob is None:
            blob = Path(folder) / "unit.bin"
            np.ones(size_bytes, dtype=np.uint8).tofile(blob)
        source = device.host_source(blob, 0, size_bytes)
        try:
            return size_bytes / median_seconds(lambda: device.upload(target, source).result(), seconds) / 1e9
        finally:
            device.close()


def _matmul_rows(ort, sweep: Sweep, threads: int, copy_load, progress) -> tuple[dict, dict]:
    """MatMul rates idle and under the copy load, each point measured back to back on one session per shape."""
    options = cpu_session_options(threads)
    idle: dict[str, list[dict]] = {}
    loaded: dict[str, list[dict]] = {}
    for dtype in sweep.dtypes:
        idle[dtype], loaded[dtype] = [], []
        for k, n in sweep.shapes:
            session = None
            for m in sweep.tiers:
                x = (
                    np.random.default_rng(1)
                    .standard_normal((m, k), dtype=np.float32)
                    .astype(NUMPY_FLOAT[dtype])
                )
                outputs = {"Y": ((m, n), NUMPY_FLOAT[dtype])}
                if session is None:
                    session = BoundSession(
                        ort, matmul_model(k, n, dtype), options, ["CPUExecutionProvider"], {"X": x}, outputs
                    )
                else:
                    session.bind({"X": x}, outputs)
                for table, load in ((idle, None), (loaded, copy_load)):
                    if load is None:
                        seconds = median_seconds(session, sweep.seconds_per_point)
                    else:
                        with load():
                            seconds = median_seconds(session, sweep.seconds_per_point)
                    table[dtype].append(
                        {"M": m, "K": k, "N": n, "seconds": seconds, "gflops": 2 * m * k * n / seconds / 1e9}
                    )
                    progress()
    return idle, loaded


def quantized_matmul_rows(sweep: Sweep, threads: int, on_sim_device: bool = False) -> list[dict]:
    """Rates of products over a GGUF pack's 4-bit planes at the sweep's M and shapes (K a whole number of blocks),
    through the C-API runtime: on the CPU as the chain runs them (pipeshard's BlockMatMul where built, else
    MatMulNBits), or on the simulated device as its sessions run them (MatMulNBits with the planes bound as inputs,
    unpacked at every call). A product's time at M rows is not fp32's: its blocks are widened as it reads them."""
    from pipeshard.runtime import capi

    rt = capi.runtime(threads)
    op = "BlockMatMul" if capi.custom_ops_available() and not on_sim_device else "MatMulNBits"
    rows = []
    for k, n in sweep.shapes:
        if k % 32:
            continue
        model = quantized_matmul_model(k, n, op=op, weights_as_inputs=on_sim_device)
        session = rt.session(model.SerializeToString(), threads=threads)
        inputs = quantized_planes(k, n) if on_sim_device else {}
        for m in sweep.tiers:
            y = np.empty((m, n), np.float32)
            binding = session.binding()
            for name, array in {
                "X": np.random.default_rng(1).standard_normal((m, k), np.float32),
                **inputs,
            }.items():
                binding.bind_input(name, array)
            binding.bind_output("Y", y)
            seconds = median_seconds(
                partial(capi.run, session, binding, rt.run_options()), sweep.seconds_per_point
            )
            rows.append({"M": m, "K": k, "N": n, "seconds": seconds, "gflops": 2 * m * k * n / seconds / 1e9})
    return rows


def matmul_read_gbps(ort, threads: int, size_bytes: int, seconds: float, copy_load) -> tuple[float, float]:
    """Bytes per second an M=1 MatMul streams from a weight of `size_bytes` (the decode roofline),
    idle and under the copy load."""
    side = int(np.sqrt(size_bytes / 4))
    session = BoundSession(
        ort,
        matmul_model(side, side, "fp32"),
        cpu_session_options(threads),
        ["CPUExecutionProvider"],
        {"X": np.ones((1, side), np.float32)},
        {"Y": ((1, side), np.float32)},
    )
    idle = side * side * 4 / median_seconds(session, seconds) / 1e9
    with copy_load():
        loaded = side * side * 4 / median_seconds(session, seconds) / 1e9
    return idle, loaded


def weight_read_gbps(threads: int, size_bytes: int, seconds: float) -> dict[str, float]:
    """Bytes per second an M=1 product streams from stored weights of about `size_bytes` (the decode roofline of a
    pack's CPU sub-layers), by dtype: pipeshard's WeightMatMul over fp16 / bf16 weights (where the C extension is
    built) and the product over a GGUF pack's 4-bit planes (`q4`: codes, scales and zero points counted), by
    pipeshard's BlockMatMul where built (what the chain's CPU sessions swap MatMulNBits for), else MatMulNBits.
    Through the C-API runtime, as the chain runs it."""
    from pipeshard.runtime import capi

    rt = capi.runtime(threads)
    found = {}
    for dtype, (model, width, stored_bytes) in _weight_read_models(
        size_bytes, capi.custom_ops_available()
    ).items():
        session = rt.session(model, threads=threads)
        x, y = np.ones((1, width), np.float32), np.empty((1, width), np.float32)
        binding = session.binding()
        binding.bind_input("X", x)
        binding.bind_output("Y", y)
        run = partial(capi.run, session, binding, rt.run_options())
        found[dtype] = stored_bytes / median_seconds(run, seconds) / 1e9
    return found


@lru_cache(maxsize=1)
def _weight_read_models(size_bytes: int, custom_ops: bool) -> dict[str, tuple[bytes, int, int]]:
    """dtype -> (serialized model, K = N, stored weight bytes) of weight_read_gbps' products, made once for every
    thread count."""
    models = {}
    if custom_ops:
        side = int(np.sqrt(size_bytes / 2))
        models = {
            dtype: (weight_matmul_model(side, side, dtype).SerializeToString(), side, side * side * 2)
            for dtype in ("fp16", "bf16")
        }
    side = int(np.sqrt(size_bytes * 2)) // 32 * 32
    blocks = side // 32
    models["q4"] = (
        quantized_matmul_model(
            side, side, op="BlockMatMul" if custom_ops else "MatMulNBits"
        ).SerializeToString(),
        side,
        side * (blocks * 16 + blocks * 4 + (blocks + 1) // 2),
    )
    return models


def hop_microseconds(ort, threads: int, width: int = 4096) -> float:
    """Fixed cost of one session run with IO binding (raw call, reused RunOptions)."""
    x = np.ones((1, 1, width), np.float32)
    session = BoundSession(
        ort,
        hop_model(width),
        cpu_session_options(threads),
        ["CPUExecutionProvider"],
        {"X": x},
        {"Y": (x.shape, np.float32)},
    )
    return median_seconds(session, 0.2, min_runs=200) * 1e6


def op_microseconds(ort, threads: int, width: int = 1024, count: int = 32) -> float:
    """Cost of one more small node in a session (graph-level overhead beyond the hop)."""
    x = np.ones((1, 1, width), np.float32)
    options = cpu_session_options(threads, optimize=False)  # keep the chain: no fusion
    session = BoundSession(
        ort,
        op_chain_model(width, count),
        options,
        ["CPUExecutionProvider"],
        {"t0": x},
        {f"t{count}": (x.shape, np.float32)},
    )
    return max(0.0, median_seconds(session, 0.2, min_runs=50) * 1e6 - hop_microseconds(ort, threads)) / count


def measure_machine(
    sweep: Sweep,
    thread_counts: list[int] | None = None,
    progress=lambda: None,
    use_cuda: bool | None = None,
    pack: str | None = None,
) -> dict:
    """Run every measurement of `sweep`; returns a schema-1 profile document. The CUDA part runs when
    the CUDA EP is really usable (or is forced off with use_cuda=False)."""
    from pipeshard.profiles import measure_cuda
    from pipeshard.runtime import capi

    ort = import_onnxruntime()
    thread_counts = thread_counts or list(range(1, physical_cores() + 1))
    # The process's one C-API thread pool, made with the largest thread count first: what a run uses by default
    # and what `--pack` times runs on that shared, spinning pool as a run's sessions do (made at the first
    # 1-thread measurement, the 2-thread sessions got quiet pools of their own, slower at one-token steps).
    capi.runtime(max(thread_counts))
    if use_cuda is None:
        use_cuda = cuda_usable()
    copy_load = measure_cuda.H2DLoop if use_cuda else CopyLoop
    cpu_threads: dict[str, dict] = {}
    for threads in thread_counts:
        idle_matmul, loaded_matmul = _matmul_rows(ort, sweep, threads, copy_load, progress)
        read_idle, read_loaded = matmul_read_gbps(
            ort, threads, sweep.bandwidth_bytes, sweep.seconds_per_point, copy_load
        )
        copy_idle = sim_copy_gbps(sweep.bandwidth_bytes, sweep.seconds_per_point)
        cpu_threads[str(threads)] = {
            "matmul": {**idle_matmul, "q4": quantized_matmul_rows(sweep, threads)},
            "memory_read_gbps": read_idle,
            "weight_read_gbps": weight_read_gbps(threads, sweep.bandwidth_bytes, sweep.seconds_per_point),
            "memory_copy_gbps": copy_idle,
            "attention": attention_rows(
                ort,
                cpu_session_options(threads),
                ["CPUExecutionProvider"],
                sweep.heads,
                sweep.kv_heads,
                sweep.head_dim,
                sweep.attention_tokens,
                sweep.attention_contexts,
                "fp32",
                sweep.seconds_per_point,
                progress=progress,
            ),
            "hop_us": hop_microseconds(ort, threads),
            "op_us": op_microseconds(ort, threads),
            "under_copy_load": {"matmul": loaded_matmul, "memory_read_gbps": read_loaded},
        }
        progress()
    if use_cuda:
        device, link, gpu = measure_cuda.measure_cuda(sweep, max(thread_counts))
        link_rows, loaded_link = link["h2d"], link["under_cpu_load"]["h2d"]
    else:
        blob, sizes = _largest_blob(pack, sweep.copy_sizes)
        link_rows = [
            {"bytes": size, "gbps": sim_upload_gbps(size, sweep.seconds_per_point, blob), "pinned": False}
            for size in sizes
        ]
        loaded_link = _copy_under_cpu_load(ort, sweep, max(thread_counts), blob, sizes)
        gpu = None
        device = {
            "kind": "sim",
            "name": "sim (host memory; compute on the CPU EP)",
            "note": "no usable CUDA EP: the simulated accelerator is measured; not a GPU claim",
            "memory_bytes": None,
            "ep_overhead_bytes": 0,
            "matmul": {"q4": quantized_matmul_rows(sweep, max(thread_counts), on_sim_device=True)},
            "attention": [],
            "launch_us": cpu_threads[str(max(thread_counts))]["hop_us"],
        }
        link = {
            "kind": "sim-memcpy",
            "h2d": link_rows,
            "d2h": link_rows,
            "under_cpu_load": {"h2d": loaded_link},
        }
    fingerprint = machine_fingerprint(gpu)
    extra = {}
    if pack is not None:
        from pipeshard.formats.manifest import load_pack
        from pipeshard.profiles.pack_timing import time_pack

        manifest = load_pack(pack).manifest
        extra["pack_timings"] = {
            "model_sha256": manifest.source["model_sha256"],
            "pasts": list(sweep.pack_pasts),
            "threads": {
                str(t): time_pack(
                    pack,
                    t,
                    PACK_TIERS,
                    sweep.pack_pasts,
                    repeat=sweep.pack_repeat,
                    progress=progress,
                    device="cuda" if use_cuda else "sim",
                )
                for t in sweep.pack_thread_counts(thread_counts)
            },
        }
    return {
        "schema_version": 1,
        "source": "measured",
        "created": now_iso(),
        "fingerprint": fingerprint,
        "fingerprint_id": fingerprint_id(fingerprint),
        "plan": {
            "tiers": list(sweep.tiers),
            "shapes": [list(s) for s in sweep.shapes],
            "dtypes": list(sweep.dtypes),
        },
        "cpu": {"physical_cores": physical_cores(), "threads": cpu_threads},
        "device": device,
        "link": link,
        "contention": contention_factors(cpu_threads, link_rows, loaded_link),
        **extra,
    }


def _copy_under_cpu_load(ort, sweep: Sweep, threads: int, blob: Path | None, sizes: list[int]) -> list[dict]:
    """The sim device's upload bandwidth while CPU matrix products run on `threads` threads."""
    with cpu_matmul_load(ort, cpu_session_options(threads), *sweep.shapes[-1]):
        return [
            {"bytes": size, "gbps": sim_upload_gbps(size, sweep.seconds_per_point, blob), "pinned": False}
            for size in sizes
        ]


def _largest_blob(pack: str | None, copy_sizes: tuple[int, ...]) -> tuple[Path | None, list[int]]:
    """The pack's largest weight file to time the sim device's uploads from, and the sizes that fit in it (its own
    size in place of larger ones); without a pack, none and the sweep's sizes."""
    if pack is None:
        return None, list(copy_sizes)
    blobs = sorted(Path(pack).glob("*.weights"), key=lambda p: p.stat().st_size)
    if not blobs:
        return None, list(copy_sizes)
    largest = blobs[-1]
    size = largest.stat().st_size
    return largest, sorted({min(s, size) for s in copy_sizes})


def contention_factors(cpu_threads: dict, link_idle: list[dict], link_loaded: list[dict]) -> dict:
    """Slowdowns (>= 1 means slower) of CPU MatMul under a copy, and of the copy under CPU MatMul."""
    matmul = {}
    for threads, rates in cpu_threads.items():
        by_tier: dict[str, list[float]] = {}
        for dtype, loaded_rows in rates["under_copy_load"]["matmul"].items():  # the dtypes timed both ways
            for idle, loaded in zip(rates["matmul"][dtype], loaded_rows, strict=True):
                by_tier.setdefault(str(idle["M"]), []).append(loaded["seconds"] / idle["seconds"])
        matmul[threads] = {tier: float(np.median(values)) for tier, values in by_tier.items()}
        matmul[threads]["memory_read"] = (
            rates["memory_read_gbps"] / rates["under_copy_load"]["memory_read_gbps"]
        )
    # Each loaded copy beside the idle one of its size and memory (on CUDA only pinned copies are timed loaded).
    loaded_gbps = {(row["bytes"], row.get("pinned", False)): row["gbps"] for row in link_loaded}
    copy = [
        row["gbps"] / loaded_gbps[key]
        for row in link_idle
        if (key := (row["bytes"], row.get("pinned", False))) in loaded_gbps
    ]
    return {
        "cpu_matmul_slowdown_under_copy": matmul,
        "copy_slowdown_under_cpu_matmul": float(np.median(copy)),
    }
