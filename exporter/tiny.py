"""Small random-weight models for tests: seeded, with a self-contained byte-level tokenizer."""

from __future__ import annotations

from typing import Any

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# The dimensions the architecture test models share (their own features are what differs).
_SMALL_DENSE = {
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    },
    "qwen3": {
        "model_type": "qwen3",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    },
    # Qwen3-MoE-like (the paper's MoE family): every layer routed, 8 experts, top-2.
    "moe": {
        "model_type": "qwen3_moe",
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 48,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    },
    "mixtral": {
        "model_type": "mixtral",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    # Mistral with a sliding window shorter than the test prompts.
    "mistral": {
        "model_type": "mistral",
        **_SMALL_DENSE,
        "sliding_window": 16,
        "tie_word_embeddings": False,
    },
    # Llama 3.x: rope scaling of type llama3.
    "llama3": {
        "model_type": "llama",
        **_SMALL_DENSE,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "tie_word_embeddings": True,
    },
    # Qwen 2.5: q/k/v biases (packed with the weights for GQA's own rotary).
    "qwen2": {
        "model_type": "qwen2",
        **_SMALL_DENSE,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
    # Phi-4-mini's shape: fused qkv / gate_up, partial rotary (0.75), LongRoPE, tied embeddings.
    "phi3": {
        "model_type": "phi3",
        **_SMALL_DENSE,
        "original_max_position_embeddings": 128,
        "partial_rotary_factor": 0.75,
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            "short_factor": [1.0 + 0.1 * i for i in range(6)],
            "long_factor": [2.0 + 0.5 * i for i in range(6)],
        },
        "tie_word_embeddings": True,
    },
    # Gemma 3: local (window 16) and global layers with their own rotary bases, one KV head, a query scalar
    # other than the head size, final logit softcapping.
    "gemma3": {
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "max_position_embeddings": 512,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "query_pre_attn_scalar": 24,
        "final_logit_softcapping": 30.0,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "tie_word_embeddings": True,
    },
}
TINY_SEED = 1234


def build_byte_tokenizer():
    """A byte-level BPE tokenizer with no merges: 256 byte tokens plus ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for symbol in sorted(alphabet):
        vocab[symbol] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_tiny_model(architecture: str):
    """A seeded random-weight causal LM of a tiny config, and its tokenizer."""
    return build_random_model(dict(TINY_CONFIGS[architecture]))


def tiny_config(settings: dict[str, Any], tokenizer=None):
    """The transformers config of a test model's settings (`model_type` plus its fields), sized for the byte
    tokenizer."""
    from transformers import AutoConfig

    tokenizer = tokenizer or build_byte_tokenizer()
    settings = dict(settings)
    return AutoConfig.for_model(
        settings.pop("model_type"),
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **settings,
    )


def build_random_model(settings: dict[str, Any]):
    """A seeded random-weight causal LM of any config (`model_type` plus its fields) with the byte tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = build_byte_tokenizer()
    config = tiny_config(settings, tokenizer)
    torch.manual_seed(TINY_SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init leaves norms at 1 and small weights: scale so outputs are not near-uniform and
    # greedy tokens are decided by clear margins (tests compare them exactly).
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() >= 2:  # matrices, and MoE experts stored as [experts, out, in]
                parameter.normal_(0.0, 0.5 if "embed" in name else 0.15)
    return model.eval(), tokenizer
