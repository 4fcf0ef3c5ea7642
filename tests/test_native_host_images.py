"""The native host's image input (examples/native-host, docs/native-host.md "Images"): its C++ preprocessing against
Pillow and runtime/images.py, and its answers to image prompts against the Python engine's tokens.

`make host` builds the host and its `image_check` tool; without them these tests skip and say why.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "build" / "native-host" / "build"
DEPS = REPO / "build" / "native-host" / "deps"
IMAGE_CHECK = BUILD / "image_check"
HOST_CLI = BUILD / "pipeshard-host"
THREADS = 2
MAX_NEW_TOKENS = 12
FILTERS = ["BOX", "BILINEAR", "HAMMING", "BICUBIC", "LANCZOS"]
# SmolVLM-256M's preprocessing as its export records it (the pack's vision.preprocessing): 512 px tiles of an image
# resized to a longest edge of 2048, LANCZOS.
SMOLVLM_256M = {
    "schema_version": 1,
    "family": "idefics3",
    "do_resize": True,
    "resample": "LANCZOS",
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "longest_edge": 2048,
    "max_resolution": 4096,
    "do_image_splitting": True,
    "max_image_size": 512,
    "image_size": 512,
    "patch_size": 16,
    "scale_factor": 4,
    "image_seq_len": 64,
    "image_token": "<image>",
    "fake_image_token": "<fake_token_around_image>",
    "global_image_token": "<global-img>",
    "row_col_token": "<row_{row}_col_{col}>",
    "max_tile_grid": 4,
    "image_token_id": 49153,
}
# A CLIP processor's (family llava): shortest edge, center crop, BICUBIC, CLIP's mean and std.
CLIP_336 = {
    "schema_version": 1,
    "family": "llava",
    "do_resize": True,
    "resample": "BICUBIC",
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "shortest_edge": 336,
    "height": None,
    "width": None,
    "crop_height": 336,
    "crop_width": 336,
    "image_size": 336,
    "image_seq_len": 576,
    "image_token": "<image>",
    "image_token_id": 32000,
}
# Sizes that upscale and downscale, portrait and landscape, odd and tiny.
SIZES = [(37, 23), (5, 91), (300, 17), (129, 255), (1280, 720), (333, 517), (2500, 90), (1, 1)]


def _built(*tools: Path) -> None:
    missing = [tool.name for tool in tools if not tool.is_file()]
    if missing or not (DEPS / ".complete").is_file():
        pytest.skip(f"the native host is not built ({', '.join(missing) or 'deps'}): `make host` builds it")


def _random_image(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """Noise over smooth gradients: every resampling filter's lobes show in it."""
    rows, cols = np.mgrid[0:height, 0:width]
    gradient = np.stack([cols * 255 // max(width, 1), rows * 255 // max(height, 1), (rows + cols) % 256], -1)
    noise = rng.integers(-40, 41, (height, width, 3))
    return np.clip(gradient + noise, 0, 255).astype(np.uint8)


def _host_pixels(tmp_path: Path, config: dict, images: list[np.ndarray]) -> tuple[np.ndarray, dict]:
    """image_check's pixel_values and layout for `images` under `config` (a manifest holding it)."""
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"vision": {"preprocessing": config}}))
    command = [str(IMAGE_CHECK), "preprocess", str(manifest), str(tmp_path / "pixels.f32")]
    for index, pixels in enumerate(images):
        path = tmp_path / f"image{index}.rgb"
        pixels.tofile(path)
        command += [str(path), str(pixels.shape[1]), str(pixels.shape[0])]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    layout = json.loads(done.stdout)
    size = layout["size"]
    return np.fromfile(tmp_path / "pixels.f32", np.float32).reshape(-1, 3, size, size), layout


def test_the_hosts_resize_is_pillows_byte_for_byte_with_every_filter(tmp_path):
    _built(IMAGE_CHECK)
    rng = np.random.default_rng(45)
    targets = [(16, 40), (77, 13), (301, 299), (1, 1), (64, 3)]
    for width, height in SIZES[:6]:
        pixels = _random_image(rng, width, height)
        pixels.tofile(tmp_path / "in.rgb")
        for new_width, new_height in [*targets, (width, max(height // 3, 1)), (max(width // 3, 1), height)]:
            for name in FILTERS:
                command = [str(IMAGE_CHECK), "resize", str(tmp_path / "in.rgb"), str(width), str(height)]
                command += [str(new_width), str(new_height), name, str(tmp_path / "out.rgb")]
                subprocess.run(command, check=True)
                got = np.fromfile(tmp_path / "out.rgb", np.uint8).reshape(new_height, new_width, 3)
                want = np.asarray(
                    Image.fromarray(pixels).resize((new_width, new_height), Image.Resampling[name])
                )
                assert np.array_equal(got, want), (width, height, new_width, new_height, name)


@pytest.mark.parametrize("config", [SMOLVLM_256M, CLIP_336], ids=["smolvlm-256m", "clip-336"])
def test_the_hosts_pixels_and_token_runs_are_runtime_images(tmp_path, config):
    """The whole preprocessing (resize, tiles and global view, rescale, normalize in float32) gives the same
    arrays as runtime/images.py, and each image's token run is the processor's text."""
    _built(IMAGE_CHECK)
    from pipeshard.formats.image_preprocessing import read_image_preprocessing
    from pipeshard.runtime.images import expand_image_tokens, preprocess

    document, config = config, read_image_preprocessing(config, "the test's preprocessing")
    rng = np.random.default_rng(7)
    for width, height in SIZES:
        pixels = _random_image(rng, width, height)
        got, layout = _host_pixels(tmp_path, document, [pixels])
        want = preprocess([Image.fromarray(pixels)], config)
        assert got.shape == want.pixel_values.shape, (width, height)
        assert np.array_equal(got, want.pixel_values), (width, height)
        assert layout["image_tokens"] == want.image_tokens
        assert layout["texts"] == [expand_image_tokens(config.image_token, want, config)]
    # Several images of one prompt: every image's tiles in order.
    images = [_random_image(rng, width, height) for width, height in [(90, 40), (40, 90)]]
    got, layout = _host_pixels(tmp_path, document, images)
    want = preprocess([Image.fromarray(pixels) for pixels in images], config)
    assert np.array_equal(got, want.pixel_values)
    assert layout["image_tokens"] == want.image_tokens


def _ppm(tmp_path: Path, name: str, pixels: np.ndarray) -> Path:
    path = tmp_path / f"{name}.ppm"
    Image.fromarray(pixels).save(path)
    return path


def _host_tokens(pack: Path, prompt: str, images: list[Path], *extra: str) -> subprocess.CompletedProcess:
    extensions = next(DEPS.rglob("libortextensions.so"))
    command = [str(HOST_CLI), str(pack), prompt, "--extensions", str(extensions), "--threads", str(THREADS)]
    command += ["--max-new-tokens", str(MAX_NEW_TOKENS), "--print-ids", *extra]
    for image in images:
        command += ["--image", str(image)]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


# One image before the text (no placeholder), two images where the prompt puts them, an image that is split.
PROMPTS = [
    ("What is in this picture?", [(37, 23)]),
    ("<image> or <image>: which is brighter?", [(100, 33), (20, 90)]),
    ("Describe it in one word.", [(64, 64)]),
]


def _answers_match(
    pack: Path, tmp_path: Path, prompts: list[tuple[str, list[tuple[int, int]]]] = PROMPTS
) -> None:
    import pipeshard

    engine = pipeshard.load(pack, threads=THREADS)
    rng = np.random.default_rng(3)
    for index, (prompt, sizes) in enumerate(prompts):
        images = [_random_image(rng, width, height) for width, height in sizes]
        paths = [_ppm(tmp_path, f"p{index}-{i}", pixels) for i, pixels in enumerate(images)]
        want = engine.generate(
            prompt, images=[Image.fromarray(p) for p in images], max_new_tokens=MAX_NEW_TOKENS
        )[0]
        done = _host_tokens(pack, prompt, paths)
        assert done.returncode == 0, done.stderr[-2000:]
        assert [int(t) for t in done.stdout.split()] == want.tokens, prompt


@pytest.fixture(scope="module")
def vlm_pack(models) -> Path:
    _built(HOST_CLI)
    return models.pack("tiny:smolvlm")


def test_the_native_host_answers_image_prompts_with_the_python_engines_tokens(vlm_pack, tmp_path):
    _answers_match(vlm_pack, tmp_path)


def _abi(*arguments: str) -> object:
    """tests/native_image_abi.py's JSON: the C ABI called through ctypes in a process without the onnxruntime wheel."""
    command = [sys.executable, "-P", str(Path(__file__).with_name("native_image_abi.py"))]
    done = subprocess.run(
        [*command, str(BUILD / "libpipeshard_host.so"), *arguments],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_bad_image_input_is_a_status_and_one_line_never_a_crash(vlm_pack, tiny_pack):
    fragments = [
        "image 0 has NULL pixels",
        "width and height must be from 1",
        "width and height must be from 1",
        "images is NULL with an image_count of 2",
        "the prompt has 2 image placeholder(s) '<image>' but 1 image(s)",
        "the prompt has 1 image placeholder(s) '<image>' but 2 image(s)",
        "is a text model: it takes no images",
    ]
    results = _abi("bad-input", str(vlm_pack), str(tiny_pack))
    assert len(results) == len(fragments)
    for result, fragment in zip(results, fragments, strict=True):
        assert result["status"] == 1, (fragment, result)  # PIPESHARD_ERR_ARGUMENT
        assert fragment in result["message"] and "\n" not in result["message"], result


def test_a_queued_image_request_copies_its_pixels_and_answers_as_the_cli(vlm_pack, tmp_path):
    """pipeshard_submit_with_images copies the pixels before it returns (the caller's buffer is zeroed at once), and
    the queued request gives the tokens the blocking call gives through the CLI."""
    pixels = _random_image(np.random.default_rng(11), 50, 30)
    prompt = "Describe it."
    done = _host_tokens(vlm_pack, prompt, [_ppm(tmp_path, "queued", pixels)])
    assert done.returncode == 0, done.stderr[-2000:]
    pixels.tofile(tmp_path / "queued.rgb")
    extensions = str(next(DEPS.rglob("libortextensions.so")))
    result = _abi(
        "submit",
        str(vlm_pack),
        extensions,
        str(tmp_path / "queued.rgb"),
        "50",
        "30",
        prompt,
        str(MAX_NEW_TOKENS),
    )
    assert result["submitted"] == 0 and result["status"] == 0, result
    assert result["tokens"] == [int(t) for t in done.stdout.split()]


def test_the_families_the_host_does_not_preprocess_are_one_line_each(vlm_pack, tmp_path):
    _built(HOST_CLI)
    pixels = np.zeros((8, 8, 3), np.uint8)
    for family in ("qwen2_vl", "gemma3"):
        pack = tmp_path / family
        shutil.copytree(vlm_pack, pack)
        manifest = json.loads((pack / "manifest.json").read_text())
        manifest["vision"]["preprocessing"]["family"] = family
        (pack / "manifest.json").write_text(json.dumps(manifest))
        done = _host_tokens(pack, "Hi", [_ppm(tmp_path, family, pixels)])
        assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
        assert f"a {family} pack's images are not supported yet" in done.stderr
        # Its text prompts still run.
        assert _host_tokens(pack, "Hi", []).returncode == 0


@pytest.mark.slow
def test_the_native_host_answers_on_smolvlm_256m_with_the_python_engines_tokens(models, tmp_path):
    """SmolVLM-256M's pack, one portrait image: 4 tiles of 512 px and the global view, 64 image tokens each."""
    _built(HOST_CLI)
    _answers_match(models.pack("smolvlm-256m"), tmp_path, [("What is in this picture?", [(40, 300)])])


@pytest.mark.slow
def test_the_native_host_answers_on_a_llava_pack_with_the_python_engines_tokens(models, tmp_path):
    """A CLIP tower before a Llama decoder (tiny:llava, an export of its own): shortest edge, center crop."""
    _built(HOST_CLI)
    _answers_match(models.pack("tiny:llava"), tmp_path)
