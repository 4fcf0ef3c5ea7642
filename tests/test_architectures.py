"""The decoder architectures people run, each from a Hugging Face folder: exported with `pipeshard export`,
partitioned, run on the CPU chain and planned on sim, greedy tokens equal to transformers'."""

import json

import numpy as np
import pytest
import torch

import pipeshard
from pipeshard.cli import main
from pipeshard.exporter.tiny import TINY_CONFIGS, build_random_model

# Prompts through the ChatML template are 21 to 71 tokens: longer than the sliding windows (16) of tiny
# Mistral and Gemma 3, so local layers attend to a cut of the cache while the answer grows.
PROMPTS = ["Hi", "What is the capital of France, and why is it famous?", "Count: 1 2 3 4 5 6 7 8 9 10 11 12"]
NEW_TOKENS = 32

PHI3 = TINY_CONFIGS["phi3"]
ARCHITECTURES = {
    "mistral": TINY_CONFIGS["mistral"],
    "llama3": TINY_CONFIGS["llama3"],
    "qwen2.5": TINY_CONFIGS["qwen2"],
    # Qwen 2.5's long-context setting.
    "qwen2.5-yarn": {
        **TINY_CONFIGS["qwen2"],
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
        },
    },
    # Qwen 2.5 with its sliding window on the upper layers (use_sliding_window, max_window_layers).
    "qwen2.5-sliding": {
        **TINY_CONFIGS["qwen2"],
        "use_sliding_window": True,
        "sliding_window": 16,
        "max_window_layers": 1,
    },
    "gemma3": TINY_CONFIGS["gemma3"],
    "phi4-mini": PHI3,
    # Phi-3-mini-4k: no rope scaling, full rotary, a sliding window (2047 there).
    "phi3-mini": {
        **PHI3,
        "partial_rotary_factor": 1.0,
        "sliding_window": 24,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
    },
    # Phi-3.5-mini: LongRoPE over full rotary.
    "phi3.5-mini": {
        **PHI3,
        "partial_rotary_factor": 1.0,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 1.0,
            "short_factor": [1.0 + 0.05 * i for i in range(8)],
            "long_factor": [1.5 + 0.5 * i for i in range(8)],
        },
    },
}


def _hf_folder(settings: dict, folder):
    model, tokenizer = build_random_model(settings)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model, tokenizer


@pytest.fixture(scope="module")
def from_hf_folder(tmp_path_factory):
    """An architecture's Hugging Face folder exported with `pipeshard export` and partitioned, once in this module:
    its name -> (transformers model, export, pack)."""
    made = {}

    def make(name: str):
        if name not in made:
            root = tmp_path_factory.mktemp(name)
            model, _ = _hf_folder(ARCHITECTURES[name], root / "hf")
            assert main(["export", str(root / "hf"), str(root / "export"), "--quiet"]) == 0
            assert main(["partition", str(root / "export"), str(root / "pack")]) == 0
            made[name] = model, root / "export", root / "pack"
        return made[name]

    return make


# An export per architecture (half a minute each here): slow, `make test` runs them.
@pytest.fixture(scope="module", params=[pytest.param(name, marks=pytest.mark.slow) for name in ARCHITECTURES])
def exported(request, from_hf_folder):
    return request.param, *from_hf_folder(request.param)


def _transformers_tokens(model, prompt_ids: list[int], eos: list[int]) -> list[int]:
    with torch.no_grad():
        output = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
    tokens = output[0, len(prompt_ids) :].tolist()
    return next((tokens[:i] for i, t in enumerate(tokens) if t in eos), tokens)


def test_chain_and_sim_give_transformers_greedy_tokens(exported):
    name, model, export, pack = exported
    engines = {
        "export": pipeshard.load(export),
        "chain": pipeshard.load(pack),
        "sim": pipeshard.load(pack, vram="30%", device="sim", profile="laptop-8gb"),
        "sim gpu-only": pipeshard.load(pack, vram="10%", device="sim", profile="laptop-8gb", plan="gpu-only"),
    }
    for prompt in PROMPTS:
        prompt_ids = engines["chain"].generator.prompt_ids(prompt)
        expected = _transformers_tokens(model, prompt_ids, engines["chain"].codec.eos_token_ids)
        assert len(expected) > 8, (name, prompt)
        for kind, engine in engines.items():
            assert engine.generate(prompt, max_new_tokens=NEW_TOKENS)[0].tokens == expected, (
                name,
                kind,
                prompt,
            )


def test_chain_logits_are_the_unsplit_exports(exported):
    _, _, export, pack = exported
    whole, chain = pipeshard.load(export).step, pipeshard.load(pack).step
    chain.all_logits = True
    ids = np.array(
        [[(7 * i + 3) % 250 for i in range(40)]], np.int64
    )  # a prompt past the windows, then decode
    whole.start(1, 64)
    chain.start(1, 64)
    for start, stop in ((0, 30), (30, 31), (31, 32), (32, 40)):
        mask, positions = np.ones((1, stop), np.int64), np.arange(start, stop)[None]
        difference = np.abs(
            whole.forward(ids[:, start:stop], mask, positions)
            - chain.forward(ids[:, start:stop], mask, positions)
        ).max()
        assert difference < 1e-4, (start, difference)


def test_sliding_window_layers_use_gqas_local_window(exported):
    import onnx

    name, model, export, _ = exported
    window = json.loads((export / "export.json").read_text())["dims"]["sliding_window"]
    nodes = onnx.load(export / "model.onnx", load_external_data=False).graph.node
    windows = [
        next((a.i for a in n.attribute if a.name == "local_window_size"), -1)
        for n in nodes
        if n.op_type == "GroupQueryAttention"
    ]
    layer_types = getattr(model.config, "layer_types", None) or ["sliding_attention"] * len(windows)
    sliding = [bool(window) and t == "sliding_attention" for t in layer_types]
    assert windows == [window if local else -1 for local in sliding]


def test_longrope_exports_stop_at_the_original_context(from_hf_folder, capsys):
    _, export, _ = from_hf_folder("phi4-mini")  # PHI3: LongRoPE, an original context of 128
    assert json.loads((export / "export.json").read_text())["dims"]["max_context"] == 128
    capsys.readouterr()
    assert main(["run", str(export), "Hi " * 60, "--max-new-tokens", "64"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error:") and "context of 128 tokens" in error and len(error.splitlines()) == 1


@pytest.mark.parametrize(
    ("settings", "feature"),
    [
        (
            {
                **TINY_CONFIGS["llama"],
                "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
            },
            "rope_scaling of type 'dynamic'",
        ),
        ({**TINY_CONFIGS["gemma3"], "attn_logit_softcapping": 50.0}, "attention logit softcapping"),
    ],
)
def test_a_feature_the_export_would_get_wrong_is_one_error_naming_it(settings, feature, tmp_path, capsys):
    _hf_folder(settings, tmp_path / "hf")
    capsys.readouterr()  # what save_pretrained printed (its progress bar, the first time in a process)
    assert main(["export", str(tmp_path / "hf"), str(tmp_path / "export"), "--quiet"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error:") and feature in error and len(error.splitlines()) == 1
    assert not (tmp_path / "export").exists()


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_quantized_hf_checkpoint_is_one_error_naming_its_method(method, tmp_path, capsys):
    """A GPTQ / AWQ folder would need that method's kernels in transformers (a traceback without them): refused."""
    _hf_folder(TINY_CONFIGS["llama"], tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    quantization = {"quant_method": method, "bits": 4, "group_size": 128}
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    capsys.readouterr()
    assert main(["export", str(tmp_path / "hf"), str(tmp_path / "export"), "--quiet"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error:") and f"a {method} quantization" in error and len(error.splitlines()) == 1
    assert not (tmp_path / "export").exists()


def test_an_unknown_architecture_is_named_with_the_supported_ones(tmp_path, capsys):
    _hf_folder(TINY_CONFIGS["llama"], tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "model_type": "falcon"}))
    assert main(["export", str(tmp_path / "hf"), str(tmp_path / "export")]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: unsupported architecture 'falcon'")
    assert all(name in error for name in ("gemma3_text", "mistral", "phi3", "qwen2", "llama"))
