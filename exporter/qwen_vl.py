"""Qwen2.5-VL (the Cosmos-Reason1 family): a native-resolution vision tower with windowed and full-attention
blocks, and a decoder with M-RoPE (three position rows: time, row, column).

The vision graph keeps every data-dependent step out of the graph: the host computes the window order, the
2-D rotary positions and the attention groups (runtime/images.py `qwen2_5_vl_vision_inputs`) and passes them
as inputs. Attention runs over groups padded to one length (the windows, or each image in the full-attention
blocks) as a batch through the fused attention op, so no patches x patches tensor is built; a gather puts every
patch back in its row afterwards. The padding is masked without a mask tensor (ONNX Runtime's Attention takes a
mask only as wide as queries x keys): queries and keys carry KEY_CHANNELS more channels, 1 and 0 on the query's,
the key's padding bias (0 or PAD_KEY_SCORE) and 0 on the key's, so a padded key scores PAD_KEY_SCORE and a real
one exactly what it did (the scale stays the head's own).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

QWEN_VL_ARCHITECTURES = ("qwen2_5_vl",)
QWEN_IMAGE_TOKENS = ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>")
# Graph inputs of vision.onnx besides pixel_values (what runtime/images.py computes from the image grids).
VISION_INDEX_INPUTS = (
    "window_index",
    "reverse_index",
    "rotary_ids",
    "window_rows",
    "window_slots",
    "image_rows",
    "image_slots",
)

# A tiny Qwen2.5-VL: 4 vision blocks (1 and 3 full attention) of 8 px patches, windows of 32 px (4 x 4 patches),
# merge 2 -> a 64 x 48 image gives 12 image tokens; a decoder of the tiny Llama's size with M-RoPE.
TINY_QWEN_VL_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2_5_vl": {
        "vision_config": {
            "depth": 4,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 8,
            "window_size": 32,
            "fullatt_block_indexes": [1, 3],
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        "text_config": {
            "hidden_size": 64,
            "intermediate_size": 160,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 512,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            "tie_word_embeddings": False,
        },
        "processor": {"min_pixels": 16 * 16 * 4, "max_pixels": 16 * 16 * 64},
    },
}
# Cosmos-Reason1-7B is a Qwen2.5-VL-7B: its vision tower and decoder dimensions (few decoder layers allowed).
COSMOS_REASON1_7B = {
    "vision_config": {
        "depth": 32,
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "patch_size": 14,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": 3584,
    },
    "text_config": {
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 128000,
        "vocab_size": 152064,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
        "tie_word_embeddings": False,
    },
    "image_token_id": 151655,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
}
COSMOS_NAME = "cosmos-reason1-7b"
# For measuring the encoder's memory on this CPU: Cosmos-Reason1-7B's vision tower dimensions with 4 of its 32
# blocks (the last one full attention, as every eighth is), one decoder layer of its dimensions, random weights,
# the byte tokenizer, the checkpoint's pixel bounds.
QWEN_VL_PROBES: dict[str, dict[str, Any]] = {
    "cosmos-reason1-7b-probe": {
        "vision_config": {**COSMOS_REASON1_7B["vision_config"], "depth": 4, "fullatt_block_indexes": [3]},
        "text_config": {
            **{k: v for k, v in COSMOS_REASON1_7B["text_config"].items() if k != "vocab_size"},
            "num_hidden_layers": 1,
        },
        "processor": {"min_pixels": 56 * 56, "max_pixels": 16384 * 28 * 28},
    },
}
VISION_SEED = 4321
KEY_CHANNELS = 8  # keeps the head size a multiple of 8 (what fused kernels want)
PAD_KEY_SCORE = -30000.0  # within half precision's range; exp() of it times any head's scale is 0


def is_qwen_vl(model_type: str | None) -> bool:
    return model_type in QWEN_VL_ARCHITECTURES


def _seed(model) -> None:
    """The tiny decoders' weight scale (clear greedy margins) and vision weights that keep activations in range;
    the merger's output at the scale of the text embeddings, as a trained one gives."""
    import torch

    from pipeshard.exporter.tiny import TINY_SEED

    torch.manual_seed(TINY_SEED)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() < 2:
                continue
            if name.startswith("model.visual."):
                parameter.normal_(0.0, 1.0 / parameter[0].numel() ** 0.5)
            else:
                parameter.normal_(0.0, 0.5 if "embed" in name else 0.15)
        table = model.get_input_embeddings().weight
        model.model.visual.merger.mlp[2].weight.mul_(float(table.std()))


def build_tiny_qwen_vl(name: str):
    """A seeded Qwen2.5-VL of TINY_QWEN_VL_CONFIGS[name] (or QWEN_VL_PROBES[name]) with the byte tokenizer (plus
    the image tokens), and its processor's pixel bounds."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from pipeshard.exporter.tiny import build_byte_tokenizer

    settings = TINY_QWEN_VL_CONFIGS.get(name) or QWEN_VL_PROBES[name]
    tokenizer = build_byte_tokenizer()
    tokenizer.add_special_tokens(
        {"additional_special_tokens": list(QWEN_IMAGE_TOKENS)}, replace_extra_special_tokens=False
    )
    image, start, end = (tokenizer.convert_tokens_to_ids(t) for t in QWEN_IMAGE_TOKENS)
    text = {
        **settings["text_config"],
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    vision = {**settings["vision_config"], "out_hidden_size": text["hidden_size"]}
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=image,
        vision_start_token_id=start,
        vision_end_token_id=end,
        tie_word_embeddings=text["tie_word_embeddings"],
    )
    torch.manual_seed(VISION_SEED)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    _seed(model)
    return model, tokenizer, settings["processor"]


def cosmos_config(decoder_layers: int | None = None, vision_depth: int | None = None):
    """The Cosmos-Reason1-7B-shaped Qwen2_5_VLConfig (fewer decoder layers or vision blocks if given)."""
    from transformers import Qwen2_5_VLConfig

    text = dict(COSMOS_REASON1_7B["text_config"])
    vision = dict(COSMOS_REASON1_7B["vision_config"])
    if decoder_layers:
        text["num_hidden_layers"] = decoder_layers
    if vision_depth:
        vision["depth"] = vision_depth
        vision["fullatt_block_indexes"] = [
            i for i in vision["fullatt_block_indexes"] if i < vision_depth
        ] or [vision_depth - 1]
    ids = {k: v for k, v in COSMOS_REASON1_7B.items() if k.endswith("_id")}
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)


def text_decoder(vlm):
    """The VLM's language model and output layer as the decoder export traces them (the same tensors)."""
    from pipeshard.exporter.text_decoder import language_model_decoder

    return language_model_decoder(vlm)


def vision_tower(vlm):
    """The vision tower in its export form: pixel_values [patches, C * T * P * P] and the host's index inputs
    (VISION_INDEX_INPUTS) -> image features [image tokens, text hidden], in reading order. Shares the VLM's
    weight tensors; module paths `visual.patch_embed`, `visual.blocks.N.{norm1,attn,norm2,mlp}`, `visual.merger`."""
    import torch

    visual = vlm.model.visual
    config = vlm.config.vision_config
    unit = config.spatial_merge_size**2
    heads = config.num_heads
    head_dim = config.hidden_size // heads

    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    class PatchEmbed(torch.nn.Module):
        """The patch projection, its rows then put in window order (whole merge units move)."""

        def __init__(self) -> None:
            super().__init__()
            self.proj = visual.patch_embed.proj

        def forward(self, pixel_values, window_index):
            patches = pixel_values.reshape(
                -1, config.in_channels, config.temporal_patch_size, config.patch_size, config.patch_size
            )
            hidden = self.proj(patches).reshape(-1, config.hidden_size)
            hidden = hidden.reshape(-1, unit, config.hidden_size).index_select(0, window_index)
            return hidden.reshape(1, -1, config.hidden_size)  # the residual stream: [1, patches, hidden]

    class GroupedAttention(torch.nn.Module):
        """Attention within groups of patches: rows [groups, length] gathers each group (padding masked as keys),
        fused attention runs the groups as a batch, slots [patches] gathers each patch's output back."""

        def __init__(self, attention) -> None:
            super().__init__()
            self.qkv, self.proj = attention.qkv, attention.proj

        def forward(self, hidden, cos, sin, rows, query_extra, key_extra, slots):
            count = hidden.shape[1]
            q, k, v = self.qkv(hidden).reshape(count, 3, heads, head_dim).permute(1, 0, 2, 3).unbind(0)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            groups = rows.shape
            q, k, v = (
                t.index_select(0, rows.reshape(-1)).reshape(*groups, heads, head_dim).transpose(1, 2)
                for t in (q, k, v)
            )
            q = torch.cat([q, query_extra.expand(groups[0], heads, groups[1], KEY_CHANNELS)], dim=-1)
            k = torch.cat([k, key_extra.expand(groups[0], heads, groups[1], KEY_CHANNELS)], dim=-1)
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=head_dim**-0.5)
            out = out.transpose(1, 2).reshape(-1, config.hidden_size).index_select(0, slots)
            return self.proj(out).unsqueeze(0)

    class Block(torch.nn.Module):
        def __init__(self, block) -> None:
            super().__init__()
            self.norm1, self.norm2, self.mlp = block.norm1, block.norm2, block.mlp
            self.attn = GroupedAttention(block.attn)

        def forward(self, hidden, cos, sin, rows, query_extra, key_extra, slots):
            hidden = hidden + self.attn(self.norm1(hidden), cos, sin, rows, query_extra, key_extra, slots)
            return hidden + self.mlp(self.norm2(hidden))

    class Merger(torch.nn.Module):
        """The patch merger, its rows then put back in reading order."""

        def __init__(self) -> None:
            super().__init__()
            self.ln_q, self.mlp = visual.merger.ln_q, visual.merger.mlp

        def forward(self, hidden, reverse_index):
            merged = self.mlp(self.ln_q(hidden).reshape(-1, unit * config.hidden_size))
            return merged.index_select(0, reverse_index)

    class Tower(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.patch_embed = PatchEmbed()
            self.blocks = torch.nn.ModuleList(Block(block) for block in visual.blocks)
            self.merger = Merger()
            self.register_buffer("inv_freq", visual.rotary_pos_emb.inv_freq.clone(), persistent=False)
            self.full = set(config.fullatt_block_indexes)

        def forward(
            self,
            pixel_values,
            window_index,
            reverse_index,
            rotary_ids,
            window_rows,
            window_slots,
            image_rows,
            image_slots,
        ):
            hidden = self.patch_embed(pixel_values, window_index)
            # 2-D rotary: row and column angles side by side, the halves repeated; rows in window order.
            angles = (rotary_ids.unsqueeze(-1).float() * self.inv_freq).reshape(rotary_ids.shape[0], -1)
            angles = angles.reshape(-1, unit, angles.shape[-1]).index_select(0, window_index)
            angles = torch.cat([angles, angles], dim=-1).reshape(-1, 1, head_dim)
            cos, sin = angles.cos(), angles.sin()
            query_extra = torch.cat(
                [hidden.new_ones(1, 1, 1, 1), hidden.new_zeros(1, 1, 1, KEY_CHANNELS - 1)], -1
            )
            groups = {}
            for kind, rows, slots in (
                ("window", window_rows, window_slots),
                ("image", image_rows, image_slots),
            ):
                bias = torch.where(rows >= 0, 0.0, PAD_KEY_SCORE).to(hidden.dtype)
                key_extra = torch.cat(
                    [
                        bias[:, None, :, None],
                        bias.new_zeros(1, 1, 1, KEY_CHANNELS - 1).expand(
                            *bias.shape[:1], 1, bias.shape[1], KEY_CHANNELS - 1
                        ),
                    ],
                    dim=-1,
                )
                groups[kind] = (rows.clamp(min=0), query_extra, key_extra, slots)
            for index, block in enumerate(self.blocks):
                hidden = block(hidden, cos, sin, *groups["image" if index in self.full else "window"])
            return self.merger(hidden, reverse_index)

    return Tower().eval()


def _vision_inputs(grid_thw, config: dict):
    """The vision graph's inputs for a grid, made by the runtime's own code (what a host runs)."""
    import numpy as np

    from pipeshard.formats.vision_inputs import qwen2_5_vl_vision_inputs

    return qwen2_5_vl_vision_inputs(np.asarray(grid_thw, dtype=np.int64), config)


def _reference_features(vlm, pixel_values, grid_thw):
    import torch

    with torch.no_grad():
        out = vlm.model.visual(pixel_values, grid_thw=torch.as_tensor(grid_thw))
    return out.pooler_output.float().numpy()


def _example(vlm, grids, preprocessing: dict, generator):
    """Random pixels for images of `grids` and the host's index inputs for them."""
    import numpy as np
    import torch

    config = vlm.config.vision_config
    width = config.in_channels * config.temporal_patch_size * config.patch_size**2
    grids = np.asarray(grids, dtype=np.int64)
    patches = int((grids[:, 0] * grids[:, 1] * grids[:, 2]).sum())
    pixels = torch.randn(patches, width, generator=generator)
    inputs = _vision_inputs(grids, preprocessing)
    return pixels, grids, {name: torch.from_numpy(inputs[name]) for name in VISION_INDEX_INPUTS}


def trace_vision(vlm, onnx_path: Path, opset: int, preprocessing: dict, shape_only: bool = False) -> None:
    """Trace the vision tower's export form into `onnx_path`, dynamic over patches, windows and images (checked:
    the dynamo exporter silently fixes a dimension it cannot prove dynamic). `shape_only`: the VLM's weights are on
    the meta device and the file's weights are references to a data file that is not written."""
    import onnx
    import torch

    from pipeshard.exporter.onnx_export import _stand_in_weights, _weights_as_references

    tower = vision_tower(vlm)
    merge = vlm.config.vision_config.spatial_merge_size
    # Traced on two images of different grids (no dimension equals another by chance).
    pixels, _, indices = _example(
        vlm,
        [[1, 6 * merge // 2, 10 * merge // 2], [1, 4 * merge // 2, 4 * merge // 2]],
        preprocessing,
        torch.Generator().manual_seed(0),
    )
    args = (pixels, *indices.values())
    if shape_only:
        args = tuple(arg.to("meta") for arg in args)
    dim = torch.export.Dim
    dynamic = {
        "pixel_values": {0: dim("patches")},
        "window_index": {0: dim("merged")},
        "reverse_index": {0: dim("merged_")},
        "rotary_ids": {0: dim("patches_")},
        "window_rows": {0: dim("windows"), 1: dim("window_length")},
        "window_slots": {0: dim("patches__")},
        "image_rows": {0: dim("images"), 1: dim("image_length")},
        "image_slots": {0: dim("patches___")},
    }
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            tower,
            args,
            dynamo=True,
            input_names=["pixel_values", *VISION_INDEX_INPUTS],
            output_names=["image_features"],
            opset_version=opset,
            optimize=not shape_only,
            dynamic_shapes=dynamic,
            verbose=False,
        )
    if shape_only:
        import onnx_ir as ir

        _stand_in_weights(program.model.graph)
        program.optimize()
        _weights_as_references(program.model.graph, onnx_path.name + ".data")
        onnx.save(ir.to_proto(program.model), str(onnx_path))
    else:
        program.save(str(onnx_path), external_data=True)
    graph = onnx.load(onnx_path, load_external_data=False).graph
    dims = {
        v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
        for v in [*graph.input, *graph.output]
    }
    # The dynamo exporter silently fixes a dimension it cannot prove dynamic: a fixed count would fail later.
    fixed = {
        name: shape
        for name, shape in dims.items()
        if not isinstance(shape[0], str) or (name.endswith("_rows") and not isinstance(shape[1], str))
    }
    if fixed:
        raise RuntimeError(f"the vision graph lost dynamic dimensions: {fixed}")


def export_vision(vlm, onnx_path: Path, opset: int, preprocessing: dict) -> float:
    """Export the vision tower to `onnx_path` (weights beside it); returns the largest difference from
    transformers' tower on two image grids other than the traced one (one image, and two of other sizes)."""
    import numpy as np
    import onnxruntime
    import torch

    trace_vision(vlm, onnx_path, opset, preprocessing)
    merge = vlm.config.vision_config.spatial_merge_size
    generator = torch.Generator().manual_seed(1)
    session = onnxruntime.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    worst = 0.0
    for grids in ([[1, 2 * merge, 3 * merge]], [[1, 8 * merge // 2, 6 * merge // 2], [1, merge, 2 * merge]]):
        pixels, grid, indices = _example(vlm, grids, preprocessing, generator)
        (ours,) = session.run(
            None, {"pixel_values": pixels.numpy(), **{name: value.numpy() for name, value in indices.items()}}
        )
        worst = max(worst, float(np.abs(ours - _reference_features(vlm, pixels, grid)).max()))
    return worst


def vision_description(vlm) -> dict:
    """What export.json says of the vision graph: its file, inputs, dims and the image token."""
    vision = vlm.config.vision_config
    text = vlm.config.text_config
    return {
        "file": "vision.onnx",
        "family": "qwen2_vl",
        "inputs": {
            "pixel_values": [
                "patches",
                vision.in_channels * vision.temporal_patch_size * vision.patch_size**2,
            ],
            "window_index": ["merged_patches"],
            "reverse_index": ["merged_patches"],
            "rotary_ids": ["patches", 2],
            "window_rows": ["windows", "window_length"],
            "window_slots": ["patches"],
            "image_rows": ["images", "image_length"],
            "image_slots": ["patches"],
        },
        "outputs": {"image_features": ["image_tokens", text.hidden_size]},
        "hidden_size": vision.hidden_size,
        "num_layers": vision.depth,
        "num_attention_heads": vision.num_heads,
        "intermediate_size": vision.intermediate_size,
        "patch_size": vision.patch_size,
        "merge_size": vision.spatial_merge_size,
        "window_size": vision.window_size,
        "fullatt_block_indexes": list(vision.fullatt_block_indexes),
        "out_hidden_size": vision.out_hidden_size,
        "image_token_id": int(vlm.config.image_token_id),
        "mrope_section": list(text.rope_parameters.get("mrope_section", [])),
        "position_rows": 3,
    }
