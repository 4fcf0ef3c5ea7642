#include "products.hpp"

#include <cstring>
#include <map>
#include <optional>

#include "joined.hpp"
#include "pack.hpp"

namespace pipeshard {

using wire::Field;

namespace {

constexpr const char* kMsDomain = "com.microsoft";

struct Node {
    std::vector<Field> fields;
    std::string domain, op;
    std::vector<std::string> inputs, outputs;
    std::map<std::string, double> attributes;

    explicit Node(const std::string& bytes) : fields(wire::parse(bytes)) {
        domain = wire::first_string(fields, wire::kNodeDomain);
        op = wire::first_string(fields, wire::kNodeOpType);
        inputs = wire::strings(fields, wire::kNodeInput);
        outputs = wire::strings(fields, wire::kNodeOutput);
        attributes = wire::node_attributes(fields);
    }
    bool is(const char* op_type) const { return domain.empty() && op == op_type; }
    double attribute(const char* name, double otherwise) const {
        auto found = attributes.find(name);
        return found == attributes.end() ? otherwise : found->second;
    }
};

using Constants = std::map<std::string, std::vector<double>>;

// The float32 and int64 initializers of at most 8 values, by name: how the swap knows a Mul's factor and a
// Reshape's shape.
Constants small_constants(const std::vector<Field>& graph) {
    Constants found;
    for (const Field& field : graph) {
        if (field.number != wire::kGraphInitializer) continue;
        std::vector<Field> tensor = wire::parse(field.bytes);
        std::vector<uint64_t> types;
        for (const Field& part : tensor)
            if (part.number == wire::kTensorDataType && part.wire == wire::VARINT) types.push_back(part.varint);
        std::vector<std::string> names = wire::strings(tensor, wire::kTensorName);
        if (names.empty() || types.size() != 1 || (types[0] != wire::kFloat && types[0] != wire::kInt64)) continue;
        bool is_float = types[0] == wire::kFloat;
        std::vector<double> values;
        std::vector<std::string> raw = wire::strings(tensor, wire::kTensorRawData);
        if (!raw.empty()) {
            size_t width = is_float ? 4 : 8;
            for (size_t at = 0; at + width <= raw[0].size() && values.size() <= 8; at += width) {
                if (is_float) {
                    float value;
                    std::memcpy(&value, raw[0].data() + at, 4);
                    values.push_back(value);
                } else {
                    int64_t value;
                    std::memcpy(&value, raw[0].data() + at, 8);
                    values.push_back(static_cast<double>(value));
                }
            }
        } else {
            for (const Field& part : tensor) {
                if (is_float && part.number == wire::kTensorFloatData && part.wire != wire::VARINT) {
                    for (size_t at = 0; at + 4 <= part.bytes.size(); at += 4) {
                        float value;
                        std::memcpy(&value, part.bytes.data() + at, 4);
                        values.push_back(value);
                    }
                } else if (!is_float && part.number == wire::kTensorInt64Data) {
                    if (part.wire == wire::VARINT) {
                        values.push_back(static_cast<double>(wire::signed_value(part.varint)));
                    } else if (part.wire == wire::LENGTH) {  // packed
                        uint64_t packed = 0;
                        int shift = 0;
                        for (char byte : part.bytes) {
                            packed |= static_cast<uint64_t>(static_cast<uint8_t>(byte) & 0x7F) << shift;
                            shift += 7;
                            if (static_cast<uint8_t>(byte) < 0x80) {
                                values.push_back(static_cast<double>(wire::signed_value(packed)));
                                packed = 0;
                                shift = 0;
                            }
                        }
                    }
                }
            }
        }
        if (values.size() <= 8) found[names[0]] = values;
    }
    return found;
}

bool constant_is(const Constants& constants, const std::string& name, const std::vector<double>& values) {
    auto found = constants.find(name);
    return found != constants.end() && found->second == values;
}

// Who produces and how many nodes read each tensor of a node list.
struct Graph {
    const std::vector<Node>& nodes;
    const std::set<std::string>& outputs;
    std::map<std::string, size_t> producer;
    std::map<std::string, int> readers;

    Graph(const std::vector<Node>& nodes_, const std::set<std::string>& outputs_) : nodes(nodes_), outputs(outputs_) {
        for (size_t index = 0; index < nodes.size(); ++index) {
            if (!nodes[index].outputs.empty()) producer[nodes[index].outputs[0]] = index;
            for (const std::string& name : nodes[index].inputs) ++readers[name];
        }
    }

    // Whether one node reads `name`, and the graph does not return it.
    bool only_here(const std::string& name) const {
        auto found = readers.find(name);
        return found != readers.end() && found->second == 1 && outputs.count(name) == 0;
    }

    // The plain ONNX node `op` with `inputs` inputs that makes `name`, read only by one node.
    std::optional<size_t> made_by(const std::string& name, const char* op, size_t inputs) const {
        auto found = producer.find(name);
        if (found == producer.end() || !only_here(name) || !nodes[found->second].is(op) ||
            nodes[found->second].inputs.size() != inputs)
            return std::nullopt;
        return found->second;
    }
};

// BlockMatMul's inputs (x, B, scales[, zero points]) where the node is a MatMulNBits it computes: 4 or 2 bits,
// blocks of 16 or 32, float arithmetic (accuracy_level 4 would quantize x to int8: another function), no g_idx or bias,
// B and its zero points weights the op reads.
std::optional<std::vector<std::string>> block_product(const Node& node, const std::set<std::string>& weights) {
    if (node.domain != kMsDomain || node.op != "MatMulNBits") return std::nullopt;
    double block = node.attribute("block_size", 0), bits = node.attribute("bits", 4);
    if ((bits != 4 && bits != 2) || (block != 16 && block != 32)) return std::nullopt;
    const std::vector<std::string>& inputs = node.inputs;
    if (node.attribute("accuracy_level", 0) == 4 || inputs.size() < 3 || !weights.count(inputs[1]))
        return std::nullopt;
    for (size_t index = 4; index < inputs.size(); ++index)
        if (!inputs[index].empty()) return std::nullopt;
    bool zero_points = inputs.size() > 3 && !inputs[3].empty();
    if (zero_points && !weights.count(inputs[3])) return std::nullopt;
    return std::vector<std::string>(inputs.begin(), inputs.begin() + (zero_points ? 4 : 3));
}

int block_size(const Node& node) { return static_cast<int>(node.attribute("block_size", 0)); }
int plane_bits(const Node& node) { return static_cast<int>(node.attribute("bits", 4)); }

// One BlockMatMul in the place of several nodes: its inputs, the node whose place and output it takes, its block
// size, the other nodes it replaces, and its plane's bits.
struct Fused {
    std::vector<std::string> inputs;
    size_t at = 0;
    int block_size = 0;
    std::vector<size_t> replaced;
    int bits = 4;
};

using Read = std::map<std::string, std::string>;  // tensor -> the stored weight it is

// (the high plane, the nodes of its term) where `term` is Mul(high product, 16) over `low`'s x and scales.
std::optional<std::pair<std::string, std::vector<size_t>>> high_plane(
    const Graph& graph, const std::map<size_t, std::vector<std::string>>& blocks, const Fused& low,
    const std::string& term, const Constants& constants) {
    std::optional<size_t> mul = graph.made_by(term, "Mul", 2);
    if (!mul) return std::nullopt;
    const std::vector<std::string>& factors = graph.nodes[*mul].inputs;
    for (int order = 0; order < 2; ++order) {
        const std::string& high_name = factors[order];
        const std::string& factor = factors[1 - order];
        auto producer = graph.producer.find(high_name);
        if (producer == graph.producer.end()) continue;
        auto high = blocks.find(producer->second);
        if (high == blocks.end()) continue;
        const std::vector<std::string>& inputs = high->second;
        if (constant_is(constants, factor, {16.0}) && graph.only_here(high_name) && inputs.size() == 3 &&
            inputs[0] == low.inputs[0] && inputs[2] == low.inputs[2] &&
            block_size(graph.nodes[producer->second]) == low.block_size && low.bits == 4 &&
            plane_bits(graph.nodes[producer->second]) == 4)
            return std::make_pair(inputs[1], std::vector<size_t>{*mul, producer->second});
    }
    return std::nullopt;
}

// (the minimums, the nodes of their term) where `term` is the minimum term of `product`'s x:
// MatMul(ReduceSum(Reshape(x, [0, 0, -1, block]), [-1]), minimums).
std::optional<std::pair<std::string, std::vector<size_t>>> minimum_term(const Graph& graph, const Fused& product,
                                                                        const std::string& term, const Read& read,
                                                                        const Constants& constants) {
    std::optional<size_t> matmul = graph.made_by(term, "MatMul", 2);
    if (!matmul) return std::nullopt;
    std::optional<size_t> sums = graph.made_by(graph.nodes[*matmul].inputs[0], "ReduceSum", 2);
    if (!sums) return std::nullopt;
    std::optional<size_t> blocks = graph.made_by(graph.nodes[*sums].inputs[0], "Reshape", 2);
    if (!blocks) return std::nullopt;
    const Node& sum = graph.nodes[*sums];
    const Node& reshape = graph.nodes[*blocks];
    if (!constant_is(constants, sum.inputs[1], {-1.0}) || !sum.attributes.count("keepdims") ||
        sum.attributes.at("keepdims") != 0 || reshape.inputs[0] != product.inputs[0] ||
        !constant_is(constants, reshape.inputs[1], {0.0, 0.0, -1.0, static_cast<double>(product.block_size)}))
        return std::nullopt;
    const std::string& minimums = graph.nodes[*matmul].inputs[1];
    auto stored = read.find(minimums);
    return std::make_pair(stored == read.end() ? minimums : stored->second,
                          std::vector<size_t>{*matmul, *sums, *blocks});
}

// The exporter's sums around its 4-bit products (exporter/quantized_weights.py), each as one BlockMatMul at the
// index of its last Add: Add(low, Mul(high, 16)) (two block products of one x and one scales, the high one without
// zero points), then Add(product, the minimum term).
std::map<size_t, Fused> fuse_planes(const Graph& graph, const std::map<size_t, std::vector<std::string>>& blocks,
                                    const Read& read, const Constants& constants) {
    std::map<std::string, Fused> products;
    for (const auto& [index, inputs] : blocks) {
        Fused product{inputs, index, block_size(graph.nodes[index]), {}, plane_bits(graph.nodes[index])};
        product.inputs.resize(4);
        products[graph.nodes[index].outputs[0]] = product;
    }
    std::map<size_t, Fused> fused;
    for (size_t index = 0; index < graph.nodes.size(); ++index) {  // the high plane's Add comes before the minimum's
        const Node& node = graph.nodes[index];
        if (!node.is("Add") || node.inputs.size() != 2) continue;
        for (int order = 0; order < 2; ++order) {
            const std::string& first = node.inputs[order];
            const std::string& second = node.inputs[1 - order];
            auto found = products.find(first);
            if (found == products.end() || !graph.only_here(first) || found->second.inputs.size() > 5) continue;
            Fused product = found->second;
            std::optional<std::pair<std::string, std::vector<size_t>>> term;
            if (product.inputs.size() == 4) term = high_plane(graph, blocks, product, second, constants);
            if (!term) {
                term = minimum_term(graph, product, second, read, constants);
                if (!term) continue;
                product.inputs.resize(5);
            }
            fused.erase(product.at);
            Fused made{product.inputs, index, product.block_size, product.replaced, product.bits};
            made.inputs.push_back(term->first);
            made.replaced.push_back(product.at);
            made.replaced.insert(made.replaced.end(), term->second.begin(), term->second.end());
            fused[index] = made;
            if (!node.outputs.empty()) products[node.outputs[0]] = made;
            break;
        }
    }
    return fused;
}

// A K-quant's factored scales or minimums: the int8 per block, the float16 factor, and the nodes that multiply them.
struct Factored {
    std::string per_block, factor;
    std::vector<size_t> nodes;
};

// Where `name` is the exporter's Reshape(Mul(Cast(factor), Cast(int8)), shape) over stored weights
// (exporter/quantized_weights.py): the Reshape and Mul are dropped once nothing reads them.
std::optional<Factored> factored(const Graph& graph, const std::string& name, const Read& read) {
    auto reshape = graph.producer.find(name);  // read by a product's low and high planes, which become one op
    if (reshape == graph.producer.end() || !graph.nodes[reshape->second].is("Reshape") ||
        graph.nodes[reshape->second].inputs.empty())
        return std::nullopt;
    std::optional<size_t> product = graph.made_by(graph.nodes[reshape->second].inputs[0], "Mul", 2);
    if (!product) return std::nullopt;
    const std::vector<std::string>& casts = graph.nodes[*product].inputs;
    auto factor = read.find(casts[0]), per_block = read.find(casts[1]);
    if (factor == read.end() || per_block == read.end() || factor->second == casts[0] ||
        per_block->second == casts[1])
        return std::nullopt;
    return Factored{per_block->second, factor->second, {reshape->second, *product}};
}

// A node of pipeshard's domain in `like`'s place: the given inputs and int attributes, `like`'s outputs, name, doc
// and metadata.
std::string custom_node(const Node& like, const std::vector<std::string>& inputs, const char* op,
                        const std::vector<std::pair<const char*, int64_t>>& attributes) {
    std::vector<Field> node;
    for (const std::string& name : inputs) node.push_back(wire::length_field(wire::kNodeInput, name));
    for (const Field& field : like.fields)
        if (field.number == wire::kNodeOutput || field.number == wire::kNodeName ||
            field.number == wire::kNodeDocString || field.number == wire::kNodeMetadata)
            node.push_back(field);
    node.push_back(wire::length_field(wire::kNodeOpType, op));
    node.push_back(wire::length_field(wire::kNodeDomain, kCustomDomain));
    for (const auto& [name, value] : attributes)
        node.push_back(wire::length_field(
            wire::kNodeAttribute,
            wire::serialize({wire::length_field(wire::kAttributeName, name),
                             wire::varint_field(wire::kAttributeInt, static_cast<uint64_t>(value)),
                             wire::varint_field(wire::kAttributeType, wire::kAttributeTypeInt)})));
    return wire::serialize(node);
}

// WeightMatMul's (x, W, trans_b) where the node is a MatMul or plain Gemm of x and a weight the op reads.
std::optional<std::string> weight_product(const Node& node, const Read& read) {
    if (node.inputs.size() != 2) return std::nullopt;
    auto weight = read.find(node.inputs[1]);
    if (weight == read.end()) return std::nullopt;
    if (node.is("MatMul")) return custom_node(node, {node.inputs[0], weight->second}, "WeightMatMul", {});
    if (!node.is("Gemm") || node.attribute("alpha", 1.0) != 1.0 || node.attribute("beta", 1.0) != 1.0 ||
        node.attribute("transA", 0) != 0)
        return std::nullopt;
    std::vector<std::pair<const char*, int64_t>> trans_b;
    if (node.attribute("transB", 0) != 0) trans_b.emplace_back("trans_b", 1);
    return custom_node(node, {node.inputs[0], weight->second}, "WeightMatMul", trans_b);
}

}  // namespace

bool product_weight(const WeightSpec& weight) {
    return weight.dtype == "uint8" || weight.dtype == "int8" ||
           (weight.shape.size() == 2 && (weight.dtype == "float16" || weight.dtype == "bfloat16")) ||
           (weight.shape.size() == 3 && weight.dtype == "float16" &&  // a K-quant's factors: [N, supers, 1] or
            (weight.shape[1] == 1 || weight.shape[2] == 1));            // [supers, 1, N]
}

int swap_products(std::vector<Field>& graph, const std::set<std::string>& weights,
                  const std::set<std::string>& outputs) {
    std::vector<size_t> at;
    std::vector<Node> nodes;
    for (size_t index = 0; index < graph.size(); ++index)
        if (graph[index].number == wire::kGraphNode) {
            at.push_back(index);
            nodes.emplace_back(graph[index].bytes);
        }
    Read read;
    for (const std::string& weight : weights) read[weight] = weight;
    for (const Node& node : nodes)
        if (node.is("Cast") && !node.inputs.empty() && weights.count(node.inputs[0]) &&
            node.attribute("to", 0) == static_cast<double>(wire::kFloat) && !node.outputs.empty())
            read[node.outputs[0]] = node.inputs[0];
    std::map<size_t, std::vector<std::string>> blocks;
    for (size_t index = 0; index < nodes.size(); ++index)
        if (auto inputs = block_product(nodes[index], weights)) blocks[index] = *inputs;
    Graph links(nodes, outputs);
    std::map<size_t, Fused> fused = fuse_planes(links, blocks, read, small_constants(graph));
    std::set<size_t> folded;
    for (const auto& entry : fused) folded.insert(entry.second.replaced.begin(), entry.second.replaced.end());

    std::set<size_t> multiplied;  // the factored scales' products the op now makes itself
    std::vector<std::optional<std::string>> rewritten(nodes.size());
    int swapped = 0;
    for (size_t index = 0; index < nodes.size(); ++index) {
        if (folded.count(index)) continue;
        auto made = fused.find(index);
        auto block = blocks.find(index);
        if (made != fused.end() || block != blocks.end()) {
            std::vector<std::string> inputs = made != fused.end() ? made->second.inputs : block->second;
            inputs.resize(8);
            auto stored_scales = read.find(inputs[2]);  // scales stored in half precision read as stored
            if (stored_scales != read.end()) inputs[2] = stored_scales->second;
            for (auto [at, factor_at] : {std::pair<size_t, size_t>{2, 6}, {5, 7}}) {  // a K-quant's, as stored
                if (inputs[at].empty()) continue;
                if (std::optional<Factored> parts = factored(links, inputs[at], read)) {
                    inputs[at] = parts->per_block;
                    inputs[factor_at] = parts->factor;
                    multiplied.insert(parts->nodes.begin(), parts->nodes.end());
                }
            }
            while (!inputs.empty() && inputs.back().empty()) inputs.pop_back();
            int size = made != fused.end() ? made->second.block_size : block_size(nodes[index]);
            int bits = made != fused.end() ? made->second.bits : plane_bits(nodes[index]);
            std::vector<std::pair<const char*, int64_t>> attributes{{"block_size", size}};
            if (bits != 4) attributes.emplace_back("bits", bits);  // 4: the op's default
            rewritten[index] = custom_node(nodes[index], inputs, "BlockMatMul", attributes);
            ++swapped;
        } else if (std::optional<std::string> product = weight_product(nodes[index], read)) {
            rewritten[index] = std::move(product);
            ++swapped;
        } else {
            rewritten[index] = graph[at[index]].bytes;
        }
    }
    if (!swapped) return 0;
    std::set<size_t> unread = multiplied;  // and the Casts of stored weights: dropped once nothing reads them
    for (size_t index = 0; index < nodes.size(); ++index)
        if (nodes[index].is("Cast") && !nodes[index].outputs.empty() && read.count(nodes[index].outputs[0]))
            unread.insert(index);
    std::vector<std::vector<std::string>> reads(nodes.size());
    for (size_t index = 0; index < nodes.size(); ++index)
        if (rewritten[index]) reads[index] = wire::strings(wire::parse(*rewritten[index]), wire::kNodeInput);
    for (bool dropped = true; dropped;) {
        std::set<std::string> still_read(outputs);
        for (size_t index = 0; index < nodes.size(); ++index)
            if (rewritten[index]) still_read.insert(reads[index].begin(), reads[index].end());
        dropped = false;
        for (size_t index : unread)
            if (rewritten[index] && !nodes[index].outputs.empty() && !still_read.count(nodes[index].outputs[0])) {
                rewritten[index].reset();
                dropped = true;
            }
    }
    std::vector<Field> kept;
    size_t node = 0;
    for (size_t index = 0; index < graph.size(); ++index) {
        if (graph[index].number != wire::kGraphNode) {
            kept.push_back(std::move(graph[index]));
        } else if (rewritten[node++]) {
            kept.push_back(wire::length_field(wire::kGraphNode, std::move(*rewritten[node - 1])));
        }
    }
    graph = std::move(kept);
    return swapped;
}

}  // namespace pipeshard
