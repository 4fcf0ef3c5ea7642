"""The cost model of a sub-layer: FLOPs and bytes moved as linear functions of T and C.

T is the number of new tokens in the step (all sequences together), C the context length each
attention reads (past + new). A cost is a dict of coefficients: {"const": a, "T": b, "C": c, "TC": d}
meaning a + b*T + c*C + d*T*C. Two independent counts are made — one from the model dimensions,
one by walking the sub-layer's ONNX nodes — and the pack is only written when they agree.
"""

from __future__ import annotations

import math
from typing import Protocol

import onnx

from pipeshard.core.errors import UserError
from pipeshard.formats.io_names import HIGH_PLANE_SUFFIX, MINIMUM_TERM_SUFFIX
from pipeshard.partitioner.graph import SubLayer

Coefficients = dict[str, float]


class Dimensions(Protocol):
    """The model dimensions a cost is counted from: export.json's (ModelDims), a manifest's (ModelFacts), or a
    vision tower's (partition.py's VisionDims: only what attention counts)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_experts: int
    expert_intermediate_size: int


DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}  # activations and KV: the compute dtype
WEIGHT_PASSTHROUGH_OPS = {"Transpose", "Cast", "Identity", "Reshape"}
MATMUL_OPS = {"MatMul", "Gemm"}


def analytic_flops(kind: str, dims: Dimensions) -> Coefficients:
    """FLOPs from the model dimensions alone (2 per multiply-add)."""
    hidden, heads, kv_heads, head_dim = (
        dims.hidden_size,
        dims.num_attention_heads,
        dims.num_key_value_heads,
        dims.head_dim,
    )
    if kind == "attn":
        projections = 2 * hidden * heads * head_dim * 2 + 2 * hidden * kv_heads * head_dim * 2
        return {"T": float(projections), "TC": float(4 * heads * head_dim)}
    if kind == "ffn":
        return {"T": float(2 * 3 * hidden * dims.intermediate_size)}
    if kind == "router":
        return {"T": float(2 * hidden * dims.num_experts)}
    if kind == "expert":  # T = the tokens routed to this expert
        return {"T": float(2 * 3 * hidden * dims.expert_intermediate_size)}
    if kind == "final":
        return {"T": float(2 * hidden * dims.vocab_size)}
    return {}


def counted_flops(sub_layer: SubLayer, model: onnx.ModelProto, dims: Dimensions) -> Coefficients:
    """FLOPs counted from the sub-layer's nodes: each MatMul against a weight, each Attention op, a patch
    embedding's Conv."""
    initializers = {i.name: list(i.dims) for i in model.graph.initializer}
    produced = {out: node for node in model.graph.node for out in node.output}

    def weight_dims(tensor: str) -> list[int] | None:
        while (
            tensor not in initializers
            and tensor in produced
            and produced[tensor].op_type in WEIGHT_PASSTHROUGH_OPS
        ):
            tensor = produced[tensor].input[0]
        return initializers.get(tensor)

    per_token = 0.0
    per_token_context = 0.0
    for index in sub_layer.nodes:
        node = model.graph.node[index]
        if node.name.endswith((HIGH_PLANE_SUFFIX, MINIMUM_TERM_SUFFIX)):
            continue  # parts of a quantized product, counted once at its low plane
        if node.op_type == "MatMulNBits":
            per_token += 2.0 * _attribute(node, "K") * _attribute(node, "N")
        elif node.op_type in MATMUL_OPS:
            shapes = [weight_dims(t) for t in node.input[:2]]
            weight = next((s for s in shapes if s is not None and len(s) == 2), None)
            if weight is not None:
                per_token += 2.0 * weight[0] * weight[1]
        elif node.op_type == "Conv" and (kernel := weight_dims(node.input[1])):  # a patch embedding: one
            per_token += 2.0 * math.prod(kernel)  # output position per patch (stride = kernel)
        elif node.op_type in ("Attention", "GroupQueryAttention", "MultiHeadAttention"):
            per_token_context += 4.0 * dims.num_attention_heads * dims.head_dim
    found = {}
    if per_token:
        found["T"] = per_token
    if per_token_context:
        found["TC"] = per_token_context
    return found


def _attribute(node: onnx.NodeProto, name: str) -> int:
    return next(onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name)


def bytes_moved(
    sub_layer: SubLayer,
    kind: str,
    dims: Dimensions,
    dtype: str,
    weight_bytes: int,
    kv_dtype: str | None = None,
) -> Coefficients:
    """Memory traffic per step: weights once, activations (DTYPE) per token, KV traffic (KV_DTYPE, DTYPE unless
    given) per context token."""
    element = DTYPE_BYTES[dtype]
    hidden = dims.hidden_size
    kv_per_token = kv_bytes_per_token(dims, kv_dtype or dtype) if kind == "attn" else 0
    if kind == "embed":
        return {"T": float(2 * hidden * element)}  # a Gather reads only the rows it needs
    if kind == "prologue":
        return {}
    activations = (
        2 * hidden * element
        + (dims.vocab_size * element if kind == "final" else 0)
        + (dims.num_experts * element if kind in ("router", "expert") else 0)
    )  # routing weights
    cost = {"const": float(weight_bytes), "T": float(activations + kv_per_token)}
    if kv_per_token:
        # The fused GroupQueryAttention reads each KV head's past once (a group's query heads share
        # it) and appends the new tokens in place: one read per context token, nothing copied.
        cost["C"] = float(kv_per_token)
    return cost


def kv_bytes_per_token(dims: Dimensions, dtype: str) -> int:
    """Key + value of one token in one layer."""
    return 2 * dims.num_key_value_heads * dims.head_dim * DTYPE_BYTES[dtype]


def checked_flops(sub_layer: SubLayer, model: onnx.ModelProto, dims: Dimensions) -> Coefficients:
    """The graph count, after checking it against the dimension formula (1 % tolerance)."""
    counted = counted_flops(sub_layer, model, dims)
    expected = analytic_flops(sub_layer.kind, dims)
    for term in set(counted) | set(expected):
        a, b = counted.get(term, 0.0), expected.get(term, 0.0)
        if abs(a - b) > 0.01 * max(abs(a), abs(b)):
            raise UserError(
                f"cost model check failed for {sub_layer.name}: {term} coefficient counted from the graph is "
                f"{a:.6g}, from the model dimensions {b:.6g}"
            )
    return counted
