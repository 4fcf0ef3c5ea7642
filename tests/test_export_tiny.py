"""tiny:llama end to end in seconds: export files, node attribution, ONNX tokenizer, generation."""

import json

import numpy as np
import onnx
import pytest
import torch

import pipeshard
from pipeshard.core.fsutil import sha256_file
from pipeshard.exporter.tiny import build_tiny_model
from pipeshard.formats.io_names import module_path
from pipeshard.partitioner.rules import DECODER_RULES, sub_layer_candidates


def test_export_writes_the_documented_files(tiny_llama_export):
    names = {p.name for p in tiny_llama_export.iterdir()}
    assert {
        "model.onnx",
        "model.onnx.data",
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer.onnx",
        "detokenizer.onnx",
        "export.json",
        "generation_config.json",
    } <= names
    info = json.loads((tiny_llama_export / "export.json").read_text())
    assert info["schema_version"] == 2 and info["architecture"] == "llama" and info["dtype"] == "fp32"
    assert info["dims"]["num_layers"] == 4 and info["dims"]["num_key_value_heads"] == 2
    assert info["max_logit_difference_vs_pytorch"] < 1e-3
    for name, entry in info["files"].items():
        assert sha256_file(tiny_llama_export / name) == entry["sha256"], name
    # its own staging folder is gone (another pytest worker may be exporting beside it in the shared cache)
    assert not list(tiny_llama_export.parent.glob(f".{tiny_llama_export.name}.partial-*"))


def test_weights_are_external_data(tiny_llama_export):
    model = onnx.load(tiny_llama_export / "model.onnx", load_external_data=False)
    large = [t for t in model.graph.initializer if np.prod(t.dims) >= 1024]
    assert large and all(t.data_location == onnx.TensorProto.EXTERNAL for t in large)


def test_every_layer_node_maps_to_exactly_one_of_attention_mlp_or_residual_glue(tiny_llama_export):
    model = onnx.load(tiny_llama_export / "model.onnx", load_external_data=False)
    per_layer = {}
    for node in model.graph.node:
        path = module_path(node)
        assert path is not None, f"node {node.name} ({node.op_type}) carries no module path"
        if ".layers." not in path:
            continue
        candidates = sub_layer_candidates(path, DECODER_RULES)
        assert len(candidates) == 1, f"{node.name} at {path} matches {candidates}"
        layer, part = candidates[0].split(".")
        per_layer.setdefault(layer, set()).add(part)
    assert per_layer == {f"L{i}": {"attn", "ffn", "glue"} for i in range(4)}


@pytest.mark.parametrize("architecture", ["llama", "gemma3", "moe"])
def test_the_trace_holds_layer_0_and_one_layer_of_each_kind(architecture):
    from pipeshard.exporter.layer_copies import layer_plan

    model, _ = build_tiny_model(architecture)
    plan = layer_plan(model)
    kinds = getattr(model.config, "layer_types", None) or ["layer"] * model.config.num_hidden_layers
    assert plan.template[: plan.traced] == tuple(range(plan.traced))
    assert all(kinds[i] == kinds[j] and 1 <= j < plan.traced for i, j in enumerate(plan.template) if i != j)
    assert set(kinds[1 : plan.traced]) == set(kinds[1:]) and plan.traced < len(kinds)


def test_copied_layers_have_their_templates_nodes_and_their_own_weights(tiny_llama_export):
    model = onnx.load(tiny_llama_export / "model.onnx", load_external_data=False)
    weights = {t.name for t in model.graph.initializer if np.prod(t.dims) >= 1024}
    ops, reads = {}, {}
    for node in model.graph.node:
        path = module_path(node)
        layer = path.split(".layers.")[1].split(".")[0] if path and ".layers." in path else None
        if layer is not None:
            ops.setdefault(layer, []).append(node.op_type)
            reads.setdefault(layer, set()).update(name for name in node.input if name in weights)
    assert ops["1"] == ops["2"] == ops["3"]  # layer 0 is traced, 1 stands for 2 and 3
    assert all(reads[a].isdisjoint(reads[b]) for a in reads for b in reads if a < b)
    assert all(len(reads[layer]) == len(reads["1"]) for layer in reads)


def test_onnx_tokenizer_matches_the_tokenizers_library(tiny_llama_export):
    check = json.loads((tiny_llama_export / "export.json").read_text())["onnx_tokenizer_check"]
    assert check["matched"] == check["strings"] > 0


def test_onnx_logits_match_pytorch_over_prefill_and_decode(tiny_llama_export):
    from pipeshard.runtime.monolithic import MonolithicStep

    model, _ = build_tiny_model("llama")
    step = MonolithicStep(tiny_llama_export)
    ids = np.array([[5, 17, 99, 3, 42, 7]], dtype=np.int64)
    step.start(1)
    prefill = step.forward(ids[:, :4], np.ones((1, 4), np.int64), np.arange(4)[None])
    decode = step.forward(ids[:, 4:], np.ones((1, 6), np.int64), np.arange(4, 6)[None])
    with torch.no_grad():
        reference = model(torch.from_numpy(ids)).logits.numpy()
    assert np.abs(np.concatenate([prefill, decode], axis=1) - reference).max() < 1e-4


def test_greedy_generation_matches_transformers(tiny_llama_export):
    engine = pipeshard.load(tiny_llama_export)
    model, tokenizer = build_tiny_model("llama")
    prompt_ids = engine.generator.prompt_ids("Tell me a story about a robot.")
    (ours,) = engine.generator.generate([prompt_ids], pipeshard.api.SamplingSettings(max_new_tokens=24))
    with torch.no_grad():
        output = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=24,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    theirs = [t for t in output[0, len(prompt_ids) :].tolist() if t not in engine.codec.eos_token_ids]
    assert ours.tokens == theirs[: len(ours.tokens)] and len(ours.tokens) > 0


def test_a_batch_of_different_lengths_gives_each_prompt_its_solo_tokens(tiny_llama_export):
    engine = pipeshard.load(tiny_llama_export)
    prompts = ["Hi", "What is the capital of France, and why is it famous?", "Count: 1 2 3"]
    solo = [engine.generate(p, max_new_tokens=12)[0].tokens for p in prompts]
    batched = [g.tokens for g in engine.generate(prompts, max_new_tokens=12)]
    assert batched == solo


def test_streaming_pieces_add_up_to_the_text(tiny_llama_export):
    engine = pipeshard.load(tiny_llama_export)
    results = []
    pieces = [event.text for event in engine.stream("Hello", results=results, max_new_tokens=16)]
    assert "".join(pieces) == results[0].text


def test_stop_string_cuts_the_text(tiny_llama_export):
    engine = pipeshard.load(tiny_llama_export)
    full = engine.generate("Hello", max_new_tokens=16)[0].text
    if len(full) < 4:
        pytest.skip("the random model answered too briefly to cut")
    stop = full[2:4]
    cut = engine.generate("Hello", max_new_tokens=16, stop_strings=(stop,))[0]
    assert cut.stop_reason == "stop_string" and cut.text == full[: full.find(stop)]


def test_fp16_export_runs_on_the_cpu_and_stays_close_to_fp32(tiny_llama_export, models):
    from pipeshard.runtime.monolithic import MonolithicStep

    ids = np.array([[5, 17, 99, 3]], dtype=np.int64)
    logits = []
    for folder in (tiny_llama_export, models.export("tiny:llama", "fp16")):
        step = MonolithicStep(folder)
        step.start(1)
        logits.append(step.forward(ids, np.ones_like(ids), np.arange(4)[None]).astype(np.float32))
    assert np.abs(logits[0] - logits[1]).max() < 0.1
    assert (logits[0].argmax(-1) == logits[1].argmax(-1)).all()


def test_the_logit_check_is_float32_rounding_at_any_logit_size():
    """Absolute for small logits, relative to the largest for large ones (a deep model's logits run to hundreds and
    its float32 sums drift with them); float16 attention by its own relative bound."""
    from pipeshard.exporter.export import logit_tolerance

    assert logit_tolerance("fp32", 5.0) == 1e-3
    assert logit_tolerance("fp32", 205.0) == pytest.approx(0.0205)
    assert logit_tolerance("fp16", 64.0) == pytest.approx(1.0)
