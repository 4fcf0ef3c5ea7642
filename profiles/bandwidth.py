"""Memory read bandwidth as a decode step sees it: one ORT MatMul streaming a weight far larger than
the caches, with a one-row input (STREAM-like: every weight byte is read once per run)."""

from __future__ import annotations

import time

import numpy as np

from pipeshard.profiles.kernels import BoundSession, matmul_model
from pipeshard.runtime.ort import cpu_session_options, import_onnxruntime

READ_K, READ_N = 4096, 16384  # a 256 MiB fp32 weight


def read_bandwidth(threads: int, repeats: int = 12, k: int = READ_K, n: int = READ_N) -> dict:
    """Bytes per second read by a [1, k] x [k, n] fp32 MatMul on the CPU EP with `threads` threads.
    The best of `repeats` runs is the machine's limit (a shared machine only ever makes runs slower);
    the median is reported beside it."""
    ort = import_onnxruntime()
    session = BoundSession(ort, matmul_model(k, n, "fp32"), cpu_session_options(threads), ["CPUExecutionProvider"],
                           {"X": np.ones((1, k), np.float32)}, {"Y": ((1, n), np.float32)})
    session()  # first run: prepacking and page faults
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        session()
        times.append(time.perf_counter() - started)
    weight_bytes = k * n * 4
    return {"kernel": f"MatMul [1,{k}]x[{k},{n}] fp32, CPU EP", "threads": threads, "bytes": weight_bytes,
            "best_bytes_per_s": weight_bytes / min(times), "median_bytes_per_s": weight_bytes / float(np.median(times))}
