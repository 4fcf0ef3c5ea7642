"""How many distinct experts a MoE layer runs per step at tiers 1, 4, 16 and 64 on real text, measured, against the
planner's expectation: E(1-(1-k/E)^T) for uniform routing, and from measured routing stats. On a seeded random
Qwen3-MoE-like model large enough for memory traffic to matter (8 experts, top-2; ~450 MB of experts), made once
under --work with its export and pack (a few minutes on 2 cores). Counting, not timing: the decode speed of the split
form (routed experts only) against the dense monolithic export (every expert for every token) is
`pipeshard bench build/bench-moe/pack --device cpu --plans monolithic,cpu` (docs/bench.md).

    python examples/moe_routing.py [--work build/bench-moe] [--threads 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

import pipeshard
from pipeshard.exporter import export_model
from pipeshard.exporter.tiny import build_random_model
from pipeshard.formats.expert_stats import RoutingStats
from pipeshard.formats.manifest import load_pack
from pipeshard.partitioner.partition import partition
from pipeshard.partitioner.planner import Planner
from pipeshard.profiles.db import load_profile
from pipeshard.runtime.moe import ExpertStats

CONFIG = {
    "model_type": "qwen3_moe",
    "hidden_size": 512,
    "intermediate_size": 1024,
    "moe_intermediate_size": 768,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}
TEXT = (Path(__file__).resolve().parents[1] / "README.md").read_text()  # real text for the routing tiers
TIERS = (1, 4, 16, 64)


def prepare(work: Path) -> tuple[Path, Path]:
    """HF folder -> export -> pack, each made once."""
    folder, export, pack = work / "hf", work / "export", work / "pack"
    if not (folder / "config.json").is_file():
        model, tokenizer = build_random_model(CONFIG)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    if not (export / "export.json").is_file():
        export_model(str(folder), export, force=True)
    if not (pack / "manifest.json").is_file():
        partition(export, pack, force=True)
    return export, pack


def distinct_experts(pack: Path, threads: int) -> dict:
    """Feed real text in steps of T tokens through the split form and count distinct experts per layer."""
    engine = pipeshard.load(pack, plan="cpu", threads=threads)
    step = engine.step
    ids = np.array([engine.codec.tokenizer.encode(TEXT).ids[:1024]], np.int64)
    measured = {}
    for tier in TIERS:
        step.expert_stats = ExpertStats(step.expert_stats.num_experts)
        step.start(1, ids.shape[1])
        steps = min(ids.shape[1] // tier, 48)
        for index in range(steps):
            begin, end = index * tier, (index + 1) * tier
            step.forward(ids[:, begin:end], np.ones((1, end), np.int64), np.arange(begin, end)[None])
        measured[tier] = step.expert_stats.mean_distinct_experts()[str(tier)]
        if tier == TIERS[-1]:
            # the text's routing at T=64, as a stats file would hold it
            stats = RoutingStats.from_json(step.expert_stats.to_json(), "the measured routing")
    manifest = step.pack.manifest
    uniform = Planner(manifest, load_profile("laptop-8gb"))
    measured_routing = Planner(manifest, load_profile("laptop-8gb"), expert_stats=stats)
    return {
        "measured": measured,
        "expected_uniform": {
            t: statistics.mean(uniform.expected_distinct_experts(t).values()) for t in TIERS
        },
        "expected_from_stats": {
            t: statistics.mean(measured_routing.expected_distinct_experts(t).values()) for t in TIERS
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="build/bench-moe")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args()
    _, pack = prepare(Path(args.work))
    pipeshard.use_process_thread_pool(args.threads)  # after the export, whose check makes its own session
    manifest = load_pack(pack).manifest
    model = manifest.model
    experts = sum(e.weight_bytes for e in manifest.sub_layers if e.kind == "expert")
    print(
        f"model: {model.architecture}, {model.num_layers} layers, "
        f"{model.num_experts} experts top-{model.experts_per_token}, "
        f"{manifest.total_weight_bytes / 2**20:.0f} MiB of weights ({experts / 2**20:.0f} MiB experts), "
        f"{args.threads} threads"
    )
    routing = distinct_experts(pack, args.threads)
    print("distinct experts per layer and step (of 8), real text:")
    print(
        f"  {'tier T':>6} {'measured':>9} {'expected, uniform E(1-(1-k/E)^T)':>34} {'expected, from stats':>21}"
    )
    for tier in TIERS:
        print(
            f"  {tier:>6} {routing['measured'][tier]:>9.2f} {routing['expected_uniform'][tier]:>34.2f} "
            f"{routing['expected_from_stats'][tier]:>21.2f}"
        )
    print(
        "  (stats: the per-expert token counts of the T=64 pass, what run --save-expert-stats writes; both"
        " expectations assume the tokens of a step choose their experts independently)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"routing": routing}, indent=1))


if __name__ == "__main__":
    main()
