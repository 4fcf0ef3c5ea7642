"""The generic vision path (exporter/vision_tower.py): Hugging Face folders of tiny random LLaVA-style models, one
with a CLIP tower and one with a SigLIP tower, exported, partitioned and run with one and two images: greedy tokens
equal to transformers' `generate` on its own processor's pixels; preprocessing without torch bit-identical to the
towers' image processors; and one `error:` line naming what does not fit for folders that do not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import pipeshard
from pipeshard.core.errors import UserError
from pipeshard.formats.image_preprocessing import read_image_preprocessing
from pipeshard.formats.manifest import load_pack
from pipeshard.runtime import images as runtime_images

PROMPT = "What is in the picture?"
NEW_TOKENS = 12
TOWERS = {"clip": "llava", "siglip": "llava_siglip"}


def _save_folder(name: str, folder: Path, **config_changes) -> Path:
    """tiny NAME saved as transformers saves a model and its processor, with `config_changes` made to config.json."""
    from pipeshard.exporter.vision_tower import build_tiny

    model, processor = build_tiny(name)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    if config_changes:
        config = json.loads((folder / "config.json").read_text())
        for key, value in config_changes.items():
            if isinstance(value, dict):
                config[key] = {**config[key], **value}
            else:
                config[key] = value
        (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> list[Path]:
    """Two images of other sizes and aspect ratios than the towers' 32 px (landscape and portrait)."""
    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(7)
    paths = []
    for index, (width, height) in enumerate([(50, 37), (41, 90)]):
        paths.append(folder / f"image{index}.png")
        Image.fromarray((rng.random((height, width, 3)) * 255).astype(np.uint8)).save(paths[-1])
    return paths


@pytest.fixture(scope="module", params=sorted(TOWERS))
def exported(request, tmp_path_factory):
    """(tower, the folder's model and processor as transformers loads them, export, pack) for each tower."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from pipeshard.exporter import export_model
    from pipeshard.partitioner.partition import partition

    root = tmp_path_factory.mktemp(request.param)
    folder = _save_folder(TOWERS[request.param], root / "hf")
    export_model(str(folder), root / "export", quiet=True)
    partition(root / "export", root / "pack")
    model = LlavaForConditionalGeneration.from_pretrained(folder).eval()
    processor = AutoProcessor.from_pretrained(folder, use_fast=False)
    return request.param, model, processor, root / "export", root / "pack"


def reference_tokens(model, processor, prompt_ids: list[int], paths: list[Path]) -> list[int]:
    """transformers' greedy tokens for the same ids, the folder's own processor making the pixels."""
    import torch

    pixels = processor.image_processor(
        images=[Image.open(p).convert("RGB") for p in paths], return_tensors="pt"
    )
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        output = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=pixels["pixel_values"],
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
        )
    return output[0, len(prompt_ids) :].tolist()


@pytest.mark.slow  # exports a model of each tower from its folder
def test_export_describes_the_tower_the_config_selects(exported):
    tower, model, processor, export, pack = exported
    vision = json.loads((export / "export.json").read_text())["vision"]
    config = model.config
    assert vision["family"] == vision["preprocessing"]["family"] == "llava"
    assert vision["tower"] == config.vision_config.model_type
    assert vision["projector"] == {"kind": "mlp", "activation": config.projector_hidden_act}
    # CLIP: layer -2 of 3 keeps 2 layers, the class token dropped (16 patches); SigLIP: both layers, every row.
    assert (vision["num_layers"], vision["tokens_per_tile"]) == (2, 16)
    assert vision["max_difference_vs_pytorch"] < 1e-4
    names = [e.name for e in load_pack(pack).manifest.vision.sub_layers if e.name != "vision_prologue"]
    assert names == ["vision_embed", "V0.attn", "V0.ffn", "V1.attn", "V1.ffn", "projector"]


@pytest.mark.slow  # exports a model of each tower from its folder
@pytest.mark.parametrize("where", ["export", "pack", "sim-25%", "sim-60%"])
def test_tokens_equal_transformers_with_one_and_two_images(where, exported, images):
    _, model, processor, export, pack = exported
    if where == "export":
        engine = pipeshard.load(export)
    elif where == "pack":
        engine = pipeshard.load(pack)
    else:
        engine = pipeshard.load(pack, device="sim", vram=where.split("-")[1], profile="laptop-8gb")
    for paths in (images[:1], images):
        (result,) = engine.generate(PROMPT, images=[str(p) for p in paths], max_new_tokens=NEW_TOKENS)
        assert result.prompt_tokens.count(model.config.image_token_id) == 16 * len(paths)
        assert (
            result.tokens
            == reference_tokens(model, processor, result.prompt_tokens, paths)[: len(result.tokens)]
        )
        assert len(result.tokens) == NEW_TOKENS
    if where.startswith("sim"):
        assert engine.step.report().peak_device_bytes <= engine.step.device.ledger.budget_bytes
        assert engine.vision.peak_device_bytes <= engine.step.device.ledger.budget_bytes


# --- preprocessing without torch


def _processor(tower: str, **options):
    from transformers import CLIPImageProcessorPil, SiglipImageProcessorPil

    if tower == "clip":
        return CLIPImageProcessorPil(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}, **options
        )
    return SiglipImageProcessorPil(size={"height": 32, "width": 32}, **options)


@pytest.mark.parametrize("tower", sorted(TOWERS))
@pytest.mark.parametrize("size", [(50, 37), (41, 90), (32, 32), (7, 300), (3000, 17)])
def test_pixels_equal_the_towers_image_processor(tower, size):
    from pipeshard.exporter.image_processing import preprocessing_config
    from pipeshard.exporter.vision_tower import build_tiny

    model, _ = build_tiny(TOWERS[tower])
    processor = _processor(tower)
    config = read_image_preprocessing(preprocessing_config(processor, model.config), tower)
    rng = np.random.default_rng(sum(size))
    image = Image.fromarray((rng.random((size[1], size[0], 3)) * 255).astype(np.uint8))
    expected = processor(images=[image], return_tensors="np")["pixel_values"]
    ours = runtime_images.preprocess([image], config)
    assert ours.pixel_values.dtype == np.float32
    np.testing.assert_array_equal(ours.pixel_values, expected)
    assert ours.image_tokens == [16]


def test_a_crop_larger_than_the_resized_image_pads_as_the_processor_does():
    """CLIP's crop on an image left smaller than the crop (no resize): zeros around it, then normalized."""
    from pipeshard.exporter.image_processing import preprocessing_config
    from pipeshard.exporter.vision_tower import build_tiny

    model, _ = build_tiny("llava")
    processor = _processor("clip", do_resize=False)
    config = read_image_preprocessing(preprocessing_config(processor, model.config), "llava")
    image = Image.fromarray((np.random.default_rng(3).random((21, 27, 3)) * 255).astype(np.uint8))
    expected = processor(images=[image], return_tensors="np")["pixel_values"]
    np.testing.assert_array_equal(runtime_images.preprocess([image], config).pixel_values, expected)


# --- what does not fit: one line naming it


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"vision_config": {"model_type": "siglip2_vision_model"}}, "'siglip2_vision_model' vision tower"),
        ({"text_config": {"model_type": "gpt2"}}, "'gpt2' decoder"),
        ({"vision_feature_layer": [-2, -1]}, "vision_feature_layer [-2, -1] selects several layers"),
        ({"vision_feature_layer": -7}, "vision_feature_layer -7 is outside the tower's 3 layers"),
        ({"vision_feature_select_strategy": "cls"}, "'vision_feature_select_strategy'"),
    ],
)
def test_a_config_that_does_not_fit_is_refused_naming_what(changes, named, tmp_path):
    from pipeshard.exporter import export_model

    folder = _save_folder("llava", tmp_path / "hf", **changes)
    with pytest.raises(UserError, match=r"^" + str(folder).replace(".", r"\.") + ": ") as refused:
        export_model(str(folder), tmp_path / "out", quiet=True)
    assert named in str(refused.value) and "\n" not in str(refused.value)


def test_a_projector_with_a_norm_is_refused_naming_its_layers(tmp_path):
    """VipLLaVA's projector (a LayerNorm before the MLP) is not one the generic path knows, whatever its config
    says of the feature layer."""
    import torch
    from transformers import CLIPVisionConfig, VipLlavaConfig, VipLlavaForConditionalGeneration

    from pipeshard.exporter import export_model
    from pipeshard.exporter.tiny import TINY_CONFIGS, tiny_config
    from pipeshard.exporter.vision_tower import TINY_LLAVA_CONFIGS, build_tiny

    _, processor = build_tiny("llava")
    vision = dict(TINY_LLAVA_CONFIGS["llava"]["vision_config"])
    vision.pop("model_type")
    config = VipLlavaConfig(
        vision_config=CLIPVisionConfig(**vision),
        text_config=tiny_config(TINY_CONFIGS["llama"], processor.tokenizer),
        image_token_index=processor.tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_layers=[-2],
    )
    config.vision_feature_layer = -2
    config.vision_feature_select_strategy = "default"
    torch.manual_seed(0)
    folder = tmp_path / "vipllava"
    VipLlavaForConditionalGeneration(config).save_pretrained(folder)
    processor.save_pretrained(folder)
    with pytest.raises(UserError, match="projector .*LayerNorm, Linear, .*, Linear.* is not a projector"):
        export_model(str(folder), tmp_path / "out", quiet=True)


def test_a_model_computing_other_features_than_its_config_says_is_refused():
    """The tower built from the config is checked against transformers' own image features."""
    from pipeshard.exporter.vision_tower import build_tiny, check_against_transformers, vision_tower

    model, _ = build_tiny("llava")
    tower = vision_tower(model)  # layer -2, as the config said when it was built
    assert check_against_transformers(model, tower, "here") <= 1e-6
    model.config.vision_feature_layer = -1  # transformers now takes the last layer
    with pytest.raises(UserError, match="^here: transformers' image features differ"):
        check_against_transformers(model, tower, "here")


def test_the_cli_refuses_a_misfit_folder_in_one_error_line(tmp_path):
    folder = _save_folder("llava_siglip", tmp_path / "hf", vision_feature_layer=[0, 1])
    refused = subprocess.run(
        [sys.executable, "-m", "pipeshard", "export", str(folder), str(tmp_path / "out")],
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        f"error: {folder}: vision_feature_layer [0, 1] selects several layers; the generic vision path takes one"
    ]
