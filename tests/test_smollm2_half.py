"""SmolLM2 with fp16 weights: the greedy tokens of transformers over the same half-precision weights (computed in
fp32), from the export and from its pack on the CPU chain (which reads the weights as stored). bf16 takes the same
path and is checked on the tiny model (tests/test_half_weights.py): one real-size half export is enough."""

import json

import pytest
import torch
from prompts import SMOLLM2_PROMPTS

import pipeshard
from pipeshard.exporter.sources import load_source, resolve_source

pytestmark = pytest.mark.slow
NEW_TOKENS = 32


def test_greedy_tokens_match_pytorch_over_the_same_weights_on_three_prompts(models):
    export, pack = models.export("smollm2-135m", "fp16"), models.pack("smollm2-135m", "fp16")
    dtype = json.loads((export / "export.json").read_text())["dtype"]
    assert dtype == "fp16"
    reference = load_source(resolve_source("smollm2-135m"), torch.float16).model.float()
    engines = {"export": pipeshard.load(export), "chain": pipeshard.load(pack)}
    eos = set(engines["export"].codec.eos_token_ids)
    for prompt in SMOLLM2_PROMPTS:
        ids = engines["export"].generator.prompt_ids(prompt)
        with torch.no_grad():
            output = reference.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        theirs = output[0, len(ids) :].tolist()
        theirs = theirs[: next((i for i, t in enumerate(theirs) if t in eos), len(theirs))]
        for name, engine in engines.items():
            (ours,) = engine.generator.generate(
                [ids], pipeshard.api.SamplingSettings(max_new_tokens=NEW_TOKENS)
            )
            assert ours.tokens == theirs, (dtype, name, prompt)
        assert len(theirs) >= 5
