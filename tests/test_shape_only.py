"""Shape-only packs (export --shape-only): the manifest of real weights from a config alone; plan, not run."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pipeshard.cli import main
from pipeshard.formats.manifest import Manifest, TensorInfo, Weight, load_pack


def _comparable(manifest: Manifest) -> dict:
    """What a manifest says about shapes, bytes and costs. Tensor names the exporter numbers (`add_961`, a packed
    `linear_7_qkv_weight`) are left out: a traced probe numbers them otherwise; module paths, KV, step inputs and
    the attention's own inputs keep their names."""
    kept = {t.name for t in (*manifest.graph_inputs, *manifest.graph_outputs)}
    kept |= {t.name for e in manifest.sub_layers for t in e.outputs if t.name.startswith("_gqa")}

    def tensor(t: TensorInfo) -> TensorInfo:
        return replace(t, name=t.name if t.name in kept else "<numbered>")

    def weight_name(name: str) -> str:
        return name if name.startswith(("model.", "lm_head.")) else "<numbered>"

    def weight(w: Weight) -> Weight:
        return replace(w, name=weight_name(w.name))

    return {
        "model": manifest.model,
        "kv_bytes_per_token": manifest.kv_bytes_per_token,
        "total_weight_bytes": manifest.total_weight_bytes,
        "graph_inputs": manifest.graph_inputs,
        "graph_outputs": manifest.graph_outputs,
        "sub_layers": [
            replace(
                e,
                files={},
                blob=e.blob and replace(e.blob, file="", sha256=None),  # its bytes
                weights=tuple(weight(w) for w in e.weights),
                inputs=tuple(tensor(t) for t in e.inputs),
                outputs=tuple(tensor(t) for t in e.outputs),
                row_chunks=e.row_chunks and replace(e.row_chunks, weight=weight_name(e.row_chunks.weight)),
            )
            for e in manifest.sub_layers
        ],
        "moe_blocks": [(block.layer, block.router, block.experts) for block in manifest.moe_blocks],
    }


@pytest.fixture(scope="session")
def shape_only_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shape-only") / "llama"
    assert main(["export", "tiny:llama", str(folder), "--shape-only", "--quiet"]) == 0
    return folder


def test_a_shape_only_pack_has_the_manifest_of_the_pack_made_from_real_weights(shape_only_llama, tiny_pack):
    shape_only = load_pack(shape_only_llama).manifest
    assert shape_only.shape_only and shape_only.model.num_layers == 4  # two traced, two repeated
    assert not [p.name for p in shape_only_llama.iterdir() if p.suffix in (".onnx", ".weights")]
    assert _comparable(shape_only) == _comparable(load_pack(tiny_pack).manifest)


@pytest.mark.slow
def test_a_shape_only_moe_pack_has_the_manifest_of_the_pack_made_from_real_weights(models, tmp_path):
    from pipeshard.shape_only import export_shape_only

    export_shape_only("tiny:moe", tmp_path / "shape-only", dtype="fp32")
    shape_only = load_pack(tmp_path / "shape-only").manifest
    assert len(shape_only.moe_blocks) == 4 and shape_only.model.num_experts == 8
    assert _comparable(shape_only) == _comparable(load_pack(models.pack("tiny:moe")).manifest)


@pytest.mark.parametrize(
    "command",
    [
        ["run", "{pack}", "hello"],
        ["chat", "{pack}"],
        ["run", "{pack}", "hello", "--device", "sim", "--vram", "1GiB"],
    ],
)
def test_running_a_shape_only_pack_is_one_error_line(shape_only_llama, capsys, command):
    assert main([part.format(pack=shape_only_llama) for part in command]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "no weights" in err[0]


def test_shape_only_export_refuses_what_does_not_apply(tmp_path, capsys):
    assert main(["export", "tiny:llama", str(tmp_path / "p"), "--shape-only", "--opset", "18"]) == 2
    assert main(["export", str(tmp_path / "nothing.json"), str(tmp_path / "q"), "--shape-only"]) == 2
    assert main(["export", "tiny:llama", str(tmp_path / "r"), "--shape-only", "--dtype", "q4_2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("error:") for line in err)
    assert "q4_0" in err[2] and "q6_k" in err[2]


@pytest.mark.slow
@pytest.mark.parametrize("format_name", ["Q4_1", "Q2_K", "Q6_K"])
def test_a_shape_only_pack_at_a_gguf_format_has_the_manifest_of_that_ggufs_export(format_name, tmp_path):
    """Q4_1: zero points, float16 minimums, the tied embedding's gather zero points; Q2_K: blocks of 16, float32
    minimums, no zero points; Q6_K: a high plane."""
    from tiny_gguf import write_tiny_llama_gguf

    from pipeshard.exporter import export_model
    from pipeshard.partitioner.partition import partition
    from pipeshard.shape_only import export_shape_only

    gguf = write_tiny_llama_gguf(tmp_path / "tiny.gguf", [format_name])
    export_model(str(gguf), tmp_path / "export", quiet=True)
    partition(tmp_path / "export", tmp_path / "pack")
    export_shape_only(str(tmp_path / "export" / "config.json"), tmp_path / "shape-only", format_name.lower())
    real, shape_only = (load_pack(tmp_path / name).manifest for name in ("pack", "shape-only"))
    assert shape_only.model.dtype == "gguf" and shape_only.source["format"] == format_name

    def unit_bytes(manifest: Manifest) -> list:
        return [(e.name, e.blob and e.blob.bytes, e.weight_bytes) for e in manifest.sub_layers]

    assert unit_bytes(shape_only) == unit_bytes(real)
    assert _comparable(shape_only) == _comparable(real)


@pytest.mark.slow
def test_a_moe_shape_only_pack_at_a_gguf_format_repeats_quantized_experts_and_keeps_the_router_float(
    tmp_path,
):
    from pipeshard.partitioner.estimator import Estimator
    from pipeshard.profiles.db import load_profile
    from pipeshard.shape_only import export_shape_only

    config = tmp_path / "config.json"
    assert (
        main(["export", "tiny:moe", str(tmp_path / "fp32"), "--shape-only", "--dtype", "fp32", "--quiet"])
        == 0
    )
    settings = json.loads((tmp_path / "fp32" / "config.json").read_text())
    config.write_text(json.dumps({**settings, "num_local_experts": 16}))  # more than the probe traces
    export_shape_only(str(config), tmp_path / "q4_0", "q4_0", attention_dtype="fp16")
    manifest = load_pack(tmp_path / "q4_0").manifest
    assert manifest.model.num_experts == 16 and manifest.model.attention_dtype == "fp16"
    experts = [e for e in manifest.sub_layers if e.kind == "expert"]
    assert len(experts) == 16 * manifest.model.num_layers
    assert {e.weight_bytes for e in experts} == {experts[0].weight_bytes}
    hidden = manifest.model.hidden_size
    for entry in (
        experts[:1] + experts[-1:]
    ):  # gate+up in blocks of 32 (their float16 scales small enough to stay in the graph, as an export keeps
        # them); down (48 columns) fits no block: float32
        assert {(w.dtype, tuple(w.shape)) for w in entry.weights} == {
            ("uint8", (2 * 48, hidden // 32, 16)),
            ("float32", (48, hidden)),
        }
    routers = [e for e in manifest.sub_layers if e.kind == "router"]
    assert all(w.dtype == "float32" for e in routers for w in e.weights)
    assert all(w.shape[1] == 16 for e in routers for w in e.weights if len(w.shape) == 2)
    estimator = Estimator(load_profile("desktop-rtx5090"), manifest.model)
    assert [dtype for *_, dtype, _ in estimator._matmuls(experts[-1])] == ["q4", "fp32"]


def test_inspect_and_plan_read_a_shape_only_pack(shape_only_llama, tmp_path, capsys):
    assert main(["inspect", str(shape_only_llama)]) == 0
    assert "L3.ffn" in capsys.readouterr().out
    out = tmp_path / "plans.json"
    assert (
        main(
            [
                "plan",
                str(shape_only_llama),
                "--vram",
                "600MiB",
                "--profile",
                "desktop-rtx5090",
                "--tiers",
                "1,64",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert [t["tier"] for t in json.loads(out.read_text())["tiers"]] == [1, 64]


def test_assumed_bits_size_the_plan_and_keep_it_from_running(tiny_pack, tmp_path, capsys):
    from pipeshard.partitioner.planner import Planner
    from pipeshard.profiles.db import load_profile

    manifest = load_pack(tiny_pack).manifest
    profile = load_profile("desktop-rtx5090")
    lossless, quantized = (Planner(manifest, profile, assume_bits=bits) for bits in (None, 4.5))
    assert quantized.model_bytes == pytest.approx(lossless.model_bytes * 4.5 / 32, rel=1e-3)
    out = tmp_path / "plans.json"
    assert (
        main(
            [
                "plan",
                str(tiny_pack),
                "--vram",
                "1GiB",
                "--profile",
                "desktop-rtx5090",
                "--assume-bits",
                "4.5",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert "planning only" in capsys.readouterr().out
    assert main(["run", str(tiny_pack), "hi", "--device", "sim", "--plans", str(out)]) == 2
    assert "--assume-bits" in capsys.readouterr().err
