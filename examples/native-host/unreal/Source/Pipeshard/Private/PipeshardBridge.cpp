#include "PipeshardBridge.h"

namespace pipeshard_unreal {

Bridge::Bridge(std::function<void()> notify) : notify_(std::move(notify)) {}

Bridge::~Bridge() { Close(); }

void Bridge::Close() {
    if (session_) pipeshard_session_close(session_);
    session_ = nullptr;
    if (host_) pipeshard_close(host_);  // joins the worker: every on_done has run
    host_ = nullptr;
    std::lock_guard<std::mutex> lock(mutex_);
    requests_.clear();
}

bool Bridge::Failed(pipeshard_status status) {
    error_.clear();
    if (status == PIPESHARD_OK) return false;
    error_ = std::string(pipeshard_status_name(status)) + ": " + pipeshard_last_error(host_);
    return true;
}

bool Bridge::Open(const BridgeOptions& options) {
    Close();
    pipeshard_options native;
    pipeshard_default_options(&native);
    native.plans_path = options.plans_path.empty() ? nullptr : options.plans_path.c_str();
    native.device = options.device.empty() ? nullptr : options.device.c_str();
    native.extensions_library = options.extensions_library.empty() ? nullptr : options.extensions_library.c_str();
    native.threads = options.threads;
    native.vram_budget_bytes = options.vram_budget_bytes;
    return !Failed(pipeshard_open(options.pack_dir.c_str(), &native, &host_));
}

bool Bridge::StartConversation(const std::string& system_prompt) {
    if (!host_) {
        error_ = "no pack is open";
        return false;
    }
    if (session_) pipeshard_session_close(session_);
    session_ = nullptr;
    return !Failed(pipeshard_session_create(host_, system_prompt.empty() ? nullptr : system_prompt.c_str(), &session_));
}

int64_t Bridge::Submit(const std::string& prompt, const pipeshard_sampling& sampling) {
    if (!host_) {
        error_ = "no pack is open";
        return 0;
    }
    auto request = std::make_unique<Request>();
    request->bridge = this;
    Request* user_data = request.get();
    std::lock_guard<std::mutex> lock(mutex_);  // the callbacks wait until the request is recorded
    request->id = next_id_++;
    pipeshard_request_id native = 0;
    if (Failed(pipeshard_submit_with_sentences(host_, session_, prompt.c_str(), &sampling, OnToken, OnSentence, OnDone,
                                               user_data, &native)))
        return 0;
    int64_t id = request->id;
    requests_[id] = {native, std::move(request)};
    return id;
}

bool Bridge::Cancel(int64_t request) {
    pipeshard_request_id native = 0;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        auto found = requests_.find(request);
        if (found == requests_.end()) return true;
        native = found->second.first;
    }
    return !Failed(pipeshard_cancel(host_, native));
}

bool Bridge::SetVramBudget(uint64_t bytes) {
    if (!host_) {
        error_ = "no pack is open";
        return false;
    }
    return !Failed(pipeshard_set_vram_budget(host_, bytes));
}

std::vector<Event> Bridge::Drain() {
    drain_scheduled_ = false;  // before taking the events: one pushed after this schedules another drain
    std::vector<Event> events;
    std::lock_guard<std::mutex> lock(mutex_);
    events.swap(events_);
    return events;
}

int Bridge::RequestsRunning() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return static_cast<int>(requests_.size());
}

void Bridge::Push(Event event) {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        events_.push_back(std::move(event));
    }
    if (!drain_scheduled_.exchange(true) && notify_) notify_();
}

int Bridge::OnToken(int64_t token_id, const char* piece, void* user_data) {
    auto* request = static_cast<Request*>(user_data);
    Event event{EventKind::Token, request->id, piece};
    event.token_id = token_id;
    request->bridge->Push(std::move(event));
    return 0;
}

void Bridge::OnSentence(pipeshard_request_id, const char* sentence, void* user_data) {
    auto* request = static_cast<Request*>(user_data);
    request->bridge->Push({EventKind::Sentence, request->id, sentence});
}

void Bridge::OnDone(pipeshard_request_id, pipeshard_status status, const char* text, const char* message,
                    void* user_data) {
    auto* request = static_cast<Request*>(user_data);
    Bridge* bridge = request->bridge;
    int64_t id = request->id;
    Event event{EventKind::Finished, id, text};
    event.status = status;
    event.message = message;
    {
        std::lock_guard<std::mutex> lock(bridge->mutex_);
        bridge->requests_.erase(id);  // frees `request`: no callback of it comes after on_done
    }
    bridge->Push(std::move(event));
}

}  // namespace pipeshard_unreal
