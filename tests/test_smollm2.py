"""The built-in model: the export must be lossless against PyTorch (transformers) on the same weights."""

import numpy as np
import pytest
import torch
from prompts import SMOLLM2_PROMPTS

import pipeshard
from pipeshard.exporter.sources import load_source, resolve_source

pytestmark = pytest.mark.slow
PROMPTS = SMOLLM2_PROMPTS


@pytest.fixture(scope="module")
def torch_smollm2():
    return load_source(resolve_source("smollm2-135m"), torch.float32).model


def test_greedy_32_tokens_match_pytorch_on_three_prompts(smollm2_export, torch_smollm2):
    engine = pipeshard.load(smollm2_export)
    for prompt in PROMPTS:
        prompt_ids = engine.generator.prompt_ids(prompt)
        (ours,) = engine.generator.generate([prompt_ids], pipeshard.api.SamplingSettings(max_new_tokens=32))
        with torch.no_grad():
            output = torch_smollm2.generate(torch.tensor([prompt_ids]), max_new_tokens=32, do_sample=False)
        theirs = output[0, len(prompt_ids) :].tolist()
        eos = set(engine.codec.eos_token_ids)
        theirs = theirs[: next((i for i, t in enumerate(theirs) if t in eos), len(theirs))]
        assert ours.tokens == theirs, prompt
        assert len(ours.tokens) >= 5


def test_prompt_logits_within_1e_3_of_pytorch(smollm2_export, torch_smollm2):
    engine = pipeshard.load(smollm2_export)
    ids = np.array([engine.generator.prompt_ids(PROMPTS[2])], dtype=np.int64)
    engine.step.start(1)
    ours = engine.step.forward(ids, np.ones_like(ids), np.arange(ids.shape[1])[None])
    with torch.no_grad():
        theirs = torch_smollm2(torch.from_numpy(ids)).logits.numpy()
    assert np.abs(ours - theirs).max() < 1e-3
