"""Just enough of protobuf's wire format to read and rewrite a few fields of a serialized ONNX model.

The CPU engines run sessions only; importing the onnx package for one node's rename would hold ~12 MiB more in
every such process (its C++ extension and protobuf runtime). A message is a list of (field number, wire type,
value): an int for varints, bytes for everything else, in their order, unknown fields kept as they are.
"""

from __future__ import annotations

import struct

VARINT, FIXED64, LENGTH, FIXED32 = 0, 1, 2, 5
_FIXED_SIZE = {FIXED64: 8, FIXED32: 4}

Field = tuple[int, int, int | bytes]


def _read_varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data):
            raise ValueError("truncated varint")
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if byte < 0x80:
            return value, at
        shift += 7


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int64 values are ten bytes of two's complement
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def parse(data: bytes) -> list[Field]:
    """The fields of one message, in order."""
    fields, at = [], 0
    while at < len(data):
        key, at = _read_varint(data, at)
        number, wire = key >> 3, key & 7
        if wire == VARINT:
            value, at = _read_varint(data, at)
        elif wire == LENGTH:
            size, at = _read_varint(data, at)
            value, at = data[at : at + size], at + size
        elif wire in _FIXED_SIZE:
            value, at = data[at : at + _FIXED_SIZE[wire]], at + _FIXED_SIZE[wire]
        else:
            raise ValueError(f"unsupported wire type {wire}")
        if at > len(data):
            raise ValueError("truncated field")
        fields.append((number, wire, value))
    return fields


def serialize(fields: list[Field]) -> bytes:
    out = bytearray()
    for number, wire, value in fields:
        out += _varint(number << 3 | wire)
        if wire == VARINT:
            out += _varint(value)
        elif wire == LENGTH:
            out += _varint(len(value)) + value
        else:
            out += value
    return bytes(out)


def strings(fields: list[Field], number: int) -> list[str]:
    """The values of a repeated (or single) string field."""
    return [value.decode() for n, wire, value in fields if n == number and wire == LENGTH]


def signed(value: int) -> int:
    """An int64 varint's value."""
    return value - (1 << 64) if value >= 1 << 63 else value


def fixed_float(value: bytes) -> float:
    return struct.unpack("<f", value)[0]


# ONNX's NodeProto and AttributeProto fields (onnx.proto).
NODE_INPUT, NODE_OUTPUT, NODE_OP_TYPE, NODE_ATTRIBUTE, NODE_DOMAIN = 1, 2, 4, 5, 7
_ATTRIBUTE_NAME, _ATTRIBUTE_FLOAT, _ATTRIBUTE_INT = 1, 2, 3


def node_attributes(node: list[Field]) -> dict[str, float | int]:
    """An ONNX node's float and int attributes by name."""
    found = {}
    for number, _, value in node:
        if number == NODE_ATTRIBUTE:
            attribute = parse(value)
            name = strings(attribute, _ATTRIBUTE_NAME)[0]
            for n, kind, v in attribute:
                if n == _ATTRIBUTE_FLOAT and kind == FIXED32:
                    found[name] = fixed_float(v)
                elif n == _ATTRIBUTE_INT and kind == VARINT:
                    found[name] = signed(v)
    return found


def node_op(node: list[Field]) -> tuple[str, str]:
    """An ONNX node's (domain, op type); the default domain is ""."""
    return (strings(node, NODE_DOMAIN) or [""])[0], strings(node, NODE_OP_TYPE)[0]
