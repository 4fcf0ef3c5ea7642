// Just enough of protobuf's wire format to read and rewrite ONNX models (runtime/protowire.py does the same for the
// Python engine).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace pipeshard::wire {

enum Kind { VARINT = 0, FIXED64 = 1, LENGTH = 2, FIXED32 = 5 };

struct Field {
    uint32_t number = 0;
    int wire = VARINT;
    uint64_t varint = 0;
    std::string bytes;  // LENGTH and fixed fields
    Field(uint32_t number_, int wire_) : number(number_), wire(wire_) {}
};

// ONNX's field numbers (onnx.proto).
constexpr uint32_t kModelGraph = 7, kModelOpsetImport = 8;
constexpr uint32_t kGraphNode = 1, kGraphInitializer = 5, kGraphInput = 11, kGraphOutput = 12, kGraphValueInfo = 13;
constexpr uint32_t kNodeInput = 1, kNodeOutput = 2, kNodeName = 3, kNodeOpType = 4, kNodeAttribute = 5,
                   kNodeDocString = 6, kNodeDomain = 7, kNodeMetadata = 9;
constexpr uint32_t kTensorDataType = 2, kTensorFloatData = 4, kTensorInt64Data = 7, kTensorName = 8,
                   kTensorRawData = 9;
constexpr uint32_t kValueInfoName = 1, kOpsetDomain = 1, kOpsetVersion = 2;
constexpr uint32_t kAttributeName = 1, kAttributeFloat = 2, kAttributeInt = 3, kAttributeType = 20;
constexpr uint64_t kAttributeTypeInt = 2;       // AttributeProto.INT
constexpr uint64_t kFloat = 1, kInt64 = 7;      // TensorProto.FLOAT, TensorProto.INT64

// The fields of a message; throws std::runtime_error on a truncated or unsupported one.
std::vector<Field> parse(const std::string& data);
std::string serialize(const std::vector<Field>& fields);
std::vector<std::string> strings(const std::vector<Field>& fields, uint32_t number);
std::string first_string(const std::vector<Field>& fields, uint32_t number);
Field length_field(uint32_t number, std::string bytes);
Field varint_field(uint32_t number, uint64_t value);
int64_t signed_value(uint64_t varint);  // an int64 field's value
// An ONNX node's float and int attributes by name.
std::map<std::string, double> node_attributes(const std::vector<Field>& node);

}  // namespace pipeshard::wire
