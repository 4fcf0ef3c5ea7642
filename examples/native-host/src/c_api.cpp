// The C ABI: every entry point catches what the library throws and turns it into a status and a message.
#include <cstring>
#include <new>
#include <string>

#include "errors.hpp"
#include "host.hpp"
#include "json.hpp"
#include "pipeshard_host.h"

struct pipeshard_host {
    pipeshard::Host* host;
    std::string last_error;
};

namespace {

thread_local std::string g_open_error;

template <typename Body>
pipeshard_status guarded(std::string& error, Body&& body) {
    try {
        body();
        error.clear();
        return PIPESHARD_OK;
    } catch (const pipeshard::HostError& failure) {
        error = failure.what();
        return failure.status;
    } catch (const pipeshard::JsonError& failure) {
        error = failure.what();
        return PIPESHARD_ERR_PACK;
    } catch (const std::bad_alloc&) {
        error = "out of memory";
        return PIPESHARD_ERR_RUNTIME;
    } catch (const std::exception& failure) {
        error = failure.what();
        return PIPESHARD_ERR_RUNTIME;
    } catch (...) {
        error = "unknown failure";
        return PIPESHARD_ERR_RUNTIME;
    }
}

pipeshard_status null_argument(pipeshard_host* host, const char* what) {
    std::string message = std::string(what) + " is NULL";
    if (host) host->last_error = message;
    else g_open_error = message;
    return PIPESHARD_ERR_ARGUMENT;
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
    if (!out_host) return null_argument(nullptr, "out_host");
    *out_host = nullptr;
    if (!pack_dir) return null_argument(nullptr, "pack_dir");
    pipeshard_options defaults;
    pipeshard_default_options(&defaults);
    const pipeshard_options& chosen = options ? *options : defaults;
    if (chosen.abi_version != PIPESHARD_HOST_ABI_VERSION) {
        g_open_error = "options.abi_version is " + std::to_string(chosen.abi_version) + ", this library speaks " +
                       std::to_string(PIPESHARD_HOST_ABI_VERSION) + " (call pipeshard_default_options first)";
        return PIPESHARD_ERR_ARGUMENT;
    }
    return guarded(g_open_error, [&] {
        auto* handle = new pipeshard_host{nullptr, {}};
        try {
            handle->host = new pipeshard::Host(pack_dir, chosen);
        } catch (...) {
            delete handle;
            throw;
        }
        *out_host = handle;
    });
}

pipeshard_status pipeshard_generate(pipeshard_host* host, const char* prompt, const pipeshard_sampling* sampling,
                                    pipeshard_token_callback callback, void* user_data) {
    if (!host) return null_argument(nullptr, "host");
    if (!prompt) return null_argument(host, "prompt");
    pipeshard_sampling defaults;
    pipeshard_default_sampling(&defaults);
    const pipeshard_sampling& chosen = sampling ? *sampling : defaults;
    return guarded(host->last_error, [&] {
        host->host->generate(host->host->prompt_ids(prompt, chosen), chosen, callback, user_data);
    });
}

pipeshard_status pipeshard_generate_ids(pipeshard_host* host, const int64_t* prompt_ids, size_t prompt_length,
                                        const pipeshard_sampling* sampling, pipeshard_token_callback callback,
                                        void* user_data) {
    if (!host) return null_argument(nullptr, "host");
    if (!prompt_ids && prompt_length) return null_argument(host, "prompt_ids");
    pipeshard_sampling defaults;
    pipeshard_default_sampling(&defaults);
    const pipeshard_sampling& chosen = sampling ? *sampling : defaults;
    return guarded(host->last_error, [&] {
        host->host->generate(std::vector<int64_t>(prompt_ids, prompt_ids + prompt_length), chosen, callback, user_data);
    });
}

pipeshard_status pipeshard_tokenize(pipeshard_host* host, const char* text, int64_t* ids, size_t capacity,
                                    size_t* count) {
    if (!host) return null_argument(nullptr, "host");
    if (!text) return null_argument(host, "text");
    return guarded(host->last_error, [&] {
        std::vector<int64_t> result = host->host->tokenize(text);
        if (count) *count = result.size();
        if (result.size() > capacity || (!ids && !result.empty()))
            pipeshard::fail(PIPESHARD_ERR_ARGUMENT, "the ids buffer holds " + std::to_string(capacity) + " ids; " +
                                                        std::to_string(result.size()) + " are needed");
        std::copy(result.begin(), result.end(), ids);
    });
}

pipeshard_status pipeshard_detokenize(pipeshard_host* host, const int64_t* ids, size_t count, char* text,
                                      size_t capacity, size_t* length) {
    if (!host) return null_argument(nullptr, "host");
    if (!ids && count) return null_argument(host, "ids");
    return guarded(host->last_error, [&] {
        std::string result = host->host->detokenize(std::vector<int64_t>(ids, ids + count));
        if (length) *length = result.size() + 1;
        if (!text || result.size() + 1 > capacity)
            pipeshard::fail(PIPESHARD_ERR_ARGUMENT, "the text buffer holds " + std::to_string(capacity) + " bytes; " +
                                                        std::to_string(result.size() + 1) + " are needed");
        std::memcpy(text, result.c_str(), result.size() + 1);
    });
}

pipeshard_status pipeshard_set_vram_budget(pipeshard_host* host, uint64_t budget_bytes) {
    if (!host) return null_argument(nullptr, "host");
    std::string error;
    pipeshard_status status = guarded(error, [&] { host->host->set_vram_budget(budget_bytes); });
    if (status != PIPESHARD_OK) host->last_error = error;  // another thread may be generating: leave its error be
    return status;
}

pipeshard_status pipeshard_report(pipeshard_host* host, char* json, size_t capacity, size_t* length) {
    if (!host) return null_argument(nullptr, "host");
    return guarded(host->last_error, [&] {
        std::string result = host->host->report();
        if (length) *length = result.size() + 1;
        if (!json || result.size() + 1 > capacity)
            pipeshard::fail(PIPESHARD_ERR_ARGUMENT, "the report buffer holds " + std::to_string(capacity) +
                                                        " bytes; " + std::to_string(result.size() + 1) + " are needed");
        std::memcpy(json, result.c_str(), result.size() + 1);
    });
}

const char* pipeshard_last_error(const pipeshard_host* host) {
    return host ? host->last_error.c_str() : g_open_error.c_str();
}

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
    }
    return "unknown status";
}

void pipeshard_close(pipeshard_host* host) {
    if (!host) return;
    delete host->host;
    delete host;
}

}  // extern "C"
