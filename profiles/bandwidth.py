"""Memory read bandwidth as a decode step sees it: one ORT MatMul with a one-row input streaming as many
weight bytes as the model reads per token (STREAM-like: every byte read once per run), so the roofline
compares like with like (probe sizes and their figures: docs/benchmarks.md)."""

from __future__ import annotations

import time

import numpy as np

from pipeshard.profiles.kernels import BoundSession, matmul_model
from pipeshard.runtime.ort import cpu_session_options, import_onnxruntime

READ_K = 4096  # rows of the probe's weight; its columns follow from the bytes to read


class BandwidthProbe:
    """Bytes per second read by a [1, k] x [k, n] fp32 MatMul on the CPU EP with `threads` threads, the weight
    about `read_bytes` large, sampled as often as asked (a benchmark samples between its rounds, so one busy
    moment cannot set the figure). The best sample is the machine's limit (a shared machine only ever makes
    runs slower); the median is reported beside it."""

    def __init__(self, threads: int, read_bytes: float) -> None:
        ort = import_onnxruntime()
        self.threads, self.k = threads, READ_K
        self.n = max(16, round(read_bytes / (4 * READ_K) / 16) * 16)
        self.session = BoundSession(
            ort,
            matmul_model(self.k, self.n, "fp32"),
            cpu_session_options(threads),
            ["CPUExecutionProvider"],
            {"X": np.ones((1, self.k), np.float32)},
            {"Y": ((1, self.n), np.float32)},
        )
        self.session()  # first run: prepacking and page faults
        self.times: list[float] = []

    def sample(self, repeats: int) -> None:
        for _ in range(repeats):
            started = time.perf_counter()
            self.session()
            self.times.append(time.perf_counter() - started)

    def result(self) -> dict:
        weight_bytes = self.k * self.n * 4
        return {
            "kernel": f"MatMul [1,{self.k}]x[{self.k},{self.n}] fp32, CPU EP",
            "threads": self.threads,
            "bytes": weight_bytes,
            "samples": len(self.times),
            "best_bytes_per_s": weight_bytes / min(self.times),
            "median_bytes_per_s": weight_bytes / float(np.median(self.times)),
        }
