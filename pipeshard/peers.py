"""Other engines on the same weights, for `pipeshard bench`: onnxruntime-genai, llama.cpp
(llama-cpp-python), transformers, and our own native host (examples/native-host, on the pack itself). Each is
optional (`pip install 'pipeshard[bench]'`, `make host`); a peer that is missing is skipped with the line that
installs it.

Their model files are made once from the export's source into a peer folder beside the pack:
`hf/` (the same fp32 weights as the export, as a transformers folder), `ort-genai/` (its model
builder run on `hf/`), and for GGUF sources the GGUF as shipped plus `model-f32.gguf` (the same
tensors dequantized to F32, the like-for-like llama.cpp run of an fp32 pack) and `model-f16.gguf` (dequantized,
then matrices rounded to F16 and vectors kept F32, as llama.cpp's converter writes them: the weights of an fp16
pack of the same source).
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from pipeshard.core.errors import UserError
from pipeshard.core.fsutil import atomic_output_dir

PEERS = ("ort-genai", "llama.cpp", "llama.cpp-f32", "llama.cpp-f16", "transformers", "native")
PEER_MODULES = {
    "ort-genai": "onnxruntime_genai",
    "llama.cpp": "llama_cpp",
    "llama.cpp-f32": "llama_cpp",
    "llama.cpp-f16": "llama_cpp",
    "transformers": "transformers",
}
NATIVE_HOST_BUILD = (
    Path(__file__).resolve().parents[1] / "build" / "native-host"
)  # where `make host` builds it
DEQUANTIZED_GGUFS = {
    "llama.cpp-f32": "f32",
    "llama.cpp-f16": "f16",
}  # peer -> the type its GGUF is rewritten in
INSTALL_HINT = {
    "ort-genai": "pip install onnxruntime-genai onnx-ir",
    "llama.cpp": 'CMAKE_ARGS=\'-DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" '
    '-DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"\' '
    "pip install --no-cache-dir llama-cpp-python",
    "transformers": "pip install 'pipeshard[export]'",
}
INSTALL_HINT["llama.cpp-f32"] = INSTALL_HINT["llama.cpp-f16"] = INSTALL_HINT["llama.cpp"]
INSTALL_HINT["native"] = "make host (or set PIPESHARD_HOST_LIBRARY to a built libpipeshard_host.so)"


def native_host_library() -> Path:
    """The native host's shared library: $PIPESHARD_HOST_LIBRARY, else where `make host` puts it."""
    return Path(
        os.environ.get("PIPESHARD_HOST_LIBRARY") or NATIVE_HOST_BUILD / "build" / "libpipeshard_host.so"
    )


def missing_peer(name: str) -> str | None:
    """Why the peer cannot run here (with the install line), or None."""
    if name not in PEERS:
        raise UserError(f"unknown peer {name!r}; known: {', '.join(PEERS)}")
    found = (
        native_host_library().is_file() if name == "native" else importlib.util.find_spec(PEER_MODULES[name])
    )
    if not found:
        return f"{name} is not installed: {INSTALL_HINT[name]}"
    return None


def _source_argument(export_dir: Path) -> tuple[str, dict]:
    source = json.loads((export_dir / "export.json").read_text())["source"]
    return (source["name"] if source["kind"] in ("builtin", "tiny") else source["path"]), source


def source_gguf(export_dir: Path) -> Path | None:
    """The GGUF the export was made from, if it was made from one."""
    _, source = _source_argument(export_dir)
    return Path(source["path"]) if source["kind"] in ("builtin", "gguf") else None


def prepare_hf_folder(export_dir: Path, peer_dir: Path) -> Path:
    """The export's source as a transformers folder in fp32 (what the export holds), made once; for a VLM the whole
    model with its image processor."""
    out = peer_dir / "hf"
    if (out / "config.json").is_file():
        return out
    import torch

    from pipeshard.exporter.sources import load_source, resolve_source

    argument, _ = _source_argument(export_dir)
    loaded = load_source(resolve_source(argument), torch.float32)
    with atomic_output_dir(out, force=False) as staging:
        (loaded.model if loaded.vlm is None else loaded.vlm).save_pretrained(staging)
        loaded.tokenizer.save_pretrained(staging)
        if loaded.image_processor is not None:
            loaded.image_processor.save_pretrained(staging)
    return out


def prepare_ort_genai(export_dir: Path, peer_dir: Path, log) -> Path:
    """onnxruntime-genai's own fp32 CPU model, built by its model builder from the hf folder."""
    out = peer_dir / "ort-genai"
    if (out / "genai_config.json").is_file():
        return out
    hf = prepare_hf_folder(export_dir, peer_dir)
    log(f"building the onnxruntime-genai model from {hf} (once)")
    with atomic_output_dir(out, force=False) as staging:
        command = [
            sys.executable,
            "-m",
            "onnxruntime_genai.models.builder",
            "-i",
            str(hf),
            "-o",
            str(staging),
            "-p",
            "fp32",
            "-e",
            "cpu",
            "-c",
            str(peer_dir / "ort-genai-cache"),
        ]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise UserError(
                f"onnxruntime-genai's model builder failed: {done.stderr.strip().splitlines()[-1:]}"
            )
    return out


def prepare_dequantized_gguf(gguf_path: Path, peer_dir: Path, log, dtype: str = "f32") -> Path:
    """The GGUF's tensors dequantized to F32 with the same metadata: llama.cpp on exactly the weights
    the fp32 export holds (which were dequantized from the same file). With `dtype` "f16", the matrices then
    rounded to F16 (vectors stay F32, as llama.cpp's converter keeps them): the weights of an fp16 export."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    out = peer_dir / f"model-{dtype}.gguf"
    if out.is_file():
        return out
    log(f"writing an {dtype.upper()} copy of {gguf_path.name} (once)")
    reader = GGUFReader(gguf_path)
    architecture = reader.fields["general.architecture"].contents()
    peer_dir.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(out.name + ".partial")
    writer = GGUFWriter(staging, architecture)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    writer.add_file_type(0 if dtype == "f32" else 1)  # all F32, or mostly F16
    for tensor in reader.tensors:
        data = (
            dequantize(tensor.data, tensor.tensor_type)
            if tensor.tensor_type != GGMLQuantizationType.F32
            else np.asarray(tensor.data)
        )
        half = dtype == "f16" and data.ndim >= 2
        writer.add_tensor(tensor.name, np.ascontiguousarray(data, dtype=np.float16 if half else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    staging.replace(out)
    return out


# -- runners: each lives in its own bench worker process ------------------------------------------------------------
class TransformersRunner:
    """PyTorch eager, the same greedy loop as ours: prefill, then one token per step with the KV cache. With
    `images` (a VLM folder), its image processor and vision tower run inside the prefill's time."""

    def __init__(self, hf_folder: Path, threads: int, images: list[str] = (), sequences: int = 1) -> None:
        import torch
        from transformers import (
            AutoImageProcessor,
            AutoModelForCausalLM,
            AutoModelForImageTextToText,
            AutoTokenizer,
        )

        torch.set_num_threads(threads)
        self.torch = torch
        self.images, self.sequences = list(images), sequences
        vlm = "vision_config" in json.loads((Path(hf_folder) / "config.json").read_text())
        if self.images and not vlm:
            raise UserError(f"{hf_folder} is a text model: transformers cannot take --images with it")
        model_class = AutoModelForImageTextToText if vlm else AutoModelForCausalLM
        self.model = model_class.from_pretrained(hf_folder, dtype=torch.float32).eval()
        self.image_processor = (
            AutoImageProcessor.from_pretrained(hf_folder, use_fast=False) if self.images else None
        )
        self.tokenizer = AutoTokenizer.from_pretrained(hf_folder)
        self.facts = {
            "engine": "transformers",
            "version": sys.modules["transformers"].__version__,
            "model": str(hf_folder),
            "dtype": "fp32",
        }

    def prompt_ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def run(self, prompt: list[int], new_tokens: int) -> dict:
        torch = self.torch
        with torch.inference_mode():
            started = time.perf_counter()
            pixels = {}
            if self.images:
                from PIL import Image

                processed = self.image_processor(
                    images=[[Image.open(p).convert("RGB") for p in self.images]], return_tensors="pt"
                )
                pixels = {key: processed[key] for key in ("pixel_values", "pixel_attention_mask")}
            output = self.model(torch.tensor([prompt] * self.sequences), use_cache=True, **pixels)
            token = output.logits[:, -1:].argmax(-1)
            first = time.perf_counter()
            tokens, cache = [token], output.past_key_values
            while len(tokens) < new_tokens:
                output = self.model(token, past_key_values=cache, use_cache=True)
                token, cache = output.logits[:, -1:].argmax(-1), output.past_key_values
                tokens.append(token)
            done = time.perf_counter()
        batch = torch.cat(tokens, dim=1).tolist()
        return _timings(prompt, batch[0], started, first, done, len(batch), all(t == batch[0] for t in batch))


class OrtGenaiRunner:
    """onnxruntime-genai on its own builder's fp32 model, greedy, EOS held off until `new_tokens`."""

    def __init__(self, model_dir: Path, threads: int, sequences: int = 1) -> None:
        import onnxruntime_genai as og

        self.sequences = sequences
        self.og = og
        config = og.Config(str(model_dir))
        config.overlay(
            json.dumps(
                {
                    "model": {
                        "decoder": {
                            "session_options": {"intra_op_num_threads": threads, "inter_op_num_threads": 1}
                        }
                    }
                }
            )
        )
        self.model = og.Model(config)
        self.tokenizer = og.Tokenizer(self.model)
        self.facts = {
            "engine": "onnxruntime-genai",
            "version": og.__version__,
            "model": str(model_dir),
            "dtype": "fp32",
        }

    def prompt_ids(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text)]

    def run(self, prompt: list[int], new_tokens: int) -> dict:
        params = self.og.GeneratorParams(self.model)
        length = len(prompt) + new_tokens
        params.set_search_options(
            do_sample=False, max_length=length, min_length=length, batch_size=self.sequences
        )
        generator = self.og.Generator(self.model, params)
        started = time.perf_counter()
        generator.append_tokens(np.array([prompt] * self.sequences, np.int32))
        generator.generate_next_token()
        first = time.perf_counter()
        while generator.token_count() < length:
            generator.generate_next_token()
        done = time.perf_counter()
        batch = [
            [int(t) for t in generator.get_sequence(row)[len(prompt) :]] for row in range(self.sequences)
        ]
        return _timings(prompt, batch[0], started, first, done, len(batch), all(t == batch[0] for t in batch))


class LlamaCppRunner:
    """llama.cpp through llama-cpp-python, greedy, the prompt evaluated afresh each run."""

    def __init__(self, gguf_path: Path, threads: int, context: int) -> None:
        import llama_cpp

        self.llm = llama_cpp.Llama(
            model_path=str(gguf_path),
            n_ctx=context,
            n_threads=threads,
            n_threads_batch=threads,
            n_batch=512,
            verbose=False,
        )
        self.facts = {
            "engine": "llama.cpp (llama-cpp-python)",
            "version": llama_cpp.__version__,
            "model": str(gguf_path),
            "dtype": _gguf_file_type(gguf_path),
        }

    def prompt_ids(self, text: str) -> list[int]:
        return list(self.llm.tokenize(text.encode(), add_bos=False, special=True))

    def run(self, prompt: list[int], new_tokens: int) -> dict:
        llm = self.llm
        llm.reset()  # or a repeated prompt would skip its evaluation
        started = time.perf_counter()
        llm.eval(prompt)
        token = int(llm.sample(temp=0.0))
        first = time.perf_counter()
        tokens = [token]
        while len(tokens) < new_tokens:
            llm.eval([token])
            token = int(llm.sample(temp=0.0))
            tokens.append(token)
        done = time.perf_counter()
        return _timings(prompt, tokens, started, first, done)


class HostOptions(ctypes.Structure):
    """The native host's `pipeshard_options` (examples/native-host/include/pipeshard_host.h, ABI 3)."""

    _fields_ = [
        ("abi_version", ctypes.c_int),
        ("plans_path", ctypes.c_char_p),
        ("device", ctypes.c_char_p),
        ("extensions_library", ctypes.c_char_p),
        ("threads", ctypes.c_int),
        ("context", ctypes.c_int),
        ("vram_budget_bytes", ctypes.c_uint64),
        ("budget_mode", ctypes.c_int),
        ("vram_reserve_bytes", ctypes.c_uint64),
        ("prefill_chunk_tokens", ctypes.c_int),
        ("sessions_per_step", ctypes.c_int),
    ]


class HostSampling(ctypes.Structure):
    """The native host's `pipeshard_sampling`."""

    _fields_ = [
        ("max_new_tokens", ctypes.c_int),
        ("temperature", ctypes.c_float),
        ("top_k", ctypes.c_int),
        ("top_p", ctypes.c_float),
        ("repetition_penalty", ctypes.c_float),
        ("seed", ctypes.c_uint64),
        ("use_chat_template", ctypes.c_int),
        ("system_prompt", ctypes.c_char_p),
        ("stop_strings", ctypes.POINTER(ctypes.c_char_p)),
        ("stop_string_count", ctypes.c_size_t),
    ]


HOST_TOKEN_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.c_char_p, ctypes.c_void_p)


class NativeHostRunner:
    """The native host (examples/native-host) on the pack, all-CPU, through its C ABI (include/pipeshard_host.h),
    greedy from token ids (no tokenizer loaded). It stops at the end-of-sequence token (its ABI has no switch to
    hold it off), so its row can end before the others."""

    def __init__(self, pack: Path, threads: int, context: int) -> None:
        from pipeshard.formats.manifest import load_pack

        library_path = native_host_library()
        self.library = library = ctypes.CDLL(str(library_path))
        library.pipeshard_last_error.restype = ctypes.c_char_p
        options = HostOptions()
        library.pipeshard_default_options(ctypes.byref(options))
        options.threads, options.context = threads, context  # no extensions library: token ids in and out
        self.host = ctypes.c_void_p()
        if library.pipeshard_open(str(pack).encode(), ctypes.byref(options), ctypes.byref(self.host)) != 0:
            raise UserError(
                f"the native host cannot open {pack}: {library.pipeshard_last_error(None).decode()}"
            )
        self.facts = {
            "engine": "pipeshard native host",
            "model": str(pack),
            "library": str(library_path),
            "dtype": load_pack(Path(pack)).model.dtype,
        }

    def _check(self, status: int) -> None:
        if status != 0:
            raise RuntimeError(self.library.pipeshard_last_error(self.host).decode())

    def prompt_ids(self, text: str) -> None:
        return None  # it takes the bench's ids; its tokenizer needs the extensions library, not loaded here

    def run(self, prompt: list[int], new_tokens: int) -> dict:
        sampling = HostSampling()
        self.library.pipeshard_default_sampling(ctypes.byref(sampling))
        sampling.max_new_tokens = new_tokens
        tokens, times = [], []

        def on_token(token_id: int, _piece: bytes, _user_data) -> int:
            times.append(time.perf_counter())
            tokens.append(int(token_id))
            return 0

        callback = HOST_TOKEN_CALLBACK(on_token)
        ids = (ctypes.c_int64 * len(prompt))(*prompt)
        started = time.perf_counter()
        self._check(
            self.library.pipeshard_generate_ids(
                self.host, ids, len(prompt), ctypes.byref(sampling), callback, None
            )
        )
        return _timings(prompt, tokens, started, times[0], times[-1])


def _gguf_file_type(path: Path) -> str:
    from gguf import GGUFReader, LlamaFileType

    field = GGUFReader(path).fields.get("general.file_type")
    name = LlamaFileType(field.contents()).name.removeprefix("MOSTLY_").removeprefix("ALL_") if field else "?"
    return {"F32": "fp32", "F16": "fp16", "BF16": "bf16"}.get(
        name, name
    )  # a pack's dtype names where they agree


def _timings(
    prompt: list[int],
    tokens: list[int],
    started: float,
    first: float,
    done: float,
    sequences: int = 1,
    sequences_agree: bool = True,
) -> dict:
    """A run's figures; with a batch, `tokens` are the first sequence's and the rates count every sequence."""
    return {
        "tokens": tokens,
        "ttft_s": first - started,
        "prefill_tok_s": sequences * len(prompt) / (first - started),
        "decode_tok_s": sequences * (len(tokens) - 1) / (done - first) if len(tokens) > 1 else 0.0,
        "sequences_agree": sequences_agree,
    }


def prepare_peer_files(name: str, export_dir: Path, peer_dir: Path, log, pack_dir: Path) -> Path:
    """Make the peer's model files once (heavy: run it in a process of its own); return their path."""
    if name == "native":
        return pack_dir
    if name == "transformers":
        return prepare_hf_folder(export_dir, peer_dir)
    if name == "ort-genai":
        return prepare_ort_genai(export_dir, peer_dir, log)
    gguf_path = source_gguf(export_dir)
    if gguf_path is None:
        raise UserError("the export was not made from a GGUF file, so there is no GGUF for llama.cpp to run")
    if name in DEQUANTIZED_GGUFS:
        return prepare_dequantized_gguf(gguf_path, peer_dir, log, DEQUANTIZED_GGUFS[name])
    return gguf_path


def make_peer_runner(
    name: str, model_path: Path, threads: int, context: int, images: list[str] = (), sequences: int = 1
):
    """The peer's runner on files made by `prepare_peer_files`; only transformers takes `images`, only it and
    onnxruntime-genai a batch of `sequences`."""
    if images and name != "transformers":
        raise UserError(f"{name} does not run a vision-language model here (--image)")
    if sequences > 1 and name not in ("transformers", "ort-genai"):
        raise UserError(f"{name} runs one sequence here (--sequences)")
    if name == "transformers":
        return TransformersRunner(model_path, threads, images, sequences)
    if name == "ort-genai":
        return OrtGenaiRunner(model_path, threads, sequences)
    if name == "native":
        return NativeHostRunner(model_path, threads, context)
    return LlamaCppRunner(model_path, threads, context)
