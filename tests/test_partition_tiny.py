"""The partitioner on tiny:llama: a verified cut, aligned blobs with no duplication, a lossless chain."""

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

import pipeshard
from pipeshard.core.errors import UserError
from pipeshard.formats.export_info import read_export_info
from pipeshard.formats.manifest import WEIGHT_ALIGNMENT, load_pack
from pipeshard.partitioner.costs import analytic_flops, checked_flops
from pipeshard.partitioner.graph import CutError, SubLayer, verify_cut
from pipeshard.partitioner.partition import partition

PROMPTS = ["Hi", "What is the capital of France, and why is it famous?", "Count: 1 2 3"]


def test_sub_layers_in_execution_order(tiny_pack):
    names = [s.name for s in load_pack(tiny_pack).sub_layers]
    layers = [f"L{i}.{part}" for i in range(4) for part in ("attn", "ffn")]
    assert names == ["prologue", "embed", *layers, "final"]


def test_only_the_residual_stream_and_own_kv_cross_between_compute_sub_layers(tiny_pack):
    pack = load_pack(tiny_pack)
    produced = {o.name: s.name for s in pack.sub_layers for o in s.outputs}
    for entry in pack.sub_layers[2:]:
        from_compute = [i for i in entry.inputs if produced.get(i.name, "prologue") != "prologue"]
        assert len(from_compute) == 1 and from_compute[0].shape[-1] == pack.model.hidden_size, entry.name
        kv_inputs = [i.name for i in entry.inputs if i.name.startswith("past_key_values.")]
        assert kv_inputs == (
            [f"past_key_values.{entry.layer}.key", f"past_key_values.{entry.layer}.value"]
            if entry.kind == "attn"
            else []
        )
    prologue_inputs = {i.name for i in pack.sub_layers[0].inputs}
    assert prologue_inputs <= {"input_ids", "attention_mask", "position_ids"}


@pytest.fixture(scope="module")
def tiny_qwen3_pack(models) -> Path:
    """Qwen3 normalizes q and k per head before rotary: its attention keeps the RotaryEmbedding ops."""
    return models.pack("tiny:qwen3")


def _ops(pack) -> dict[str, list[onnx.NodeProto]]:
    return {e.name: list(onnx.load(pack.path(e.files["onnx"])).graph.node) for e in pack.sub_layers}


def test_plain_rotary_attention_is_one_qkv_matmul_and_gqa_rotating_from_the_prologue_tables(tiny_pack):
    pack = load_pack(tiny_pack)
    nodes = _ops(pack)
    assert not any(n.op_type in ("Cos", "Sin", "RotaryEmbedding") for found in nodes.values() for n in found)
    prologue_outputs = {o.name for o in pack.sub_layers[0].outputs}
    for entry in (e for e in pack.sub_layers if e.kind == "attn"):
        (gqa,) = [n for n in nodes[entry.name] if n.op_type == "GroupQueryAttention"]
        assert onnx.helper.get_attribute_value(next(a for a in gqa.attribute if a.name == "do_rotary")) == 1
        assert set(gqa.input[7:9]) <= prologue_outputs  # the cos/sin caches
        assert [n.op_type for n in nodes[entry.name]].count("MatMul") == 2  # packed q/k/v, then o


def test_sibling_projections_are_one_matmul_split_back_in_their_own_sub_layer(tiny_pack, tiny_qwen3_pack):
    """Gate and up are one MatMul (then Split) in every FFN; Qwen3's q/k/v, which the GQA packing leaves
    apart for their per-head norms, likewise in every attention."""
    for pack, kinds in ((load_pack(tiny_pack), ("ffn",)), (load_pack(tiny_qwen3_pack), ("attn", "ffn"))):
        nodes = _ops(pack)
        for entry in (e for e in pack.sub_layers if e.kind in kinds):
            ops = [n.op_type for n in nodes[entry.name]]
            assert ops.count("Split") == 1, entry.name
            assert ops.count("MatMul") == 2, entry.name  # the packed projections, then down / o


def test_values_every_layer_computes_alike_are_computed_once_in_the_prologue(tiny_qwen3_pack):
    """The rotary cos/sin read only the prologue's angles: one Cos and one Sin per step, not two per attention."""
    pack = load_pack(tiny_qwen3_pack)
    ops = {name: [n.op_type for n in found] for name, found in _ops(pack).items()}
    assert (ops["prologue"].count("Cos"), ops["prologue"].count("Sin")) == (1, 1)
    assert not any({"Cos", "Sin"} & set(found) for name, found in ops.items() if name != "prologue")
    attention_inputs = {i.name for i in pack.sub_layers[2].inputs}
    assert {o.name for o in pack.sub_layers[0].outputs} & attention_inputs


def test_weights_are_aligned_stored_once_and_byte_identical(tiny_pack, tiny_llama_export):
    pack = load_pack(tiny_pack, verify=True)
    source = onnx.load(tiny_llama_export / "model.onnx", load_external_data=False)
    onnx.load_external_data_for_model(source, str(tiny_llama_export))
    source_bytes = {
        t.name: onnx.numpy_helper.to_array(t).tobytes()
        for t in source.graph.initializer
        if t.data_location == onnx.TensorProto.EXTERNAL or len(t.raw_data) >= 1024
    }
    stored = {}
    for entry in pack.sub_layers:
        for weight in entry.weights:
            assert weight.offset % WEIGHT_ALIGNMENT == 0
            data = (tiny_pack / weight.file).read_bytes()[weight.offset : weight.offset + weight.bytes]
            stored.setdefault(weight.name, data)
            assert stored[weight.name] == data
    external_total = (tiny_llama_export / "model.onnx.data").stat().st_size
    blob_total = sum(e.blob.bytes for e in pack.sub_layers if e.blob)
    assert sum(len(d) for d in stored.values()) == external_total
    assert blob_total <= external_total + WEIGHT_ALIGNMENT * len(stored)
    assert all(stored[name] == data for name, data in source_bytes.items() if name in stored)


def test_tied_embedding_is_stored_with_the_lm_head_and_read_by_embed(tiny_pack):
    entries = {e.name: e for e in load_pack(tiny_pack).sub_layers}
    (embed_weight,) = entries["embed"].weights
    assert entries["embed"].blob is None and embed_weight.file == entries["final"].blob.file


def test_cost_model_matches_the_dimension_formula(tiny_pack):
    pack = load_pack(tiny_pack)
    for entry in pack.sub_layers:
        assert entry.cost.flops == analytic_flops(entry.kind, pack.model), entry.name
    attn = next(e for e in pack.sub_layers if e.kind == "attn")
    assert attn.kv.bytes_per_token == 2 * 2 * 16 * 4
    # GroupQueryAttention reads each KV head's past once and appends in place
    assert attn.cost.bytes["C"] == attn.kv.bytes_per_token


def test_cost_check_rejects_a_graph_that_disagrees_with_the_dimensions(tiny_llama_export):
    model = onnx.load(tiny_llama_export / "model.onnx", load_external_data=False)
    matmuls = [i for i, n in enumerate(model.graph.node) if n.op_type == "MatMul"][:2]
    dims = read_export_info(tiny_llama_export).dims  # hidden 64, 4 heads of 16, 2 KV heads
    with pytest.raises(UserError, match="cost model check failed for L0.attn"):
        checked_flops(SubLayer("L0.attn", "attn", 0, nodes=matmuls), model, dims)


def test_chain_greedy_tokens_and_logits_equal_the_monolithic_session(tiny_pack, tiny_llama_export):
    whole, chain = pipeshard.load(tiny_llama_export), pipeshard.load(tiny_pack)
    assert [g.tokens for g in chain.generate(PROMPTS, max_new_tokens=24)] == [
        g.tokens for g in whole.generate(PROMPTS, max_new_tokens=24)
    ]
    for prompt in PROMPTS:
        solo = chain.generate(prompt, max_new_tokens=24)[0].tokens
        assert solo == whole.generate(prompt, max_new_tokens=24)[0].tokens
    ids = np.array([[5, 17, 99, 3, 42, 7]], dtype=np.int64)
    whole.step.start(1)
    chain.step.all_logits = True
    chain.step.start(1)
    for start, stop in ((0, 4), (4, 5), (5, 6)):
        mask = np.ones((1, stop), np.int64)
        positions = np.arange(start, stop)[None]
        difference = np.abs(
            whole.step.forward(ids[:, start:stop], mask, positions)
            - chain.step.forward(ids[:, start:stop], mask, positions)
        ).max()
        assert difference < 1e-4


def test_verify_cut_names_tensors_wider_than_the_residual_stream():
    sub_layers = [
        SubLayer("embed", "embed", None, outputs=["h0"]),
        SubLayer("L0.attn", "attn", 0, inputs=["h0", "past_key_values.0.key"], outputs=["h1", "scores"]),
        SubLayer("L0.ffn", "ffn", 0, inputs=["h1", "scores"], outputs=["h2"]),
    ]
    shapes = {"h0": ["b", "s", 64], "h1": ["b", "s", 64], "scores": ["b", 4, "s", "t"], "h2": ["b", "s", 64]}
    with pytest.raises(CutError, match="scores"):
        verify_cut(sub_layers, shapes, 64)


def test_verify_cut_rejects_a_sub_layer_reading_another_layers_kv():
    sub_layers = [SubLayer("L1.attn", "attn", 1, inputs=["past_key_values.0.key"], outputs=[])]
    with pytest.raises(CutError, match="past_key_values.0.key"):
        verify_cut(sub_layers, {}, 64)


def test_a_node_matching_no_rule_is_named(tiny_llama_export, tmp_path):
    model = onnx.load(tiny_llama_export / "model.onnx", load_external_data=False)
    node = next(n for n in model.graph.node if n.op_type == "MatMul")
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes":
            prop.value = "['', 'lm', 'lm.mystery_block', 'linear']"
    folder = tmp_path / "export"
    folder.mkdir()
    for item in tiny_llama_export.iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    onnx.save(model, folder / "model.onnx")
    info = json.loads((folder / "export.json").read_text())
    info["files"]["model.onnx"]["bytes"] = (folder / "model.onnx").stat().st_size
    (folder / "export.json").write_text(json.dumps(info))
    with pytest.raises(CutError, match=f"match no sub-layer rule: {node.name}"):
        partition(folder, tmp_path / "pack")


def test_inspect_lists_every_sub_layer_with_totals(tiny_pack, capsys):
    from pipeshard.cli import main

    assert main(["inspect", str(tiny_pack)]) == 0
    table = capsys.readouterr().out
    assert "L3.ffn" in table and table.strip().splitlines()[-1].startswith("total")
    assert main(["inspect", str(tiny_pack), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (
        len(summary["sub_layers"]) == 11
        and summary["totals"]["flops_T64"] > summary["totals"]["flops_T1"] > 0
    )


def test_generation_steps_compute_only_the_last_positions_logits(tiny_pack, tiny_llama_export):
    whole, chain = pipeshard.load(tiny_llama_export), pipeshard.load(tiny_pack)
    ids = np.array([[5, 17, 99, 3], [1, 2, 3, 4]], dtype=np.int64)
    args = (ids, np.ones_like(ids), np.tile(np.arange(4), (2, 1)))
    whole.step.start(2)
    chain.step.start(2)
    full, last = whole.step.forward(*args), chain.step.forward(*args)
    assert last.shape == (2, 1, full.shape[-1])
    assert np.abs(full[:, -1:, :] - last).max() < 1e-4


def test_an_fp16_export_partitions_and_runs_losslessly(models):
    pack16 = models.pack("tiny:llama", "fp16")  # fp16 shares the rotary cos/sin across layers
    whole, chain = pipeshard.load(models.export("tiny:llama", "fp16")), pipeshard.load(pack16)
    assert [g.tokens for g in chain.generate(PROMPTS, max_new_tokens=12)] == [
        g.tokens for g in whole.generate(PROMPTS, max_new_tokens=12)
    ]
    assert load_pack(pack16).model.dtype == "fp16"


def test_the_prologue_is_the_padding_bias_lengths_and_rotary_rows_only(tiny_pack):
    """GQA masks the future itself: the exporter's ~40-op causal mask is gone from the step."""
    ops = [n.op_type for n in _ops(load_pack(tiny_pack))["prologue"]]
    assert not {"Range", "GatherND", "LessOrEqual"} & set(ops) and len(ops) <= 30, ops


def test_a_mask_that_is_not_causal_and_padding_keeps_the_exporters_bias():
    from onnx import TensorProto, helper

    from pipeshard.exporter.fuse import _mask_window

    graph = helper.make_graph(  # padding only, no causal part
        [
            helper.make_node("Cast", ["attention_mask"], ["attend"], to=TensorProto.BOOL),
            helper.make_node(
                "Constant", [], ["axes"], value=helper.make_tensor("v", TensorProto.INT64, [2], [1, 2])
            ),
            helper.make_node("Unsqueeze", ["attend", "axes"], ["mask"]),
        ],
        "g",
        [
            helper.make_tensor_value_info(name, TensorProto.INT64, ["batch", size])
            for name, size in (
                ("input_ids", "sequence"),
                ("attention_mask", "total"),
                ("position_ids", "sequence"),
            )
        ],
        [helper.make_tensor_value_info("mask", TensorProto.BOOL, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert _mask_window(model, "mask", None) is None and _mask_window(model, "mask", 4) is None


def test_rotary_tables_are_bound_whole_once_instead_of_sliced_every_step(tiny_pack):
    from pipeshard.runtime.step import Step

    pack = load_pack(tiny_pack)
    prologue = pack.sub_layers[0]
    tables = {o.name: o.rows_of for o in prologue.outputs if o.rows_of}
    assert tables == {"_gqa_cos_cache": "_gqa_cos_cache_table", "_gqa_sin_cache": "_gqa_sin_cache_table"}
    assert set(tables.values()) <= {w.name for w in prologue.weights}
    step = Step(tiny_pack, threads=1)
    stages = step.sub_layer_stages()
    assert not set(tables) & {n for s in stages for n in s.shared_inputs + s.allocated_outputs}
    for stage in (s for s in stages if s.past):
        assert set(tables) <= set(stage.fixed_inputs)
    rows = step.max_context
    assert [step._tables[name].shape[0] for name in tables] == [rows, rows]


def test_only_a_slice_of_a_stored_weight_from_row_zero_is_a_row_prefix():
    from onnx import TensorProto, helper

    from pipeshard.partitioner.partition import row_prefix_outputs

    def sliced(start: int, axis: int) -> dict[str, str]:
        table = helper.make_tensor("table", TensorProto.FLOAT, [8, 2], [0.0] * 16)
        table.data_location = TensorProto.EXTERNAL
        table.ClearField("float_data")
        table.external_data.add(key="location", value="w.bin")
        nodes = [
            helper.make_node(
                "Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [1], [v])
            )
            for name, v in (("start", start), ("axis", axis))
        ]
        nodes.append(helper.make_node("Slice", ["table", "start", "total", "axis"], ["rows"]))
        graph = helper.make_graph(
            nodes,
            "g",
            [helper.make_tensor_value_info("total", TensorProto.INT64, [1])],
            [helper.make_tensor_value_info("rows", TensorProto.FLOAT, None)],
            [table],
        )
        model = helper.make_model(graph)
        sub_layer = SubLayer(
            "prologue",
            "prologue",
            None,
            nodes=[0, 1, 2],
            inputs=["total"],
            outputs=["rows"],
            initializers=["table"],
        )
        return row_prefix_outputs(model, sub_layer, {"table": table})

    assert sliced(0, 0) == {"rows": "table"}
    assert sliced(1, 0) == {} and sliced(0, 1) == {}


def test_decode_steps_skip_the_prologue_and_keep_its_values_in_place(tiny_pack, tiny_llama_export):
    """At one new token the chain fills the prologue's values itself (over the KV capacity) instead of
    running it; a left-padded batch then still gives the monolithic session's logits."""
    whole, chain = pipeshard.load(tiny_llama_export).step, pipeshard.load(tiny_pack).step
    runs = []
    chain.stage_timer = lambda name, seconds: runs.append(name)
    ids = np.array([[0, 0, 5, 17, 99], [3, 42, 7, 8, 9]], np.int64)
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], np.int64)
    positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    for step in (whole, chain):
        step.start(2, 16)
    for tokens in (5, 1, 1, 1):
        if tokens == 1:
            ids = np.array([[11], [12]], np.int64)
            mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
            positions = positions[:, -1:] + 1
        expected = whole.forward(ids, mask, positions)[:, -1]
        assert np.abs(chain.forward(ids, mask, positions)[:, -1] - expected).max() < 1e-4
    stages = chain.sub_layer_stages()
    assert runs.count(stages[0].name) == 1  # the prefill's
    assert stages[0].name == "prologue" and len(runs) == 4 * len(stages) - 3
