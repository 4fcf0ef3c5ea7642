// The step a host runs, as docs/plans.md ("How a step executes its tier's plan") and docs/native-host.md say:
// the tier's plan of the rung in force, its units in manifest order, each on the side its placement names, the
// KV bound in place, streamed weights through a ring of staging slots copied ahead of use.
#include "host.hpp"

#include <algorithm>
#include <map>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <numeric>
#include <sstream>
#include <thread>

#include "errors.hpp"
#include "joined.hpp"
#include "products.hpp"
#include "sha256.hpp"

#if defined(_WIN32)
#ifndef NOMINMAX
#define NOMINMAX
#endif
#include <windows.h>
#else
#include <fcntl.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#endif

extern "C" const void* pipeshard_decode_attention_op(void);  // runtime/_attention.c
extern "C" const void* pipeshard_weight_matmul_op(void);     // runtime/_matmul.c
extern "C" const void* pipeshard_block_matmul_op(void);      // runtime/_matmul.c

namespace pipeshard {

namespace {
constexpr uint64_t kJoinedBytes = 64ull << 20;  // weights per joined decode session, as the Python engine's chain
constexpr int kMaxThreads = 1024;  // more intra-op threads than any client CPU has: a typing mistake
constexpr int kAllCpuPrefillChunk = 64;  // prompt tokens per step without plans: cancel acts between steps
constexpr int kMaxSessionsPerStep = 16;  // the most sequences one KV cache holds
// Streamed experts are copied once their router has run, two in flight per layer (formats/plans.py's EXPERT_SLOTS);
// their copies' events come after every ring slot's (a plan has at most 64 slots).
constexpr int kExpertSlots = 2;
constexpr int kFirstExpertEvent = 64;
// A VLM's tensors: the vision blocks' first input and last output, which the decoder's embed sub-layer reads.
constexpr const char* kPixelValues = "pixel_values";
constexpr const char* kImageFeatures = "image_features";

const OrtApi* g_api = nullptr;

const OrtApi& ort() { return *g_api; }

void check(OrtStatus* status) {
    if (!status) return;
    std::string message = ort().GetErrorMessage(status);
    ort().ReleaseStatus(status);
    fail(PIPESHARD_ERR_RUNTIME, "ONNX Runtime: " + message);
}

// One ONNX Runtime environment per process (ONNX Runtime allows one), shared by every host and released with the
// last: its global intra-op pool serves every session, as pipeshard's own C-API chain does.
std::mutex g_env_mutex;
OrtEnv* g_env = nullptr;
// The `pipeshard` op domain: DecodeAttention, WeightMatMul and BlockMatMul (null: the compiler built no ops).
OrtCustomOpDomain* g_custom_ops = nullptr;
int g_env_users = 0;

struct ElementType {
    ONNXTensorElementDataType type;
    size_t bytes;
};

ElementType element_type(const std::string& dtype) {
    static const std::map<std::string, ONNXTensorElementDataType> types = {
        {"float32", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT},   {"float16", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16},
        {"bfloat16", ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16}, {"int64", ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64},
        {"int32", ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32},     {"bool", ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL},
        {"uint8", ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8},     {"int8", ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8}};
    auto found = types.find(dtype);
    if (found == types.end()) fail(PIPESHARD_ERR_PACK, "unsupported dtype '" + dtype + "' in manifest.json");
    return {found->second, static_cast<size_t>(dtype_bytes(dtype))};
}

float half_to_float(uint16_t h) {
    uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    uint32_t bits;
    if (exponent == 0) {
        if (mantissa == 0) {
            bits = sign;
        } else {
            exponent = 127 - 15 + 1;
            while (!(mantissa & 0x400)) { mantissa <<= 1; --exponent; }
            bits = sign | (exponent << 23) | ((mantissa & 0x3FF) << 13);
        }
    } else if (exponent == 31) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else {
        bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
    }
    float out;
    std::memcpy(&out, &bits, 4);
    return out;
}

std::vector<int> version_numbers(const std::string& version) {
    std::vector<int> numbers;
    std::stringstream in(version);
    std::string part;
    while (std::getline(in, part, '.')) numbers.push_back(std::atoi(part.c_str()));
    return numbers;
}

// A path as ONNX Runtime takes it: UTF-16 on Windows, the bytes elsewhere.
std::basic_string<ORTCHAR_T> ort_path(const std::string& path) {
#if defined(_WIN32)
    int length = MultiByteToWideChar(CP_UTF8, 0, path.c_str(), -1, nullptr, 0);
    std::wstring wide(static_cast<size_t>(length > 0 ? length - 1 : 0), L'\0');
    if (length > 1) MultiByteToWideChar(CP_UTF8, 0, path.c_str(), -1, &wide[0], length);
    return wide;
#else
    return path;
#endif
}

double seconds_since(std::chrono::steady_clock::time_point start) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

const std::string& input_dtype_of(const SubLayer& sub, const std::string& name) {
    for (const TensorSpec& input : sub.inputs)
        if (input.name == name) return input.dtype;
    fail(PIPESHARD_ERR_PACK, sub.name + ": no input " + name);
}

bool ends_incomplete(const std::string& text) {
    return text.size() >= 3 && text.compare(text.size() - 3, 3, "\xEF\xBF\xBD") == 0;
}

}  // namespace

// A weight blob mapped read-only: CPU chunks bind their rows from it, device units copy from it.
class MappedFile {
public:
    explicit MappedFile(const std::string& path) {
#if defined(_WIN32)
        file_ = CreateFileA(path.c_str(), GENERIC_READ, FILE_SHARE_READ, nullptr, OPEN_EXISTING, 0, nullptr);
        if (file_ == INVALID_HANDLE_VALUE) fail(PIPESHARD_ERR_PACK, path + ": cannot be opened");
        LARGE_INTEGER size;
        GetFileSizeEx(file_, &size);
        size_ = static_cast<size_t>(size.QuadPart);
        mapping_ = CreateFileMappingA(file_, nullptr, PAGE_READONLY, 0, 0, nullptr);
        data_ = mapping_ ? static_cast<uint8_t*>(MapViewOfFile(mapping_, FILE_MAP_READ, 0, 0, 0)) : nullptr;
        if (!data_) fail(PIPESHARD_ERR_PACK, path + ": cannot be mapped");
#else
        int fd = open(path.c_str(), O_RDONLY);
        if (fd < 0) fail(PIPESHARD_ERR_PACK, path + ": cannot be opened");
        struct stat info {};
        fstat(fd, &info);
        size_ = static_cast<size_t>(info.st_size);
        void* data = size_ ? mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0) : nullptr;
        close(fd);
        if (data == MAP_FAILED) fail(PIPESHARD_ERR_PACK, path + ": cannot be mapped");
        data_ = static_cast<uint8_t*>(data);
#endif
    }
    ~MappedFile() {
#if defined(_WIN32)
        if (data_) UnmapViewOfFile(data_);
        if (mapping_) CloseHandle(mapping_);
        if (file_ != INVALID_HANDLE_VALUE) CloseHandle(file_);
#else
        if (data_) munmap(data_, size_);
#endif
    }
    const uint8_t* data() const { return data_; }
    size_t size() const { return size_; }
    // Lets go of the pages read so far (sessions have packed what they multiply); the next read maps them again.
    void release_pages() const {
#if !defined(_WIN32)
        if (data_) madvise(data_, size_, MADV_DONTNEED);
#endif
    }

private:
    uint8_t* data_ = nullptr;
    size_t size_ = 0;
#if defined(_WIN32)
    HANDLE file_ = INVALID_HANDLE_VALUE, mapping_ = nullptr;
#endif
};

Host::Host(const std::string& pack_dir, const pipeshard_options& options) {
    if (!g_api) {
        g_api = OrtGetApiBase()->GetApi(ORT_API_VERSION);
        if (!g_api)
            fail(PIPESHARD_ERR_RUNTIME, std::string("the ONNX Runtime library (") + OrtGetApiBase()->GetVersionString() +
                                            ") is older than the API version " + std::to_string(ORT_API_VERSION) +
                                            " this host was built with");
    }
    manifest_ = read_manifest(pack_dir);
    std::string version = OrtGetApiBase()->GetVersionString();
    if (!manifest_.min_onnxruntime.empty() && version_numbers(version) < version_numbers(manifest_.min_onnxruntime))
        fail(PIPESHARD_ERR_PACK, pack_dir + " needs ONNX Runtime " + manifest_.min_onnxruntime + " or newer; this "
                                 "process has " + version);
    for (const SubLayer& sub : manifest_.sub_layers) {
        for (const TensorSpec& output : sub.outputs)
            if (output.name == "logits") logits_dtype_ = output.dtype;
        for (const TensorSpec& input : sub.inputs) {
            // DecodeAttention reads a float32 cache of whole 8-float lanes per head.
            bool past = std::find(sub.past.begin(), sub.past.end(), input.name) != sub.past.end();
            const Json* head = past && input.shape.is_array() && !input.shape.items.empty() ? &input.shape.items.back()
                                                                                            : nullptr;
            if (input.dtype == "float32" && (!past || (head && head->is_number() && head->integer() % 8 == 0)))
                float_inputs_.insert(input.name);
        }
    }

    has_plans_ = options.plans_path != nullptr && options.plans_path[0] != '\0';
    device_kind_ = options.device && options.device[0] ? options.device : (has_plans_ ? "cuda" : "cpu");
    if (device_kind_ != "cpu" && device_kind_ != "sim" && device_kind_ != "cuda")
        fail(PIPESHARD_ERR_ARGUMENT, "unknown device '" + device_kind_ + "' (cpu, sim or cuda)");
    if (has_plans_ && device_kind_ == "cpu")
        fail(PIPESHARD_ERR_ARGUMENT, "a plans file places units on a device: give the device sim or cuda");
    if (!has_plans_ && device_kind_ != "cpu")
        fail(PIPESHARD_ERR_ARGUMENT, "device " + device_kind_ + " needs a plans file (`pipeshard plan PACK --vram "
                                     "SIZES --out plans.json`)");
    if (options.threads < 0 || options.threads > kMaxThreads)
        fail(PIPESHARD_ERR_ARGUMENT, "threads must be from 0 (all cores) to " + std::to_string(kMaxThreads));
    if (options.context < 0) fail(PIPESHARD_ERR_ARGUMENT, "context must be >= 0");
    if (options.budget_mode != PIPESHARD_BUDGET_FIXED && options.budget_mode != PIPESHARD_BUDGET_AUTO)
        fail(PIPESHARD_ERR_ARGUMENT, "budget_mode must be PIPESHARD_BUDGET_FIXED (0) or PIPESHARD_BUDGET_AUTO (1)");
    if (options.prefill_chunk_tokens < 0) fail(PIPESHARD_ERR_ARGUMENT, "prefill_chunk_tokens must be >= 0");
    if (options.sessions_per_step < 0 || options.sessions_per_step > kMaxSessionsPerStep)
        fail(PIPESHARD_ERR_ARGUMENT, "sessions_per_step must be from 0 (one) to " + std::to_string(kMaxSessionsPerStep));
    sequences_ = static_cast<size_t>(std::max(1, options.sessions_per_step));
    owner_.assign(sequences_, nullptr);
    last_used_.assign(sequences_, 0);
    try {
        manifest_sha256_ = sha256_file(manifest_.folder + "/manifest.json");
    } catch (const std::runtime_error& error) {
        fail(PIPESHARD_ERR_PACK, error.what());
    }

    for (const MoeBlock& block : manifest_.moe_blocks)
        for (const SubLayer& sub : manifest_.sub_layers)
            if (sub.name == block.router)
                for (const TensorSpec& output : sub.outputs)
                    if ((output.name == block.hidden || output.name == block.routing) && output.dtype != "float32")
                        fail(PIPESHARD_ERR_PACK, block.router + "'s " + output.name + " is " + output.dtype +
                                                     ": this host combines float32 experts only");
    moe_outputs_.resize(manifest_.moe_blocks.size());

    if (has_plans_) {
        plans_ = read_plans(options.plans_path, manifest_, static_cast<int64_t>(sequences_), units_);
        if (options.context > plans_.context)
            fail(PIPESHARD_ERR_PLANS, std::string(options.plans_path) + " was made for a context of " +
                                          std::to_string(plans_.context) + " tokens, less than the " +
                                          std::to_string(options.context) + " asked for");
        capacity_ = options.context ? options.context : plans_.context;
        // The floor of every ladder: a 0-byte rung with the smallest rung's tiers, every unit on the CPU.
        if (plans_.rungs.back().budget_bytes > 0) {
            Rung floor;
            floor.all_cpu = true;
            for (const auto& entry : plans_.rungs.back().tiers) {
                Plan plan;
                plan.strategy = "all-cpu";
                plan.tier = entry.first;
                plan.prefetch = false;
                for (const Unit& unit : units_) plan.placements[unit.name] = "cpu";
                floor.tiers[entry.first] = plan;
            }
            plans_.rungs.push_back(floor);
        }
        budget_bytes_ = options.vram_budget_bytes ? options.vram_budget_bytes : plans_.rungs.front().budget_bytes;
        if (options.budget_mode == PIPESHARD_BUDGET_AUTO) {
            // Until the device or the game says what is free, nothing is.
            auto_budget_ = true;
            reserve_bytes_ = options.vram_reserve_bytes;
            budget_bytes_ = 0;
        }
        rung_ = rung_for(budget_bytes_);
        pending_budget_ = budget_bytes_;
        int slots = 0;
        for (const Rung& rung : plans_.rungs)
            for (const auto& entry : rung.tiers) slots = std::max(slots, entry.second.slots);
        try {
            load_env(options.threads);
            device_ = make_device(device_kind_, g_api, slots);
        } catch (const HostError&) {
            throw;
        } catch (const std::exception& error) {
            fail(PIPESHARD_ERR_DEVICE, error.what());
        }
    } else {
        units_ = planning_units(manifest_, 1);
        capacity_ = options.context ? options.context : std::min<int64_t>(4096, manifest_.max_context);
        load_env(options.threads);
    }
    int largest = largest_tier();
    prefill_chunk_ = options.prefill_chunk_tokens ? options.prefill_chunk_tokens : largest ? largest : kAllCpuPrefillChunk;
    if (largest) prefill_chunk_ = std::min(prefill_chunk_, largest);
    if (capacity_ > manifest_.max_context)
        fail(PIPESHARD_ERR_ARGUMENT, "context " + std::to_string(capacity_) + " is beyond the model's " +
                                         std::to_string(manifest_.max_context) + " tokens");
    check(ort().CreateCpuMemoryInfo(OrtArenaAllocator, OrtMemTypeDefault, &cpu_memory_));
    check(ort().CreateRunOptions(&run_options_));
    for (const auto* list : {&manifest_.sub_layers, &manifest_.vision.sub_layers})
        for (const SubLayer& sub : *list)
            if (!sub.blob_file.empty() && !blobs_.count(sub.blob_file))
                blobs_[sub.blob_file] = std::make_unique<MappedFile>(pack_dir + "/" + sub.blob_file);
    allocate_kv();
    // An output layer planned as row chunks runs whole when every chunk is on the CPU: a unit for that.
    for (size_t u = 0; u < units_.size() && whole_output_unit_ == SIZE_MAX; ++u)
        if (units_[u].chunk) {
            whole_output_unit_ = units_.size();
            units_.push_back({manifest_.sub_layers[units_[u].sub_layer].name, units_[u].sub_layer, false, 0, 0});
        }
    // Sessions of units some plan runs on the CPU are made now (first use would stall a step); device ones when a
    // plan that needs them is activated.
    for (size_t u = 0; u < units_.size(); ++u) {
        const Unit& unit = units_[u];
        if (unit.chunk) continue;
        bool on_cpu = !has_plans_ || host_only(manifest_.sub_layers[unit.sub_layer]) || u == whole_output_unit_;
        for (const Rung& rung : plans_.rungs)
            for (const auto& entry : rung.tiers) {
                if (rung.all_cpu) continue;  // made when a budget first drops that low
                auto placed = entry.second.placements.find(unit.name);
                on_cpu |= placed != entry.second.placements.end() && placed->second == "cpu";
            }
        if (on_cpu) session_for({u, "cpu", -1});
    }
    load_text(options.extensions_library);
    load_vision();
}

Host::~Host() {
    try {
        deactivate();
    } catch (...) {
    }
    clear_values();
    for (auto& entry : kv_)
        for (auto& views : entry.second.host_views)
            for (auto& view : views) ort().ReleaseValue(view.second);
    // Sessions first, then the options that registered the extensions library, then the environment: ONNX Runtime
    // 1.29 crashes at exit in any other order.
    for (auto& entry : bindings_) ort().ReleaseIoBinding(entry.second);
    std::vector<OrtSession*> sessions;
    for (auto* table : {&cpu_sessions_, &host_input_sessions_, &device_sessions_, &vision_sessions_})
        for (auto& entry : *table) sessions.push_back(entry.second);
    std::sort(sessions.begin(), sessions.end());
    sessions.erase(std::unique(sessions.begin(), sessions.end()), sessions.end());
    for (auto& entry : decode_pieces_)
        for (Piece& piece : entry.second)
            if (piece.session) sessions.push_back(piece.session);
    for (OrtSession* session : sessions) ort().ReleaseSession(session);
    for (OrtValue* value : initializer_values_) ort().ReleaseValue(value);
    if (prepacked_) ort().ReleasePrepackedWeightsContainer(prepacked_);
    if (tokenizer_) ort().ReleaseSession(tokenizer_);
    if (detokenizer_) ort().ReleaseSession(detokenizer_);
    for (OrtSessionOptions* options : session_options_) ort().ReleaseSessionOptions(options);
    if (tokenizer_options_) ort().ReleaseSessionOptions(tokenizer_options_);
    device_.reset();
    if (run_options_) ort().ReleaseRunOptions(run_options_);
    if (cpu_memory_) ort().ReleaseMemoryInfo(cpu_memory_);
    if (env_) {
        std::lock_guard<std::mutex> lock(g_env_mutex);
        if (--g_env_users == 0) {
            ort().ReleaseEnv(g_env);
            g_env = nullptr;
            if (g_custom_ops) ort().ReleaseCustomOpDomain(g_custom_ops);
            g_custom_ops = nullptr;
        }
    }
}

void Host::load_env(int threads) {
    std::lock_guard<std::mutex> lock(g_env_mutex);
    if (!g_env) {
        OrtThreadingOptions* threading = nullptr;
        check(ort().CreateThreadingOptions(&threading));
        int count = threads ? threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
        OrtStatus* status = ort().SetGlobalIntraOpNumThreads(threading, count);
        if (!status) status = ort().SetGlobalInterOpNumThreads(threading, 1);
        if (!status) status = ort().SetGlobalSpinControl(threading, 1);
        if (!status) status = ort().CreateEnvWithGlobalThreadPools(ORT_LOGGING_LEVEL_ERROR, "pipeshard-host", threading,
                                                                   &g_env);
        ort().ReleaseThreadingOptions(threading);
        check(status);
        // One CPU arena for every session of the process, as the Python engine's chain has: each joined or
        // sub-layer session reuses the buffers the one before it touched instead of growing an arena of its own.
        OrtMemoryInfo* arena_memory = nullptr;
        OrtArenaCfg* arena = nullptr;
        check(ort().CreateCpuMemoryInfo(OrtArenaAllocator, OrtMemTypeDefault, &arena_memory));
        status = ort().CreateArenaCfg(0, -1, -1, -1, &arena);
        if (!status) status = ort().CreateAndRegisterAllocator(g_env, arena_memory, arena);
        if (arena) ort().ReleaseArenaCfg(arena);
        ort().ReleaseMemoryInfo(arena_memory);
        check(status);
        if (pipeshard_decode_attention_op() && pipeshard_block_matmul_op()) {
            check(ort().CreateCustomOpDomain(kCustomDomain, &g_custom_ops));
            for (const void* op :
                 {pipeshard_decode_attention_op(), pipeshard_weight_matmul_op(), pipeshard_block_matmul_op()})
                check(ort().CustomOpDomain_Add(g_custom_ops, static_cast<const OrtCustomOp*>(op)));
        }
    }
    ++g_env_users;
    env_ = g_env;
}

OrtSession* Host::make_session(const std::string& file, bool on_device, const std::vector<const SubLayer*>& weights_of,
                               const std::string* model) {
    OrtSessionOptions* options = nullptr;
    check(ort().CreateSessionOptions(&options));
    session_options_.push_back(options);
    check(ort().SetSessionGraphOptimizationLevel(options, ORT_ENABLE_ALL));
    check(ort().SetSessionExecutionMode(options, ORT_SEQUENTIAL));
    // A memory pattern is traced per set of input shapes, and the context grows every step (docs/cli.md).
    check(ort().DisableMemPattern(options));
    check(ort().DisablePerSessionThreads(options));
    check(ort().SetSessionLogSeverityLevel(options, 3));
    check(ort().AddSessionConfigEntry(options, "session.use_env_allocators", "1"));
    if (on_device) {
        try {
            device_->add_provider(options);
        } catch (const std::exception& error) {
            fail(PIPESHARD_ERR_DEVICE, error.what());
        }
    }
    std::set<std::string> added;
    for (const SubLayer* sub : weights_of)
        for (const WeightSpec& weight : sub->weights) {
            if (!added.insert(weight.name).second) continue;
            OrtValue* value = tensor(cpu_memory_, const_cast<uint8_t*>(mapped(weight.file) + weight.offset),
                                     weight.bytes, weight.shape, weight.dtype);
            initializer_values_.push_back(value);
            check(ort().AddInitializer(options, weight.name.c_str(), value));
        }
    if (!prepacked_) check(ort().CreatePrepackedWeightsContainer(&prepacked_));
    OrtSession* session = nullptr;
    if (model) {
        check(ort().AddSessionConfigEntry(options, "session.model_external_initializers_file_folder_path",
                                          manifest_.folder.c_str()));
        if (g_custom_ops) check(ort().AddCustomOpDomain(options, g_custom_ops));
        check(ort().CreateSessionFromArrayWithPrepackedWeightsContainer(env_, model->data(), model->size(), options,
                                                                         prepacked_, &session));
    } else {
        std::string path = manifest_.folder + "/" + file;
        check(ort().CreateSessionWithPrepackedWeightsContainer(env_, ort_path(path).c_str(), options, prepacked_,
                                                               &session));
    }
    if (!weights_of.empty()) release_weight_pages();  // each session's, so the load peaks at one session's pages
    return session;
}

// A sub-layer's CPU session: its file, or where it has products the ops compute (src/products.hpp), its graph
// with them swapped, as the Python engine's CPU sessions are.
OrtSession* Host::make_cpu_session(const SubLayer& sub) {
    if (g_custom_ops && std::any_of(sub.weights.begin(), sub.weights.end(), product_weight)) {
        std::set<std::string> outputs, weights;
        for (const TensorSpec& output : sub.outputs) outputs.insert(output.name);
        for (const WeightSpec& weight : sub.weights)
            if (product_weight(weight)) weights.insert(weight.name);
        JoinedModel swapped;
        try {
            swapped = join_models({manifest_.folder + "/" + sub.onnx_file}, outputs, nullptr, &weights);
        } catch (const std::runtime_error& error) {
            fail(PIPESHARD_ERR_PACK, error.what());
        }
        if (swapped.product_nodes) {
            cpu_product_nodes_[sub.name] = swapped.product_nodes;
            return make_session(sub.name, false, {&sub}, &swapped.model);
        }
    }
    return make_session(sub.onnx_file, false, {&sub});
}

OrtSession* Host::session_for(const Run& run) {
    const Unit& unit = units_[run.unit];
    const SubLayer& sub = manifest_.sub_layers[unit.sub_layer];
    if (run.placement == "cpu" && !unit.chunk) {
        auto& session = cpu_sessions_[unit.sub_layer];
        if (!session) session = make_cpu_session(sub);
        return session;
    }
    bool on_device = run.placement != "cpu" && device_kind_ == "cuda";
    auto& table = on_device ? device_sessions_ : host_input_sessions_;
    auto& session = table[unit.sub_layer];
    if (!session) session = make_session(sub.inputs_file, on_device);
    return session;
}

OrtIoBinding* Host::binding_for(OrtSession* session) {
    auto& binding = bindings_[session];
    if (!binding) check(ort().CreateIoBinding(session, &binding));
    return binding;
}

void Host::load_text(const char* extensions_library) {
    std::string folder = manifest_.folder;
    std::string config_path = folder + "/generation_config.json";
    try {
        if (FILE* probe = std::fopen(config_path.c_str(), "rb")) {
            std::fclose(probe);
            Json config = Json::parse(read_file(config_path));
            if (config.has("eos_token_id")) {
                const Json& eos = config.at("eos_token_id");
                if (eos.is_array()) {
                    for (const Json& id : eos.items) eos_ids_.push_back(id.integer());
                } else if (eos.is_number()) {
                    eos_ids_.push_back(eos.integer());
                }
            }
        }
        if (!manifest_.chat_template_file.empty()) {
            chat_template_ = Json::parse(read_file(folder + "/" + manifest_.chat_template_file));
            if (chat_template_.at("schema_version").integer() != 1)
                fail(PIPESHARD_ERR_PACK, folder + "/" + manifest_.chat_template_file + ": unsupported schema_version");
            chat_template_.at("user").at("before").str();
            chat_template_.at("system_user").at("between").str();
            has_chat_template_ = true;
        }
    } catch (const JsonError& error) {
        fail(PIPESHARD_ERR_PACK, folder + ": " + error.what());
    } catch (const std::runtime_error& error) {
        if (dynamic_cast<const HostError*>(&error)) throw;
        fail(PIPESHARD_ERR_PACK, error.what());
    }
    if (!extensions_library || !extensions_library[0]) return;
    check(ort().CreateSessionOptions(&tokenizer_options_));
    check(ort().DisablePerSessionThreads(tokenizer_options_));
    check(ort().SetSessionLogSeverityLevel(tokenizer_options_, 3));
    OrtStatus* status = ort().RegisterCustomOpsLibrary_V2(tokenizer_options_, ort_path(extensions_library).c_str());
    if (status) {
        std::string message = ort().GetErrorMessage(status);
        ort().ReleaseStatus(status);
        fail(PIPESHARD_ERR_ARGUMENT, std::string("the extensions library ") + extensions_library +
                                         " cannot be loaded (" + message + ")");
    }
    for (auto [file, session] : {std::pair<const char*, OrtSession**>{"tokenizer.onnx", &tokenizer_},
                                 std::pair<const char*, OrtSession**>{"detokenizer.onnx", &detokenizer_}}) {
        std::string path = folder + "/" + file;
        status = ort().CreateSession(env_, ort_path(path).c_str(), tokenizer_options_, session);
        if (status) {
            std::string message = ort().GetErrorMessage(status);
            ort().ReleaseStatus(status);
            fail(PIPESHARD_ERR_PACK, path + " cannot be loaded (" + message + ")");
        }
    }
    // The tokenizer config's eos token, as pipeshard's TextCodec adds it to generation_config's.
    try {
        Json config = Json::parse(read_file(folder + "/tokenizer_config.json"));
        if (config.has("eos_token") && config.at("eos_token").is_string()) {
            std::vector<int64_t> ids = tokenize(config.at("eos_token").str());
            if (ids.size() == 1) eos_ids_.push_back(ids[0]);
        }
    } catch (const JsonError&) {
    } catch (const std::runtime_error& error) {
        if (dynamic_cast<const HostError*>(&error)) throw;
    }
    std::sort(eos_ids_.begin(), eos_ids_.end());
    eos_ids_.erase(std::unique(eos_ids_.begin(), eos_ids_.end()), eos_ids_.end());
}

void Host::load_vision() {
    for (const SubLayer& sub : manifest_.sub_layers)
        for (const TensorSpec& input : sub.inputs) {
            if (input.name != kImageFeatures) continue;
            const Json* width = input.shape.items.size() == 2 ? &input.shape.items[1] : nullptr;
            if (!width || !width->is_number() || width->integer() < 1)
                fail(PIPESHARD_ERR_PACK, sub.name + " reads image_features of no fixed width");
            takes_features_ = true;
            features_dtype_ = input.dtype;
            features_width_ = width->integer();
        }
    if (!manifest_.has_vision) return;
    if (!takes_features_)
        fail(PIPESHARD_ERR_PACK, manifest_.folder + " has a vision tower but no sub-layer reads image_features");
    try {
        image_config_ = std::make_unique<ImageConfig>(ImageConfig::from(manifest_.vision.preprocessing));
    } catch (const HostError& error) {
        if (error.status != PIPESHARD_ERR_ARGUMENT) throw;
        image_refusal_ = error.what();  // text prompts still run; images are refused with this line
    }
}

void Host::allocate_kv() {
    for (size_t index = 0; index < manifest_.sub_layers.size(); ++index) {
        const SubLayer& sub = manifest_.sub_layers[index];
        if (sub.past.empty()) continue;
        KvCache& cache = kv_[index];
        for (const std::string& past : sub.past) {
            const TensorSpec* spec = nullptr;
            for (const TensorSpec& input : sub.inputs)
                if (input.name == past) spec = &input;
            if (!spec) fail(PIPESHARD_ERR_PACK, sub.name + ": its past " + past + " is not among its inputs");
            std::vector<int64_t> shape;  // one sequence's
            size_t sequence_axis = 0;
            for (const Json& dim : spec->shape.items) {
                bool positions = !dim.is_number() && dim.str() != "batch";
                if (positions) sequence_axis = shape.size();
                shape.push_back(dim.is_number() ? dim.integer() : positions ? capacity_ : 1);
            }
            if (shape.empty() || shape[0] != 1 || sequence_axis == 0)
                fail(PIPESHARD_ERR_PACK, sub.name + ": its past " + past + " is not [batch, heads, positions, size]");
            size_t bytes = element_type(spec->dtype).bytes;
            for (int64_t dim : shape) bytes *= static_cast<size_t>(dim);
            size_t rows = 1, position_bytes = element_type(spec->dtype).bytes;
            for (size_t axis = 0; axis < shape.size(); ++axis) {
                if (axis < sequence_axis) rows *= static_cast<size_t>(shape[axis]);
                if (axis > sequence_axis) position_bytes *= static_cast<size_t>(shape[axis]);
            }
            size_t position = cache.rows.size();
            kv_names_[past] = {index, position};
            if (position < sub.present.size()) kv_names_[sub.present[position]] = {index, position};
            cache.rows.push_back(rows);
            cache.position_bytes.push_back(position_bytes);
            cache.shape.push_back(shape);
            cache.dtype.push_back(spec->dtype);
            cache.host.emplace_back(bytes * sequences_, 0);
            cache.host_views.emplace_back();
            cache.device_views.emplace_back();
        }
    }
}

OrtValue* Host::kv_value(const std::string& name) {
    const auto& [sub_layer, index] = kv_names_.at(name);
    KvCache& cache = kv_.at(sub_layer);
    auto& views = cache.on_device ? cache.device_views[index] : cache.host_views[index];
    auto& view = views[{step_first_, step_count_}];
    if (!view) {
        std::vector<int64_t> shape = cache.shape[index];
        size_t sequence_bytes = cache.host[index].size() / sequences_;
        uint8_t* base = cache.on_device ? static_cast<uint8_t*>(cache.device[index]) : cache.host[index].data();
        shape[0] = static_cast<int64_t>(step_count_);
        view = tensor(cache.on_device ? device_->memory_info() : cpu_memory_, base + step_first_ * sequence_bytes,
                      step_count_ * sequence_bytes, shape, cache.dtype[index]);
    }
    return view;
}

// ---- Plans, rungs and device memory ----------------------------------------------------------------------------

int Host::rung_for(uint64_t budget_bytes) const {
    for (size_t index = 0; index < plans_.rungs.size(); ++index)  // largest first
        if (plans_.rungs[index].budget_bytes <= budget_bytes) return static_cast<int>(index);
    return -1;
}

const std::map<int, Plan>* Host::tier_plans() const {
    return has_plans_ ? &plans_.rungs[static_cast<size_t>(rung_)].tiers : nullptr;
}

int Host::largest_tier() const {
    const auto* tiers = tier_plans();
    return tiers ? tiers->rbegin()->first : 0;
}

const Plan* Host::plan_for(int64_t tokens, int* tier) const {
    const auto* tiers = tier_plans();
    if (!tiers) {
        *tier = 0;
        return nullptr;
    }
    auto found = tiers->lower_bound(static_cast<int>(tokens));
    if (found == tiers->end()) --found;
    *tier = found->first;
    return &found->second;
}

void* Host::device_allocate(uint64_t bytes, const std::string& purpose) {
    if (device_bytes_ + bytes > budget_bytes_)
        fail(PIPESHARD_ERR_BUDGET, purpose + " (" + std::to_string(bytes) + " bytes) does not fit the VRAM budget of " +
                                       std::to_string(budget_bytes_) + " bytes with " +
                                       std::to_string(device_bytes_) + " in use");
    void* buffer = nullptr;
    try {
        buffer = device_->allocate(bytes);
    } catch (const std::exception& error) {
        fail(PIPESHARD_ERR_DEVICE, error.what());
    }
    device_allocations_[buffer] = bytes;
    device_bytes_ += bytes;
    peak_device_bytes_ = std::max<uint64_t>(peak_device_bytes_, device_bytes_);
    return buffer;
}

void Host::device_release(void* buffer) {
    auto found = device_allocations_.find(buffer);
    if (found == device_allocations_.end()) return;
    device_bytes_ -= found->second;
    device_allocations_.erase(found);
    device_->release(buffer);
}

const uint8_t* Host::mapped(const std::string& file) const {
    auto found = blobs_.find(file);
    if (found == blobs_.end()) fail(PIPESHARD_ERR_PACK, "weights of " + file + " are not in the pack");
    return found->second->data();
}

uint64_t Host::unit_size(const Unit& unit) const {
    const SubLayer& sub = manifest_.sub_layers[unit.sub_layer];
    if (!unit.chunk) return sub.blob_bytes;
    return static_cast<uint64_t>(unit.row_stop - unit.row_start) * sub.row_chunks.row_bytes;
}

std::pair<std::string, uint64_t> Host::unit_bytes(const Unit& unit) const {
    const SubLayer& sub = manifest_.sub_layers[unit.sub_layer];
    if (!unit.chunk) return {sub.blob_file, 0};
    for (const WeightSpec& weight : sub.weights)
        if (weight.name == sub.row_chunks.weight)
            return {weight.file, weight.offset + static_cast<uint64_t>(unit.row_start) * sub.row_chunks.row_bytes};
    fail(PIPESHARD_ERR_PACK, sub.name + ": its row_chunks weight is not among its weights");
}

void Host::start_copy(int streamed_index, int slot) {
    const Unit& unit = units_[runs_[streamed_[static_cast<size_t>(streamed_index)]].unit];
    auto [file, offset] = unit_bytes(unit);
    uint64_t bytes = unit_size(unit);
    device_->upload(slots_[static_cast<size_t>(slot)], mapped(file) + offset, bytes, slot);
    slot_holds_[static_cast<size_t>(slot)] = streamed_index;
    streamed_weight_bytes_ += bytes;
}

void Host::deactivate() {
    if (!active_) return;
    device_->drain();
    for (auto& [index, cache] : kv_) {
        if (!cache.on_device) continue;
        for (size_t i = 0; i < cache.device.size(); ++i) {
            device_->download(cache.host[i].data(), cache.device[i], cache.host[i].size());
            for (auto& view : cache.device_views[i]) ort().ReleaseValue(view.second);
            cache.device_views[i].clear();
            device_release(cache.device[i]);
        }
        cache.device.clear();
        cache.on_device = false;
    }
    for (auto& entry : pinned_) device_release(entry.second);
    pinned_.clear();
    for (void* slot : slots_) device_release(slot);
    slots_.clear();
    for (void* slot : expert_slots_) device_release(slot);
    expert_slots_.clear();
    slot_holds_.clear();
    runs_.clear();
    streamed_.clear();
    active_ = nullptr;
}

// Make `plan` the one on the device: what the old plan held goes first (so device memory never passes the
// budget), then the KV of device-run attentions moves in, pinned units are uploaded, the ring is allocated and
// its first copies start.
void Host::activate(const Plan* plan) {
    deactivate();
    ++plan_switches_;
    std::map<size_t, std::vector<size_t>> chunks_of;  // sub-layer -> its chunk units
    for (size_t u = 0; u < units_.size(); ++u)
        if (units_[u].chunk) chunks_of[units_[u].sub_layer].push_back(u);
    for (size_t u = 0; u < units_.size(); ++u) {
        if (u == whole_output_unit_) continue;
        const Unit& unit = units_[u];
        const SubLayer& sub = manifest_.sub_layers[unit.sub_layer];
        std::string placement = host_only(sub) ? "cpu" : plan->placements.at(unit.name);
        if (unit.chunk) {
            bool any_on_device = false;
            for (size_t c : chunks_of[unit.sub_layer])
                any_on_device |= plan->placements.at(units_[c].name) != "cpu";
            if (!any_on_device) {
                // Every chunk on the CPU: the whole output layer's session runs once, for the first chunk's unit.
                if (u == chunks_of[unit.sub_layer].front()) runs_.push_back({whole_output_unit_, "cpu", -1});
                continue;
            }
        }
        Run run{u, placement, -1};
        if (placement == "streamed" && sub.kind != "expert") {
            run.streamed_index = static_cast<int>(streamed_.size());
            streamed_.push_back(runs_.size());
        }
        if (placement != "cpu" && !unit.chunk) {
            for (const WeightSpec& weight : sub.weights)
                if (weight.file != sub.blob_file)
                    fail(PIPESHARD_ERR_PACK, sub.name + " reads " + weight.name + " from another unit's blob (" +
                                                 weight.file + "); this host places such units on the CPU only");
        }
        runs_.push_back(run);
    }
    active_ = plan;
    for (const Run& run : runs_) {
        const Unit& unit = units_[run.unit];
        if (run.placement == "cpu") {
            session_for(run);
            continue;
        }
        session_for(run);
        if (run.placement == "pinned") {
            auto [file, offset] = unit_bytes(unit);
            uint64_t bytes = unit_size(unit);
            void* buffer = device_allocate(bytes, "pinned weights of " + unit.name);
            device_->upload(buffer, mapped(file) + offset, bytes, -1);
            pinned_[run.unit] = buffer;
        }
        auto cache = kv_.find(unit.sub_layer);
        if (cache != kv_.end() && !cache->second.on_device) {
            KvCache& kv = cache->second;
            const SubLayer& sub = manifest_.sub_layers[unit.sub_layer];
            for (size_t i = 0; i < kv.host.size(); ++i) {
                void* buffer = device_allocate(kv.host[i].size(), "the KV cache of " + sub.name);
                device_->upload(buffer, kv.host[i].data(), kv.host[i].size(), -1);
                kv.device.push_back(buffer);
            }
            kv.on_device = true;
        }
    }
    if (!streamed_.empty()) {
        int slots = std::max(1, plan->slots);
        slot_bytes_ = 0;
        for (size_t run_index : streamed_) slot_bytes_ = std::max(slot_bytes_, unit_size(units_[runs_[run_index].unit]));
        for (int slot = 0; slot < slots; ++slot) slots_.push_back(device_allocate(slot_bytes_, "a staging slot"));
        slot_holds_.assign(slots_.size(), -1);
        if (plan->prefetch)
            for (int k = 0; k < static_cast<int>(std::min(slots_.size(), streamed_.size())); ++k) start_copy(k, k);
    }
    uint64_t expert_slot_bytes = 0;
    for (const Run& run : runs_)
        if (run.placement == "streamed" && run.streamed_index < 0)
            expert_slot_bytes = std::max(expert_slot_bytes, unit_size(units_[run.unit]));
    if (expert_slot_bytes)
        for (int slot = 0; slot < kExpertSlots; ++slot)
            expert_slots_.push_back(device_allocate(expert_slot_bytes, "an expert staging slot"));
}

// The AUTO budget: the device's free memory (the game's figure when it gave one) plus what this host holds, minus
// the reserve; the budget in force when no figure is known.
uint64_t Host::auto_budget() const {
    uint64_t free_bytes = 0;
    if (has_game_free_) {
        free_bytes = game_free_bytes_;
    } else if (!device_->free_memory(&free_bytes)) {
        return budget_bytes_;
    }
    uint64_t usable = free_bytes + device_bytes_, reserve = reserve_bytes_;
    return usable > reserve ? usable - reserve : 0;
}

void Host::apply_pending_budget() {
    if (release_requested_.exchange(false)) release_device();
    if (!has_plans_) return;
    uint64_t budget = auto_budget_ ? auto_budget() : pending_budget_.load();
    if (budget == budget_bytes_) return;
    int rung = rung_for(budget);  // the all-CPU rung fits every budget
    if (rung != rung_) deactivate();
    rung_ = rung;
    budget_bytes_ = budget;
}

void Host::set_vram_budget(uint64_t budget_bytes) {
    if (!has_plans_)
        fail(PIPESHARD_ERR_ARGUMENT, "this host runs every unit on the CPU: open it with a plans file (a budget "
                                     "ladder) to change budgets");
    pending_budget_ = budget_bytes;
    auto_budget_ = false;
}

void Host::set_auto_budget(uint64_t reserve_bytes) {
    if (!has_plans_)
        fail(PIPESHARD_ERR_ARGUMENT, "this host runs every unit on the CPU: open it with a plans file (a budget "
                                     "ladder) to follow the free device memory");
    reserve_bytes_ = reserve_bytes;
    auto_budget_ = true;
}

void Host::set_free_vram(uint64_t free_bytes) {
    game_free_bytes_ = free_bytes;
    has_game_free_ = true;
}

// Free every device buffer and the device sessions (ONNX Runtime's device arenas with them); the KV comes home.
void Host::release_device() {
    deactivate();
    for (auto entry = device_sessions_.begin(); entry != device_sessions_.end();) {
        auto binding = bindings_.find(entry->second);
        if (binding != bindings_.end()) {
            ort().ReleaseIoBinding(binding->second);
            bindings_.erase(binding);
        }
        ort().ReleaseSession(entry->second);
        entry = device_sessions_.erase(entry);
    }
}

void Host::apply_release() {
    std::lock_guard<std::mutex> lock(report_mutex_);
    if (release_requested_.exchange(false)) release_device();
}

void Host::apply_budget() {
    std::lock_guard<std::mutex> lock(report_mutex_);
    apply_pending_budget();
}

// After a step stopped part way (cancelled): the ring's copies restart from the first streamed unit.
void Host::restart_ring() {
    if (!active_ || streamed_.empty()) return;
    device_->drain();
    slot_holds_.assign(slots_.size(), -1);
    if (active_->prefetch)
        for (int k = 0; k < static_cast<int>(std::min(slots_.size(), streamed_.size())); ++k) start_copy(k, k);
}

void Host::warmup() {
    int64_t token = 0;
    feed(sequence_for(nullptr, {}), &token, 1, 0, nullptr);
}

// ---- The step --------------------------------------------------------------------------------------------------

OrtValue* Host::tensor(const OrtMemoryInfo* memory, void* data, size_t bytes, const std::vector<int64_t>& shape,
                       const std::string& dtype) {
    OrtValue* value = nullptr;
    check(ort().CreateTensorWithDataAsOrtValue(memory, data, bytes, shape.data(), shape.size(),
                                               element_type(dtype).type, &value));
    return value;
}

void Host::set_value(const std::string& name, OrtValue* value) {
    auto found = values_.find(name);
    if (found != values_.end()) ort().ReleaseValue(found->second);
    values_[name] = value;
}

void Host::clear_values() {
    for (auto& entry : values_) ort().ReleaseValue(entry.second);
    values_.clear();
}

// The tokens in steps of at most prefill_chunk_ (the largest tier with plans), each a forward of its own; a
// conversation holds each step's tokens once the step has run.
void Host::feed(size_t sequence, const int64_t* ids, int64_t tokens, int64_t past, Conversation* conversation) {
    for (int64_t begin = 0; begin < tokens; begin += prefill_chunk_) {
        int64_t count = std::min<int64_t>(prefill_chunk_, tokens - begin);
        forward({sequence}, ids + begin, count, {past + begin});
        if (conversation) conversation->cached.insert(conversation->cached.end(), ids + begin, ids + begin + count);
    }
}

void Host::forward(const std::vector<size_t>& sequences, const int64_t* ids, int64_t tokens,
                   const std::vector<int64_t>& pasts) {
    if (cancel_requested()) fail(PIPESHARD_ERR_CANCELLED, "cancelled");
    // A shared step runs the cache's first sequences up to the last one fed: one that no turn feeds now gets a
    // placeholder token just past its cells (written where its next token goes, so nothing it holds changes; a full
    // sequence gives up its last cell instead, fed again at its session's next turn).
    int64_t batch = 1;
    std::vector<int64_t> lengths(1, pasts.at(0));
    if (sequences.size() == 1) {
        step_first_ = sequences[0];
        input_ids_.assign(ids, ids + tokens);
    } else {
        step_first_ = 0;
        batch = static_cast<int64_t>(*std::max_element(sequences.begin(), sequences.end())) + 1;
        lengths.assign(static_cast<size_t>(batch), 0);
        input_ids_.assign(static_cast<size_t>(batch), 0);
        for (size_t s = 0; s < static_cast<size_t>(batch); ++s)
            if (owner_[s]) {
                std::vector<int64_t>& cached = owner_[s]->cached;
                if (static_cast<int64_t>(cached.size()) >= capacity_) cached.resize(static_cast<size_t>(capacity_ - 1));
                lengths[s] = static_cast<int64_t>(cached.size());
            }
        for (size_t k = 0; k < sequences.size(); ++k) {
            lengths[sequences[k]] = pasts[k];
            input_ids_[sequences[k]] = ids[k];
        }
    }
    step_count_ = static_cast<size_t>(batch);
    live_rows_.assign(static_cast<size_t>(batch * tokens), sequences.size() == 1);
    for (size_t sequence : sequences)
        if (sequences.size() > 1) live_rows_[sequence] = 1;
    for (size_t sequence : sequences) last_used_[sequence] = ++uses_;
    {
        // What report() reads changes here, under its lock; the units then run without it, so a report from
        // another thread never waits for a whole step.
        std::lock_guard<std::mutex> lock(report_mutex_);
        apply_pending_budget();
        int tier = 0;
        const Plan* plan = plan_for(batch * tokens, &tier);
        if (!plan) {
            if (!active_ && runs_.empty()) {
                for (size_t u = 0; u < units_.size(); ++u) runs_.push_back({u, "cpu", -1});
            }
        } else if (plan != active_) {
            activate(plan);
        }
        ++steps_;
        ++tier_steps_[tier];
        if (sequences.size() > 1) ++shared_steps_;
    }
    // Each row's mask covers its cells and its new tokens (the rest of a shorter row's is zeros).
    int64_t total = *std::max_element(lengths.begin(), lengths.end()) + tokens;
    attention_mask_.assign(static_cast<size_t>(batch * total), 0);
    position_ids_.resize(static_cast<size_t>(batch * tokens));
    for (size_t b = 0; b < static_cast<size_t>(batch); ++b) {
        std::fill_n(attention_mask_.begin() + static_cast<std::ptrdiff_t>(b * static_cast<size_t>(total)),
                    lengths[b] + tokens, 1);
        std::iota(position_ids_.begin() + static_cast<std::ptrdiff_t>(b * static_cast<size_t>(tokens)),
                  position_ids_.begin() + static_cast<std::ptrdiff_t>((b + 1) * static_cast<size_t>(tokens)), lengths[b]);
    }
    clear_values();
    set_value("input_ids", tensor(cpu_memory_, input_ids_.data(), input_ids_.size() * 8, {batch, tokens}, "int64"));
    set_value("attention_mask", tensor(cpu_memory_, attention_mask_.data(), attention_mask_.size() * 8,
                                       {batch, total}, "int64"));
    set_value("position_ids", tensor(cpu_memory_, position_ids_.data(), position_ids_.size() * 8, {batch, tokens},
                                     "int64"));
    set_image_features(input_ids_.data(), batch * tokens);
    size_t logit_bytes = static_cast<size_t>(batch * manifest_.vocab_size) * element_type(logits_dtype_).bytes;
    logits_bytes_.resize(logit_bytes);
    try {
        if (tokens == 1) {
            const std::vector<Piece>& pieces = decode_pieces();
            uint64_t swapped = 0;
            for (const Piece& piece : pieces) swapped += static_cast<uint64_t>(piece.decode_attention_nodes);
            decode_runs_ = pieces.size();
            decode_attention_nodes_ = swapped;
            decode_product_nodes_ = decode_products(pieces);
            for (const Piece& piece : pieces) {
                if (cancel_requested()) {
                    restart_ring();
                    fail(PIPESHARD_ERR_CANCELLED, "cancelled");
                }
                if (is_expert(piece.first_run)) continue;  // run by its router's block
                run_unit(runs_[piece.first_run], tokens, piece.session, piece.session ? &piece.spec : nullptr);
                size_t block = 0;
                if (const MoeBlock* moe = moe_block_after(piece.first_run + piece.run_count - 1, &block))
                    run_experts(*moe, block, tokens);
            }
        } else {
            for (size_t index = 0; index < runs_.size(); ++index) {
                if (cancel_requested()) {
                    restart_ring();
                    fail(PIPESHARD_ERR_CANCELLED, "cancelled");
                }
                if (is_expert(index)) continue;
                run_unit(runs_[index], tokens);
                size_t block = 0;
                if (const MoeBlock* moe = moe_block_after(index, &block)) run_experts(*moe, block, tokens);
            }
        }
    } catch (const HostError& error) {
        if (error.status == PIPESHARD_ERR_CANCELLED) throw;
        deactivate_after_failure();
        throw;
    } catch (...) {
        deactivate_after_failure();
        throw;
    }
}

// The products the decode step's sessions compute with pipeshard's ops: its joined sessions' and its CPU runs'.
uint64_t Host::decode_products(const std::vector<Piece>& pieces) const {
    uint64_t count = 0;
    for (const Piece& piece : pieces) {
        if (piece.session) {
            count += static_cast<uint64_t>(piece.product_nodes);
            continue;
        }
        for (size_t index = piece.first_run; index < piece.first_run + piece.run_count; ++index) {
            if (runs_[index].placement != "cpu" || units_[runs_[index].unit].chunk) continue;
            const std::string& name = manifest_.sub_layers[units_[runs_[index].unit].sub_layer].name;
            auto found = cpu_product_nodes_.find(name);
            if (found != cpu_product_nodes_.end()) count += static_cast<uint64_t>(found->second);
        }
    }
    return count;
}

// The decode step's pieces for the runs in force, made on the first decode step of each plan: stretches of CPU runs
// (cut at kJoinedBytes of weights) joined, and the attention of any run the CPU EP computes swapped for
// DecodeAttention.
const std::vector<Piece>& Host::decode_pieces() {
    auto found = decode_pieces_.find(active_);
    if (found != decode_pieces_.end()) return found->second;
    std::vector<Piece> pieces;
    for (size_t first = 0; first < runs_.size();) {
        // A MoE layer's experts run by themselves, and a stretch ends with a router (its experts run next).
        auto joinable = [&](size_t index) {
            return runs_[index].placement == "cpu" && !units_[runs_[index].unit].chunk && !is_expert(index);
        };
        size_t count = 1;
        uint64_t bytes = unit_size(units_[runs_[first].unit]);
        size_t ignored = 0;
        while (joinable(first) && first + count < runs_.size() && joinable(first + count) &&
               !moe_block_after(first + count - 1, &ignored)) {
            uint64_t more = unit_size(units_[runs_[first + count].unit]);
            if (bytes + more > kJoinedBytes) break;
            bytes += more;
            ++count;
        }
        pieces.push_back(make_piece(first, count));
        first += count;
    }
    return decode_pieces_[active_] = std::move(pieces);
}

Piece Host::make_piece(size_t first_run, size_t run_count) {
    Piece piece;
    piece.first_run = first_run;
    piece.run_count = run_count;
    const Run& run = runs_[first_run];
    bool on_cpu = run.placement == "cpu" && !units_[run.unit].chunk;
    // A device the CPU EP computes for (sim) runs the weights-as-inputs file; a CUDA session keeps its attention.
    if (!on_cpu && (device_kind_ != "sim" || units_[run.unit].chunk)) return piece;
    std::vector<size_t> members;
    std::vector<std::string> paths;
    for (size_t i = first_run; i < first_run + run_count; ++i) {
        const SubLayer& sub = manifest_.sub_layers[units_[runs_[i].unit].sub_layer];
        members.push_back(units_[runs_[i].unit].sub_layer);
        paths.push_back(manifest_.folder + "/" + (on_cpu ? sub.onnx_file : sub.inputs_file));
    }
    // Kept as outputs: what a later sub-layer (or a MoE combine: the residual) reads, the logits, the present KV.
    std::set<std::string> outputs, read_outside;
    for (const MoeBlock& block : manifest_.moe_blocks) read_outside.insert(block.residual);
    for (size_t index = 0; index < manifest_.sub_layers.size(); ++index)
        if (std::find(members.begin(), members.end(), index) == members.end())
            for (const TensorSpec& input : manifest_.sub_layers[index].inputs) read_outside.insert(input.name);
    for (size_t index : members) {
        const SubLayer& sub = manifest_.sub_layers[index];
        for (const TensorSpec& output : sub.outputs)
            if (read_outside.count(output.name) || output.name == "logits" ||
                std::find(sub.present.begin(), sub.present.end(), output.name) != sub.present.end())
                outputs.insert(output.name);
    }
    std::set<std::string> product_weights;
    if (on_cpu && g_custom_ops)
        for (size_t index : members)
            for (const WeightSpec& weight : manifest_.sub_layers[index].weights)
                if (product_weight(weight)) product_weights.insert(weight.name);
    JoinedModel joined;
    try {
        joined = join_models(paths, outputs, g_custom_ops ? &float_inputs_ : nullptr,
                             product_weights.empty() ? nullptr : &product_weights);
    } catch (const std::runtime_error& error) {
        fail(PIPESHARD_ERR_PACK, error.what());
    }
    if (run_count == 1 && joined.decode_attention_nodes == 0) return piece;  // the run's own session
    piece.decode_attention_nodes = joined.decode_attention_nodes;
    piece.product_nodes = joined.product_nodes;
    SubLayer& spec = piece.spec;
    const SubLayer& first = manifest_.sub_layers[members.front()];
    if (run_count == 1) {
        spec = first;
    } else {
        spec.name = first.name + ".." + manifest_.sub_layers[members.back()].name;
        spec.kind = manifest_.sub_layers[members.back()].kind == "final" ? "final" : "joined";
        auto find_spec = [&](const std::string& name, bool input) -> const TensorSpec& {
            for (size_t index : members)
                for (const TensorSpec& tensor : input ? manifest_.sub_layers[index].inputs
                                                      : manifest_.sub_layers[index].outputs)
                    if (tensor.name == name) return tensor;
            fail(PIPESHARD_ERR_PACK, spec.name + ": no sub-layer has " + name);
        };
        for (const std::string& name : joined.inputs) spec.inputs.push_back(find_spec(name, true));
        for (const std::string& name : joined.outputs) spec.outputs.push_back(find_spec(name, false));
        for (size_t index : members) {
            const SubLayer& sub = manifest_.sub_layers[index];
            spec.past.insert(spec.past.end(), sub.past.begin(), sub.past.end());
            spec.present.insert(spec.present.end(), sub.present.begin(), sub.present.end());
        }
    }
    std::vector<const SubLayer*> weights_of;
    if (on_cpu)
        for (size_t index : members) weights_of.push_back(&manifest_.sub_layers[index]);
    piece.session = make_session(spec.name, false, weights_of, &joined.model);
    return piece;
}

const MoeBlock* Host::moe_block_after(size_t run, size_t* index) const {
    const std::string& name = manifest_.sub_layers[units_[runs_[run].unit].sub_layer].name;
    for (size_t i = 0; i < manifest_.moe_blocks.size(); ++i)
        if (manifest_.moe_blocks[i].router == name) {
            *index = i;
            return &manifest_.moe_blocks[i];
        }
    return nullptr;
}

bool Host::is_expert(size_t run) const {
    if (manifest_.moe_blocks.empty()) return false;
    const std::string& name = manifest_.sub_layers[units_[runs_[run].unit].sub_layer].name;
    for (const MoeBlock& block : manifest_.moe_blocks)
        if (std::find(block.experts.begin(), block.experts.end(), name) != block.experts.end()) return true;
    return false;
}

// As runtime/moe.py's chosen_experts and combine: each expert with a nonzero routing weight runs once over its
// tokens' rows (hidden [1, n, H], routing [1, n, E]); their outputs are added in expert order, then the residual.
void Host::run_experts(const MoeBlock& block, size_t block_index, int64_t tokens) {
    auto floats = [&](const std::string& name, size_t count) {
        auto found = values_.find(name);
        if (found == values_.end())
            fail(PIPESHARD_ERR_PACK, "the MoE block of " + block.router + " reads " + name + ", which no run produced");
        void* data = nullptr;
        check(ort().GetTensorMutableData(found->second, &data));
        OrtTensorTypeAndShapeInfo* info = nullptr;
        check(ort().GetTensorTypeAndShape(found->second, &info));
        size_t elements = 0;
        OrtStatus* status = ort().GetTensorShapeElementCount(info, &elements);
        ort().ReleaseTensorTypeAndShapeInfo(info);
        check(status);
        if (elements != count)
            fail(PIPESHARD_ERR_PACK,
                 name + " holds " + std::to_string(elements) + " values, not " + std::to_string(count));
        return static_cast<const float*>(data);
    };
    size_t experts = block.experts.size(), width = static_cast<size_t>(manifest_.hidden_size);
    size_t rows = step_count_ * static_cast<size_t>(tokens);
    const float* hidden = floats(block.hidden, rows * width);
    const float* routing = floats(block.routing, rows * experts);
    const float* residual = floats(block.residual, rows * width);
    std::vector<float>& total = moe_outputs_[block_index];
    total.assign(rows * width, 0.0f);
    // The hidden and routing values stay in values_ while experts read row subsets under the same names.
    OrtValue* whole_hidden = values_.at(block.hidden);
    OrtValue* whole_routing = values_.at(block.routing);
    values_.erase(block.hidden);
    values_.erase(block.routing);
    struct Restore {
        Host& host;
        const MoeBlock& block;
        OrtValue *hidden, *routing;
        ~Restore() {
            host.set_value(block.hidden, hidden);
            host.set_value(block.routing, routing);
        }
    } restore{*this, block, whole_hidden, whole_routing};
    // Each chosen expert's rows and run, in the order they run (pinned, CPU, streamed; expert order within each).
    struct Chosen {
        size_t expert, run;
        std::vector<size_t> rows;
    };
    auto run_order = [&](size_t run) {
        const std::string& placement = runs_[run].placement;
        return placement == "pinned" ? 0 : placement == "cpu" ? 1 : 2;
    };
    std::vector<Chosen> chosen;
    for (size_t expert = 0; expert < experts; ++expert) {
        Chosen pick{expert, runs_.size(), {}};
        for (size_t row = 0; row < rows; ++row)  // a placeholder row's experts do not run (it adds nothing)
            if (live_rows_[row] && routing[row * experts + expert] != 0.0f) pick.rows.push_back(row);
        if (pick.rows.empty()) continue;
        for (size_t index = 0; index < runs_.size(); ++index)
            if (manifest_.sub_layers[units_[runs_[index].unit].sub_layer].name == block.experts[expert]) pick.run = index;
        if (pick.run == runs_.size()) fail(PIPESHARD_ERR_PACK, block.experts[expert] + " is in no run");
        chosen.push_back(std::move(pick));
    }
    std::stable_sort(chosen.begin(), chosen.end(),
                     [&](const Chosen& a, const Chosen& b) { return run_order(a.run) < run_order(b.run); });
    std::vector<size_t> streamed;  // positions in `chosen`
    for (size_t i = 0; i < chosen.size(); ++i)
        if (run_order(chosen[i].run) == 2) streamed.push_back(i);
    for (size_t k = 0; k < std::min<size_t>(kExpertSlots, streamed.size()); ++k)
        start_expert_copy(runs_[chosen[streamed[k]].run], static_cast<int>(k));
    expert_results_.resize(experts);
    size_t streamed_run = 0;
    for (const Chosen& pick : chosen) {
        if (cancel_requested()) fail(PIPESHARD_ERR_CANCELLED, "cancelled");
        int64_t count = static_cast<int64_t>(pick.rows.size());
        expert_hidden_.resize(pick.rows.size() * width);
        expert_routing_.resize(pick.rows.size() * experts);
        for (size_t i = 0; i < pick.rows.size(); ++i) {
            std::copy_n(hidden + pick.rows[i] * width, width, expert_hidden_.begin() + i * width);
            std::copy_n(routing + pick.rows[i] * experts, experts, expert_routing_.begin() + i * experts);
        }
        set_value(block.hidden, tensor(cpu_memory_, expert_hidden_.data(), expert_hidden_.size() * 4,
                                       {1, count, static_cast<int64_t>(width)}, "float32"));
        set_value(block.routing, tensor(cpu_memory_, expert_routing_.data(), expert_routing_.size() * 4,
                                        {1, count, static_cast<int64_t>(experts)}, "float32"));
        const uint8_t* weights = nullptr;
        int slot = static_cast<int>(streamed_run % kExpertSlots);
        bool is_streamed = run_order(pick.run) == 2;
        if (is_streamed) {
            device_->wait(kFirstExpertEvent + slot);
            weights = static_cast<const uint8_t*>(expert_slots_.at(static_cast<size_t>(slot)));
        }
        run_unit(runs_[pick.run], count, nullptr, nullptr, weights);
        const float* output = floats(block.expert_outputs[pick.expert], pick.rows.size() * width);
        expert_results_[pick.expert].assign(output, output + pick.rows.size() * width);
        if (is_streamed && ++streamed_run + kExpertSlots - 1 < streamed.size())
            start_expert_copy(runs_[chosen[streamed[streamed_run + kExpertSlots - 1]].run], slot);
    }
    // Added in expert order, as the dense graph adds them.
    std::sort(chosen.begin(), chosen.end(), [](const Chosen& a, const Chosen& b) { return a.expert < b.expert; });
    for (const Chosen& pick : chosen) {
        const std::vector<float>& output = expert_results_[pick.expert];
        for (size_t i = 0; i < pick.rows.size(); ++i)
            for (size_t column = 0; column < width; ++column)
                total[pick.rows[i] * width + column] += output[i * width + column];
    }
    for (size_t i = 0; i < total.size(); ++i) total[i] = residual[i] + total[i];
    set_value(block.output, tensor(cpu_memory_, total.data(), total.size() * 4,
                                   {static_cast<int64_t>(step_count_), tokens, static_cast<int64_t>(width)}, "float32"));
}

void Host::start_expert_copy(const Run& run, int slot) {
    const Unit& unit = units_[run.unit];
    auto [file, offset] = unit_bytes(unit);
    uint64_t bytes = unit_size(unit);
    device_->upload(expert_slots_.at(static_cast<size_t>(slot)), mapped(file) + offset, bytes, kFirstExpertEvent + slot);
    streamed_weight_bytes_ += bytes;
}

void Host::release_weight_pages() {
    for (auto& entry : blobs_) entry.second->release_pages();
#if defined(__GLIBC__)
    malloc_trim(0);  // the copies ONNX Runtime made while packing weights the container already held
#endif
}

// Failed mid-step: the ring and the KV are in an unknown state; release the device (generate forgets the
// conversation's cells).
void Host::deactivate_after_failure() {
    std::lock_guard<std::mutex> lock(report_mutex_);
    try {
        deactivate();
    } catch (...) {
    }
}

void Host::run_unit(const Run& run, int64_t tokens, OrtSession* session, const SubLayer* spec,
                    const uint8_t* device_weights) {
    const Unit& unit = units_[run.unit];
    const SubLayer& sub = spec ? *spec : manifest_.sub_layers[unit.sub_layer];
    if (!session) session = session_for(run);
    OrtIoBinding* binding = binding_for(session);
    ort().ClearBoundInputs(binding);
    ort().ClearBoundOutputs(binding);
    std::vector<OrtValue*> temporaries;
    struct Release {
        std::vector<OrtValue*>& values;
        ~Release() {
            for (OrtValue* value : values) ort().ReleaseValue(value);
        }
    } release{temporaries};

    bool is_output_layer = sub.kind == "final";
    for (const TensorSpec& input : sub.inputs) {
        if (std::find(sub.past.begin(), sub.past.end(), input.name) != sub.past.end()) {
            check(ort().BindInput(binding, input.name.c_str(), kv_value(input.name)));
            continue;
        }
        auto found = values_.find(input.name);
        if (found == values_.end())
            fail(PIPESHARD_ERR_PACK, sub.name + " reads " + input.name + ", which no earlier sub-layer produced");
        OrtValue* value = found->second;
        if (is_output_layer && tokens > 1 && input.shape.size() == 3) {
            // The output layer of a multi-token step reads only the last position's hidden state.
            void* data = nullptr;
            check(ort().GetTensorMutableData(value, &data));
            size_t row = static_cast<size_t>(manifest_.hidden_size) * element_type(input.dtype).bytes;
            value = tensor(cpu_memory_, static_cast<uint8_t*>(data) + row * static_cast<size_t>(tokens - 1), row,
                           {1, 1, manifest_.hidden_size}, input.dtype);
            temporaries.push_back(value);
        }
        check(ort().BindInput(binding, input.name.c_str(), value));
    }
    bool weights_as_inputs = run.placement != "cpu" || unit.chunk;
    if (weights_as_inputs) {
        const uint8_t* device_bytes = device_weights;  // a streamed expert's staging slot, its copy waited for
        if (!device_bytes && run.placement == "pinned") {
            device_bytes = static_cast<const uint8_t*>(pinned_.at(run.unit));
        } else if (!device_bytes && run.placement == "streamed") {
            int slot = run.streamed_index % static_cast<int>(slots_.size());
            if (!active_->prefetch || slot_holds_[static_cast<size_t>(slot)] != run.streamed_index)
                start_copy(run.streamed_index, slot);
            device_->wait(slot);
            device_bytes = static_cast<const uint8_t*>(slots_[static_cast<size_t>(slot)]);
        }
        for (const WeightSpec& weight : sub.weights) {
            std::vector<int64_t> shape = weight.shape;
            const OrtMemoryInfo* memory = cpu_memory_;
            const uint8_t* data = nullptr;
            size_t bytes = weight.bytes;
            bool rows = unit.chunk && weight.name == sub.row_chunks.weight;
            if (rows) {
                shape[0] = unit.row_stop - unit.row_start;
                bytes = static_cast<size_t>(shape[0]) * sub.row_chunks.row_bytes;
            }
            if (device_bytes && (rows || !unit.chunk)) {
                memory = device_->memory_info();
                data = rows ? device_bytes : device_bytes + weight.offset;
            } else {
                data = mapped(weight.file) + weight.offset +
                       (rows ? static_cast<uint64_t>(unit.row_start) * sub.row_chunks.row_bytes : 0);
            }
            OrtValue* value = tensor(memory, const_cast<uint8_t*>(data), bytes, shape, weight.dtype);
            temporaries.push_back(value);
            check(ort().BindInput(binding, weight.name.c_str(), value));
        }
    }
    std::vector<std::string> handed_on;
    std::function<void()> spread_logits;
    for (const TensorSpec& output : sub.outputs) {
        if (std::find(sub.present.begin(), sub.present.end(), output.name) != sub.present.end()) {
            check(ort().BindOutput(binding, output.name.c_str(), kv_value(output.name)));
        } else if (output.name == "logits") {
            // A row chunk of a one-row step writes its columns in place; of several rows, its own block of them,
            // spread into the rows after the run.
            size_t element = element_type(output.dtype).bytes;
            int64_t start = unit.chunk ? unit.row_start : 0;
            int64_t width = unit.chunk ? unit.row_stop - unit.row_start : manifest_.vocab_size;
            int64_t batch = static_cast<int64_t>(step_count_);
            uint8_t* data = logits_bytes_.data() + static_cast<size_t>(start) * element;
            if (unit.chunk && batch > 1) {
                chunk_logits_.resize(static_cast<size_t>(batch * width) * element);
                data = chunk_logits_.data();
            }
            OrtValue* value = tensor(cpu_memory_, data, static_cast<size_t>(batch * width) * element, {batch, 1, width},
                                     output.dtype);
            temporaries.push_back(value);
            check(ort().BindOutput(binding, output.name.c_str(), value));
            if (unit.chunk && batch > 1)
                spread_logits = [this, start, width, batch, element] {
                    size_t row = static_cast<size_t>(manifest_.vocab_size) * element, part = static_cast<size_t>(width) * element;
                    for (int64_t b = 0; b < batch; ++b)
                        std::memcpy(logits_bytes_.data() + static_cast<size_t>(b) * row + static_cast<size_t>(start) * element,
                                    chunk_logits_.data() + static_cast<size_t>(b) * part, part);
                };
        } else {
            check(ort().BindOutputToDevice(binding, output.name.c_str(), cpu_memory_));
            handed_on.push_back(output.name);
        }
    }
    check(ort().RunWithBinding(session, run_options_, binding));
    if (spread_logits) spread_logits();
    if (run.streamed_index >= 0 && active_->prefetch && streamed_.size() > slots_.size()) {
        // The slot is free again: start the copy of the streamed unit `slots` places ahead (the next step's first
        // ones after the last).
        int slot = run.streamed_index % static_cast<int>(slots_.size());
        start_copy((run.streamed_index + static_cast<int>(slots_.size())) % static_cast<int>(streamed_.size()), slot);
    }
    OrtAllocator* allocator = nullptr;
    check(ort().GetAllocatorWithDefaultOptions(&allocator));
    OrtValue** outputs = nullptr;
    size_t count = 0;
    check(ort().GetBoundOutputValues(binding, allocator, &outputs, &count));
    // Outputs come back in the order they were bound: the present KV and logits first where bound earlier.
    size_t index = 0;
    for (const TensorSpec& output : sub.outputs) {
        if (index >= count) break;
        bool kept = std::find(handed_on.begin(), handed_on.end(), output.name) != handed_on.end();
        if (kept) {
            set_value(output.name, outputs[index]);
        } else {
            ort().ReleaseValue(outputs[index]);
        }
        ++index;
    }
    for (; index < count; ++index) ort().ReleaseValue(outputs[index]);
    check(ort().AllocatorFree(allocator, outputs));
}

void Host::read_logits(size_t row) {
    size_t vocab = static_cast<size_t>(manifest_.vocab_size);
    logits_.resize(vocab);
    if (logits_dtype_ == "float32") {
        std::memcpy(logits_.data(), logits_bytes_.data() + row * vocab * 4, vocab * 4);
    } else if (logits_dtype_ == "float16") {
        const uint16_t* half = reinterpret_cast<const uint16_t*>(logits_bytes_.data()) + row * vocab;
        for (size_t i = 0; i < vocab; ++i) logits_[i] = half_to_float(half[i]);
    } else {
        fail(PIPESHARD_ERR_PACK, "logits of dtype " + logits_dtype_ + " are not supported");
    }
}

// ---- Generation ------------------------------------------------------------------------------------------------

int64_t Host::choose(const Sampling& sampling, const std::vector<int64_t>& history, std::mt19937_64& rng) {
    if (sampling.temperature == 0.0f && sampling.repetition_penalty == 1.0f)  // greedy: no copy of the vocabulary
        return static_cast<int64_t>(std::max_element(logits_.begin(), logits_.end()) - logits_.begin());
    std::vector<double> scores(logits_.begin(), logits_.end());
    if (sampling.repetition_penalty != 1.0f) {
        std::vector<int64_t> seen(history);
        std::sort(seen.begin(), seen.end());
        seen.erase(std::unique(seen.begin(), seen.end()), seen.end());
        for (int64_t id : seen) {
            double& value = scores[static_cast<size_t>(id)];
            value = value > 0 ? value / sampling.repetition_penalty : value * sampling.repetition_penalty;
        }
    }
    if (sampling.temperature == 0.0f)
        return static_cast<int64_t>(std::max_element(scores.begin(), scores.end()) - scores.begin());
    for (double& value : scores) value /= sampling.temperature;
    if (sampling.top_k > 0 && static_cast<size_t>(sampling.top_k) < scores.size()) {
        std::vector<double> sorted(scores);
        std::nth_element(sorted.begin(), sorted.begin() + (sampling.top_k - 1), sorted.end(), std::greater<double>());
        double kth = sorted[static_cast<size_t>(sampling.top_k - 1)];
        for (double& value : scores)
            if (value < kth) value = -INFINITY;
    }
    double top = *std::max_element(scores.begin(), scores.end());
    std::vector<double> probabilities(scores.size());
    double sum = 0;
    for (size_t i = 0; i < scores.size(); ++i) sum += probabilities[i] = std::exp(scores[i] - top);
    for (double& p : probabilities) p /= sum;
    if (sampling.top_p < 1.0f) {
        std::vector<size_t> order(probabilities.size());
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return probabilities[a] > probabilities[b]; });
        double cumulative = 0;
        for (size_t i : order) {
            if (cumulative >= sampling.top_p) probabilities[i] = 0;
            cumulative += probabilities[i] > 0 ? probabilities[i] : 0;
        }
    }
    std::discrete_distribution<size_t> pick(probabilities.begin(), probabilities.end());
    return static_cast<int64_t>(pick(rng));
}

Sampling Sampling::from(const pipeshard_sampling& sampling) {
    if (sampling.max_new_tokens < 1) fail(PIPESHARD_ERR_ARGUMENT, "max_new_tokens must be at least 1");
    if (!(sampling.temperature >= 0 && sampling.temperature <= 100))
        fail(PIPESHARD_ERR_ARGUMENT, "temperature must be a number from 0 to 100");
    if (sampling.top_k < 0) fail(PIPESHARD_ERR_ARGUMENT, "top_k must be >= 0 (0 means off)");
    if (!(sampling.top_p > 0 && sampling.top_p <= 1)) fail(PIPESHARD_ERR_ARGUMENT, "top_p must be in (0, 1]");
    if (!(sampling.repetition_penalty > 0 && sampling.repetition_penalty <= 100))
        fail(PIPESHARD_ERR_ARGUMENT, "repetition_penalty must be in (0, 100]");
    if (sampling.stop_string_count && !sampling.stop_strings)
        fail(PIPESHARD_ERR_ARGUMENT, "stop_strings is NULL with a stop_string_count of " +
                                         std::to_string(sampling.stop_string_count));
    Sampling copy;
    copy.max_new_tokens = sampling.max_new_tokens;
    copy.temperature = sampling.temperature;
    copy.top_k = sampling.top_k;
    copy.top_p = sampling.top_p;
    copy.repetition_penalty = sampling.repetition_penalty;
    copy.seed = sampling.seed;
    copy.use_chat_template = sampling.use_chat_template != 0;
    copy.has_system = sampling.system_prompt != nullptr;
    if (copy.has_system) copy.system = sampling.system_prompt;
    for (size_t i = 0; i < sampling.stop_string_count; ++i) {
        if (!sampling.stop_strings[i] || !sampling.stop_strings[i][0])
            fail(PIPESHARD_ERR_ARGUMENT, "stop string " + std::to_string(i) + " is NULL or empty");
        copy.stop_strings.emplace_back(sampling.stop_strings[i]);
    }
    return copy;
}

std::vector<int64_t> Host::prompt_ids(const std::string& prompt, const Sampling& sampling) {
    std::string text = prompt;
    if (sampling.use_chat_template) {
        if (!has_chat_template_)
            fail(PIPESHARD_ERR_ARGUMENT, manifest_.folder + " has no pre-rendered chat template (chat_template.json): "
                                         "pass use_chat_template = 0 and a prompt in the model's own format");
        if (sampling.has_system) {
            const Json& form = chat_template_.at("system_user");
            text = form.at("before").str() + sampling.system + form.at("between").str() + text +
                   form.at("after").str();
        } else {
            const Json& form = chat_template_.at("user");
            text = form.at("before").str() + text + form.at("after").str();
        }
    }
    std::vector<int64_t> ids = tokenize(text);
    if (ids.empty()) fail(PIPESHARD_ERR_ARGUMENT, "the prompt is empty");
    return ids;
}

std::vector<int64_t> Host::tokenize(const std::string& text) {
    if (!tokenizer_)
        fail(PIPESHARD_ERR_ARGUMENT, "no tokenizer: open the host with extensions_library (libortextensions) and a "
                                     "pack with tokenizer.onnx");
    OrtAllocator* allocator = nullptr;
    check(ort().GetAllocatorWithDefaultOptions(&allocator));
    int64_t shape[] = {1};
    OrtValue* input = nullptr;
    check(ort().CreateTensorAsOrtValue(allocator, shape, 1, ONNX_TENSOR_ELEMENT_DATA_TYPE_STRING, &input));
    const char* strings[] = {text.c_str()};
    OrtValue* output = nullptr;
    OrtStatus* status = ort().FillStringTensor(input, strings, 1);
    const char* input_names[] = {"text"};
    const char* output_names[] = {"input_ids"};
    if (!status) status = ort().Run(tokenizer_, nullptr, input_names, &input, 1, output_names, 1, &output);
    ort().ReleaseValue(input);
    check(status);
    OrtTensorTypeAndShapeInfo* info = nullptr;
    std::vector<int64_t> ids;
    status = ort().GetTensorTypeAndShape(output, &info);
    if (!status) {
        size_t count = 0;
        status = ort().GetTensorShapeElementCount(info, &count);
        ort().ReleaseTensorTypeAndShapeInfo(info);
        int64_t* data = nullptr;
        if (!status) status = ort().GetTensorMutableData(output, reinterpret_cast<void**>(&data));
        if (!status) ids.assign(data, data + count);
    }
    ort().ReleaseValue(output);
    check(status);
    return ids;
}

std::string Host::detokenize(const std::vector<int64_t>& ids) {
    if (!detokenizer_)
        fail(PIPESHARD_ERR_ARGUMENT, "no detokenizer: open the host with extensions_library (libortextensions) and "
                                     "a pack with detokenizer.onnx");
    if (ids.empty()) return "";
    std::vector<int64_t> copy(ids);
    int64_t shape[] = {static_cast<int64_t>(copy.size())};
    OrtValue* input = tensor(cpu_memory_, copy.data(), copy.size() * 8, {shape[0]}, "int64");
    const char* input_names[] = {"ids"};
    const char* output_names[] = {"text"};
    OrtValue* output = nullptr;
    OrtStatus* status = ort().Run(detokenizer_, nullptr, input_names, &input, 1, output_names, 1, &output);
    ort().ReleaseValue(input);
    check(status);
    size_t length = 0;
    std::string text;
    status = ort().GetStringTensorDataLength(output, &length);
    if (!status) {
        text.resize(length);
        size_t offset = 0;
        status = ort().GetStringTensorContent(output, text.data(), length, &offset, 1);
    }
    ort().ReleaseValue(output);
    check(status);
    return text;
}

namespace {

// The text of a growing answer, decoded a few tokens at a time as streaming servers do: each step decodes the tokens
// from the last point where the text ended on a whole character, so a step's cost does not grow with the answer.
// Byte-level BPE text is its tokens' bytes joined, so the pieces add up to the whole answer's decoding.
struct IncrementalText {
    std::function<std::string(const std::vector<int64_t>&)> decode;
    std::string text;             // the decoding of tokens [0, read)
    std::string window;           // the decoding of tokens [prefix, read): the start of the next step's
    size_t prefix = 0, read = 0;

    void extend(const std::vector<int64_t>& tokens) {
        std::string now = decode(std::vector<int64_t>(tokens.begin() + prefix, tokens.end()));
        if (ends_incomplete(now) || now.size() <= window.size()) return;  // wait for the character's other bytes
        if (now.compare(0, window.size(), window) == 0) {
            window = now.substr(window.size());  // tokens [read, end): the next window
            text += window;
        } else {  // not a byte-level decoding: decode the whole answer, and the window anew
            text = decode(tokens);
            window = decode(std::vector<int64_t>(tokens.begin() + read, tokens.end()));
        }
        prefix = read;
        read = tokens.size();
    }
};

// Where the first stop string begins in `text` (npos: none), and how many bytes at its end could still begin one.
size_t stop_position(const std::string& text, const std::vector<std::string>& stops, size_t* held_back) {
    size_t first = std::string::npos;
    *held_back = 0;
    for (const std::string& stop : stops) {
        first = std::min(first, text.find(stop));
        for (size_t length = std::min(stop.size() - 1, text.size()); length > *held_back; --length)
            if (text.compare(text.size() - length, length, stop, 0, length) == 0) {
                *held_back = length;
                break;
            }
    }
    return first;
}

}  // namespace

// One request's answer in the making: its sequence of the cache, what it has fed, and what it has handed on.
struct Generation {
    std::vector<int64_t> prompt;
    Sampling sampling;
    TokenSink sink;
    Conversation* conversation = nullptr;
    const std::atomic<bool>* cancelled = nullptr;
    size_t sequence = 0;
    int64_t past = 0;  // the sequence's tokens in the cache
    int64_t next = -1;  // the token to feed next, once chosen
    std::mt19937_64 rng;
    std::vector<int64_t> history;
    Answer answer;
    std::string emitted;  // the text handed to the sink so far
    IncrementalText text;
    GenerationTimes times;
    std::chrono::steady_clock::time_point started, first_token_at;
};

std::unique_ptr<Generation> Host::begin(const std::vector<int64_t>& prompt, const Sampling& sampling,
                                        const TokenSink& sink, Conversation* conversation,
                                        const std::vector<size_t>& busy) {
    if (prompt.empty()) fail(PIPESHARD_ERR_ARGUMENT, "the prompt is empty");
    for (int64_t id : prompt)
        if (id < 0 || id >= manifest_.vocab_size)
            fail(PIPESHARD_ERR_ARGUMENT, "token id " + std::to_string(id) + " is outside the vocabulary of " +
                                             std::to_string(manifest_.vocab_size));
    if (static_cast<int64_t>(prompt.size()) + sampling.max_new_tokens > capacity_)
        fail(PIPESHARD_ERR_CONTEXT, "the prompt (" + std::to_string(prompt.size()) + " tokens) and max_new_tokens (" +
                                        std::to_string(sampling.max_new_tokens) + ") exceed the context of " +
                                        std::to_string(capacity_) + " tokens");
    if (!sampling.stop_strings.empty() && !detokenizer_)
        fail(PIPESHARD_ERR_ARGUMENT, "stop strings need the detokenizer: open the host with extensions_library");
    auto generation = std::make_unique<Generation>();
    Generation& g = *generation;
    g.prompt = prompt;
    g.sampling = sampling;
    g.sink = sink;
    g.conversation = conversation;
    g.sequence = sequence_for(conversation, busy);
    if (conversation) {  // the cells it holds of the prompt's first tokens (at least one token is fed)
        std::vector<int64_t>& cached = conversation->cached;
        while (g.past < static_cast<int64_t>(std::min(cached.size(), prompt.size() - 1)) &&
               cached[static_cast<size_t>(g.past)] == prompt[static_cast<size_t>(g.past)])
            ++g.past;
        cached.resize(static_cast<size_t>(g.past));
    }
    g.rng.seed(sampling.seed);
    g.history = prompt;
    g.text.decode = [this](const std::vector<int64_t>& ids) { return detokenize(ids); };
    g.times.prompt_tokens = prompt.size();
    g.times.stop_reason = "length";
    g.started = g.first_token_at = std::chrono::steady_clock::now();
    return generation;
}

// The next token from the logits just read: handed to the sink (its text held back while it could begin a stop
// string); false when the answer ends here (end of sequence, a stop string, the sink, max_new_tokens).
bool Host::take(Generation& g) {
    int64_t token = choose(g.sampling, g.history, g.rng);
    g.next = -1;
    if (g.answer.tokens.empty()) {
        g.first_token_at = std::chrono::steady_clock::now();
        g.times.prefill_s = seconds_since(g.started);
    }
    if (std::find(eos_ids_.begin(), eos_ids_.end(), token) != eos_ids_.end()) {
        g.times.stop_reason = "eos";
        return false;
    }
    g.answer.tokens.push_back(token);
    g.history.push_back(token);
    std::string piece;
    bool stopped = false;
    if (detokenizer_) {
        g.text.extend(g.answer.tokens);
        if (!ends_incomplete(g.text.text)) {
            size_t held_back = 0;
            size_t stop = stop_position(g.text.text, g.sampling.stop_strings, &held_back);
            stopped = stop != std::string::npos;
            size_t shown = stopped ? stop : g.text.text.size() - held_back;
            if (shown >= g.emitted.size() && g.text.text.compare(0, g.emitted.size(), g.emitted) == 0) {
                piece = g.text.text.substr(g.emitted.size(), shown - g.emitted.size());
                g.emitted = g.text.text.substr(0, shown);
            }
        }
    }
    g.times.generated_tokens = g.answer.tokens.size();
    if (g.sink && !g.sink(token, piece)) {
        g.times.stop_reason = "callback";
        return false;
    }
    if (stopped) {
        g.times.stop_reason = "stop";
        return false;
    }
    if (static_cast<int>(g.answer.tokens.size()) == g.sampling.max_new_tokens) return false;
    g.next = token;
    return true;
}

Answer Host::finish(Generation& g) {
    GenerationTimes& times = g.times;
    times.decode_s = seconds_since(g.first_token_at);
    if (!g.sampling.stop_strings.empty() && times.stop_reason != "stop" && times.stop_reason != "callback") {
        std::string text = detokenize(g.answer.tokens);  // what was held back while it could begin a stop string
        if (!ends_incomplete(text) && text.size() > g.emitted.size() && g.sink) g.sink(-1, text.substr(g.emitted.size()));
    }
    {
        std::lock_guard<std::mutex> lock(report_mutex_);
        last_ = times;
    }
    g.answer.text = g.emitted;
    if (detokenizer_ && times.stop_reason != "stop") g.answer.text = detokenize(g.answer.tokens);
    return std::move(g.answer);
}

// After a step failed other than by a cancel: the sequence's cells are in an unknown state, fed again next time.
void Host::forget_cells(Generation& g) {
    if (g.conversation) g.conversation->cached.clear();
}

Answer Host::generate(const std::vector<int64_t>& prompt, const Sampling& sampling, const TokenSink& sink,
                      Conversation* conversation) {
    std::unique_ptr<Generation> generation = begin(prompt, sampling, sink, conversation, {});
    Generation& g = *generation;
    try {
        feed(g.sequence, prompt.data() + g.past, static_cast<int64_t>(prompt.size()) - g.past, g.past, conversation);
        g.past = static_cast<int64_t>(prompt.size());
        read_logits(0);
        while (take(g)) {
            feed(g.sequence, &g.next, 1, g.past, conversation);
            ++g.past;
            ++g.times.decode_steps;
            read_logits(0);
        }
    } catch (const HostError& error) {
        if (error.status != PIPESHARD_ERR_CANCELLED) forget_cells(g);
        throw;
    } catch (...) {
        forget_cells(g);
        throw;
    }
    return finish(g);
}

// Several sessions' turns, each prefilled into its own sequence of the cache a chunk at a time, decoded together: one
// step feeds every turn's last token. Turns `more` gives join between steps while sequences are free; each ends on
// its own (its `ended` called on this thread), a cancel taking effect between steps.
void Host::run_turns(const std::vector<Turn*>& first, const std::function<std::vector<Turn*>(size_t)>& more) {
    struct Running {
        Turn* turn;
        std::unique_ptr<Generation> generation;
    };
    std::vector<Running> running;
    auto busy = [&] {
        std::vector<size_t> sequences;
        for (const Running& r : running) sequences.push_back(r.generation->sequence);
        return sequences;
    };
    auto end = [&](size_t index, pipeshard_status status, const std::string& message) {
        Running r = std::move(running[index]);
        running.erase(running.begin() + static_cast<std::ptrdiff_t>(index));
        Turn& turn = *r.turn;
        std::string said = message;
        if (status == PIPESHARD_OK) {
            status = guarded(said, [&] {
                Answer answer = finish(*r.generation);
                turn.conversation->turns.push_back({"user", turn.user});
                turn.conversation->turns.push_back({"assistant", answer.text});
                if (turn.answered) turn.answered(answer);
            });
        } else if (status != PIPESHARD_ERR_CANCELLED) {
            forget_cells(*r.generation);
        }
        turn.ended(status, said);
    };
    auto start = [&](Turn* turn) {
        if (turn->cancelled->load()) return turn->ended(PIPESHARD_ERR_CANCELLED, "cancelled before it started");
        std::string message;
        pipeshard_status status = guarded(message, [&] {
            std::vector<int64_t> ids = tokenize(render_chat(history_with(*turn->conversation, turn->user)));
            running.push_back({turn, begin(ids, turn->sampling, turn->sink, turn->conversation, busy())});
            running.back().generation->cancelled = turn->cancelled;
        });
        if (status != PIPESHARD_OK) turn->ended(status, message);
    };
    for (Turn* turn : first) start(turn);
    while (!running.empty()) {
        if (running.size() < sequences_)
            for (Turn* turn : more(sequences_ - running.size())) start(turn);
        for (size_t i = running.size(); i-- > 0;)
            if (running[i].turn->cancelled->load()) end(i, PIPESHARD_ERR_CANCELLED, "cancelled");
        // One prompt chunk of the first turn still prefilling; its first token once its prompt is in.
        for (size_t i = 0; i < running.size(); ++i) {
            Generation& g = *running[i].generation;
            int64_t left = static_cast<int64_t>(g.prompt.size()) - g.past;
            if (left <= 0) continue;  // prefilled (decoding since)
            std::string message;
            bool answered = false;
            set_cancel_flag(g.cancelled);
            pipeshard_status status = guarded(message, [&] {
                int64_t count = std::min<int64_t>(prefill_chunk_, left);
                feed(g.sequence, g.prompt.data() + g.past, count, g.past, g.conversation);
                g.past += count;
                if (g.past == static_cast<int64_t>(g.prompt.size())) {
                    read_logits(0);
                    answered = !take(g);
                }
            });
            set_cancel_flag(nullptr);
            if (status != PIPESHARD_OK || answered) end(i, status, message);
            break;
        }
        // One decode step over every turn with a token to feed.
        std::vector<size_t> sequences, indices;
        std::vector<int64_t> ids, pasts;
        for (size_t i = 0; i < running.size(); ++i) {
            const Generation& g = *running[i].generation;
            if (g.next < 0) continue;
            indices.push_back(i);
            sequences.push_back(g.sequence);
            ids.push_back(g.next);
            pasts.push_back(g.past);
        }
        if (indices.empty()) continue;
        std::string message;
        pipeshard_status status = guarded(message, [&] { forward(sequences, ids.data(), 1, pasts); });
        if (status != PIPESHARD_OK) {
            for (size_t k = indices.size(); k-- > 0;) end(indices[k], status, message);
            continue;
        }
        std::vector<std::pair<pipeshard_status, std::string>> endings(indices.size(), {PIPESHARD_OK, ""});
        std::vector<bool> ends(indices.size(), false);
        for (size_t k = 0; k < indices.size(); ++k) {
            Generation& g = *running[indices[k]].generation;
            g.conversation->cached.push_back(g.next);
            ++g.past;
            ++g.times.decode_steps;
            endings[k].first = guarded(endings[k].second, [&] {
                read_logits(step_row(g.sequence));
                ends[k] = !take(g);
            });
            ends[k] = ends[k] || endings[k].first != PIPESHARD_OK;  // a sink that threw ends its own turn only
        }
        for (size_t k = indices.size(); k-- > 0;)
            if (ends[k]) end(indices[k], endings[k].first, endings[k].second);
    }
}

// ---- Images ----------------------------------------------------------------------------------------------------

Answer Host::generate_with_images(const std::string& prompt, const std::vector<RgbImage>& images,
                                  const Sampling& sampling, const TokenSink& sink) {
    if (images.empty()) return generate(prompt_ids(prompt, sampling), sampling, sink);
    if (!manifest_.has_vision) fail(PIPESHARD_ERR_ARGUMENT, manifest_.folder + " is a text model: it takes no images");
    if (!image_config_) fail(PIPESHARD_ERR_ARGUMENT, image_refusal_);
    const ImageConfig& config = *image_config_;
    ImageInputs inputs = preprocess(images, config);
    std::string text = expand_image_tokens(with_placeholders(prompt, images.size(), config), inputs, config);
    std::vector<int64_t> ids = prompt_ids(text, sampling);
    int64_t runs = std::accumulate(inputs.image_tokens.begin(), inputs.image_tokens.end(), int64_t{0});
    int64_t tokenized = std::count(ids.begin(), ids.end(), manifest_.vision.image_token_id);
    if (tokenized != runs)
        fail(PIPESHARD_ERR_PACK, manifest_.folder + "/tokenizer.onnx made " + std::to_string(tokenized) + " image "
                                 "tokens of the " + std::to_string(runs) + " the images' token runs hold");
    if (static_cast<int64_t>(ids.size()) + sampling.max_new_tokens > capacity_)  // before the encode, not after
        fail(PIPESHARD_ERR_CONTEXT, "the prompt with its image tokens (" + std::to_string(ids.size()) +
                                        " tokens) and max_new_tokens (" + std::to_string(sampling.max_new_tokens) +
                                        ") exceed the context of " + std::to_string(capacity_) + " tokens");
    struct Forget {  // the features are this request's alone
        Host& host;
        ~Forget() {
            host.features_.clear();
            host.feature_rows_ = host.features_fed_ = 0;
        }
    } forget{*this};
    encode(inputs);
    return generate(ids, sampling, sink);
}

// The vision blocks in order over every tile at once, on the CPU (the Python engine's chain does the same): their
// last output is the features, one row per image token.
void Host::encode(const ImageInputs& inputs) {
    const std::vector<SubLayer>& blocks = manifest_.vision.sub_layers;
    if (input_dtype_of(blocks.front(), kPixelValues) != "float32")
        fail(PIPESHARD_ERR_PACK, "the vision graph takes " + input_dtype_of(blocks.front(), kPixelValues) +
                                     " pixels; this host feeds float32 (export the pack with fp32 weights)");
    std::map<std::string, OrtValue*> values;
    struct Release {
        std::map<std::string, OrtValue*>& values;
        ~Release() {
            for (auto& entry : values) ort().ReleaseValue(entry.second);
        }
    } release{values};
    values[kPixelValues] = tensor(cpu_memory_, const_cast<float*>(inputs.pixels.data()), inputs.pixels.size() * 4,
                                  {inputs.tiles, 3, inputs.size, inputs.size}, "float32");
    for (size_t index = 0; index < blocks.size(); ++index) {
        if (cancel_requested()) fail(PIPESHARD_ERR_CANCELLED, "cancelled");
        const SubLayer& block = blocks[index];
        OrtSession*& session = vision_sessions_[index];
        if (!session) session = make_session(block.onnx_file, false, {&block});
        std::vector<const char*> input_names, output_names;
        std::vector<OrtValue*> input_values;
        for (const TensorSpec& input : block.inputs) {
            auto found = values.find(input.name);
            if (found == values.end())
                fail(PIPESHARD_ERR_PACK, "vision block " + block.name + " reads " + input.name +
                                             ", which no earlier block produced");
            input_names.push_back(input.name.c_str());
            input_values.push_back(found->second);
        }
        for (const TensorSpec& output : block.outputs) output_names.push_back(output.name.c_str());
        std::vector<OrtValue*> outputs(output_names.size(), nullptr);
        check(ort().Run(session, run_options_, input_names.data(), input_values.data(), input_values.size(),
                        output_names.data(), output_names.size(), outputs.data()));
        for (size_t i = 0; i < outputs.size(); ++i) {
            OrtValue*& slot = values[block.outputs[i].name];
            if (slot) ort().ReleaseValue(slot);
            slot = outputs[i];
        }
    }
    auto found = values.find(kImageFeatures);
    if (found == values.end()) fail(PIPESHARD_ERR_PACK, "the last vision block gives no image_features");
    OrtTensorTypeAndShapeInfo* info = nullptr;
    check(ort().GetTensorTypeAndShape(found->second, &info));
    size_t rank = 0;
    ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    std::vector<int64_t> shape(2, 0);
    OrtStatus* status = ort().GetDimensionsCount(info, &rank);
    if (!status && rank == 2) status = ort().GetDimensions(info, shape.data(), 2);
    if (!status) status = ort().GetTensorElementType(info, &type);
    ort().ReleaseTensorTypeAndShapeInfo(info);
    check(status);
    int64_t rows = std::accumulate(inputs.image_tokens.begin(), inputs.image_tokens.end(), int64_t{0});
    if (rank != 2 || shape[0] != rows || shape[1] != features_width_ || type != element_type(features_dtype_).type)
        fail(PIPESHARD_ERR_PACK, "the vision blocks gave image_features of " + std::to_string(shape[0]) + " x " +
                                     std::to_string(shape[1]) + " for " + std::to_string(rows) + " image tokens of " +
                                     std::to_string(features_width_) + " " + features_dtype_ + " values each");
    void* data = nullptr;
    check(ort().GetTensorMutableData(found->second, &data));
    size_t bytes = static_cast<size_t>(rows * features_width_) * element_type(features_dtype_).bytes;
    features_.assign(static_cast<uint8_t*>(data), static_cast<uint8_t*>(data) + bytes);
    feature_rows_ = static_cast<size_t>(rows);
    features_fed_ = 0;
    release_weight_pages();
}

// The step's rows of image features: as many as its image tokens, in the order the prompt's come (0 rows on steps
// without them, decode steps included).
void Host::set_image_features(const int64_t* ids, int64_t tokens) {
    if (!takes_features_) return;
    size_t image_tokens = 0;
    if (manifest_.has_vision)
        image_tokens = static_cast<size_t>(std::count(ids, ids + tokens, manifest_.vision.image_token_id));
    size_t rows = std::min(image_tokens, feature_rows_ - features_fed_);
    size_t row_bytes = static_cast<size_t>(features_width_) * element_type(features_dtype_).bytes;
    static uint8_t none[16];  // a tensor of 0 rows still takes a pointer
    uint8_t* data = rows ? features_.data() + features_fed_ * row_bytes : none;
    set_value(kImageFeatures, tensor(cpu_memory_, data, rows * row_bytes, {static_cast<int64_t>(rows), features_width_},
                                     features_dtype_));
    features_fed_ += rows;
}

std::string Host::report() const {
    std::lock_guard<std::mutex> lock(report_mutex_);
    std::ostringstream out;
    out << "{\"device\": \"" << device_kind_ << "\", \"onnxruntime\": \"" << OrtGetApiBase()->GetVersionString()
        << "\", \"context\": " << capacity_ << ", \"budget_bytes\": " << budget_bytes_;
    if (has_plans_) {
        const Rung& rung = plans_.rungs[static_cast<size_t>(rung_)];
        out << ", \"rung_budget_bytes\": " << rung.budget_bytes << ", \"plans\": {";
        bool first = true;
        for (const auto& [tier, plan] : rung.tiers) {
            out << (first ? "" : ", ") << "\"" << tier << "\": \"" << plan.strategy << "\"";
            first = false;
        }
        out << "}, \"active_tier\": " << (active_ ? active_->tier : 0) << ", \"budget_mode\": \""
            << (auto_budget_ ? "auto" : "fixed") << "\"";
    }
    out << ", \"units\": " << units_.size() << ", \"decode_runs\": " << decode_runs_
        << ", \"decode_attention_nodes\": " << decode_attention_nodes_
        << ", \"decode_product_nodes\": " << decode_product_nodes_;
    out << ", \"steps\": " << steps_ << ", \"shared_steps\": " << shared_steps_ << ", \"plan_switches\": " << plan_switches_ << ", \"tier_steps\": {";
    bool first = true;
    for (const auto& [tier, count] : tier_steps_) {
        out << (first ? "" : ", ") << "\"" << tier << "\": " << count;
        first = false;
    }
    // As pipeshard's generate counts it: forward steps after the prompt's, over the time since the first token.
    double decode_tok_s = last_.decode_s > 0 ? static_cast<double>(last_.decode_steps) / last_.decode_s : 0.0;
    out << "}, \"device_bytes\": " << device_bytes_ << ", \"peak_device_bytes\": " << peak_device_bytes_
        << ", \"streamed_weight_bytes\": " << streamed_weight_bytes_ << ", \"last\": {\"prompt_tokens\": "
        << last_.prompt_tokens << ", \"generated_tokens\": " << last_.generated_tokens << ", \"prefill_s\": "
        << last_.prefill_s << ", \"decode_s\": " << last_.decode_s << ", \"decode_tok_s\": " << decode_tok_s
        << ", \"stop_reason\": \"" << last_.stop_reason << "\"}}";
    return out.str();
}

}  // namespace pipeshard
