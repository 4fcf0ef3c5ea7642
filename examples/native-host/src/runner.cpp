#include "runner.hpp"

#include <chrono>

#include "errors.hpp"

namespace pipeshard {

Runner::Runner(std::unique_ptr<Host> host) : host_(std::move(host)) { worker_ = std::thread([this] { loop(); }); }

Runner::~Runner() {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stopping_ = true;
        for (auto& task : queue_) task->cancelled = true;
        if (running_) running_->cancelled = true;
    }
    wake_.notify_all();
    worker_.join();
}

uint64_t Runner::submit(std::unique_ptr<Task> task) {
    std::lock_guard<std::mutex> lock(mutex_);
    task->id = next_id_++;
    uint64_t id = task->id;
    queue_.push_back(std::move(task));
    wake_.notify_one();
    return id;
}

void Runner::cancel(uint64_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (running_ && running_->id == id) running_->cancelled = true;
    for (auto& task : queue_)
        if (task->id == id) task->cancelled = true;
}

void Runner::cancel_conversation(const Conversation* conversation) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (running_ && running_->conversation == conversation) running_->cancelled = true;
    for (auto& task : queue_)
        if (task->conversation == conversation) task->cancelled = true;
}

bool Runner::known(uint64_t id) const {
    if (running_ && running_->id == id) return true;
    for (const auto& task : queue_)
        if (task->id == id) return true;
    return false;
}

pipeshard_status Runner::wait(uint64_t id, int timeout_ms, std::string* message) {
    if (on_worker()) {
        *message = "pipeshard_wait was called from a callback, on the worker thread that would have to end it";
        return PIPESHARD_ERR_ARGUMENT;
    }
    std::unique_lock<std::mutex> lock(mutex_);
    auto ended = [&] { return results_.count(id) != 0 || !known(id); };
    if (timeout_ms < 0) {
        ended_.wait(lock, ended);
    } else if (!ended_.wait_for(lock, std::chrono::milliseconds(timeout_ms), ended)) {
        *message = "request " + std::to_string(id) + " has not ended after " + std::to_string(timeout_ms) + " ms";
        return PIPESHARD_ERR_ARGUMENT;
    }
    auto found = results_.find(id);
    if (found == results_.end()) {
        *message = "no request " + std::to_string(id) + " (unknown, or its result was collected already)";
        return PIPESHARD_ERR_ARGUMENT;
    }
    Ended result = found->second;
    results_.erase(found);
    *message = result.message;
    return result.status;
}

pipeshard_status Runner::run(std::function<void()> body, std::string* message, Conversation* conversation) {
    if (on_worker()) {
        *message = "a blocking call from a callback, on the worker thread it would wait for: submit it instead";
        return PIPESHARD_ERR_ARGUMENT;
    }
    auto task = std::make_unique<Task>();
    task->body = std::move(body);
    task->conversation = conversation;
    return wait(submit(std::move(task)), -1, message);
}

void Runner::loop() {
    for (;;) {
        std::unique_ptr<Task> task;
        {
            std::unique_lock<std::mutex> lock(mutex_);
            wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
            if (queue_.empty()) return;  // stopping, and nothing left to report
            task = std::move(queue_.front());
            queue_.pop_front();
            running_ = task.get();
        }
        std::string message;
        pipeshard_status status = PIPESHARD_ERR_CANCELLED;
        if (task->cancelled) {
            message = "cancelled before it started";
        } else {
            host_->set_cancel_flag(&task->cancelled);
            status = guarded(message, task->body);
            host_->set_cancel_flag(nullptr);
        }
        if (task->finish) {
            std::string ignored;
            guarded(ignored, [&] { task->finish(status, message); });
        }
        {
            std::lock_guard<std::mutex> lock(mutex_);
            running_ = nullptr;
            results_[task->id] = {status, message};
            while (results_.size() > kKeptResults) results_.erase(results_.begin());
        }
        ended_.notify_all();
    }
}

}  // namespace pipeshard
