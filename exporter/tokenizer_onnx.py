"""ONNX tokenizer and detokenizer (onnxruntime-extensions ops) built from the local tokenizer.json.

`gen_processing_models` would fetch from the hub; we build the two single-op graphs ourselves so a
host without Python (a game engine with ONNX Runtime and the extensions library) can tokenize.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

log = logging.getLogger(__name__)

EXTENSIONS_DOMAIN = "ai.onnx.contrib"
ENCODER_FILE, DECODER_FILE = "tokenizer.onnx", "detokenizer.onnx"
CHECK_STRINGS = [
    "Hello, world!",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
    "def f(x):\n    return x ** 2  # square",
    "Grüße aus Köln – ça va? 東京 🚀",
    "   leading spaces and\ttabs",
]


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (byte-level BPE vocabularies)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


def _extensions_tokenizer_config(tokenizer_config_json: Path) -> str:
    """The tokenizer config as the extensions op reads it: transformers 5 writes the class
    `TokenizersBackend`, which the op does not know; a byte-level BPE is a GPT2Tokenizer to it."""
    config = json.loads(tokenizer_config_json.read_text(encoding="utf-8"))
    if config.get("tokenizer_class") in (None, "TokenizersBackend", "PreTrainedTokenizerFast"):
        config["tokenizer_class"] = "GPT2Tokenizer"
    return json.dumps(config)


def _model(node: onnx.NodeProto, inputs, outputs) -> onnx.ModelProto:
    """A one-op graph at the lowest IR version that holds its opsets: older ONNX Runtimes (the Unity plugin's 1.29)
    refuse the newest IR a current onnx package stamps by default."""
    graph = helper.make_graph([node], node.op_type, inputs, outputs)
    opsets = [helper.make_operatorsetid("", 17), helper.make_operatorsetid(EXTENSIONS_DOMAIN, 1)]
    return helper.make_model(
        graph, opset_imports=opsets, ir_version=helper.find_min_ir_version_for(opsets, ignore_unknown=True)
    )


def build_tokenizer_models(
    tokenizer_json: Path, tokenizer_config_json: Path
) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """(encoder: string[N] -> int64 ids[N, L], decoder: int64 ids -> string) for a byte-level BPE."""
    encoder = _model(
        helper.make_node(
            "HfJsonTokenizer",
            ["text"],
            ["input_ids"],
            domain=EXTENSIONS_DOMAIN,
            tokenizer_vocab=tokenizer_json.read_text(encoding="utf-8"),
            tokenizer_config=_extensions_tokenizer_config(tokenizer_config_json),
        ),
        [helper.make_tensor_value_info("text", TensorProto.STRING, ["N"])],
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["N", "L"])],
    )
    spec = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    id_to_token = {index: token for token, index in spec["model"]["vocab"].items()}
    added = {entry["id"]: entry["content"] for entry in spec.get("added_tokens", [])}
    id_to_token.update(added)
    special_ids = [entry["id"] for entry in spec.get("added_tokens", []) if entry.get("special")]
    decoder = _model(
        helper.make_node(
            "BpeDecoder",
            ["ids"],
            ["text"],
            domain=EXTENSIONS_DOMAIN,
            id_vocab="\n".join(id_to_token.get(i, "") for i in range(max(id_to_token) + 1)),
            byte_decoder="\n".join(f"{ord(char)}\t{byte}" for byte, char in _byte_to_unicode().items()),
            added_tokens="\n".join(f"{i}\t{text}" for i, text in added.items()),
            all_special_ids="\n".join(str(i) for i in special_ids),
            skip_special_tokens=0,
        ),
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [None])],
        [helper.make_tensor_value_info("text", TensorProto.STRING, [1])],
    )
    return encoder, decoder


def check_tokenizer_models(encoder_path: Path, decoder_path: Path, tokenizer_json: Path) -> dict[str, int]:
    """Compare the ONNX tokenizer with the `tokenizers` library on fixed strings."""
    import onnxruntime
    from onnxruntime_extensions import get_library_path
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(str(tokenizer_json))
    options = onnxruntime.SessionOptions()
    options.register_custom_ops_library(get_library_path())
    options.log_severity_level = 3
    encode = onnxruntime.InferenceSession(str(encoder_path), options, providers=["CPUExecutionProvider"])
    decode = onnxruntime.InferenceSession(str(decoder_path), options, providers=["CPUExecutionProvider"])
    matched = 0
    for text in CHECK_STRINGS:
        expected = reference.encode(text, add_special_tokens=False).ids
        ids = encode.run(None, {"text": np.array([text])})[0][0].tolist()
        decoded = decode.run(None, {"ids": np.array(expected, dtype=np.int64)})[0]
        decoded_text = str(decoded.reshape(-1)[0]) if decoded.size else ""
        matched += ids == expected and decoded_text == reference.decode(expected, skip_special_tokens=False)
    return {"strings": len(CHECK_STRINGS), "matched": matched}


def _is_byte_level(tokenizer_json: Path) -> bool:
    spec = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    decoder = spec.get("decoder") or {}
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", [])]
    return spec.get("model", {}).get("type") == "BPE" and "ByteLevel" in kinds


def write_tokenizer_models(folder: Path) -> dict:
    """Write the ONNX tokenizer and detokenizer beside `tokenizer.json` when they reproduce it on every check
    string; otherwise write neither (a host would tokenize wrongly) and say why in the returned record."""
    tokenizer_json = folder / "tokenizer.json"
    if not _is_byte_level(tokenizer_json):
        reason = "not a byte-level BPE tokenizer (the ONNX detokenizer handles only those)"
        log.warning("warning: no ONNX tokenizer written: %s", reason)
        return {"strings": len(CHECK_STRINGS), "matched": 0, "skipped": reason}
    encoder, decoder = build_tokenizer_models(tokenizer_json, folder / "tokenizer_config.json")
    onnx.save(encoder, folder / ENCODER_FILE)
    onnx.save(decoder, folder / DECODER_FILE)
    check = check_tokenizer_models(folder / ENCODER_FILE, folder / DECODER_FILE, tokenizer_json)
    if check["matched"] != check["strings"]:
        for name in (ENCODER_FILE, DECODER_FILE):
            (folder / name).unlink()
        check["skipped"] = (
            f"the ONNX tokenizer matched {check['matched']} of {check['strings']} check strings"
        )
        log.warning("warning: no ONNX tokenizer written: %s", check["skipped"])
    return check
