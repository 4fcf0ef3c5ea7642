"""The planner at the paper's largest scale: plan wall time, one-tier replan time and peak memory.

    python examples/planner_scale.py build/paper/qwen3-235b-a22b --assume-bits 2.9

Plans the pack's default tiers (1, 4, 16, 64, 256, 1024) on the reference profile desktop-rtx5090 at one budget,
then replans tier 1 for budget changes (a game taking VRAM back), each in this process; prints one JSON object
with the wall times (median and range of the replans) and the process's peak resident memory (ru_maxrss).
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
    parser.add_argument("--assume-bits", type=float, default=None)
    parser.add_argument("--replans", type=int, default=5)
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
    planned = planner.plan(int(args.vram * GiB), DEFAULT_TIERS)
    replans = []
    for index in range(args.replans):
        budget = int((args.vram - 1 - index % 3) * GiB)
        started = time.perf_counter()
        planner.plan_tier(1, budget)
        replans.append(time.perf_counter() - started)
    print(
        json.dumps(
            {
                "pack": args.pack,
                "units": len(planner.units),
                "budget_gib": args.vram,
                "context": args.context,
                "manifest_load_s": round(loaded_s, 3),
                "planner_setup_s": round(setup_s, 3),
                "plan_all_tiers_s": round(planned["planning_s"], 3),
                "tiers": list(DEFAULT_TIERS),
                "chosen": {str(e["tier"]): e["chosen"].strategy for e in planned["tiers"]},
                "replan_tier1_s": {
                    "median": round(statistics.median(replans), 4),
                    "min": round(min(replans), 4),
                    "max": round(max(replans), 4),
                    "runs": len(replans),
                },
                "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
