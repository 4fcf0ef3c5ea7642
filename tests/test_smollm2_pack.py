"""SmolLM2 as a pack: partitioned fast, no duplicated weights, the chain lossless against the whole graph."""

import subprocess
import sys

import numpy as np
import pytest
from prompts import SMOLLM2_PROMPTS

import pipeshard
from pipeshard.formats.manifest import WEIGHT_ALIGNMENT, load_pack

pytestmark = pytest.mark.slow
PROMPTS = SMOLLM2_PROMPTS


@pytest.fixture(scope="module")
def smollm2_pack(models):
    """The session's SmolLM2 pack, and how long its partition took (in whichever module made it first)."""
    pack = models.pack("smollm2-135m")
    return pack, models.partition_seconds[("smollm2-135m", "fp32", "fp32")]


def test_partition_takes_under_10_s_and_duplicates_no_weight(smollm2_pack, smollm2_export):
    pack_dir, seconds = smollm2_pack
    assert seconds < 10
    pack = load_pack(pack_dir)
    owned = sum(w.bytes for e in pack.sub_layers for w in e.weights if e.blob and w.file == e.blob.file)
    blobs = sum(p.stat().st_size for p in pack_dir.glob("*.weights"))
    export_weights = (smollm2_export / "model.onnx.data").stat().st_size
    assert owned == export_weights
    assert blobs - export_weights < WEIGHT_ALIGNMENT * sum(len(e.weights) for e in pack.sub_layers)
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


def _memory_after_loading(pack, join_decode: bool) -> tuple[float, float]:
    """MiB of anonymous memory a fresh process holds after loading the chain, and MiB its peak RSS rose while
    loading (both beyond the runtime itself)."""
    script = f"""
from pathlib import Path
from pipeshard.runtime import capi
def status(field): return int(open("/proc/self/status").read().split(field + ":")[1].split()[0]) / 1024
capi.runtime(2)
anon, peak = status("RssAnon"), status("VmHWM")
from pipeshard.runtime.step import Step
step = Step(Path({str(pack)!r}), threads=2, join_decode={join_decode})
assert (len(sum(step.decode_runs(), [])) < 20) == {join_decode}
print(status("RssAnon") - anon, status("VmHWM") - peak)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    anon, peak = done.stdout.split()[-2:]
    return float(anon), float(peak)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_joined_decode_sessions_share_the_sub_layers_weights(smollm2_pack):
    """The joined decode sessions take their weights (~514 MiB packed) from the sub-layers' sessions; making one
    maps all of its weights at once, so the load peak rises by up to one session's weights (JOINED_WEIGHT_BYTES,
    measured +62 MiB) and one weight packed to be found in the container."""
    from pipeshard.runtime.stages import JOINED_WEIGHT_BYTES

    joined, split = (
        _memory_after_loading(smollm2_pack[0], True),
        _memory_after_loading(smollm2_pack[0], False),
    )
    assert joined[0] - split[0] < 20, f"joined sessions hold {joined[0] - split[0]:.0f} MiB more"
    assert joined[1] - split[1] < JOINED_WEIGHT_BYTES / 2**20 + 16, (
        f"load peak {joined[1] - split[1]:.0f} MiB higher"
    )
