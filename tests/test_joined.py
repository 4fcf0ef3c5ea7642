"""Sub-layers joined into one graph (runtime/joined.py) and the chain's joined decode sessions."""

import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from pipeshard.formats.manifest import SubLayer, load_pack
from pipeshard.runtime.joined import join


def _entries(pack) -> dict[str, SubLayer]:
    return {e.name: e for e in load_pack(pack).sub_layers}


def _session(path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _feeds(session: ort.InferenceSession, rng) -> dict[str, np.ndarray]:
    """Inputs for one step of 3 new tokens over 5 cached rows of an 8-row cache."""
    sizes = {"batch": 1, "sequence": 3, "kv_capacity": 8, "total_sequence": 8, "past_sequence + sequence": 8}
    feeds = {}
    for node_arg in session.get_inputs():
        shape = [d if isinstance(d, int) else sizes[d] for d in node_arg.shape]
        if node_arg.name.endswith("seqlens_k"):
            feeds[node_arg.name] = np.array([7], np.int32)
        elif node_arg.name.endswith("total_sequence_length"):
            feeds[node_arg.name] = np.array(8, np.int32)
        elif node_arg.name.endswith("padding_bias"):
            feeds[node_arg.name] = np.triu(np.full((3, 8), -1e9, np.float32), 6)[None, None]
        else:
            feeds[node_arg.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def test_a_joined_layer_computes_what_its_sub_layers_do_in_turn(tiny_pack, tmp_path):
    pack = tmp_path / "pack"
    shutil.copytree(tiny_pack, pack)
    entries = _entries(pack)
    attn, ffn = entries["L0.attn"], entries["L0.ffn"]
    residual = attn.outputs[-1].name
    assert residual in {i.name for i in ffn.inputs}
    presents = set(attn.kv.present)
    wanted = presents | {ffn.outputs[0].name}
    joined = join([pack / attn.files["onnx"], pack / ffn.files["onnx"]], wanted)
    assert joined.inputs == [i.name for i in attn.inputs]  # the boundary between them is internal
    assert set(joined.outputs) == wanted and residual not in joined.outputs
    (pack / "joined.onnx").write_bytes(joined.model)
    onnx.checker.check_model(str(pack / "joined.onnx"))
    model = onnx.load(pack / "joined.onnx", load_external_data=False)
    parts = [onnx.load(pack / e.files["onnx"], load_external_data=False) for e in (attn, ffn)]
    assert len(model.graph.node) == sum(len(p.graph.node) for p in parts)

    whole, first, second = (_session(pack / name) for name in ("joined.onnx", "L0.attn.onnx", "L0.ffn.onnx"))
    feeds = _feeds(whole, np.random.default_rng(0))
    out = dict(zip([o.name for o in whole.get_outputs()], whole.run(None, feeds), strict=True))
    step = dict(zip([o.name for o in first.get_outputs()], first.run(None, feeds), strict=True))
    final = second.run(None, {residual: step[residual]})[0]
    np.testing.assert_array_equal(out[ffn.outputs[0].name], final)
    for name in presents:
        np.testing.assert_array_equal(out[name], step[name])


def test_an_initializer_two_sub_layers_store_is_kept_once(tiny_pack):
    entries = _entries(tiny_pack)
    names = list(entries)
    joined = join([tiny_pack / entries[n].files["onnx"] for n in names], {"logits"})
    stored = [w.name for n in names for w in entries[n].weights]
    assert len(stored) > len(set(stored))  # the tied embedding: the embedding and the output layer
    initializers = [t.name for t in onnx.ModelProto.FromString(joined.model).graph.initializer]
    every = {
        t.name
        for n in names
        for t in onnx.load(tiny_pack / entries[n].files["onnx"], load_external_data=False).graph.initializer
    }
    assert sorted(initializers) == sorted(every) and set(stored) <= every


def test_an_output_no_sub_layer_makes_is_an_error(tiny_pack):
    entries = _entries(tiny_pack)
    with pytest.raises(ValueError, match="no joined sub-layer outputs"):
        join([tiny_pack / entries["L0.attn"].files["onnx"]], {"logits"})


def test_an_output_shares_an_inputs_buffer_only_after_every_read_of_it(tmp_path):
    """x -> Relu -> y -> Neg -> z, and x -> Abs -> w: z depends on every read of x except Abs's."""
    floats = TensorProto.FLOAT
    nodes = [
        helper.make_node("Relu", ["x"], ["y"]),
        helper.make_node("Neg", ["y"], ["z"]),
        helper.make_node("Abs", ["x"], ["w"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", floats, [2])],
        [helper.make_tensor_value_info(n, floats, [2]) for n in ("z", "w")],
    )
    onnx.save(helper.make_model(graph), tmp_path / "g.onnx")
    joined = join([tmp_path / "g.onnx"], {"z", "w"})
    assert joined.read_before_written("y", "z")
    assert not joined.read_before_written("x", "z")  # Abs may run after Neg
    assert not joined.read_before_written("x", "w")  # Relu reads x and w does not depend on it


def test_the_chain_decodes_in_fewer_runs_with_the_same_logits(tiny_pack):
    from pipeshard.runtime.step import Step

    joined = Step(tiny_pack, threads=1, decode_attention=False)
    split = Step(tiny_pack, threads=1, decode_attention=False, join_decode=False)
    joined_runs, split_runs = sum(joined.decode_runs(), []), sum(split.decode_runs(), [])
    assert len(joined_runs) < len(split_runs) == len(split.layout.in_line) - 1  # less the prologue
    logits = []
    for step in (joined, split):
        step.start(2, 16)
        mask = np.array([[0, 1, 1, 1], [1, 1, 1, 1]], np.int64)
        ids = np.array([[0, 5, 17, 99], [3, 42, 7, 8]], np.int64)
        positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
        steps = [step.forward(ids, mask, positions)[:, -1].copy()]
        for token in (11, 12, 13):
            mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
            positions = positions[:, -1:] + 1
            steps.append(step.forward(np.full((2, 1), token, np.int64), mask, positions)[:, -1].copy())
        logits.append(np.stack(steps))
    np.testing.assert_allclose(logits[0], logits[1], atol=1e-5)
    assert [op.names for op in joined._program] == joined.decode_runs() == [joined_runs]
