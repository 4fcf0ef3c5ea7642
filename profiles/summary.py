"""The human summary of a profile DB (measured or spec)."""

from __future__ import annotations


def _peak(rows: list[dict]) -> float:
    return max((row["gflops"] for row in rows), default=0.0)


def summarize(document: dict, where: str = "") -> str:
    """Peak GFLOP/s per device, thread count and dtype; bandwidths; link; contention factors."""
    fingerprint = document["fingerprint"]
    lines = [
        f"profile {where or document.get('name', '')}: source {document['source']}, created {document['created']}",
        f"  machine: {fingerprint.get('cpu_model')}, {document['cpu'].get('physical_cores')} cores, "
        f"GPU {fingerprint.get('gpu')}"
        + (f", onnxruntime {fingerprint['onnxruntime']}" if "onnxruntime" in fingerprint else ""),
    ]
    if document.get("description"):
        lines.append(f"  {document['description']}")
    lines.append("  CPU EP (peak MatMul GFLOP/s by dtype; M=1 GFLOP/s; read / copy GB/s; one hop us):")
    for threads, rates in sorted(document["cpu"]["threads"].items(), key=lambda item: int(item[0])):
        peaks = ", ".join(f"{dtype} {_peak(rows):.1f}" for dtype, rows in rates["matmul"].items())
        decode = max((r["gflops"] for r in rates["matmul"].get("fp32", []) if r["M"] == 1), default=0.0)
        lines.append(
            f"    {threads:>2} threads: {peaks}; M=1 {decode:.1f}; read {rates['memory_read_gbps']:.1f} GB/s, "
            f"copy {rates.get('memory_copy_gbps', 0):.1f} GB/s; hop {rates['hop_us']:.1f} us"
        )
    device = document["device"]
    lines.append(f"  device: {device['kind']} — {device.get('name')}")
    if device.get("matmul"):
        peaks = ", ".join(f"{dtype} {_peak(rows):.0f}" for dtype, rows in device["matmul"].items())
        memory = device.get("memory_bytes") or 0
        lines.append(
            f"    peak MatMul GFLOP/s: {peaks}; memory {memory / 1024**3:.1f} GiB, EP overhead "
            f"{device.get('ep_overhead_bytes', 0) / 1024**2:.0f} MiB, "
            f"launch {device.get('launch_us', 0):.1f} us"
        )
    elif device["kind"] == "sim":
        lines.append("    compute runs on the CPU EP (the rates above); this is a test double, not a GPU")
    link = document["link"]
    best = {
        direction: max((row["gbps"] for row in link[direction]), default=0.0) for direction in ("h2d", "d2h")
    }
    lines.append(
        f"  link: {link['kind']} {link.get('name', '')} — best H2D {best['h2d']:.1f} GB/s, "
        f"D2H {best['d2h']:.1f} GB/s"
    )
    contention = document["contention"]
    for threads, factors in sorted(
        contention.get("cpu_matmul_slowdown_under_copy", {}).items(), key=lambda item: int(item[0])
    ):
        shown = ", ".join(
            f"M={tier} x{value:.2f}" if tier != "memory_read" else f"read x{value:.2f}"
            for tier, value in factors.items()
        )
        lines.append(f"  contention, CPU MatMul under copy, {threads} threads: {shown}")
    lines.append(
        f"  contention, copy under CPU MatMul: x{contention.get('copy_slowdown_under_cpu_matmul', 1):.2f}"
    )
    return "\n".join(lines)
