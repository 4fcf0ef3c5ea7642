"""Optimum-style export configs: what a decoder's ONNX graph takes and returns, per architecture.

Built on optimum's `ExporterConfig` and normalized configs, so model facts are read the same way
for every architecture; the torch dynamo exporter does the tracing (see `onnx_export`).
"""

from __future__ import annotations

from dataclasses import dataclass

from optimum.exporters.base import ExporterConfig
from optimum.utils.normalized_config import NormalizedTextConfigWithGQA

from pipeshard.core.errors import UserError
from pipeshard.exporter.moe_blocks import moe_dims

# Rotary variants whose tables are fixed functions of the position: the trace computes them exactly.
# LongRoPE also picks its factors by the step's length (see `_max_context`).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class DecoderDims:
    """The numbers a runtime needs about a decoder-only LM."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    num_experts: int = 0  # MoE only: experts per layer, routed per token, and each expert's FFN width
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    sliding_window: int = (
        0  # keys a sliding-window layer attends to (0: none, or none shorter than max_context)
    )


def rope_parameter_sets(config) -> list[dict]:
    """The model's rotary settings: one dict, or one per layer type (Gemma 3's local and global bases)."""
    parameters = getattr(config, "rope_parameters", None) or {}
    if parameters and all(isinstance(value, dict) for value in parameters.values()):
        return list(parameters.values())
    return [parameters]


def check_supported_features(config, where: str) -> None:
    """Refuse, naming the feature, what the export would silently get wrong."""
    for parameters in rope_parameter_sets(config):
        rope_type = parameters.get("rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise UserError(
                f"{where}: rope_scaling of type {rope_type!r} is not supported "
                f"(supported: {', '.join(STATIC_ROPE_TYPES)})"
            )
    if getattr(config, "attn_logit_softcapping", None):
        raise UserError(f"{where}: attention logit softcapping (attn_logit_softcapping) is not supported")
    if getattr(config, "use_bidirectional_attention", False):
        raise UserError(f"{where}: bidirectional attention (use_bidirectional_attention) is not supported")


def _max_context(config) -> int:
    """The longest context the export computes as transformers does. LongRoPE switches every position to its
    long factors once a sequence passes the original length, and transformers then recomputes the whole cache;
    an export stays within the original length, where the short factors hold (the runtime refuses more)."""
    for parameters in rope_parameter_sets(config):
        if parameters.get("rope_type") == "longrope" and parameters.get("long_factor") != parameters.get(
            "short_factor"
        ):
            original = parameters.get("original_max_position_embeddings") or getattr(
                config, "original_max_position_embeddings", None
            )
            return min(original or config.max_position_embeddings, config.max_position_embeddings)
    return config.max_position_embeddings


def _effective_sliding_window(config) -> int:
    """The sliding window a layer of this model can meet within its context, or 0."""
    window = getattr(config, "sliding_window", None) or 0
    return window if 0 < window < _max_context(config) else 0


class DecoderWithPastExportConfig(ExporterConfig):
    """Decoder with KV cache in and out: prefill (past length 0) and decode in one graph."""

    NORMALIZED_CONFIG_CLASS = NormalizedTextConfigWithGQA
    image_token_id: int | None = None  # a VLM's decoder takes `image_features` for its image tokens
    POSITION_ROWS = 1  # position_ids [batch, sequence]; M-RoPE decoders take [3, batch, sequence]

    @property
    def dims(self) -> DecoderDims:
        normalized = self._normalized_config
        heads = normalized.num_attention_heads
        config = self._config
        moe = moe_dims(config)
        return DecoderDims(
            num_layers=normalized.num_layers,
            hidden_size=normalized.hidden_size,
            intermediate_size=config.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=normalized.num_key_value_heads or heads,
            head_dim=getattr(config, "head_dim", None) or normalized.hidden_size // heads,
            vocab_size=normalized.vocab_size,
            max_context=_max_context(config),
            num_experts=moe.num_experts if moe else 0,
            experts_per_token=moe.experts_per_token if moe else 0,
            expert_intermediate_size=moe.expert_intermediate_size if moe else 0,
            sliding_window=_effective_sliding_window(config),
        )

    @property
    def past_names(self) -> list[str]:
        return [
            f"past_key_values.{i}.{kind}" for i in range(self.dims.num_layers) for kind in ("key", "value")
        ]

    @property
    def present_names(self) -> list[str]:
        return [f"present.{i}.{kind}" for i in range(self.dims.num_layers) for kind in ("key", "value")]

    @property
    def inputs(self) -> dict[str, dict[int, str]]:
        axes = {"input_ids": {0: "batch", 1: "sequence"}}
        if self.image_token_id is not None:
            axes["image_features"] = {0: "image_tokens"}
        axes |= {
            "attention_mask": {0: "batch", 1: "total_sequence"},
            "position_ids": {0: "batch", 1: "sequence"}
            if self.POSITION_ROWS == 1
            else {1: "batch", 2: "sequence"},
        }
        axes.update({name: {0: "batch", 2: "past_sequence"} for name in self.past_names})
        return axes

    @property
    def outputs(self) -> dict[str, dict[int, str]]:
        axes = {"logits": {0: "batch", 1: "sequence"}}
        axes.update({name: {0: "batch", 2: "total_sequence"} for name in self.present_names})
        return axes


class LlamaExportConfig(DecoderWithPastExportConfig):
    """Llama family (SmolLM2, Llama 2/3, TinyLlama)."""


class MistralExportConfig(DecoderWithPastExportConfig):
    """Mistral: Llama layout with optional sliding window (exported as full attention)."""


class Qwen2ExportConfig(DecoderWithPastExportConfig):
    """Qwen2 / Qwen2.5: Llama layout with q/k/v biases."""


class Qwen3ExportConfig(DecoderWithPastExportConfig):
    """Qwen3: Llama layout with per-head q/k RMS norms."""


class Qwen3MoeExportConfig(DecoderWithPastExportConfig):
    """Qwen3-MoE: Qwen3 attention, a routed expert block per layer (exported per expert, exporter/moe_blocks.py)."""


class MixtralExportConfig(DecoderWithPastExportConfig):
    """Mixtral: Mistral attention, a routed expert block per layer (exported per expert, exporter/moe_blocks.py)."""


class Phi3ExportConfig(DecoderWithPastExportConfig):
    """Phi-3 / Phi-3.5 / Phi-4-mini: fused qkv_proj and gate_up_proj, partial rotary, LongRoPE."""


class Gemma3TextExportConfig(DecoderWithPastExportConfig):
    """Gemma 3 text: scaled embeddings, (1 + w) RMS norms around attention and FFN, q/k norms, GeGLU, local
    (sliding-window) and global layers with their own rotary bases, optional final logit softcapping."""


class Qwen2_5_VLTextExportConfig(DecoderWithPastExportConfig):
    """Qwen2.5-VL's decoder: Qwen2 layers with M-RoPE, rotary angles per (time, row, column) position row
    (`mrope_section` splits the frequencies among them). Only inside a Qwen2.5-VL export (exporter/qwen_vl.py)."""

    POSITION_ROWS = 3


# Decoders that only come inside a vision-language model.
VLM_DECODERS: dict[str, type[DecoderWithPastExportConfig]] = {"qwen2_5_vl_text": Qwen2_5_VLTextExportConfig}

SUPPORTED_ARCHITECTURES: dict[str, type[DecoderWithPastExportConfig]] = {
    "llama": LlamaExportConfig,
    "mistral": MistralExportConfig,
    "qwen2": Qwen2ExportConfig,
    "qwen3": Qwen3ExportConfig,
    "qwen3_moe": Qwen3MoeExportConfig,
    "mixtral": MixtralExportConfig,
    "phi3": Phi3ExportConfig,
    "gemma3_text": Gemma3TextExportConfig,
}


def export_config_for(
    config, float_dtype: str, image_token_id: int | None = None
) -> DecoderWithPastExportConfig:
    """The export config of a transformers model config (a VLM's decoder: with its image token)."""
    check_supported_features(config, config.model_type)
    kind = SUPPORTED_ARCHITECTURES.get(config.model_type) or VLM_DECODERS[config.model_type]
    export_config = kind(config, task="text-generation", float_dtype=float_dtype)
    export_config.image_token_id = image_token_id
    return export_config
