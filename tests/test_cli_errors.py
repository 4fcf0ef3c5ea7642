"""Bad input: one `error:` line on stderr, exit status 2, no traceback, nothing left behind."""

import json
import subprocess
import sys

import pytest

from pipeshard.cli import main
from pipeshard.exporter.sources import builtin_gguf_path


def run_cli(capsys, *argv):
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.err


def assert_one_error_line(status, err, *fragments):
    lines = err.strip().splitlines()
    assert status == 2, err
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_missing_model_path(capsys, tmp_path):
    status, err = run_cli(capsys, "export", str(tmp_path / "nope"), str(tmp_path / "out"))
    assert_one_error_line(status, err, "does not exist")
    assert not (tmp_path / "out").exists()


def test_folder_that_is_not_a_model(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    status, err = run_cli(capsys, "export", str(tmp_path / "empty"), str(tmp_path / "out"))
    assert_one_error_line(status, err, "not a model folder")


def test_unsupported_architecture_is_named_with_the_supported_list(capsys, tmp_path):
    folder = tmp_path / "bigcode"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt_bigcode"}))
    status, err = run_cli(capsys, "export", str(folder), str(tmp_path / "out"))
    assert_one_error_line(status, err, "gpt_bigcode", "llama", "qwen3")


def test_unknown_tiny_model(capsys, tmp_path):
    status, err = run_cli(capsys, "export", "tiny:gpt9", str(tmp_path / "out"))
    assert_one_error_line(status, err, "tiny:gpt9", "tiny:llama")


def test_truncated_gguf(capsys, tmp_path):
    truncated = tmp_path / "cut.gguf"
    with open(builtin_gguf_path("smollm2-135m"), "rb") as source:
        truncated.write_bytes(source.read(4 * 1024 * 1024))
    status, err = run_cli(capsys, "export", str(truncated), str(tmp_path / "out"))
    assert_one_error_line(status, err, "truncated")


@pytest.mark.parametrize("content", [b"not a gguf file at all", b"GGUF\x03\x00\x00\x00garbage"])
def test_corrupt_gguf(capsys, tmp_path, content):
    corrupt = tmp_path / "bad.gguf"
    corrupt.write_bytes(content)
    status, err = run_cli(capsys, "export", str(corrupt), str(tmp_path / "out"))
    assert_one_error_line(status, err, "bad.gguf")


def test_existing_out_is_refused_without_force(capsys, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    status, err = run_cli(capsys, "export", "tiny:llama", str(tmp_path / "out"))
    assert_one_error_line(status, err, "already exists", "--force")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def test_unknown_dtype(capsys, tmp_path):
    status, err = run_cli(capsys, "export", "tiny:llama", str(tmp_path / "out"), "--dtype", "int3")
    assert_one_error_line(status, err, "int3", "fp32", "fp16")


def test_run_on_a_folder_that_is_not_an_export(capsys, tmp_path):
    status, err = run_cli(capsys, "run", str(tmp_path), "hello")
    assert_one_error_line(status, err, "export.json")


def test_prompt_longer_than_the_context(capsys, tiny_llama_export):
    status, err = run_cli(capsys, "run", str(tiny_llama_export), "word " * 600)
    assert_one_error_line(status, err, "exceeds the context")


def test_unknown_option_is_an_error_line(capsys):
    status, err = run_cli(capsys, "export", "--bogus")
    assert_one_error_line(status, err)


def test_a_real_process_prints_no_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "pipeshard", "export", str(tmp_path / "nope"), str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("error:") and "Traceback" not in result.stderr
