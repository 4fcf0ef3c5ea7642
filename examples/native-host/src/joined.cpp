// Just enough of protobuf's wire format to join ONNX models and rename a node's op (runtime/protowire.py does the
// same for the Python engine).
#include "joined.hpp"

#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>

namespace pipeshard {

const char* const kCustomDomain = "pipeshard";

namespace {

enum Wire { VARINT = 0, FIXED64 = 1, LENGTH = 2, FIXED32 = 5 };

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
constexpr uint32_t kNodeInput = 1, kNodeOutput = 2, kNodeOpType = 4, kNodeAttribute = 5, kNodeDomain = 7;
constexpr uint32_t kTensorName = 8, kValueInfoName = 1, kOpsetDomain = 1, kOpsetVersion = 2;
constexpr uint32_t kAttributeName = 1, kAttributeFloat = 2, kAttributeInt = 3;

uint64_t read_varint(const std::string& data, size_t& at) {
    uint64_t value = 0;
    for (int shift = 0;; shift += 7) {
        if (at >= data.size() || shift > 63) throw std::runtime_error("truncated varint in an ONNX model");
        uint8_t byte = static_cast<uint8_t>(data[at++]);
        value |= static_cast<uint64_t>(byte & 0x7F) << shift;
        if (byte < 0x80) return value;
    }
}

void write_varint(std::string& out, uint64_t value) {
    do {
        uint8_t byte = value & 0x7F;
        value >>= 7;
        out.push_back(static_cast<char>(byte | (value ? 0x80 : 0)));
    } while (value);
}

std::vector<Field> parse(const std::string& data) {
    std::vector<Field> fields;
    size_t at = 0;
    while (at < data.size()) {
        uint64_t key = read_varint(data, at);
        Field field(static_cast<uint32_t>(key >> 3), static_cast<int>(key & 7));
        size_t size = 0;
        if (field.wire == VARINT) {
            field.varint = read_varint(data, at);
        } else {
            if (field.wire == LENGTH) size = static_cast<size_t>(read_varint(data, at));
            else if (field.wire == FIXED64) size = 8;
            else if (field.wire == FIXED32) size = 4;
            else throw std::runtime_error("unsupported protobuf wire type in an ONNX model");
            if (size > data.size() - at) throw std::runtime_error("truncated field in an ONNX model");
            field.bytes = data.substr(at, size);
            at += size;
        }
        fields.push_back(std::move(field));
    }
    return fields;
}

std::string serialize(const std::vector<Field>& fields) {
    std::string out;
    for (const Field& field : fields) {
        write_varint(out, static_cast<uint64_t>(field.number) << 3 | static_cast<uint64_t>(field.wire));
        if (field.wire == VARINT) {
            write_varint(out, field.varint);
        } else {
            if (field.wire == LENGTH) write_varint(out, field.bytes.size());
            out += field.bytes;
        }
    }
    return out;
}

std::vector<std::string> strings(const std::vector<Field>& fields, uint32_t number) {
    std::vector<std::string> found;
    for (const Field& field : fields)
        if (field.number == number && field.wire == LENGTH) found.push_back(field.bytes);
    return found;
}

std::string first_string(const std::vector<Field>& fields, uint32_t number) {
    std::vector<std::string> found = strings(fields, number);
    return found.empty() ? std::string() : found[0];
}

Field length_field(uint32_t number, std::string bytes) {
    Field field(number, LENGTH);
    field.bytes = std::move(bytes);
    return field;
}

// GroupQueryAttention's inputs, by position, that DecodeAttention needs absent or reads specially.
constexpr size_t kKey = 1, kValue = 2, kPastKey = 3, kCosCache = 7, kSinCache = 8, kPositionIds = 9;

// Whether DecodeAttention computes what this GroupQueryAttention node does at one new token (decode_attention.py).
bool covered(const std::vector<Field>& node, const std::set<std::string>& float_inputs) {
    std::vector<std::string> inputs = strings(node, kNodeInput);
    if (inputs.size() > 11 || strings(node, kNodeOutput).size() != 3) return false;
    inputs.resize(11);
    std::map<std::string, double> attributes;
    for (const Field& field : node) {
        if (field.number != kNodeAttribute) continue;
        std::vector<Field> attribute = parse(field.bytes);
        std::string name = first_string(attribute, kAttributeName);
        for (const Field& value : attribute) {
            if (value.number == kAttributeFloat && value.wire == FIXED32) {
                float number;
                std::memcpy(&number, value.bytes.data(), 4);
                attributes[name] = number;
            } else if (value.number == kAttributeInt && value.wire == VARINT) {
                attributes[name] = static_cast<double>(static_cast<int64_t>(value.varint));
            }
        }
    }
    auto attribute = [&](const char* name) { return attributes.count(name) ? attributes[name] : 0.0; };
    bool rotary = attribute("do_rotary") == 1;
    return inputs[kKey].empty() && inputs[kValue].empty() && inputs[kPositionIds].empty() &&
           rotary == !inputs[kCosCache].empty() && rotary == !inputs[kSinCache].empty() &&
           attribute("rotary_interleaved") == 0 && attribute("softcap") == 0 && attribute("smooth_softmax") == 0 &&
           float_inputs.count(inputs[kPastKey]) > 0;
}

std::string read_bytes(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::runtime_error(path + ": cannot be read");
    std::ostringstream out;
    out << in.rdbuf();
    return out.str();
}

}  // namespace

JoinedModel join_models(const std::vector<std::string>& paths, const std::set<std::string>& outputs,
                        const std::set<std::string>* float_inputs) {
    std::vector<std::vector<Field>> models, graphs;
    for (const std::string& path : paths) {
        models.push_back(parse(read_bytes(path)));
        std::vector<std::string> graph = strings(models.back(), kModelGraph);
        if (graph.size() != 1) throw std::runtime_error(path + ": not one graph");
        graphs.push_back(parse(graph[0]));
    }
    std::set<std::string> produced;
    for (const auto& graph : graphs)
        for (const Field& field : graph)
            if (field.number == kGraphNode)
                for (const std::string& name : strings(parse(field.bytes), kNodeOutput)) produced.insert(name);
    JoinedModel joined;
    std::vector<Field> graph;
    for (const Field& field : graphs[0])
        if (field.number != kGraphNode && field.number != kGraphInitializer && field.number != kGraphInput &&
            field.number != kGraphOutput && field.number != kGraphValueInfo)
            graph.push_back(field);
    std::map<uint32_t, std::set<std::string>> seen;
    for (const auto& member : graphs) {
        for (const Field& field : member) {
            if (field.number == kGraphNode) {
                std::vector<Field> node = parse(field.bytes);
                if (float_inputs && first_string(node, kNodeDomain) == "com.microsoft" &&
                    first_string(node, kNodeOpType) == "GroupQueryAttention" && covered(node, *float_inputs)) {
                    for (Field& part : node) {
                        if (part.number == kNodeOpType) part.bytes = "DecodeAttention";
                        if (part.number == kNodeDomain) part.bytes = kCustomDomain;
                    }
                    graph.push_back(length_field(kGraphNode, serialize(node)));
                    ++joined.decode_attention_nodes;
                } else {
                    graph.push_back(field);
                }
                continue;
            }
            if (field.number != kGraphInitializer && field.number != kGraphInput && field.number != kGraphOutput &&
                field.number != kGraphValueInfo)
                continue;
            std::string name =
                first_string(parse(field.bytes), field.number == kGraphInitializer ? kTensorName : kValueInfoName);
            bool wanted = field.number == kGraphInput ? produced.count(name) == 0
                          : field.number == kGraphOutput ? outputs.count(name) > 0
                                                         : true;
            if (wanted && seen[field.number].insert(name).second) {
                graph.push_back(field);
                if (field.number == kGraphInput) joined.inputs.push_back(name);
                if (field.number == kGraphOutput) joined.outputs.push_back(name);
            }
        }
    }
    if (joined.outputs.size() != outputs.size()) throw std::runtime_error("a joined sub-layer output is missing");
    std::map<std::string, uint64_t> opsets;
    for (const auto& model : models)
        for (const Field& field : model)
            if (field.number == kModelOpsetImport) {
                std::vector<Field> opset = parse(field.bytes);
                uint64_t version = 1;
                for (const Field& part : opset)
                    if (part.number == kOpsetVersion && part.wire == VARINT) version = part.varint;
                uint64_t& kept = opsets[first_string(opset, kOpsetDomain)];
                kept = std::max(kept, version);
            }
    if (joined.decode_attention_nodes) opsets[kCustomDomain] = 1;
    std::vector<Field> model;
    for (const Field& field : models[0])
        if (field.number != kModelGraph && field.number != kModelOpsetImport) model.push_back(field);
    model.push_back(length_field(kModelGraph, serialize(graph)));
    for (const auto& entry : opsets) {
        Field version(kOpsetVersion, VARINT);
        version.varint = entry.second;
        model.push_back(length_field(kModelOpsetImport, serialize({length_field(kOpsetDomain, entry.first), version})));
    }
    joined.model = serialize(model);
    return joined;
}

}  // namespace pipeshard
