"""Which sub-layer each exported node belongs to: one rule table per architecture family (data).

A node's module path is the innermost torch module scope the exporter recorded on it
(`pkg.torch.onnx.name_scopes`). The first rule whose pattern matches the path decides; `{0}` in the
sub-layer name is the first captured group (the layer index). `glue` nodes sit directly in a
decoder layer (the residual adds) and join the sub-layer whose output they consume.
"""

from __future__ import annotations

import re

GLUE = "glue"

# (pattern on the module path, sub-layer); applied in order, first match wins.
DECODER_RULES: list[tuple[str, str]] = [
    (r"(?:^|\.)layers\.(\d+)\.(input_layernorm|self_attn)(\..*)?$", "L{0}.attn"),
    (r"(?:^|\.)layers\.(\d+)\.(post_attention_layernorm|mlp)(\..*)?$", "L{0}.ffn"),
    (r"(?:^|\.)layers\.(\d+)$", "L{0}." + GLUE),
    (r"(?:^|\.)embed_tokens$|^image_merge$", "embed"),  # a VLM decoder's image merge (exporter/vlm.py) too
    (r"(?:^|\.)model\.norm$|(?:^|\.)lm_head$", "final"),
    (r"(?:^|\.)rotary_emb$|(?:^|\.)model$|^lm$|^$", "prologue"),
]

# Gemma 3 normalises the attention's output before the residual add (`post_attention_layernorm`) and wraps the
# FFN in `pre_feedforward_layernorm` / `post_feedforward_layernorm`.
GEMMA3_RULES: list[tuple[str, str]] = [
    (r"(?:^|\.)layers\.(\d+)\.(input_layernorm|self_attn|post_attention_layernorm)(\..*)?$", "L{0}.attn"),
    (
        r"(?:^|\.)layers\.(\d+)\.(pre_feedforward_layernorm|mlp|post_feedforward_layernorm)(\..*)?$",
        "L{0}.ffn",
    ),
    *DECODER_RULES[2:],
]

# MoE layers as exporter/moe_blocks.py writes them; dense layers of the same model (Qwen3-MoE's
# `mlp_only_layers`) fall through to the decoder rules.
MOE_RULES: list[tuple[str, str]] = [
    (r"(?:^|\.)layers\.(\d+)\.mlp\.router(\..*)?$", "L{0}.router"),
    (r"(?:^|\.)layers\.(\d+)\.mlp\.experts\.(\d+)(\..*)?$", "L{0}.expert{1}"),
    (r"(?:^|\.)layers\.(\d+)\.mlp\.combine$", "L{0}.combine"),
    *DECODER_RULES,
]

# A VLM's vision tower (exporter/vlm.py: `vision_model` and `connector` of Idefics3 / SmolVLM).
VISION_RULES: list[tuple[str, str]] = [
    (r"(?:^|\.)encoder\.layers\.(\d+)\.(layer_norm1|self_attn)(\..*)?$", "V{0}.attn"),
    (r"(?:^|\.)encoder\.layers\.(\d+)\.(layer_norm2|mlp)(\..*)?$", "V{0}.ffn"),
    (r"(?:^|\.)encoder\.layers\.(\d+)$", "V{0}." + GLUE),
    (r"(?:^|\.)vision_model\.embeddings(\..*)?$", "vision_embed"),
    (r"(?:^|\.)vision_model\.post_layernorm$|(?:^|\.)connector(\..*)?$", "projector"),
    (r"(?:^|\.)vision_model$|^_empty_nn_module_stack_from_metadata_hook$|^$", "prologue"),
]

# Qwen2.5-VL's vision tower in its export form (exporter/qwen_vl.py: `patch_embed`, `blocks`, `merger`).
QWEN_VISION_RULES: list[tuple[str, str]] = [
    (r"(?:^|\.)blocks\.(\d+)\.(norm1|attn)(\..*)?$", "V{0}.attn"),
    (r"(?:^|\.)blocks\.(\d+)\.(norm2|mlp)(\..*)?$", "V{0}.ffn"),
    (r"(?:^|\.)blocks\.(\d+)$", "V{0}." + GLUE),
    (r"(?:^|\.)patch_embed(\..*)?$", "vision_embed"),
    (r"(?:^|\.)merger(\..*)?$", "projector"),
    (r"^_empty_nn_module_stack_from_metadata_hook$|^$", "prologue"),
]
# A CLIP / SigLIP tower with a LLaVA projector in the same form (exporter/vision_tower.py); CLIP's pre-norm joins
# the embedding.
LLAVA_VISION_RULES: list[tuple[str, str]] = [
    (r"(?:^|\.)vision_model\.pre_layrnorm$", "vision_embed"),
    *VISION_RULES,
]
VISION_RULES_BY_FAMILY = {
    "idefics3": VISION_RULES,
    "qwen2_vl": QWEN_VISION_RULES,
    "llava": LLAVA_VISION_RULES,
}

RULES_BY_ARCHITECTURE: dict[str, list[tuple[str, str]]] = {
    "llama": DECODER_RULES,
    "mistral": DECODER_RULES,
    "qwen2": DECODER_RULES,
    "qwen3": DECODER_RULES,
    "qwen3_moe": MOE_RULES,
    "mixtral": MOE_RULES,
    "phi3": DECODER_RULES,
    "gemma3_text": GEMMA3_RULES,
    "qwen2_5_vl_text": DECODER_RULES,
}


def sub_layer_candidates(path: str, rules: list[tuple[str, str]]) -> list[str]:
    """Every sub-layer whose rule matches `path` (a well-formed table gives exactly one)."""
    found = []
    for pattern, template in rules:
        match = re.search(pattern, path)
        if match:
            found.append(template.format(*match.groups()))
    return found


def classify(path: str, rules: list[tuple[str, str]]) -> str | None:
    """The sub-layer of a module path by the first matching rule, or None."""
    candidates = sub_layer_candidates(path, rules)
    return candidates[0] if candidates else None
