"""Vision-language models (Idefics3 / SmolVLM): the vision tower as its own graph, and the language decoder with
the image features merged into its embeddings.

The export follows onnxruntime-genai's multi-modal contract: `vision.onnx` (pixel values -> image features, one
row per image token) and a decoder that places those rows at the image-token positions. The contract's separate
embedding graph is the decoder's `embed` sub-layer here: a graph of its own would hold a second copy of a tied
embedding table (the output layer reads it too).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from pipeshard.core.errors import UserError

VLM_ARCHITECTURES = ("smolvlm", "idefics3")
IMAGE_MERGE = "image_merge"  # the merge's module name; the partitioner puts it in the `embed` sub-layer
VISION_FILE = "vision.onnx"
IMAGE_TOKEN = "<image>"
MAX_TILE_GRID = 6  # row / column tokens the tokenizers here know (<row_6_col_6>)

# A tiny SmolVLM: 2 SigLIP layers over 32 px tiles of 8 px patches (16 patches), pixel shuffle by 2 -> 4 image
# tokens per tile, a Llama decoder of the tiny Llama's size.
TINY_VLM_CONFIGS: dict[str, dict[str, Any]] = {
    "smolvlm": {
        "model_type": "smolvlm",
        "scale_factor": 2,
        "vision_config": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 32,
            "patch_size": 8,
        },
        "text_config": {
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 160,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 512,
            "rope_theta": 10000.0,
            "tie_word_embeddings": True,
        },
        "processor": {"longest_edge": 64, "tile": 32},
    },
}
# SmolVLM-256M's vision tower and connector: SigLIP-B/16 over 512 px tiles, pixel shuffle by 4 -> 64 tokens a tile.
SMOLVLM_256M_VISION = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "image_size": 512,
    "patch_size": 16,
}
SMOLVLM_256M_PROCESSOR = {"longest_edge": 2048, "tile": 512}
VISION_SEED = 4321


def image_special_tokens() -> list[str]:
    """The Idefics3 processor's image tokens: the placeholder, its fences, the global image and tile positions."""
    grid = [f"<row_{r}_col_{c}>" for r in range(1, MAX_TILE_GRID + 1) for c in range(1, MAX_TILE_GRID + 1)]
    return ["<fake_token_around_image>", IMAGE_TOKEN, "<global-img>", *grid]


def is_vlm_architecture(model_type: str | None) -> bool:
    return model_type in VLM_ARCHITECTURES


def _seeded_vision(model) -> None:
    """Random vision weights that keep activations in range (norms at 1, matrices at a modest scale)."""
    import torch

    torch.manual_seed(VISION_SEED)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.startswith(("model.vision_model.", "model.connector.")) and parameter.dim() >= 2:
                fan_in = parameter[0].numel()
                parameter.normal_(0.0, 1.0 / fan_in**0.5)


def build_vlm(text_model, tokenizer, vision: dict, scale_factor: int, seed_text: bool):
    """A SmolVLM around `text_model` (a Llama causal LM whose weights it keeps), with a seeded random vision
    tower and connector; the tokenizer gains the image tokens (their embedding rows seeded too)."""
    import torch
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration

    tokenizer.add_special_tokens(
        {"additional_special_tokens": image_special_tokens()}, replace_extra_special_tokens=False
    )
    text_config = text_model.config
    vocab = max(len(tokenizer), text_config.vocab_size)
    config = SmolVLMConfig(
        text_config={**text_config.to_dict(), "vocab_size": vocab},
        vision_config=vision,
        scale_factor=scale_factor,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        tie_word_embeddings=bool(text_config.tie_word_embeddings),
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(VISION_SEED)
    model = SmolVLMForConditionalGeneration(config).eval()
    _seeded_vision(model)
    old_rows = text_config.vocab_size
    with torch.no_grad():
        state = {
            f"model.text_model.{k[len('model.') :]}": v
            for k, v in text_model.state_dict().items()
            if k.startswith("model.")
        }
        embed = state["model.text_model.embed_tokens.weight"]
        if vocab > old_rows:  # new rows for the image tokens, at the table's own scale
            generator = torch.Generator().manual_seed(VISION_SEED)
            extra = torch.randn(vocab - old_rows, embed.shape[1], generator=generator) * embed.std()
            state["model.text_model.embed_tokens.weight"] = torch.cat([embed, extra.to(embed.dtype)])
        missing, unexpected = model.load_state_dict(state, strict=False)
        if not config.tie_word_embeddings:
            head = text_model.lm_head.weight
            rows = torch.zeros(vocab, head.shape[1], dtype=head.dtype)
            rows[:old_rows] = head
            model.lm_head.weight.copy_(rows)
    model.tie_weights()
    if seed_text:
        _seed_tiny_text(model)
    with torch.no_grad():  # image features at the scale of the text embeddings, as a trained connector gives
        table = model.get_input_embeddings().weight
        model.model.connector.modality_projection.proj.weight.mul_(float(table.std()))
    stray = [k for k in missing if not k.startswith(("model.vision_model.", "model.connector.", "lm_head."))]
    if stray or unexpected:
        raise RuntimeError(f"text weights do not fit the VLM: missing {stray}, unexpected {unexpected}")
    return model, tokenizer


def _seed_tiny_text(model) -> None:
    """The tiny decoders' weight scale (exporter/tiny.py): clear greedy margins for exact comparisons."""
    import torch

    from pipeshard.exporter.tiny import TINY_SEED

    torch.manual_seed(TINY_SEED)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.startswith("model.text_model.") and parameter.dim() >= 2:
                parameter.normal_(0.0, 0.5 if "embed" in name else 0.15)


def build_tiny_vlm(name: str):
    """A seeded tiny VLM of TINY_VLM_CONFIGS[name] with the byte tokenizer, and its processor settings."""
    from pipeshard.exporter.tiny import build_random_model

    settings = TINY_VLM_CONFIGS[name]
    text_model, tokenizer = build_random_model(dict(settings["text_config"]))
    model, tokenizer = build_vlm(
        text_model, tokenizer, settings["vision_config"], settings["scale_factor"], seed_text=True
    )
    return model, tokenizer, settings["processor"]


def build_smolvlm_256m(text_model, tokenizer):
    """SmolVLM-256M's shape around the real SmolLM2-135M decoder (its own text model): random vision weights."""
    model, tokenizer = build_vlm(text_model, tokenizer, SMOLVLM_256M_VISION, scale_factor=4, seed_text=False)
    return model, tokenizer, SMOLVLM_256M_PROCESSOR


def image_processor_for(processor: dict):
    """transformers' Idefics3 image processor for a built VLM's tile size (saved with the export, and the
    reference the runtime's own preprocessing is checked against)."""
    from transformers import Idefics3ImageProcessorPil

    return Idefics3ImageProcessorPil(
        size={"longest_edge": processor["longest_edge"]}, max_image_size={"longest_edge": processor["tile"]}
    )


def text_decoder(vlm):
    """The VLM's language model as a plain causal LM (same weight tensors), what the decoder export traces."""
    from pipeshard.exporter.text_decoder import causal_lm_copy

    prefix = "model.text_model."
    return causal_lm_copy(
        vlm, {k[len(prefix) :]: v for k, v in vlm.state_dict().items() if k.startswith(prefix)}
    )


def image_merge_module(image_token_id: int):
    """input_ids [b, s], embeds [b, s, h], features [n, h] -> embeds with the i-th image token's row replaced by
    features[i] (in reading order), for the first n image tokens; a step with no features changes nothing."""
    import torch

    class ImageMerge(torch.nn.Module):
        def forward(self, input_ids, embeds, features):
            flat = (input_ids == image_token_id).reshape(-1)
            order = torch.cumsum(flat.to(torch.int64), 0)
            placed = flat & (order <= features.shape[0])
            index = torch.where(placed, order, torch.zeros_like(order))
            padded = torch.cat([features.new_zeros((1, features.shape[1])), features], 0)
            rows = padded.index_select(0, index).reshape(embeds.shape)
            return torch.where(placed.reshape(*input_ids.shape, 1), rows, embeds)

    return ImageMerge()


def tile_tower(vision_model, connector, embed):
    """A tower over whole tiles: pixel values [tiles, 3, S, S] -> image features [tiles * tokens per tile, text
    hidden], `embed(vision_model, pixel_values)` then the encoder, the post-layernorm and the connector, at the
    module paths the partitioner cuts (`vision_model.embeddings`, `vision_model.encoder.layers.N`,
    `vision_model.post_layernorm`, `connector`)."""
    import torch

    class VisionTower(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.vision_model = vision_model
            self.connector = connector

        def forward(self, pixel_values):
            tower = self.vision_model
            hidden = embed(tower, pixel_values)
            hidden = tower.post_layernorm(tower.encoder(inputs_embeds=hidden).last_hidden_state)
            features = self.connector(hidden)
            return features.reshape(-1, features.shape[-1])

    return VisionTower().eval()


def vision_tower(vlm):
    """Idefics3's tower and connector as a `tile_tower`."""
    import torch

    def embed(tower, pixel_values):
        # Whole tiles only (the preprocessing makes no padded ones): every patch attends to every other, so the
        # encoder runs without a mask, which would otherwise cross every block.
        patches = torch.ones(
            (
                pixel_values.shape[0],
                pixel_values.shape[2] // tower.patch_size,
                pixel_values.shape[3] // tower.patch_size,
            ),
            dtype=torch.bool,
        )
        return tower.embeddings(pixel_values=pixel_values, patch_attention_mask=patches)

    return tile_tower(vlm.model.vision_model, vlm.model.connector, embed)


def export_vision(vlm, onnx_path: Path, opset: int) -> float:
    """Export the vision tower to `onnx_path` (weights beside it), dynamic over tiles; returns the largest
    difference from PyTorch on a tile count other than the traced one."""
    return export_tile_tower(
        vision_tower(vlm), vlm.config.vision_config.image_size, vlm.dtype, onnx_path, opset
    )


def export_tile_tower(tower, size: int, dtype, onnx_path: Path, opset: int) -> float:
    """Export a tower of pixel values [tiles, 3, size, size] -> features [rows, hidden] to `onnx_path`, dynamic
    over tiles; returns the largest difference from PyTorch on a tile count other than the traced one."""
    import numpy as np
    import onnx
    import onnxruntime
    import torch

    generator = torch.Generator().manual_seed(0)
    traced = torch.randn(3, 3, size, size, generator=generator).to(dtype)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            tower,
            (traced,),
            dynamo=True,
            input_names=["pixel_values"],
            output_names=["image_features"],
            opset_version=opset,
            optimize=True,
            dynamic_shapes={"pixel_values": {0: torch.export.Dim("tiles")}},
            verbose=False,
        )
    program.save(str(onnx_path), external_data=True)
    graph = onnx.load(onnx_path, load_external_data=False).graph
    dims = {
        v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
        for v in [*graph.input, *graph.output]
    }
    # The dynamo exporter silently fixes a dimension it cannot prove dynamic: a fixed tile count would fail later.
    if not isinstance(dims["pixel_values"][0], str) or not isinstance(dims["image_features"][0], str):
        raise RuntimeError(f"the vision graph lost its dynamic tile dimension: {dims}")
    check = torch.randn(2, 3, size, size, generator=generator).to(dtype)
    session = onnxruntime.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    (ours,) = session.run(None, {"pixel_values": check.numpy()})
    with torch.no_grad():
        reference = tower.float()(check.float()).numpy()
    tower.to(dtype)
    return float(np.abs(ours.astype(np.float32) - reference).max())


def vision_description(vlm) -> dict:
    """What export.json says of the vision graph: its file, dims and the image token."""
    vision = vlm.config.vision_config
    tokens_per_tile = (vision.image_size // vision.patch_size) ** 2 // vlm.config.scale_factor**2
    return {
        "file": VISION_FILE,
        "family": "idefics3",
        "inputs": {"pixel_values": ["tiles", 3, vision.image_size, vision.image_size]},
        "outputs": {"image_features": ["image_tokens", vlm.config.text_config.hidden_size]},
        "hidden_size": vision.hidden_size,
        "num_layers": vision.num_hidden_layers,
        "num_attention_heads": vision.num_attention_heads,
        "intermediate_size": vision.intermediate_size,
        "image_size": vision.image_size,
        "patch_size": vision.patch_size,
        "patches_per_tile": (vision.image_size // vision.patch_size) ** 2,
        "tokens_per_tile": tokens_per_tile,
        "scale_factor": vlm.config.scale_factor,
        "image_token_id": int(vlm.config.image_token_id),
    }


def check_vlm_config(config, where: str) -> None:
    """Refuse VLM configs whose decoder or vision tower the export does not handle."""
    if config.model_type in ("qwen2_5_vl", "gemma3"):  # checked by their own modules
        return
    text_type = getattr(config.text_config, "model_type", None)
    if text_type != "llama":
        raise UserError(
            f"{where}: a {config.model_type} model with a {text_type!r} decoder is not supported "
            "(supported: llama)"
        )
