"""The model pack's manifest.json as typed records (docs/model-pack.md): the contract between the partitioner,
which writes it, and the runtime, the planner and native hosts, which read it. `load_pack` checks the schema, every
field's type and range, that every file it names is a plain file inside the pack, and that every weight lies
inside its blob; a problem is one UserError naming the file and the field."""

from __future__ import annotations

import math
import os
import stat
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pipeshard.core.errors import UserError
from pipeshard.core.fsutil import read_json, sha256_file
from pipeshard.formats.fields import Fields
from pipeshard.formats.image_preprocessing import ImagePreprocessing

MANIFEST_NAME = "manifest.json"
PACK_SCHEMA_VERSION = 2  # 2: KV caches are in-place buffers (GroupQueryAttention), see docs/model-pack.md
WEIGHT_ALIGNMENT = 4096
SUB_LAYER_KINDS = (
    "prologue", "embed", "attn", "ffn", "router", "expert", "final",  # the decoder's
    "vision_prologue", "vision_embed", "projector",  # a vision tower's besides its attn / ffn blocks
)  # fmt: skip
MAX_DIMENSION = 1 << 40  # larger than any real tensor dimension or byte count; refuses absurd values


def check_file_name(fields: Fields, name: str) -> str:
    """A file a pack names: a plain name inside the pack's folder (no folders, no `..`, not absolute)."""
    value = fields.str(name)
    if not value or value in (".", "..") or "/" in value or "\\" in value or "\0" in value or ":" in value:
        fields.fail(f"is {value!r}: a pack names only files inside its own folder", name)
    return value


@dataclass(frozen=True)
class TensorInfo:
    """A graph input or output: name, shape (numbers or symbolic names) and ONNX dtype name."""

    name: str
    shape: list
    dtype: str
    rows_of: str | None = None  # the first rows of this stored weight, every step (rotary caches)

    @classmethod
    def from_json(cls, fields: Fields) -> TensorInfo:
        shape = fields.list("shape")
        if not all(
            isinstance(d, str) or (isinstance(d, int) and not isinstance(d, bool) and d >= 0) for d in shape
        ):
            fields.fail("must hold dimensions (non-negative integers or names)", "shape")
        info = cls(fields.str("name"), shape, fields.str("dtype"), fields.str("rows_of", None))
        fields.done()
        return info

    def to_json(self) -> dict:
        document = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}
        return document | ({"rows_of": self.rows_of} if self.rows_of is not None else {})


# The bytes of one element of each dtype a stored weight may have.
WEIGHT_ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4}
WEIGHT_ELEMENT_BYTES |= {"int8": 1, "uint8": 1, "bool": 1}


@dataclass(frozen=True)
class Weight:
    """A stored weight: where in which blob of the pack its bytes are."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    file: str
    offset: int
    bytes: int

    @classmethod
    def from_json(cls, fields: Fields) -> Weight:
        weight = cls(
            fields.str("name"),
            tuple(fields.int_list("shape", minimum=0)),
            fields.str("dtype"),
            check_file_name(fields, "file"),
            fields.int("offset", maximum=MAX_DIMENSION),
            fields.int("bytes", maximum=MAX_DIMENSION),
        )
        if weight.dtype not in WEIGHT_ELEMENT_BYTES:
            fields.fail(f"is {weight.dtype!r}, not one of {', '.join(WEIGHT_ELEMENT_BYTES)}", "dtype")
        if math.prod(weight.shape) * WEIGHT_ELEMENT_BYTES[weight.dtype] != weight.bytes:
            fields.fail(
                f"is {weight.bytes}, not the {list(weight.shape)} {weight.dtype} elements' bytes", "bytes"
            )
        fields.done()
        return weight

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "file": self.file,
            "offset": self.offset,
            "bytes": self.bytes,
        }


@dataclass(frozen=True)
class Blob:
    """A sub-layer's weights, one after the other in one file: one read or one copy moves them all."""

    file: str
    bytes: int
    sha256: str | None  # None in a shape-only pack

    @classmethod
    def from_json(cls, fields: Fields) -> Blob:
        blob = cls(
            check_file_name(fields, "file"),
            fields.int("bytes", maximum=MAX_DIMENSION),
            fields.str("sha256", None),
        )
        fields.done()
        return blob

    def to_json(self) -> dict:
        return {"file": self.file, "bytes": self.bytes, "sha256": self.sha256}


@dataclass(frozen=True)
class KvSpec:
    """An attention's KV inputs and outputs (bound to one in-place buffer each) and its bytes per token."""

    past: list[str]
    present: list[str]
    bytes_per_token: int

    @classmethod
    def from_json(cls, fields: Fields) -> KvSpec:
        kv = cls(
            fields.str_list("past"),
            fields.str_list("present"),
            fields.int("bytes_per_token", maximum=MAX_DIMENSION),
        )
        if len(kv.past) != len(kv.present):
            fields.fail("must name as many presents as pasts", "present")
        fields.done()
        return kv

    def to_json(self) -> dict:
        return {
            "past": list(self.past),
            "present": list(self.present),
            "bytes_per_token": self.bytes_per_token,
        }


@dataclass(frozen=True)
class RowChunks:
    """An output layer whose weight's rows may be bound in ranges (logits that wide)."""

    weight: str
    rows: int
    row_bytes: int

    @classmethod
    def from_json(cls, fields: Fields) -> RowChunks:
        chunks = cls(
            fields.str("weight"),
            fields.int("rows", minimum=1, maximum=MAX_DIMENSION),
            fields.int("row_bytes", minimum=1, maximum=MAX_DIMENSION),
        )
        fields.done()
        return chunks

    def to_json(self) -> dict:
        return {"weight": self.weight, "rows": self.rows, "row_bytes": self.row_bytes}


COST_TERMS = ("const", "T", "C", "TC")
COST_MODEL = (
    "flops and bytes per step = const + T*new_tokens + C*context + TC*new_tokens*context; "
    "for an expert, T = the tokens routed to it"
)  # manifest.json's `cost_model`: what a sub-layer's `cost` means


@dataclass(frozen=True)
class Cost:
    """FLOPs and bytes moved per step as `const + T*t + C*c + T*C*tc` (T new tokens, C context)."""

    flops: dict[str, float]
    bytes: dict[str, float]

    @classmethod
    def from_json(cls, fields: Fields) -> Cost:
        flops, moved = fields.number_map("flops", minimum=0.0), fields.number_map("bytes", minimum=0.0)
        for name, terms in (("flops", flops), ("bytes", moved)):
            if unknown := set(terms) - set(COST_TERMS):
                fields.fail(f"has unknown terms {sorted(unknown)} (known: {', '.join(COST_TERMS)})", name)
        fields.done()
        return cls(flops, moved)

    def to_json(self) -> dict:
        return {"flops": dict(self.flops), "bytes": dict(self.bytes)}

    def flops_at(self, tokens: float, context: float) -> float:
        return evaluate_cost(self.flops, tokens, context)

    @property
    def flops_per_token(self) -> float:
        """The `T` term of the FLOPs."""
        return self.flops.get("T", 0.0)

    @property
    def flops_per_token_and_context(self) -> float:
        """The `TC` term of the FLOPs (attention's scores)."""
        return self.flops.get("TC", 0.0)

    @property
    def bytes_per_context_token(self) -> float | None:
        """The `C` term of the bytes moved (the KV read per context token), None where the cost has none."""
        return self.bytes.get("C")

    def bytes_at(self, tokens: float, context: float) -> float:
        return evaluate_cost(self.bytes, tokens, context)


@dataclass(frozen=True)
class Chunk:
    """A planning unit that is a range of an output layer's rows (not in the manifest: made by the planner's
    `planning_units`)."""

    of: str  # the sub-layer's name
    first_row: int
    end_row: int
    share: float  # of the sub-layer's rows


@dataclass(frozen=True)
class SubLayer:
    """One cut of the graph: its files, its weights and where they are stored, its boundary, KV and cost."""

    name: str
    kind: str
    layer: int | None
    files: dict[str, str]  # "onnx" and "weights_as_inputs"; empty in a shape-only pack
    blob: Blob | None
    weights: tuple[Weight, ...]
    weight_bytes: int
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    kv: KvSpec | None
    cost: Cost
    nodes: int
    row_chunks: RowChunks | None = None
    expert: int | None = None
    chunk: Chunk | None = None  # set on planning units only

    @classmethod
    def from_json(cls, fields: Fields) -> SubLayer:
        files = fields.object("files")
        file_names = {}
        for variant in ("onnx", "weights_as_inputs"):
            if files.has(variant):
                file_names[variant] = check_file_name(files, variant)
        files.done()
        kind = fields.str("kind", choices=SUB_LAYER_KINDS)
        blob = fields.object("blob", None)
        kv = fields.object("kv", None)
        chunks = fields.object("row_chunks", None)
        entry = cls(
            name=fields.str("name"),
            kind=kind,
            layer=fields.int("layer", None, maximum=1 << 20),
            files=file_names,
            blob=Blob.from_json(blob) if blob else None,
            weights=tuple(Weight.from_json(w) for w in fields.objects("weights")),
            weight_bytes=fields.int("weight_bytes", 0, maximum=MAX_DIMENSION),
            inputs=tuple(TensorInfo.from_json(t) for t in fields.objects("inputs")),
            outputs=tuple(TensorInfo.from_json(t) for t in fields.objects("outputs")),
            kv=KvSpec.from_json(kv) if kv else None,
            cost=Cost.from_json(fields.object("cost")),
            nodes=fields.int("nodes", 0),
            row_chunks=RowChunks.from_json(chunks) if chunks else None,
            expert=fields.int("expert", None, maximum=1 << 20),
        )
        if kind == "expert" and entry.expert is None:
            fields.fail("is missing (an expert's index)", "expert")
        fields.done()
        return entry

    def to_json(self) -> dict:
        """The manifest's entry (a planning unit's `chunk` is the planner's, not the manifest's)."""
        return {
            "name": self.name,
            "kind": self.kind,
            "layer": self.layer,
            "files": dict(self.files),
            "blob": self.blob and self.blob.to_json(),
            "weights": [w.to_json() for w in self.weights],
            "weight_bytes": self.weight_bytes,
            "inputs": [t.to_json() for t in self.inputs],
            "outputs": [t.to_json() for t in self.outputs],
            "kv": self.kv and self.kv.to_json(),
            **({"expert": self.expert} if self.expert is not None else {}),
            "row_chunks": self.row_chunks and self.row_chunks.to_json(),
            "cost": self.cost.to_json(),
            "nodes": self.nodes,
        }

    @property
    def weight_names(self) -> list[str]:
        return [w.name for w in self.weights]

    @property
    def graph_file(self) -> str:
        """Its graph with the weights as stored initializers (a CPU session maps them from the blob)."""
        return self.files["onnx"]

    @property
    def weights_as_inputs_file(self) -> str:
        """Its graph with the weights as inputs (a device session binds them where the plan put them)."""
        return self.files["weights_as_inputs"]


@dataclass(frozen=True)
class ModelFacts:
    """The model's dimensions and types (MoE fields 0 for a dense model)."""

    architecture: str
    dtype: str  # the weights: fp32 | fp16 | bf16 | gguf (quantized blocks)
    compute_dtype: str  # activations
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    tie_word_embeddings: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    sliding_window: int = 0
    position_rows: int = 1  # 3: M-RoPE, position_ids [3, batch, tokens]
    attention_dtype: str = "fp32"  # the fused attention's inputs, output and KV cache

    @property
    def kv_dtype(self) -> str:
        return self.attention_dtype

    @property
    def device_attention_masks_padding(self) -> bool:
        """False for float16 attention: its device graphs run ONNX Runtime's CUDA GroupQueryAttention, which refuses
        an attention bias, so they have none, and a step with padding (a batch of different lengths) cannot run an
        attention on the device."""
        return self.attention_dtype != "fp16"

    @classmethod
    def from_json(cls, fields: Fields) -> ModelFacts:
        dtype = fields.str("dtype", choices=DTYPES)
        values: dict[str, Any] = {"architecture": fields.str("architecture"), "dtype": dtype}
        values["compute_dtype"] = fields.str("compute_dtype", dtype, choices=DTYPES)
        values["attention_dtype"] = fields.str("attention_dtype", values["compute_dtype"], choices=DTYPES)
        for name in ("num_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "vocab_size", "max_context"):  # fmt: skip
            values[name] = fields.int(name, minimum=1, maximum=MAX_DIMENSION)
        values["tie_word_embeddings"] = fields.bool("tie_word_embeddings", False)
        for name in ("num_experts", "experts_per_token", "expert_intermediate_size", "sliding_window"):
            values[name] = fields.int(name, 0, maximum=MAX_DIMENSION)
        values["position_rows"] = fields.int("position_rows", 1, minimum=1, maximum=3)
        if values["experts_per_token"] > values["num_experts"]:
            fields.fail(f"is more than num_experts ({values['num_experts']})", "experts_per_token")
        fields.done()
        return cls(**values)

    def to_json(self) -> dict:
        return {
            "architecture": self.architecture,
            "dtype": self.dtype,
            "compute_dtype": self.compute_dtype,
            "attention_dtype": self.attention_dtype,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "max_context": self.max_context,
            "tie_word_embeddings": self.tie_word_embeddings,
            "num_experts": self.num_experts,
            "experts_per_token": self.experts_per_token,
            "expert_intermediate_size": self.expert_intermediate_size,
            "sliding_window": self.sliding_window,
            "position_rows": self.position_rows,
        }

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


DTYPES = ("fp32", "fp16", "bf16", "gguf")  # gguf: a GGUF's quantized blocks as stored


@dataclass(frozen=True)
class MoeBlock:
    """How a MoE layer's router and experts connect (docs/model-pack.md)."""

    layer: int
    router: str
    experts: list[str]
    residual: str
    hidden: str
    routing: str
    expert_outputs: list[str]
    output: str

    @classmethod
    def from_json(cls, fields: Fields) -> MoeBlock:
        block = cls(
            fields.int("layer", maximum=1 << 20),
            fields.str("router"),
            fields.str_list("experts"),
            fields.str("residual"),
            fields.str("hidden"),
            fields.str("routing"),
            fields.str_list("expert_outputs"),
            fields.str("output"),
        )
        if len(block.experts) != len(block.expert_outputs):
            fields.fail("must have one output per expert", "expert_outputs")
        fields.done()
        return block

    def to_json(self) -> dict:
        return {
            "layer": self.layer,
            "router": self.router,
            "experts": list(self.experts),
            "hidden": self.hidden,
            "routing": self.routing,
            "residual": self.residual,
            "expert_outputs": list(self.expert_outputs),
            "output": self.output,
        }


@dataclass(frozen=True)
class TowerSummary:
    """What a pack's summary says of its vision tower, read from the export's facts: its name (the model, else its
    family), blocks, tile size and per-tile patches and image tokens (None where a family's tiles vary, as
    Qwen2.5-VL's images do)."""

    name: str
    num_layers: int
    image_size: int | None
    patches_per_tile: int | None
    tokens_per_tile: int | None

    @classmethod
    def from_facts(cls, facts: dict) -> TowerSummary:
        def count(name: str) -> int | None:
            value = facts.get(name)
            return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

        return cls(
            str(facts.get("model") or facts.get("family", "idefics3")),
            facts["num_layers"],
            count("image_size"),
            count("patches_per_tile"),
            count("tokens_per_tile"),
        )


@dataclass(frozen=True)
class VisionSection:
    """A VLM's vision tower cut into blocks, and the export's facts about it (dims, image token, preprocessing)."""

    sub_layers: tuple[SubLayer, ...]
    graph_inputs: tuple[TensorInfo, ...]
    graph_outputs: tuple[TensorInfo, ...]
    total_weight_bytes: int
    facts: dict  # export.json's `vision` section as the exporter wrote it (docs/vlm.md)
    preprocessing: ImagePreprocessing | None = None  # the facts' `preprocessing`, read

    @property
    def summary(self) -> TowerSummary:
        return TowerSummary.from_facts(self.facts)

    @classmethod
    def from_json(cls, fields: Fields) -> VisionSection:
        sub_layers = tuple(SubLayer.from_json(s) for s in fields.objects("sub_layers"))
        graph_inputs = tuple(TensorInfo.from_json(t) for t in fields.objects("graph_inputs"))
        graph_outputs = tuple(TensorInfo.from_json(t) for t in fields.objects("graph_outputs"))
        total = fields.int("total_weight_bytes", maximum=MAX_DIMENSION)
        facts = {k: v for k, v in fields.document.items() if k not in fields.read}
        preprocessing = fields.object("preprocessing", None)
        section = cls(
            sub_layers,
            graph_inputs,
            graph_outputs,
            total,
            facts,
            ImagePreprocessing.from_json(preprocessing) if preprocessing else None,
        )
        for name in ("hidden_size", "num_attention_heads", "num_layers", "image_token_id"):
            if not isinstance(section.facts.get(name), int) or section.facts[name] < 1:
                fields.fail("must be a positive integer", name)
        full = section.facts.get("fullatt_block_indexes", [])
        if not isinstance(full, list) or not all(
            isinstance(b, int) and 0 <= b < section.num_layers for b in full
        ):
            fields.fail(f"must list blocks below num_layers ({section.num_layers})", "fullatt_block_indexes")
        return section

    @property
    def num_layers(self) -> int:
        """The tower's blocks."""
        return self.facts["num_layers"]

    @property
    def image_token_id(self) -> int:
        """The token whose rows the image features fill."""
        return self.facts["image_token_id"]

    @property
    def bidirectional_image_runs(self) -> bool:
        """Gemma 3: an image's tokens attend to their whole run, which must come in one step."""
        return bool(self.facts.get("bidirectional_image_runs"))

    @property
    def fullatt_block_indexes(self) -> tuple[int, ...]:
        """The blocks that attend over the whole image (Qwen2.5-VL); the others attend within windows."""
        return tuple(self.facts.get("fullatt_block_indexes", ()))

    def with_blocks(
        self, sub_layers: tuple[SubLayer, ...], num_layers: int, fullatt_block_indexes: list[int]
    ) -> VisionSection:
        """This tower with other blocks (a shape-only probe repeated): the facts say the new block count and
        full-attention blocks, the preprocessing's attention groups (the host's, when it makes them) too."""
        full = sorted(fullatt_block_indexes)
        facts = {**self.facts, "num_layers": num_layers, "fullatt_block_indexes": full}
        preprocessing = self.preprocessing
        if preprocessing is not None and preprocessing.family == "qwen2_vl":
            preprocessing = replace(preprocessing, fullatt_block_indexes=tuple(full))
            facts["preprocessing"] = preprocessing.to_json()
        total = sum(e.blob.bytes for e in sub_layers if e.blob)
        return replace(
            self,
            sub_layers=tuple(sub_layers),
            total_weight_bytes=total,
            facts=facts,
            preprocessing=preprocessing,
        )

    def to_json(self) -> dict:
        """The manifest's `vision` section (a block's entry has no KV and no row chunks: none has either)."""
        entries = [
            {k: v for k, v in e.to_json().items() if k not in ("kv", "row_chunks")} for e in self.sub_layers
        ]
        return {
            **self.facts,
            "graph_inputs": [t.to_json() for t in self.graph_inputs],
            "graph_outputs": [t.to_json() for t in self.graph_outputs],
            "total_weight_bytes": self.total_weight_bytes,
            "sub_layers": entries,
        }


@dataclass(frozen=True)
class FileDigest:
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """manifest.json: the model, its sub-layers in execution order, MoE blocks, the vision tower, host files."""

    model: ModelFacts
    sub_layers: tuple[SubLayer, ...]
    moe_blocks: tuple[MoeBlock, ...]
    vision: VisionSection | None
    graph_inputs: tuple[TensorInfo, ...]
    graph_outputs: tuple[TensorInfo, ...]
    kv_bytes_per_token: int
    total_weight_bytes: int
    source: dict
    host_chat_template: (
        str | None
    )  # the pre-rendered chat template's file, None when it cannot be pre-rendered
    min_onnxruntime: str | None
    files: dict[str, FileDigest]  # every file but the weight blobs
    shape_only: bool = False
    pipeshard_version: str = ""
    by_name: dict[str, SubLayer] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_name", {s.name: s for s in self.sub_layers})

    @classmethod
    def from_json(cls, document: Any, where: str) -> Manifest:
        fields = Fields(document, where)
        fields.schema(PACK_SCHEMA_VERSION, "export and partition the model again")
        fields.int("weight_alignment", WEIGHT_ALIGNMENT, minimum=1)
        fields.str("cost_model", "")
        host = fields.object("host", {})
        chat_template = check_file_name(host, "chat_template") if host.has("chat_template") else None
        host.read.add("chat_template")
        min_ort = host.str("min_onnxruntime", None)
        host.done()
        files = {}
        listed = fields.raw("files", {})
        if not isinstance(listed, dict):
            fields.fail("must be an object", "files")
        for name in listed:
            entry = fields.object("files").object(name)
            check_file_name(Fields({"file": name}, where, f"files[{name!r}]"), "file")
            files[name] = FileDigest(entry.int("bytes", maximum=MAX_DIMENSION), entry.str("sha256"))
            entry.done()
        vision = fields.object("vision", None)
        source = fields.object("source", {})
        source.str("export", "")  # the export folder it was partitioned from
        source.str("model_sha256", "")  # its model.onnx's digest (profiles' pack timings are matched by it)
        source.str("config", "")  # a shape-only pack's config
        source.bool("shape_only", False)
        source.str("format", "")  # a shape-only pack's GGUF format (Q4_0 ... Q6_K), its weights described so
        source.done()
        manifest = cls(
            model=ModelFacts.from_json(fields.object("model")),
            sub_layers=tuple(SubLayer.from_json(s) for s in fields.objects("sub_layers")),
            moe_blocks=tuple(MoeBlock.from_json(b) for b in fields.objects("moe_blocks", [])),
            vision=VisionSection.from_json(vision) if vision else None,
            graph_inputs=tuple(TensorInfo.from_json(t) for t in fields.objects("graph_inputs", [])),
            graph_outputs=tuple(TensorInfo.from_json(t) for t in fields.objects("graph_outputs", [])),
            kv_bytes_per_token=fields.int("kv_bytes_per_token", 0, maximum=MAX_DIMENSION),
            total_weight_bytes=fields.int("total_weight_bytes", 0, maximum=MAX_DIMENSION),
            source=source.document,
            host_chat_template=chat_template,
            min_onnxruntime=min_ort,
            files=files,
            shape_only=fields.bool("shape_only", False),
            pipeshard_version=fields.str("pipeshard_version", ""),
        )
        fields.done()
        names = [s.name for s in manifest.sub_layers]
        if not names:
            fields.fail("is empty", "sub_layers")
        if len(set(names)) != len(names):
            fields.fail("names a sub-layer twice", "sub_layers")
        for block in manifest.moe_blocks:
            for name in (block.router, *block.experts):
                if name not in names:
                    fields.fail(f"names {name!r}, which is not a sub-layer", "moe_blocks")
        if not manifest.shape_only:  # only a shape-only pack has no graphs
            for entry in manifest.sub_layers:
                if "onnx" not in entry.files:
                    fields.fail(f"of {entry.name!r} names no graph (files.onnx)", "sub_layers")
        return manifest

    def sub_layer(self, name: str) -> SubLayer:
        return self.by_name[name]

    @property
    def model_sha256(self) -> str | None:
        """The digest of the export's model.onnx this pack was cut from (None for a shape-only pack)."""
        return self.source.get("model_sha256")

    def to_json(self) -> dict:
        """manifest.json's document, its fields in the order the partitioner writes them."""
        return {
            "schema_version": PACK_SCHEMA_VERSION,
            "pipeshard_version": self.pipeshard_version,
            "model": self.model.to_json(),
            "source": dict(self.source),
            "weight_alignment": WEIGHT_ALIGNMENT,
            "graph_inputs": [t.to_json() for t in self.graph_inputs],
            "graph_outputs": [t.to_json() for t in self.graph_outputs],
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "total_weight_bytes": self.total_weight_bytes,
            "cost_model": COST_MODEL,
            "sub_layers": [e.to_json() for e in self.sub_layers],
            "moe_blocks": [b.to_json() for b in self.moe_blocks],
            **({"vision": self.vision.to_json()} if self.vision else {}),
            "host": {"min_onnxruntime": self.min_onnxruntime, "chat_template": self.host_chat_template},
            "files": {name: {"bytes": d.bytes, "sha256": d.sha256} for name, d in self.files.items()},
            **({"shape_only": True} if self.shape_only else {}),
        }


@dataclass
class Pack:
    """A loaded manifest and where its files are."""

    folder: Path
    manifest: Manifest

    @property
    def model(self) -> ModelFacts:
        return self.manifest.model

    @property
    def sub_layers(self) -> tuple[SubLayer, ...]:
        return self.manifest.sub_layers

    @property
    def shape_only(self) -> bool:
        """Made by `export --shape-only`: shapes, bytes and costs for planning, no weights to run."""
        return self.manifest.shape_only

    def require_weights(self) -> None:
        """Refuse to run a shape-only pack."""
        if self.shape_only:
            raise UserError(
                f"{self.folder} is a shape-only pack (export --shape-only): it holds no weights, so it "
                "can be inspected and planned but not run; export the model with its weights to run it"
            )

    def path(self, name: str) -> Path:
        return self.folder / name


def evaluate_cost(coefficients: dict[str, float], tokens: float, context: float) -> float:
    """A manifest cost at T new tokens and context C: const + T*t + C*c + T*C*tc."""
    return (
        coefficients.get("const", 0.0)
        + coefficients.get("T", 0.0) * tokens
        + coefficients.get("C", 0.0) * context
        + coefficients.get("TC", 0.0) * tokens * context
    )


def is_pack(folder: Path) -> bool:
    return (Path(folder) / MANIFEST_NAME).is_file()


def pack_file(folder: Path, name: str, what: str) -> Path:
    """A file of the pack, checked to be a regular file inside its folder (no link leading out, no device)."""
    path = folder / name
    try:
        info = os.lstat(path)
    except OSError:
        raise UserError(f"{path} is missing ({what})") from None
    if stat.S_ISLNK(info.st_mode):
        target = path.resolve()
        if target.parent != folder.resolve():
            raise UserError(f"{path} is a link leading out of the pack ({what})")
        info = os.stat(path)
    if not stat.S_ISREG(info.st_mode):
        raise UserError(f"{path} is not a regular file ({what})")
    return path


def load_pack(folder: Path, verify: bool = False) -> Pack:
    """Read and check a pack: schema and fields, every file present and inside the pack, every weight inside its
    blob, blob sizes always, sha256 of every file when `verify`."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"{folder} does not exist or is not a folder")
    path = folder / MANIFEST_NAME
    manifest = Manifest.from_json(read_json(path, "model pack"), str(path))
    if manifest.shape_only:
        return Pack(folder, manifest)  # no sub-layer files and no blobs: shapes, bytes and costs only
    vision = manifest.vision.sub_layers if manifest.vision else ()
    sizes: dict[str, int] = {}
    for entry in (*manifest.sub_layers, *vision):
        what = f"sub-layer {entry.name}"
        for file_name in entry.files.values():
            pack_file(folder, file_name, what)
        for weight in entry.weights:
            if weight.file not in sizes:
                sizes[weight.file] = pack_file(folder, weight.file, what).stat().st_size
            if weight.offset + weight.bytes > sizes[weight.file]:
                raise UserError(
                    f"{path}: weight {weight.name} of {what} ends at byte {weight.offset + weight.bytes}, past the "
                    f"end of {weight.file} ({sizes[weight.file]} bytes)"
                )
        if entry.blob:
            blob_path = pack_file(folder, entry.blob.file, what)
            size = blob_path.stat().st_size
            if size != entry.blob.bytes:
                raise UserError(
                    f"{blob_path} has {size} bytes, the manifest says {entry.blob.bytes} (truncated or replaced)"
                )
            if verify and sha256_file(blob_path) != entry.blob.sha256:
                raise UserError(f"{blob_path} does not match its sha256 in the manifest (corrupt)")
    if verify:
        for weight_file in sizes.keys() - {e.blob.file for e in (*manifest.sub_layers, *vision) if e.blob}:
            raise UserError(
                f"{path}: {weight_file} holds weights but is no sub-layer's blob (nothing verifies it)"
            )
    for name, listed in manifest.files.items():
        file_path = pack_file(folder, name, "listed in the manifest")
        if file_path.stat().st_size != listed.bytes or verify and sha256_file(file_path) != listed.sha256:
            raise UserError(f"{file_path} does not match the manifest (corrupt or replaced)")
    return Pack(folder, manifest)
