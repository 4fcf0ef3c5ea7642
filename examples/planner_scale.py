"""The planner at the paper's largest scale: plan wall time, one-tier replan time and peak memory.

    python examples/planner_scale.py build/paper/qwen3-235b-a22b-q2_k

Plans the pack's default tiers (1, 4, 16, 64, 256, 1024) on the reference profile desktop-rtx5090 at one budget
(every strategy, the baselines and the timelines, as `pipeshard plan` does), then answers budget changes (a game
taking VRAM back) as the runtime does: the tier-1 plan for the new budget (`Planner.plan_for("auto", ...)`), each
in this process; prints one JSON object with the wall and CPU times (median and range of the replans; the CPU
time is what a shared machine's load does not inflate) and the process's peak resident memory (ru_maxrss).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

GiB = 1024**3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pack")
    parser.add_argument("--vram", type=float, default=8.0, help="budget in GiB (default 8)")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument(
        "--assume-bits",
        type=float,
        default=None,
        help="a what-if: every weight at this many bits (planning only)",
    )
    parser.add_argument("--replans", type=int, default=20)
    args = parser.parse_args()

    from pipeshard.formats.manifest import load_pack
    from pipeshard.formats.plans import DEFAULT_TIERS
    from pipeshard.partitioner.planner import Planner
    from pipeshard.profiles.db import load_profile

    started = time.perf_counter()
    pack = load_pack(args.pack)
    loaded_s = time.perf_counter() - started
    started = time.perf_counter()
    planner = Planner(
        pack.manifest,
        load_profile("desktop-rtx5090"),
        context=args.context,
        threads=16,
        assume_bits=args.assume_bits,
    )
    setup_s = time.perf_counter() - started
    cpu_started = time.process_time()
    planned = planner.plan(int(args.vram * GiB), DEFAULT_TIERS)
    plan_cpu_s = time.process_time() - cpu_started
    replans, replan_cpu = [], []
    for index in range(args.replans):
        # budgets spread over half to all of --vram, in an order that jumps both ways
        budget = int(args.vram * (0.5 + 0.5 * (index * 7 % args.replans) / args.replans) * GiB)
        started, cpu_started = time.perf_counter(), time.process_time()
        planner.plan_for("auto", 1, budget)
        replans.append(time.perf_counter() - started)
        replan_cpu.append(time.process_time() - cpu_started)
    print(
        json.dumps(
            {
                "pack": args.pack,
                "units": len(planner.units),
                "budget_gib": args.vram,
                "context": args.context,
                "manifest_load_s": round(loaded_s, 3),
                "planner_setup_s": round(setup_s, 3),
                "plan_all_tiers_s": round(planned.planning_s, 3),
                "plan_all_tiers_cpu_s": round(plan_cpu_s, 3),
                "tiers": list(DEFAULT_TIERS),
                "chosen": {str(e.tier): e.chosen.strategy for e in planned.tiers},
                "replan_tier1_s": {
                    "median": round(statistics.median(replans), 4),
                    "min": round(min(replans), 4),
                    "max": round(max(replans), 4),
                    "runs": len(replans),
                },
                "replan_tier1_cpu_s": {
                    "median": round(statistics.median(replan_cpu), 4),
                    "max": round(max(replan_cpu), 4),
                },
                "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
