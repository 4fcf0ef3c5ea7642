"""Timing a pack's own sub-layers on the CPU EP: the estimator's exact rates for that model.

The paper's estimator uses the profiled time when the exact key was measured and a roofline
otherwise; here the key is (sub-layer kind, new tokens T, context C) of one pack. Each point runs the
pack's chain for one step of T tokens after a prefill of C - T tokens and takes, per kind, the median
over that kind's sub-layers, then the median over repeats.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

TIMED_KINDS = ("attn", "ffn", "final")


def timed_step(step, past: int, tokens: int, rng) -> tuple[float, dict[str, float]]:
    """Prefill `past` tokens (untimed), then time one step of `tokens` tokens, per stage (seconds)."""
    ids = rng.integers(0, min(step.vocab_size, 20000), size=(1, past + tokens)).astype(np.int64)
    step.start(1)
    if past:
        step.forward(ids[:, :past], np.ones((1, past), np.int64), np.arange(past)[None])
    stage_seconds: dict[str, float] = {}
    step.stage_timer = stage_seconds.__setitem__
    try:
        begin = time.perf_counter()
        step.forward(ids[:, past:], np.ones((1, past + tokens), np.int64), np.arange(past, past + tokens)[None])
        total = time.perf_counter() - begin
    finally:
        step.stage_timer = None
    return total, stage_seconds


def time_pack(pack_dir, threads: int, tiers, pasts, repeat: int = 3, progress=lambda: None) -> list[dict]:
    """Rows {kind, T, C, seconds} for the pack's attention, FFN and output sub-layers."""
    from pipeshard.runtime.step import Step

    step = Step(pack_dir, threads=threads)
    step.all_logits = True  # time the output layer over all T, as the cost model counts it
    kinds = {s["name"]: s["kind"] for s in step.pack.sub_layers}
    rng = np.random.default_rng(0)
    rows = []
    for past in pasts:
        for tokens in tiers:
            timed_step(step, past, tokens, rng)  # warm-up for this shape
            per_kind: dict[str, list[float]] = {kind: [] for kind in TIMED_KINDS}
            for _ in range(repeat):
                _, stages = timed_step(step, past, tokens, rng)
                for kind in TIMED_KINDS:
                    values = [seconds for name, seconds in stages.items() if kinds[name] == kind]
                    if values:
                        per_kind[kind].append(statistics.median(values))
            for kind, values in per_kind.items():
                if values:
                    rows.append({"kind": kind, "T": tokens, "C": past + tokens, "seconds": statistics.median(values)})
            progress()
    return rows
