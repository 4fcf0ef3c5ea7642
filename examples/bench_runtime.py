"""Runtime figures in one run: the chain vs monolithic (bench_chain.py: `pipeshard bench`), then
on the simulated device at 25 % of the model's bytes, how much of the gpu-only plan's copy time at
tier 64 is hidden behind compute.

    python examples/bench_runtime.py PACK --profile build/profile-smollm2.json [--threads 2]
        [--steps 6] [--context 512]

`sim` copies are real memcpys on the prefetch thread; the figures say nothing about GPU speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import pipeshard
from pipeshard.partitioner.planner import Planner
from pipeshard.profiles.db import load_profile

TIER = 64


def copy_overlap_at_tier(pack: str, profile: str, threads: int, steps: int, context: int, fraction: float) -> dict:
    manifest = json.loads((Path(pack) / "manifest.json").read_text())
    planner = Planner(manifest, load_profile(profile), 1 << 40)
    budget = planner.minimum_budget() + int(planner.model_bytes * fraction)
    engine = pipeshard.load(pack, vram=budget, device="sim", profile=profile, plan="gpu-only", threads=threads,
                            context=context)
    step, device = engine.step, engine.step.device
    step.tiers = [TIER]
    ids = np.random.default_rng(0).integers(100, 20000, size=(1, TIER * (steps + 1))).astype(np.int64)
    step.start(1)
    rows = []
    for index in range(steps + 1):
        begin, end = index * TIER, (index + 1) * TIER
        copy_before, wait_before = device.copy_seconds, step.stats.copy_wait_s
        started = time.perf_counter()
        step.forward(ids[:, begin:end], np.ones((1, end), np.int64), np.arange(begin, end)[None])
        elapsed = time.perf_counter() - started
        if index == 0:
            continue  # first step: sessions are created and the plan activated
        copy = device.copy_seconds - copy_before
        wait = step.stats.copy_wait_s - wait_before
        rows.append({"step_s": elapsed, "copy_s": copy, "wait_s": wait, "compute_s": elapsed - wait})
    plan = step.plans[TIER]
    return {"budget_mib": budget / 2**20, "plan": plan.strategy, "counts": plan.counts(),
            "streamed_mib_per_step": plan.streamed_bytes / 2**20, "rows": rows,
            "peak_mib": device.ledger.peak / 2**20, "predicted_step_s": plan.step_s,
            "predicted_hidden": plan.copy_hidden_fraction}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pack")
    parser.add_argument("--profile", required=True, help="this machine's profile (its device is sim)")
    parser.add_argument("--context", type=int, default=512, help="KV context the plan reserves")
    parser.add_argument("--fraction", type=float, default=0.25, help="budget = minimum + this share of the model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print("== cpu chain vs monolithic ==", flush=True)
    subprocess.run([sys.executable, str(Path(__file__).with_name("bench_chain.py")), args.pack,
                    "--threads", str(args.threads), "--repeat", str(args.repeat)], check=True)
    print(f"== sim device, gpu-only plan at tier {TIER}, budget = minimum + {args.fraction:.0%} of the model ==")
    result = copy_overlap_at_tier(args.pack, args.profile, args.threads, args.steps, args.context, args.fraction)
    if not result["rows"] or not sum(r["copy_s"] for r in result["rows"]):
        print(f"  the planner's plan at tier {TIER} streams nothing within this budget: {result['plan']} "
              f"{result['counts']}")
        return
    copy = sum(r["copy_s"] for r in result["rows"])
    wait = sum(r["wait_s"] for r in result["rows"])
    compute = statistics.median(r["compute_s"] for r in result["rows"])
    copy_median = statistics.median(r["copy_s"] for r in result["rows"])
    print(f"  budget {result['budget_mib']:.0f} MiB, plan {result['plan']} {result['counts']}, "
          f"{result['streamed_mib_per_step']:.0f} MiB streamed per step, peak {result['peak_mib']:.0f} MiB (sim)")
    print(f"  per step (median): {statistics.median(r['step_s'] for r in result['rows']) * 1e3:.0f} ms, "
          f"compute {compute * 1e3:.0f} ms, copy {copy_median * 1e3:.0f} ms, "
          f"waiting for copies {statistics.median(r['wait_s'] for r in result['rows']) * 1e3:.1f} ms")
    print(f"  copy time hidden behind compute: {100 * (1 - wait / copy):.1f} % (sim; planner predicted "
          f"{100 * result['predicted_hidden']:.0f} % on the {args.profile} profile)")


if __name__ == "__main__":
    main()
