"""`pipeshard partition EXPORT_DIR PACK`: cut the decoder and write the model pack.

The pack is a folder of sub-layer ONNX files, one weight blob per sub-layer (4096-byte aligned
tensors, beside the ONNX files because ONNX Runtime refuses external data elsewhere), a
weights-as-inputs variant of each sub-layer for device sessions, and `manifest.json`
(docs/model-pack.md). Weights are read once, from the export's data file, straight into blobs.
"""

from __future__ import annotations

import hashlib
import logging
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.external_data_helper import ExternalDataInfo

from pipeshard.core.errors import UserError
from pipeshard.core.fsutil import atomic_output_dir, check_output_dir, sha256_file, write_json_atomic
from pipeshard.core.version import __version__
from pipeshard.formats.export_info import ExportVision, read_export_info
from pipeshard.formats.io_names import GQA_BIAS_INPUT, PAST_PREFIX, PRESENT_PREFIX
from pipeshard.formats.manifest import (
    MANIFEST_NAME,
    WEIGHT_ALIGNMENT,
    Blob,
    Cost,
    FileDigest,
    KvSpec,
    Manifest,
    ModelFacts,
    RowChunks,
    TensorInfo,
    VisionSection,
    Weight,
)
from pipeshard.formats.manifest import SubLayer as ManifestEntry
from pipeshard.partitioner.costs import (
    DTYPE_BYTES,
    bytes_moved,
    checked_flops,
    counted_flops,
    kv_bytes_per_token,
)
from pipeshard.partitioner.graph import (
    PROLOGUE,
    VISION_PROLOGUE,
    SubLayer,
    assign_sub_layers,
    build_graph,
    cut,
    expert_index,
    fused_transposed_products,
    hoist_step_invariants,
    keep_embedding_whole,
    merge_duplicate_prologue_nodes,
    moe_blocks,
    moe_internal_tensors,
    topologically_sorted,
    untranspose_tied_weights,
    verify_cut,
)
from pipeshard.partitioner.host_files import (
    CHAT_TEMPLATE_FILE,
    MIN_ONNXRUNTIME,
    TOKENIZER_GRAPHS,
    prerendered_chat_template,
    write_tokenizer_graph,
)
from pipeshard.partitioner.rules import RULES_BY_ARCHITECTURE, VISION_RULES_BY_FAMILY

log = logging.getLogger(__name__)
ONNX_DTYPE_NAMES = {
    onnx.TensorProto.FLOAT: "float32",
    onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.BFLOAT16: "bfloat16",
    onnx.TensorProto.INT64: "int64",
    onnx.TensorProto.BOOL: "bool",
    onnx.TensorProto.INT32: "int32",
    onnx.TensorProto.UINT8: "uint8",
    onnx.TensorProto.INT8: "int8",
}


@dataclass
class PartitionResult:
    pack: Path
    sub_layers: int
    weight_bytes: int
    seconds: float


class Placement(NamedTuple):
    """Where a weight's bytes are in the pack: its blob, and its place in it."""

    file: str
    offset: int
    bytes: int


class VisionDims(NamedTuple):
    """What a vision block's attention cost is counted from (partitioner/costs.py)."""

    hidden_size: int
    num_attention_heads: int
    head_dim: int


def _weight_records(sub_layer, initializers: dict, placements: dict[str, Placement]) -> tuple[Weight, ...]:
    """The manifest's records of a sub-layer's stored weights: name, shape, dtype and where its blob holds it."""
    return tuple(
        Weight(
            name,
            tuple(initializers[name].dims),
            ONNX_DTYPE_NAMES[initializers[name].data_type],
            *placements[name],
        )
        for name in sub_layer.initializers
        if name in placements
    )


def _value_infos(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """Type and shape of every tensor: the exporter's, and ONNX shape inference for the tensors the
    export's rewrites added without one (only metadata is read: the weights stay unloaded)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    infos = {v.name: v for v in inferred.graph.value_info}
    infos.update({v.name: v for v in model.graph.value_info})
    infos.update({v.name: v for v in model.graph.input})
    infos.update({v.name: v for v in model.graph.output})
    return infos


def _dims(info: onnx.ValueInfoProto) -> list:
    return [
        d.dim_value if d.HasField("dim_value") else d.dim_param or "?"
        for d in info.type.tensor_type.shape.dim
    ]


def _with_last_dim(info: onnx.ValueInfoProto, name: str) -> onnx.ValueInfoProto:
    dims = _dims(info)
    return helper.make_tensor_value_info(info.name, info.type.tensor_type.elem_type, [*dims[:-1], name])


def _describe(info: onnx.ValueInfoProto, rows_of: str | None = None) -> TensorInfo:
    elem_type = info.type.tensor_type.elem_type
    return TensorInfo(info.name, _dims(info), ONNX_DTYPE_NAMES.get(elem_type, str(elem_type)), rows_of)


def _external(initializer: onnx.TensorProto) -> ExternalDataInfo | None:
    """Where an external weight's bytes are in the export's data file (location, offset, length)."""
    if initializer.data_location != onnx.TensorProto.EXTERNAL:
        return None
    return ExternalDataInfo(initializer)


def _weight_owners(sub_layers: list[SubLayer], initializers: dict[str, onnx.TensorProto]) -> dict[str, str]:
    """Each external weight is stored once, in the blob of the last sub-layer that uses it (a tied
    embedding lives with the lm_head; the embedding Gather reads it from there)."""
    owners: dict[str, str] = {}
    for sub_layer in sub_layers:
        for name in sub_layer.initializers:
            if _external(initializers[name]) is not None:
                owners[name] = sub_layer.name
    return owners


def _write_blobs(
    sub_layers, owners, initializers, source_data: Path | None, staging: Path
) -> tuple[dict[str, Placement], dict[str, Blob]]:
    """Copy each owned weight from the export's data file into its sub-layer's blob, aligned. With no
    `source_data` (a shape-only export) only the layout is made: the same offsets and sizes, no files and no
    digests."""
    source = np.memmap(source_data, dtype=np.uint8, mode="r") if source_data else None
    placements: dict[str, Placement] = {}
    blobs: dict[str, Blob] = {}
    for sub_layer in sub_layers:
        owned = [name for name in sub_layer.initializers if owners.get(name) == sub_layer.name]
        if not owned:
            continue
        blob_name = f"{sub_layer.name}.weights"
        digest = hashlib.sha256()
        offset = 0
        with open(staging / blob_name, "wb") if source is not None else nullcontext() as blob:
            for name in owned:
                padding = (-offset) % WEIGHT_ALIGNMENT
                if padding and blob is not None:
                    blob.write(b"\0" * padding)
                    digest.update(b"\0" * padding)
                offset += padding
                entry = _external(initializers[name])
                start, length = entry.offset or 0, entry.length
                if blob is not None:
                    chunk = source[start : start + length]
                    if len(chunk) != length:
                        raise UserError(
                            f"{source_data} is truncated: weight {name} ends past the end of the file"
                        )
                    blob.write(chunk)
                    digest.update(chunk)
                placements[name] = Placement(blob_name, offset, length)
                offset += length
        blobs[sub_layer.name] = Blob(blob_name, offset, digest.hexdigest() if blob is not None else None)
    return placements, blobs


def row_chunkable_weight(model: onnx.ModelProto, sub_layer, initializers) -> str | None:
    """The output layer's weight W [vocab, hidden] when every use of it is `Gemm(x, W, transB=1)` (W or its Cast):
    then any range of W's rows gives that range of the logits, so a device can stream and compute
    the layer in row chunks (SmolLM2's tied lm_head is 108 MiB, ten times any other sub-layer)."""
    if sub_layer.kind != "final":
        return None
    nodes = [model.graph.node[i] for i in sub_layer.nodes]
    casts = {
        n.input[0]: n.output[0] for n in nodes if n.op_type == "Cast"
    }  # half-precision weights read as float
    for name in sub_layer.initializers:
        read_as = casts.get(name, name)
        users = [n for n in nodes if read_as in n.input]
        if (
            len(initializers[name].dims) == 2
            and users
            and all(
                n.op_type == "Gemm"
                and list(n.input).index(read_as) == 1
                and any(a.name == "transB" and a.i == 1 for a in n.attribute)
                for n in users
            )
        ):
            return name
    return None


def row_prefix_outputs(model: onnx.ModelProto, sub_layer, initializers) -> dict[str, str]:
    """Outputs that every step are the first rows of one of the sub-layer's stored weights,
    `Slice(W, starts=[0], ends, axes=[0])` (the rotary cos/sin tables up to the step's length), by the
    weight: a consumer that takes longer tables (GroupQueryAttention's caches) can be given W itself,
    once, instead of the per-step slice."""
    nodes = [model.graph.node[i] for i in sub_layer.nodes]
    constants = {
        n.output[0]: numpy_helper.to_array(n.attribute[0].t).tolist()
        for n in nodes
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"
    }
    constants.update(
        {
            name: numpy_helper.to_array(i).tolist()
            for name, i in initializers.items()
            if i.data_type == onnx.TensorProto.INT64 and not _external(i) and len(i.dims) == 1
        }
    )

    def value(node: onnx.NodeProto, index: int):
        return constants.get(node.input[index]) if len(node.input) > index and node.input[index] else None

    return {
        node.output[0]: node.input[0]
        for node in nodes
        if node.op_type == "Slice"
        and node.output[0] in sub_layer.outputs
        and node.input[0] in sub_layer.initializers
        and _external(initializers[node.input[0]])
        and value(node, 1) == [0]
        and value(node, 3) == [0]
        and value(node, 4) in (None, [1])
    }


def _sub_model(
    model,
    sub_layer,
    infos,
    initializers,
    placements,
    weights_as_inputs: bool,
    row_chunks: str | None = None,
    unmasked_attention: bool = False,
) -> onnx.ModelProto:
    """A sub-layer's graph: weights as stored (`onnx`), or as inputs (`weights_as_inputs`, the device's variant,
    whose attentions take no bias with `unmasked_attention`: ModelFacts.device_attention_masks_padding)."""
    nodes = [model.graph.node[i] for i in sub_layer.nodes]
    if weights_as_inputs:  # the device's variant
        nodes = fused_transposed_products(nodes)
        if unmasked_attention:
            nodes = [_without_attention_bias(node) for node in nodes]
    inputs = [infos[name] for name in sub_layer.inputs]
    outputs = [infos[name] for name in sub_layer.outputs]
    if weights_as_inputs and row_chunks:  # the logits of a row chunk are as wide as the chunk
        outputs = [_with_last_dim(info, "rows") for info in outputs]
    stored = []
    for name in sub_layer.initializers:
        original = initializers[name]
        if name not in placements:
            stored.append(original)  # small constant, inline
        elif weights_as_inputs:
            dims = ["rows", *original.dims[1:]] if name == row_chunks else list(original.dims)
            inputs.append(helper.make_tensor_value_info(name, original.data_type, dims))
        else:
            stub = onnx.TensorProto()
            stub.CopyFrom(original)
            del stub.external_data[:]
            place = placements[name]
            for key, value in (
                ("location", place.file),
                ("offset", str(place.offset)),
                ("length", str(place.bytes)),
            ):
                stub.external_data.add(key=key, value=value)
            stored.append(stub)
    graph = helper.make_graph(nodes, sub_layer.name, inputs, outputs, initializer=stored)
    sub_model = helper.make_model(
        graph,
        opset_imports=list(model.opset_import),
        ir_version=model.ir_version,
        producer_name="pipeshard",
        producer_version=__version__,
    )
    sub_model.functions.extend(model.functions)
    return sub_model


def _without_attention_bias(node: onnx.NodeProto) -> onnx.NodeProto:
    """A GroupQueryAttention without its attention bias (input 10); other nodes as they are."""
    if node.op_type != "GroupQueryAttention" or len(node.input) <= GQA_BIAS_INPUT:
        return node
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    copy.input[GQA_BIAS_INPUT] = ""
    return copy


def _copy_shared_weights(model: onnx.ModelProto, assignment: dict[int, str]) -> None:
    """A stored weight that several vision blocks read (the exporter merges equal tensors: norms and biases at
    their initial values) gets a copy per block: each block's blob then holds all it reads, which one staging
    slot streams alone."""
    stored = {i.name: i for i in model.graph.initializer if _external(i) is not None}
    readers: dict[str, set[str]] = {}
    for index, node in enumerate(model.graph.node):
        for tensor in node.input:
            if tensor in stored:
                readers.setdefault(tensor, set()).add(assignment[index])
    for name, blocks in readers.items():
        for block in sorted(blocks)[1:]:
            copy = onnx.TensorProto()
            copy.CopyFrom(stored[name])
            copy.name = f"{name}.{block}"
            model.graph.initializer.append(copy)
            for index, node in enumerate(model.graph.node):
                if assignment[index] == block:
                    node.input[:] = [copy.name if tensor == name else tensor for tensor in node.input]


def _vision_section(
    export_dir: Path, vision: ExportVision, dtype: str, staging: Path, shape_only: bool = False
) -> VisionSection:
    """Cut a VLM's vision graph into its blocks (`vision_embed`, `V{i}.attn`, `V{i}.ffn`, `projector`) and write
    them beside the decoder's sub-layers: the manifest's `vision` section. A block's cost counts T = patches
    through it and C = the patches each attends to; attention scores are the fused op's, never stored."""
    model = onnx.load(export_dir / vision.file, load_external_data=False)
    graph = build_graph(model)
    assignment = assign_sub_layers(model, graph, VISION_RULES_BY_FAMILY[vision.family])
    hoist_step_invariants(
        model, graph, assignment, frozenset(v.name for v in model.graph.input) - {"pixel_values"}
    )
    model, assignment = topologically_sorted(model, assignment)
    _copy_shared_weights(model, assignment)
    sub_layers = cut(model, assignment)
    infos = _value_infos(model)
    verify_cut(sub_layers, {name: _dims(v) for name, v in infos.items()}, vision.hidden_size)
    for sub_layer in sub_layers:
        if sub_layer.name == PROLOGUE:
            sub_layer.name = VISION_PROLOGUE
    initializers = {i.name: i for i in model.graph.initializer}
    external = {_external(i).location for i in initializers.values() if _external(i)}
    placements, blobs = (
        _write_blobs(
            sub_layers,
            _weight_owners(sub_layers, initializers),
            initializers,
            None if shape_only else export_dir / external.pop(),
            staging,
        )
        if external
        else ({}, {})
    )
    dims = VisionDims(
        vision.hidden_size, vision.num_attention_heads, vision.hidden_size // vision.num_attention_heads
    )
    entries = []
    for sub_layer in sub_layers:
        files = (
            {}
            if shape_only
            else {"onnx": f"{sub_layer.name}.onnx", "weights_as_inputs": f"{sub_layer.name}.inputs.onnx"}
        )
        for variant, as_inputs in (("onnx", False), ("weights_as_inputs", True)) if files else ():
            onnx.save(
                _sub_model(model, sub_layer, infos, initializers, placements, as_inputs),
                staging / files[variant],
            )
        weights = _weight_records(sub_layer, initializers, placements)
        weight_bytes = sum(w.bytes for w in weights)
        entries.append(
            ManifestEntry(
                name=sub_layer.name,
                kind=sub_layer.kind,
                layer=sub_layer.layer,
                files=files,
                blob=blobs.get(sub_layer.name),
                weights=weights,
                weight_bytes=weight_bytes,
                inputs=tuple(_describe(infos[t]) for t in sub_layer.inputs),
                outputs=tuple(_describe(infos[t]) for t in sub_layer.outputs),
                kv=None,
                cost=Cost(
                    flops=counted_flops(sub_layer, model, dims),
                    bytes={
                        "const": float(weight_bytes),
                        "T": float(2 * vision.hidden_size * DTYPE_BYTES[dtype]),
                    },
                ),
                nodes=len(sub_layer.nodes),
            )
        )
    # the export's section, less what only the export has (its graph file, its check against PyTorch)
    described = {k: v for k, v in vision.facts.items() if k not in ("file", "max_difference_vs_pytorch")}
    return VisionSection(
        sub_layers=tuple(entries),
        graph_inputs=tuple(_describe(v) for v in model.graph.input),
        graph_outputs=tuple(_describe(v) for v in model.graph.output),
        total_weight_bytes=sum(b.bytes for b in blobs.values()),
        facts=described,
        preprocessing=vision.preprocessing,
    )


def partition(export_dir: Path, pack: Path, force: bool = False) -> PartitionResult:
    """Cut EXPORT_DIR's decoder into sub-layers and write the pack to PACK (atomically)."""
    started = time.perf_counter()
    export_dir = Path(export_dir)
    info = read_export_info(export_dir)
    check_output_dir(Path(pack), force)
    rules = RULES_BY_ARCHITECTURE.get(info.architecture)
    if rules is None:
        raise UserError(
            f"no partition rules for architecture {info.architecture!r}; "
            f"known: {', '.join(sorted(RULES_BY_ARCHITECTURE))}"
        )
    dims, dtype = info.dims, info.dtype
    compute = info.compute_dtype  # activations (half-precision weights compute in fp32); KV: attention_dtype
    model = onnx.load(export_dir / info.model_file, load_external_data=False)
    graph = build_graph(model)
    assignment = assign_sub_layers(model, graph, rules)
    hoist_step_invariants(model, graph, assignment)
    keep_embedding_whole(model, graph, assignment)
    merge_duplicate_prologue_nodes(model, assignment)
    untranspose_tied_weights(model, assignment)
    model, assignment = topologically_sorted(model, assignment)
    sub_layers = cut(model, assignment)
    infos = _value_infos(model)
    shapes = {name: _dims(v) for name, v in infos.items()}
    blocks = moe_blocks(sub_layers, model, shapes, dims.hidden_size)
    verify_cut(sub_layers, shapes, dims.hidden_size, frozenset(moe_internal_tensors(blocks, sub_layers)))
    sub_layers = [s for s in sub_layers if s.kind != "combine"]  # the runtime combines the routed experts
    initializers = {i.name: i for i in model.graph.initializer}
    external = {_external(i).location for i in initializers.values() if _external(i)}
    if len(external) > 1:
        raise UserError(f"{export_dir}: weights spread over several files ({sorted(external)}); expected one")
    owners = _weight_owners(sub_layers, initializers)

    shape_only = info.shape_only  # weights are references to a file that does not exist
    with atomic_output_dir(Path(pack), force) as staging:
        placements, blobs = (
            _write_blobs(
                sub_layers, owners, initializers, None if shape_only else export_dir / external.pop(), staging
            )
            if external
            else ({}, {})
        )
        entries = []
        for sub_layer in sub_layers:
            files = {"onnx": f"{sub_layer.name}.onnx", "weights_as_inputs": f"{sub_layer.name}.inputs.onnx"}
            chunkable = row_chunkable_weight(model, sub_layer, initializers)
            if shape_only:
                files = {}
            for variant, as_inputs in (("onnx", False), ("weights_as_inputs", True)) if files else ():
                onnx.save(
                    _sub_model(
                        model,
                        sub_layer,
                        infos,
                        initializers,
                        placements,
                        as_inputs,
                        chunkable,
                        unmasked_attention=info.attention_dtype == "fp16",
                    ),
                    staging / files[variant],
                )
            weights = _weight_records(sub_layer, initializers, placements)
            weight_bytes = sum(w.bytes for w in weights)
            tables = row_prefix_outputs(model, sub_layer, initializers)
            kv = None
            if sub_layer.kind == "attn":
                kv = KvSpec(
                    past=[t for t in sub_layer.inputs if t.startswith(PAST_PREFIX)],
                    present=[t for t in sub_layer.outputs if t.startswith(PRESENT_PREFIX)],
                    bytes_per_token=kv_bytes_per_token(dims, info.attention_dtype),
                )
            row_chunks = None
            if chunkable and chunkable in placements:
                rows = int(initializers[chunkable].dims[0])
                row_chunks = RowChunks(chunkable, rows, placements[chunkable].bytes // rows)
            entries.append(
                ManifestEntry(
                    name=sub_layer.name,
                    kind=sub_layer.kind,
                    layer=sub_layer.layer,
                    files=files,
                    blob=blobs.get(sub_layer.name),
                    weights=weights,
                    weight_bytes=weight_bytes,
                    inputs=tuple(_describe(infos[t]) for t in sub_layer.inputs),
                    outputs=tuple(_describe(infos[t], tables.get(t)) for t in sub_layer.outputs),
                    kv=kv,
                    expert=expert_index(sub_layer.name) if sub_layer.kind == "expert" else None,
                    row_chunks=row_chunks,
                    cost=Cost(
                        flops=checked_flops(sub_layer, model, dims),
                        bytes=bytes_moved(
                            sub_layer, sub_layer.kind, dims, compute, weight_bytes, info.attention_dtype
                        ),
                    ),
                    nodes=len(sub_layer.nodes),
                )
            )
        vision = _vision_section(export_dir, info.vision, dtype, staging, shape_only) if info.vision else None
        for name in (
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "chat_template.jinja",
            "preprocessor_config.json",
            *TOKENIZER_GRAPHS,
        ):
            if (export_dir / name).is_file():
                if name in TOKENIZER_GRAPHS:
                    write_tokenizer_graph(export_dir / name, staging / name)
                else:
                    (staging / name).write_bytes((export_dir / name).read_bytes())
        chat_template = prerendered_chat_template(staging)
        if chat_template is not None:
            write_json_atomic(staging / CHAT_TEMPLATE_FILE, chat_template)
        model_facts = ModelFacts(
            architecture=info.architecture,
            dtype=dtype,
            compute_dtype=compute,
            attention_dtype=info.attention_dtype,
            tie_word_embeddings=info.tie_word_embeddings,
            position_rows=info.position_rows,  # 3: M-RoPE, position_ids [3, batch, tokens]
            **asdict(dims),
        )
        manifest = Manifest(
            model=model_facts,
            sub_layers=tuple(entries),
            moe_blocks=tuple(blocks),
            vision=vision,
            graph_inputs=tuple(_describe(v) for v in model.graph.input),
            graph_outputs=tuple(_describe(v) for v in model.graph.output),
            kv_bytes_per_token=sum(e.kv.bytes_per_token for e in entries if e.kv),
            total_weight_bytes=sum(b.bytes for b in blobs.values()),
            source={
                "export": str(export_dir.absolute()),
                "model_sha256": sha256_file(export_dir / info.model_file),
            },
            # For native hosts (docs/native-host.md): the oldest ONNX Runtime these files are checked with, and
            # the chat template rendered in advance (None: the template needs a template engine).
            min_onnxruntime=MIN_ONNXRUNTIME,
            host_chat_template=CHAT_TEMPLATE_FILE if chat_template is not None else None,
            # Every file but the weight blobs (their digests are in the entries), for `inspect --verify`.
            files={
                path.name: FileDigest(path.stat().st_size, sha256_file(path))
                for path in sorted(staging.iterdir())
                if path.is_file() and not path.name.endswith(".weights") and not shape_only
            },
            shape_only=shape_only,
            pipeshard_version=__version__,
        )
        write_json_atomic(staging / MANIFEST_NAME, manifest.to_json())
    total = sum(b.bytes for b in blobs.values())
    return PartitionResult(Path(pack), len(entries), total, time.perf_counter() - started)
