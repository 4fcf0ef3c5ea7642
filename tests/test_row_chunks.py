"""The output layer in row chunks: what the pack says, how plans split it, and lossless runs with the
chunks pinned, streamed and on the CPU in one step."""

from pathlib import Path

import onnx
import pytest

import pipeshard
from pipeshard.api import Engine
from pipeshard.formats.manifest import RowChunks, load_pack
from pipeshard.formats.plans import Placement, planning_units
from pipeshard.partitioner.planner import Planner
from pipeshard.profiles.db import load_profile
from pipeshard.runtime.devices import make_device
from pipeshard.runtime.plansource import PlanBook
from pipeshard.runtime.step import Step
from pipeshard.runtime.text import TextCodec

PROMPTS = ["hi", "a much longer prompt than the first one"]


def test_the_pack_marks_the_tied_output_layer_as_row_chunkable(tiny_pack):
    final = load_pack(tiny_pack).sub_layers[-1]
    assert final.row_chunks == RowChunks("lm_head.weight", rows=259, row_bytes=64 * 4)
    graph = onnx.load(tiny_pack / final.files["weights_as_inputs"], load_external_data=False).graph
    weight = next(i for i in graph.input if i.name == "lm_head.weight")
    assert weight.type.tensor_type.shape.dim[0].dim_param == "rows"


def test_an_untied_output_layer_is_stored_by_rows_and_row_chunkable_too(models):
    """An untied head (`MatMul(x, W [hidden, vocab])` in the trace) is stored by rows at export
    (exporter/fuse.py: store_output_layer_by_rows), so the partitioner marks it like a tied one."""
    pack = models.pack("tiny:qwen3")
    final = load_pack(pack).sub_layers[-1]
    assert final.row_chunks is not None and (final.row_chunks.rows, final.row_chunks.row_bytes) == (259, 256)
    assert not load_pack(pack).model.tie_word_embeddings


def test_plans_split_the_output_layer_into_consecutive_row_ranges(tiny_pack):
    sub_layers = load_pack(tiny_pack).sub_layers
    units = planning_units(sub_layers, output_chunks=4)
    chunks = [u for u in units if u.chunk and u.chunk.of == "final"]
    assert [(u.chunk.first_row, u.chunk.end_row) for u in chunks] == [
        (0, 65),
        (65, 130),
        (130, 195),
        (195, 259),
    ]
    assert sum(u.weight_bytes for u in chunks) == 259 * 256 and "final" not in {u.name for u in units}
    assert planning_units(sub_layers) == list(sub_layers)  # tiny: the output layer is no larger than an FFN


@pytest.mark.parametrize(
    ("model", "chunk_placements"),
    [
        ("tiny:llama", (Placement.PINNED, Placement.STREAMED, Placement.CPU, Placement.STREAMED)),
        ("tiny:llama", (Placement.STREAMED, Placement.STREAMED, Placement.STREAMED, Placement.STREAMED)),
        ("tiny:llama", (Placement.CPU, Placement.PINNED, Placement.PINNED, Placement.CPU)),
        ("tiny:qwen3", (Placement.PINNED, Placement.STREAMED, Placement.CPU, Placement.STREAMED)),  # untied
    ],
)
def test_chunks_placed_anywhere_give_the_monolithic_tokens(models, model, chunk_placements):
    tiny_pack = models.pack(model)
    reference = pipeshard.load(models.export(model))
    reference.codec.eos_token_ids = []
    expected = [g.tokens for g in reference.generate(PROMPTS, max_new_tokens=12)]
    manifest = load_pack(tiny_pack).manifest
    profile = load_profile("laptop-8gb")
    # planned for the batch the test runs, so the runtime keeps these placements (a larger batch is replanned)
    planner = Planner(manifest, profile, context=128, batch=len(PROMPTS), output_chunks=4)
    budget = planner.minimum_budget() + 2_000_000
    placements = {
        u.name: Placement.STREAMED if u.kind == "attn" else Placement.CPU for u in planner.placeable
    }
    placements.update({f"final#{j}": p for j, p in enumerate(chunk_placements)})
    book = PlanBook([u.name for u in planner.units], source=planner, budget_bytes=budget, strategy="gpu-only")
    step = Step(Path(tiny_pack), make_device("sim", budget), book)
    for tier in step.tiers:
        step.plans[tier] = planner.evaluate("gpu-only", tier, placements, budget)
    engine = Engine(step, TextCodec(Path(tiny_pack)), Path(tiny_pack))
    engine.codec.eos_token_ids = []
    assert [g.tokens for g in engine.generate(PROMPTS, max_new_tokens=12)] == expected
    chunk_bytes = [65 * 256, 65 * 256, 65 * 256, 64 * 256]
    streamed_chunks = sum(
        b for b, p in zip(chunk_bytes, chunk_placements, strict=True) if p == Placement.STREAMED
    )
    assert step.stats.streamed_bytes >= streamed_chunks and step.device.ledger.peak <= budget
