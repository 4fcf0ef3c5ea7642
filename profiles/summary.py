"""The human summary of a profile DB (measured or spec)."""

from __future__ import annotations

from pipeshard.formats.profile_db import MatmulRow, ProfileDb


def _peak(rows: tuple[MatmulRow, ...]) -> float:
    return max((row.gflops for row in rows), default=0.0)


def summarize(profile: ProfileDb, where: str = "") -> str:
    """Peak GFLOP/s per device, thread count and dtype; bandwidths; link; contention factors."""
    fingerprint = profile.fingerprint
    lines = [
        f"profile {where or profile.name or ''}: source {profile.source}, created {profile.created}",
        f"  machine: {fingerprint.cpu_model}, {profile.cpu.physical_cores} cores, GPU {fingerprint.gpu}"
        + (f", onnxruntime {fingerprint.onnxruntime}" if fingerprint.onnxruntime else ""),
    ]
    if profile.description:
        lines.append(f"  {profile.description}")
    lines.append("  CPU EP (peak MatMul GFLOP/s by dtype; M=1 GFLOP/s; read / copy GB/s; one hop us):")
    for threads in profile.thread_counts:
        rates = profile.cpu.threads[threads]
        peaks = ", ".join(f"{dtype} {_peak(rows):.1f}" for dtype, rows in rates.matmul.items())
        decode = max((r.gflops for r in rates.matmul.get("fp32", ()) if r.M == 1), default=0.0)
        lines.append(
            f"    {threads:>2} threads: {peaks}; M=1 {decode:.1f}; read {rates.memory_read_gbps:.1f} GB/s, "
            f"copy {rates.memory_copy_gbps or 0:.1f} GB/s; hop {rates.hop_us:.1f} us"
        )
    device = profile.device
    lines.append(f"  device: {device.kind} — {device.name}")
    if device.matmul and device.kind != "sim":
        peaks = ", ".join(f"{dtype} {_peak(rows):.0f}" for dtype, rows in device.matmul.items())
        lines.append(
            f"    peak MatMul GFLOP/s: {peaks}; memory {(device.memory_bytes or 0) / 1024**3:.1f} GiB, EP overhead "
            f"{device.ep_overhead_bytes / 1024**2:.0f} MiB, launch {device.launch_us or 0:.1f} us"
        )
    elif device.kind == "sim":
        lines.append("    compute runs on the CPU EP (the rates above); this is a test double, not a GPU")
        if device.matmul:
            peaks = ", ".join(f"{dtype} {_peak(rows):.0f}" for dtype, rows in device.matmul.items())
            lines.append(f"    its sessions' own products (weights bound as inputs), peak GFLOP/s: {peaks}")
    link = profile.link
    lines.append(
        f"  link: {link.kind} {link.name or ''} — best H2D {max(row.gbps for row in link.h2d):.1f} GB/s, "
        f"D2H {max(row.gbps for row in link.d2h):.1f} GB/s"
    )
    contention = profile.contention
    for threads, factors in sorted(contention.cpu_matmul_slowdown_under_copy.items()):
        shown = ", ".join(
            [f"M={tier} x{value:.2f}" for tier, value in factors.by_tier.items()]
            + [f"read x{factors.memory_read:.2f}"]
        )
        lines.append(f"  contention, CPU MatMul under copy, {threads} threads: {shown}")
    lines.append(f"  contention, copy under CPU MatMul: x{contention.copy_slowdown_under_cpu_matmul:.2f}")
    return "\n".join(lines)
