"""Vision-language models: the export, the pack's vision blocks, and greedy tokens equal to transformers' with one
and two images, on the export's sessions, the pack's CPU chain and planned on the simulated device."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from PIL import Image

import pipeshard
from pipeshard.core.errors import UserError
from pipeshard.formats.manifest import load_pack

PROMPT = "What is in the picture?"
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_vlm():
    from pipeshard.exporter.vlm import build_tiny_vlm, image_processor_for

    model, tokenizer, processor = build_tiny_vlm("smolvlm")
    return model, tokenizer, image_processor_for(processor)


@pytest.fixture(scope="module")
def vlm_export(models) -> Path:
    return models.export("tiny:smolvlm")


@pytest.fixture(scope="module")
def vlm_pack(models) -> Path:
    return models.pack("tiny:smolvlm")


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> list[Path]:
    """Two images of other sizes and aspect ratios than the tiles: one is split into tiles, one is not."""
    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(7)
    paths = []
    for index, (width, height) in enumerate([(50, 37), (90, 61)]):
        pixels = (rng.random((height, width, 3)) * 255).astype(np.uint8)
        paths.append(folder / f"image{index}.png")
        Image.fromarray(pixels).save(paths[-1])
    return paths


def reference_output(tiny_vlm, prompt_ids: list[int], paths: list[Path], **options):
    """transformers' greedy `generate` for the same ids, its own image processor making the pixels (`options`:
    more of generate's arguments)."""
    import torch

    model, _, image_processor = tiny_vlm
    pixels = image_processor(images=[[Image.open(p).convert("RGB") for p in paths]], return_tensors="pt")
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        return model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=pixels["pixel_values"],
            pixel_attention_mask=pixels["pixel_attention_mask"],
            do_sample=False,
            **{"max_new_tokens": NEW_TOKENS, **options},
        )


def reference_tokens(tiny_vlm, prompt_ids: list[int], paths: list[Path]) -> list[int]:
    """transformers' greedy tokens for the same ids, its own image processor making the pixels."""
    return reference_output(tiny_vlm, prompt_ids, paths)[0, len(prompt_ids) :].tolist()


def test_export_describes_three_parts_with_dynamic_tiles(vlm_export):
    info = json.loads((vlm_export / "export.json").read_text())
    assert info["vision"]["preprocessing"]["family"] == "idefics3"
    assert info["vision"]["max_difference_vs_pytorch"] < 1e-4
    assert "image_features" in info["inputs"]
    vision = onnx.load(vlm_export / info["vision"]["file"], load_external_data=False).graph
    assert vision.input[0].type.tensor_type.shape.dim[0].dim_param  # tiles stay dynamic
    assert vision.output[0].type.tensor_type.shape.dim[0].dim_param


def test_pack_cuts_the_vision_tower_into_blocks(vlm_pack):
    manifest = load_pack(vlm_pack).manifest
    names = [e.name for e in manifest.vision.sub_layers]
    assert names == ["vision_prologue", "vision_embed", "V0.attn", "V0.ffn", "V1.attn", "V1.ffn", "projector"]
    attention = next(e for e in manifest.vision.sub_layers if e.name == "V0.attn")
    assert attention.cost.flops["TC"] > 0 and attention.weight_bytes > 0
    # The image merge stays in the embedding: the prologue keeps to the attention's step values (skipped at
    # one new token).
    prologue = manifest.sub_layer("prologue")
    assert {i.name for i in prologue.inputs} <= {"input_ids", "attention_mask", "position_ids"}
    assert "image_features" in {i.name for i in manifest.sub_layer("embed").inputs}


@pytest.mark.parametrize("where", ["export", "pack", "sim-25%", "sim-60%"])
def test_tokens_equal_transformers_with_one_and_two_images(where, vlm_export, vlm_pack, images, tiny_vlm):
    if where == "export":
        engine = pipeshard.load(vlm_export)
    elif where == "pack":
        engine = pipeshard.load(vlm_pack)
    else:
        engine = pipeshard.load(vlm_pack, device="sim", vram=where.split("-")[1], profile="laptop-8gb")
    for paths in (images[:1], images):
        (result,) = engine.generate(PROMPT, images=[str(p) for p in paths], max_new_tokens=NEW_TOKENS)
        assert result.tokens == reference_tokens(tiny_vlm, result.prompt_tokens, paths)[: len(result.tokens)]
        assert len(result.tokens) == NEW_TOKENS
    if where.startswith("sim"):
        # VLMOpt: the encoder's weights stream through two slots and everything is released before the prefill.
        vision = engine.vision
        largest = max(e.blob.bytes for e in vision.entries if e.blob)
        assert vision.streamed_bytes >= 2 * vision.description.total_weight_bytes
        assert 2 * largest <= vision.peak_device_bytes <= engine.step.device.ledger.budget_bytes
        assert engine.step.report().peak_device_bytes <= engine.step.device.ledger.budget_bytes


def test_text_only_prompt_on_a_vlm_equals_its_decoder(vlm_pack, tiny_vlm):
    import torch

    engine = pipeshard.load(vlm_pack)
    (result,) = engine.generate(PROMPT, max_new_tokens=NEW_TOKENS)
    model = tiny_vlm[0]
    ids = torch.tensor([result.prompt_tokens])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False
        )
    assert result.tokens == out[0, ids.shape[1] :].tolist()[: len(result.tokens)]


def test_chat_turns_with_images_reuse_the_cache(vlm_pack, images, tiny_vlm):
    from pipeshard.runtime.conversation import Conversation
    from pipeshard.runtime.generate import SamplingSettings

    engine = pipeshard.load(vlm_pack)
    conversation = Conversation(
        engine.generator, SamplingSettings(max_new_tokens=6), 400, vision=engine.vision
    )
    "".join(conversation.ask("Look.", [str(images[0])]))
    "".join(conversation.ask("And this one?", [str(images[1])]))
    assert engine.generator.reused_tokens > 0  # the first turn, image included, came from the kept cache
    last = conversation.last
    assert last.tokens == reference_tokens(tiny_vlm, last.prompt_tokens, images)[: len(last.tokens)]


def test_images_on_a_text_model_and_bad_images_are_user_errors(tiny_pack, images, tmp_path):
    engine = pipeshard.load(tiny_pack)
    with pytest.raises(UserError, match="text model"):
        engine.generate(PROMPT, images=[str(images[0])])
    not_an_image = tmp_path / "notes.png"
    not_an_image.write_text("hello")
    for path in (tmp_path / "missing.png", not_an_image, tmp_path):
        done = subprocess.run(
            [sys.executable, "-m", "pipeshard", "run", str(tiny_pack), PROMPT, "--image", str(path)],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 2
        assert done.stderr.startswith("error:") and done.stderr.count("\n") == 1, done.stderr


def test_run_cli_with_images_prints_json(vlm_pack, images):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeshard",
            "run",
            str(vlm_pack),
            "<image> and <image>?",
            "--image",
            str(images[0]),
            "--image",
            str(images[1]),
            "--json",
            "--max-new-tokens",
            "4",
            "--device",
            "sim",
            "--vram",
            "40%",
            "--profile",
            "laptop-8gb",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["images"] == 2 and len(result["tokens"]) == 4 and result["vision_peak_device_bytes"] > 0
    wrong = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeshard",
            "run",
            str(vlm_pack),
            "<image> only one",
            "--image",
            str(images[0]),
            "--image",
            str(images[1]),
        ],
        capture_output=True,
        text=True,
    )
    assert wrong.returncode == 2 and "placeholder" in wrong.stderr


@pytest.mark.slow  # exports the tiny model a second time, from its HF folder
def test_hf_folder_of_a_vlm_exports_the_same_model(tiny_vlm, images, tmp_path):
    from pipeshard.exporter import export_model
    from pipeshard.partitioner.partition import partition

    model, tokenizer, image_processor = tiny_vlm
    folder = tmp_path / "smolvlm-tiny"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    image_processor.save_pretrained(folder)
    export_model(str(folder), tmp_path / "export", quiet=True)
    partition(tmp_path / "export", tmp_path / "pack")
    engine = pipeshard.load(tmp_path / "pack")
    (result,) = engine.generate(PROMPT, images=[str(p) for p in images], max_new_tokens=NEW_TOKENS)
    assert result.tokens == reference_tokens(tiny_vlm, result.prompt_tokens, images)[: len(result.tokens)]


@pytest.mark.slow
def test_smolvlm_256m_through_the_real_smollm2_decoder_equals_transformers(models, tmp_path):
    """SmolVLM-256M's shape around the built-in SmolLM2-135M (its real text model; the vision weights are random):
    the pack's tokens equal transformers' for a wide image, 4 tiles of the real 512 pixels in a row and the global
    view (the fewest any image gets at SmolVLM's 2048-pixel longest edge; two images in one prompt and images of
    several tile rows are the tiny VLM's tests; each tile costs seconds here on both sides)."""
    import torch

    from pipeshard.exporter.sources import load_source, resolve_source

    pack = models.pack("smolvlm-256m")
    source = load_source(resolve_source("smolvlm-256m"), torch.float32)
    reference = (source.vlm, source.tokenizer, source.image_processor)
    rng = np.random.default_rng(3)
    paths = []
    for index, (width, height) in enumerate([(700, 150)]):
        paths.append(tmp_path / f"photo{index}.jpg")
        Image.fromarray((rng.random((height, width, 3)) * 255).astype(np.uint8)).save(paths[-1])
    engine = pipeshard.load(pack)
    # A plain completion: through the chat template, random image features make SmolLM2 stop at once.
    (result,) = engine.generate(
        "The capital of France is",
        chat_template=False,
        images=[str(p) for p in paths],
        max_new_tokens=NEW_TOKENS,
    )
    assert (
        len(result.tokens) == NEW_TOKENS
        and result.prompt_tokens.count(source.vlm.config.image_token_id) == 5 * 64
    )
    assert result.tokens == reference_tokens(reference, result.prompt_tokens, paths)


def _data_url(path: Path) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def test_server_takes_images_as_data_urls(vlm_pack, images):
    """Chat requests with image parts, two at once on the scheduler, get what `generate(images=...)` gives; a URL
    the server would have to fetch, or bytes that are no image, are a 400 with an error object."""
    import httpx
    from test_server import client, server

    engine = pipeshard.load(vlm_pack)
    expected = [
        engine.generate(PROMPT, images=[str(p) for p in paths], max_new_tokens=NEW_TOKENS)[0].text
        for paths in (images[:1], images)
    ]
    with server(vlm_pack, "--parallel", "2", "--context", "512") as base:
        chat = client(base)

        def ask(paths):
            parts = [{"type": "image_url", "image_url": {"url": _data_url(p)}} for p in paths]
            answer = chat.chat.completions.create(
                model="pack",
                max_tokens=NEW_TOKENS,
                temperature=0,
                messages=[{"role": "user", "content": [*parts, {"type": "text", "text": PROMPT}]}],
            )
            return answer.choices[0].message.content

        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(ask, (images[:1], images))) == expected
        for url in ("https://example.com/cat.png", "data:image/png;base64,bm90IGFuIGltYWdl"):
            reply = httpx.post(
                base + "/v1/chat/completions",
                json={
                    "model": "pack",
                    "messages": [
                        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}
                    ],
                },
            )
            assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages"


def test_plan_predicts_the_vision_encoder_at_image_sizes(vlm_pack, tiny_pack):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeshard",
            "plan",
            str(vlm_pack),
            "--vram",
            "50%",
            "--profile",
            "laptop-8gb",
            "--tiers",
            "1",
            "--image-size",
            "64x48,1280x720",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("  ") and "tiles" in line]
    assert len(lines) == 2 and all("VLMOpt" in line and "(fits" in line for line in lines)
    text_model = subprocess.run(
        [sys.executable, "-m", "pipeshard", "plan", str(tiny_pack), "--vram", "50%", "--image-size", "64x48"],
        capture_output=True,
        text=True,
    )
    assert (
        text_model.returncode == 2
        and text_model.stderr.startswith("error:")
        and "text model" in text_model.stderr
    )


def test_a_prompt_cut_into_chunks_gives_each_chunk_its_image_rows(vlm_pack, images, tiny_vlm):
    """Tiers of at most 16 tokens: the two-image prompt's prefill runs in chunks that cut through image runs."""
    engine = pipeshard.load(vlm_pack, device="sim", vram="60%", profile="laptop-8gb")
    engine.step.tiers = [1, 16]
    (result,) = engine.generate(PROMPT, images=[str(p) for p in images], max_new_tokens=NEW_TOKENS)
    assert len(result.prompt_tokens) > 3 * 16
    assert result.tokens == reference_tokens(tiny_vlm, result.prompt_tokens, images)[: len(result.tokens)]


# --- Qwen2.5-VL (the Cosmos-Reason1 family): windowed vision attention, M-RoPE decoder


@pytest.fixture(scope="module")
def tiny_qwen():
    from pipeshard.exporter.image_processing import qwen2_vl_image_processor
    from pipeshard.exporter.qwen_vl import build_tiny_qwen_vl

    model, tokenizer, processor = build_tiny_qwen_vl("qwen2_5_vl")
    return model, tokenizer, qwen2_vl_image_processor(model.config, **processor)


@pytest.fixture(scope="module")
def qwen_export(models) -> Path:
    return models.export("tiny:qwen2_5_vl")


@pytest.fixture(scope="module")
def qwen_pack(models) -> Path:
    return models.pack("tiny:qwen2_5_vl")


def qwen_reference_tokens(tiny_qwen, prompt_ids: list[int], paths: list[Path]) -> list[int]:
    """Qwen2_5_VLForConditionalGeneration.generate's greedy tokens for the same ids, its processor's pixels."""
    import torch

    model, _, image_processor = tiny_qwen
    pixels = image_processor(images=[Image.open(p).convert("RGB") for p in paths], return_tensors="pt")
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=pixels["pixel_values"],
            image_grid_thw=pixels["image_grid_thw"],
            mm_token_type_ids=(ids == model.config.image_token_id).int(),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
        )
    return out[0, len(prompt_ids) :].tolist()


def test_qwen_export_keeps_patches_windows_and_images_dynamic(qwen_export):
    info = json.loads((qwen_export / "export.json").read_text())
    assert info["vision"]["family"] == "qwen2_vl" and info["position_rows"] == 3
    assert info["vision"]["max_difference_vs_pytorch"] < 1e-4  # two image grids, one and two images
    graph = onnx.load(qwen_export / "vision.onnx", load_external_data=False).graph
    dims = {
        v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
        for v in [*graph.input, *graph.output]
    }
    assert all(isinstance(shape[0], str) for shape in dims.values())
    assert all(isinstance(d, str) for d in dims["window_rows"] + dims["image_rows"])
    # Fused attention over padded groups, and nothing of patches x patches: every MatMul is by a weight.
    assert sum(n.op_type == "Attention" for n in graph.node) == 4
    weights = {i.name for i in graph.initializer}
    assert all(n.input[1] in weights for n in graph.node if n.op_type == "MatMul")
    decoder = onnx.load(qwen_export / "model.onnx", load_external_data=False).graph
    position = next(v for v in decoder.input if v.name == "position_ids")
    assert [d.dim_param or d.dim_value for d in position.type.tensor_type.shape.dim] == [
        3,
        "batch",
        "sequence",
    ]
    assert sum(n.op_type == "GroupQueryAttention" for n in decoder.node) == 3


def test_qwen_pack_cuts_the_vision_tower_into_blocks(qwen_pack):
    manifest = load_pack(qwen_pack).manifest
    names = [e.name for e in manifest.vision.sub_layers]
    assert names == [
        "vision_prologue",
        "vision_embed",
        *[f"V{i}.{k}" for i in range(4) for k in ("attn", "ffn")],
        "projector",
    ]
    assert manifest.model.position_rows == 3
    # Every block's blob holds all it reads (equal tensors merged by the exporter are copied per block).
    for entry in manifest.vision.sub_layers:
        assert all(w.file == entry.blob.file for w in entry.weights)


def test_inspect_describes_a_tower_whose_tiles_vary_and_one_whose_tiles_are_fixed(
    qwen_pack, vlm_pack, capsys
):
    from pipeshard.cli import main

    assert main(["inspect", str(qwen_pack)]) == 0
    assert (
        "vision tower (qwen2_vl): 4 blocks over images of varying size; weights:" in capsys.readouterr().out
    )
    assert main(["inspect", str(vlm_pack)]) == 0
    assert "per tile:" in capsys.readouterr().out


@pytest.mark.parametrize("where", ["export", "pack", "sim-25%", "sim-60%"])
def test_qwen_tokens_equal_transformers_with_one_and_two_images(
    where, qwen_export, qwen_pack, images, tiny_qwen
):
    if where == "export":
        engine = pipeshard.load(qwen_export)
    elif where == "pack":
        engine = pipeshard.load(qwen_pack)
    else:
        engine = pipeshard.load(qwen_pack, device="sim", vram=where.split("-")[1], profile="laptop-8gb")
    for paths in (images[:1], images):
        (result,) = engine.generate(PROMPT, images=[str(p) for p in paths], max_new_tokens=NEW_TOKENS)
        assert len(result.tokens) == NEW_TOKENS
        assert result.tokens == qwen_reference_tokens(tiny_qwen, result.prompt_tokens, paths)
    if where.startswith("sim"):
        vision = engine.vision
        assert vision.streamed_bytes >= 2 * vision.description.total_weight_bytes
        assert vision.peak_device_bytes <= engine.step.device.ledger.budget_bytes


def test_qwen_prompt_in_chunks_and_chat_turns_keep_mrope_positions(qwen_pack, images, tiny_qwen):
    """Tiers of at most 16 tokens cut the prefill through image runs (each chunk its rows of the 3-row positions);
    a second chat turn reuses the cache and continues from the first turn's rope delta."""
    from pipeshard.runtime.conversation import Conversation
    from pipeshard.runtime.generate import SamplingSettings

    engine = pipeshard.load(qwen_pack, device="sim", vram="60%", profile="laptop-8gb")
    engine.step.tiers = [1, 16]
    (result,) = engine.generate(PROMPT, images=[str(p) for p in images], max_new_tokens=NEW_TOKENS)
    assert len(result.prompt_tokens) > 3 * 16
    assert result.tokens == qwen_reference_tokens(tiny_qwen, result.prompt_tokens, images)
    chat = pipeshard.load(qwen_pack)
    conversation = Conversation(chat.generator, SamplingSettings(max_new_tokens=6), 400, vision=chat.vision)
    "".join(conversation.ask("Look.", [str(images[0])]))
    "".join(conversation.ask("And this one?", [str(images[1])]))
    assert chat.generator.reused_tokens > 0
    last = conversation.last
    assert last.tokens == qwen_reference_tokens(tiny_qwen, last.prompt_tokens, images)[: len(last.tokens)]


@pytest.mark.slow  # exports the tiny model a second time, from its HF folder
def test_qwen_hf_folder_exports_the_same_model(tiny_qwen, images, tmp_path):
    from pipeshard.exporter import export_model

    model, tokenizer, image_processor = tiny_qwen
    folder = tmp_path / "qwen-tiny"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    image_processor.save_pretrained(folder)
    export_model(str(folder), tmp_path / "export", quiet=True)
    engine = pipeshard.load(tmp_path / "export")
    (result,) = engine.generate(PROMPT, images=[str(p) for p in images], max_new_tokens=NEW_TOKENS)
    assert result.tokens == qwen_reference_tokens(tiny_qwen, result.prompt_tokens, images)


def test_qwen_server_takes_images_with_mrope_positions(qwen_pack, images):
    """The continuous-batching scheduler gives each request its own M-RoPE positions and rope delta: two chat
    requests with images at once get what `generate(images=...)` gives."""
    from concurrent.futures import ThreadPoolExecutor

    from test_server import client, server

    engine = pipeshard.load(qwen_pack)
    expected = [
        engine.generate(PROMPT, images=[str(p) for p in paths], max_new_tokens=NEW_TOKENS)[0].text
        for paths in (images[:1], images)
    ]
    with server(qwen_pack, "--parallel", "2", "--context", "512") as base:
        chat = client(base)

        def ask(paths):
            parts = [{"type": "image_url", "image_url": {"url": _data_url(p)}} for p in paths]
            answer = chat.chat.completions.create(
                model="pack",
                max_tokens=NEW_TOKENS,
                temperature=0,
                messages=[{"role": "user", "content": [*parts, {"type": "text", "text": PROMPT}]}],
            )
            return answer.choices[0].message.content

        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(ask, (images[:1], images))) == expected


def test_a_decode_row_shorter_than_the_step_gets_its_own_logits(qwen_pack):
    """The scheduler's decode steps leave a shorter row's mask ending early: its new token goes after its own last
    column, not the step's (the graph's seqlens_k are each row's last set column). Decoders whose rotary stays
    outside GroupQueryAttention (M-RoPE, Qwen3) compute them in the graph at every step."""
    engine = pipeshard.load(qwen_pack)
    step = engine.step
    short, long = (
        engine.generator.prompt_ids(text) for text in ("Hi.", "A longer prompt than the other one.")
    )

    def positions(start, count, batch=1):
        return np.broadcast_to(np.arange(start, start + count), (3, batch, count)).copy()

    step.start(1, 128)
    step.forward(np.array([short]), np.ones((1, len(short)), np.int64), positions(0, len(short)))
    alone = step.forward(np.array([[5]]), np.ones((1, len(short) + 1), np.int64), positions(len(short), 1))[
        0, -1
    ]
    step.start(2, 128)
    step.forward(np.array([short]), np.ones((1, len(short)), np.int64), positions(0, len(short)), slot=0)
    step.forward(np.array([long]), np.ones((1, len(long)), np.int64), positions(0, len(long)), slot=1)
    mask = np.zeros((2, len(long) + 1), np.int64)
    mask[0, : len(short) + 1] = mask[1, :] = 1
    rows = np.stack([positions(len(short), 1)[:, 0], positions(len(long), 1)[:, 0]], axis=1)
    together = step.forward(np.array([[5], [7]]), mask, rows)[0, -1]
    assert np.abs(together - alone).max() < 1e-4


def _vision_comparable(vision: dict) -> dict:
    """A manifest's vision section with each tensor named by where it comes from (a graph input, or the sub-layer
    and output that makes it) and the weights the exporter numbers (`val_137`) unnamed: the rest as it is."""
    source = {t["name"]: t["name"] for t in vision["graph_inputs"]}
    source |= {
        t["name"]: f"{e['name']}:{k}" for e in vision["sub_layers"] for k, t in enumerate(e["outputs"])
    }

    def weight(w: dict) -> dict:
        return {
            **w,
            "name": w["name"] if w["name"].startswith(("patch_embed.", "blocks.", "merger.")) else None,
        }

    return {
        **vision,
        "sub_layers": [
            {
                **e,
                "weights": [weight(w) for w in e["weights"]],
                "inputs": [{**t, "name": source[t["name"]]} for t in e["inputs"]],
                "outputs": [{**t, "name": source[t["name"]]} for t in e["outputs"]],
            }
            for e in vision["sub_layers"]
        ],
    }


@pytest.mark.slow
def test_a_qwen_vision_probe_repeated_is_the_whole_towers_trace(tiny_qwen, tmp_path):
    """Shape-only vision: a probe of one windowed and one full-attention block, repeated to the tiny tower's
    4 blocks (1 and 3 full attention), is the manifest's vision section of the whole tower traced."""
    from pipeshard.exporter.shape_only import trace_vlm, vlm_probe_config
    from pipeshard.partitioner.partition import partition
    from pipeshard.partitioner.repeat import repeat_vision_blocks

    config = tiny_qwen[0].config
    vision = {}
    for name, traced in (("whole", config), ("probe", vlm_probe_config(config))):
        (tmp_path / name).mkdir()
        trace_vlm(traced, "fp16", tmp_path / name)
        partition(tmp_path / name, tmp_path / f"{name}-pack")
        vision[name] = json.loads((tmp_path / f"{name}-pack" / "manifest.json").read_text())["vision"]
    assert vision["probe"]["num_layers"] == 2 and vision["probe"]["fullatt_block_indexes"] == [1]
    probe = load_pack(tmp_path / "probe-pack").manifest.vision
    repeated = repeat_vision_blocks(probe, 4, [1, 3]).to_json()
    assert _vision_comparable(repeated) == _vision_comparable(vision["whole"])
    names = [w["name"] for e in repeated["sub_layers"] for w in e["weights"]]
    assert len(names) == len(set(names)) and "blocks.2.attn.proj.weight" in names


@pytest.mark.slow
def test_cosmos_shape_only_pack_plans_the_encoder_at_image_sizes(tmp_path):
    """cosmos-reason1-7b --shape-only (its 7B vision tower probed with two blocks, no weights): plan --image-size
    predicts VLMOpt's least peak at least 10x under the naive port's at 1440p; a weights export of it is one error
    line."""
    pack = tmp_path / "cosmos"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeshard",
            "export",
            "cosmos-reason1-7b",
            str(pack),
            "--shape-only",
            "--dtype",
            "fp16",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    manifest = load_pack(pack).manifest
    assert manifest.vision.facts["num_layers"] == 32 and manifest.model.num_layers == 28
    plan = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeshard",
            "plan",
            str(pack),
            "--vram",
            "8GiB",
            "--profile",
            "laptop-8gb",
            "--tiers",
            "1",
            "--image-size",
            "854x480,2560x1440",
        ],
        capture_output=True,
        text=True,
    )
    assert plan.returncode == 0, plan.stderr
    printed = plan.stdout.splitlines()
    (line,) = [line for line in printed if line.startswith("  2560x1440")]
    assert "(fits" in line and float(line.rsplit("(", 1)[1].split("x")[0]) >= 10
    # The planner's placement of the blocks at 1440p: predicted at least as fast as VLMOpt's and the CPU's, in budget.
    from pipeshard.core.units import parse_size

    placed, times = printed[printed.index(line) + 1 : printed.index(line) + 3]
    seconds = [float(part.split()[-2]) for part in times.split(": ", 1)[1].split(", ")]
    assert seconds[0] <= seconds[1] and seconds[0] <= seconds[2]
    assert parse_size(placed.split("; ")[-1].split(" on the device")[0]) <= 8 * 1024**3
    refused = subprocess.run(
        [sys.executable, "-m", "pipeshard", "export", "cosmos-reason1-7b", str(tmp_path / "w")],
        capture_output=True,
        text=True,
    )
    assert (
        refused.returncode == 2 and refused.stderr.startswith("error:") and "--shape-only" in refused.stderr
    )
