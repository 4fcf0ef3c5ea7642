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


def build_random_model(settings: dict[str, Any]):
    """A seeded random-weight causal LM of any config (`model_type` plus its fields) with the byte tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = build_byte_tokenizer()
    settings = dict(settings)
    model_type = settings.pop("model_type")
    vocab_size = len(tokenizer)
    config = AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **settings,
    )
    torch.manual_seed(TINY_SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init leaves norms at 1 and small weights: scale so outputs are not near-uniform and
    # greedy tokens are decided by clear margins (tests compare them exactly).
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() >= 2:  # matrices, and MoE experts stored as [experts, out, in]
                parameter.normal_(0.0, 0.5 if "embed" in name else 0.15)
    return model.eval(), tokenizer
