"""`--attention-dtype fp16`, the export a GPU runs: every attention and its KV cache in float16, the rest in float32.
Lossless there means: greedy tokens identical to transformers running the same weights with its attention in float16
(exporter/half_attention.py) on every plan (dense and MoE), logits within float16's tolerance, and KV bytes halved in
the pack and in the planner's VRAM figures (docs/precision.md)."""

from pathlib import Path

import numpy as np
import pytest
import torch

import pipeshard
from pipeshard.core.errors import UserError
from pipeshard.exporter.export import HALF_ATTENTION_RELATIVE_TOLERANCE
from pipeshard.exporter.half_attention import use_attention_dtype
from pipeshard.exporter.tiny import build_tiny_model
from pipeshard.formats.manifest import load_pack
from pipeshard.partitioner.planner import Planner
from pipeshard.profiles.db import load_profile

PROMPTS = ["Tell me a story about a robot.", "Count: 1 2 3 4 5 6 7 8 9 10 11 12"]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def half_pack(models) -> Path:
    return models.pack("tiny:llama", attention="fp16")


@pytest.fixture(scope="module")
def reference():
    """tiny:llama in transformers, its attention in float16."""
    model, _ = build_tiny_model("llama")
    return use_attention_dtype(model, "fp16")


def _transformers_tokens(model, prompt_ids: list[int]) -> list[int]:
    with torch.no_grad():
        output = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
    return output[0, len(prompt_ids) :].tolist()


@pytest.mark.parametrize("architecture", ["llama", "moe"])
def test_every_plan_gives_the_tokens_of_transformers_with_attention_in_float16(architecture, models):
    reference = use_attention_dtype(build_tiny_model(architecture)[0], "fp16")
    pack = models.pack(f"tiny:{architecture}", attention="fp16")
    engines = {
        "export": pipeshard.load(models.export(f"tiny:{architecture}", attention="fp16")),
        "chain": pipeshard.load(pack),
        "sim static": pipeshard.load(pack, vram="30%", device="sim", profile="laptop-8gb", plan="static"),
        "sim gpu-only": pipeshard.load(pack, vram="10%", device="sim", profile="laptop-8gb", plan="gpu-only"),
    }
    for engine in engines.values():
        engine.codec.eos_token_ids = []
    for prompt in PROMPTS:
        expected = _transformers_tokens(reference, engines["chain"].generator.prompt_ids(prompt))
        for kind, engine in engines.items():
            assert engine.generate(prompt, max_new_tokens=NEW_TOKENS)[0].tokens == expected, (kind, prompt)


def test_logits_are_within_float16_tolerance_of_transformers(half_pack, reference):
    step = pipeshard.load(half_pack).step
    step.all_logits = True
    ids = np.array([[(7 * i + 3) % 250 for i in range(24)]], np.int64)
    step.start(1, 64)
    logits = [
        step.forward(ids[:, start:stop], np.ones((1, stop), np.int64), np.arange(start, stop)[None])
        for start, stop in ((0, 20), (20, 21), (21, 24))
    ]
    with torch.no_grad():
        expected = reference(torch.from_numpy(ids)).logits.numpy()
    difference = np.abs(np.concatenate(logits, axis=1) - expected).max()
    assert difference <= HALF_ATTENTION_RELATIVE_TOLERANCE * np.abs(expected).max()


def test_the_kv_cache_is_float16_in_the_pack_and_in_the_planners_vram(half_pack, tiny_pack):
    half, full = load_pack(half_pack), load_pack(tiny_pack)
    assert half.model.kv_dtype == "fp16" and full.model.kv_dtype == "fp32"
    assert 2 * half.manifest.kv_bytes_per_token == full.manifest.kv_bytes_per_token
    attention = next(e for e in half.sub_layers if e.kind == "attn")
    assert {i.dtype for i in attention.inputs if i.name in attention.kv.past} == {"float16"}
    profile = load_profile("laptop-8gb")
    planners = [Planner(pack.manifest, profile, context=256) for pack in (half, full)]
    kv_cache = [sum(p.kv_bytes(e) for e in p.placeable) for p in planners]
    assert 2 * kv_cache[0] == kv_cache[1] > 0


def test_a_padded_batch_with_float16_attention_on_the_device_is_refused_in_one_line(models):
    """The device variant takes no padding mask (ONNX Runtime's CUDA GQA refuses an attention bias); the chain,
    whose graphs keep it, runs the batch."""
    pack = models.pack("tiny:llama", attention="fp16")
    prompts = ["Hi", "What is the capital of France, and why is it famous?"]
    assert all(g.tokens for g in pipeshard.load(pack).generate(prompts, max_new_tokens=4))
    engine = pipeshard.load(pack, vram="60%", device="sim", profile="laptop-8gb", plan="static")
    assert engine.step.book.plan_for(1).placements["L0.attn"] != "cpu"  # static pins attention first
    with pytest.raises(UserError) as refused:
        engine.generate(prompts, max_new_tokens=4)
    assert "\n" not in str(refused.value) and "on the device" in str(refused.value)


def test_a_vlm_gives_the_tokens_of_transformers_with_its_decoders_attention_in_float16(models, tmp_path):
    """tiny:smolvlm with `--attention-dtype fp16` (the decoder's attention and KV in float16; its vision blocks keep
    float32), one image, on the export, the chain and two plans on sim: transformers' greedy tokens with the same
    attention types, up to the first step whose top two logits are closer than float16's tolerance (a random tiny
    VLM's logits are nearly flat: there a rounding step may pick either)."""
    from PIL import Image
    from test_vlm import reference_output

    from pipeshard.exporter.vlm import build_tiny_vlm, image_processor_for

    model, _, processor = build_tiny_vlm("smolvlm")
    use_attention_dtype(model, "fp16")
    model.config.vision_config._attn_implementation = "sdpa"  # the vision blocks as the export keeps them
    image = tmp_path / "photo.png"
    Image.fromarray((np.random.default_rng(5).random((300, 500, 3)) * 255).astype(np.uint8)).save(image)
    pack = models.pack("tiny:smolvlm", attention="fp16")
    engines = {
        "export": pipeshard.load(models.export("tiny:smolvlm", attention="fp16")),
        "chain": pipeshard.load(pack),
        "sim static": pipeshard.load(pack, vram="30%", device="sim", profile="laptop-8gb", plan="static"),
        "sim gpu-only": pipeshard.load(pack, vram="10%", device="sim", profile="laptop-8gb", plan="gpu-only"),
    }
    results = {}
    for kind, engine in engines.items():
        engine.codec.eos_token_ids = []
        (results[kind],) = engine.generate(
            "Describe the image.", images=[str(image)], max_new_tokens=NEW_TOKENS
        )
    prompt_ids = results["chain"].prompt_tokens
    output = reference_output(
        (model, None, image_processor_for(processor)),
        prompt_ids,
        [image],
        max_new_tokens=NEW_TOKENS,
        output_scores=True,
        return_dict_in_generate=True,
    )
    expected = output.sequences[0, len(prompt_ids) :].tolist()
    decided = len(expected)
    for index, scores in enumerate(output.scores):
        top_two = torch.topk(scores[0], 2).values
        if top_two[0] - top_two[1] < HALF_ATTENTION_RELATIVE_TOLERANCE * scores[0].abs().max():
            decided = index + 1  # this step's token may differ; nothing after it can be compared
            break
    assert decided >= 6, decided
    for kind, result in results.items():
        assert result.prompt_tokens == prompt_ids, kind
        assert result.tokens[: decided - 1] == expected[: decided - 1], kind
