// The host's worker thread: requests (and every other piece of work on the engine) run on it one at a time, in the
// order submitted; any thread may submit, cancel and wait.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "host.hpp"

namespace pipeshard {

struct Task {
    uint64_t id = 0;
    std::atomic<bool> cancelled{false};
    Conversation* conversation = nullptr;  // whose turn it is, or nullptr
    std::function<void()> body;            // throws on failure (HostError with PIPESHARD_ERR_CANCELLED when cancelled)
    std::shared_ptr<Turn> turn;            // a session's turn: run by Host::run_turns instead, when steps are shared
    std::function<void(pipeshard_status, const std::string& message)> finish;  // on the worker, after the body
};

class Runner {
public:
    explicit Runner(std::unique_ptr<Host> host);
    ~Runner();  // cancels what is queued or running, then joins the worker
    Runner(const Runner&) = delete;
    Runner& operator=(const Runner&) = delete;

    Host& host() { return *host_; }
    uint64_t submit(std::unique_ptr<Task> task);
    void cancel(uint64_t id);
    void cancel_conversation(const Conversation* conversation);
    // The task's status and message once it has ended; PIPESHARD_ERR_ARGUMENT for an unknown id or on timeout.
    pipeshard_status wait(uint64_t id, int timeout_ms, std::string* message);
    // Submit `body` and wait for it; refused on the worker thread (a callback), where waiting would never end.
    pipeshard_status run(std::function<void()> body, std::string* message, Conversation* conversation = nullptr);
    bool on_worker() const { return std::this_thread::get_id() == worker_.get_id(); }

private:
    struct Ended {
        pipeshard_status status;
        std::string message;
    };
    static constexpr size_t kKeptResults = 4096;  // ended requests whose status pipeshard_wait can still give

    std::unique_ptr<Host> host_;
    std::mutex mutex_;
    std::condition_variable wake_, ended_;
    std::deque<std::unique_ptr<Task>> queue_;
    std::vector<Task*> running_;
    std::map<uint64_t, Ended> results_;
    uint64_t next_id_ = 1;
    bool stopping_ = false;
    std::thread worker_;

    void loop();
    bool known(uint64_t id) const;  // queued or running (mutex_ held)
    bool shares_steps(const Task& task) const { return task.turn && host_->sequences() > 1; }
    // mutex_ held: turns at the queue's front, of sessions with no turn running, at most `room` of them.
    void take_turns(std::vector<std::unique_ptr<Task>>& into, size_t room);
    void run_one(Task& task);
    void run_turns(std::vector<std::unique_ptr<Task>>& tasks);
    void complete(Task& task, pipeshard_status status, const std::string& message);
};

}  // namespace pipeshard
