"""Timing a pack's own sub-layers where plans put them: the estimator's exact rates for that model.

The paper's estimator uses the profiled time when the exact key was measured and a roofline otherwise; here
the key is (placement, sub-layer kind, new tokens T, context C) of one pack. Placement `cpu` is the chain's CPU
sessions (weights prepacked); `device` is every unit pinned on the device the profile measures (on the
simulated device: weights-as-inputs sessions on the CPU EP, which cannot prepack). Each point runs one step of
T tokens after a prefill of C - T tokens with every sub-layer timed apart, and takes per kind the median over
that kind's sub-layers (an output layer in row chunks: the sum of its chunks), then the median over repeats.
Beside them, per placement and point, the whole step as the runtime runs it (one-token steps join sub-layers
into few sessions) over the sum of its parts: the estimator scales the parts by it. On the simulated device, whose
copies share the cores with its compute, also the upload rate a run streaming every unit achieves (`streamed`,
`copy`): the estimator's rate for copies beside compute there.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

TIMED_KINDS = ("attn", "ffn", "final")
PLACEMENTS = ("cpu", "device")


def _ids(step, count: int, rng) -> np.ndarray:
    return rng.integers(0, min(step.vocab_size, 20000), size=(1, count)).astype(np.int64)


def prefill(step, past: int, rng) -> None:
    """New sequences with `past` tokens cached: what the steps timed after it attend to. A step of T tokens
    after it writes the cache's rows past..past+T, which the next step at the same past writes again, so one
    prefill serves every step timed at that past."""
    step.start(1)
    if past:
        ids = _ids(step, past, rng)
        step.forward(ids, np.ones((1, past), np.int64), np.arange(past)[None])


def _step_after(step, past: int, tokens: int, rng) -> None:
    step.forward(
        _ids(step, tokens, rng), np.ones((1, past + tokens), np.int64), np.arange(past, past + tokens)[None]
    )


def time_stages(step, past: int, tokens: int, rng) -> tuple[float, dict[str, float]]:
    """Seconds of one step of `tokens` tokens after `past` cached ones (prefill() first), and per stage."""
    stage_seconds: dict[str, float] = {}
    step.stage_timer = stage_seconds.__setitem__
    try:
        begin = time.perf_counter()
        _step_after(step, past, tokens, rng)
        total = time.perf_counter() - begin
    finally:
        step.stage_timer = None
    return total, stage_seconds


def time_whole(step, past: int, tokens: int, rng) -> float:
    """Seconds of one step of `tokens` tokens after `past` cached ones (prefill() first), run as the runtime
    runs it."""
    begin = time.perf_counter()
    _step_after(step, past, tokens, rng)
    return time.perf_counter() - begin


def _time_step_kinds(step, placement: str, tiers, pasts, repeat: int, progress) -> list[dict]:
    step.all_logits = True  # time the output layer over all T, as the cost model counts it
    units = step.layout.units
    kind_of = {e.name: e.kind for e in step.pack.sub_layers}
    layer_of = {name: unit.chunk.of if unit.chunk else name for name, unit in units.items()}
    rng = np.random.default_rng(0)
    rows = []
    for past in pasts:
        prefill(step, past, rng)
        for tokens in tiers:
            time_stages(step, past, tokens, rng)  # warm-up for this shape
            per_kind: dict[str, list[float]] = {kind: [] for kind in TIMED_KINDS}
            stage_sums = []
            for _ in range(repeat):
                _, stages = time_stages(step, past, tokens, rng)
                stage_sums.append(sum(stages.values()))
                by_layer: dict[str, float] = {}
                for name, seconds in stages.items():
                    by_layer[layer_of.get(name, name)] = by_layer.get(layer_of.get(name, name), 0.0) + seconds
                for kind in TIMED_KINDS:
                    values = [seconds for name, seconds in by_layer.items() if kind_of.get(name) == kind]
                    if values:
                        per_kind[kind].append(statistics.median(values))
            # The whole steps after the timed ones: a step's program is made at the first step after the timer
            # changes, and one-token steps run joined sessions of their own; the warm-up takes both (a step of
            # many tokens outweighs making its program: no warm-up).
            if tokens < 64:
                time_whole(step, past, tokens, rng)
            wholes = [time_whole(step, past, tokens, rng) for _ in range(repeat)]
            ratio = statistics.median(wholes) / statistics.median(stage_sums)
            for kind, values in per_kind.items():
                if values:
                    rows.append(
                        {
                            "placement": placement,
                            "kind": kind,
                            "T": tokens,
                            "C": past + tokens,
                            "seconds": statistics.median(values),
                        }
                    )
            rows.append(
                {
                    "placement": placement,
                    "kind": "step",
                    "T": tokens,
                    "C": past + tokens,
                    "ratio": ratio,
                }
            )
            progress()
    return rows


def _every_unit(step, placement: str, tiers, slots: int = 0):
    """A plan placing every placeable unit of `step`'s pack at `placement`, with room for the device's activations
    at the largest tier. Pinned, an output layer in row chunks stays on the CPU: a split with chunks is never
    joined, and the device's one-token steps are to be timed as plans run them (the estimator takes its CPU rows
    for it on sim)."""
    from pipeshard.formats.plans import HOST_ONLY_KINDS, Placement, Plan, VramBreakdown

    placements = {
        name: Placement.CPU
        if unit.kind in HOST_ONLY_KINDS or (placement == Placement.PINNED and unit.chunk is not None)
        else placement
        for name, unit in step.layout.units.items()
    }
    workspace = 4 * max(tiers) * step.hidden_size * np.dtype(step.dtype).itemsize
    vram = VramBreakdown(workspace=workspace, reserve=0)
    return Plan(placement, 0, placements, {}, 0.0, 0.0, vram, 0, slots=slots, prefetch=slots > 0)


def _copy_rate_while_streaming(step, tiers, past: int, repeat: int) -> list[dict]:
    """Rows {placement: "streamed", kind: "copy", T, gbps}: the upload rate a run that streams every unit through
    the staging slots achieves while its sub-layers compute (what copies cost beside compute on this device)."""
    rng = np.random.default_rng(0)
    rows = []
    prefill(step, past, rng)
    for tokens in tiers:
        time_whole(step, past, tokens, rng)  # warm-up
        copied, seconds = step.device.copied_bytes, step.device.copy_seconds
        for _ in range(repeat):
            time_whole(step, past, tokens, rng)
        moved, spent = step.device.copied_bytes - copied, step.device.copy_seconds - seconds
        if moved and spent > 0:
            row = {"placement": "streamed", "kind": "copy", "T": tokens, "C": past + tokens}
            rows.append({**row, "gbps": moved / spent / 1e9})
    return rows


def time_pack(
    pack_dir, threads: int, tiers, pasts, repeat: int = 3, progress=lambda: None, device: str | None = None
) -> list[dict]:
    """Rows {placement, kind, T, C, seconds} for the pack's attention, FFN and output sub-layers, and {placement,
    kind: "step", T, C, ratio}: on the CPU, and with `device` ("sim", "cuda") every unit pinned on it, where the
    whole model fits in its memory; on sim also the copy rate of a run streaming every unit."""
    from pipeshard.formats.plans import STAGING_SLOTS, Placement
    from pipeshard.runtime.devices import BudgetExceeded, make_device
    from pipeshard.runtime.plansource import PlanBook
    from pipeshard.runtime.step import Step

    chain = Step(pack_dir, threads=threads)
    rows = _time_step_kinds(chain, "cpu", tiers, pasts, repeat, progress)
    units = list(chain.layout.units)
    pinned_plan, streamed_plan = (
        _every_unit(chain, Placement.PINNED, tiers),
        _every_unit(chain, Placement.STREAMED, tiers, STAGING_SLOTS),
    )
    chain.close()
    if device is None:
        return rows

    def on_device(plan, budget: int):
        return Step(
            pack_dir, device=make_device(device, budget), book=PlanBook(units, fixed=plan), threads=threads
        )

    try:
        pinned = on_device(pinned_plan, 1 << 50 if device == "sim" else _free_bytes())
    except BudgetExceeded:
        return rows  # the model does not fit whole: the estimator keeps its rates for the device
    rows += _time_step_kinds(pinned, "device", tiers, pasts, repeat, progress)
    pinned.close()
    if device == "sim":  # a GPU's copy engine does not share the cores: its profiled link rows hold there
        streamed = on_device(streamed_plan, 1 << 50)
        rows += _copy_rate_while_streaming(streamed, tiers, min(pasts), repeat)
        streamed.close()
    return rows


def _free_bytes() -> int:
    from pipeshard.profiles.measure_cuda import CudaRuntime

    return int(CudaRuntime().properties()["free_bytes"] * 0.9)
