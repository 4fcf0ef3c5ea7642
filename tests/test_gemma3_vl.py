"""Gemma 3 multimodal from an HF folder (a tiny random Gemma3ForConditionalGeneration saved with its processor):
preprocessing bit-identical to transformers', the decoder's bidirectional attention within each image's tokens,
and greedy tokens equal to transformers' `generate` with one and two images on the export, the pack's CPU chain
and the simulated device at 25 % and 60 %."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from PIL import Image

import pipeshard
from pipeshard.core.errors import UserError

PROMPT = "What is in the picture?"
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    """The tiny model, and the HF folder it is saved to with its processor (what a user has)."""
    from pipeshard.exporter.gemma3_vl import build_tiny_gemma3_vl

    model, tokenizer, processor = build_tiny_gemma3_vl("gemma3_vl")
    folder = tmp_path_factory.mktemp("gemma3-hf")
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return model, processor, folder


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> list[Path]:
    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(7)
    paths = []
    for index, (width, height) in enumerate([(50, 37), (90, 61)]):
        paths.append(folder / f"image{index}.png")
        Image.fromarray((rng.random((height, width, 3)) * 255).astype(np.uint8)).save(paths[-1])
    return paths


@pytest.fixture(scope="module")
def gemma3_export(tiny_gemma3, tmp_path_factory) -> Path:
    from pipeshard.exporter import export_model

    out = tmp_path_factory.mktemp("gemma3-export") / "export"
    export_model(str(tiny_gemma3[2]), out, quiet=True)
    return out


@pytest.fixture(scope="module")
def gemma3_pack(gemma3_export, tmp_path_factory) -> Path:
    from pipeshard.partitioner.partition import partition

    out = tmp_path_factory.mktemp("gemma3-pack") / "pack"
    partition(gemma3_export, out)
    return out


def reference_tokens(
    tiny_gemma3, prompt_ids: list[int], paths: list[Path], image_attention: bool = True
) -> list[int]:
    """Gemma3ForConditionalGeneration.generate's greedy tokens for the same ids, the saved processor's pixels and
    token types (which turn on the bidirectional attention within each image; off without `image_attention`)."""
    import torch
    from transformers import AutoProcessor

    model, _, folder = tiny_gemma3
    processor = AutoProcessor.from_pretrained(folder)
    pixels = processor.image_processor(
        images=[Image.open(p).convert("RGB") for p in paths], return_tensors="pt"
    )
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=pixels["pixel_values"],
            token_type_ids=(ids == model.config.image_token_id).long() if image_attention else None,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
        )
    return out[0, len(prompt_ids) :].tolist()


def test_preprocessing_is_bit_identical_to_the_processor(tiny_gemma3, images):
    """The pixels of the runtime's numpy preprocessing equal the saved processor's, and the expanded prompt
    tokenizes to the processor's ids, for odd sizes, a grey and an RGBA image."""
    from transformers import AutoProcessor

    from pipeshard.exporter.image_processing import preprocessing_config
    from pipeshard.formats.image_preprocessing import read_image_preprocessing
    from pipeshard.runtime.images import expand_image_tokens, preprocess

    model, _, folder = tiny_gemma3
    processor = AutoProcessor.from_pretrained(folder)
    config = read_image_preprocessing(
        preprocessing_config(processor.image_processor, model.config, processor.tokenizer), "gemma3"
    )
    rng = np.random.default_rng(3)
    pictures = [Image.open(p) for p in images] + [
        Image.fromarray((rng.random((17, 45)) * 255).astype(np.uint8), "L"),
        Image.fromarray((rng.random((40, 33, 4)) * 255).astype(np.uint8), "RGBA"),
    ]
    ours = preprocess(pictures, config)
    theirs = processor.image_processor(images=pictures, return_tensors="np")
    assert ours.pixel_values.dtype == np.float32
    assert np.array_equal(ours.pixel_values, theirs["pixel_values"])
    text = "Look <start_of_image> and <start_of_image>"
    expanded = expand_image_tokens(text, preprocess(pictures[:2], config), config)
    reference = processor(text=[text], images=[pictures[:2]], return_tensors="np")
    assert processor.tokenizer(expanded)["input_ids"] == reference["input_ids"][0].tolist()


def test_the_image_attention_changes_the_tiny_models_tokens(tiny_gemma3, images):
    """What makes the token comparisons below able to fail: with causal attention alone over the image tokens,
    transformers' greedy tokens differ for one image and for two."""
    _, processor, _ = tiny_gemma3
    for paths in (images[:1], images):
        text = "<start_of_image>" * len(paths) + PROMPT
        ids = processor(text=[text], images=[[Image.open(p) for p in paths]])["input_ids"][0]
        assert reference_tokens(tiny_gemma3, ids, paths) != reference_tokens(tiny_gemma3, ids, paths, False)


def test_image_masks_equal_transformers_masks(tiny_gemma3):
    """The masks the exported decoder makes from the ids are transformers' own for a left-padded batch with two
    images, one longer than the sliding window reaches, and for a step after a past."""
    import torch
    from transformers.models.gemma3.modeling_gemma3 import (
        create_masks_for_vision_model,
        get_block_sequence_ids_for_mask,
    )

    from pipeshard.exporter.gemma3_vl import image_block_masks

    model = tiny_gemma3[0]
    image = model.config.image_token_id
    text = model.config.text_config
    ids = torch.tensor([[5, 6] + [image] * 18 + [7] + [image] * 3 + [8], [0] * 3 + [5] + [image] * 20 + [9]])
    attention = torch.ones_like(ids)
    attention[1, :3] = 0
    embeds = torch.zeros(*ids.shape, text.hidden_size)
    ours = image_block_masks(ids, attention, image, text.sliding_window)
    theirs = create_masks_for_vision_model(
        config=text,
        inputs_embeds=embeds,
        attention_mask=attention,
        cache=None,
        position_ids=None,
        block_sequence_ids=get_block_sequence_ids_for_mask((ids == image).long()),
    )
    for kind in ("full_attention", "sliding_attention"):
        assert torch.equal(ours[kind], theirs[kind]), kind
    assert ours["full_attention"][0, 0].triu(1).any()  # image tokens see later ones


@pytest.mark.slow  # exports the HF folder
def test_export_keeps_image_attention_in_the_fused_mask(gemma3_export):
    info = json.loads((gemma3_export / "export.json").read_text())
    vision = info["vision"]
    assert vision["preprocessing"]["family"] == "gemma3" and vision["bidirectional_image_runs"]
    assert vision["tokens_per_tile"] == 16 and vision["max_difference_vs_pytorch"] < 1e-4
    graph = onnx.load(gemma3_export / "model.onnx", load_external_data=False).graph
    attentions = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert len(attentions) == 4
    for node in attentions:
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attributes["causal"] == 0 and "local_window_size" not in attributes and node.input[10]


@pytest.mark.slow  # exports the HF folder
@pytest.mark.parametrize("where", ["export", "pack", "sim-25%", "sim-60%"])
def test_tokens_equal_transformers_with_one_and_two_images(
    where, gemma3_export, gemma3_pack, images, tiny_gemma3
):
    if where == "export":
        engine = pipeshard.load(gemma3_export)
    elif where == "pack":
        engine = pipeshard.load(gemma3_pack)
    else:
        engine = pipeshard.load(gemma3_pack, device="sim", vram=where.split("-")[1], profile="laptop-8gb")
    for paths in (images[:1], images):
        (result,) = engine.generate(PROMPT, images=[str(p) for p in paths], max_new_tokens=NEW_TOKENS)
        assert len(result.tokens) == NEW_TOKENS
        assert result.tokens == reference_tokens(tiny_gemma3, result.prompt_tokens, paths)
    if where.startswith("sim"):
        vision = engine.vision  # the planner's placement of the vision blocks ran, under the budget
        assert vision.last_plan is not None
        assert vision.peak_device_bytes <= engine.step.device.ledger.budget_bytes


@pytest.mark.slow  # exports the HF folder
def test_a_batch_of_prompts_with_other_images_gives_each_its_tokens(gemma3_pack, images, tiny_gemma3):
    """Left padding: the shorter prompt's padded columns are masked, its image runs found in its own row."""
    engine = pipeshard.load(gemma3_pack)
    results = engine.generate(
        [PROMPT, "Compare them."],
        images=[[str(images[1])], [str(p) for p in images]],
        max_new_tokens=NEW_TOKENS,
    )
    for result, paths in zip(results, [images[1:], images], strict=True):
        assert result.tokens == reference_tokens(tiny_gemma3, result.prompt_tokens, paths)


@pytest.mark.slow  # exports the HF folder
def test_prefill_chunks_keep_each_image_whole(gemma3_pack, images, tiny_gemma3):
    """Tiers of at most 24 tokens: the chunks end before an image's 16 tokens rather than inside them (the
    tokens equal transformers'); at most 8, an image's run fits no chunk: one error naming it."""
    engine = pipeshard.load(gemma3_pack, device="sim", vram="60%", profile="laptop-8gb")
    engine.step.tiers = [1, 24]
    (result,) = engine.generate(PROMPT, images=[str(p) for p in images], max_new_tokens=NEW_TOKENS)
    assert len(result.prompt_tokens) > 2 * 24
    assert result.tokens == reference_tokens(tiny_gemma3, result.prompt_tokens, images)
    engine.step.tiers = [1, 8]
    with pytest.raises(UserError, match="run of 16 tokens does not fit a prefill chunk of 8"):
        engine.generate(PROMPT, images=[str(images[0])], max_new_tokens=2)


def test_pan_and_scan_is_refused_with_one_line(tiny_gemma3):
    from pipeshard.exporter.gemma3_vl import check_gemma3_vl

    model, processor, _ = tiny_gemma3
    processor.image_processor.do_pan_and_scan = True
    try:
        with pytest.raises(UserError, match="pan-and-scan"):
            check_gemma3_vl(model, processor.image_processor, "folder")
    finally:
        processor.image_processor.do_pan_and_scan = None


def test_half_attention_is_refused_with_one_line(tmp_path):
    """float16 attention's device graphs drop the attention bias, where the image runs' mask lives."""
    from pipeshard.exporter import export_model

    with pytest.raises(UserError, match="attention within an image's tokens needs the mask"):
        export_model("tiny:gemma3_vl", tmp_path / "out", quiet=True, attention_dtype="fp16")


def test_chunk_ends_move_before_an_image_run():
    from pipeshard.runtime.kv import chunk_end

    ids = [1, 2, 9, 9, 9, 9, 3, 9, 9, 4]
    assert chunk_end(ids, 0, 4, 9) == 2  # would end inside the first run: ends before it
    assert chunk_end(ids, 2, 4, 9) == 6  # the run fits whole
    assert chunk_end(ids, 6, 2, 9) == 7  # before the second run
    assert chunk_end(ids, 0, 4, None) == 4  # models without image attention cut anywhere
    assert chunk_end(ids, 8, 4, 9) == 10
    with pytest.raises(UserError, match="run of 4 tokens does not fit a prefill chunk of 3"):
        chunk_end(ids, 2, 3, 9)
