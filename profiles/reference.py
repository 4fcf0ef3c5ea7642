"""Reference profiles for machines we do not have, built from public specifications.

Each rate is a roofline on the spec figures (compute peak x efficiency, memory bandwidth x
efficiency); the document is marked `"source": "spec"` and lists the figures used. Regenerate the
shipped JSON files with `python -m pipeshard.profiles.reference` (a test checks they are current).
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeshard.formats.profile_db import PROFILE_SCHEMA_VERSION
from pipeshard.profiles.measure import FULL

GB = 1e9
GiB = 1024**3
COMPUTE_EFFICIENCY = 0.6  # share of peak FLOP/s a large GEMM reaches
BANDWIDTH_EFFICIENCY = 0.7  # share of the theoretical memory bandwidth a streaming read reaches
PCIE_EFFICIENCY = {"pinned": 0.8, "pageable": 0.5}
PER_CORE_READ_GBPS = 15.0  # one core cannot saturate DRAM; bandwidth grows with threads up to the bus

SPECS = {
    "laptop-8gb": {
        "description": "gaming laptop: RTX 4060 Laptop GPU 8 GB on PCIe 4.0 x8, 8-core Ryzen 7 7840HS, DDR5-5600",
        "cpu": {
            "model": "AMD Ryzen 7 7840HS",
            "cores": 8,
            "peak_gflops_fp32": 8 * 3.8 * 32,
            "memory_gbps": 89.6,
            "fp16_speed": 0.5,
        },
        "gpu": {
            "model": "NVIDIA GeForce RTX 4060 Laptop GPU",
            "memory_bytes": 8 * GiB,
            "memory_gbps": 256.0,
            "peak_gflops_fp32": 14600.0,
            "peak_gflops_fp16": 58000.0,
        },
        "link": {"name": "PCIe 4.0 x8", "gbps": 15.75},
    },
    "desktop-24gb": {
        "description": "desktop: RTX 4090 24 GB on PCIe 4.0 x16, 16-core Ryzen 9 7950X, DDR5-6000",
        "cpu": {
            "model": "AMD Ryzen 9 7950X",
            "cores": 16,
            "peak_gflops_fp32": 16 * 4.5 * 32,
            "memory_gbps": 96.0,
            "fp16_speed": 0.5,
        },
        "gpu": {
            "model": "NVIDIA GeForce RTX 4090",
            "memory_bytes": 24 * GiB,
            "memory_gbps": 1008.0,
            "peak_gflops_fp32": 82600.0,
            "peak_gflops_fp16": 165200.0,
        },
        "link": {"name": "PCIe 4.0 x16", "gbps": 31.5},
    },
    "laptop-4gb": {
        "description": "entry laptop: RTX 3050 Laptop GPU 4 GB on PCIe 4.0 x8, 8-core Core i5-12450H, DDR4-3200",
        "cpu": {
            "model": "Intel Core i5-12450H",
            "cores": 8,
            "peak_gflops_fp32": 600.0,
            "memory_gbps": 51.2,
            "fp16_speed": 0.5,
        },
        "gpu": {
            "model": "NVIDIA GeForce RTX 3050 Laptop GPU",
            "memory_bytes": 4 * GiB,
            "memory_gbps": 192.0,
            "peak_gflops_fp32": 7100.0,
            "peak_gflops_fp16": 28400.0,
        },
        "link": {"name": "PCIe 4.0 x8", "gbps": 15.75},
    },
    # The paper's machine class (its Table 4 / Figure 2: an RTX 5090 desktop, 16 CPU threads). The CPU model is an
    # assumption: a 16-core desktop part with dual-channel DDR5-5600 (Zen 5: two 512-bit FMA pipes per core).
    "desktop-rtx5090": {
        "description": "the paper's desktop: RTX 5090 32 GB on PCIe 5.0 x16, a 16-core Ryzen 9 9950X class CPU, "
        "dual-channel DDR5-5600",
        "cpu": {
            "model": "AMD Ryzen 9 9950X",
            "cores": 16,
            "peak_gflops_fp32": 16 * 5.0 * 64,
            "memory_gbps": 89.6,
            "fp16_speed": 0.5,
            # Not a spec figure: the read rate the artifact's own -ngl baseline runs imply (median of 40 Minitron
            # decode runs at 1K context; examples/calibrate_rtx5090.py, docs/paper-comparison.md). It replaces
            # memory_gbps x BANDWIDTH_EFFICIENCY at every thread count that could reach it.
            "calibrated_read_gbps": 106.2,
        },
        "gpu": {
            "model": "NVIDIA GeForce RTX 5090",
            "memory_bytes": 32 * GiB,
            "memory_gbps": 1792.0,
            "peak_gflops_fp32": 104800.0,
            "peak_gflops_fp16": 209500.0,
        },
        "link": {"name": "PCIe 5.0 x16", "gbps": 63.0},
    },
}
GPU_EP_OVERHEAD_BYTES = 400 * 1024**2  # CUDA context + cuBLAS/cuDNN workspaces, typical
CPU_CONTENTION = 1.1  # CPU GEMM slowdown while a PCIe DMA runs (DMA shares the memory bus)
COPY_CONTENTION = 1.05


def _roofline_seconds(flops: float, bytes_moved: float, peak_gflops: float, gbps: float) -> float:
    return max(
        flops / (peak_gflops * COMPUTE_EFFICIENCY * GB), bytes_moved / (gbps * BANDWIDTH_EFFICIENCY * GB)
    )


def _matmul_rows(peak_gflops: float, gbps: float, element_bytes: int) -> list[dict]:
    rows = []
    for k, n in FULL.shapes:
        for m in FULL.tiers:
            flops = 2.0 * m * k * n
            seconds = _roofline_seconds(flops, element_bytes * (k * n + m * (k + n)), peak_gflops, gbps)
            rows.append({"M": m, "K": k, "N": n, "seconds": seconds, "gflops": flops / seconds / GB})
    return rows


def _attention_rows(peak_gflops: float, gbps: float) -> list[dict]:
    rows = []
    for tokens in FULL.attention_tokens:
        for context in FULL.attention_contexts:
            flops = 4.0 * FULL.heads * FULL.head_dim * tokens * context
            # the KV read and written
            bytes_moved = 4 * FULL.kv_heads * FULL.head_dim * (2 * context + 2 * tokens)
            seconds = _roofline_seconds(flops, bytes_moved, peak_gflops, gbps)
            rows.append(
                {
                    "T": tokens,
                    "C": context,
                    "heads": FULL.heads,
                    "kv_heads": FULL.kv_heads,
                    "head_dim": FULL.head_dim,
                    "seconds": seconds,
                    "gflops": flops / seconds / GB,
                }
            )
    return rows


def reference_profile(name: str) -> dict:
    """The schema-1 profile of a SPECS entry."""
    spec = SPECS[name]
    cpu, gpu, link = spec["cpu"], spec["gpu"], spec["link"]
    threads = {}
    for count in sorted({1, 2, 4, cpu["cores"] // 2, cpu["cores"]}):
        peak = cpu["peak_gflops_fp32"] * count / cpu["cores"]
        bus_gbps = (
            cpu.get("calibrated_read_gbps", cpu["memory_gbps"] * BANDWIDTH_EFFICIENCY) / BANDWIDTH_EFFICIENCY
        )
        gbps = min(bus_gbps, PER_CORE_READ_GBPS * count / BANDWIDTH_EFFICIENCY)
        matmul = {
            "fp32": _matmul_rows(peak, gbps, 4),
            "fp16": _matmul_rows(peak * cpu["fp16_speed"], gbps, 2),
        }
        loaded = {
            dtype: [
                {**row, "seconds": row["seconds"] * CPU_CONTENTION, "gflops": row["gflops"] / CPU_CONTENTION}
                for row in rows
            ]
            for dtype, rows in matmul.items()
        }
        threads[str(count)] = {
            "matmul": matmul,
            "memory_read_gbps": gbps * BANDWIDTH_EFFICIENCY,
            "memory_copy_gbps": gbps * BANDWIDTH_EFFICIENCY / 2,
            "attention": _attention_rows(peak, gbps),
            "hop_us": 5.0,
            "op_us": 2.0,
            "under_copy_load": {
                "matmul": loaded,
                "memory_read_gbps": gbps * BANDWIDTH_EFFICIENCY / CPU_CONTENTION,
            },
        }
    sizes = FULL.copy_sizes
    h2d = [{"bytes": s, "gbps": link["gbps"] * PCIE_EFFICIENCY["pinned"], "pinned": True} for s in sizes] + [
        {"bytes": s, "gbps": link["gbps"] * PCIE_EFFICIENCY["pageable"], "pinned": False} for s in sizes
    ]
    return {
        "schema_version": PROFILE_SCHEMA_VERSION,
        "source": "spec",
        "created": "2026-11-29T00:00:00+00:00",
        "name": name,
        "description": spec["description"],
        "spec": {
            **spec,
            "efficiency": {
                "compute": COMPUTE_EFFICIENCY,
                "bandwidth": BANDWIDTH_EFFICIENCY,
                "pcie": PCIE_EFFICIENCY,
                "per_core_read_gbps": PER_CORE_READ_GBPS,
            },
            "contention": {"cpu": CPU_CONTENTION, "copy": COPY_CONTENTION},
            "gpu_ep_overhead_bytes": GPU_EP_OVERHEAD_BYTES,
        },
        "fingerprint": {
            "cpu_model": cpu["model"],
            "physical_cores": cpu["cores"],
            "gpu": gpu["model"],
            "gpu_driver": "spec",
        },
        "fingerprint_id": f"spec-{name}",
        "cpu": {"physical_cores": cpu["cores"], "threads": threads},
        "device": {
            "kind": "cuda",
            "name": gpu["model"],
            "memory_bytes": gpu["memory_bytes"],
            "ep_overhead_bytes": GPU_EP_OVERHEAD_BYTES,
            "memory_read_gbps": gpu["memory_gbps"] * BANDWIDTH_EFFICIENCY,
            "matmul": {
                "fp32": _matmul_rows(gpu["peak_gflops_fp32"], gpu["memory_gbps"], 4),
                "fp16": _matmul_rows(gpu["peak_gflops_fp16"], gpu["memory_gbps"], 2),
            },
            "attention": _attention_rows(gpu["peak_gflops_fp16"], gpu["memory_gbps"]),
            "launch_us": 10.0,
        },
        "link": {
            "kind": "pcie",
            "name": link["name"],
            "h2d": h2d,
            "d2h": h2d,
            "under_cpu_load": {"h2d": [{**row, "gbps": row["gbps"] / COPY_CONTENTION} for row in h2d]},
        },
        "contention": {
            "cpu_matmul_slowdown_under_copy": {
                t: {str(m): CPU_CONTENTION for m in FULL.tiers} | {"memory_read": CPU_CONTENTION}
                for t in threads
            },
            "copy_slowdown_under_cpu_matmul": COPY_CONTENTION,
        },
    }


def write_reference_profiles(folder: Path) -> list[Path]:
    written = []
    for name in SPECS:
        path = Path(folder) / f"{name}.json"
        path.write_text(json.dumps(reference_profile(name), indent=1) + "\n")
        written.append(path)
    return written


if __name__ == "__main__":
    for path in write_reference_profiles(Path(__file__).parent):
        print(path)
