"""The paper's Table 4 / Figure 2 beside what our planner predicts for the same models, contexts and budgets.

    python examples/paper_compare.py            # writes docs/paper-comparison.md (exports the packs if missing)

For each of the paper's four models (examples/paper_configs/) a shape-only pack is exported once into
build/paper/ (`pipeshard export CONFIG PACK --shape-only --dtype fp16`). For every published row (model x
context x VRAM budget) the planner plans tiers 1 (decode) and 1024 (prefill micro-batch, the paper's -ub) on
the reference profile `desktop-rtx5090` with 16 CPU threads and the KV cache sized for the context. Predicted
tokens/s is the tier-1 plan's; predicted TTFT is the prompt's 1024-token chunks times the tier-1024 step
(the paper's prompts: its baseline log's token counts). The `layers` baseline (llama.cpp -ngl: whole layers on
the GPU, the rest on the CPU) is planned the same way; the speedup is ours over it. The quantized models are
planned with --assume-bits (planning only): 4.5 bits for Q4_0, 2.9 for the Q2_K of Qwen3-235B (about 85 GB).
The paper's figures are examples/paper_data/ (copied from its artifact).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "examples" / "paper_data"
CONFIGS = REPO / "examples" / "paper_configs"
PROFILE = "desktop-rtx5090"
THREADS = 16
PREFILL_TIER = 1024  # the paper's micro-batch (-ub 1024)
CONTEXTS = {"1K": 1024, "4K": 4096, "16K": 16384, "64K": 65536}
MiB = 1024**2


@dataclass(frozen=True)
class PaperModel:
    table4: str  # the model's name in table4.csv
    figure2: str  # ... and in figure2.csv
    config: str  # examples/paper_configs/<config>.json
    precision: str  # what the paper ran
    assume_bits: float | None  # planning-only bits per weight for a quantized GGUF
    prompt_tokens: dict[str, int]  # the prompt of each context, tokenized (the paper's baseline log)


MINITRON_PROMPTS = {"1K": 908, "4K": 4035, "16K": 16134, "64K": 64530}
QWEN_PROMPTS = {"1K": 889, "4K": 3935, "16K": 15734, "64K": 62930}
MODELS = [
    PaperModel("nemo-4b", "minitron-4b", "minitron-4b", "f16", None, MINITRON_PROMPTS),
    PaperModel("nemo-8b", "minitron-8b", "minitron-8b", "f16", None, MINITRON_PROMPTS),
    PaperModel("qwen-30b", "qwen3-30b", "qwen3-30b-a3b", "Q4_0", 4.5, QWEN_PROMPTS),
    PaperModel("qwen-235b", "qwen3-235b", "qwen3-235b-a22b", "Q2_K", 2.9, QWEN_PROMPTS),
]


def ensure_pack(model: PaperModel, folder: Path) -> Path:
    """The model's shape-only pack, exported once."""
    pack = folder / model.config
    if not (pack / "manifest.json").is_file():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pipeshard",
                "export",
                str(CONFIGS / f"{model.config}.json"),
                str(pack),
                "--shape-only",
                "--dtype",
                "fp16",
            ],
            check=True,
        )
    return pack


def read_paper() -> tuple[dict, dict]:
    with open(DATA / "table4.csv", newline="", encoding="utf-8-sig") as handle:
        table4 = {(r["Model"], r["CtxSize"], r["Vram"]): r for r in csv.DictReader(handle)}
    with open(DATA / "figure2.csv", newline="", encoding="utf-8-sig") as handle:
        figure2 = {(r["Model"], r["CtxK"], r["VramBudget"]): r for r in csv.DictReader(handle)}
    return table4, figure2


def where_attention_runs(plan) -> str:
    """How many attentions the plan keeps on the device (their KV in VRAM) and how many on the CPU."""
    attentions = [name for name in plan.placements if name.endswith(".attn")]
    on_device = sum(1 for name in attentions if plan.placements[name] != "cpu")
    return f"{on_device}/{len(attentions)}"


def plans_of_tier(planner, tier: int, budget: int) -> dict:
    """The planner's choice for a tier (what Planner.plan_tier chooses: the fastest of its three strategies) and
    the `layers` baseline, without the timelines and the `offload` baseline plan_tier also makes."""
    planner.check_budget(budget)
    strategies = [
        p
        for p in (planner.gpu_only(tier, budget), planner.static(tier, budget), planner.dynamic(tier, budget))
        if p is not None
    ]
    return {
        "ours": min(strategies, key=lambda p: p.step_s),
        "layers": planner.baseline("layers", tier, budget),
    }


def predict(planner, prompt_tokens: int, budget: int) -> dict:
    """Tokens/s and TTFT of the chosen plan and of `layers` within `budget` bytes, from the plans of tiers 1 and
    PREFILL_TIER."""
    decode, prefill = plans_of_tier(planner, 1, budget), plans_of_tier(planner, PREFILL_TIER, budget)
    chunks = math.ceil(prompt_tokens / PREFILL_TIER)
    row = {}
    for key in ("ours", "layers"):
        decode_plan, prefill_plan = decode[key], prefill[key]
        row[key] = {
            "tok_s": decode_plan.tokens_per_s,
            "ttft_ms": chunks * prefill_plan.step_s * 1000,
            "decode": decode_plan.strategy,
            "prefill": prefill_plan.strategy,
            "attn_on_gpu": where_attention_runs(decode_plan),
            "streamed_mib": decode_plan.streamed_bytes / MiB,
        }
    return row


def explain(context: str, budget: str, row: dict, predicted: float, paper: float, kind: str) -> str:
    """One sentence on the likeliest reason our predicted speedup is more than 2x off the paper's (from what the
    plans say: where attention and the prefill run, what `layers` leaves on the CPU)."""
    mine = row["ours"]
    attn, total = (int(x) for x in mine["attn_on_gpu"].split("/"))
    group = row["query_heads_per_kv_head"]
    if kind == "TTFT" and predicted < paper and mine["prefill"] == "static":
        return (
            f"TTFT: at {budget} no plan of ours streams the model through the GPU for a 1024-token chunk, so "
            "its FFNs (experts) run on the CPU: GPU-only needs two staging slots as large as the largest unit "
            f"({row['largest_unit_mib']:.0f} MiB) beside the chunk's workspace, and the dynamic search starts "
            "from a pinned prefix that leaves no room for a staging slot; the paper streams every layer "
            "through the GPU at prefill (its FULL_SHARD / SHARD_ATTN_PRIO with one slot)"
        )
    if kind == "TTFT" and predicted > paper:
        return (
            "TTFT: our `layers` baseline computes the prompt chunks of its CPU layers on the CPU, while "
            "llama.cpp's -ngl copies the weights of CPU-resident layers to the GPU for large batches (its "
            "operation offload), so the paper's baseline prefill is far faster than our `layers` model"
        )
    if kind == "TTFT":
        return (
            "TTFT: our `layers` prefill is predicted close to our plan's; the measured llama.cpp baseline "
            "pays what the roofline does not (its per-layer transfers and synchronisation)"
        )
    if predicted < paper and attn < total:
        return (
            f"tok/s: at {context} the KV of {total - attn} of {total} attentions does not fit {budget} beside "
            "the weights, so our plan computes those attentions on the CPU, as `layers` does; the paper keeps "
            "the KV in host memory and streams it to the GPU with the weights (KV streaming, issue 25)"
        )
    if predicted < paper:
        return (
            "tok/s: our `layers` decode is predicted nearer our plan than the paper measured its baseline: the "
            "measured llama.cpp -ngl pays CPU costs the estimator does not model (its per-layer "
            "synchronisation and graph splits), and at long contexts its CPU attention kernels"
        )
    return (
        f"tok/s: our `layers` decode is predicted slower than the paper's measured baseline: the estimator "
        "charges CPU attention at the profile's multi-head rate, up to "
        f"{group}x this model's grouped-query KV traffic ({group} query heads per KV head), and each CPU "
        "sub-layer (expert) a session hop, costs llama.cpp's CPU kernels do not pay"
    )


def compare(packs: Path) -> tuple[list[dict], dict]:
    from pipeshard.formats.manifest import load_pack
    from pipeshard.partitioner.planner import Planner
    from pipeshard.profiles.db import load_profile

    table4, figure2 = read_paper()
    profile = load_profile(PROFILE)
    rows, seconds = [], {}
    for model in MODELS:
        pack = load_pack(ensure_pack(model, packs))
        started = time.perf_counter()
        for context, tokens in CONTEXTS.items():
            planner = Planner(
                pack.manifest,
                profile,
                context=tokens,
                batch=1,
                threads=THREADS,
                assume_bits=model.assume_bits,
            )
            for key, published in table4.items():
                if key[0] != model.table4 or key[1] != context:
                    continue
                row = predict(planner, model.prompt_tokens[context], int(published["VramMB"]) * MiB)
                speedups = figure2[(model.figure2, context, published["Vram"])]
                rows.append(
                    {
                        "model": model,
                        "context": context,
                        "vram": published["Vram"],
                        **row,
                        "paper_tok_s": float(published["TPS"]),
                        "paper_ttft_ms": float(published["TTFT(msec)"]),
                        "paper_tps_speedup": float(speedups["TPSSpeedup"]),
                        "paper_ttft_speedup": float(speedups["TTFTSpeedup"]),
                        "units": len(planner.units),
                        "model_gib": planner.model_bytes / 1024**3,
                        "largest_unit_mib": max(planner.weight_bytes[e.name] for e in planner.placeable)
                        / MiB,
                        "query_heads_per_kv_head": pack.model.num_attention_heads
                        // pack.model.num_key_value_heads,
                    }
                )
        seconds[model.config] = time.perf_counter() - started
    return rows, seconds


def render(rows: list[dict], seconds: dict, command: str) -> str:
    lines = [
        "# The paper's Table 4 and Figure 2 beside our planner's predictions",
        "",
        f"Generated by `{command}` (examples/paper_compare.py); do not edit by hand.",
        "",
        "**What is compared.** The paper (Ukarande et al., MLSys 2026) measured pipelined sharding in its llama.cpp "
        "fork on an RTX 5090 desktop with 16 CPU threads (Table 4: tokens/s and TTFT; Figure 2: speedups over "
        "hand-tuned llama.cpp `-ngl`). Nothing here is measured: for the same models, contexts and VRAM budgets, "
        "our planner plans shape-only packs (`pipeshard export CONFIG PACK --shape-only`, no weights) on the "
        f"reference profile `{PROFILE}` (profiles/reference.py: RTX 5090 32 GB, 1.79 TB/s, PCIe 5.0 x16, a 16-core "
        "Zen 5 desktop CPU on dual-channel DDR5-5600, all from spec sheets), with the KV cache sized for the "
        "context. *ours* is the planner's chosen plan at tier 1 (decode: tokens/s) and at tier 1024 (prefill: "
        "TTFT = the prompt's 1024-token chunks x that step); *layers* is our `-ngl` baseline (whole layers on "
        "the GPU in order, the rest on the CPU) predicted the same way. Speedup = ours / layers (TTFT: layers / "
        "ours). The paper's speedups are over its own measured, hand-tuned baseline.",
        "",
        "**Assumptions.** Minitron-4B/8B are planned lossless in fp16 (the paper's f16 GGUFs); Qwen3-30B-A3B (Q4_0) "
        "and Qwen3-235B-A22B (Q2_K, about 85 GB) with `--assume-bits 4.5` and `2.9`: planning only, every weight "
        "sized and read at that many bits, compute at fp16 rates (our runtime stays lossless; it would need "
        "4x / 5.5x the bytes). Architectures are from the models' public configs (examples/paper_configs/; the "
        "4B's shape is an assumption, see its `_source`). The paper does not name its CPU (its artifact was built on "
        "an Intel x86-64 Windows desktop); the profile's 16-core Zen 5 with AVX-512 has about twice the fp32 peak "
        "of an Intel desktop without it, which matters for CPU prefill, hardly for decode (both read dual-channel "
        "DDR5). Every figure is a roofline prediction, unchecked on a GPU: no GPU run has been made (unverified).",
        "",
        "**The largest differences, in short** (details in the notes under each table): (1) at small budgets our "
        "prefill stays on the CPU because no plan of ours streams the model at tier 1024 (GPU-only's two slots of "
        "the largest unit do not fit, and the dynamic search leaves no room for a slot), where the paper streams "
        "every layer: TTFT up to 40x the paper's; (2) at long contexts the KV that does not fit keeps attention on "
        "the CPU (the paper streams KV, issue 25): tok/s up to 10x below the paper's at 64K; (3) our `layers` "
        "baseline computes a prompt's CPU layers on the CPU, while llama.cpp offloads large batches to the GPU, "
        "so our predicted TTFT speedups are 3-15x the paper's where both stream; (4) attention is costed at the "
        "profile's multi-head rate, overcharging grouped-query attention on the CPU.",
        "",
        "Columns: budget; *ours* tok/s and TTFT with the decode / prefill strategies and the attentions on the "
        "GPU at decode; *layers* tok/s and TTFT; predicted speedups; the paper's tok/s, TTFT and speedups. A "
        "note [n] marks a predicted speedup more than 2x from the paper's; the notes under each table say why.",
        "",
    ]
    for model in MODELS:
        mine = [r for r in rows if r["model"] is model]
        lines += [
            f"## {model.figure2} ({model.precision}"
            + (f", planned at {model.assume_bits:g} bits/weight" if model.assume_bits else "")
            + f": {mine[0]['model_gib']:.1f} GiB of weights, {mine[0]['units']} planning units; "
            f"{seconds[model.config]:.0f} s to plan its {len(mine)} rows x 2 tiers)",
            "",
        ]
        notes: list[str] = []
        for context in CONTEXTS:
            lines += [
                f"**{context} context**",
                "",
                "| VRAM | ours tok/s | ours TTFT ms | plans (decode/prefill), attn on GPU | layers tok/s | "
                "layers TTFT ms | speedup tok/s | speedup TTFT | paper tok/s | paper TTFT ms | "
                "paper speedup tok/s | paper speedup TTFT |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|",
            ]
            for r in (r for r in mine if r["context"] == context):
                ours, base = r["ours"], r["layers"]
                tps_speedup = ours["tok_s"] / base["tok_s"]
                ttft_speedup = base["ttft_ms"] / ours["ttft_ms"]
                marks = []
                for kind, predicted, paper in (
                    ("tok/s", tps_speedup, r["paper_tps_speedup"]),
                    ("TTFT", ttft_speedup, r["paper_ttft_speedup"]),
                ):
                    if max(predicted / paper, paper / predicted) > 2:
                        notes.append(
                            f"[{len(notes) + 1}] {context}, {r['vram']}: "
                            + explain(context, r["vram"] + "B", r, predicted, paper, kind)
                            + "."
                        )
                        marks.append(f"[{len(notes)}]")
                lines.append(
                    f"| {r['vram']} | {ours['tok_s']:.1f} | {ours['ttft_ms']:.0f} | {ours['decode']} / "
                    f"{ours['prefill']}, {ours['attn_on_gpu']} | {base['tok_s']:.1f} | {base['ttft_ms']:.0f} | "
                    f"{tps_speedup:.2f}x | {ttft_speedup:.2f}x | {r['paper_tok_s']:.1f} | {r['paper_ttft_ms']:.0f} | "
                    f"{r['paper_tps_speedup']:.2f}x | {r['paper_ttft_speedup']:.2f}x {' '.join(marks)} |"
                )
            lines.append("")
        if notes:
            lines += ["Notes:", "", *(f"- {note}" for note in notes), ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--packs", default=str(REPO / "build" / "paper"), help="where the shape-only packs are kept"
    )
    parser.add_argument("--out", default=str(REPO / "docs" / "paper-comparison.md"))
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    args = parser.parse_args()
    rows, seconds = compare(Path(args.packs))
    Path(args.out).write_text(render(rows, seconds, "python examples/paper_compare.py") + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps([{**r, "model": r["model"].config} for r in rows], indent=1))
    print(f"wrote {args.out}: {len(rows)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
