"""Estimator accuracy on this machine: the planner's predicted step time against the measured one.

    pipeshard profile --pack PACK --out build/profile.json
    python examples/estimator_accuracy.py PACK --profile build/profile.json [--device sim] [--vram 25%,50%]
                                          [--tiers 1,64] [--plans auto,gpu-only] [--context 256] [--repeat 5]
                                          [--rounds 3] [--threads 2]

Rows: the all-CPU chain, and at each budget on the device the planner's own plan (or those --plans names). For
tier T a step of T new tokens runs after a prefill to a context of --context tokens (the context the planner
assumes): one-token steps are timed as a run of decode steps, larger tiers as one step each after a fresh
prefill; medians over --repeat, then the median (and the spread) over --rounds, the rows interleaved (this machine
is noisy).
`--sub-layers` also prints, for the chain, each kind's predicted and measured time (each sub-layer timed apart).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import pipeshard
from pipeshard.partitioner.estimator import Estimator
from pipeshard.partitioner.planner import Planner
from pipeshard.profiles.db import load_profile
from pipeshard.profiles.pack_timing import prefill, time_stages


def step_seconds(step, tier: int, context: int, repeat: int, rng) -> float:
    """Median seconds of a step of `tier` tokens ending at `context` (decode steps for tier 1)."""
    decode_steps = 16 if tier == 1 else 1
    past = context - tier * decode_steps
    samples = []
    for _ in range(repeat if tier > 1 else max(1, repeat // 2)):
        ids = rng.integers(0, min(step.vocab_size, 20000), size=(1, context)).astype(np.int64)
        step.start(1, context)
        step.forward(ids[:, :past], np.ones((1, past), np.int64), np.arange(past)[None])
        for index in range(decode_steps):
            begin = past + index * tier
            end = begin + tier
            started = time.perf_counter()
            step.forward(ids[:, begin:end], np.ones((1, end), np.int64), np.arange(begin, end)[None])
            samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def sub_layer_lines(step, estimator: Estimator, tier: int, context: int, repeat: int, rng) -> list[str]:
    """The chain's sub-layers each timed apart, by kind, beside the estimator."""
    entries = {e.name: e for e in step.pack.sub_layers}
    prefill(step, context - tier, rng)
    time_stages(step, context - tier, tier, rng)  # warm-up for this shape
    runs = [time_stages(step, context - tier, tier, rng)[1] for _ in range(repeat)]
    lines = []
    for kind in ("attn", "ffn", "final"):
        names = [n for n in entries if entries[n].kind == kind]
        measured = sum(statistics.median(r[n] for r in runs) for n in names)
        predicted = sum(
            estimator.compute_seconds(entries[n], 1 if kind == "final" else tier, context, False)
            for n in names
        )
        lines.append(
            f"      {kind:6s} predicted {predicted * 1e3:8.2f} ms, measured {measured * 1e3:8.2f} ms "
            f"over {len(names)} sub-layers"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pack")
    parser.add_argument("--profile", required=True)
    parser.add_argument("--device", default="sim", choices=("sim", "cuda"))
    parser.add_argument("--vram", default="25%,50%", help="budgets of the planned rows")
    parser.add_argument("--tiers", default="1,64")
    parser.add_argument(
        "--plans", default="auto", help="plans run at each budget (auto: the planner's choice)"
    )
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="every row this many times, interleaved")
    parser.add_argument("--sub-layers", action="store_true", help="the chain's kinds timed apart, too")
    args = parser.parse_args()
    tiers = [int(t) for t in args.tiers.split(",")]
    profile = load_profile(args.profile)
    rng = np.random.default_rng(0)
    print(
        f"{args.pack}, profile {args.profile}, {args.threads} threads, context {args.context}, "
        f"device {args.device}"
    )
    print(
        f"{'row':<12} {'tier':>5} {'plan':<22} {'pred ms':>9} {'meas ms':>9} {'spread':>13} {'pred/meas':>9}"
    )
    rows: dict[tuple[str, int], dict] = {}
    for _ in range(args.rounds):
        # One engine at a time: an idle engine's ONNX Runtime threads would take cores from the measured one.
        planned = [(budget, name) for budget in args.vram.split(",") for name in args.plans.split(",")]
        for budget, plan_name in [(None, "cpu"), *planned]:
            engine = pipeshard.load(
                args.pack,
                threads=args.threads,
                vram=budget,
                context=args.context,
                plan=plan_name,
                device=args.device if budget else "cpu",
                profile=args.profile if budget else None,
            )
            step = engine.step
            manifest = step.pack.manifest
            for tier in tiers:
                row = rows.setdefault(
                    ("cpu" if budget is None else f"{plan_name} {budget}", tier), {"measured": []}
                )
                if budget is None:
                    row["predicted"] = (
                        Planner(manifest, profile, context=args.context, threads=args.threads)
                        .baseline("cpu", tier, 1 << 40)
                        .step_s
                    )
                    row["plan"] = "chain"
                else:
                    plan = step.book.plan_for(step.book.tier_for(tier))
                    row["predicted"] = plan.step_s
                    row["plan"] = f"{plan.strategy} {'/'.join(str(v) for v in plan.counts().values())}"
                    row["plan"] += f" kv{len(plan.kv_streamed)}" if plan.kv_streamed else ""
                step_seconds(
                    step, tier, args.context, 1, rng
                )  # warm-up: sessions and programs for this shape
                row["measured"].append(step_seconds(step, tier, args.context, args.repeat, rng))
                if args.sub_layers and budget is None:
                    estimator = Estimator(
                        profile, manifest.model, args.threads, manifest.source["model_sha256"]
                    )
                    print("\n".join(sub_layer_lines(step, estimator, tier, args.context, args.repeat, rng)))
            step.close()
            del engine, step
    for (name, tier), row in rows.items():
        measured = statistics.median(row["measured"])
        spread = f"{min(row['measured']) * 1e3:.1f}-{max(row['measured']) * 1e3:.1f}"
        print(
            f"{name:<12} {tier:>5} {row['plan']:<22} {row['predicted'] * 1e3:>9.2f} {measured * 1e3:>9.2f} "
            f"{spread:>13} {row['predicted'] / measured:>9.2f}"
        )
    print(
        "pred/meas: the planner's step time over the measured median (1.00 = exact); plan: pinned/streamed/cpu"
    )


if __name__ == "__main__":
    main()
