// The host behind the C ABI: a pack's sessions, its KV cache, the plans of the active ladder rung, and the step.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "device.hpp"
#include "images.hpp"
#include "json.hpp"
#include "onnxruntime_c_api.h"
#include "pack.hpp"
#include "pipeshard_host.h"

namespace pipeshard {

class MappedFile;

// One attention's cache: per past name a [sequences, kv_heads, capacity, head_dim] buffer, on the host and (while
// its attention runs on the device) on the device; bound as both the past input and the present output, over the
// sequences a step runs (`views`: made once per first sequence and count). One sequence's part of a buffer is `rows`
// rows (its heads) of `capacity` positions of `position_bytes` each.
struct KvCache {
    std::vector<std::vector<uint8_t>> host;
    std::vector<void*> device;
    std::vector<std::vector<int64_t>> shape;  // one sequence's
    std::vector<std::string> dtype;
    std::vector<size_t> rows, position_bytes;
    std::vector<std::map<std::pair<size_t, size_t>, OrtValue*>> host_views, device_views;
    bool on_device = false;
};

// How one request chooses its tokens: pipeshard_sampling checked and copied (its strings owned).
struct Sampling {
    int max_new_tokens = 64;
    float temperature = 0, top_p = 1, repetition_penalty = 1;
    int top_k = 0;
    uint64_t seed = 0;
    bool use_chat_template = true;
    bool has_system = false;
    std::string system;
    std::vector<std::string> stop_strings;

    // Throws HostError(PIPESHARD_ERR_ARGUMENT) on a value out of range.
    static Sampling from(const pipeshard_sampling& sampling);
};

struct Message {
    std::string role, content;
};

// One conversation (a session of the C ABI): its history, the tokens whose KV cells it holds, and those cells
// while another conversation's are in the host's cache (`kv`: per past buffer, each row's first cached positions).
struct Conversation {
    bool has_system = false;
    std::string system;
    std::vector<Message> turns;  // user, assistant, user, assistant, ...
    std::vector<int64_t> cached;
    std::vector<std::vector<uint8_t>> kv;
};

struct Answer {
    std::vector<int64_t> tokens;
    std::string text;
};

// Sees each token and the text it completes; returns false to stop.
using TokenSink = std::function<bool(int64_t token, const std::string& piece)>;

// One session run of a step: a unit, where it computes, and (streamed) its place in the ring.
struct Run {
    size_t unit = 0;
    std::string placement;
    int streamed_index = -1;
};

// Runs of a decode step taken together: a stretch of CPU runs as one session over their joined graphs, or one
// run whose attention is pipeshard's DecodeAttention (src/joined.hpp); `session` nullptr: the run's own session.
struct Piece {
    size_t first_run = 0, run_count = 1;
    OrtSession* session = nullptr;
    SubLayer spec;  // what the joined session reads and writes, as a sub-layer's record
    int decode_attention_nodes = 0;
    int product_nodes = 0;  // products of the joined session computed by BlockMatMul or WeightMatMul
};

// A session's turn that may share its decode steps with other sessions' turns (Host::run_turns).
struct Turn {
    Conversation* conversation = nullptr;
    std::string user;
    Sampling sampling;
    TokenSink sink;
    const std::atomic<bool>* cancelled = nullptr;
    std::function<void(const Answer& answer)> answered;  // once it ended well, before `ended`
    std::function<void(pipeshard_status status, const std::string& message)> ended;  // as it ends, on the worker
};

struct Generation;  // one request's answer in the making (host.cpp)

struct GenerationTimes {
    size_t prompt_tokens = 0, generated_tokens = 0, decode_steps = 0;
    double prefill_s = 0, decode_s = 0;
    std::string stop_reason;
};

class Host {
public:
    Host(const std::string& pack_dir, const pipeshard_options& options);
    ~Host();
    Host(const Host&) = delete;
    Host& operator=(const Host&) = delete;

    // Everything below runs on the runner's worker thread, except where it says "any thread".
    std::vector<int64_t> prompt_ids(const std::string& prompt, const Sampling& sampling);
    std::vector<int64_t> tokenize(const std::string& text);     // any thread
    std::string detokenize(const std::vector<int64_t>& ids);    // any thread
    // With a conversation: its cells are loaded, the prompt's tokens it holds already are not fed again, and the
    // tokens fed are added to what it holds as each step ends.
    Answer generate(const std::vector<int64_t>& prompt, const Sampling& sampling, const TokenSink& sink,
                    Conversation* conversation = nullptr);
    // A VLM pack's one-shot prompt with images (docs/native-host.md, "Images"): preprocessed as runtime/images.py
    // does, their token runs expanded in the prompt (placeholders where it has them, else before its text), the
    // vision blocks run on the CPU, and their features spliced into the image tokens' embeddings as the prompt is fed.
    Answer generate_with_images(const std::string& prompt, const std::vector<RgbImage>& images,
                                const Sampling& sampling, const TokenSink& sink);
    // A user's next turn in the conversation; it joins the history unless cancelled or failed.
    Answer say(Conversation& conversation, const std::string& user, const Sampling& sampling, const TokenSink& sink);
    // Turns of different sessions (at most sequences() of them, more joining between steps from `more(room)`), their
    // decode steps shared; each turn's `ended` is called as it ends.
    void run_turns(const std::vector<Turn*>& turns, const std::function<std::vector<Turn*>(size_t room)>& more);
    size_t sequences() const { return sequences_; }  // any thread
    std::string render_chat(const std::vector<Message>& messages) const;  // any thread
    void save(Conversation& conversation, const std::string& path);
    std::unique_ptr<Conversation> load(const std::string& path);
    void forget(Conversation* conversation);  // before it is freed
    void warmup();
    // The running request's cancel flag, looked at between two sub-layer runs (nullptr between requests).
    void set_cancel_flag(const std::atomic<bool>* flag) { cancel_ = flag; }

    // Any thread: take effect between two steps.
    void set_vram_budget(uint64_t budget_bytes);
    void set_auto_budget(uint64_t reserve_bytes);
    void set_free_vram(uint64_t free_bytes);
    void request_release() { release_requested_ = true; }
    bool release_pending() const { return release_requested_.load(); }
    void apply_release();  // the worker, when no request runs
    void apply_budget();   // the worker, when no request runs: a rung left behind frees its device memory now
    std::string report() const;

private:
    Manifest manifest_;
    std::vector<Unit> units_;
    size_t whole_output_unit_ = SIZE_MAX;  // the output layer as one unit, when plans cut it into row chunks
    PlansFile plans_;
    bool has_plans_ = false;
    std::string device_kind_ = "cpu";
    std::unique_ptr<Device> device_;
    int64_t capacity_ = 0;
    size_t sequences_ = 1;  // the cache's sequences: turns of that many sessions share a decode step
    int prefill_chunk_ = 0;
    std::string manifest_sha256_;

    OrtEnv* env_ = nullptr;
    OrtMemoryInfo* cpu_memory_ = nullptr;
    OrtRunOptions* run_options_ = nullptr;
    std::vector<OrtSessionOptions*> session_options_;
    std::map<size_t, OrtSession*> cpu_sessions_, host_input_sessions_, device_sessions_;
    std::map<OrtSession*, OrtIoBinding*> bindings_;
    OrtSessionOptions* tokenizer_options_ = nullptr;
    OrtSession* tokenizer_ = nullptr;
    OrtSession* detokenizer_ = nullptr;
    std::vector<int64_t> eos_ids_;
    Json chat_template_;
    bool has_chat_template_ = false;

    // A VLM pack's vision: its preprocessing (null when the pack has none, or one this host does not take: then
    // image_refusal_ says why), its blocks' CPU sessions, and the features of the running request's images, which
    // the embed sub-layer reads as `image_features` (its rows in the order the prompt's image tokens come).
    std::unique_ptr<ImageConfig> image_config_;
    std::string image_refusal_;
    std::map<size_t, OrtSession*> vision_sessions_;
    bool takes_features_ = false;
    std::string features_dtype_ = "float32";
    int64_t features_width_ = 0;
    std::vector<uint8_t> features_;
    size_t feature_rows_ = 0, features_fed_ = 0;

    std::map<std::string, std::unique_ptr<MappedFile>> blobs_;
    std::map<size_t, KvCache> kv_;  // by attention sub-layer
    std::map<std::string, std::pair<size_t, size_t>> kv_names_;  // past or present name -> (sub-layer, index)
    // CPU sessions take their weights mapped from the blobs (AddInitializer) with one prepacked-weights container,
    // so a joined decode session holds no second packed copy of what the sub-layer sessions packed.
    OrtPrepackedWeightsContainer* prepacked_ = nullptr;
    std::vector<OrtValue*> initializer_values_;
    std::set<std::string> float_inputs_;  // float32 tensors among the sub-layers' inputs
    std::map<const Plan*, std::vector<Piece>> decode_pieces_;  // by plan in force (nullptr: all-CPU, no plans)

    // The plans in force: the rung (index into plans_.rungs), and the tier plan now on the device.
    int rung_ = -1;
    std::atomic<uint64_t> pending_budget_{0};  // what set_vram_budget asked for, taken between steps
    std::atomic<bool> auto_budget_{false};
    std::atomic<uint64_t> reserve_bytes_{0}, game_free_bytes_{0};
    std::atomic<bool> has_game_free_{false}, release_requested_{false};
    uint64_t budget_bytes_ = 0;
    const Plan* active_ = nullptr;
    std::vector<Run> runs_;
    std::vector<size_t> streamed_;  // run indices of the streamed units, in order
    std::map<size_t, void*> pinned_;  // unit -> device buffer
    std::vector<void*> slots_;
    std::vector<void*> expert_slots_;  // kExpertSlots buffers as large as the plan's largest streamed expert
    std::vector<int> slot_holds_;     // streamed index each slot holds (or is receiving), -1 none
    uint64_t slot_bytes_ = 0;
    std::map<void*, uint64_t> device_allocations_;
    std::atomic<uint64_t> device_bytes_{0}, peak_device_bytes_{0};  // report() reads them while units run

    // Step state.
    std::map<std::string, OrtValue*> values_;  // what runs hand on by name (ORT-allocated outputs, step inputs)
    std::vector<int64_t> input_ids_, attention_mask_, position_ids_;
    std::vector<uint8_t> logits_bytes_, chunk_logits_;
    std::vector<float> expert_hidden_, expert_routing_;  // a MoE layer's rows gathered for one expert
    std::vector<std::vector<float>> moe_outputs_;        // per MoE block: residual + experts, read later this step
    std::vector<std::vector<float>> expert_results_;     // per expert of the running block: its rows' outputs
    std::string logits_dtype_ = "float32";
    std::vector<float> logits_;

    const std::atomic<bool>* cancel_ = nullptr;
    // Per sequence of the cache: whose cells it holds (nullptr: a one-shot prompt's, or none), and when it last ran.
    std::vector<Conversation*> owner_;
    std::vector<uint64_t> last_used_;
    uint64_t uses_ = 0;
    // The step running: its first sequence and how many (a one-sequence step: that sequence), and per row of its
    // tokens whether a request fed it (a sequence in a shared step no turn of which runs feeds a placeholder).
    size_t step_first_ = 0, step_count_ = 1;
    std::vector<char> live_rows_;
    mutable std::mutex report_mutex_;   // a step's plan and budget changes, and report() from another thread

    // What the host has done.
    std::atomic<uint64_t> steps_{0}, shared_steps_{0}, plan_switches_{0}, streamed_weight_bytes_{0};
    std::atomic<uint64_t> decode_runs_{0}, decode_attention_nodes_{0}, decode_product_nodes_{0};  // of the last decode step
    std::map<std::string, int> cpu_product_nodes_;  // sub-layer -> products its CPU session's ops compute
    std::map<int, uint64_t> tier_steps_;
    GenerationTimes last_;

    void load_env(int threads);
    OrtSession* make_session(const std::string& file, bool on_device,
                             const std::vector<const SubLayer*>& weights_of = {}, const std::string* model = nullptr);
    const std::vector<Piece>& decode_pieces();
    uint64_t decode_products(const std::vector<Piece>& pieces) const;
    void release_weight_pages();
    Piece make_piece(size_t first_run, size_t run_count);
    OrtSession* make_cpu_session(const SubLayer& sub);
    OrtSession* session_for(const Run& run);
    OrtIoBinding* binding_for(OrtSession* session);
    void load_text(const char* extensions_library);
    void load_vision();
    void encode(const ImageInputs& inputs);
    void set_image_features(const int64_t* ids, int64_t tokens);
    void allocate_kv();

    const std::map<int, Plan>* tier_plans() const;
    const Plan* plan_for(int64_t tokens, int* tier) const;
    int largest_tier() const;
    int rung_for(uint64_t budget_bytes) const;
    void activate(const Plan* plan);
    void deactivate();
    void deactivate_after_failure();
    void* device_allocate(uint64_t bytes, const std::string& purpose);
    void device_release(void* buffer);
    std::pair<std::string, uint64_t> unit_bytes(const Unit& unit) const;  // (file, offset); size by unit_size
    uint64_t unit_size(const Unit& unit) const;
    const uint8_t* mapped(const std::string& file) const;
    void start_copy(int streamed_index, int slot);
    void apply_pending_budget();

    uint64_t auto_budget() const;
    void release_device();
    void restart_ring();
    // The sequence that holds (or is given) the conversation's cells; a one-shot prompt (nullptr) gets a free one.
    // A sequence taken from another conversation stores its cells first; those in `busy` are not taken.
    size_t sequence_for(Conversation* conversation, const std::vector<size_t>& busy);
    void store_cells(Conversation& conversation, size_t sequence);
    void load_cells(Conversation& conversation, size_t sequence);
    OrtValue* kv_value(const std::string& name);  // the step's sequences of a past or present buffer
    size_t step_row(size_t sequence) const { return sequence - step_first_; }
    void sync_kv_to_host();
    void sync_kv_to_device();
    bool cancel_requested() const { return cancel_ && cancel_->load(std::memory_order_relaxed); }

    std::vector<Message> history_with(const Conversation& conversation, const std::string& user) const;
    std::unique_ptr<Generation> begin(const std::vector<int64_t>& prompt, const Sampling& sampling,
                                      const TokenSink& sink, Conversation* conversation,
                                      const std::vector<size_t>& busy);
    bool take(Generation& generation);
    Answer finish(Generation& generation);
    void forget_cells(Generation& generation);
    void feed(size_t sequence, const int64_t* ids, int64_t tokens, int64_t past, Conversation* conversation);
    // One step: `tokens` new tokens of one sequence, or one token of each of several; `pasts`: what each holds.
    void forward(const std::vector<size_t>& sequences, const int64_t* ids, int64_t tokens,
                 const std::vector<int64_t>& pasts);
    // `device_weights`: a streamed expert's weights, already copied into its staging slot.
    void run_unit(const Run& run, int64_t tokens, OrtSession* session = nullptr, const SubLayer* spec = nullptr,
                  const uint8_t* device_weights = nullptr);
    // Runs after a router: the experts its tokens chose, each over those tokens (pinned ones first, then CPU ones
    // while the first streamed ones' copies land, then the streamed ones), and the combine.
    void run_experts(const MoeBlock& block, size_t block_index, int64_t tokens);
    void start_expert_copy(const Run& run, int slot);
    const MoeBlock* moe_block_after(size_t run, size_t* index) const;  // the block whose router this run is
    bool is_expert(size_t run) const;
    OrtValue* tensor(const OrtMemoryInfo* memory, void* data, size_t bytes, const std::vector<int64_t>& shape,
                     const std::string& dtype);
    void set_value(const std::string& name, OrtValue* value);
    void clear_values();
    void read_logits(size_t row);  // the step's logits of one of its rows
    int64_t choose(const Sampling& sampling, const std::vector<int64_t>& history, std::mt19937_64& rng);
};

}  // namespace pipeshard
