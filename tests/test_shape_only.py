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
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error:") for line in err)


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
