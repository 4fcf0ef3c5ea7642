"""`pipeshard export MODEL OUT`: the optimum-style export of a decoder to an ONNX folder."""

from __future__ import annotations

import logging
import os
import platform
import time
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from pipeshard.core.errors import UserError
from pipeshard.core.fsutil import atomic_output_dir, sha256_file, write_json_atomic
from pipeshard.exporter.offline import force_offline
from pipeshard.formats.export_info import ATTENTION_DTYPES, EXPORT_SCHEMA_VERSION, KV_CACHE

log = logging.getLogger(__name__)

# the stored weights' type -> the torch type the model is loaded in; fp16 and bf16 weights are computed in float32
# (exporter/half_weights.py), so every export computes in float32 and is checked against PyTorch at one tolerance.
# `gguf`: a GGUF's quantized tensors kept as their blocks (exporter/quantized_weights.py), traced over the
# dequantized float32 weights transformers loads.
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "gguf": "float32"}
COMPUTE_DTYPE = "fp32"
LOGIT_TOLERANCE = 1e-3
# float32 against float32, relative to the largest logit where that is larger: the two sum in other orders, and the
# rounding grows with the logits (a 16-layer model of random weights: logits to 205, 7.9e-6 of them apart)
LOGIT_RELATIVE_TOLERANCE = 1e-4
# float16 attention against PyTorch's attention on float16-rounded q, k, v and output, relative to the largest
# logit: the kernels also round inside (rotary on float16 q and k, the scores, the probabilities) where the
# reference does not, so the two differ by float16 steps (2^-10 relative) accumulated over the layers
HALF_ATTENTION_RELATIVE_TOLERANCE = 2**-6
MODEL_FILE = "model.onnx"
TOOL_PACKAGES = [
    "pipeshard",
    "torch",
    "transformers",
    "optimum",
    "onnx",
    "onnxscript",
    "onnxruntime",
    "onnxruntime-extensions",
    "gguf",
]


@dataclass
class ExportResult:
    """What an export wrote, and how it went."""

    out: Path
    files: dict[str, int]
    seconds: float
    max_logit_difference: float


def _versions() -> dict[str, str]:
    found = {}
    for package in TOOL_PACKAGES:
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            continue
    found["python"] = platform.python_version()
    return found


def _stages(total: int, quiet: bool):
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc="export",
        unit="stage",
        disable=True if quiet else None,
        leave=False,
        bar_format="{desc}: {n_fmt}/{total_fmt} stages |{bar:20}| {elapsed}",
    )


def _quiet_third_party_output() -> None:
    """Our progress bar is the one the user sees: mute transformers' bars and torch's exporter chatter
    unless -v (INFO) was asked for."""
    if logging.getLogger().getEffectiveLevel() <= logging.INFO:
        return
    import torch.onnx  # noqa: F401 - torch configures its loggers on import; override after it
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    for name in (
        "torch.onnx",
        "torch.onnx._internal.exporter._registration",
        "torch._dynamo",
        "torch.export",
        "onnxscript",
    ):
        logging.getLogger(name).setLevel(logging.ERROR)


def _export_vision(source, staging: Path, opset: int) -> dict:
    """A VLM's vision graph beside the decoder, checked against PyTorch; its description for export.json."""
    from pipeshard.exporter import gemma3_vl, qwen_vl, vision_tower, vlm
    from pipeshard.exporter.image_processing import preprocessing_config

    preprocessing = preprocessing_config(source.image_processor, source.vlm.config)
    if qwen_vl.is_qwen_vl(source.vlm.config.model_type):
        difference = qwen_vl.export_vision(source.vlm, staging / vlm.VISION_FILE, opset, preprocessing)
        description = qwen_vl.vision_description(source.vlm)
    elif gemma3_vl.is_gemma3_vl(source.vlm.config.model_type):
        tower, size = gemma3_vl.vision_tower(source.vlm), source.vlm.config.vision_config.image_size
        difference = vlm.export_tile_tower(tower, size, source.vlm.dtype, staging / vlm.VISION_FILE, opset)
        description = gemma3_vl.vision_description(source.vlm)
    elif not vlm.is_vlm_architecture(source.vlm.config.model_type):  # exporter/vision_tower.py
        where = source.description.get("path", source.description["name"])
        difference = vision_tower.export_vision(source.vlm, staging / vlm.VISION_FILE, opset, where)
        description = vision_tower.vision_description(source.vlm)
    else:
        difference = vlm.export_vision(source.vlm, staging / vlm.VISION_FILE, opset)
        description = vlm.vision_description(source.vlm)
    if not difference <= LOGIT_TOLERANCE:
        raise RuntimeError(f"exported image features differ from PyTorch by {difference:.3g}")
    return {**description, "max_difference_vs_pytorch": difference, "preprocessing": preprocessing}


def stored_dtype(spec, dtype: str) -> str:
    """The weights' type an export of `spec` stores: `auto` keeps a GGUF language model's quantized blocks
    (`gguf`) and computes everything else in float32 as traced."""
    keeps_blocks = spec.gguf_file is not None and not spec.vision
    if dtype == "auto":
        return "gguf" if keeps_blocks else "fp32"
    if dtype == "gguf" and not keeps_blocks:
        raise UserError(
            f"--dtype gguf keeps a GGUF language model's quantized blocks; {spec.name} is "
            + ("a vision-language model" if spec.vision else "not a GGUF file")
        )
    return dtype


def logit_tolerance(attention_dtype: str, largest_logit: float) -> float:
    """How far the export's logits may be from PyTorch's: float32 rounding, or float16 attention's steps."""
    if attention_dtype != COMPUTE_DTYPE:
        return HALF_ATTENTION_RELATIVE_TOLERANCE * largest_logit
    return max(LOGIT_TOLERANCE, LOGIT_RELATIVE_TOLERANCE * largest_logit)


def export_model(
    model: str,
    out: Path,
    dtype: str = "auto",
    force: bool = False,
    opset: int | None = None,
    quiet: bool = False,
    attention_dtype: str = COMPUTE_DTYPE,
) -> ExportResult:
    """Export MODEL to OUT (atomically): ONNX decoder, weights, config, tokenizer files, export.json.
    `attention_dtype`: what the fused attention and its KV cache compute in (`fp16`: what a GPU's fused kernels
    need, checked against transformers with its attention in float16; docs/precision.md)."""
    if dtype not in (*DTYPES, "auto"):
        raise UserError(f"unknown dtype {dtype!r}; choose one of: auto, {', '.join(DTYPES)}")
    if attention_dtype not in ATTENTION_DTYPES:
        raise UserError(
            f"unknown attention dtype {attention_dtype!r}; choose one of: {', '.join(ATTENTION_DTYPES)}"
        )
    out = Path(out)
    if out.exists() and not force:
        raise UserError(f"{out} already exists (use --force to replace it)")
    force_offline()
    from pipeshard.exporter.configs import export_config_for
    from pipeshard.exporter.fuse import fuse_exported_model
    from pipeshard.exporter.onnx_export import DEFAULT_OPSET, export_decoder, max_logit_difference
    from pipeshard.exporter.sources import load_source, resolve_source
    from pipeshard.exporter.tokenizer_onnx import write_tokenizer_models

    opset = opset or DEFAULT_OPSET
    spec = resolve_source(model)
    dtype = stored_dtype(spec, dtype)
    _quiet_third_party_output()
    import torch

    started = time.perf_counter()
    with atomic_output_dir(out, force) as staging, _stages(5, quiet) as progress:
        progress.set_description("load model")
        source = load_source(spec, getattr(torch, DTYPES[dtype]))
        source.model.float()  # the weights keep the half type's values; the trace and the reference compute in fp32
        image_token_id = None
        if source.vlm is not None:
            source.vlm.float()  # its vision graph too (stored in fp32)
            image_token_id = int(source.vlm.config.image_token_id)
        export_config = export_config_for(source.model.config, COMPUTE_DTYPE, image_token_id)
        mask_as_bias = getattr(source.model, "MASK_READS_INPUT_IDS", False)
        if mask_as_bias and attention_dtype != COMPUTE_DTYPE:
            raise UserError(
                f"{spec.name}: attention within an image's tokens needs the mask as an attention bias, which "
                f"{attention_dtype} attention on a device drops; export with --attention-dtype {COMPUTE_DTYPE}"
            )
        progress.update()

        stored_rows = None
        if dtype == "gguf":
            from pipeshard.exporter.quantized_weights import read_stored_rows
            from pipeshard.exporter.sources import gguf_reader

            stored_rows = read_stored_rows(gguf_reader(spec.folder / spec.gguf_file))
        progress.set_description("trace + write ONNX")
        vision = _export_vision(source, staging, opset) if source.vlm is not None else None
        export_decoder(source.model, export_config, staging / MODEL_FILE, opset)
        dims = export_config.dims
        # M-RoPE positions are not a token's place in the cache: rotary stays apart from GQA there.
        fuse_exported_model(
            staging / MODEL_FILE,
            dims.num_attention_heads,
            dims.num_key_value_heads,
            dims.head_dim,
            COMPUTE_DTYPE,
            dims.max_context if export_config.POSITION_ROWS == 1 else None,
            dims.sliding_window or None,
            stored_dtype=dtype,
            stored_rows=stored_rows,
            attention_dtype=attention_dtype,
            # masks that let a query see later keys (Gemma 3's image runs) go to the attention whole
            mask_as_bias=mask_as_bias,
        )
        progress.update()

        progress.set_description("validate against PyTorch")
        difference, largest_logit = max_logit_difference(
            source.model, export_config, staging / MODEL_FILE, attention_dtype
        )
        tolerance = logit_tolerance(attention_dtype, largest_logit)
        if not difference <= tolerance:
            raise UserError(
                f"the exported graph's logits differ from PyTorch's by {difference:.3g} (> {tolerance:.3g}, the "
                f"largest logit {largest_logit:.3g}): nothing was exported; a pipeshard defect, please report it "
                "with the model"
            )
        progress.update()

        progress.set_description("tokenizer")
        source.model.config.save_pretrained(staging)
        source.model.generation_config.save_pretrained(staging)
        source.tokenizer.save_pretrained(staging)
        if source.image_processor is not None:
            source.image_processor.save_pretrained(staging)
        tokenizer_check = write_tokenizer_models(staging)
        progress.update()

        progress.set_description("checksums")
        files = {p.name: p.stat().st_size for p in sorted(staging.iterdir()) if p.is_file()}
        document = {
            "schema_version": EXPORT_SCHEMA_VERSION,
            "source": source.description,
            "architecture": source.model.config.model_type,
            **({"vision": vision} if vision else {}),
            "task": export_config.task,
            "dims": asdict(export_config.dims),
            "tie_word_embeddings": bool(getattr(source.model.config, "tie_word_embeddings", False)),
            "dtype": dtype,
            "compute_dtype": COMPUTE_DTYPE,
            "attention_dtype": attention_dtype,
            "opset": opset,
            "kv_cache": KV_CACHE,
            "model_file": MODEL_FILE,
            "inputs": list(export_config.inputs),
            "position_rows": export_config.POSITION_ROWS,
            "outputs": list(export_config.outputs),
            **({"quantized_weights": stored_rows.kept} if stored_rows else {}),
            "max_logit_difference_vs_pytorch": difference,
            "onnx_tokenizer_check": tokenizer_check,
            "tools": _versions(),
            "files": {
                name: {"bytes": size, "sha256": sha256_file(staging / name)} for name, size in files.items()
            },
        }
        write_json_atomic(staging / "export.json", document)
        progress.update()
    os.sync()
    return ExportResult(out, files, time.perf_counter() - started, difference)
