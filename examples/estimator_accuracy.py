"""Estimator accuracy on this machine: predicted vs measured CPU time of every sub-layer and step.

    pipeshard profile --quick --pack PACK --out build/profile.json
    python examples/estimator_accuracy.py PACK --profile build/profile.json [--threads 2] [--past 256]

For each tier T, the pack's own CPU sessions run a step of T new tokens after a prefill of `past`
tokens (context C = past + T); each sub-layer's run is timed (median of --repeat steps) and set
beside the estimator's prediction. Prints the mean absolute percentage error (MAPE) per tier, for
sub-layers and for whole all-CPU steps.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from pipeshard.partitioner.estimator import Estimator
from pipeshard.profiles.db import load_profile
from pipeshard.profiles.pack_timing import timed_step
from pipeshard.runtime.step import Step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pack")
    parser.add_argument("--profile", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--past", type=int, default=256)
    parser.add_argument("--tiers", default="1,4,16,64,256")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--verbose", action="store_true", help="absolute times per kind")
    args = parser.parse_args()
    step = Step(args.pack, threads=args.threads)
    estimator = Estimator(load_profile(args.profile), step.pack.model, args.threads,
                          step.pack.manifest["source"]["model_sha256"])
    entries = {e["name"]: e for e in step.pack.sub_layers}
    rng = np.random.default_rng(0)
    print(f"{args.pack}, profile {args.profile}, {estimator.threads} threads, past {args.past} tokens")
    print(f"{'tier':>5} {'sub-layer MAPE':>15} {'by kind (MAPE)':<44} {'step pred ms':>12} {'step meas ms':>12} "
          f"{'step APE':>9}")
    for tier in (int(t) for t in args.tiers.split(",")):
        timed_step(step, args.past, tier, rng)  # warm-up for this shape
        runs = [timed_step(step, args.past, tier, rng) for _ in range(args.repeat)]
        measured = {name: statistics.median(r[1][name] for r in runs) for name in entries}
        measured_total = statistics.median(r[0] for r in runs)
        context = args.past + tier
        # A generation step computes the output layer for the last position only (batch 1 here).
        predicted = {name: estimator.compute_seconds(entry, 1 if entry["kind"] == "final" else tier, context,
                                                     on_device=False)
                     for name, entry in entries.items()}
        errors = {name: abs(predicted[name] - measured[name]) / measured[name] for name in entries}
        if args.verbose:
            for kind in ("attn", "ffn", "final"):
                names = [n for n in entries if entries[n]["kind"] == kind]
                print(f"      {kind:6s} predicted {sum(predicted[n] for n in names) * 1e3:8.2f} ms, "
                      f"measured {sum(measured[n] for n in names) * 1e3:8.2f} ms over {len(names)} sub-layers")
        by_kind = {}
        for name, error in errors.items():
            by_kind.setdefault(entries[name]["kind"], []).append(error)
        kinds = " ".join(f"{kind} {100 * statistics.mean(values):.0f}%" for kind, values in by_kind.items())
        compute_kinds = [n for n in entries if entries[n]["kind"] in ("attn", "ffn", "final")]
        mape = 100 * statistics.mean(errors[n] for n in compute_kinds)
        step_predicted = sum(predicted.values())
        print(f"{tier:>5} {mape:>14.1f}% {kinds:<44} {step_predicted * 1e3:>12.2f} {measured_total * 1e3:>12.2f} "
              f"{100 * abs(step_predicted - measured_total) / measured_total:>8.1f}%")
    print("sub-layer MAPE over attn/ffn/final; step = one all-CPU forward (predicted: sum of sub-layers)")


if __name__ == "__main__":
    main()
