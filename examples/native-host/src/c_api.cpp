// The C ABI: every entry point catches what the library throws and turns it into a status and a message (kept per
// calling thread, so that threads calling one host do not overwrite each other's).
#include <atomic>
#include <chrono>
#include <functional>
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "errors.hpp"
#include "host.hpp"
#include "json.hpp"
#include "pipeshard_host.h"
#include "runner.hpp"
#include "sentences.hpp"

struct pipeshard_host {
    std::unique_ptr<pipeshard::Runner> runner;
    std::atomic<bool> budget_task_queued{false};
    std::mutex sessions_mutex;
    std::set<pipeshard_session*> sessions;
};

struct pipeshard_session {
    pipeshard_host* host;
    std::unique_ptr<pipeshard::Conversation> conversation;
};

namespace {

using pipeshard::guarded;

thread_local std::string g_error;

pipeshard_status null_argument(const char* what) {
    g_error = std::string(what) + " is NULL";
    return PIPESHARD_ERR_ARGUMENT;
}

pipeshard_status finished(pipeshard_status status, const std::string& message) {
    g_error = message;
    return status;
}

pipeshard::Sampling sampling_of(const pipeshard_sampling* sampling) {
    pipeshard_sampling defaults;
    pipeshard_default_sampling(&defaults);
    return pipeshard::Sampling::from(sampling ? *sampling : defaults);
}

// The token callback as the library's sink: nonzero from the callback stops.
pipeshard::TokenSink sink_of(pipeshard_token_callback callback, void* user_data) {
    if (!callback) return nullptr;
    return [callback, user_data](int64_t token, const std::string& piece) {
        return callback(token, piece.c_str(), user_data) == 0;
    };
}

// Generation on the worker, waited for: the blocking calls. `prompt` gives the ids there.
pipeshard_status generate_blocking(pipeshard_host* host,
                                   const std::function<std::vector<int64_t>(const pipeshard::Sampling&)>& prompt,
                                   const pipeshard_sampling* sampling, pipeshard_token_callback callback,
                                   void* user_data) {
    pipeshard::Sampling chosen;
    pipeshard_status status = guarded(g_error, [&] { chosen = sampling_of(sampling); });
    if (status != PIPESHARD_OK) return status;
    std::string message;
    pipeshard::Host& engine = host->runner->host();
    status = host->runner->run(
        [&] { engine.generate(prompt(chosen), chosen, sink_of(callback, user_data)); }, &message);
    return finished(status, message);
}

// The caller's images copied and checked (any thread, before a request is queued).
std::vector<pipeshard::RgbImage> images_of(const pipeshard_image* images, size_t count) {
    constexpr int kLargestEdge = 32768;
    if (!images && count)
        pipeshard::fail(PIPESHARD_ERR_ARGUMENT, "images is NULL with an image_count of " + std::to_string(count));
    std::vector<pipeshard::RgbImage> copies(count);
    for (size_t i = 0; i < count; ++i) {
        const pipeshard_image& image = images[i];
        std::string which = "image " + std::to_string(i);
        if (!image.rgb) pipeshard::fail(PIPESHARD_ERR_ARGUMENT, which + " has NULL pixels (rgb)");
        if (image.width < 1 || image.height < 1 || image.width > kLargestEdge || image.height > kLargestEdge)
            pipeshard::fail(PIPESHARD_ERR_ARGUMENT, which + " is " + std::to_string(image.width) + "x" +
                                                        std::to_string(image.height) + " pixels: width and height "
                                                        "must be from 1 to " + std::to_string(kLargestEdge));
        copies[i].width = image.width;
        copies[i].height = image.height;
        copies[i].pixels.assign(image.rgb, image.rgb + static_cast<size_t>(image.width) * image.height * 3);
    }
    return copies;
}

void close_session(pipeshard_session* session) {
    pipeshard_host* host = session->host;
    host->runner->cancel_conversation(session->conversation.get());
    auto forget = [host, session] {
        host->runner->host().forget(session->conversation.get());
        delete session;
    };
    {
        std::lock_guard<std::mutex> lock(host->sessions_mutex);
        host->sessions.erase(session);
    }
    if (host->runner->on_worker()) {  // from a callback: after the request running now
        auto task = std::make_unique<pipeshard::Task>();
        task->body = forget;
        host->runner->submit(std::move(task));
    } else {
        std::string ignored;
        host->runner->run(forget, &ignored);
    }
}

// A budget change reaches a running request between two steps; an idle host applies it on the worker at once
// (one such task queued at a time, however often the game calls).
pipeshard_status budget_changed(pipeshard_host* host, const std::function<void(pipeshard::Host&)>& change) {
    pipeshard::Host& engine = host->runner->host();
    pipeshard_status status = guarded(g_error, [&] { change(engine); });
    if (status == PIPESHARD_OK && !host->budget_task_queued.exchange(true)) {
        auto task = std::make_unique<pipeshard::Task>();
        task->body = [host, &engine] {
            host->budget_task_queued = false;
            engine.apply_budget();
        };
        host->runner->submit(std::move(task));
    }
    return status;
}

// Queue a request on the host's worker: `body(sink)` makes its answer, handing each token to `sink`: the token
// callback, then (with `on_sentence`) the sentences its piece completes, and the remainder once the answer is made.
// `on_done`, when given, gets the answer's text. A session's `turn` (its user text and sampling) may instead share
// its decode steps with other sessions' turns (Host::run_turns), with the same callbacks.
template <typename Body>
void queue_request(pipeshard_host* host, pipeshard::Conversation* conversation, Body body,
                   pipeshard_token_callback on_token, pipeshard_sentence_callback on_sentence,
                   pipeshard_done_callback on_done, void* user_data, pipeshard_request_id* out_request,
                   std::shared_ptr<pipeshard::Turn> turn = nullptr) {
    auto task = std::make_unique<pipeshard::Task>();
    auto answer = std::make_shared<pipeshard::Answer>();
    auto splitter = std::make_shared<pipeshard::SentenceSplitter>();
    task->conversation = conversation;
    uint64_t* id = &task->id;
    pipeshard::TokenSink tokens = sink_of(on_token, user_data), sink = tokens;
    if (on_sentence)
        sink = [=](int64_t token, const std::string& piece) {
            bool go_on = !tokens || tokens(token, piece);
            for (const std::string& sentence : splitter->feed(piece)) on_sentence(*id, sentence.c_str(), user_data);
            return go_on;
        };
    auto answered = [=](const pipeshard::Answer& made) {
        *answer = made;
        std::string rest = on_sentence ? splitter->finish() : std::string();
        if (!rest.empty()) on_sentence(*id, rest.c_str(), user_data);
    };
    task->body = [=] { answered(body(sink)); };
    if (turn) {
        turn->sink = sink;
        turn->cancelled = &task->cancelled;
        turn->answered = answered;
        task->turn = std::move(turn);
    }
    if (on_done)
        task->finish = [=](pipeshard_status status, const std::string& message) {
            on_done(*id, status, answer->text.c_str(), message.c_str(), user_data);
        };
    uint64_t request = host->runner->submit(std::move(task));
    if (out_request) *out_request = request;
}

}  // namespace

extern "C" {

void pipeshard_default_options(pipeshard_options* options) {
    if (!options) return;
    std::memset(options, 0, sizeof *options);
    options->abi_version = PIPESHARD_HOST_ABI_VERSION;
}

void pipeshard_default_sampling(pipeshard_sampling* sampling) {
    if (!sampling) return;
    std::memset(sampling, 0, sizeof *sampling);
    sampling->max_new_tokens = 64;
    sampling->top_p = 1.0f;
    sampling->repetition_penalty = 1.0f;
    sampling->use_chat_template = 1;
}

pipeshard_status pipeshard_open(const char* pack_dir, const pipeshard_options* options, pipeshard_host** out_host) {
    if (!out_host) return null_argument("out_host");
    *out_host = nullptr;
    if (!pack_dir) return null_argument("pack_dir");
    pipeshard_options defaults;
    pipeshard_default_options(&defaults);
    const pipeshard_options& chosen = options ? *options : defaults;
    if (chosen.abi_version != PIPESHARD_HOST_ABI_VERSION)
        return finished(PIPESHARD_ERR_ARGUMENT, "options.abi_version is " + std::to_string(chosen.abi_version) +
                                                    ", this library speaks " +
                                                    std::to_string(PIPESHARD_HOST_ABI_VERSION) +
                                                    " (call pipeshard_default_options first)");
    return guarded(g_error, [&] {
        auto handle = std::make_unique<pipeshard_host>();
        handle->runner = std::make_unique<pipeshard::Runner>(std::make_unique<pipeshard::Host>(pack_dir, chosen));
        *out_host = handle.release();
    });
}

pipeshard_status pipeshard_generate(pipeshard_host* host, const char* prompt, const pipeshard_sampling* sampling,
                                    pipeshard_token_callback callback, void* user_data) {
    if (!host) return null_argument("host");
    if (!prompt) return null_argument("prompt");
    std::string text = prompt;
    pipeshard::Host& engine = host->runner->host();
    return generate_blocking(
        host, [&](const pipeshard::Sampling& chosen) { return engine.prompt_ids(text, chosen); }, sampling, callback,
        user_data);
}

pipeshard_status pipeshard_generate_ids(pipeshard_host* host, const int64_t* prompt_ids, size_t prompt_length,
                                        const pipeshard_sampling* sampling, pipeshard_token_callback callback,
                                        void* user_data) {
    if (!host) return null_argument("host");
    if (!prompt_ids && prompt_length) return null_argument("prompt_ids");
    std::vector<int64_t> ids(prompt_ids, prompt_ids + prompt_length);
    return generate_blocking(host, [&](const pipeshard::Sampling&) { return ids; }, sampling, callback, user_data);
}

pipeshard_status pipeshard_generate_with_images(pipeshard_host* host, const char* prompt,
                                                const pipeshard_image* images, size_t image_count,
                                                const pipeshard_sampling* sampling, pipeshard_token_callback callback,
                                                void* user_data) {
    if (!host) return null_argument("host");
    if (!prompt) return null_argument("prompt");
    std::vector<pipeshard::RgbImage> copies;
    pipeshard::Sampling chosen;
    pipeshard_status status = guarded(g_error, [&] {
        copies = images_of(images, image_count);
        chosen = sampling_of(sampling);
    });
    if (status != PIPESHARD_OK) return status;
    std::string message, text = prompt;
    pipeshard::Host& engine = host->runner->host();
    status = host->runner->run(
        [&] { engine.generate_with_images(text, copies, chosen, sink_of(callback, user_data)); }, &message);
    return finished(status, message);
}

pipeshard_status pipeshard_submit_with_images(pipeshard_host* host, const char* prompt, const pipeshard_image* images,
                                              size_t image_count, const pipeshard_sampling* sampling,
                                              pipeshard_token_callback on_token, pipeshard_done_callback on_done,
                                              void* user_data, pipeshard_request_id* out_request) {
    if (!host) return null_argument("host");
    if (!prompt) return null_argument("prompt");
    return guarded(g_error, [&] {
        auto copies = std::make_shared<std::vector<pipeshard::RgbImage>>(images_of(images, image_count));
        pipeshard::Sampling chosen = sampling_of(sampling);
        pipeshard::Host* engine = &host->runner->host();
        std::string text = prompt;
        queue_request(
            host, nullptr,
            [=](const pipeshard::TokenSink& sink) {
                return engine->generate_with_images(text, *copies, chosen, sink);
            },
            on_token, nullptr, on_done, user_data, out_request);
    });
}

pipeshard_status pipeshard_submit(pipeshard_host* host, pipeshard_session* session, const char* prompt,
                                  const pipeshard_sampling* sampling, pipeshard_token_callback on_token,
                                  pipeshard_done_callback on_done, void* user_data, pipeshard_request_id* out_request) {
    return pipeshard_submit_with_sentences(host, session, prompt, sampling, on_token, nullptr, on_done, user_data,
                                           out_request);
}

pipeshard_status pipeshard_submit_with_sentences(pipeshard_host* host, pipeshard_session* session, const char* prompt,
                                                 const pipeshard_sampling* sampling, pipeshard_token_callback on_token,
                                                 pipeshard_sentence_callback on_sentence,
                                                 pipeshard_done_callback on_done, void* user_data,
                                                 pipeshard_request_id* out_request) {
    if (!host) return null_argument("host");
    if (!prompt) return null_argument("prompt");
    if (session && session->host != host) return finished(PIPESHARD_ERR_ARGUMENT, "the session belongs to another host");
    return guarded(g_error, [&] {
        pipeshard::Sampling chosen = sampling_of(sampling);
        pipeshard::Host* engine = &host->runner->host();
        pipeshard::Conversation* conversation = session ? session->conversation.get() : nullptr;
        std::string text = prompt;
        std::shared_ptr<pipeshard::Turn> turn;
        if (conversation) {
            turn = std::make_shared<pipeshard::Turn>();
            turn->conversation = conversation;
            turn->user = text;
            turn->sampling = chosen;
        }
        queue_request(
            host, conversation,
            [=](const pipeshard::TokenSink& sink) {
                return conversation ? engine->say(*conversation, text, chosen, sink)
                                    : engine->generate(engine->prompt_ids(text, chosen), chosen, sink);
            },
            on_token, on_sentence, on_done, user_data, out_request, turn);
    });
}

pipeshard_status pipeshard_cancel(pipeshard_host* host, pipeshard_request_id request) {
    if (!host) return null_argument("host");
    host->runner->cancel(request);
    return finished(PIPESHARD_OK, "");
}

pipeshard_status pipeshard_wait(pipeshard_host* host, pipeshard_request_id request, int timeout_ms) {
    if (!host) return null_argument("host");
    std::string message;
    pipeshard_status status = host->runner->wait(request, timeout_ms, &message);
    return finished(status, message);
}

pipeshard_status pipeshard_session_create(pipeshard_host* host, const char* system_prompt,
                                          pipeshard_session** out_session) {
    if (!out_session) return null_argument("out_session");
    *out_session = nullptr;
    if (!host) return null_argument("host");
    return guarded(g_error, [&] {
        auto session = std::make_unique<pipeshard_session>();
        session->host = host;
        session->conversation = std::make_unique<pipeshard::Conversation>();
        session->conversation->has_system = system_prompt != nullptr;
        if (system_prompt) session->conversation->system = system_prompt;
        std::lock_guard<std::mutex> lock(host->sessions_mutex);
        host->sessions.insert(session.get());
        *out_session = session.release();
    });
}

pipeshard_status pipeshard_session_say(pipeshard_session* session, const char* user_text,
                                       const pipeshard_sampling* sampling, pipeshard_token_callback callback,
                                       void* user_data) {
    if (!session) return null_argument("session");
    if (!user_text) return null_argument("user_text");
    pipeshard::Sampling chosen;
    pipeshard_status status = guarded(g_error, [&] { chosen = sampling_of(sampling); });
    if (status != PIPESHARD_OK) return status;
    std::string message, text = user_text;
    pipeshard::Conversation* conversation = session->conversation.get();
    pipeshard::Host& engine = session->host->runner->host();
    status = session->host->runner->run(
        [&] { engine.say(*conversation, text, chosen, sink_of(callback, user_data)); }, &message, conversation);
    return finished(status, message);
}

pipeshard_status pipeshard_session_rollback(pipeshard_session* session) {
    if (!session) return null_argument("session");
    std::string message;
    pipeshard::Conversation* conversation = session->conversation.get();
    pipeshard_status status = session->host->runner->run(
        [conversation] {
            if (conversation->turns.empty()) pipeshard::fail(PIPESHARD_ERR_ARGUMENT, "the session has no turn to drop");
            conversation->turns.resize(conversation->turns.size() - 2);
        },
        &message, conversation);
    return finished(status, message);
}

pipeshard_status pipeshard_session_turns(pipeshard_session* session, size_t* turns) {
    if (!session) return null_argument("session");
    if (!turns) return null_argument("turns");
    std::string message;
    pipeshard::Conversation* conversation = session->conversation.get();
    pipeshard_status status = session->host->runner->run(
        [conversation, turns] { *turns = conversation->turns.size() / 2; }, &message, conversation);
    return finished(status, message);
}

pipeshard_status pipeshard_session_save(pipeshard_session* session, const char* path) {
    if (!session) return null_argument("session");
    if (!path) return null_argument("path");
    std::string message, file = path;
    pipeshard::Conversation* conversation = session->conversation.get();
    pipeshard::Host& engine = session->host->runner->host();
    pipeshard_status status =
        session->host->runner->run([&] { engine.save(*conversation, file); }, &message, conversation);
    return finished(status, message);
}

pipeshard_status pipeshard_session_load(pipeshard_host* host, const char* path, pipeshard_session** out_session) {
    if (!out_session) return null_argument("out_session");
    *out_session = nullptr;
    if (!host) return null_argument("host");
    if (!path) return null_argument("path");
    std::string message, file = path;
    std::unique_ptr<pipeshard::Conversation> conversation;
    pipeshard::Host& engine = host->runner->host();
    pipeshard_status status = host->runner->run([&] { conversation = engine.load(file); }, &message);
    if (status != PIPESHARD_OK) return finished(status, message);
    auto session = std::make_unique<pipeshard_session>();
    session->host = host;
    session->conversation = std::move(conversation);
    std::lock_guard<std::mutex> lock(host->sessions_mutex);
    host->sessions.insert(session.get());
    *out_session = session.release();
    return finished(PIPESHARD_OK, "");
}

void pipeshard_session_close(pipeshard_session* session) {
    if (session) close_session(session);
}

pipeshard_status pipeshard_render_chat(pipeshard_host* host, const pipeshard_message* messages, size_t count,
                                       char* text, size_t capacity, size_t* length) {
    if (!host) return null_argument("host");
    if (!messages && count) return null_argument("messages");
    return guarded(g_error, [&] {
        std::vector<pipeshard::Message> list;
        for (size_t i = 0; i < count; ++i) {
            if (!messages[i].role || !messages[i].content)
                pipeshard::fail(PIPESHARD_ERR_ARGUMENT, "message " + std::to_string(i) + " has a NULL role or content");
            list.push_back({messages[i].role, messages[i].content});
        }
        std::string result = host->runner->host().render_chat(list);
        if (length) *length = result.size() + 1;
        if (!text || result.size() + 1 > capacity)
            pipeshard::fail(PIPESHARD_ERR_ARGUMENT, "the text buffer holds " + std::to_string(capacity) + " bytes; " +
                                                        std::to_string(result.size() + 1) + " are needed");
        std::memcpy(text, result.c_str(), result.size() + 1);
    });
}

pipeshard_status pipeshard_tokenize(pipeshard_host* host, const char* text, int64_t* ids, size_t capacity,
                                    size_t* count) {
    if (!host) return null_argument("host");
    if (!text) return null_argument("text");
    return guarded(g_error, [&] {
        std::vector<int64_t> result = host->runner->host().tokenize(text);
        if (count) *count = result.size();
        if (result.size() > capacity || (!ids && !result.empty()))
            pipeshard::fail(PIPESHARD_ERR_ARGUMENT, "the ids buffer holds " + std::to_string(capacity) + " ids; " +
                                                        std::to_string(result.size()) + " are needed");
        std::copy(result.begin(), result.end(), ids);
    });
}

pipeshard_status pipeshard_detokenize(pipeshard_host* host, const int64_t* ids, size_t count, char* text,
                                      size_t capacity, size_t* length) {
    if (!host) return null_argument("host");
    if (!ids && count) return null_argument("ids");
    return guarded(g_error, [&] {
        std::string result = host->runner->host().detokenize(std::vector<int64_t>(ids, ids + count));
        if (length) *length = result.size() + 1;
        if (!text || result.size() + 1 > capacity)
            pipeshard::fail(PIPESHARD_ERR_ARGUMENT, "the text buffer holds " + std::to_string(capacity) + " bytes; " +
                                                        std::to_string(result.size() + 1) + " are needed");
        std::memcpy(text, result.c_str(), result.size() + 1);
    });
}

pipeshard_status pipeshard_set_vram_budget(pipeshard_host* host, uint64_t budget_bytes) {
    if (!host) return null_argument("host");
    return budget_changed(host, [&](pipeshard::Host& engine) { engine.set_vram_budget(budget_bytes); });
}

pipeshard_status pipeshard_set_auto_budget(pipeshard_host* host, uint64_t reserve_bytes) {
    if (!host) return null_argument("host");
    return budget_changed(host, [&](pipeshard::Host& engine) { engine.set_auto_budget(reserve_bytes); });
}

pipeshard_status pipeshard_set_free_vram(pipeshard_host* host, uint64_t free_bytes) {
    if (!host) return null_argument("host");
    return budget_changed(host, [&](pipeshard::Host& engine) { engine.set_free_vram(free_bytes); });
}

pipeshard_status pipeshard_release(pipeshard_host* host) {
    if (!host) return null_argument("host");
    if (host->runner->on_worker())
        return finished(PIPESHARD_ERR_ARGUMENT, "pipeshard_release from a callback: it waits for the worker");
    pipeshard::Host& engine = host->runner->host();
    engine.request_release();  // taken before the next step of a running request, or by this task when idle
    auto task = std::make_unique<pipeshard::Task>();
    task->body = [&engine] {
        if (engine.release_pending()) engine.apply_release();
    };
    host->runner->submit(std::move(task));
    while (engine.release_pending()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return finished(PIPESHARD_OK, "");
}

pipeshard_status pipeshard_warmup(pipeshard_host* host) {
    if (!host) return null_argument("host");
    std::string message;
    pipeshard::Host& engine = host->runner->host();
    pipeshard_status status = host->runner->run([&] { engine.warmup(); }, &message);
    return finished(status, message);
}

pipeshard_status pipeshard_report(pipeshard_host* host, char* json, size_t capacity, size_t* length) {
    if (!host) return null_argument("host");
    return guarded(g_error, [&] {
        std::string result = host->runner->host().report();
        if (length) *length = result.size() + 1;
        if (!json || result.size() + 1 > capacity)
            pipeshard::fail(PIPESHARD_ERR_ARGUMENT, "the report buffer holds " + std::to_string(capacity) +
                                                        " bytes; " + std::to_string(result.size() + 1) + " are needed");
        std::memcpy(json, result.c_str(), result.size() + 1);
    });
}

const char* pipeshard_last_error(const pipeshard_host*) { return g_error.c_str(); }

const char* pipeshard_status_name(pipeshard_status status) {
    switch (status) {
        case PIPESHARD_OK: return "ok";
        case PIPESHARD_ERR_ARGUMENT: return "bad argument";
        case PIPESHARD_ERR_PACK: return "bad pack";
        case PIPESHARD_ERR_PLANS: return "bad plans file";
        case PIPESHARD_ERR_BUDGET: return "budget too small";
        case PIPESHARD_ERR_DEVICE: return "device not usable";
        case PIPESHARD_ERR_CONTEXT: return "context exceeded";
        case PIPESHARD_ERR_RUNTIME: return "runtime failure";
        case PIPESHARD_ERR_CANCELLED: return "cancelled";
    }
    return "unknown status";
}

void pipeshard_close(pipeshard_host* host) {
    if (!host || host->runner->on_worker()) return;  // from a callback it would wait for itself: not allowed
    std::set<pipeshard_session*> sessions;
    {
        std::lock_guard<std::mutex> lock(host->sessions_mutex);
        sessions.swap(host->sessions);
    }
    host->runner.reset();  // cancels and joins the worker; then the sessions' conversations go
    for (pipeshard_session* session : sessions) delete session;
    delete host;
}

}  // extern "C"
