"""CUDA part of the profile: PCIe copies (pinned and pageable, both directions, by size, idle and while
the CPU computes), the CUDA EP's matrix and attention sweeps, launch overhead and the EP's own memory
overhead (cudaMemGetInfo before and after creating and running a session).

Needs onnxruntime-gpu with a CUDA EP that really loads, and NVIDIA's cuda-python (`cuda.bindings`).
Unverified on real hardware until the GPU check runs it (see README).
"""

from __future__ import annotations

import threading

import numpy as np

from pipeshard.profiles.kernels import (
    NUMPY_FLOAT,
    BoundSession,
    attention_rows,
    cpu_matmul_load,
    hop_model,
    matmul_model,
    median_seconds,
)
from pipeshard.runtime.ort import CUDA_PROVIDERS, import_onnxruntime


def _check(result):
    """cuda-python returns (err, *values); raise on an error, return the values."""
    err, *values = result
    if int(err) != 0:
        raise RuntimeError(f"CUDA error {err}")
    return values[0] if len(values) == 1 else values


class CudaRuntime:
    """The few runtime calls the profiler and the cuda device need."""

    def __init__(self) -> None:
        from cuda.bindings import runtime

        self.rt = runtime
        _check(runtime.cudaSetDevice(0))

    def properties(self) -> dict:
        props = _check(self.rt.cudaGetDeviceProperties(0))
        driver = _check(self.rt.cudaDriverGetVersion())
        free, total = _check(self.rt.cudaMemGetInfo())
        name = props.name.decode() if isinstance(props.name, bytes) else str(props.name)
        return {
            "name": name.strip("\x00"),
            "driver": str(driver),
            "memory_bytes": int(total),
            "free_bytes": int(free),
        }

    def free_bytes(self) -> int:
        return int(_check(self.rt.cudaMemGetInfo())[0])

    def copy_gbps(self, size: int, pinned: bool, to_device: bool, seconds: float) -> float:
        rt = self.rt
        device = _check(rt.cudaMalloc(size))
        host_array = None
        host = _check(rt.cudaMallocHost(size)) if pinned else None
        if not pinned:
            host_array = np.ones(size, np.uint8)
            host = host_array.ctypes.data
        stream = _check(rt.cudaStreamCreate())
        kind = (
            rt.cudaMemcpyKind.cudaMemcpyHostToDevice
            if to_device
            else rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        )
        source, target = (host, device) if to_device else (device, host)

        def copy() -> None:
            _check(rt.cudaMemcpyAsync(target, source, size, kind, stream))
            _check(rt.cudaStreamSynchronize(stream))

        try:
            return size / median_seconds(copy, seconds) / 1e9
        finally:
            _check(rt.cudaStreamDestroy(stream))
            _check(rt.cudaFree(device))
            if pinned:
                _check(rt.cudaFreeHost(host))
            del host_array


class H2DLoop:
    """Background pinned host-to-device copies: the contention load for CPU kernels on a CUDA machine."""

    def __init__(self, size_bytes: int = 64 * 1024**2) -> None:
        self.cuda = CudaRuntime()
        self.size = size_bytes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.cuda.copy_gbps(self.size, True, True, 0.0)

    def __enter__(self) -> H2DLoop:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def measure_cuda(sweep, cpu_threads: int) -> tuple[dict, dict, dict]:
    """(device section, link section, copy slowdown under CPU load) of the profile DB."""
    from pipeshard.runtime.ort import cpu_session_options

    ort = import_onnxruntime()
    cuda = CudaRuntime()
    before = cuda.free_bytes()
    options = ort.SessionOptions()
    options.log_severity_level = 3
    hop = BoundSession(
        ort,
        hop_model(4096),
        options,
        CUDA_PROVIDERS,
        {"X": np.ones((1, 1, 4096), np.float32)},
        {"Y": ((1, 1, 4096), np.float32)},
        device="cuda",
    )
    hop()
    overhead = before - cuda.free_bytes()
    launch_us = median_seconds(hop, 0.2, min_runs=200) * 1e6
    matmul: dict[str, list[dict]] = {}
    for dtype in sweep.dtypes:
        rows = []
        for k, n in sweep.shapes:
            model = matmul_model(k, n, dtype)
            for m in sweep.tiers:
                x = np.ones((m, k), NUMPY_FLOAT[dtype])
                session = BoundSession(
                    ort,
                    model,
                    options,
                    CUDA_PROVIDERS,
                    {"X": x},
                    {"Y": ((m, n), NUMPY_FLOAT[dtype])},
                    device="cuda",
                )
                seconds = median_seconds(session, sweep.seconds_per_point)
                rows.append(
                    {"M": m, "K": k, "N": n, "seconds": seconds, "gflops": 2 * m * k * n / seconds / 1e9}
                )
        matmul[dtype] = rows
    attention = attention_rows(
        ort,
        options,
        CUDA_PROVIDERS,
        sweep.heads,
        sweep.kv_heads,
        sweep.head_dim,
        sweep.attention_tokens,
        sweep.attention_contexts,
        "fp16",
        sweep.seconds_per_point,
        device="cuda",
    )
    link = {"kind": "pcie", "h2d": [], "d2h": []}
    for pinned in (True, False):
        for size in sweep.copy_sizes:
            for direction, to_device in (("h2d", True), ("d2h", False)):
                gbps = cuda.copy_gbps(size, pinned, to_device, sweep.seconds_per_point)
                link[direction].append({"bytes": size, "pinned": pinned, "gbps": gbps})
    # The copy while the CPU computes matrix products on every thread.
    with cpu_matmul_load(ort, cpu_session_options(cpu_threads), *sweep.shapes[-1]):
        link["under_cpu_load"] = {
            "h2d": [
                {"bytes": s, "pinned": True, "gbps": cuda.copy_gbps(s, True, True, sweep.seconds_per_point)}
                for s in sweep.copy_sizes
            ]
        }
    properties = cuda.properties()
    device = {
        "kind": "cuda",
        "name": properties["name"],
        "driver": properties["driver"],
        "memory_bytes": properties["memory_bytes"],
        "ep_overhead_bytes": int(overhead),
        "matmul": matmul,
        "attention": attention,
        "launch_us": launch_us,
    }
    return device, link, properties
