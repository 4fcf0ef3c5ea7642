"""The numpy + Pillow image preprocessing gives what transformers' processors give: the same pixels, tile
layout, patch grid and expanded prompt, and Qwen2.5-VL's window and rotary indices as its vision tower."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import (
    Idefics3ImageProcessorPil,
    Idefics3Processor,
    Qwen2_5_VLConfig,
    SmolVLMConfig,
    vision_utils,
)
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VisionTransformerPretrainedModel,
    Qwen2_5_VLModel,
)
from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor

from pipeshard.core.errors import UserError
from pipeshard.exporter.image_processing import preprocessing_config, qwen2_vl_image_processor
from pipeshard.exporter.tiny import build_byte_tokenizer
from pipeshard.formats import vision_inputs
from pipeshard.formats.image_preprocessing import read_image_preprocessing
from pipeshard.runtime import images

# (width, height): tiny, landscape, 4:3, 16:9, and a tall strip; saved alternately as PNG and JPEG.
IMAGE_SIZES = [(37, 53), (300, 200), (640, 480), (1280, 720), (50, 1500)]


def _synthetic_image(width: int, height: int, seed: int) -> Image.Image:
    """Seeded noise over per-channel gradients: every resampling filter tap matters."""
    rng = np.random.default_rng(seed)
    rows, cols = np.meshgrid(np.linspace(0, 1, height), np.linspace(0, 1, width), indexing="ij")
    gradients = np.stack([rows * 200 + cols * 40, cols * 220, (1 - rows) * (1 - cols) * 230], axis=-1)
    noise = rng.normal(0, 25, (height, width, 3))
    return Image.fromarray(np.clip(gradients + noise, 0, 255).astype(np.uint8))


@pytest.fixture(scope="module")
def image_paths(tmp_path_factory) -> list:
    folder = tmp_path_factory.mktemp("images")
    paths = []
    for index, (width, height) in enumerate(IMAGE_SIZES):
        path = folder / f"image{index}.{'png' if index % 2 == 0 else 'jpg'}"
        _synthetic_image(width, height, seed=index).save(path)
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def loaded(image_paths) -> list[Image.Image]:
    return [images.load_image(path) for path in image_paths]


@pytest.fixture(scope="module")
def image_tokenizer():
    """The tiny models' byte tokenizer with both families' image tokens: injective, so equal ids = equal text."""
    tokenizer = build_byte_tokenizer()
    grid = [f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7)]
    tokenizer.add_special_tokens(
        {
            "additional_special_tokens": [
                "<fake_token_around_image>",
                "<image>",
                "<global-img>",
                *grid,
                "<|vision_start|>",
                "<|image_pad|>",
                "<|vision_end|>",
            ]
        }
    )
    return tokenizer


# --- Idefics3 / SmolVLM


def _smolvlm_config(image_size: int, patch_size: int, scale_factor: int):
    return SmolVLMConfig(
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": image_size,
            "patch_size": patch_size,
        },
        text_config={
            "model_type": "llama",
            "hidden_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "intermediate_size": 64,
        },
        scale_factor=scale_factor,
    )


def _idefics3(longest_edge=128, tile=64, patch=16, scale=2, **processor_options):
    processor = Idefics3ImageProcessorPil(
        size={"longest_edge": longest_edge}, max_image_size={"longest_edge": tile}, **processor_options
    )
    return processor, read_image_preprocessing(
        preprocessing_config(processor, _smolvlm_config(tile, patch, scale)), "idefics3"
    )


def _check_idefics3(processor, config, image_list):
    """One prompt's images through both; pixels must be bit-identical (same filter, same float ops)."""
    expected = processor(images=[image_list], return_row_col_info=True, return_tensors="np")
    ours = images.preprocess(image_list, config)
    assert ours.pixel_values.dtype == np.float32
    assert ours.pixel_values.shape == expected["pixel_values"].shape[1:]
    np.testing.assert_array_equal(ours.pixel_values, expected["pixel_values"][0])
    assert ours.rows == expected["rows"][0] and ours.cols == expected["cols"][0]
    return ours


@pytest.mark.parametrize("index", range(len(IMAGE_SIZES)))
def test_idefics3_pixels_and_tiles_equal_the_transformers_processor(loaded, index):
    processor, config = _idefics3()
    ours = _check_idefics3(processor, config, [loaded[index]])
    tiles = ours.rows[0] * ours.cols[0] + 1 if ours.rows[0] else 1
    assert ours.pixel_values.shape[0] == tiles
    assert ours.image_tokens == [tiles * config.image_seq_len]


def test_idefics3_two_images_concatenate_their_tiles(loaded):
    processor, config = _idefics3()
    ours = _check_idefics3(processor, config, [loaded[1], loaded[4]])
    assert len(ours.rows) == 2 and sum(ours.image_tokens) == ours.pixel_values.shape[0] * config.image_seq_len


@pytest.mark.parametrize(
    "options", [{"do_image_splitting": False}, {"do_resize": False}], ids=["no-splitting", "no-first-resize"]
)
def test_idefics3_processor_options_are_followed(loaded, options):
    processor, config = _idefics3(**options)
    ours = _check_idefics3(processor, config, [loaded[0], loaded[2]])
    if "do_image_splitting" in options:
        assert ours.rows == [0, 0] and ours.pixel_values.shape[0] == 2


def test_idefics3_at_smolvlm_256m_sizes(loaded):
    """SmolVLM-256M's processor: longest edge 2048, 512 px tiles, 64 tokens a tile; a 1280x720 image is upscaled
    and cut into 4 x 3 tiles plus the global view, as transformers does."""
    processor, config = _idefics3(longest_edge=2048, tile=512, patch=16, scale=4)
    ours = _check_idefics3(processor, config, [loaded[3]])
    assert config.image_seq_len == 64
    assert (ours.rows, ours.cols, ours.image_tokens) == ([3], [4], [13 * 64])


def test_idefics3_prompt_expansion_equals_the_transformers_processor(loaded, image_tokenizer):
    processor, config = _idefics3()
    reference = Idefics3Processor(processor, image_tokenizer, image_seq_len=config.image_seq_len)
    for image_list, prompt in [
        ([loaded[2]], "<|im_start|>user\n<image>What is this?<|im_end|>\n"),
        ([loaded[0], loaded[4]], "Compare <image> and\n<image> please."),
    ]:
        ours = images.preprocess(image_list, config)
        expanded = images.expand_image_tokens(prompt, ours, config)
        expected = reference(text=prompt, images=image_list)
        assert image_tokenizer(expanded)["input_ids"] == expected["input_ids"][0]
        assert expanded.count("<image>") == sum(ours.image_tokens)
    unsplit = images.ImageInputs("idefics3", ours.pixel_values, [config.image_seq_len], rows=[0], cols=[0])
    assert images.expand_image_tokens("<image>", unsplit, config) == (
        "<fake_token_around_image><global-img>"
        + "<image>" * config.image_seq_len
        + "<fake_token_around_image>"
    )


# --- Qwen2-VL / Qwen2.5-VL


def _qwen_config(window_size=112, depth=2):
    return Qwen2_5_VLConfig(
        vision_config={
            "depth": depth,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 32,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": window_size,
            "fullatt_block_indexes": [depth - 1],
        },
        text_config={
            "hidden_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "intermediate_size": 64,
        },
    )


def _qwen(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64):
    model_config = _qwen_config()
    processor = qwen2_vl_image_processor(model_config, min_pixels=min_pixels, max_pixels=max_pixels)
    return processor, read_image_preprocessing(preprocessing_config(processor, model_config), "qwen2_vl")


def _check_qwen(processor, config, image_list):
    expected = processor(images=image_list, return_tensors="np")
    ours = images.preprocess(image_list, config)
    assert ours.pixel_values.dtype == np.float32
    np.testing.assert_array_equal(ours.pixel_values, expected["pixel_values"])
    np.testing.assert_array_equal(ours.image_grid_thw, expected["image_grid_thw"])
    assert ours.image_grid_thw.dtype == np.int64
    return ours


@pytest.mark.parametrize("index", range(len(IMAGE_SIZES)))
def test_qwen2_vl_patches_and_grid_equal_the_transformers_processor(loaded, index):
    processor, config = _qwen()
    ours = _check_qwen(processor, config, [loaded[index]])
    t, h, w = ours.image_grid_thw[0]
    assert ours.pixel_values.shape == (t * h * w, 3 * 2 * 14 * 14)
    assert ours.image_tokens == [t * h * w // 4]
    assert t * h * w * 14 * 14 <= config.max_pixels  # larger images are scaled down to what the model takes


def test_qwen2_vl_two_images_and_checkpoint_pixel_bounds(loaded):
    """Qwen2.5-VL's shipped bounds keep 640x480 and 1280x720 near native resolution."""
    processor, config = _qwen(min_pixels=56 * 56, max_pixels=16384 * 28 * 28)
    ours = _check_qwen(processor, config, [loaded[2], loaded[3]])
    assert ours.image_grid_thw.tolist() == [[1, 34, 46], [1, 52, 92]]


def test_qwen2_vl_prompt_expansion_equals_the_transformers_processor(loaded):
    processor, config = _qwen()
    # Building Qwen2_5_VLProcessor needs a video processor, which needs torchvision (not installable here):
    # its own replacement code runs on an instance given only what that code reads.
    reference = Qwen2_5_VLProcessor.__new__(Qwen2_5_VLProcessor)
    reference.image_processor, reference.image_token = processor, "<|image_pad|>"
    placeholder = images.image_placeholder(config)
    assert placeholder == "<|vision_start|><|image_pad|><|vision_end|>"
    for image_list in ([loaded[1]], [loaded[0], loaded[3]]):
        prompt = "<|im_start|>user\n" + "".join(
            f"Picture {i}: {placeholder}\n" for i in range(len(image_list))
        )
        _, replacements = reference._process_images(image_list)
        expected, _ = reference.get_text_with_replacements([prompt], images_replacements=replacements)
        ours = images.preprocess(image_list, config)
        assert images.expand_image_tokens(prompt, ours, config) == expected[0]


def _grid_cases(loaded):
    """Grids of real images plus edge cases: merged grids that divide the window evenly, and a 2-frame grid."""
    _, config = _qwen()
    from_images = images.preprocess(loaded, config).image_grid_thw
    edge = np.array([[1, 16, 16], [1, 8, 24], [2, 6, 10], [1, 2, 2]], dtype=np.int64)
    return [from_images, edge, np.concatenate([edge, from_images])]


def test_qwen2_5_vl_window_and_rotary_indices_equal_transformers(loaded):
    _, config = _qwen()
    for grid in _grid_cases(loaded):
        torch_grid = torch.from_numpy(grid)
        window_index, cu_window = vision_inputs.vision_window_index(grid, config.to_json())
        expected_index, expected_cu = vision_utils.get_vision_window_index(
            torch_grid, spatial_merge_size=2, window_size=config.window_size, patch_size=14
        )
        np.testing.assert_array_equal(window_index, expected_index.numpy())
        np.testing.assert_array_equal(cu_window, expected_cu.numpy())
        assert window_index.dtype == np.int64 and cu_window.dtype == np.int32
        cu_full = vision_inputs.cu_seqlens(grid)
        np.testing.assert_array_equal(cu_full, vision_utils.get_vision_cu_seqlens(torch_grid).numpy())
        assert cu_full.dtype == np.int32
        positions = vision_inputs.rotary_position_ids(grid, 2)
        np.testing.assert_array_equal(positions, vision_utils.get_vision_position_ids(torch_grid, 2).numpy())


def test_qwen2_5_vl_vision_tower_gives_the_same_features_from_our_indices(loaded):
    """The vision tower's own forward, once computing its indices and once handed ours, as the ONNX graph is."""
    model_config = _qwen_config()
    processor, config = _qwen()
    torch.manual_seed(0)
    tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(model_config.vision_config).eval()
    ours = images.preprocess([loaded[1], loaded[4]], config)
    window_index, cu_window = vision_inputs.vision_window_index(ours.image_grid_thw, config.to_json())
    pixels, grid = torch.from_numpy(ours.pixel_values), torch.from_numpy(ours.image_grid_thw)
    with torch.no_grad():
        expected = tower(pixels, grid).pooler_output
        given = tower(
            pixels,
            grid,
            window_index=torch.from_numpy(window_index),
            cu_window_seqlens=torch.from_numpy(cu_window),
            cu_seqlens=torch.from_numpy(vision_inputs.cu_seqlens(ours.image_grid_thw)),
            position_ids=torch.from_numpy(vision_inputs.rotary_position_ids(ours.image_grid_thw, 2)),
        ).pooler_output
    assert given.shape[0] == sum(ours.image_tokens)
    torch.testing.assert_close(given, expected, rtol=0, atol=0)


def test_qwen2_vl_refuses_an_image_too_elongated_for_the_model():
    _, config = _qwen()
    with pytest.raises(UserError, match="too elongated"):
        images.preprocess([Image.new("RGB", (2010, 10))], config)


# --- the recorded config and its checks


def test_preprocessing_config_is_plain_json_with_what_the_runtime_needs(image_tokenizer):
    processor, _ = _idefics3()
    model_config = _smolvlm_config(64, 16, 2)
    model_config.image_token_id = image_tokenizer.convert_tokens_to_ids("<image>")
    config = preprocessing_config(processor, model_config, tokenizer=image_tokenizer)
    assert json.loads(json.dumps(config)) == config
    assert (config["family"], config["resample"], config["image_seq_len"], config["max_image_size"]) == (
        "idefics3",
        "LANCZOS",
        4,
        64,
    )
    assert config["token_ids"]["<image>"] == image_tokenizer.convert_tokens_to_ids("<image>")
    assert "<row_2_col_2>" in config["token_ids"]

    model_config = _qwen_config()
    model_config.image_token_id = image_tokenizer.convert_tokens_to_ids("<|image_pad|>")
    qwen = preprocessing_config(
        qwen2_vl_image_processor(model_config), model_config, tokenizer=image_tokenizer
    )
    assert json.loads(json.dumps(qwen)) == qwen
    assert (qwen["family"], qwen["resample"], qwen["window_size"], qwen["fullatt_block_indexes"]) == (
        "qwen2_vl",
        "BICUBIC",
        112,
        [1],
    )
    assert (qwen["min_pixels"], qwen["max_pixels"], qwen["merge_size"]) == (3136, 12845056, 2)


def test_preprocessing_config_refuses_a_processor_that_does_not_fit_the_model(image_tokenizer):
    processor = Idefics3ImageProcessorPil(size={"longest_edge": 128}, max_image_size={"longest_edge": 64})
    with pytest.raises(ValueError, match="tiles are 64 px"):
        preprocessing_config(processor, _smolvlm_config(32, 8, 2))
    model_config = _qwen_config()
    wrong_patch = qwen2_vl_image_processor(model_config)
    wrong_patch.patch_size = 16
    with pytest.raises(ValueError, match="patch_size"):
        preprocessing_config(wrong_patch, model_config)
    with pytest.raises(
        ValueError, match="image_token_id"
    ):  # 151655 is not the byte tokenizer's <|image_pad|>
        preprocessing_config(qwen2_vl_image_processor(model_config), model_config, tokenizer=image_tokenizer)


def test_a_pack_of_another_schema_or_a_prompt_with_the_wrong_image_count_is_a_user_error(loaded):
    _, config = _idefics3()
    ours = images.preprocess([loaded[0]], config)
    with pytest.raises(UserError, match="2 image placeholder"):
        images.expand_image_tokens("<image><image>", ours, config)
    with pytest.raises(UserError, match="schema_version 99"):
        read_image_preprocessing({**config.to_json(), "schema_version": 99}, "manifest.json")
    with pytest.raises(UserError, match="family"):
        read_image_preprocessing({**config.to_json(), "family": "pixtral"}, "manifest.json")
    with pytest.raises(UserError, match=r"manifest.json: vision.preprocessing.image_seq_len is missing"):
        document = {k: v for k, v in config.to_json().items() if k != "image_seq_len"}
        read_image_preprocessing(document, "manifest.json", "vision.preprocessing")
    with pytest.raises(UserError, match="do_resize must be true or false"):
        read_image_preprocessing({**config.to_json(), "do_resize": "yes"}, "manifest.json")
    with pytest.raises(UserError, match="image_sequence_length is not a known field"):
        read_image_preprocessing({**config.to_json(), "image_sequence_length": 4}, "manifest.json")
    assert read_image_preprocessing(config.to_json(), "manifest.json") == config


# --- loading


def test_load_image_errors_name_the_file(tmp_path):
    text_file = tmp_path / "notes.png"
    text_file.write_text("not an image\n")
    truncated = tmp_path / "cut.png"
    _synthetic_image(64, 64, seed=9).save(tmp_path / "whole.png")
    truncated.write_bytes((tmp_path / "whole.png").read_bytes()[:200])
    cases = [
        (tmp_path / "missing.jpg", "not found"),
        (text_file, "not an image file"),
        (tmp_path, "is a directory"),
        (truncated, "cannot read image"),
    ]
    for path, message in cases:
        with pytest.raises(UserError, match=message) as raised:
            images.load_image(path)
        assert str(path) in str(raised.value)


def test_load_image_gives_rgb_upright_with_transparency_on_white(tmp_path):
    rgba = np.zeros((4, 6, 4), dtype=np.uint8)
    rgba[:, :3] = (255, 0, 0, 255)  # opaque red left half, fully transparent black right half
    Image.fromarray(rgba, "RGBA").save(tmp_path / "alpha.png")
    Image.fromarray(np.full((5, 7), 90, dtype=np.uint8), "L").save(tmp_path / "gray.png")
    rotated = Image.fromarray(np.zeros((10, 20, 3), dtype=np.uint8))
    exif = rotated.getexif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    rotated.save(tmp_path / "rotated.jpg", exif=exif)

    alpha = images.load_image(tmp_path / "alpha.png")
    assert (
        alpha.mode == "RGB" and alpha.getpixel((0, 0)) == (255, 0, 0) and alpha.getpixel((5, 0)) == (255,) * 3
    )
    processor, config = _idefics3()
    with Image.open(tmp_path / "alpha.png") as opened:  # the processor composites onto white too
        _check_idefics3(processor, config, [opened])
    assert images.load_image(tmp_path / "gray.png").getpixel((0, 0)) == (90, 90, 90)
    assert images.load_image(tmp_path / "rotated.jpg").size == (10, 20)


def test_the_runtime_module_imports_neither_torch_nor_transformers():
    code = "import sys, pipeshard.runtime.images; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_qwen2_5_vl_decoder_positions_equal_transformers_rope_index(loaded, image_tokenizer):
    model_config = _qwen_config()
    model_config.image_token_id = image_tokenizer.convert_tokens_to_ids("<|image_pad|>")
    processor = qwen2_vl_image_processor(model_config, min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64)
    config = read_image_preprocessing(
        preprocessing_config(processor, model_config, tokenizer=image_tokenizer), "qwen2_vl"
    )
    model = Qwen2_5_VLModel(model_config).eval()
    placeholder = images.image_placeholder(config)
    for image_list in ([loaded[4]], [loaded[1], loaded[3]]):
        ours = images.preprocess(image_list, config)
        prompt = "Look: " + " and ".join([placeholder] * len(image_list)) + " - what differs?"
        ids = np.array(image_tokenizer(images.expand_image_tokens(prompt, ours, config))["input_ids"])
        positions, delta = images.mrope_position_ids(ids, ours.image_grid_thw, config)
        expected, expected_delta = model.get_rope_index(
            torch.from_numpy(ids)[None],
            torch.from_numpy((ids == config.image_token_id).astype(np.int32))[None],
            image_grid_thw=torch.from_numpy(ours.image_grid_thw),
        )
        np.testing.assert_array_equal(positions, expected[:, 0].numpy())
        assert delta == int(expected_delta)
