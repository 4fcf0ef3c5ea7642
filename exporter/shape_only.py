"""`pipeshard export MODEL OUT --shape-only`: a model pack from a config alone, for planning.

MODEL is a config (below), or `cosmos-reason1-7b`: Qwen2.5-VL-7B's vision tower and decoder.

The model is built with its weights on torch's meta device (nothing is allocated) and traced as the real
export traces it; the weights become references to a data file that is never written, so the pack has every
shape, byte count and cost coefficient and no weights. A model of many identical layers is traced with
`PROBE_LAYERS` of them (and a MoE model with a few experts per layer), and the pack's manifest is that probe's
with its last layer (its last expert) repeated (partitioner/repeat.py; tests check the result against the pack
made from real weights). A Qwen2.5-VL's vision tower is probed alike: one windowed-attention block and one
full-attention block, each repeated where the real tower has a block of its kind (tests check the result against
the whole tower's trace).

`--dtype q4_0 ... q6_k` describes the pack a GGUF whose matrices are all in that format exports to (`--dtype gguf`):
the probe is traced in float32 as a GGUF's export is, and every product and embedding weight (but a MoE router's
gate, which llama.cpp's quantize keeps in float32) is described by the parts the real export stores it as
(exporter/quantized_weights.py: format_layout; a test checks it against the real export of a tiny GGUF). Norms and
other vectors stay float32. llama.cpp's quantization mixes (Q6_K output layers, wider types for some layers in the
K-quant mixes) are not followed: every matrix takes the one format.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import asdict
from pathlib import Path

from pipeshard.core.errors import UserError
from pipeshard.core.fsutil import write_json_atomic
from pipeshard.exporter.gguf_blocks import CODES
from pipeshard.exporter.offline import force_offline
from pipeshard.formats.export_info import EXPORT_SCHEMA_VERSION, KV_CACHE

log = logging.getLogger(__name__)
PROBE_LAYERS = 2  # layer 0 and one layer that stands for every later one
PROBE_VISION_FULLATT = [1]  # a vision probe of two blocks: block 0 windowed, block 1 full-attention
MODEL_FILE = "model.onnx"


def load_config(model: str):
    """The transformers config of `tiny:ARCH`, a model folder's config.json (no weights needed) or a config.json."""
    from transformers import AutoConfig

    from pipeshard.exporter.configs import SUPPORTED_ARCHITECTURES, check_supported_features
    from pipeshard.exporter.tiny import TINY_CONFIGS, tiny_config

    if model.startswith("tiny:"):
        architecture = model.split(":", 1)[1]
        if architecture not in TINY_CONFIGS:
            raise UserError(
                f"unknown tiny model {model!r}; known: {', '.join('tiny:' + a for a in TINY_CONFIGS)}"
            )
        config = tiny_config(dict(TINY_CONFIGS[architecture]))
    else:
        path = Path(model)
        config_path = path / "config.json" if path.is_dir() else path
        if not config_path.is_file():
            raise UserError(
                f"{model}: give a model config (config.json, or a folder holding one) or tiny:ARCH"
            )
        try:
            settings = json.loads(config_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UserError(f"{config_path} is not a valid config ({exc})") from None
        if not isinstance(settings, dict) or "model_type" not in settings:
            raise UserError(f"{config_path} has no model_type")
        settings = {
            key: value for key, value in settings.items() if not key.startswith("_")
        }  # "_source" notes
        settings.pop("architectures", None)
        if settings["model_type"] not in SUPPORTED_ARCHITECTURES:
            raise UserError(
                f"unsupported architecture {settings['model_type']!r} in {config_path}; "
                f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        try:
            config = AutoConfig.for_model(settings.pop("model_type"), **settings)
        except (TypeError, ValueError) as exc:
            raise UserError(f"{config_path}: {exc}") from None
        check_supported_features(config, str(config_path))
    layer_types = getattr(config, "layer_types", None) or []
    if (
        len(set(layer_types)) > 1
        or getattr(config, "mlp_only_layers", None)
        or getattr(config, "decoder_sparse_step", 1) not in (1, None)
    ):
        raise UserError(
            f"{model}: --shape-only needs layers that are all alike (this config mixes layer types)"
        )
    return config


EXPERT_COUNT_FIELDS = {"qwen3_moe": "num_experts", "mixtral": "num_local_experts"}
# --shape-only --dtype: the float types a shape-only trace takes, and GGUF's quantized formats by their CLI names
FLOAT_DTYPES = ("fp32", "fp16")
GGUF_FORMATS = {name.lower(): name for name in CODES}
SHAPE_DTYPES = (*FLOAT_DTYPES, *GGUF_FORMATS)


def probe_experts(config, element_bytes: int, block: int | None = None) -> int:
    """How many experts per layer the probe traces: more than a token's, unlike every other dimension of the
    model and of its weights' quantized parts in blocks of `block` (so that repeat_experts can tell the expert
    count in a shape: the routing weights' width), and enough that the router's gate is stored as a weight where
    the full model's is."""
    from pipeshard.exporter.fuse import stored_externally
    from pipeshard.exporter.moe_blocks import moe_dims

    moe = moe_dims(config)
    others = {
        config.hidden_size,
        config.intermediate_size,
        config.num_attention_heads,
        config.vocab_size,
        getattr(config, "num_key_value_heads", None),
        getattr(config, "head_dim", None),
        moe.expert_intermediate_size,
        PROBE_LAYERS,
        1,
    }
    if block:
        for width in (config.hidden_size, config.intermediate_size, moe.expert_intermediate_size):
            others |= {width // block, (width // block + 1) // 2}
        others |= {block // 2, block // 4}
    gate_bytes = config.hidden_size * element_bytes
    count = moe.experts_per_token + 1
    while count in others or stored_externally(gate_bytes * moe.num_experts) != stored_externally(
        gate_bytes * count
    ):
        count += 1
    return min(count, moe.num_experts)


def probe_config(config, layers: int = PROBE_LAYERS, element_bytes: int = 4, block: int | None = None):
    """The same model with only its first `layers` layers (and in a MoE model `probe_experts` experts)."""
    probe = copy.deepcopy(config)
    probe.num_hidden_layers = min(layers, config.num_hidden_layers)
    if getattr(probe, "layer_types", None):
        probe.layer_types = probe.layer_types[: probe.num_hidden_layers]
    if config.model_type in EXPERT_COUNT_FIELDS:
        setattr(probe, EXPERT_COUNT_FIELDS[config.model_type], probe_experts(config, element_bytes, block))
    return probe


def _trace_probe(
    config, dtype: str, folder: Path, gguf_format: str | None = None, attention_dtype: str | None = None
) -> None:
    """The shape-only export folder of `config`: model.onnx with references for weights, export.json, config;
    `gguf_format`: traced in float32 (`dtype` fp32), its weights described as stored in that format;
    `attention_dtype`: the attention's and KV cache's (default: `dtype`)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipeshard.exporter.configs import export_config_for
    from pipeshard.exporter.export import DTYPES, _quiet_third_party_output
    from pipeshard.exporter.fuse import fuse_exported_model
    from pipeshard.exporter.onnx_export import DEFAULT_OPSET, export_decoder

    _quiet_third_party_output()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, DTYPES[dtype])).eval()
    export_config = export_config_for(config, dtype)
    export_decoder(model, export_config, folder / MODEL_FILE, DEFAULT_OPSET, shape_only=True)
    dims = export_config.dims
    fuse_exported_model(
        folder / MODEL_FILE,
        dims.num_attention_heads,
        dims.num_key_value_heads,
        dims.head_dim,
        dtype,
        dims.max_context,
        dims.sliding_window or None,
        shape_only=True,
        attention_dtype=attention_dtype or dtype,
        shape_format=gguf_format,
    )
    config.save_pretrained(folder)
    write_json_atomic(
        folder / "export.json",
        {
            "schema_version": EXPORT_SCHEMA_VERSION,
            "shape_only": True,
            "source": {
                "kind": "config",
                "name": config.model_type,
                **({"format": gguf_format} if gguf_format else {}),
            },
            "architecture": config.model_type,
            "task": export_config.task,
            "dims": asdict(dims),
            "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
            "dtype": "gguf" if gguf_format else dtype,
            "compute_dtype": dtype,
            "attention_dtype": attention_dtype or dtype,
            "opset": DEFAULT_OPSET,
            "kv_cache": KV_CACHE,
            "model_file": MODEL_FILE,
            "inputs": list(export_config.inputs),
            "outputs": list(export_config.outputs),
        },
    )


def vlm_probe_config(vlm_config, layers: int = PROBE_LAYERS):
    """The same Qwen2.5-VL with its decoder's first `layers` layers and a vision tower of two blocks, the first
    windowed and the second full-attention (repeat_vision_blocks copies each to the real tower's blocks)."""
    probe = copy.deepcopy(vlm_config)
    probe.text_config.num_hidden_layers = min(layers, vlm_config.text_config.num_hidden_layers)
    if getattr(probe.text_config, "layer_types", None):
        probe.text_config.layer_types = probe.text_config.layer_types[: probe.text_config.num_hidden_layers]
    probe.vision_config.depth = len(PROBE_VISION_FULLATT) + 1
    probe.vision_config.fullatt_block_indexes = list(PROBE_VISION_FULLATT)
    return probe


def trace_vlm(vlm_config, dtype: str, folder: Path) -> None:
    """A Qwen2.5-VL's shape-only export folder: its decoder (M-RoPE positions, the image features merged into the
    embedding) and its vision tower, both on the meta device, traced as `vlm_config` has them."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from pipeshard.exporter import qwen_vl
    from pipeshard.exporter.configs import export_config_for
    from pipeshard.exporter.export import DTYPES, _quiet_third_party_output
    from pipeshard.exporter.fuse import fuse_exported_model
    from pipeshard.exporter.image_processing import preprocessing_config, qwen2_vl_image_processor
    from pipeshard.exporter.onnx_export import DEFAULT_OPSET, export_decoder

    _quiet_third_party_output()
    with torch.device("meta"):
        vlm = Qwen2_5_VLForConditionalGeneration(vlm_config).to(getattr(torch, DTYPES[dtype])).eval()
    preprocessing = preprocessing_config(qwen2_vl_image_processor(vlm_config), vlm_config)
    qwen_vl.trace_vision(vlm, folder / "vision.onnx", DEFAULT_OPSET, preprocessing, shape_only=True)
    decoder = qwen_vl.text_decoder(vlm)
    export_config = export_config_for(decoder.config, dtype, int(vlm_config.image_token_id))
    export_decoder(decoder, export_config, folder / MODEL_FILE, DEFAULT_OPSET, shape_only=True)
    dims = export_config.dims
    fuse_exported_model(
        folder / MODEL_FILE,
        dims.num_attention_heads,
        dims.num_key_value_heads,
        dims.head_dim,
        dtype,
        None,
        None,
        shape_only=True,
    )
    decoder.config.save_pretrained(folder)
    write_json_atomic(
        folder / "export.json",
        {
            "schema_version": EXPORT_SCHEMA_VERSION,
            "shape_only": True,
            "source": {"kind": "config", "name": qwen_vl.COSMOS_NAME},
            "architecture": decoder.config.model_type,
            "vision": {**qwen_vl.vision_description(vlm), "preprocessing": preprocessing},
            "task": export_config.task,
            "dims": asdict(dims),
            "tie_word_embeddings": False,
            "dtype": dtype,
            "opset": DEFAULT_OPSET,
            "kv_cache": KV_CACHE,
            "model_file": MODEL_FILE,
            "inputs": list(export_config.inputs),
            "outputs": list(export_config.outputs),
            "position_rows": export_config.POSITION_ROWS,
        },
    )


def trace_shape_probe(
    model: str,
    dtype: str,
    export_dir: Path,
    probe_layers: int = PROBE_LAYERS,
    attention_dtype: str | None = None,
):
    """Trace MODEL's config (a probe of `probe_layers` layers) into `export_dir` with weights on the meta device;
    returns the full config (a VLM's whole Qwen2_5_VLConfig), whose layer, expert and vision block counts the
    probe's pack is then repeated to. `attention_dtype` fp16 with a float32 trace (fp32 and the GGUF formats):
    the attention and KV cache in float16, as `export --attention-dtype fp16` makes them for a GPU."""
    from pipeshard.exporter.qwen_vl import COSMOS_NAME, cosmos_config

    if dtype not in SHAPE_DTYPES:
        raise UserError(f"unknown dtype {dtype!r} for --shape-only; choose one of: {', '.join(SHAPE_DTYPES)}")
    gguf_format = GGUF_FORMATS.get(dtype)
    if attention_dtype not in (None, "fp32", "fp16") or (attention_dtype == "fp32" and dtype == "fp16"):
        raise UserError(
            f"--attention-dtype {attention_dtype} does not apply to a --dtype {dtype} shape-only pack"
        )
    force_offline()
    if model == COSMOS_NAME:
        if gguf_format:
            raise UserError(f"--dtype {dtype}: {COSMOS_NAME}'s shape-only pack is fp32 or fp16")
        vlm_config = cosmos_config()
        trace_vlm(vlm_probe_config(vlm_config, probe_layers), dtype, export_dir)
        return vlm_config
    config = load_config(model)
    if gguf_format:  # products in blocks; a router's gate in float32
        probe = probe_config(config, probe_layers, 4, CODES[gguf_format][1])
        _trace_probe(probe, "fp32", export_dir, gguf_format, attention_dtype)
    else:
        probe = probe_config(config, probe_layers, {"fp32": 4, "fp16": 2}[dtype])
        _trace_probe(probe, dtype, export_dir, None, attention_dtype)
    return config


def expert_count(config) -> int | None:
    """The experts per MoE layer of a config, or None for a dense model."""
    field = EXPERT_COUNT_FIELDS.get(config.model_type)
    return getattr(config, field) if field else None
