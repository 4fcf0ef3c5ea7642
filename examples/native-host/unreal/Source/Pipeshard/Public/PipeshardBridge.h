// The engine-independent half of the Unreal module: one pipeshard host (and optionally one conversation) over the C
// ABI, with the host's callbacks, which run on its worker thread, turned into events queued for the game thread.
// It uses no Unreal type, so CTest builds and runs it with the real host (tests/bridge_tests.cpp); PipeshardComponent
// wraps it for Blueprints.
//
// Threads: Open, StartConversation, Submit, Cancel, SetVramBudget and Drain are called from the game thread. The
// host's worker only appends events and calls the notify function (at most once until the next Drain), which must
// just schedule a Drain on the game thread (UPipeshardComponent posts an AsyncTask to ENamedThreads::GameThread).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "pipeshard_host.h"

namespace pipeshard_unreal {

enum class EventKind { Token, Sentence, Finished };

struct Event {
    EventKind kind;
    int64_t request;  // the bridge's request id, as Submit returned it
    std::string text;  // Token: the piece; Sentence: the sentence; Finished: the answer's text
    int64_t token_id = -1;  // Token only
    pipeshard_status status = PIPESHARD_OK;  // Finished only
    std::string message;  // Finished only: what went wrong, or ""
};

struct BridgeOptions {
    std::string pack_dir;
    std::string plans_path;  // "": every unit on the CPU
    std::string device;      // "": cpu without plans, else "sim" or "cuda"
    std::string extensions_library;
    int threads = 0;
    uint64_t vram_budget_bytes = 0;
};

class Bridge {
public:
    explicit Bridge(std::function<void()> notify);
    ~Bridge();  // closes the host: what is queued or running is cancelled, no callback runs after
    Bridge(const Bridge&) = delete;
    Bridge& operator=(const Bridge&) = delete;

    // Opens the pack (closing a host opened before); false with LastError() on failure.
    bool Open(const BridgeOptions& options);
    bool IsOpen() const { return host_ != nullptr; }
    // Later prompts are turns of one conversation whose KV cache is kept (system "": the template's default).
    bool StartConversation(const std::string& system_prompt);
    // Queues a prompt; its id (from 1), or 0 with LastError(). Its events follow in order: Token (and Sentence)
    // events, then one Finished.
    int64_t Submit(const std::string& prompt, const pipeshard_sampling& sampling);
    bool Cancel(int64_t request);  // an ended or unknown id is no error
    bool SetVramBudget(uint64_t bytes);
    // The events queued since the last call, in the order the host made them (game thread).
    std::vector<Event> Drain();
    int RequestsRunning() const;  // submitted, not yet finished
    const std::string& LastError() const { return error_; }  // the last call's failure, or ""

private:
    struct Request {
        Bridge* bridge;
        int64_t id;
    };

    static int OnToken(int64_t token_id, const char* piece, void* user_data);
    static void OnSentence(pipeshard_request_id, const char* sentence, void* user_data);
    static void OnDone(pipeshard_request_id, pipeshard_status status, const char* text, const char* message,
                       void* user_data);
    void Push(Event event);  // any thread
    void Close();
    bool Failed(pipeshard_status status);

    std::function<void()> notify_;
    pipeshard_host* host_ = nullptr;
    pipeshard_session* session_ = nullptr;
    std::string error_;
    int64_t next_id_ = 1;
    mutable std::mutex mutex_;  // guards events_ and requests_
    std::vector<Event> events_;
    std::map<int64_t, std::pair<pipeshard_request_id, std::unique_ptr<Request>>> requests_;
    std::atomic<bool> drain_scheduled_{false};
};

}  // namespace pipeshard_unreal
