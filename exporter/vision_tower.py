"""The generic vision path: any "vision tower + projector + decoder" model that transformers describes by its
config (LLaVA's layout), exported without code for its family.

What fits: a CLIP or SigLIP vision tower (`vision_config.model_type`), one feature layer (`vision_feature_layer`)
taken with or without its first row (`vision_feature_select_strategy`: `default` drops the class token, `full`
keeps every row), a projector of two linear layers around `projector_hidden_act`, a decoder pipeshard exports,
and the image features placed at the image token's positions, one fixed-size image making one run of tokens
whose length the processor gives. Anything else is refused with one line naming what does not fit; the export
also checks the tower it builds against transformers' own `get_image_features`, so a model whose forward does
more than its config says (a scale, a norm) is refused rather than exported wrong.

The vision graph has Idefics3's form (exporter/vlm.py): `pixel_values` [images, 3, S, S] -> `image_features`
[image tokens, text hidden], and keeps only the tower's layers up to the selected one.
"""

from __future__ import annotations

from typing import Any

from pipeshard.core.errors import UserError

FAMILY = "llava"  # export.json's vision family and preprocessing family of this path
TOWER_TYPES = ("clip_vision_model", "siglip_vision_model")
SELECT_STRATEGIES = ("default", "full")
IMAGE_TOKEN = "<image>"
PROJECTOR = "multi_modal_projector"
VISION_SEED = 4321

# Tiny random models: a CLIP tower (class token, feature layer -2 of 3, the class token dropped) before a Llama
# decoder, and a SigLIP tower (no class token, the last layer, every row) before a Qwen2 decoder; 32 px images
# of 8 px patches.
_TINY_TOWER = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "image_size": 32,
    "patch_size": 8,
}
TINY_LLAVA_CONFIGS: dict[str, dict[str, Any]] = {
    "llava": {
        "vision_config": {"model_type": "clip_vision_model", **_TINY_TOWER, "num_hidden_layers": 3},
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "projector_hidden_act": "gelu",
        "text": "llama",
    },
    "llava_siglip": {
        "vision_config": {"model_type": "siglip_vision_model", **_TINY_TOWER, "num_hidden_layers": 2},
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "full",
        "projector_hidden_act": "gelu_pytorch_tanh",
        "text": "qwen2",
    },
}


def has_vision_and_text(config: dict) -> bool:
    """Whether a config.json describes a vision tower beside a decoder (a candidate for this path)."""
    return isinstance(config.get("vision_config"), dict) and isinstance(config.get("text_config"), dict)


def check_config(config, where: str) -> None:
    """Refuse, in one line naming it, what of a transformers config the generic path does not describe."""
    from pipeshard.exporter.configs import SUPPORTED_ARCHITECTURES

    tower = getattr(config.vision_config, "model_type", None)
    if tower not in TOWER_TYPES:
        raise UserError(
            f"{where}: a {config.model_type} model with a {tower!r} vision tower does not fit the generic "
            f"vision path (vision_config.model_type: {' or '.join(TOWER_TYPES)})"
        )
    decoder = getattr(config.text_config, "model_type", None)
    if decoder not in SUPPORTED_ARCHITECTURES:
        raise UserError(
            f"{where}: a {config.model_type} model with a {decoder!r} decoder does not fit the generic vision path "
            f"(text_config.model_type: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    for field in ("vision_feature_layer", "vision_feature_select_strategy", "projector_hidden_act"):
        if getattr(config, field, None) is None:
            raise UserError(
                f"{where}: a {config.model_type} model without {field} does not fit the generic vision path"
            )
    layer = config.vision_feature_layer
    if not isinstance(layer, int):
        raise UserError(
            f"{where}: vision_feature_layer {layer} selects several layers; the generic vision path takes one"
        )
    layers = config.vision_config.num_hidden_layers
    if not -(layers + 1) <= layer <= layers:
        raise UserError(f"{where}: vision_feature_layer {layer} is outside the tower's {layers} layers")
    if config.vision_feature_select_strategy not in SELECT_STRATEGIES:
        raise UserError(
            f"{where}: vision_feature_select_strategy {config.vision_feature_select_strategy!r} is not one of "
            f"{', '.join(SELECT_STRATEGIES)}"
        )
    if getattr(config, "image_token_id", None) is None:
        raise UserError(
            f"{where}: a {config.model_type} model without image_token_id does not fit the generic vision path"
        )


def check_modules(vlm, where: str) -> None:
    """The loaded model holds its tower as `vision_tower` and a linear-activation-linear `multi_modal_projector`."""
    import torch

    inner = getattr(vlm, "model", None)
    for name in ("vision_tower", PROJECTOR, "language_model"):
        if not isinstance(getattr(inner, name, None), torch.nn.Module):
            raise UserError(
                f"{where}: {type(vlm).__name__} has no model.{name}; the generic vision path needs one"
            )
    kinds = [type(module).__name__ for module in getattr(inner, PROJECTOR).children()]
    linear = [isinstance(module, torch.nn.Linear) for module in getattr(inner, PROJECTOR).children()]
    if len(kinds) != 3 or linear != [True, False, True]:
        raise UserError(
            f"{where}: the projector ({PROJECTOR}: {', '.join(kinds)}) is not a projector the generic vision "
            "path knows (Linear, activation, Linear)"
        )


def selected_layers(config) -> int:
    """How many tower layers produce the selected hidden state (hidden_states[0] is the embeddings')."""
    return config.vision_feature_layer % (config.vision_config.num_hidden_layers + 1)


def class_tokens(config) -> int:
    """Rows the tower puts before its patches: CLIP's class token; SigLIP has none."""
    return 1 if config.vision_config.model_type == "clip_vision_model" else 0


def tokens_per_image(config) -> int:
    """Image features per image: every patch row, the class token's too, less the first row under `default`."""
    vision = config.vision_config
    rows = (vision.image_size // vision.patch_size) ** 2 + class_tokens(config)
    return rows - (1 if config.vision_feature_select_strategy == "default" else 0)


def check_processor(processor, config, where: str) -> None:
    """The processor makes images of the tower's size and expands each into as many tokens as the tower gives."""
    size = config.vision_config.image_size
    pixels = processor.image_processor(images=[_probe_image()], return_tensors="np")["pixel_values"]
    if tuple(pixels.shape[-2:]) != (size, size):
        raise UserError(
            f"{where}: the image processor makes {pixels.shape[-1]}x{pixels.shape[-2]} images but the vision tower "
            f"takes {size}x{size}"
        )
    counted = processor(text=IMAGE_TOKEN, images=[_probe_image()], return_tensors="np")["input_ids"]
    image_tokens = int((counted == config.image_token_id).sum())
    if image_tokens != tokens_per_image(config):
        raise UserError(
            f"{where}: the processor expands an image into {image_tokens} image tokens but the tower and "
            f"vision_feature_select_strategy give {tokens_per_image(config)} features"
        )


def _probe_image():
    from PIL import Image

    return Image.new("RGB", (47, 31), (120, 60, 200))


def load_folder(folder, where: str):
    """A Hugging Face folder of a model that fits: the model, its tokenizer and image processor."""
    import torch
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    try:
        config = AutoConfig.from_pretrained(folder)
    except (
        ValueError,
        TypeError,
        KeyError,
        StrictDataclassError,
    ) as exc:  # transformers validates known fields
        raise UserError(
            f"{where}: transformers refuses its config.json: {' '.join(str(exc).split())}"
        ) from None
    check_config(config, where)
    try:
        vlm = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    except ValueError as exc:  # no image-text-to-text class for this model type
        raise UserError(f"{where}: transformers has no image-text model for it ({exc})") from None
    check_modules(vlm, where)
    try:
        processor = AutoProcessor.from_pretrained(folder, use_fast=False)
    except (OSError, ValueError, TypeError) as exc:
        raise UserError(f"{where}: no usable processor ({exc})") from None
    if not hasattr(processor, "image_processor") or not hasattr(processor, "tokenizer"):
        raise UserError(
            f"{where}: the processor ({type(processor).__name__}) has no image processor and tokenizer"
        )
    if getattr(processor, "image_token", IMAGE_TOKEN) != IMAGE_TOKEN:
        raise UserError(
            f"{where}: the processor's image token is {processor.image_token!r}, not {IMAGE_TOKEN!r}"
        )
    check_processor(processor, vlm.config, where)
    return vlm, processor.tokenizer, processor.image_processor


def build_tiny(name: str):
    """A seeded tiny model of TINY_LLAVA_CONFIGS[name] with the byte tokenizer (plus `<image>`), and its processor
    (transformers' LlavaProcessor over the tower's own image processor)."""
    import torch
    from transformers import AutoConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    from pipeshard.exporter.tiny import TINY_CONFIGS, TINY_SEED, build_byte_tokenizer, tiny_config

    settings = TINY_LLAVA_CONFIGS[name]
    tokenizer = build_byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    vision = dict(settings["vision_config"])
    config = LlavaConfig(
        vision_config=AutoConfig.for_model(vision.pop("model_type"), **vision),
        text_config=tiny_config(TINY_CONFIGS[settings["text"]], tokenizer),
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_layer=settings["vision_feature_layer"],
        vision_feature_select_strategy=settings["vision_feature_select_strategy"],
        projector_hidden_act=settings["projector_hidden_act"],
        pad_token_id=tokenizer.pad_token_id,
    )
    config.image_seq_length = tokens_per_image(config)
    torch.manual_seed(TINY_SEED)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if parameter.dim() < 2:
                continue
            if parameter_name.startswith(("model.vision_tower.", f"model.{PROJECTOR}.")):
                parameter.normal_(0.0, 1.0 / parameter[0].numel() ** 0.5)
            else:  # the tiny decoders' scale (exporter/tiny.py): clear greedy margins
                parameter.normal_(0.0, 0.5 if "embed" in parameter_name else 0.15)
        # image features at the scale of the text embeddings, as a trained projector gives
        getattr(model.model, PROJECTOR).linear_2.weight.mul_(float(model.get_input_embeddings().weight.std()))
    model.tie_weights()
    processor = LlavaProcessor(
        image_processor=_tiny_image_processor(config.vision_config),
        tokenizer=tokenizer,
        patch_size=config.vision_config.patch_size,
        vision_feature_select_strategy=config.vision_feature_select_strategy,
        num_additional_image_tokens=class_tokens(config),
        image_token=IMAGE_TOKEN,
    )
    return model, processor


def _tiny_image_processor(vision):
    """The tower's own image processor (the PIL one) at the tower's image size."""
    from transformers import CLIPImageProcessorPil, SiglipImageProcessorPil

    size = vision.image_size
    if vision.model_type == "clip_vision_model":
        return CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    return SiglipImageProcessorPil(size={"height": size, "width": size})


def text_decoder(vlm):
    """The model's language model as a plain causal LM (same weight tensors), what the decoder export traces."""
    from pipeshard.exporter.text_decoder import causal_lm_copy

    return causal_lm_copy(vlm, vlm.model.language_model.state_dict())


def vision_tower(vlm):
    """pixel values [images, 3, S, S] -> image features [images * tokens per image, text hidden]: the embeddings
    (and CLIP's pre-norm), the layers up to the selected one, the selected rows, the projector."""
    import torch

    config = vlm.config
    layers, drop_first = selected_layers(config), config.vision_feature_select_strategy == "default"

    class VisionTower(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            tower = vlm.model.vision_tower  # transformers 5's CLIPVisionModel holds its layers itself
            self.vision_model = getattr(tower, "vision_model", tower)
            self.connector = getattr(vlm.model, PROJECTOR)

        def forward(self, pixel_values):
            tower = self.vision_model
            hidden = tower.embeddings(pixel_values)
            if hasattr(tower, "pre_layrnorm"):  # CLIP
                hidden = tower.pre_layrnorm(hidden)
            for layer in tower.encoder.layers[:layers]:
                hidden = layer(hidden, None)  # whole images: no mask
            if drop_first:
                hidden = hidden[:, 1:]
            features = self.connector(hidden)
            return features.reshape(-1, features.shape[-1])

    return VisionTower().eval()


def check_against_transformers(vlm, tower, where: str) -> float:
    """The largest difference between the tower built from the config and transformers' `get_image_features`
    on two images; a model whose forward does something else is refused."""
    import torch

    size = vlm.config.vision_config.image_size
    pixels = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1)).to(vlm.dtype)
    with torch.no_grad():
        ours = tower(pixels)
        try:
            theirs = vlm.model.get_image_features(pixel_values=pixels, return_dict=True).pooler_output
        except (TypeError, ValueError, RuntimeError) as exc:
            raise UserError(
                f"{where}: transformers' get_image_features does not take plain pixels ({exc})"
            ) from None
        theirs = torch.cat(list(theirs)).reshape(-1, ours.shape[-1]) if len(theirs) else None
    if theirs is None or theirs.shape != ours.shape:
        raise UserError(
            f"{where}: transformers gives image features of shape {None if theirs is None else tuple(theirs.shape)}, "
            f"the generic vision path {tuple(ours.shape)}: the model does not fit it"
        )
    difference = float((ours - theirs).abs().max())
    if not difference <= 1e-4 * max(1.0, float(theirs.abs().max())):
        raise UserError(
            f"{where}: transformers' image features differ from a {config_summary(vlm.config)} by {difference:.3g}: "
            "the model does more than its config describes"
        )
    return difference


def config_summary(config) -> str:
    """The tower, layer, strategy and projector the config describes, in words."""
    return (
        f"{config.vision_config.model_type} tower's layer {config.vision_feature_layer} "
        f"({config.vision_feature_select_strategy}) through a {config.projector_hidden_act} MLP projector"
    )


def vision_description(vlm) -> dict:
    """What export.json says of the vision graph: its file, dims, the feature selection and the image token."""
    config = vlm.config
    vision = config.vision_config
    return {
        "file": "vision.onnx",
        "family": FAMILY,
        "inputs": {"pixel_values": ["images", 3, vision.image_size, vision.image_size]},
        "outputs": {"image_features": ["image_tokens", config.text_config.hidden_size]},
        "tower": vision.model_type,
        "hidden_size": vision.hidden_size,
        "num_layers": selected_layers(config),  # the layers the graph keeps
        "num_attention_heads": vision.num_attention_heads,
        "intermediate_size": vision.intermediate_size,
        "image_size": vision.image_size,
        "patch_size": vision.patch_size,
        "patches_per_tile": (vision.image_size // vision.patch_size) ** 2 + class_tokens(config),
        "tokens_per_tile": tokens_per_image(config),
        "vision_feature_layer": config.vision_feature_layer,
        "vision_feature_select_strategy": config.vision_feature_select_strategy,
        "projector": {"kind": "mlp", "activation": config.projector_hidden_act},
        "image_token_id": int(config.image_token_id),
    }


def export_vision(vlm, onnx_path, opset: int, where: str) -> float:
    """Export the tower built from the config (checked first against transformers' image features), dynamic
    over images; returns the largest difference of the ONNX graph from PyTorch."""
    from pipeshard.exporter.vlm import export_tile_tower

    tower = vision_tower(vlm)
    check_against_transformers(vlm, tower, where)
    return export_tile_tower(tower, vlm.config.vision_config.image_size, vlm.dtype, onnx_path, opset)
