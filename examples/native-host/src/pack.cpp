#include "pack.hpp"

#include <sys/stat.h>

#include <algorithm>

#include "errors.hpp"
#include "sha256.hpp"

namespace pipeshard {
namespace {

constexpr int64_t kPackSchemaVersion = 2;
constexpr int64_t kPlansSchemaVersion = 2;

bool is_file(const std::string& path, uint64_t* size = nullptr) {
    struct stat info {};
    if (stat(path.c_str(), &info) != 0 || !S_ISREG(info.st_mode)) return false;
    if (size) *size = static_cast<uint64_t>(info.st_size);
    return true;
}

bool is_directory(const std::string& path) {
    struct stat info {};
    return stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode);
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

SubLayer read_sub_layer(const Json& entry, const std::string& folder) {
    SubLayer sub;
    sub.name = entry.at("name").str();
    sub.kind = entry.at("kind").str();
    sub.onnx_file = entry.at("files").at("onnx").str();
    sub.inputs_file = entry.at("files").at("weights_as_inputs").str();
    const Json& blob = entry.at("blob");
    if (!blob.is_null()) {
        sub.blob_file = blob.at("file").str();
        sub.blob_bytes = static_cast<uint64_t>(blob.at("bytes").integer());
    }
    for (const Json& weight : entry.at("weights").items) {
        WeightSpec spec;
        spec.name = weight.at("name").str();
        spec.file = weight.at("file").str();
        spec.dtype = weight.at("dtype").str();
        for (const Json& dim : weight.at("shape").items) spec.shape.push_back(dim.integer());
        spec.offset = static_cast<uint64_t>(weight.at("offset").integer());
        spec.bytes = static_cast<uint64_t>(weight.at("bytes").integer());
        sub.weights.push_back(spec);
    }
    sub.inputs = tensor_specs(entry.at("inputs"));
    sub.outputs = tensor_specs(entry.at("outputs"));
    const Json& kv = entry.at("kv");
    if (!kv.is_null()) {
        sub.past = strings(kv.at("past"));
        sub.present = strings(kv.at("present"));
    }
    const Json& chunks = entry.at("row_chunks");
    if (!chunks.is_null()) {
        sub.has_row_chunks = true;
        sub.row_chunks = {chunks.at("weight").str(), chunks.at("rows").integer(),
                          static_cast<uint64_t>(chunks.at("row_bytes").integer())};
    }
    for (const std::string& file : {sub.onnx_file, sub.inputs_file})
        if (!is_file(folder + "/" + file))
            fail(PIPESHARD_ERR_PACK, folder + "/" + file + " is missing (listed in manifest.json)");
    if (!sub.blob_file.empty()) {
        uint64_t size = 0;
        std::string path = folder + "/" + sub.blob_file;
        if (!is_file(path, &size)) fail(PIPESHARD_ERR_PACK, path + " is missing (listed in manifest.json)");
        if (size != sub.blob_bytes)
            fail(PIPESHARD_ERR_PACK, path + " has " + std::to_string(size) + " bytes, the manifest says " +
                                         std::to_string(sub.blob_bytes) + " (truncated or corrupt)");
    }
    return sub;
}

}  // namespace

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
        manifest.hidden_size = model.at("hidden_size").integer();
        manifest.vocab_size = model.at("vocab_size").integer();
        manifest.max_context = model.at("max_context").integer();
        if (document.has("moe_blocks") && document.at("moe_blocks").size() != 0)
            fail(PIPESHARD_ERR_PACK, path + ": a mixture-of-experts pack; this host runs dense packs only (yet)");
        if (document.has("host")) {
            const Json& host = document.at("host");
            if (host.has("min_onnxruntime")) manifest.min_onnxruntime = host.at("min_onnxruntime").str();
            if (host.has("chat_template") && !host.at("chat_template").is_null())
                manifest.chat_template_file = host.at("chat_template").str();
        }
        for (const Json& entry : document.at("sub_layers").items)
            manifest.sub_layers.push_back(read_sub_layer(entry, folder));
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
    plan.tier = static_cast<int>(chosen.at("tier").integer());
    for (const auto& [unit, placement] : chosen.at("placements").fields) {
        const std::string& where = placement.str();
        if (where != "cpu" && where != "pinned" && where != "streamed")
            throw JsonError("unknown placement '" + where + "' of " + unit);
        plan.placements[unit] = where;
    }
    if (chosen.has("slots")) plan.slots = static_cast<int>(chosen.at("slots").integer());
    if (chosen.has("prefetch")) plan.prefetch = chosen.at("prefetch").boolean;
    uint64_t total = 0;
    for (const auto& [part, bytes] : chosen.at("vram").fields)
        if (part != "total") total += static_cast<uint64_t>(bytes.integer());
    plan.vram_total = total;
    return plan;
}

}  // namespace

PlansFile read_plans(const std::string& path, const Manifest& manifest, std::vector<Unit>& units) {
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
        plans.context = document.at("context").integer();
        if (document.at("batch").integer() != 1)
            fail(PIPESHARD_ERR_PLANS, path + ": made for batches of " +
                                          std::to_string(document.at("batch").integer()) + "; this host runs one "
                                          "sequence (plan with --batch 1)");
        std::vector<const Json*> ladder;
        if (document.has("ladder") && document.at("ladder").size() != 0) {
            for (const Json& rung : document.at("ladder").items) ladder.push_back(&rung);
        } else {
            ladder.push_back(&document);
        }
        for (const Json* rung_json : ladder) {
            Rung rung;
            rung.budget_bytes = static_cast<uint64_t>(rung_json->at("budget_bytes").integer());
            for (const Json& tier : rung_json->at("tiers").items) {
                Plan plan = read_plan(tier.at("chosen"));
                rung.tiers[static_cast<int>(tier.at("tier").integer())] = plan;
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
