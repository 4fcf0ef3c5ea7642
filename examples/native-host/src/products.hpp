// Products with stored weights on the CPU, as the Python engine's CPU sessions compute them
// (runtime/weight_matmul.py): a 4-bit com.microsoft::MatMulNBits (with the exporter's high-plane and minimum terms
// around it) becomes pipeshard's BlockMatMul, a MatMul or Gemm of a half-precision weight pipeshard's WeightMatMul
// (runtime/_matmul.c, built into the host). The pack is not changed.
#pragma once

#include <set>
#include <string>
#include <vector>

#include "wire.hpp"

namespace pipeshard {

struct WeightSpec;

// The weights the ops may read: 2-D float16 and bfloat16 ones, and the uint8 planes and zero points of 4-bit
// products.
bool product_weight(const WeightSpec& weight);

// Rewrites a GraphProto's fields: every product of a weight in `weights` (read directly, or through a Cast to
// float) swapped, nodes nothing reads any more dropped. `outputs` are the graph's outputs. Returns how many
// products were swapped.
int swap_products(std::vector<wire::Field>& graph, const std::set<std::string>& weights,
                  const std::set<std::string>& outputs);

}  // namespace pipeshard
