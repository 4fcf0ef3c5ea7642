#include "joined.hpp"

#include <cstdint>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>

#include "products.hpp"
#include "wire.hpp"

namespace pipeshard {

const char* const kCustomDomain = "pipeshard";

namespace {

using namespace wire;

// GroupQueryAttention's inputs, by position, that DecodeAttention needs absent or reads specially.
constexpr size_t kKey = 1, kValue = 2, kPastKey = 3, kCosCache = 7, kSinCache = 8, kPositionIds = 9;

// Whether DecodeAttention computes what this GroupQueryAttention node does at one new token (decode_attention.py).
bool covered(const std::vector<Field>& node, const std::set<std::string>& float_inputs) {
    std::vector<std::string> inputs = strings(node, kNodeInput);
    if (inputs.size() > 11 || strings(node, kNodeOutput).size() != 3) return false;
    inputs.resize(11);
    std::map<std::string, double> attributes = node_attributes(node);
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
                        const std::set<std::string>* float_inputs, const std::set<std::string>* product_weights) {
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
    if (product_weights) joined.product_nodes = swap_products(graph, *product_weights, outputs);
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
    if (joined.decode_attention_nodes || joined.product_nodes) opsets[kCustomDomain] = 1;
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
