"""The in-place KV cache of the fused attention: what the export holds, growth, and the batch limit."""

import numpy as np
import onnx
import pytest

from pipeshard.core.errors import UserError
from pipeshard.runtime.monolithic import MonolithicStep
from pipeshard.runtime.step import Step


def test_the_export_attends_with_group_query_attention_over_in_place_buffers(tiny_llama_export):
    model = onnx.load(tiny_llama_export / "model.onnx", load_external_data=False)
    ops = [node.op_type for node in model.graph.node]
    assert ops.count("GroupQueryAttention") == 4 and "Attention" not in ops
    past = {i.name for i in model.graph.input if i.name.startswith("past_key_values.")}
    readers = [n for n in model.graph.node for t in n.input if t in past]
    assert {n.op_type for n in readers} == {"GroupQueryAttention"}  # no Concat, no Shape of the past
    gqa = next(n for n in model.graph.node if n.op_type == "GroupQueryAttention")
    assert gqa.output[1].startswith("present.") and gqa.input[3].startswith("past_key_values.")


def _logits(step, ids, capacity):
    """Prefill `ids`, then three greedy decode steps; the logits of every step."""
    step.start(1, capacity)
    mask, out = np.ones((1, ids.shape[1]), np.int64), []
    logits = step.forward(ids, mask, np.arange(ids.shape[1])[None])
    out.append(np.array(logits[:, -1]))
    for _ in range(3):
        token = out[-1].argmax(-1).reshape(1, 1)
        mask = np.ones((1, mask.shape[1] + 1), np.int64)
        out.append(np.array(step.forward(token, mask, np.array([[mask.shape[1] - 1]]))[:, -1]))
    return out


@pytest.mark.parametrize(
    "make",
    [lambda export, pack: MonolithicStep(export), lambda export, pack: Step(pack)],
    ids=["monolithic", "chain"],
)
def test_a_cache_started_too_small_grows_and_gives_the_same_logits(make, tiny_llama_export, tiny_pack):
    ids = np.arange(5, 17, dtype=np.int64)[None]
    roomy = _logits(make(tiny_llama_export, tiny_pack), ids, 64)
    cramped = _logits(make(tiny_llama_export, tiny_pack), ids, 2)
    for a, b in zip(roomy, cramped, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_several_new_tokens_after_a_past_in_a_batch_is_a_clear_error(tiny_llama_export):
    step = MonolithicStep(tiny_llama_export)
    step.start(2, 32)
    with pytest.raises(UserError, match="batch 1"):
        step.forward(np.ones((2, 3), np.int64), np.ones((2, 8), np.int64), np.tile(np.arange(5, 8), (2, 1)))


def test_switching_all_logits_rebinds_every_stage_to_the_new_buffers(tiny_pack):
    step = Step(tiny_pack)
    ids = np.arange(5, 17, dtype=np.int64)[None]
    results = []
    for all_logits in (False, True, False, True):
        step.all_logits = all_logits
        step.start(1, 32)
        results.append(np.array(step.forward(ids, np.ones_like(ids), np.arange(12)[None])[:, -1]))
    for result in results[1:]:
        np.testing.assert_allclose(result, results[0], atol=1e-6)
