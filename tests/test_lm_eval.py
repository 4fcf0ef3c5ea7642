"""lm-evaluation-harness as a real client: its `local-completions` model against `pipeshard serve` scores a small
multiple-choice task (tests/lm_eval/, a local JSONL) exactly as its `hf` model does on the same weights in
transformers: the same accuracy, and every choice's loglikelihood within 1e-4."""

from __future__ import annotations

from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")
from test_server import server  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TASK = "pipeshard_tiny_mc"


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    """tiny:llama as a Hugging Face folder: the weights its export has, and its byte tokenizer."""
    from pipeshard.exporter.tiny import build_tiny_model

    folder = tmp_path_factory.mktemp("tiny-llama-hf")
    model, tokenizer = build_tiny_model("llama")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def evaluate(
    model: str, model_args: dict, task: str = TASK, chat: bool = False, limit: int | None = None
) -> tuple[dict, list[dict]]:
    """A task's metrics and samples under one of the harness's models (`chat`: prompts through the chat
    template; `limit`: the task's first documents only)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[task],
        task_manager=TaskManager(include_path=str(REPO / "tests" / "lm_eval")),
        batch_size=1,
        log_samples=True,
        apply_chat_template=chat,
        limit=limit,
    )
    return results["results"][task], results["samples"][task]


@pytest.mark.slow  # 40 s here: the harness's two runs of 144 loglikelihood requests
def test_lm_eval_local_completions_scores_as_its_hf_model(tiny_pack, hf_folder, monkeypatch):
    monkeypatch.chdir(REPO)  # the task names its JSONL from the repository's root
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    expected, expected_samples = evaluate(
        "hf", {"pretrained": str(hf_folder), "dtype": "float32", "device": "cpu"}
    )
    with server(tiny_pack, "--parallel", "2", "--context", "512") as base:
        ours, our_samples = evaluate(
            "local-completions",
            {
                "base_url": f"{base}/v1/completions",
                "model": "pack",
                "tokenizer_backend": "huggingface",
                "tokenizer": str(hf_folder),
                "max_length": 512,
                "num_concurrent": 1,
                "max_retries": 1,
            },
        )
    assert len(our_samples) == len(expected_samples) == 36
    for theirs, mine in zip(expected_samples, our_samples, strict=True):
        assert theirs["doc_id"] == mine["doc_id"]
        for (their_ll, their_greedy), (my_ll, my_greedy) in zip(
            theirs["filtered_resps"], mine["filtered_resps"], strict=True
        ):
            assert float(my_ll) < 0 and abs(float(their_ll) - float(my_ll)) < 1e-4
            assert bool(their_greedy) == bool(my_greedy)
    assert ours["acc,none"] == expected["acc,none"]
    assert ours["acc_norm,none"] == expected["acc_norm,none"]


@pytest.fixture(scope="module")
def smollm2_hf_folder(tmp_path_factory) -> Path:
    """SmolLM2-135M as a Hugging Face folder: the built-in GGUF's weights as transformers dequantizes them (what
    the fp32 export holds), and its tokenizer."""
    import torch

    from pipeshard.exporter.sources import load_source, resolve_source

    folder = tmp_path_factory.mktemp("smollm2-hf")
    source = load_source(resolve_source("smollm2-135m"), torch.float32)
    source.model.save_pretrained(folder)
    source.tokenizer.save_pretrained(folder)
    return folder


# The task's first 16 questions (64 loglikelihood requests through transformers, then the server): the tiny
# model's test above takes all 36.
SMOLLM2_QUESTIONS = 16


@pytest.mark.slow
def test_lm_eval_local_completions_scores_smollm2_as_its_hf_model(models, smollm2_hf_folder, monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    expected, expected_samples = evaluate(
        "hf",
        {"pretrained": str(smollm2_hf_folder), "dtype": "float32", "device": "cpu"},
        limit=SMOLLM2_QUESTIONS,
    )
    with server(models.pack("smollm2-135m"), "--parallel", "2", "--context", "512") as base:
        ours, our_samples = evaluate(
            "local-completions",
            {
                "base_url": f"{base}/v1/completions",
                "model": "pack",
                "tokenizer_backend": "huggingface",
                "tokenizer": str(smollm2_hf_folder),
                "max_length": 512,
                "num_concurrent": 1,
                "max_retries": 1,
            },
            limit=SMOLLM2_QUESTIONS,
        )
    assert len(our_samples) == len(expected_samples) == SMOLLM2_QUESTIONS
    for theirs, mine in zip(expected_samples, our_samples, strict=True):
        for (their_ll, their_greedy), (my_ll, my_greedy) in zip(
            theirs["filtered_resps"], mine["filtered_resps"], strict=True
        ):
            assert (
                float(my_ll) < 0 and abs(float(their_ll) - float(my_ll)) < 1e-3
            )  # 30 layers of fp32 rounding
            assert bool(their_greedy) == bool(my_greedy)
    assert ours["acc,none"] == expected["acc,none"] and ours["acc_norm,none"] == expected["acc_norm,none"]
    assert expected["acc,none"] > 0.25  # a real model: better than chance on these easy questions


@pytest.mark.slow  # about 60 s here
def test_lm_eval_local_chat_completions_generates_as_its_hf_model(tiny_pack, hf_folder, monkeypatch):
    """A generate_until task through the chat template: `local-chat-completions` against the server gets the
    answers the harness's `hf` model generates (greedy, the same stop strings), answer for answer."""
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    task = "pipeshard_tiny_gen"
    expected, expected_samples = evaluate(
        "hf", {"pretrained": str(hf_folder), "dtype": "float32", "device": "cpu"}, task, chat=True
    )
    with server(tiny_pack, "--parallel", "2", "--context", "512") as base:
        ours, our_samples = evaluate(
            "local-chat-completions",
            {"base_url": f"{base}/v1/chat/completions", "model": "pack", "max_retries": 1},
            task,
            chat=True,
        )
    answers = [sample["filtered_resps"] for sample in our_samples]
    assert answers == [sample["filtered_resps"] for sample in expected_samples]
    assert sum(bool(a[0]) for a in answers) > len(answers) // 2  # answers, not empty strings
    assert ours["exact_match,none"] == expected["exact_match,none"]
