"""The GPU check (shared/GPU-CHECK.md): one run that exercises the CUDA path end to end.

    python examples/gpu_check.py --pack PACK [--moe-pack PACK] [--device cuda|sim] [--fraction 0.25]
        [--out gpu_check.json]

1. Versions, the GPU, and the providers a test session really got (fails loudly if CUDA did not load).
2. A quick profile of this machine (with the CUDA part when the device is cuda), saved beside the JSON.
3. `pipeshard bench` at a budget of minimum + FRACTION of the model's bytes: the planner's plan and
   the `layers` and `offload` baselines on the device beside the all-CPU chain — TTFT, decode
   tok/s, peak device memory (ledger, and cudaMemGetInfo on CUDA), bytes streamed, copy time
   hidden, predicted vs measured step time — and their greedy tokens against the chain's.
   With `--moe-pack` (e.g. a partitioned `tiny:moe`), the same for a MoE pack: routed experts pinned,
   streamed after their router, or on the CPU.
4. Everything in one JSON file and a short table. `--device sim` is the dry run the test suite uses.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

PROMPT = "Explain in two sentences why the sky is blue."
PLANS = ("auto", "layers", "offload")


def environment(device: str) -> dict:
    import numpy as np
    import onnxruntime

    from pipeshard.profiles.kernels import hop_model
    from pipeshard.runtime.ort import CUDA_PROVIDERS

    found = {
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
        "available_providers": onnxruntime.get_available_providers(),
        "device": device,
    }
    if device == "cuda":
        if hasattr(onnxruntime, "preload_dlls"):
            onnxruntime.preload_dlls()
        session = onnxruntime.InferenceSession(hop_model(8).SerializeToString(), providers=CUDA_PROVIDERS)
        found["session_providers"] = session.get_providers()
        if found["session_providers"][0] != "CUDAExecutionProvider":
            raise SystemExit(f"CUDA EP did not load: the session got {found['session_providers']}")
        session.run(None, {"X": np.ones((1, 1, 8), np.float32)})
        from pipeshard.profiles.measure_cuda import CudaRuntime

        found["gpu"] = CudaRuntime().properties()
    return found


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pack", required=True)
    parser.add_argument("--moe-pack", default=None, help="also check this MoE pack")
    parser.add_argument("--device", default="cuda", choices=("cuda", "sim"))
    parser.add_argument("--fraction", type=float, default=0.25)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--profile", default=None, help="use this DB instead of profiling (the dry run does)")
    parser.add_argument("--out", default="gpu_check.json")
    args = parser.parse_args(argv)

    from pipeshard.bench import BenchSettings, bench_table, run_bench
    from pipeshard.profiles.db import save_profile
    from pipeshard.profiles.measure import QUICK, measure_machine

    report = {"environment": environment(args.device)}
    out = Path(args.out)
    profile = args.profile
    if profile is None:
        started = time.perf_counter()
        document = measure_machine(QUICK, use_cuda=args.device == "cuda")
        profile = str(out.with_suffix(".profile.json"))
        save_profile(document, Path(profile))
        report["profile"] = {
            "path": profile,
            "seconds": time.perf_counter() - started,
            "device": document["device"],
            "link_h2d": document["link"]["h2d"],
        }
    report["ok"] = True
    for key, pack in (("bench", args.pack), ("moe_bench", args.moe_pack)):
        if pack is None:
            continue
        settings = BenchSettings(
            pack=pack,
            device=args.device,
            vram=f"{args.fraction * 100:g}%",
            profile=profile,
            plans=["cpu", *PLANS],
            reference="cpu",
            new_tokens=args.new_tokens,
            prompt=PROMPT,
            repeat=args.repeat,
            threads=2,
        )
        bench = run_bench(settings, log=lambda line: print(line, file=sys.stderr))
        report[key] = bench
        planned = [r for r in bench["rows"] if r["name"] in PLANS]
        report["ok"] &= len(planned) == len(PLANS) and all(
            r["same_tokens_as_reference"] and r["peak_device_bytes"] <= r["facts"]["budget_bytes"]
            for r in planned
        )
        print(bench_table(bench))
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {out}; ok: {report['ok']}")
    return report


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
