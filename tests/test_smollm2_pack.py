"""SmolLM2 as a pack: partitioned fast, no duplicated weights, the chain lossless against the whole graph."""

import subprocess
import sys
import time

import numpy as np
import pytest
from prompts import SMOLLM2_PROMPTS

import pipeshard
from pipeshard.partitioner.pack import partition
from pipeshard.runtime.pack import WEIGHT_ALIGNMENT, load_pack

pytestmark = pytest.mark.slow
PROMPTS = SMOLLM2_PROMPTS


@pytest.fixture(scope="module")
def smollm2_pack(smollm2_export, tmp_path_factory):
    pack = tmp_path_factory.mktemp("smollm2") / "pack"
    started = time.perf_counter()
    partition(smollm2_export, pack)
    return pack, time.perf_counter() - started


def test_partition_takes_under_10_s_and_duplicates_no_weight(smollm2_pack, smollm2_export):
    pack_dir, seconds = smollm2_pack
    assert seconds < 10
    pack = load_pack(pack_dir)
    owned = sum(w["bytes"] for e in pack.sub_layers for w in e["weights"]
                if e["blob"] and w["file"] == e["blob"]["file"])
    blobs = sum(p.stat().st_size for p in pack_dir.glob("*.weights"))
    export_weights = (smollm2_export / "model.onnx.data").stat().st_size
    assert owned == export_weights
    assert blobs - export_weights < WEIGHT_ALIGNMENT * sum(len(e["weights"]) for e in pack.sub_layers)
    assert len(pack.sub_layers) == 2 + 2 * 30 + 1


def test_chain_64_greedy_tokens_equal_the_monolithic_session(smollm2_pack, smollm2_export):
    whole, chain = pipeshard.load(smollm2_export), pipeshard.load(smollm2_pack[0])
    for prompt in PROMPTS:
        ids = whole.generator.prompt_ids(prompt)
        settings = pipeshard.api.SamplingSettings(max_new_tokens=64)
        chain_tokens = chain.generator.generate([ids], settings)[0].tokens
        assert chain_tokens == whole.generator.generate([ids], settings)[0].tokens
    ids = np.array([whole.generator.prompt_ids(PROMPTS[1])], dtype=np.int64)
    whole.step.start(1)
    chain.step.all_logits = True
    chain.step.start(1)
    args = (ids, np.ones_like(ids), np.arange(ids.shape[1])[None])
    assert np.abs(whole.step.forward(*args) - chain.step.forward(*args)).max() < 1e-4


def _resident_after_loading(pack, decode_attention: bool) -> float:
    """MiB of anonymous memory a fresh process holds after loading the chain (beyond the runtime itself)."""
    script = f"""
from pathlib import Path
from pipeshard.runtime import capi
def anon(): return int(open("/proc/self/status").read().split("RssAnon:")[1].split()[0]) / 1024
capi.runtime(2)
before = anon()
from pipeshard.runtime.chain import ChainStep
step = ChainStep(Path({str(pack)!r}), threads=2, decode_attention={decode_attention})
assert all(s.decode_session is not None for s in step.stages if s.name.endswith(".attn")) == {decode_attention}
print(anon() - before)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return float(done.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_decode_attention_sessions_share_the_attention_weights(smollm2_pack):
    """The decode sessions take the attention sub-layers' weights (~101 MiB packed) from the prompt sessions."""
    from pipeshard.runtime import capi

    if not capi.custom_ops_available():
        pytest.skip("the C extension (and with it the decode attention op) was not built")
    extra = _resident_after_loading(smollm2_pack[0], True) - _resident_after_loading(smollm2_pack[0], False)
    assert extra < 20, f"decode sessions hold {extra:.0f} MiB more"
