"""The cost model's attention: priced at the model's ratio of query to KV heads against the ratio the profile's
attention rows were measured at."""

import json
from types import SimpleNamespace

import pytest

from pipeshard.core.errors import UserError
from pipeshard.formats.manifest import Cost, ModelFacts, SubLayer
from pipeshard.formats.profile_db import ProfileDb
from pipeshard.partitioner.estimator import Estimator
from pipeshard.profiles.db import load_profile, reference_profile_path
from pipeshard.profiles.kernels import attention_rows
from pipeshard.profiles.measure import QUICK, sweep_for_pack
from pipeshard.runtime.ort import cpu_session_options, import_onnxruntime

TOKENS, CONTEXT = 1, 1024  # a point every reference profile measured


def _measured_at(kv_heads: int) -> ProfileDb:
    """laptop-8gb with its CPU attention rows as if measured with 16 query heads sharing `kv_heads` KV heads."""
    document = json.loads(reference_profile_path("laptop-8gb").read_text())
    for rates in document["cpu"]["threads"].values():
        for row in rates["attention"]:
            row["kv_heads"] = kv_heads
    return ProfileDb.from_json(document, "laptop-8gb, edited")


def _model(heads: int, kv_heads: int) -> ModelFacts:
    return ModelFacts("llama", "fp32", "fp32", 2, 1024, 4096, heads, kv_heads, 64, 32000, 8192)


def _attention_seconds(profile: ProfileDb, model: ModelFacts) -> float:
    """An attention sub-layer's own time (no weights, no KV bytes: its FLOPs at the attention rate alone)."""
    entry = SubLayer("attn", "attn", 0, {}, None, (), 0, (), (), None, Cost({}, {}), 0)
    estimator = Estimator(profile, model, threads=1)
    return estimator.compute_seconds(entry, TOKENS, CONTEXT, on_device=False) - estimator.cpu.hop_s


def _measured_gflops(profile: ProfileDb) -> float:
    return next(r.gflops for r in profile.cpu.threads[1].attention if (r.T, r.C) == (TOKENS, CONTEXT))


def test_a_model_at_the_measured_head_ratio_is_priced_at_the_measured_rate_and_mha_lower():
    profile = _measured_at(kv_heads=4)
    flops = 4.0 * 16 * 64 * TOKENS * CONTEXT
    gqa = _attention_seconds(profile, _model(16, 4))
    assert gqa == pytest.approx(flops / (_measured_gflops(profile) * 1e9), rel=1e-12)
    # Four times the KV heads: four times the KV read per FLOP, where the measured rate is bound by reading it.
    assert _attention_seconds(profile, _model(16, 16)) == pytest.approx(4 * gqa, rel=1e-12)


def test_a_model_sharing_kv_heads_more_than_measured_is_priced_faster_up_to_the_peak():
    mha_rows = load_profile("laptop-8gb")
    assert _attention_seconds(mha_rows, _model(16, 16)) == pytest.approx(
        4.0 * 16 * 64 * TOKENS * CONTEXT / (_measured_gflops(mha_rows) * 1e9), rel=1e-12
    )
    table = Estimator(mha_rows, _model(16, 4), threads=1).cpu.attention
    measured = table.gflops(TOKENS, CONTEXT)
    assert table.gflops(TOKENS, CONTEXT, 4.0) == min(4 * measured, table.peak_gflops) > measured
    assert table.gflops(TOKENS, CONTEXT, 1e6) == table.peak_gflops


def test_the_attention_kernel_runs_and_records_a_grouped_head_ratio():
    ort = import_onnxruntime()
    rows = attention_rows(
        ort, cpu_session_options(1), ["CPUExecutionProvider"], 8, 2, 32, (1, 4), (64,), "fp32", 0.01
    )
    assert [(r["T"], r["C"], r["heads"], r["kv_heads"]) for r in rows] == [(1, 64, 8, 2), (4, 64, 8, 2)]
    assert all(r["gflops"] > 0 for r in rows)
    document = json.loads(reference_profile_path("laptop-8gb").read_text())
    document["cpu"]["threads"]["1"]["attention"] = rows
    assert ProfileDb.from_json(document, "db.json").cpu.threads[1].attention[0].queries_per_kv_head == 4.0


def test_a_pack_is_swept_at_its_own_head_counts():
    manifest = SimpleNamespace(sub_layers=(), model=_model(32, 8))
    sweep = sweep_for_pack(QUICK, manifest)
    assert (sweep.heads, sweep.kv_heads, sweep.head_dim) == (32, 8, 64)
    assert (QUICK.heads, QUICK.kv_heads) == (16, 16)  # without a pack: one KV head per query head


def test_rows_of_one_table_must_share_one_head_ratio():
    document = json.loads(reference_profile_path("laptop-8gb").read_text())
    document["cpu"]["threads"]["1"]["attention"][0]["kv_heads"] = 4
    with pytest.raises(UserError, match=r"cpu\.threads\.1\.attention mixes head ratios"):
        ProfileDb.from_json(document, "db.json")


def _with_q4_rows(gflops: float) -> ProfileDb:
    """laptop-8gb with CPU 4-bit product rows (every M at `gflops`) and the simulated device's at half of it."""
    document = json.loads(reference_profile_path("laptop-8gb").read_text())
    shape = {"K": 2048, "N": 2048}
    rows = [
        {"M": m, **shape, "seconds": 2 * m * 2048 * 2048 / (gflops * 1e9), "gflops": gflops} for m in (1, 64)
    ]
    for rates in document["cpu"]["threads"].values():
        rates["matmul"]["q4"] = rows
    document["device"] = {
        "kind": "sim",
        "name": "sim",
        "matmul": {"q4": [{**r, "gflops": gflops / 2} for r in rows]},
    }
    return ProfileDb.from_json(document, "laptop-8gb, edited")


def _q4_ffn() -> SubLayer:
    """One 2048 x 2048 product over 4-bit planes (low plane, scales, zero points), as a GGUF pack stores it."""
    from pipeshard.formats.manifest import Weight

    parts = (
        Weight("w_q4_low", (2048, 64, 16), "uint8", "f", 0, 2048 * 1024),
        Weight("w_q4_scales", (2048, 64), "float32", "f", 0, 2048 * 64 * 4),
        Weight("w_q4_zero_points", (2048, 32), "uint8", "f", 0, 2048 * 32),
    )
    return SubLayer(
        "ffn", "ffn", 0, {}, None, parts, sum(w.bytes for w in parts), (), (), None, Cost({}, {}), 0
    )


def test_a_gguf_packs_products_are_priced_at_the_profiles_4_bit_rates_on_the_cpu_and_on_sim():
    profile, entry, tokens = _with_q4_rows(gflops=10.0), _q4_ffn(), 64
    estimator = Estimator(profile, _model(16, 4), threads=1)
    compute = 2.0 * tokens * 2048 * 2048 / 10e9  # far above the planes' read time at these rates
    assert estimator.compute_seconds(entry, tokens, CONTEXT, on_device=False) == pytest.approx(
        estimator.cpu.hop_s + compute, rel=1e-9
    )
    assert estimator.compute_seconds(entry, tokens, CONTEXT, on_device=True) == pytest.approx(
        estimator.device.hop_s + 2 * compute, rel=1e-9
    )
    # Without the rows, the fp32 table's rate stands in (the model's own arithmetic): far faster here.
    plain = Estimator(load_profile("laptop-8gb"), _model(16, 4), threads=1)
    assert plain.compute_seconds(entry, tokens, CONTEXT, on_device=False) < compute / 2
