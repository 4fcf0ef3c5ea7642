"""The attention of decode steps on the CPU: GroupQueryAttention nodes swapped for `pipeshard.DecodeAttention`.

ONNX Runtime's CPU GroupQueryAttention is slow at one new token (two small SGEMMs per head, each packing its
operand); `runtime/_attention.c` does the same arithmetic in one pass over the cache, split across the intra-op
threads (figures in docs/cli.md).

The pack is not changed: the chain's decode sessions join the sub-layers' graphs (`runtime/joined.py`) with each
covered GroupQueryAttention node swapped for this op (same inputs, outputs and attributes; renamed on protobuf's
wire format, `runtime/protowire.py`); prompts run the sub-layers' own sessions. Results equal ONNX Runtime's
kernel to float rounding (the sums run in another order), so greedy tokens are the same.
"""

from __future__ import annotations

from pipeshard.runtime import protowire as wire
from pipeshard.runtime.capi import CUSTOM_DOMAIN

GQA_DOMAIN, GQA_OP = "com.microsoft", "GroupQueryAttention"
DECODE_OP = "DecodeAttention"
# GroupQueryAttention's inputs the op requires absent (it takes a packed query and derives positions from
# seqlens_k), and the attributes it implements only at these values.
_ABSENT_INPUTS = (1, 2, 9)  # key, value, position_ids
_COS_CACHE, _SIN_CACHE, _PAST_KEY = 7, 8, 3
_DEFAULT_ATTRIBUTES = {"rotary_interleaved": 0, "softcap": 0.0, "smooth_softmax": 0, "causal": 1}


def _is_attention(node: list[wire.Field]) -> bool:
    return wire.node_op(node) == (GQA_DOMAIN, GQA_OP)


def covered(node: bytes, float_inputs: set[str]) -> bool:
    """Whether DecodeAttention computes what this serialized GroupQueryAttention node does at one new token."""
    return _covered(wire.parse(node), float_inputs)


def _covered(fields: list[wire.Field], float_inputs: set[str]) -> bool:
    inputs = wire.strings(fields, wire.NODE_INPUT)
    inputs += [""] * (11 - len(inputs))
    attributes = wire.node_attributes(fields)
    rotary = attributes.get("do_rotary", 0) == 1
    return (
        len(inputs) == 11
        and len(wire.strings(fields, wire.NODE_OUTPUT)) == 3
        and all(not inputs[i] for i in _ABSENT_INPUTS)
        and rotary == bool(inputs[_COS_CACHE]) == bool(inputs[_SIN_CACHE])
        and all(attributes.get(name, default) == default for name, default in _DEFAULT_ATTRIBUTES.items())
        and inputs[_PAST_KEY] in float_inputs
    )


def decode_attention_node(node: bytes, float_inputs: set[str]) -> bytes | None:
    """This serialized node as DecodeAttention if it is a GroupQueryAttention the op covers, else None."""
    fields = wire.parse(node)
    if not _is_attention(fields) or not _covered(fields, float_inputs):
        return None
    return wire.serialize(
        [
            (
                n,
                k,
                (DECODE_OP if n == wire.NODE_OP_TYPE else CUSTOM_DOMAIN).encode()
                if n in (wire.NODE_OP_TYPE, wire.NODE_DOMAIN)
                else v,
            )
            for n, k, v in fields
        ]
    )
