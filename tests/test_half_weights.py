"""fp16 and bf16 exports: weights stored in half precision, computed in float32, the greedy tokens of PyTorch over the
same weights; on the CPU chain read as stored (no float32 copy), on the simulated device too."""

import json
from dataclasses import replace

import numpy as np
import onnx
import pytest
import torch

import pipeshard
from pipeshard.exporter.sources import load_source, resolve_source
from pipeshard.formats.manifest import Cost, SubLayer, Weight, load_pack
from pipeshard.partitioner.estimator import Estimator
from pipeshard.partitioner.planner import Planner
from pipeshard.profiles.db import load_profile
from pipeshard.runtime import capi
from pipeshard.runtime.joined import join
from pipeshard.runtime.step import Step
from pipeshard.runtime.weight_matmul import product_weights

PROMPTS = ["Hi", "What is the capital of France, and why is it famous?", "Count: 1 2 3"]
TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
NEW_TOKENS = 12


@pytest.fixture(scope="module", params=["fp16", "bf16"])
def half(request, models):
    """(dtype, export folder, pack folder) of tiny:llama in that dtype."""
    return request.param, models.export("tiny:llama", request.param), models.pack("tiny:llama", request.param)


@pytest.fixture(scope="module")
def pytorch_tokens(half):
    """Greedy tokens of transformers over the model's weights rounded to the dtype, computed in float32."""
    dtype, export, _ = half
    model = load_source(resolve_source("tiny:llama"), TORCH_DTYPES[dtype]).model.float()
    engine = pipeshard.load(export)
    eos = set(engine.codec.eos_token_ids)
    tokens = []
    for prompt in PROMPTS:
        ids = engine.generator.prompt_ids(prompt)
        with torch.no_grad():
            output = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        theirs = output[0, len(ids) :].tolist()
        tokens.append(theirs[: next((i for i, t in enumerate(theirs) if t in eos), len(theirs))])
    return tokens


def _tokens(engine) -> list[list[int]]:
    generator = engine.generator
    return [
        generator.generate(
            [generator.prompt_ids(p)], pipeshard.api.SamplingSettings(max_new_tokens=NEW_TOKENS)
        )[0].tokens
        for p in PROMPTS
    ]


def test_the_export_stores_the_products_and_embedding_in_the_dtype(half):
    dtype, export, pack = half
    info = json.loads((export / "export.json").read_text())
    assert (info["dtype"], info["compute_dtype"]) == (dtype, "fp32")
    model = onnx.load(export / "model.onnx", load_external_data=False)
    stored = {i.name: i.data_type for i in model.graph.initializer if len(i.dims) == 2}
    half_type = {"fp16": onnx.TensorProto.FLOAT16, "bf16": onnx.TensorProto.BFLOAT16}[dtype]
    assert stored["lm_head.weight"] == half_type and sum(t == half_type for t in stored.values()) >= 8
    manifest = load_pack(pack).manifest
    assert (manifest.model.dtype, manifest.model.compute_dtype) == (dtype, "fp32")
    fp32_bytes = sum(
        4 * int(np.prod(w.shape)) for e in manifest.sub_layers for w in e.weights if w.dtype != "float32"
    )
    assert manifest.total_weight_bytes < 0.6 * fp32_bytes + 2**20  # half the bytes (plus alignment)
    final = next(e for e in manifest.sub_layers if e.kind == "final")
    assert final.row_chunks and final.row_chunks.row_bytes == 2 * manifest.model.hidden_size


def test_the_export_and_the_chain_give_pytorchs_greedy_tokens(half, pytorch_tokens):
    _, export, pack = half
    assert _tokens(pipeshard.load(export)) == pytorch_tokens
    assert _tokens(pipeshard.load(pack)) == pytorch_tokens


@pytest.mark.skipif(
    not capi.custom_ops_available(), reason="the C extension (and with it the op) was not built"
)
def test_the_chain_reads_the_stored_weights_and_computes_what_the_casts_do(half):
    _, _, pack = half
    entry = next(e for e in load_pack(pack).sub_layers if e.kind == "ffn")
    weights = product_weights(entry.weights, float_weights=False)
    swapped = join([pack / entry.files["onnx"]], {o.name for o in entry.outputs}, product_weights=weights)
    ops = [node.op_type for node in onnx.load_from_string(swapped.model).graph.node]
    assert swapped.weight_matmul_nodes == 2 and ops.count("WeightMatMul") == 2 and "Cast" not in ops
    ids = np.array([[5, 17, 99, 3]], dtype=np.int64)
    logits = []
    for step in (
        Step(pack, threads=1),
        Step(pack, threads=1, weight_matmul=False),
    ):  # the op; ORT's Cast + MatMul
        step.start(1)
        prompt = step.forward(ids, np.ones_like(ids), np.arange(4)[None]).copy()
        decode = step.forward(np.array([[7]]), np.ones((1, 5), np.int64), np.array([[4]])).copy()
        logits.append((prompt, decode))
    for ours, theirs in zip(logits[0], logits[1], strict=True):
        np.testing.assert_allclose(ours, theirs, atol=1e-4)


def test_every_plan_on_the_simulated_device_gives_pytorchs_greedy_tokens(half, pytorch_tokens):
    _, _, pack = half
    minimum = Planner(load_pack(pack).manifest, load_profile("laptop-8gb")).minimum_budget()
    for plan in ("auto", "layers", "offload"):
        engine = pipeshard.load(
            pack, vram=minimum + 600_000, device="sim", profile="laptop-8gb", plan=plan, context=256
        )
        assert _tokens(engine) == pytorch_tokens, plan


def test_the_estimator_reads_each_weight_in_its_dtype_at_the_profiles_rate_for_it(half):
    _, _, pack = half
    model = load_pack(pack).model
    profile = load_profile("laptop-8gb")

    def decode_seconds(dtype: str, weight_read_gbps: dict | None = None) -> float:
        threads = {
            count: replace(rates, weight_read_gbps=weight_read_gbps)
            for count, rates in profile.cpu.threads.items()
        }
        measured = replace(profile, cpu=replace(profile.cpu, threads=threads))
        weight = Weight("w", (4096, 4096), dtype, "w.bin", 0, 0)
        entry = SubLayer("ffn", "ffn", 0, {}, None, (weight,), 0, (), (), None, Cost({}, {}), 0)
        return Estimator(measured, model, threads=1).compute_seconds(entry, 1, 1, on_device=False)

    fp32 = decode_seconds("float32")
    half_bytes = decode_seconds({"fp16": "float16", "bf16": "bfloat16"}[model.dtype])
    assert half_bytes == pytest.approx(fp32 / 2, rel=0.05)  # memory-bound at one token: half the bytes
    read = profile.cpu.threads[1].memory_read_gbps
    slower = decode_seconds("bfloat16", {"fp16": read / 2, "bf16": read / 2})  # the measured rate, if any
    assert slower == pytest.approx(fp32, rel=0.05)


@pytest.mark.skipif(
    not capi.custom_ops_available(), reason="the C extension (and with it the op) was not built"
)
def test_fp32_weights_through_the_op_give_the_same_steps(tiny_pack):
    ids = np.array([[5, 17, 99, 3]], dtype=np.int64)
    logits = []
    for step in (Step(tiny_pack, threads=1, fp32_weight_matmul=True), Step(tiny_pack, threads=1)):
        step.start(1)
        prompt = step.forward(ids, np.ones_like(ids), np.arange(4)[None]).copy()
        decode = step.forward(np.array([[7]]), np.ones((1, 5), np.int64), np.array([[4]])).copy()
        logits.append((prompt, decode))
    for ours, theirs in zip(logits[0], logits[1], strict=True):
        np.testing.assert_allclose(ours, theirs, atol=1e-4)
