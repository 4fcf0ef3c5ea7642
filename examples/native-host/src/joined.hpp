// Sub-layer graphs joined into one model for decode steps, ONNX Runtime's GroupQueryAttention swapped for
// pipeshard's DecodeAttention op (runtime/_attention.c, linked into the host) and products of stored weights for
// its BlockMatMul and WeightMatMul (runtime/_matmul.c, src/products.cpp), as the Python engine's chain does
// (runtime/joined.py, runtime/decode_attention.py, runtime/weight_matmul.py): the files are rewritten on protobuf's
// wire format, the pack is not changed.
#pragma once

#include <set>
#include <string>
#include <vector>

namespace pipeshard {

extern const char* const kCustomDomain;  // "pipeshard", the op domain of runtime/_attention.c and _matmul.c

struct JoinedModel {
    std::string model;                  // serialized ModelProto
    std::vector<std::string> inputs;    // graph inputs, in order (none produced by a joined node)
    std::vector<std::string> outputs;   // graph outputs kept, in order
    int decode_attention_nodes = 0;     // GroupQueryAttention nodes swapped for DecodeAttention
    int product_nodes = 0;              // products swapped for BlockMatMul or WeightMatMul
};

// The models in `paths`, in that order, as one: outputs are the sub-layers' outputs named in `outputs`; with
// `float_inputs` (the float32 tensors among the sub-layers' inputs), every GroupQueryAttention DecodeAttention
// computes at one new token is swapped for it; with `product_weights` (product_weight's weights), the products
// of them. Throws std::runtime_error on a file it cannot read.
JoinedModel join_models(const std::vector<std::string>& paths, const std::set<std::string>& outputs,
                        const std::set<std::string>* float_inputs, const std::set<std::string>* product_weights);

}  // namespace pipeshard
