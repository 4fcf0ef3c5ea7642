#include "pack.hpp"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <set>

#include "errors.hpp"
#include "sha256.hpp"

namespace pipeshard {
namespace {

constexpr int64_t kPackSchemaVersion = 2;
constexpr int64_t kPlansSchemaVersion = 2;

namespace fs = std::filesystem;

bool is_file(const std::string& path, uint64_t* size = nullptr) {
    std::error_code error;
    if (!fs::is_regular_file(fs::u8path(path), error)) return false;
    if (size) *size = static_cast<uint64_t>(fs::file_size(fs::u8path(path), error));
    return !error;
}

bool is_directory(const std::string& path) {
    std::error_code error;
    return fs::is_directory(fs::u8path(path), error);
}

// A count, size or offset of a manifest or plans file: an integer from 0 to `most`.
uint64_t count_of(const Json& value, const std::string& what, int64_t least = 0,
                  int64_t most = std::numeric_limits<int64_t>::max()) {
    int64_t number = value.integer();
    if (number < least || number > most)
        throw JsonError(what + " must be from " + std::to_string(least) + " to " + std::to_string(most) + ", not " +
                        std::to_string(number));
    return static_cast<uint64_t>(number);
}

// A file the pack names: a plain name (no folder, no "..") of a regular file whose real path lies inside the pack.
std::string inside_pack(const std::string& folder, const std::string& name, const std::string& what) {
    if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos ||
        name.find('\\') != std::string::npos)
        throw JsonError(what + " '" + name + "' is not a plain file name inside the pack");
    std::string path = folder + "/" + name;
    std::error_code folder_error, file_error;
    fs::path real_folder = fs::canonical(fs::u8path(folder), folder_error);
    fs::path real_file = fs::canonical(fs::u8path(path), file_error);
    bool found = !file_error;
    bool inside = found && !folder_error && real_file.parent_path() == real_folder;
    if (!found || !is_file(path)) fail(PIPESHARD_ERR_PACK, path + " is missing (listed in manifest.json)");
    if (!inside) fail(PIPESHARD_ERR_PACK, path + " leads outside the pack (a link): refused");
    return name;
}

std::vector<TensorSpec> tensor_specs(const Json& list) {
    std::vector<TensorSpec> specs;
    for (const Json& item : list.items) specs.push_back({item.at("name").str(), item.at("dtype").str(), item.at("shape")});
    return specs;
}

std::vector<std::string> strings(const Json& list) {
    std::vector<std::string> out;
    for (const Json& item : list.items) out.push_back(item.str());
    return out;
}

// `vision`: a vision block's record, which has neither a KV cache nor row chunks and leaves them out.
// A MoE block whose router and experts are sub-layers of the pack, one output per expert.
MoeBlock read_moe_block(const Json& entry, const std::vector<SubLayer>& sub_layers, const std::string& path) {
    MoeBlock block;
    block.router = entry.at("router").str();
    for (const Json& name : entry.at("experts").items) block.experts.push_back(name.str());
    for (const Json& name : entry.at("expert_outputs").items) block.expert_outputs.push_back(name.str());
    block.residual = entry.at("residual").str();
    block.hidden = entry.at("hidden").str();
    block.routing = entry.at("routing").str();
    block.output = entry.at("output").str();
    auto known = [&](const std::string& name) {
        for (const SubLayer& sub : sub_layers)
            if (sub.name == name) return;
        fail(PIPESHARD_ERR_PACK, path + ": moe_blocks names " + name + ", which is no sub-layer");
    };
    known(block.router);
    for (const std::string& expert : block.experts) known(expert);
    if (block.experts.empty() || block.experts.size() != block.expert_outputs.size())
        fail(PIPESHARD_ERR_PACK, path + ": the MoE block of " + block.router + " has " +
                                     std::to_string(block.experts.size()) + " experts and " +
                                     std::to_string(block.expert_outputs.size()) + " expert outputs");
    return block;
}

SubLayer read_sub_layer(const Json& entry, const std::string& folder, bool vision = false) {
    SubLayer sub;
    sub.name = entry.at("name").str();
    sub.kind = entry.at("kind").str();
    std::string where = "sub-layer " + sub.name;
    sub.onnx_file = inside_pack(folder, entry.at("files").at("onnx").str(), where + "'s onnx file");
    sub.inputs_file = inside_pack(folder, entry.at("files").at("weights_as_inputs").str(), where + "'s onnx file");
    const Json& blob = entry.at("blob");
    uint64_t blob_size = 0;
    if (!blob.is_null()) {
        sub.blob_file = inside_pack(folder, blob.at("file").str(), where + "'s blob");
        sub.blob_bytes = count_of(blob.at("bytes"), where + "'s blob bytes");
        std::string path = folder + "/" + sub.blob_file;
        is_file(path, &blob_size);
        if (blob_size != sub.blob_bytes)
            fail(PIPESHARD_ERR_PACK, path + " has " + std::to_string(blob_size) + " bytes, the manifest says " +
                                         std::to_string(sub.blob_bytes) + " (truncated or corrupt)");
    }
    for (const Json& weight : entry.at("weights").items) {
        WeightSpec spec;
        spec.name = weight.at("name").str();
        std::string what = where + "'s weight " + spec.name;
        spec.file = inside_pack(folder, weight.at("file").str(), what + "'s file");
        uint64_t file_size = blob_size;
        if (spec.file != sub.blob_file) is_file(folder + "/" + spec.file, &file_size);  // a tied weight's blob
        spec.dtype = weight.at("dtype").str();
        uint64_t elements = 1;
        for (const Json& dim : weight.at("shape").items) {
            uint64_t size = count_of(dim, what + "'s shape", 0, 1LL << 40);
            elements = size && elements > std::numeric_limits<uint64_t>::max() / size ? 0 : elements * size;
            spec.shape.push_back(static_cast<int64_t>(size));
        }
        spec.offset = count_of(weight.at("offset"), what + "'s offset");
        spec.bytes = count_of(weight.at("bytes"), what + "'s bytes");
        if (elements * dtype_bytes(spec.dtype) != spec.bytes)
            throw JsonError(what + " has " + std::to_string(spec.bytes) + " bytes, not what its shape and dtype hold");
        if (spec.offset > file_size || spec.bytes > file_size - spec.offset)
            throw JsonError(what + " (offset " + std::to_string(spec.offset) + ", " + std::to_string(spec.bytes) +
                            " bytes) lies past the end of its blob of " + std::to_string(file_size) + " bytes");
        sub.weights.push_back(spec);
    }
    sub.inputs = tensor_specs(entry.at("inputs"));
    sub.outputs = tensor_specs(entry.at("outputs"));
    const Json null_value;
    const Json& kv = vision ? null_value : entry.at("kv");
    if (!kv.is_null()) {
        sub.past = strings(kv.at("past"));
        sub.present = strings(kv.at("present"));
    }
    const Json& chunks = vision ? null_value : entry.at("row_chunks");
    if (!chunks.is_null()) {
        sub.has_row_chunks = true;
        sub.row_chunks = {chunks.at("weight").str(), static_cast<int64_t>(count_of(chunks.at("rows"), where + "'s rows", 1)),
                          count_of(chunks.at("row_bytes"), where + "'s row bytes", 1)};
        auto chunked = std::find_if(sub.weights.begin(), sub.weights.end(),
                                    [&](const WeightSpec& w) { return w.name == sub.row_chunks.weight; });
        if (chunked == sub.weights.end() ||
            static_cast<uint64_t>(sub.row_chunks.rows) > chunked->bytes / sub.row_chunks.row_bytes ||
            static_cast<uint64_t>(sub.row_chunks.rows) * sub.row_chunks.row_bytes != chunked->bytes)
            throw JsonError(where + "'s row chunks do not match its weight " + sub.row_chunks.weight);
    }
    return sub;
}

}  // namespace

uint64_t dtype_bytes(const std::string& dtype) {
    if (dtype == "float32" || dtype == "int32") return 4;
    if (dtype == "float16" || dtype == "bfloat16") return 2;
    if (dtype == "int64") return 8;
    if (dtype == "bool" || dtype == "uint8" || dtype == "int8") return 1;
    throw JsonError("unsupported dtype '" + dtype + "'");
}

bool host_only(const SubLayer& sub_layer) { return sub_layer.kind == "prologue" || sub_layer.kind == "embed"; }

Manifest read_manifest(const std::string& folder) {
    if (!is_directory(folder)) fail(PIPESHARD_ERR_PACK, folder + " does not exist (or is not a folder)");
    std::string path = folder + "/manifest.json";
    if (!is_file(path)) fail(PIPESHARD_ERR_PACK, path + " is missing: not a pipeshard model pack");
    Manifest manifest;
    manifest.folder = folder;
    try {
        Json document = Json::parse(read_file(path));
        const Json& version = document.at("schema_version");
        if (!version.is_number() || version.integer() != kPackSchemaVersion)
            fail(PIPESHARD_ERR_PACK, path + ": unsupported schema_version (this host reads " +
                                         std::to_string(kPackSchemaVersion) + ")");
        const Json& model = document.at("model");
        manifest.hidden_size = static_cast<int64_t>(count_of(model.at("hidden_size"), "model.hidden_size", 1, 1 << 20));
        manifest.vocab_size = static_cast<int64_t>(count_of(model.at("vocab_size"), "model.vocab_size", 1, 1 << 24));
        manifest.max_context = static_cast<int64_t>(count_of(model.at("max_context"), "model.max_context", 1, 1 << 24));
        if (document.has("host")) {
            const Json& host = document.at("host");
            if (host.has("min_onnxruntime")) manifest.min_onnxruntime = host.at("min_onnxruntime").str();
            if (host.has("chat_template") && !host.at("chat_template").is_null())
                manifest.chat_template_file = inside_pack(folder, host.at("chat_template").str(), "the chat template");
        }
        for (const Json& entry : document.at("sub_layers").items)
            manifest.sub_layers.push_back(read_sub_layer(entry, folder));
        if (document.has("moe_blocks"))
            for (const Json& entry : document.at("moe_blocks").items)
                manifest.moe_blocks.push_back(read_moe_block(entry, manifest.sub_layers, path));
        if (document.has("vision") && !document.at("vision").is_null()) {
            const Json& vision = document.at("vision");
            manifest.has_vision = true;
            manifest.vision.family = vision.at("family").str();
            manifest.vision.image_token_id = static_cast<int64_t>(
                count_of(vision.at("image_token_id"), "vision.image_token_id", 0, manifest.vocab_size - 1));
            manifest.vision.preprocessing = vision.at("preprocessing");
            for (const Json& entry : vision.at("sub_layers").items)
                manifest.vision.sub_layers.push_back(read_sub_layer(entry, folder, true));
            if (manifest.vision.sub_layers.empty()) throw JsonError("vision has no sub_layers");
        }
        std::set<std::string> blobs;
        for (const auto* list : {&manifest.sub_layers, &manifest.vision.sub_layers})
            for (const SubLayer& sub : *list) blobs.insert(sub.blob_file);
        for (const auto* list : {&manifest.sub_layers, &manifest.vision.sub_layers})
            for (const SubLayer& sub : *list)
                for (const WeightSpec& weight : sub.weights)
                    if (!blobs.count(weight.file))
                        throw JsonError(weight.file + " holds weights of " + sub.name + " but is no sub-layer's blob");
    } catch (const JsonError& error) {
        fail(PIPESHARD_ERR_PACK, path + ": " + error.what());
    }
    if (manifest.sub_layers.empty()) fail(PIPESHARD_ERR_PACK, path + ": no sub_layers");
    return manifest;
}

std::vector<Unit> planning_units(const Manifest& manifest, int chunks) {
    std::vector<Unit> units;
    for (size_t index = 0; index < manifest.sub_layers.size(); ++index) {
        const SubLayer& sub = manifest.sub_layers[index];
        if (!sub.has_row_chunks || chunks <= 1) {
            units.push_back({sub.name, index, false, 0, 0});
            continue;
        }
        int64_t rows = sub.row_chunks.rows;
        int64_t per_chunk = (rows + chunks - 1) / chunks;
        for (int64_t start = 0; start < rows; start += per_chunk)
            units.push_back({sub.name + "#" + std::to_string(start / per_chunk), index, true, start,
                             std::min(start + per_chunk, rows)});
    }
    return units;
}

namespace {

Plan read_plan(const Json& chosen) {
    Plan plan;
    plan.strategy = chosen.at("strategy").str();
    plan.tier = static_cast<int>(count_of(chosen.at("tier"), "a plan's tier", 0, 1 << 20));
    for (const auto& [unit, placement] : chosen.at("placements").fields) {
        const std::string& where = placement.str();
        if (where != "cpu" && where != "pinned" && where != "streamed")
            throw JsonError("unknown placement '" + where + "' of " + unit);
        plan.placements[unit] = where;
    }
    if (chosen.has("slots")) plan.slots = static_cast<int>(count_of(chosen.at("slots"), "a plan's slots", 0, 64));
    if (chosen.has("prefetch")) plan.prefetch = chosen.at("prefetch").boolean;
    uint64_t total = 0;
    for (const auto& [part, bytes] : chosen.at("vram").fields)
        if (part != "total") total += count_of(bytes, "a plan's vram." + part, 0, 1LL << 50);
    plan.vram_total = total;
    return plan;
}

}  // namespace

PlansFile read_plans(const std::string& path, const Manifest& manifest, int64_t sequences, std::vector<Unit>& units) {
    if (!is_file(path)) fail(PIPESHARD_ERR_PLANS, path + " does not exist (a plans file of `pipeshard plan --out`)");
    PlansFile plans;
    plans.path = path;
    std::string digest = sha256_file(manifest.folder + "/manifest.json");
    try {
        Json document = Json::parse(read_file(path));
        const Json& version = document.at("schema_version");
        if (!version.is_number() || version.integer() != kPlansSchemaVersion)
            fail(PIPESHARD_ERR_PLANS, path + ": unsupported schema_version (this host reads " +
                                          std::to_string(kPlansSchemaVersion) + ": make it again with `pipeshard plan "
                                          "PACK --out FILE`)");
        if (!document.has("pack_sha256") || document.at("pack_sha256").str() != digest)
            fail(PIPESHARD_ERR_PLANS, path + " was made for another pack (" +
                                          (document.has("pack") ? document.at("pack").str() : std::string("?")) +
                                          "), not " + manifest.folder + ": its pack_sha256 differs from this "
                                          "pack's manifest.json");
        plans.context = static_cast<int64_t>(count_of(document.at("context"), "context", 1, manifest.max_context));
        if (document.at("batch").integer() != sequences)
            fail(PIPESHARD_ERR_PLANS, path + ": made for batches of " +
                                          std::to_string(document.at("batch").integer()) + "; this host runs " +
                                          std::to_string(sequences) + " sessions per step (plan with --batch " +
                                          std::to_string(sequences) + ")");
        std::vector<const Json*> ladder;
        if (document.has("ladder") && document.at("ladder").size() != 0) {
            for (const Json& rung : document.at("ladder").items) ladder.push_back(&rung);
        } else {
            ladder.push_back(&document);
        }
        for (const Json* rung_json : ladder) {
            Rung rung;
            rung.budget_bytes = count_of(rung_json->at("budget_bytes"), "budget_bytes", 0, 1LL << 50);
            for (const Json& tier : rung_json->at("tiers").items) {
                Plan plan = read_plan(tier.at("chosen"));
                rung.tiers[static_cast<int>(count_of(tier.at("tier"), "a tier", 1, 1 << 20))] = plan;
            }
            if (rung.tiers.empty()) fail(PIPESHARD_ERR_PLANS, path + ": a rung without tiers");
            plans.rungs.push_back(rung);
        }
    } catch (const JsonError& error) {
        fail(PIPESHARD_ERR_PLANS, path + ": " + error.what());
    }
    std::sort(plans.rungs.begin(), plans.rungs.end(),
              [](const Rung& a, const Rung& b) { return a.budget_bytes > b.budget_bytes; });
    // The output layer's chunk count is the plans' (every plan of a file places the same units).
    const Plan& first = plans.rungs.front().tiers.begin()->second;
    int chunks = 0;
    for (const auto& entry : first.placements)
        if (entry.first.find('#') != std::string::npos) ++chunks;
    units = planning_units(manifest, chunks);
    std::set<std::string> names;
    for (const Unit& unit : units) names.insert(unit.name);
    for (const Rung& rung : plans.rungs) {
        for (const auto& [tier, plan] : rung.tiers) {
            std::set<std::string> placed;
            for (const auto& entry : plan.placements) placed.insert(entry.first);
            if (placed != names)
                fail(PIPESHARD_ERR_PLANS, path + ": the tier " + std::to_string(tier) +
                                              " plan does not place exactly this pack's sub-layers");
            if (plan.vram_total > rung.budget_bytes)
                fail(PIPESHARD_ERR_PLANS, path + ": the tier " + std::to_string(tier) + " plan needs " +
                                              std::to_string(plan.vram_total) + " bytes, over its rung's budget of " +
                                              std::to_string(rung.budget_bytes) + " bytes");
        }
    }
    return plans;
}

}  // namespace pipeshard
