#include "runner.hpp"

#include <algorithm>
#include <chrono>

#include "errors.hpp"

namespace pipeshard {

Runner::Runner(std::unique_ptr<Host> host) : host_(std::move(host)) { worker_ = std::thread([this] { loop(); }); }

Runner::~Runner() {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stopping_ = true;
        for (auto& task : queue_) task->cancelled = true;
        for (Task* task : running_) task->cancelled = true;
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
    for (Task* task : running_)
        if (task->id == id) task->cancelled = true;
    for (auto& task : queue_)
        if (task->id == id) task->cancelled = true;
}

void Runner::cancel_conversation(const Conversation* conversation) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (Task* task : running_)
        if (task->conversation == conversation) task->cancelled = true;
    for (auto& task : queue_)
        if (task->conversation == conversation) task->cancelled = true;
}

bool Runner::known(uint64_t id) const {
    for (const Task* task : running_)
        if (task->id == id) return true;
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
        std::vector<std::unique_ptr<Task>> tasks;
        {
            std::unique_lock<std::mutex> lock(mutex_);
            wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
            if (queue_.empty()) return;  // stopping, and nothing left to report
            if (shares_steps(*queue_.front())) {
                take_turns(tasks, host_->sequences());
            } else {
                tasks.push_back(std::move(queue_.front()));
                queue_.pop_front();
                running_.push_back(tasks.back().get());
            }
        }
        if (shares_steps(*tasks.front())) {
            run_turns(tasks);
        } else {
            run_one(*tasks.front());
        }
    }
}

void Runner::take_turns(std::vector<std::unique_ptr<Task>>& into, size_t room) {
    auto running = [&](const Conversation* conversation) {
        for (const Task* task : running_)
            if (task->conversation == conversation) return true;
        return false;
    };
    while (room > 0 && !queue_.empty() && shares_steps(*queue_.front()) && !running(queue_.front()->conversation)) {
        into.push_back(std::move(queue_.front()));
        queue_.pop_front();
        running_.push_back(into.back().get());
        --room;
    }
}

void Runner::run_one(Task& task) {
    std::string message;
    pipeshard_status status = PIPESHARD_ERR_CANCELLED;
    if (task.cancelled) {
        message = "cancelled before it started";
    } else {
        host_->set_cancel_flag(&task.cancelled);
        status = guarded(message, task.body);
        host_->set_cancel_flag(nullptr);
    }
    complete(task, status, message);
}

// The turns share decode steps; turns queued meanwhile join between steps while the cache has room for them.
void Runner::run_turns(std::vector<std::unique_ptr<Task>>& tasks) {
    auto prepare = [this](size_t first, const std::vector<std::unique_ptr<Task>>& list) {
        std::vector<Turn*> turns;
        for (size_t i = first; i < list.size(); ++i) {
            Task* task = list[i].get();
            task->turn->ended = [this, task](pipeshard_status status, const std::string& message) {
                complete(*task, status, message);
            };
            turns.push_back(task->turn.get());
        }
        return turns;
    };
    host_->run_turns(prepare(0, tasks), [&](size_t room) {
        size_t first = tasks.size();
        {
            std::lock_guard<std::mutex> lock(mutex_);
            take_turns(tasks, room);
        }
        return prepare(first, tasks);
    });
}

void Runner::complete(Task& task, pipeshard_status status, const std::string& message) {
    if (task.finish) {
        std::string ignored;
        guarded(ignored, [&] { task.finish(status, message); });
    }
    {
        std::lock_guard<std::mutex> lock(mutex_);
        running_.erase(std::find(running_.begin(), running_.end(), &task));
        results_[task.id] = {status, message};
        while (results_.size() > kKeptResults) results_.erase(results_.begin());
    }
    ended_.notify_all();
}

}  // namespace pipeshard
