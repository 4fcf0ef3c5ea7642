"""The CPU read rate of the paper's desktop, implied by its own llama.cpp `-ngl` baseline runs.

    python examples/calibrate_rtx5090.py      # prints one JSON object; exports the Minitron shape-only packs if missing

The paper artifact's baseline log (examples/paper_data/baseline_5090.csv, its
paper_results/benchmark_summary_5090_base.csv: hand-tuned `-ngl` runs, never pipelined sharding) gives decode
tokens/s with the first NGL layers on the GPU and the rest, with the output layer, on the CPU. For the fp16
Minitrons at 1K context, where at least half the weights stay on the CPU, a decode step reads the CPU layers'
weights once: the implied CPU read rate is those bytes over the step time less the GPU layers' share (their bytes at
the profile's GPU read rate). The median over those runs is what profiles/reference.py takes for `desktop-rtx5090`
(`calibrated_read_gbps`); docs/paper-comparison.md records it.
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from paper_compare import DATA, MODELS, PROFILE, ensure_pack  # noqa: E402

CONTEXT = 1024
MINITRONS = {"minitron-4b", "minitron-8b"}


def main() -> int:
    from pipeshard.formats.manifest import load_pack
    from pipeshard.partitioner.planner import Planner
    from pipeshard.profiles.db import load_profile

    profile = load_profile(PROFILE)
    gpu_read_gbps = profile.device.memory_read_gbps
    packs = Path(__file__).resolve().parents[1] / "build" / "paper"
    with open(DATA / "baseline_5090.csv", newline="", encoding="utf-8-sig") as handle:
        runs = [
            r
            for r in csv.DictReader(handle)
            if r["Model"] in MINITRONS and int(r["Context"]) == CONTEXT and r["Status"] == "SUCCESS"
        ]
    implied = []
    for model in (m for m in MODELS if m.config in MINITRONS):
        planner = Planner(load_pack(ensure_pack(model, packs)).manifest, profile, context=CONTEXT)
        layers = planner.model.num_layers
        for run in (r for r in runs if r["Model"] == model.config):
            on_gpu = int(run["NGL"])
            gpu_bytes = cpu_bytes = 0
            for entry in planner.placeable:
                weight = planner.weight_bytes[entry.name]
                if (entry.layer is not None and entry.layer < on_gpu) or (
                    entry.layer is None and on_gpu > layers
                ):
                    gpu_bytes += weight
                else:
                    cpu_bytes += weight
            if cpu_bytes < (cpu_bytes + gpu_bytes) / 2:
                continue
            step_s = 1.0 / float(run["EvalTPS"]) - gpu_bytes / (gpu_read_gbps * 1e9)
            implied.append(
                {
                    "model": model.config,
                    "ngl": on_gpu,
                    "tok_s": float(run["EvalTPS"]),
                    "gbps": cpu_bytes / step_s / 1e9,
                }
            )
    print(
        json.dumps(
            {
                "runs": len(implied),
                "median_gbps": round(statistics.median(r["gbps"] for r in implied), 1),
                "range_gbps": [
                    round(min(r["gbps"] for r in implied), 1),
                    round(max(r["gbps"] for r in implied), 1),
                ],
                "per_run": [{**r, "gbps": round(r["gbps"], 1)} for r in implied],
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
