"""transformers' attention computed as pipeshard's float16 attention graphs compute it: the reference that
`--attention-dtype fp16` exports are checked against (docs/precision.md)."""

from __future__ import annotations

HALF_ATTENTION = "pipeshard_fp16"


def half_precision_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention on q, k and v rounded to float16, its output rounded to float16: what a fused
    float16 kernel computes (float32 accumulation inside), given and returned in the model's own type."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rounded = [tensor.to(torch.float16).to(tensor.dtype) for tensor in (query, key, value)]
    output, weights = sdpa_attention_forward(module, *rounded, attention_mask, **kwargs)
    return output.to(torch.float16).to(output.dtype), weights


def use_attention_dtype(model, attention_dtype: str):
    """MODEL (a transformers model) with its attention computing in ATTENTION_DTYPE (`fp32`: as it is)."""
    if attention_dtype == "fp16":
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(HALF_ATTENTION, half_precision_attention)
        AttentionMaskInterface.register(HALF_ATTENTION, sdpa_mask)
        model.set_attn_implementation(HALF_ATTENTION)
    return model
