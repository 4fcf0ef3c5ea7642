"""Gemma 3 multimodal (`Gemma3ForConditionalGeneration`): a SigLIP tower, a projector that average-pools the patches
to `mm_tokens_per_image` rows, normalizes them (soft-embedding norm) and projects them into the decoder's width,
and the Gemma 3 decoder, which attends bidirectionally among the tokens of one image during a prefill.

The vision graph has Idefics3's contract (exporter/vlm.py: whole square images in, one row of features per image
token out, module paths `vision_model.*` and `connector`), so the partitioner cuts and the runtime runs it as it
does SmolVLM's. The decoder's masks are made in the graph from `input_ids`: causal (and the sliding window on local
layers), or-ed with "same run of image tokens", as transformers' `create_masks_for_vision_model` makes them; the
fused attention takes each mask whole as its bias with GroupQueryAttention's causal masking off (exporter/fuse.py
`mask_as_bias`). A run's tokens see one another only within one step: the runtime keeps every run in one prefill
chunk (runtime/step.py).
"""

from __future__ import annotations

import functools
from typing import Any

from pipeshard.core.errors import UserError

GEMMA3_VL_ARCHITECTURES = ("gemma3",)
# The tokenizer's image tokens (Gemma 3's names): the placeholder a prompt holds, its closing fence, and the token
# each image feature row takes.
IMAGE_TOKENS = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}
VISION_SEED = 4321
EMBED_STD = 0.1

# A tiny Gemma 3: 2 SigLIP layers over 32 px images of 4 px patches (64 patches), pooled 2 x 2 to 16 image tokens;
# the tiny Gemma 3 decoder (local layers of window 16, so the window cuts through image runs) without the final
# logit softcapping, which Gemma3ForConditionalGeneration does not apply.
TINY_GEMMA3_VL_CONFIGS: dict[str, dict[str, Any]] = {
    "gemma3_vl": {
        "vision_config": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 32,
            "patch_size": 4,
        },
        "mm_tokens_per_image": 16,
        "text_overrides": {"final_logit_softcapping": None, "tie_word_embeddings": False},
    },
}


def is_gemma3_vl(model_type: str | None) -> bool:
    return model_type in GEMMA3_VL_ARCHITECTURES


def add_image_tokens(tokenizer) -> None:
    """The image tokens as special tokens, named as Gemma 3's tokenizer names them (what Gemma3Processor reads)."""
    tokenizer.add_special_tokens(
        {"additional_special_tokens": list(IMAGE_TOKENS.values())}, replace_extra_special_tokens=False
    )
    tokenizer._set_model_specific_special_tokens(special_tokens=dict(IMAGE_TOKENS))


def _seed(model) -> None:
    """The tiny decoders' weight scale (clear greedy margins), vision weights that keep activations in range, and
    a projection that puts image features at the scale of the (scaled) text embeddings, as a trained one does."""
    import torch

    from pipeshard.exporter.tiny import TINY_SEED

    torch.manual_seed(TINY_SEED)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() < 2 or name.endswith("mm_input_projection_weight"):
                continue
            if name.startswith("model.vision_tower."):
                parameter.normal_(0.0, 1.0 / parameter[0].numel() ** 0.5)
            elif "embed" in name:  # Gemma scales embeddings by sqrt(hidden): at the layers' scale after it
                parameter.normal_(0.0, EMBED_STD)
            else:
                parameter.normal_(0.0, 0.5 if name == "lm_head.weight" else 0.15)
        text = model.config.text_config
        embedded = float(model.get_input_embeddings().weight.std()) * text.hidden_size**0.5
        projection = model.model.multi_modal_projector.mm_input_projection_weight
        projection.normal_(0.0, embedded / projection.shape[0] ** 0.5)


def build_tiny_gemma3_vl(name: str):
    """A seeded Gemma3ForConditionalGeneration of TINY_GEMMA3_VL_CONFIGS[name] with the byte tokenizer (plus the
    image tokens), and its processor (transformers' Gemma3Processor over the PIL image processor)."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from pipeshard.exporter.tiny import TINY_CONFIGS, build_byte_tokenizer

    settings = TINY_GEMMA3_VL_CONFIGS[name]
    tokenizer = build_byte_tokenizer()
    add_image_tokens(tokenizer)
    text = {k: v for k, v in TINY_CONFIGS["gemma3"].items() if k != "model_type"}
    text |= {
        **settings["text_overrides"],
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    ids = {key: tokenizer.convert_tokens_to_ids(token) for key, token in IMAGE_TOKENS.items()}
    config = Gemma3Config(
        text_config=text,
        vision_config=settings["vision_config"],
        mm_tokens_per_image=settings["mm_tokens_per_image"],
        boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"],
        image_token_index=ids["image_token"],
        tie_word_embeddings=text["tie_word_embeddings"],
    )
    torch.manual_seed(VISION_SEED)
    model = Gemma3ForConditionalGeneration(config).eval()
    _seed(model)
    return model, tokenizer, processor_for(model.config, tokenizer)


def processor_for(config, tokenizer):
    """transformers' Gemma 3 processor for a config: images resized to the tower's size, `mm_tokens_per_image`
    soft tokens each."""
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor

    size = config.vision_config.image_size
    image_processor = Gemma3ImageProcessorPil(size={"height": size, "width": size})
    return Gemma3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_length=config.mm_tokens_per_image
    )


def check_gemma3_vl(vlm, image_processor, where: str) -> None:
    """Refuse, naming it, what the export would not compute as transformers does."""
    config = vlm.config
    vision = config.vision_config
    if vision.model_type != "siglip_vision_model":
        raise UserError(
            f"{where}: a Gemma 3 vision tower of type {vision.model_type!r} is not supported (siglip)"
        )
    if getattr(image_processor, "do_pan_and_scan", False):
        raise UserError(f"{where}: Gemma 3's pan-and-scan image crops (do_pan_and_scan) are not supported")
    patches = vision.image_size // vision.patch_size
    pooled = int(config.mm_tokens_per_image**0.5)
    if pooled * pooled != config.mm_tokens_per_image or patches % pooled:
        raise UserError(
            f"{where}: mm_tokens_per_image {config.mm_tokens_per_image} is not a square grid dividing the "
            f"tower's {patches} x {patches} patches"
        )
    if getattr(config.text_config, "use_bidirectional_attention", False):
        raise UserError(f"{where}: bidirectional attention (use_bidirectional_attention) is not supported")


def image_block_masks(input_ids, attention_mask, image_token_id: int, sliding_window: int | None):
    """The decoder's boolean masks [batch, 1, new, total] for one step, as transformers' Gemma 3 makes them at a
    prefill: a query sees the keys before it and every key of its own run of image tokens in this step (both
    within the sliding window on local layers), never padding. Returns {layer type: mask}."""
    import torch

    new, total = input_ids.shape[1], attention_mask.shape[1]
    query = (torch.arange(new) + (total - new)).unsqueeze(-1)
    key = torch.arange(total).unsqueeze(0)
    # Not `input_ids == image_token_id`: the exporter would merge that with the image merge's own comparison, and
    # the masks (the prologue's) would then read a node of the embedding's sub-layer.
    is_image = (input_ids >= image_token_id) & (input_ids <= image_token_id)
    previous = torch.nn.functional.pad(is_image, (1, 0))[:, :-1]
    runs = torch.cumsum((is_image & ~previous).to(torch.int64), dim=1)
    runs = torch.where(is_image, runs, torch.zeros_like(runs))  # 0: not an image token
    key_runs = torch.cat([torch.zeros_like(runs[:, :1]).expand(-1, total - new), runs], dim=1)
    same_run = (runs.unsqueeze(-1) == key_runs.unsqueeze(1)) & (runs.unsqueeze(-1) > 0)
    visible = ((key <= query).unsqueeze(0) | same_run) & attention_mask.bool().unsqueeze(1)
    masks = {"full_attention": visible.unsqueeze(1)}
    if sliding_window:
        masks["sliding_attention"] = (visible & (query - key < sliding_window).unsqueeze(0)).unsqueeze(1)
    return masks


def text_decoder(vlm):
    """The VLM's language model and output layer in their export form (the same tensors), the masks made from the
    ids (`image_block_masks`), no final logit softcapping (Gemma3ForConditionalGeneration applies none)."""
    from pipeshard.exporter.text_decoder import language_model_decoder

    image_token_id = int(vlm.config.image_token_id)
    sliding_window = getattr(vlm.config.text_config, "sliding_window", None)
    return language_model_decoder(
        vlm,
        functools.partial(image_block_masks, image_token_id=image_token_id, sliding_window=sliding_window),
    )


def vision_tower(vlm):
    """pixel values [images, 3, S, S] -> image features [images * mm_tokens_per_image, text hidden]: the SigLIP
    tower and the pooling projector as a `tile_tower` (an image is one tile)."""
    from pipeshard.exporter.vlm import tile_tower

    return tile_tower(
        vlm.model.vision_tower,
        vlm.model.multi_modal_projector,
        lambda tower, pixels: tower.embeddings(pixels),
    )


def vision_description(vlm) -> dict:
    """What export.json says of the vision graph: Idefics3's contract (an image is one tile), its dims and the
    image token; `bidirectional_image_runs` says the decoder attends within each image's run of tokens."""
    config = vlm.config
    vision = config.vision_config
    return {
        "file": "vision.onnx",
        "family": "idefics3",
        "model": "gemma3",
        "inputs": {"pixel_values": ["tiles", 3, vision.image_size, vision.image_size]},
        "outputs": {"image_features": ["image_tokens", config.text_config.hidden_size]},
        "hidden_size": vision.hidden_size,
        "num_layers": vision.num_hidden_layers,
        "num_attention_heads": vision.num_attention_heads,
        "intermediate_size": vision.intermediate_size,
        "image_size": vision.image_size,
        "patch_size": vision.patch_size,
        "patches_per_tile": (vision.image_size // vision.patch_size) ** 2,
        "tokens_per_tile": int(config.mm_tokens_per_image),
        "image_token_id": int(config.image_token_id),
        "bidirectional_image_runs": True,
    }
