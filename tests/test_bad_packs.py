"""A damaged pack is one `error:` line naming the file, exit status 2."""

import shutil

import pytest

from pipeshard.cli import main


@pytest.fixture()
def pack_copy(tiny_pack, tmp_path):
    """The shared tiny pack's copy, for this test to damage."""
    pack = tmp_path / "pack"
    shutil.copytree(tiny_pack, pack)
    return pack


def error_line(capsys, *argv):
    status = main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and err[0].startswith("error:"), err
    return err[0]


def test_missing_sub_layer_file(pack_copy, capsys):
    (pack_copy / "L2.ffn.onnx").unlink()
    assert "L2.ffn.onnx" in error_line(capsys, "run", str(pack_copy), "hi")


def test_truncated_weight_blob(pack_copy, capsys):
    blob = pack_copy / "L1.attn.weights"
    blob.write_bytes(blob.read_bytes()[:1000])
    assert "L1.attn.weights" in error_line(capsys, "inspect", str(pack_copy))


def test_corrupt_weight_blob_is_caught_by_verify(pack_copy, capsys):
    blob = pack_copy / "L0.ffn.weights"
    data = bytearray(blob.read_bytes())
    data[100] ^= 0xFF
    blob.write_bytes(bytes(data))
    assert main(["inspect", str(pack_copy)]) == 0  # sizes only by default
    capsys.readouterr()
    assert "L0.ffn.weights" in error_line(capsys, "inspect", str(pack_copy), "--verify")


def test_unknown_schema_version(pack_copy, capsys):
    manifest = pack_copy / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"schema_version": 2', '"schema_version": 99', 1))
    line = error_line(capsys, "run", str(pack_copy), "hi")
    assert "manifest.json" in line and "schema_version" in line


def test_manifest_that_is_not_json(pack_copy, capsys):
    (pack_copy / "manifest.json").write_text("{ this is not json")
    assert "manifest.json" in error_line(capsys, "inspect", str(pack_copy))


def test_partition_refuses_existing_pack_without_force(pack_copy, tiny_llama_export, capsys):
    assert "--force" in error_line(capsys, "partition", str(tiny_llama_export), str(pack_copy))
