"""Every node of a device sub-layer graph has a CUDA kernel for its op, opset and types in the pinned
onnxruntime-gpu (tests/ort_kernels.py's table, checked by runtime/kernel_check.py): ONNX Runtime would otherwise run
it on the CPU without a word."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper
from ort_kernels import ONNXRUNTIME_GPU, TABLE

import pipeshard
from pipeshard.api import Engine
from pipeshard.core.errors import UserError
from pipeshard.core.fsutil import sha256_file
from pipeshard.exporter.fuse import attention_in_half
from pipeshard.formats.manifest import load_pack
from pipeshard.formats.plans import HOST_ONLY_KINDS, Placement
from pipeshard.partitioner.partition import partition
from pipeshard.partitioner.planner import Planner
from pipeshard.profiles.db import load_profile
from pipeshard.runtime.devices import make_device
from pipeshard.runtime.kernel_check import BIAS_REFUSED, SHAPE_ON_CPU, KernelTable, Missing, missing_kernels
from pipeshard.runtime.plansource import PlanBook
from pipeshard.runtime.step import Step
from pipeshard.runtime.text import TextCodec

# Every kind of device graph, from the session's exports: (name, weights' dtype) -> what it shows.
DEVICE_GRAPH_KINDS = {
    ("tiny:llama", "fp32"): "dense",
    ("tiny:moe", "fp32"): "MoE: router and one graph per expert",
    ("tiny:llama", "fp16"): "half-precision weights (Casts to float32)",
    ("tiny:smolvlm", "fp32"): "VLM: vision blocks (fused Attention) beside the decoder",
    ("tiny:qwen2_5_vl", "fp32"): "Qwen2.5-VL: windowed vision attention, M-RoPE decoder",
}


def device_graphs(pack: Path) -> dict[str, onnx.ModelProto]:
    """The graphs a pack runs on a device: its sub-layers' and vision blocks' weights-as-inputs files."""
    loaded = load_pack(pack)
    vision = loaded.manifest.vision.sub_layers if loaded.manifest.vision else ()
    return {
        entry.name: onnx.load(loaded.path(entry.files["weights_as_inputs"]), load_external_data=False)
        for entry in (*loaded.manifest.sub_layers, *vision)
        if entry.kind not in HOST_ONLY_KINDS
    }


def cuda_gaps(pack: Path, table: KernelTable) -> list[Missing]:
    return [
        missing
        for name, graph in device_graphs(pack).items()
        for missing in missing_kernels(graph, name, table)
    ]


def half_attention_pack(export: Path, folder: Path) -> Path:
    """EXPORT as `--attention-dtype fp16` writes it (its fused graph through the exporter's attention_in_half),
    partitioned into FOLDER/pack. Copied, not hard-linked: onnx refuses external data with several links."""
    copy = folder / "export"
    copy.mkdir(parents=True)
    for path in export.iterdir():
        if path.is_file():
            shutil.copyfile(path, copy / path.name)
    info = json.loads((export / "export.json").read_text())
    model_file = copy / info["model_file"]
    model = onnx.load(model_file, load_external_data=False)
    assert attention_in_half(model) > 0
    onnx.save(model, model_file)
    info["attention_dtype"] = "fp16"
    info["files"][model_file.name] = {"bytes": model_file.stat().st_size, "sha256": sha256_file(model_file)}
    (copy / "export.json").write_text(json.dumps(info))
    partition(copy, folder / "pack")
    return folder / "pack"


@pytest.fixture(scope="module")
def table() -> KernelTable:
    if not TABLE.is_file():
        pytest.skip(
            f"no CUDA kernel table for onnxruntime-gpu {ONNXRUNTIME_GPU} at {TABLE}: `make install` fetches it "
            "(tests/ort_kernels.py needs PyPI, a C compiler and binutils)"
        )
    return KernelTable(json.loads(TABLE.read_text()))


def _planted(
    node: onnx.NodeProto, inputs: list[onnx.ValueInfoProto], opsets: dict[str, int]
) -> onnx.ModelProto:
    """A one-node graph whose outputs carry no declared type (as an exporter leaves com.microsoft ops)."""
    graph = helper.make_graph(
        [node], "planted", inputs, [helper.make_value_info(node.output[0], onnx.TypeProto())]
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()])


def _group_query_attention(element: int) -> onnx.ModelProto:
    tensors = [helper.make_tensor_value_info(n, element, None) for n in ("q", "k", "v", "past_k", "past_v")]
    lengths = [helper.make_tensor_value_info(n, TensorProto.INT32, None) for n in ("seqlens_k", "total")]
    node = helper.make_node(
        "GroupQueryAttention",
        ["q", "k", "v", "past_k", "past_v", "seqlens_k", "total"],
        ["out", "present_k", "present_v"],
        name="layers.0.attn",
        domain="com.microsoft",
        num_heads=4,
        kv_num_heads=2,
    )
    return _planted(node, tensors + lengths, {"": 21, "com.microsoft": 1})


def test_a_float32_matmul_has_a_cuda_kernel(table):
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 2]) for n in "ab"]
    model = _planted(helper.make_node("MatMul", ["a", "b"], ["y"], name="product"), inputs, {"": 21})
    assert missing_kernels(model, "planted", table) == []


def test_a_float32_group_query_attention_is_named(table):
    assert missing_kernels(_group_query_attention(TensorProto.FLOAT), "planted", table) == [
        Missing(
            "planted", "layers.0.attn", "com.microsoft::GroupQueryAttention", ("float",) * 5 + ("int32",) * 2
        )
    ]


def test_a_float16_group_query_attention_has_a_cuda_kernel(table):
    assert missing_kernels(_group_query_attention(TensorProto.FLOAT16), "planted", table) == []


def test_a_group_query_attention_given_a_bias_is_named(table):
    """ONNX Runtime's CUDA GQA kernel fails a run given an attention_bias (input 10)."""
    model = _group_query_attention(TensorProto.FLOAT16)
    node = model.graph.node[0]
    node.input.extend(["", "", "", "bias"])
    model.graph.input.append(helper.make_tensor_value_info("bias", TensorProto.FLOAT16, None))
    (missing,) = missing_kernels(model, "planted", table)
    assert (missing.node, missing.why) == ("layers.0.attn", BIAS_REFUSED)


def _one_hot(opset: int) -> onnx.ModelProto:
    inputs = [
        helper.make_tensor_value_info("indices", TensorProto.INT64, [3]),
        helper.make_tensor_value_info("depth", TensorProto.INT64, []),
        helper.make_tensor_value_info("values", TensorProto.FLOAT, [2]),
    ]
    node = helper.make_node("OneHot", ["indices", "depth", "values"], ["y"], name="one_hot")
    return _planted(node, inputs, {"": opset})


def test_a_kernel_serves_only_the_schema_versions_it_registers(table):
    """CUDA's OneHot kernels start at the opset-11 schema: at opset 10 the node runs opset 9's, which has none."""
    assert missing_kernels(_one_hot(11), "planted", table) == []
    assert missing_kernels(_one_hot(10), "planted", table) == [
        Missing("planted", "one_hot", "OneHot", ("int64", "int64", "float"))
    ]


def test_an_op_of_a_domain_without_cuda_kernels_is_named(table):
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])]
    node = helper.make_node("Unknown", ["x"], ["y"], name="custom", domain="pipeshard.test")
    missing = missing_kernels(_planted(node, inputs, {"": 21, "pipeshard.test": 1}), "planted", table)
    assert missing == [Missing("planted", "custom", "pipeshard.test::Unknown", ("float",))]


@pytest.fixture(scope="module", params=list(DEVICE_GRAPH_KINDS), ids=list(DEVICE_GRAPH_KINDS.values()))
def export_of_each_kind(request, models) -> Path:
    return models.export(*request.param)


def test_with_attention_in_half_every_device_node_of_every_kind_has_a_cuda_kernel(
    export_of_each_kind, table, tmp_path
):
    gaps = cuda_gaps(half_attention_pack(export_of_each_kind, tmp_path), table)
    assert gaps == [], "\n".join(map(str, gaps))


def test_with_attention_in_half_every_node_of_a_quantized_pack_has_a_cuda_kernel(tiny_gguf, table, tmp_path):
    _, export, _ = tiny_gguf
    gaps = cuda_gaps(half_attention_pack(export, tmp_path), table)
    assert gaps == [], "\n".join(map(str, gaps))


def test_with_attention_in_float32_the_cuda_ep_lacks_exactly_each_attention(tiny_pack, table):
    """What `--device cuda` refuses a default export for: its float32 GroupQueryAttention, one per layer."""
    gaps = cuda_gaps(Path(tiny_pack), table)
    assert {(gap.sub_layer, gap.op, gap.types[0]) for gap in gaps} == {
        (f"L{layer}.attn", "com.microsoft::GroupQueryAttention", "float") for layer in range(len(gaps))
    }


def device_engine(pack: Path, kernel_table: KernelTable | None) -> Engine:
    """PACK on a sim device with every placeable sub-layer streamed (each runs in its device session), its device
    graphs checked against KERNEL_TABLE at load as a cuda device checks them."""
    planner = Planner(load_pack(pack).manifest, load_profile("laptop-8gb"), context=128)
    budget = planner.minimum_budget() + 4_000_000
    placements = {u.name: Placement.STREAMED for u in planner.placeable}
    book = PlanBook([u.name for u in planner.units], source=planner, budget_bytes=budget, strategy="gpu-only")
    step = Step(pack, make_device("sim", budget, kernel_table=kernel_table), book)
    for tier in step.tiers:
        step.plans[tier] = planner.evaluate("gpu-only", tier, placements, budget)
    engine = Engine(step, TextCodec(pack), pack)
    engine.codec.eos_token_ids = []
    return engine


def test_a_device_refuses_a_graph_its_kernel_table_lacks_in_one_line_naming_the_node(tiny_pack, table):
    with pytest.raises(UserError) as refused:
        device_engine(Path(tiny_pack), table).generate(["hi"], max_new_tokens=2)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("L0.attn: node ") and "com.microsoft::GroupQueryAttention(float, " in message
    assert f"no CUDAExecutionProvider kernel in onnxruntime {ONNXRUNTIME_GPU}" in message


def test_a_device_checking_the_cuda_table_runs_every_sub_layer_of_a_half_attention_pack(models, table):
    pack = Path(models.pack("tiny:llama", attention="fp16"))
    chain = pipeshard.load(pack)
    chain.codec.eos_token_ids = []
    expected = chain.generate(["hi"], max_new_tokens=8)[0].tokens
    assert device_engine(pack, table).generate(["hi"], max_new_tokens=8)[0].tokens == expected


def _reshaped_by_shape(concatenated: bool) -> onnx.ModelProto:
    """y = Reshape(x, Shape(x)), or with the shape passed through a Concat first."""
    nodes = [helper.make_node("Shape", ["x"], ["shape"], name="shape")]
    if concatenated:
        nodes.append(helper.make_node("Concat", ["shape"], ["joined"], name="join", axis=0))
    nodes.append(helper.make_node("Reshape", ["x", nodes[-1].output[0]], ["y"], name="reshape"))
    graph = helper.make_graph(
        nodes,
        "shaped",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["a", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_a_shape_computation_the_cuda_ep_hands_to_the_cpu_is_named(table):
    """ONNX Runtime's CUDA EP places a Concat of Shape's output on the CPU EP (a session without CPU fallback
    refuses it); a Reshape reading Shape's output directly takes it on the CPU and stays on CUDA."""
    assert missing_kernels(_reshaped_by_shape(concatenated=False), "planted", table) == []
    assert missing_kernels(_reshaped_by_shape(concatenated=True), "planted", table) == [
        Missing("planted", "join", "Concat", ("int64",), SHAPE_ON_CPU)
    ]
