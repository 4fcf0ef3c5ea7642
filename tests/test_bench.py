"""`pipeshard bench` on tiny:llama: every plan side by side, the JSON document, the prompt, bad input."""

import json

import pytest

from pipeshard.bench import PLANS, bench_prompt, first_difference, validate_bench
from pipeshard.cli import main
from pipeshard.core.errors import UserError
from pipeshard.runtime.text import TextCodec


def test_bench_rows_may_run_in_several_processes_whose_rounds_are_combined(tiny_pack, tmp_path):
    out = tmp_path / "bench.json"
    assert (
        main(
            [
                "bench",
                str(tiny_pack),
                "--device",
                "cpu",
                "--plans",
                "monolithic,cpu",
                "--peers",
                "none",
                "--new-tokens",
                "4",
                "--repeat",
                "2",
                "--processes",
                "2",
                "--threads",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    document = validate_bench(json.loads(out.read_text()))
    assert [row["name"] for row in document["rows"]] == ["monolithic", "cpu"]
    for row in document["rows"]:
        assert row["processes"] == 2 and row["runs"] == 2 and row["same_tokens_as_reference"]
        by_process = row["decode_tok_s_by_process"]
        assert [len(runs) for runs in by_process] == [2, 2]
        assert row["decode_tok_s_runs"] == pytest.approx(
            [(a * b) ** 0.5 for a, b in zip(*by_process, strict=True)]
        )


def test_bench_refuses_zero_processes(tiny_pack, capsys):
    assert (
        main(
            [
                "bench",
                str(tiny_pack),
                "--device",
                "cpu",
                "--plans",
                "cpu",
                "--peers",
                "none",
                "--processes",
                "0",
            ]
        )
        == 2
    )
    assert capsys.readouterr().err.startswith("error: ")


def test_bench_runs_every_plan_and_writes_a_valid_document(tiny_pack, tmp_path, capsys):
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    assert (
        main(
            [
                "bench",
                str(tiny_pack),
                "--device",
                "sim",
                "--vram",
                "40%",
                "--profile",
                "laptop-8gb",
                "--peers",
                "none",
                "--new-tokens",
                "8",
                "--repeat",
                "1",
                "--threads",
                "1",
                "--json",
                str(out),
                "--plot",
                str(plot),
            ]
        )
        == 0
    )
    document = validate_bench(json.loads(out.read_text()))
    assert sorted(row["name"] for row in document["rows"]) == sorted(PLANS)
    for row in document["rows"]:
        assert row["same_tokens_as_reference"] and row["deterministic"] and len(row["tokens"]) == 8, row[
            "name"
        ]
        assert row["decode_tok_s_min"] <= row["decode_tok_s"] <= row["decode_tok_s_max"]
        if row["facts"]["device"] == "sim":
            assert row["peak_device_bytes"] <= row["facts"]["budget_bytes"]
            assert row["predicted_decode_step_s"] > 0
    bandwidth = document["machine"]["read_bandwidth"]
    assert bandwidth["best_bytes_per_s"] > 1e8
    assert bandwidth["samples"] == 6 + 2 * 2  # before the rounds, then after the warm-up and the one round
    # the probe reads what a decode step reads (its weight's columns rounded to 16), so caches help both alike
    assert bandwidth["bytes"] == pytest.approx(document["rows"][0]["bytes_read_per_token"], abs=8 * 4096 * 4)
    assert document["rows"][0]["name"] == "monolithic"  # the default reference comes first
    assert document["rows"][0]["decode_tok_s_paired_ratio"] == 1.0
    assert all(len(row["decode_tok_s_runs"]) == row["runs"] == 1 for row in document["rows"])
    assert document["rows"][1]["decode_tok_s_ratio"] == pytest.approx(
        document["rows"][1]["decode_tok_s"] / document["rows"][0]["decode_tok_s"]
    )
    assert plot.stat().st_size > 1000
    assert all(row["peak_rss_bytes"] < 400 * 2**20 for row in document["rows"])  # each worker's own peak
    for row in document["rows"]:  # the engine's own memory: above the bare interpreter and libraries
        assert 0 < row["baseline_rss_bytes"] < row["peak_rss_bytes"]
        assert row["rss_over_weights_and_kv"] > 1  # the baseline was taken before any weight was loaded
        assert row["rss_over_weights_and_kv"] == pytest.approx(
            (row["peak_rss_bytes"] - row["baseline_rss_bytes"]) / row["weights_and_kv_bytes"]
        )
    table = capsys.readouterr().out
    assert "never GPU speed" in table and "gpu-only [sim]" in table


def test_a_missing_or_unusable_peer_is_skipped_not_fatal(tiny_pack, tmp_path, capsys):
    # tiny:llama was not made from a GGUF, so llama.cpp cannot run it whether or not it is installed.
    out = tmp_path / "bench.json"
    assert (
        main(
            [
                "bench",
                str(tiny_pack),
                "--device",
                "cpu",
                "--peers",
                "llama.cpp",
                "--plans",
                "cpu",
                "--reference",
                "cpu",
                "--new-tokens",
                "4",
                "--repeat",
                "1",
                "--threads",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    document = json.loads(out.read_text())
    assert [row["name"] for row in document["rows"]] == ["cpu"]
    assert document["skipped"][0]["name"] == "llama.cpp"
    assert "skipped llama.cpp" in capsys.readouterr().err


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--peers", "vllm"], "unknown peer"),
        (["--plans", "fastest"], "unknown plan"),
        (["--device", "sim", "--plans", "auto", "--vram", "25"], "give a unit"),
        (["--new-tokens", "1"], "--new-tokens"),
        (["--device", "cpu", "--reference", "transformers", "--peers", "none"], "reference row"),
        (["--device", "cpu", "--sequences", "1,0"], "--sequences"),
        (["--device", "cpu", "--plans", "cpu", "--sequences", "1,2", "--image", "a.png"], "one sequence"),
        (["--device", "cpu", "--plans", "cpu", "--image", "a.png"], "text model"),
    ],
)
def test_bad_bench_arguments_are_one_line_errors(tiny_pack, arguments, message, capsys):
    assert main(["bench", str(tiny_pack), *arguments]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err and len(err.strip().splitlines()) == 1


def test_the_prompt_is_lengthened_to_exactly_the_asked_tokens(tiny_llama_export):
    codec = TextCodec(tiny_llama_export)
    _, short = bench_prompt(codec, "hi", None)
    text, ids = bench_prompt(codec, "hi", 300)
    assert len(ids) == 300 and ids[-4:] == short[-4:]  # still ends with the assistant turn's header
    assert codec.encode(text) == ids


def test_a_raw_prompt_for_a_base_model_is_lengthened_to_the_asked_tokens(tiny_llama_export):
    codec = TextCodec(tiny_llama_export)
    text, ids = bench_prompt(codec, "The capital of France is", 40, chat_template=False)
    assert len(ids) == 40 and ids[:6] == codec.encode("The capital of France is", add_special_tokens=True)[:6]
    assert codec.encode(text) == ids  # the text as a peer reads it (its special tokens spelt out)
    assert "<|im_start|>" not in text


def test_first_difference_and_document_validation():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    with pytest.raises(UserError, match="schema_version"):
        validate_bench({"rows": []})


def test_balanced_ab_cancels_a_creation_order_bias(monkeypatch):
    """Whatever is made later runs 10 % faster here; B truly costs 1.5x A: both pairings are biased, the
    combined ratio is not."""
    import pipeshard.bench as bench

    clock = [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    made: list[str] = []

    def make(side: str):
        cost = (1.0 if side == "A" else 1.5) * 0.9 ** len(made)
        made.append(side)

        def run(_round: int) -> None:
            clock[0] += cost

        return run

    result = bench.balanced_ab(make, rounds=4)
    assert made == ["A", "B", "B", "A"]
    assert result.pairings[0] == pytest.approx(1.5 * 0.9) and result.pairings[1] == pytest.approx(
        1.5 / 0.9**1
    )
    assert result.ratio == pytest.approx(1.5)
    assert len(result.a_times) == len(result.b_times) == 8


def test_sequences_run_every_row_once_per_count_as_one_batch(tiny_pack, tmp_path):
    out = tmp_path / "bench.json"
    assert (
        main(
            [
                "bench",
                str(tiny_pack),
                "--device",
                "cpu",
                "--plans",
                "cpu",
                "--peers",
                "none",
                "--sequences",
                "1,3",
                "--new-tokens",
                "6",
                "--repeat",
                "1",
                "--threads",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    one, batch = validate_bench(json.loads(out.read_text()))["rows"]
    assert (one["name"], one["sequences"], batch["name"], batch["sequences"]) == ("cpu", 1, "cpu*3", 3)
    assert batch["sequences_agree"] and batch["same_tokens_as_reference"] and len(batch["tokens"]) == 6
    assert batch["decode_tok_s"] > 0  # its rate counts its three sequences (a ratio, not asserted: timing)
    assert (
        one["roofline_fraction"] > 0 and batch["roofline_fraction"] is None
    )  # a batch shares each weight read
    assert batch["weights_and_kv_bytes"] > one["weights_and_kv_bytes"]
    # one round: the whole answer is the first token's time plus each sequence's 5 decode steps at the batch's rate / 3
    assert batch["answer_s"] == pytest.approx(batch["ttft_s"] + 3 * 5 / batch["decode_tok_s"])


def test_the_native_host_peer_gives_the_chains_tokens(tiny_pack, tmp_path):
    from pipeshard.peers import missing_peer

    if missing_peer("native"):
        pytest.skip(missing_peer("native"))
    out = tmp_path / "bench.json"
    assert (
        main(
            [
                "bench",
                str(tiny_pack),
                "--device",
                "cpu",
                "--plans",
                "cpu",
                "--peers",
                "native",
                "--new-tokens",
                "6",
                "--repeat",
                "1",
                "--threads",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    chain, native = validate_bench(json.loads(out.read_text()))["rows"]
    assert native["name"] == "native" and native["facts"]["engine"] == "pipeshard native host"
    assert native["tokens"] == chain["tokens"] and native["decode_tok_s"] > 0
    assert native["prompt_ids_match"] is None  # fed the bench's ids, no tokenizer of its own


def test_images_are_encoded_in_every_run_and_match_transformers(models, tmp_path):
    import numpy as np
    from PIL import Image

    pack = models.pack("tiny:smolvlm")
    image = tmp_path / "image.png"
    Image.fromarray((np.random.default_rng(3).random((61, 90, 3)) * 255).astype(np.uint8)).save(image)
    out = tmp_path / "bench.json"
    assert (
        main(
            [
                "bench",
                str(pack),
                "--device",
                "cpu",
                "--plans",
                "monolithic,cpu",
                "--peers",
                "transformers",
                "--reference",
                "transformers",
                "--peer-dir",
                str(tmp_path / "peers"),  # beside this test's files, not the shared pack's
                "--image",
                str(image),
                "--new-tokens",
                "6",
                "--repeat",
                "1",
                "--threads",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    document = validate_bench(json.loads(out.read_text()))
    assert [row["name"] for row in document["rows"]] == ["monolithic", "cpu", "transformers"]
    assert all(row["same_tokens_as_reference"] for row in document["rows"])  # transformers ran its own pixels
    from pipeshard.formats.manifest import load_pack
    from pipeshard.runtime.vision import prepare_images

    config = load_pack(pack).manifest.vision.preprocessing
    image_id = TextCodec(pack).tokenizer.token_to_id(config.image_token)
    assert (
        document["settings"]["prompt_ids"].count(image_id) == sum(prepare_images(config, [image]).counts) > 0
    )
    assert all(row["answer_s"] > row["ttft_s"] > 0 for row in document["rows"])
