// The pack's manifest and a plans file, read into typed records once (docs/model-pack.md, docs/plans.md).
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "json.hpp"

namespace pipeshard {

struct TensorSpec {
    std::string name;
    std::string dtype;
    Json shape;  // ints and symbolic names, as the manifest writes them
};

struct WeightSpec {
    std::string name;
    std::string file;
    std::string dtype;
    std::vector<int64_t> shape;
    uint64_t offset = 0;
    uint64_t bytes = 0;
};

struct RowChunks {
    std::string weight;  // the output layer's weight whose rows a chunk binds
    int64_t rows = 0;
    uint64_t row_bytes = 0;
};

struct SubLayer {
    std::string name, kind;
    std::string onnx_file, inputs_file;  // the sub-layer, and its weights-as-inputs variant
    std::string blob_file;               // empty when it owns no weights
    uint64_t blob_bytes = 0;
    std::vector<WeightSpec> weights;
    std::vector<TensorSpec> inputs, outputs;
    std::vector<std::string> past, present;  // KV names, in matching order
    bool has_row_chunks = false;
    RowChunks row_chunks;
};

// A VLM pack's vision tower (manifest.vision, docs/vlm.md): its blocks in order, from pixel_values to
// image_features, and the preprocessing its export recorded.
struct Vision {
    std::string family;
    int64_t image_token_id = -1;
    Json preprocessing;
    std::vector<SubLayer> sub_layers;
};

// A MoE layer's router, experts and the tensors that connect them (manifest.moe_blocks, docs/model-pack.md): the
// host runs each expert some token chose over those tokens only and adds their outputs to the residual.
struct MoeBlock {
    std::string router;
    std::vector<std::string> experts, expert_outputs;
    std::string residual, hidden, routing, output;
};

struct Manifest {
    std::string folder;
    int64_t hidden_size = 0, vocab_size = 0, max_context = 0;
    std::string min_onnxruntime;      // manifest.host.min_onnxruntime, or empty
    std::string chat_template_file;   // manifest.host.chat_template, or empty
    std::vector<SubLayer> sub_layers;
    std::vector<MoeBlock> moe_blocks;
    bool has_vision = false;
    Vision vision;
};

// A unit plans place: a sub-layer, or rows [row_start, row_stop) of the output layer (`final#j`).
struct Unit {
    std::string name;
    size_t sub_layer = 0;
    bool chunk = false;
    int64_t row_start = 0, row_stop = 0;
};

struct Plan {
    std::string strategy;
    int tier = 0;
    std::map<std::string, std::string> placements;  // unit -> pinned | streamed | cpu
    int slots = 0;
    bool prefetch = true;
    uint64_t vram_total = 0;
};

struct Rung {
    uint64_t budget_bytes = 0;
    std::map<int, Plan> tiers;
    bool all_cpu = false;  // the 0-byte rung the host adds below a plans file's ladder
};

struct PlansFile {
    std::string path;
    int64_t context = 0;
    std::vector<Rung> rungs;  // largest budget first
};

// Throws HostError(PIPESHARD_ERR_PACK) with the file and the field on anything a host cannot run.
Manifest read_manifest(const std::string& folder);

// The units of a plan (the output layer as `chunks` row ranges when chunks > 1), in execution order.
std::vector<Unit> planning_units(const Manifest& manifest, int chunks);

// Throws HostError(PIPESHARD_ERR_PLANS) when the file is not for this pack or does not place its units.
PlansFile read_plans(const std::string& path, const Manifest& manifest, int64_t sequences, std::vector<Unit>& units);

// Whether a sub-layer always runs on the host (cheap, or reading few rows of a large table).
bool host_only(const SubLayer& sub_layer);
// The bytes of one element of a dtype the host runs (a JsonError for any other).
uint64_t dtype_bytes(const std::string& dtype);

}  // namespace pipeshard
