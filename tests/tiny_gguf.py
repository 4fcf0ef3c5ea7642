"""Tiny llama GGUF files with random weights in chosen quantized formats, for the tests of quantized exports.

The tokenizer is SmolLM2's (its GGUF fields copied), so transformers loads the file as it loads any llama GGUF;
each matrix is stored in one of the given formats, taking turns, so every format holds several roles (the tied
embedding included). gguf's own quantizer makes the formats it has; the K-quants get random blocks whose
half-precision scales are chosen to keep weights in a trained model's range.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from pipeshard.exporter.gguf_blocks import FORMATS, unpack
from pipeshard.exporter.sources import builtin_gguf_path, gguf_reader

TOKENIZER_FIELDS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_space_prefix",
    "tokenizer.chat_template",
)
# the K-quants' float16 fields: byte offset in the block -> the value's range
K_QUANT_HALVES = {
    "Q2_K": {80: (4e-3, 8e-3), 82: (2e-3, 4e-3)},
    "Q3_K": {108: (1e-3, 3e-3)},
    "Q4_K": {0: (2e-4, 6e-4), 2: (2e-4, 6e-4)},
    "Q5_K": {0: (1e-4, 3e-4), 2: (1e-4, 3e-4)},
    "Q6_K": {208: (2e-5, 6e-5)},
}
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2


def quantized_rows(format_name: str, rows: int, columns: int, rng: np.random.Generator) -> np.ndarray:
    """Stored bytes [rows, bytes per row] of a random matrix in FORMAT."""
    if format_name not in K_QUANT_HALVES:
        values = rng.normal(0, 0.05, (rows, columns)).astype(np.float32)
        return quantize(values, getattr(GGMLQuantizationType, format_name))
    block_bytes, block_weights, _ = FORMATS[format_name]
    blocks = rng.integers(0, 256, (rows, columns // block_weights, block_bytes)).astype(np.uint8)
    for offset, (low, high) in K_QUANT_HALVES[format_name].items():
        halves = rng.uniform(low, high, blocks.shape[:2]).astype(np.float16)
        blocks[..., offset : offset + 2] = halves.view(np.uint8).reshape(*blocks.shape[:2], 2)
    raw = blocks.reshape(rows, -1)
    assert np.abs(unpack(format_name, raw, columns).dequantized()).max() < 1.0
    return raw


def write_tiny_llama_gguf(path: Path, formats: list[str], seed: int = 0) -> Path:
    """A 2-layer llama (hidden 256, SmolLM2's vocabulary) whose matrices take FORMATS in turn."""
    rng = np.random.default_rng(seed)
    source = gguf_reader(builtin_gguf_path("smollm2-135m"))
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(2048)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    for name in TOKENIZER_FIELDS:
        field = source.fields[name]
        writer.add_key_value(
            name, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None
        )
    turn = iter(range(1_000_000))

    def matrix(name: str, rows: int, columns: int) -> None:
        format_name = formats[next(turn) % len(formats)]
        raw = quantized_rows(format_name, rows, columns, rng)
        writer.add_tensor(
            name, raw, raw_shape=raw.shape, raw_dtype=getattr(GGMLQuantizationType, format_name)
        )

    def norm(name: str) -> None:
        writer.add_tensor(name, rng.uniform(0.8, 1.2, HIDDEN).astype(np.float32))

    matrix("token_embd.weight", vocab, HIDDEN)
    head_dim = HIDDEN // HEADS
    for layer in range(LAYERS):
        prefix = f"blk.{layer}."
        norm(prefix + "attn_norm.weight")
        matrix(prefix + "attn_q.weight", HIDDEN, HIDDEN)
        matrix(prefix + "attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        matrix(prefix + "attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        matrix(prefix + "attn_output.weight", HIDDEN, HIDDEN)
        norm(prefix + "ffn_norm.weight")
        matrix(prefix + "ffn_gate.weight", FFN, HIDDEN)
        matrix(prefix + "ffn_up.weight", FFN, HIDDEN)
        matrix(prefix + "ffn_down.weight", HIDDEN, FFN)
    norm("output_norm.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
