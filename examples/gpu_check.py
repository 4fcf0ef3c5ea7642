"""The GPU check (shared/GPU-CHECK.md): one run that exercises the CUDA path end to end.

    python examples/gpu_check.py --pack PACK [--device cuda|sim] [--fraction 0.25] [--out gpu_check.json]

1. Versions, the GPU, and the providers a test session really got (fails loudly if CUDA did not load).
2. A quick profile of this machine (with the CUDA part when the device is cuda), saved beside the JSON.
3. At a budget of minimum + FRACTION of the model's bytes: the planner's plan and the `layers` and
   `offload` baselines on the device — TTFT, decode tok/s, peak device memory (ledger, and
   cudaMemGetInfo on CUDA), bytes streamed, copy time hidden, predicted vs measured step time —
   and their greedy tokens against the all-CPU chain's.
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
    from pipeshard.profiles.measure_cuda import CUDA_PROVIDERS

    found = {"python": platform.python_version(), "onnxruntime": onnxruntime.__version__,
             "available_providers": onnxruntime.get_available_providers(), "device": device}
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


def run_plan(pack: str, device: str, budget: int, profile: str, plan: str, new_tokens: int) -> tuple[dict, list[int]]:
    import pipeshard

    engine = pipeshard.load(pack, vram=budget, device=device, profile=profile, plan=plan, context=1024)
    engine.codec.eos_token_ids = []
    started = time.perf_counter()
    (result,) = engine.generate(PROMPT, max_new_tokens=new_tokens)
    wall = time.perf_counter() - started
    step = engine.step
    stats = step.stats
    row = {
        "plan": plan, "ttft_s": result.ttft_s, "decode_tok_s": result.decode_tok_s, "wall_s": wall,
        "peak_device_bytes": step.device.ledger.peak, "budget_bytes": budget,
        "streamed_bytes": stats.streamed_bytes, "copy_wait_s": stats.copy_wait_s,
        "copy_s": getattr(step.device, "copy_seconds", 0.0),
        "plans": {str(t): {"strategy": p.strategy, "counts": p.counts(), "predicted_step_s": p.step_s}
                  for t, p in sorted(step._plans.items())},
        "measured_decode_step_s": 1 / result.decode_tok_s if result.decode_tok_s else None,
    }
    if device == "cuda":
        from pipeshard.profiles.measure_cuda import CudaRuntime

        properties = CudaRuntime().properties()
        row["device_used_bytes_now"] = properties["memory_bytes"] - properties["free_bytes"]
    close = getattr(step, "close", None)
    if close:
        close()
    return row, result.tokens


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pack", required=True)
    parser.add_argument("--device", default="cuda", choices=("cuda", "sim"))
    parser.add_argument("--fraction", type=float, default=0.25)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--profile", default=None, help="use this DB instead of profiling (the dry run does)")
    parser.add_argument("--out", default="gpu_check.json")
    args = parser.parse_args(argv)

    import pipeshard
    from pipeshard.partitioner.budget import budget_for_fraction
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
        report["profile"] = {"path": profile, "seconds": time.perf_counter() - started,
                             "device": document["device"], "link_h2d": document["link"]["h2d"]}
    budget = budget_for_fraction(args.pack, profile, args.fraction)
    reference = pipeshard.load(args.pack)
    reference.codec.eos_token_ids = []
    cpu_tokens = reference.generate(PROMPT, max_new_tokens=args.new_tokens)[0].tokens
    report["rows"] = []
    for plan in PLANS:
        row, tokens = run_plan(args.pack, args.device, budget, profile, plan, args.new_tokens)
        row["tokens_equal_cpu"] = tokens == cpu_tokens
        report["rows"].append(row)
    report["ok"] = all(r["tokens_equal_cpu"] and r["peak_device_bytes"] <= budget for r in report["rows"])
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"device {args.device}, budget {budget / 2**20:.0f} MiB ({args.fraction:.0%} of the model + minimum)")
    print(f"{'plan':<8} {'TTFT ms':>8} {'tok/s':>7} {'peak MiB':>9} {'streamed MiB':>13} {'same tokens':>12}")
    for row in report["rows"]:
        print(f"{row['plan']:<8} {row['ttft_s'] * 1e3:>8.0f} {row['decode_tok_s']:>7.1f} "
              f"{row['peak_device_bytes'] / 2**20:>9.0f} {row['streamed_bytes'] / 2**20:>13.1f} "
              f"{str(row['tokens_equal_cpu']):>12}")
    print(f"wrote {out}; ok: {report['ok']}")
    return report


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
