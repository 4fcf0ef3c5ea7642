// CTest cases of the native host, through its C ABI only. EXPECTED is written by tests/test_native_host.py: the
// Python engine's greedy tokens for three prompts (all-CPU and with a saved plans file), the tokenizer's check
// strings with the `tokenizers` library's ids, and the files the bad-input cases use.
//   host_tests CASE EXTENSIONS_LIBRARY EXPECTED_JSON
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "json.hpp"
#include "pipeshard_host.h"
#include "sentences.hpp"

using pipeshard::Json;

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
    std::printf("%s %s\n", ok ? "ok  " : "FAIL", what.c_str());
    if (!ok) ++failures;
}

std::string join(const std::vector<int64_t>& ids) {
    std::string out;
    for (size_t i = 0; i < ids.size(); ++i) out += (i ? " " : "") + std::to_string(ids[i]);
    return out;
}

std::vector<int64_t> ids_of(const Json& list) {
    std::vector<int64_t> ids;
    for (const Json& item : list.items) ids.push_back(item.integer());
    return ids;
}

struct Collected {
    std::vector<int64_t> ids;
    std::string text;
    pipeshard_host* host = nullptr;
    size_t budget_after = 0;
    uint64_t budget_bytes = 0;
    bool free_vram = false;  // budget_bytes is the device's free memory (AUTO), not a budget
    int budget_status = -1;
    std::string report_at_first;
};

std::string report(pipeshard_host* host) {
    char buffer[8192];
    size_t length = 0;
    return pipeshard_report(host, buffer, sizeof buffer, &length) == PIPESHARD_OK ? buffer : "";
}

int collect(int64_t token, const char* piece, void* user_data) {
    auto* collected = static_cast<Collected*>(user_data);
    collected->ids.push_back(token);
    collected->text += piece;
    if (collected->host && collected->ids.size() == 1) collected->report_at_first = report(collected->host);
    if (collected->budget_after && collected->ids.size() == collected->budget_after)
        collected->budget_status = collected->free_vram ? pipeshard_set_free_vram(collected->host, collected->budget_bytes)
                                                        : pipeshard_set_vram_budget(collected->host, collected->budget_bytes);
    return 0;
}

// A folder under the system's temporary folder, made when missing.
std::string scratch_folder(const std::string& name) {
    std::error_code error;
    std::filesystem::path folder = std::filesystem::temp_directory_path(error) / name;
    std::filesystem::create_directories(folder, error);
    return folder.u8string();
}

bool has(const std::string& text, const std::string& fragment) { return text.find(fragment) != std::string::npos; }

uint64_t steps_of(const std::string& report) {
    size_t at = report.find("\"steps\": ");
    return at == std::string::npos ? 0 : std::strtoull(report.c_str() + at + 9, nullptr, 10);
}

pipeshard_host* open_host(const Json& expected, const std::string& extensions, bool planned, uint64_t budget = 0,
                          pipeshard_options options = {}) {
    if (options.abi_version == 0) pipeshard_default_options(&options);
    options.extensions_library = extensions.c_str();
    options.threads = static_cast<int>(expected.at("threads").integer());
    static std::string plans;
    plans = expected.at("plans").str();
    if (planned) {
        options.plans_path = plans.c_str();
        options.device = "sim";
        options.vram_budget_bytes = budget;
    }
    pipeshard_host* host = nullptr;
    pipeshard_status status = pipeshard_open(expected.at("pack").str().c_str(), &options, &host);
    std::string message = pipeshard_last_error(nullptr);
    expect(status == PIPESHARD_OK, std::string("open ") + (planned ? "with the plans file" : "all-CPU") + " " + message);
    return host;
}

pipeshard_sampling greedy(const Json& expected) {
    pipeshard_sampling sampling;
    pipeshard_default_sampling(&sampling);
    sampling.max_new_tokens = static_cast<int>(expected.at("max_new_tokens").integer());
    return sampling;
}

void compare_prompts(pipeshard_host* host, const Json& expected, const char* key) {
    pipeshard_sampling sampling = greedy(expected);
    for (const Json& prompt : expected.at("prompts").items) {
        Collected collected;
        pipeshard_status status = pipeshard_generate(host, prompt.at("text").str().c_str(), &sampling, collect, &collected);
        std::string message = pipeshard_last_error(host);
        std::vector<int64_t> want = ids_of(prompt.at(key));
        expect(status == PIPESHARD_OK && collected.ids == want,
               std::string(key) + " for \"" + prompt.at("text").str() + "\": host [" + join(collected.ids) +
                   "] python [" + join(want) + "] " + message);
        std::printf("     text: %s\n     report: %s\n", collected.text.c_str(), report(host).c_str());
    }
}

// A decode step runs joined sub-layer sessions with pipeshard's DecodeAttention (all-CPU: a few stretches; planned
// on sim: every attention the CPU EP computes swapped), as the Python engine's chain does.
void expect_decode_pieces(pipeshard_host* host, bool joined) {
    std::string now = report(host);
    auto number = [&](const char* key) {
        size_t at = now.find(std::string("\"") + key + "\": ");
        return at == std::string::npos ? 0 : std::strtoull(now.c_str() + at + std::strlen(key) + 4, nullptr, 10);
    };
    expect(number("decode_attention_nodes") > 0, "decode steps attend through DecodeAttention: " + now);
    if (joined)
        expect(number("decode_runs") > 0 && 3 * number("decode_runs") < number("units"),
               "decode steps run joined stretches of sub-layers: " + now);
}

int all_cpu_tokens(const Json& expected, const std::string& extensions) {
    pipeshard_host* host = open_host(expected, extensions, false);
    if (host) compare_prompts(host, expected, "cpu_tokens");
    if (host) expect_decode_pieces(host, true);
    pipeshard_close(host);
    return failures;
}

int planned_tokens(const Json& expected, const std::string& extensions) {
    pipeshard_host* host = open_host(expected, extensions, true);
    if (host) compare_prompts(host, expected, "planned_tokens");
    if (host) expect_decode_pieces(host, false);
    pipeshard_close(host);
    return failures;
}

int budget_ladder(const Json& expected, const std::string& extensions) {
    const Json& ladder = expected.at("ladder");
    pipeshard_host* host = open_host(expected, extensions, true);
    if (!host) return failures;
    const Json& prompt = expected.at("prompts").at(0);
    pipeshard_sampling sampling = greedy(expected);
    Collected collected;
    collected.host = host;
    collected.budget_after = static_cast<size_t>(ladder.at("budget_after").integer());
    collected.budget_bytes = static_cast<uint64_t>(ladder.at("small_budget_bytes").integer());
    pipeshard_status status = pipeshard_generate(host, prompt.at("text").str().c_str(), &sampling, collect, &collected);
    std::vector<int64_t> want = ids_of(prompt.at("planned_tokens"));
    std::string after = report(host);
    expect(status == PIPESHARD_OK && collected.budget_status == PIPESHARD_OK && collected.ids == want,
           "a budget change to the smaller rung after " + std::to_string(collected.budget_after) +
               " tokens keeps the tokens: host [" + join(collected.ids) + "] python [" + join(want) + "]");
    expect(after.find("\"rung_budget_bytes\": " + std::to_string(ladder.at("small_rung_bytes").integer())) !=
               std::string::npos, "the smaller rung runs after the change: " + after);
    status = pipeshard_release(host);
    expect(status == PIPESHARD_OK && has(report(host), "\"device_bytes\": 0,"), "release frees the device: " + report(host));
    expect(pipeshard_warmup(host) == PIPESHARD_OK && !has(report(host), "\"device_bytes\": 0,"),
           "warmup uploads the rung's weights again: " + report(host));
    status = pipeshard_set_vram_budget(host, static_cast<uint64_t>(expected.at("too_small_budget_bytes").integer()));
    for (int wait = 0; wait < 1000 && !has(report(host), "\"device_bytes\": 0,"); ++wait)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    expect(has(report(host), "\"device_bytes\": 0,"), "an idle host gives the memory back when its budget drops");
    Collected again;
    status = status == PIPESHARD_OK ? pipeshard_generate(host, prompt.at("text").str().c_str(), &sampling, collect, &again)
                                    : status;
    after = report(host);
    expect(status == PIPESHARD_OK && again.ids == want && has(after, "\"rung_budget_bytes\": 0,") &&
               has(after, "\"peak_device_bytes\""),
           "a budget below every rung of the file runs the all-CPU rung, with the same tokens: " + after);
    pipeshard_close(host);
    return failures;
}

// AUTO: the budget follows the free memory the game reports (a fake source here), less the reserve.
int auto_budget(const Json& expected, const std::string& extensions) {
    const Json& ladder = expected.at("ladder");
    uint64_t large = static_cast<uint64_t>(ladder.at("large_rung_bytes").integer());
    pipeshard_options options;
    pipeshard_default_options(&options);
    options.budget_mode = PIPESHARD_BUDGET_AUTO;
    options.vram_reserve_bytes = large;
    pipeshard_host* host = open_host(expected, extensions, true, 0, options);
    if (!host) return failures;
    expect(has(report(host), "\"rung_budget_bytes\": 0,"), "before any figure AUTO uses no device memory");
    expect(pipeshard_set_free_vram(host, 2 * large) == PIPESHARD_OK, "the game reports its free memory");
    const Json& prompt = expected.at("prompts").at(0);
    pipeshard_sampling sampling = greedy(expected);
    Collected collected;
    collected.host = host;
    collected.free_vram = true;
    collected.budget_after = static_cast<size_t>(ladder.at("budget_after").integer());
    collected.budget_bytes = 0;  // the free memory vanishes mid-generation
    pipeshard_status status = pipeshard_generate(host, prompt.at("text").str().c_str(), &sampling, collect, &collected);
    std::vector<int64_t> want = ids_of(prompt.at("planned_tokens"));
    std::string after = report(host);
    expect(has(collected.report_at_first, "\"rung_budget_bytes\": " + std::to_string(large) + ","),
           "free memory minus the reserve picks the large rung: " + collected.report_at_first);
    expect(status == PIPESHARD_OK && collected.ids == want, "the tokens stay the Python engine's: host [" +
                                                              join(collected.ids) + "] python [" + join(want) + "]");
    expect(has(after, "\"rung_budget_bytes\": 0,") && has(after, "\"device_bytes\": 0,"),
           "no free memory left: the all-CPU rung, no device memory held: " + after);
    pipeshard_close(host);
    return failures;
}

// ---- Requests, cancellation and sessions ------------------------------------------------------------------------

struct Done {
    std::mutex mutex;
    std::condition_variable ended;
    bool done = false;
    pipeshard_status status = PIPESHARD_OK;
    std::string message;
    std::chrono::steady_clock::time_point at;
    std::atomic<int> tokens{0};
    std::string pieces, text;  // what on_token saw; what on_done said
    std::vector<std::string> sentences;  // what on_sentence saw
    bool sentence_after_done = false;
};

int count_token(int64_t, const char* piece, void* user_data) {
    auto* done = static_cast<Done*>(user_data);
    ++done->tokens;
    done->pieces += piece;  // only the worker thread writes it
    return 0;
}

void on_done(pipeshard_request_id, pipeshard_status status, const char* text, const char* message, void* user_data) {
    auto* done = static_cast<Done*>(user_data);
    std::lock_guard<std::mutex> lock(done->mutex);
    done->text = text;
    done->at = std::chrono::steady_clock::now();
    done->status = status;
    done->message = message;
    done->done = true;
    done->ended.notify_all();
}

std::vector<int64_t> say(pipeshard_session* session, const std::string& text, const pipeshard_sampling& sampling,
                         pipeshard_status* status) {
    Collected collected;
    *status = pipeshard_session_say(session, text.c_str(), &sampling, collect, &collected);
    return collected.ids;
}

// What a fresh prefill of the whole history gives: the messages rendered, tokenized, generated from an empty cache.
std::vector<int64_t> fresh(pipeshard_host* host, const std::vector<std::pair<std::string, std::string>>& history,
                           pipeshard_sampling sampling) {
    std::vector<pipeshard_message> messages;
    for (const auto& [role, content] : history) messages.push_back({role.c_str(), content.c_str()});
    std::vector<char> text(1 << 16);
    size_t length = 0;
    std::vector<int64_t> ids(1 << 14);
    size_t count = 0;
    Collected collected;
    sampling.use_chat_template = 0;
    if (pipeshard_render_chat(host, messages.data(), messages.size(), text.data(), text.size(), &length) != PIPESHARD_OK ||
        pipeshard_tokenize(host, text.data(), ids.data(), ids.size(), &count) != PIPESHARD_OK ||
        pipeshard_generate_ids(host, ids.data(), count, &sampling, collect, &collected) != PIPESHARD_OK)
        expect(false, std::string("a fresh prefill of the history: ") + pipeshard_last_error(host));
    return collected.ids;
}

std::string text_of(pipeshard_host* host, const std::vector<int64_t>& ids) {
    std::vector<char> text(1 << 16);
    size_t length = 0;
    return pipeshard_detokenize(host, ids.data(), ids.size(), text.data(), text.size(), &length) == PIPESHARD_OK
               ? text.data() : "";
}

// Cancel during a long prefill: the request's on_done says so within 50 ms, and the session goes on.
int async_cancel(const Json& expected, const std::string& extensions) {
    pipeshard_options options;
    pipeshard_default_options(&options);
    options.context = 2560;
    pipeshard_host* host = open_host(expected, extensions, false, 0, options);
    if (!host) return failures;
    std::string long_text;
    while (long_text.size() < 9000) long_text += "The quick brown fox jumps over the lazy dog near the river bank. ";
    std::vector<int64_t> ids(8192);
    size_t count = 0;
    pipeshard_tokenize(host, long_text.c_str(), ids.data(), ids.size(), &count);
    expect(count >= 1900, "a long prompt of " + std::to_string(count) + " tokens");
    pipeshard_session* session = nullptr;
    expect(pipeshard_session_create(host, nullptr, &session) == PIPESHARD_OK, "a session");
    pipeshard_sampling sampling = greedy(expected);
    double worst_ms = 0;
    for (int round = 0; round < 3; ++round) {
        Done done;
        pipeshard_request_id request = 0;
        uint64_t steps_before = steps_of(report(host));
        pipeshard_status status = pipeshard_submit(host, session, long_text.c_str(), &sampling, count_token, on_done,
                                                   &done, &request);
        expect(status == PIPESHARD_OK && request != 0, "submit returns at once with a request id");
        // Cancel once the prefill is under way: its first chunk has run.
        while (steps_of(report(host)) < steps_before + 1)
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
        auto cancelled_at = std::chrono::steady_clock::now();
        pipeshard_cancel(host, request);
        {
            std::unique_lock<std::mutex> lock(done.mutex);
            done.ended.wait_for(lock, std::chrono::seconds(30), [&] { return done.done; });
        }
        double latency_ms = std::chrono::duration<double, std::milli>(done.at - cancelled_at).count();
        worst_ms = std::max(worst_ms, latency_ms);
        std::printf("     cancel latency during a %zu-token prefill (round %d): %.2f ms\n", count, round + 1, latency_ms);
        expect(done.done && done.status == PIPESHARD_ERR_CANCELLED && done.tokens == 0,
               "on_done reports the cancellation (" + std::string(pipeshard_status_name(done.status)) + ": " +
                   done.message + ")");
        expect(pipeshard_wait(host, request, 1000) == PIPESHARD_ERR_CANCELLED, "pipeshard_wait gives the same status");
    }
    expect(worst_ms < 50, "cancel to on_done within 50 ms: at most " + std::to_string(worst_ms) + " ms");
    pipeshard_status status = PIPESHARD_OK;
    size_t turns = 9;
    pipeshard_session_turns(session, &turns);
    expect(turns == 0, "a cancelled turn does not join the history");
    const Json& prompt = expected.at("prompts").at(0);
    std::vector<int64_t> answer = say(session, prompt.at("text").str(), sampling, &status);
    std::vector<int64_t> want = ids_of(prompt.at("cpu_tokens"));
    expect(status == PIPESHARD_OK && answer == want, "the session answers after: [" + join(answer) + "] python [" +
                                                          join(want) + "] " + pipeshard_last_error(host));
    // Queued behind a running request, a cancelled one is reported without running.
    Done first, second;
    pipeshard_request_id running = 0, queued = 0;
    pipeshard_submit(host, nullptr, prompt.at("text").str().c_str(), &sampling, count_token, on_done, &first, &running);
    pipeshard_submit(host, nullptr, prompt.at("text").str().c_str(), &sampling, count_token, on_done, &second, &queued);
    pipeshard_cancel(host, queued);
    expect(pipeshard_wait(host, running, -1) == PIPESHARD_OK && first.tokens > 0, "the request before it runs");
    pipeshard_status queued_status = pipeshard_wait(host, queued, -1);
    expect(queued_status == PIPESHARD_ERR_CANCELLED && second.tokens == 0,
           "a queued request cancelled: " + second.message);
    // A stop string: the answer ends before it, on_token and on_done alike.
    std::string whole = text_of(host, want);
    std::string stop = whole.substr(whole.size() / 2, 5);
    std::string before = whole.substr(0, whole.find(stop));
    const char* stops[] = {"no such text", stop.c_str()};
    pipeshard_sampling stopping = sampling;
    stopping.stop_strings = stops;
    stopping.stop_string_count = 2;
    Done stopped;
    pipeshard_request_id request = 0;
    pipeshard_submit(host, nullptr, prompt.at("text").str().c_str(), &stopping, count_token, on_done, &stopped, &request);
    pipeshard_status ended = pipeshard_wait(host, request, -1);
    expect(ended == PIPESHARD_OK && stopped.pieces == before && stopped.text == before,
           "the stop string \"" + stop + "\" ends the answer before it: \"" + stopped.pieces + "\" / \"" + stopped.text +
               "\"");
    pipeshard_session_close(session);
    pipeshard_close(host);
    return failures;
}

// A session and the history it has said, to check its answers against a fresh prefill of that history.
struct Character {
    pipeshard_session* session = nullptr;
    std::vector<std::pair<std::string, std::string>> history;
};

// Two characters over one host: the first without a system prompt, the second a pirate.
void create_characters(pipeshard_host* host, Character (&characters)[2]) {
    std::string pirate = "You are a pirate captain. Answer briefly.";
    pipeshard_session_create(host, nullptr, &characters[0].session);
    pipeshard_session_create(host, pirate.c_str(), &characters[1].session);
    characters[1].history.push_back({"system", pirate});
}

// Two characters over one host, turns alternating: each keeps its history, each answer is a fresh prefill's; a
// saved session continues as the original; a rolled-back turn is said again the same way.
int sessions(const Json& expected, const std::string& extensions) {
    pipeshard_host* host = open_host(expected, extensions, false);
    if (!host) return failures;
    for (const Json& render : expected.at("chat_renders").items) {
        std::vector<pipeshard_message> messages;
        for (const Json& message : render.at("messages").items)
            messages.push_back({message.at("role").str().c_str(), message.at("content").str().c_str()});
        std::vector<char> text(1 << 16);
        size_t length = 0;
        pipeshard_status status = pipeshard_render_chat(host, messages.data(), messages.size(), text.data(), text.size(),
                                                        &length);
        expect(status == PIPESHARD_OK && text.data() == render.at("text").str(),
               "a " + std::to_string(messages.size()) + "-message history renders as transformers' apply_chat_template");
    }
    pipeshard_sampling sampling = greedy(expected);
    sampling.max_new_tokens = static_cast<int>(expected.at("session_max_new_tokens").integer());
    const Json& prompts = expected.at("prompts");
    Character characters[2];
    create_characters(host, characters);
    for (int turn = 0; turn < 2; ++turn)
        for (int c = 0; c < 2; ++c) {
            Character& character = characters[c];
            std::string user = prompts.at(static_cast<size_t>((turn * 2 + c) % prompts.size())).at("text").str();
            pipeshard_status status;
            std::vector<int64_t> answer = say(character.session, user, sampling, &status);
            character.history.push_back({"user", user});
            std::vector<int64_t> want = fresh(host, character.history, sampling);
            expect(status == PIPESHARD_OK && answer == want && !answer.empty(),
                   "session " + std::to_string(c) + " turn " + std::to_string(turn + 1) + ": [" + join(answer) +
                       "] fresh prefill of its history [" + join(want) + "] " + pipeshard_last_error(host));
            character.history.push_back({"assistant", text_of(host, answer)});
        }
    size_t turns[2] = {0, 0};
    pipeshard_session_turns(characters[0].session, &turns[0]);
    pipeshard_session_turns(characters[1].session, &turns[1]);
    expect(turns[0] == 2 && turns[1] == 2, "each session holds its own two turns");

    std::string path = scratch_folder("pipeshard-host-test") + "/session.bin";
    expect(pipeshard_session_save(characters[1].session, path.c_str()) == PIPESHARD_OK,
           std::string("save a session: ") + pipeshard_last_error(host));
    pipeshard_session* restored = nullptr;
    expect(pipeshard_session_load(host, path.c_str(), &restored) == PIPESHARD_OK,
           std::string("load it: ") + pipeshard_last_error(host));
    std::string next = prompts.at(0).at("text").str();
    pipeshard_status status;
    std::vector<int64_t> original = say(characters[1].session, next, sampling, &status);
    std::vector<int64_t> again = restored ? say(restored, next, sampling, &status) : std::vector<int64_t>{};
    expect(status == PIPESHARD_OK && again == original && !original.empty(),
           "the restored session continues with the same tokens: [" + join(again) + "] [" + join(original) + "]");
    expect(pipeshard_session_rollback(characters[1].session) == PIPESHARD_OK, "roll back the last turn");
    std::vector<int64_t> redone = say(characters[1].session, next, sampling, &status);
    expect(status == PIPESHARD_OK && redone == original, "and say it again: [" + join(redone) + "]");
    pipeshard_session_close(restored);
    pipeshard_session_close(characters[0].session);
    pipeshard_close(host);  // closes the other session too
    return failures;
}

// ---- Sessions sharing decode steps ---------------------------------------------------------------------------

struct SharedTurn {
    Done done;
    std::vector<int64_t> ids;  // written by the worker only
    pipeshard_host* host = nullptr;
    size_t cancel_after = 0;  // cancel its own request after this many tokens (0: never)
    std::atomic<pipeshard_request_id> request{0};
};

int shared_token(int64_t token, const char* piece, void* user_data) {
    auto* turn = static_cast<SharedTurn*>(user_data);
    if (token >= 0) turn->ids.push_back(token);
    turn->done.pieces += piece;
    if (turn->cancel_after && turn->ids.size() == turn->cancel_after) pipeshard_cancel(turn->host, turn->request);
    return 0;
}

void shared_done(pipeshard_request_id request, pipeshard_status status, const char* text, const char* message,
                 void* user_data) {
    on_done(request, status, text, message, &static_cast<SharedTurn*>(user_data)->done);
}

void wait_for(SharedTurn& turn) {
    std::unique_lock<std::mutex> lock(turn.done.mutex);
    turn.done.ended.wait_for(lock, std::chrono::seconds(120), [&] { return turn.done.done; });
}

uint64_t shared_steps_of(const std::string& report) {
    size_t at = report.find("\"shared_steps\": ");
    return at == std::string::npos ? 0 : std::strtoull(report.c_str() + at + 16, nullptr, 10);
}

// Two characters' turns submitted together run in one decode step (sessions_per_step 2), all-CPU and planned on sim
// with a plans file made for batches of 2: each answer equals a fresh prefill of that session's history; a turn
// cancelled mid-answer leaves the other's answer and its own history as they were.
int shared_steps(const Json& expected, const std::string& extensions) {
    std::string batch_plans = expected.at("batch_plans").str();
    for (bool planned : {false, true}) {
        std::string where = planned ? "planned on sim: " : "all-CPU: ";
        pipeshard_options options;
        pipeshard_default_options(&options);
        options.sessions_per_step = 2;
        if (planned) {
            options.plans_path = batch_plans.c_str();
            options.device = "sim";
        }
        pipeshard_host* host = open_host(expected, extensions, false, 0, options);
        if (!host) return failures;
        pipeshard_sampling sampling = greedy(expected);
        sampling.max_new_tokens = static_cast<int>(expected.at("session_max_new_tokens").integer());
        const Json& prompts = expected.at("prompts");
        Character characters[2];
        create_characters(host, characters);
        for (int turn = 0; turn < 3; ++turn) {
            SharedTurn runs[2];
            std::string users[2];
            for (int c = 0; c < 2; ++c) {
                users[c] = prompts.at(static_cast<size_t>((turn * 2 + c) % prompts.size())).at("text").str();
                runs[c].host = host;
                runs[c].cancel_after = turn == 2 && c == 1 ? 3 : 0;  // the last turn of the pirate: cancelled
                pipeshard_request_id request = 0;
                expect(pipeshard_submit(host, characters[c].session, users[c].c_str(), &sampling, shared_token,
                                        shared_done, &runs[c], &request) == PIPESHARD_OK,
                       where + "submit a turn");
                runs[c].request = request;
            }
            for (SharedTurn& run : runs) wait_for(run);
            for (int c = 0; c < 2; ++c) {
                Character& character = characters[c];
                std::string which = where + "session " + std::to_string(c) + " turn " + std::to_string(turn + 1);
                if (runs[c].cancel_after) {
                    size_t turns = 0;
                    pipeshard_session_turns(character.session, &turns);
                    expect(runs[c].done.status == PIPESHARD_ERR_CANCELLED && turns == 2,
                           which + ": cancelled, its history unchanged (" + runs[c].done.message + ")");
                    pipeshard_status status;
                    users[c] += " Be brief.";
                    runs[c].ids = say(character.session, users[c], sampling, &status);
                    runs[c].done.status = status;
                }
                character.history.push_back({"user", users[c]});
                std::vector<int64_t> want = fresh(host, character.history, sampling);
                expect(runs[c].done.status == PIPESHARD_OK && runs[c].ids == want && !want.empty(),
                       which + ": [" + join(runs[c].ids) + "] fresh prefill of its history [" + join(want) + "] " +
                           runs[c].done.message);
                character.history.push_back({"assistant", text_of(host, runs[c].ids)});
            }
        }
        uint64_t shared = shared_steps_of(report(host));
        std::printf("     %s%llu decode steps shared by both sessions\n", where.c_str(),
                    static_cast<unsigned long long>(shared));
        expect(shared >= static_cast<uint64_t>(sampling.max_new_tokens), where + "turns shared steps: " + report(host));
        pipeshard_close(host);
    }
    return failures;
}

int tokenizer_round_trip(const Json& expected, const std::string& extensions) {
    pipeshard_host* host = open_host(expected, extensions, false);
    if (!host) return failures;
    for (const Json& check : expected.at("check_strings").items) {
        const std::string& text = check.at("text").str();
        std::vector<int64_t> ids(4096);
        size_t count = 0;
        pipeshard_status status = pipeshard_tokenize(host, text.c_str(), ids.data(), ids.size(), &count);
        ids.resize(status == PIPESHARD_OK ? count : 0);
        std::vector<int64_t> want = ids_of(check.at("ids"));
        expect(status == PIPESHARD_OK && ids == want, "tokenize \"" + text + "\": [" + join(ids) + "] want [" +
                                                          join(want) + "]");
        std::vector<char> decoded(4096);
        size_t length = 0;
        status = pipeshard_detokenize(host, want.data(), want.size(), decoded.data(), decoded.size(), &length);
        expect(status == PIPESHARD_OK && std::string(decoded.data()) == check.at("decoded").str(),
               "detokenize back to \"" + check.at("decoded").str() + "\": got \"" + decoded.data() + "\"");
    }
    pipeshard_close(host);
    return failures;
}

// The status of a call, then the host's message about it (read after the call).
void expect_status(pipeshard_status status, pipeshard_status want, const pipeshard_host* host, const std::string& what) {
    std::string message = pipeshard_last_error(host);
    expect(status == want && !message.empty(), what + " -> " + pipeshard_status_name(status) + ": " + message);
}

void expect_open_error(const std::string& what, const std::string& pack, pipeshard_options options,
                       pipeshard_status want) {
    pipeshard_host* host = nullptr;
    pipeshard_status status = pipeshard_open(pack.c_str(), &options, &host);
    std::string message = pipeshard_last_error(nullptr);
    expect(status == want && host == nullptr && !message.empty(),
           what + " -> " + pipeshard_status_name(status) + ": " + message);
    pipeshard_close(host);
}

int bad_input(const Json* expected, const std::string& extensions) {
    pipeshard_options options;
    pipeshard_default_options(&options);
    expect_open_error("a missing pack", "/nonexistent/pack", options, PIPESHARD_ERR_PACK);
    std::string scratch = scratch_folder("pipeshard-host-test");
    std::error_code error;
    std::filesystem::create_directories(scratch + "/corrupt", error);
    std::filesystem::create_directories(scratch + "/future", error);
    if (error) return ++failures;
    std::ofstream(scratch + "/corrupt/manifest.json") << "{\"schema_version\": 2, \"model\": {";
    expect_open_error("a corrupt manifest", scratch + "/corrupt", options, PIPESHARD_ERR_PACK);
    std::ofstream(scratch + "/future/manifest.json") << "{\"schema_version\": 99}";
    expect_open_error("a manifest of another schema", scratch + "/future", options, PIPESHARD_ERR_PACK);
    pipeshard_host* host = nullptr;
    expect_status(pipeshard_open(nullptr, &options, &host), PIPESHARD_ERR_ARGUMENT, nullptr, "a NULL pack");
    pipeshard_options old_abi = options;
    old_abi.abi_version = 0;
    expect_open_error("options not from pipeshard_default_options", "/nonexistent/pack", old_abi,
                      PIPESHARD_ERR_ARGUMENT);
    expect_status(pipeshard_generate(nullptr, "hi", nullptr, nullptr, nullptr), PIPESHARD_ERR_ARGUMENT, nullptr,
                  "generate without a host");
    if (!expected) return failures;

    std::string pack = expected->at("pack").str();
    std::string plans = expected->at("plans").str();
    std::string other_plans = expected->at("other_plans").str();
    pipeshard_options planned = options;
    planned.device = "sim";
    planned.plans_path = other_plans.c_str();
    expect_open_error("plans made for another pack", pack, planned, PIPESHARD_ERR_PLANS);
    planned.plans_path = "/nonexistent/plans.json";
    expect_open_error("a missing plans file", pack, planned, PIPESHARD_ERR_PLANS);
    planned.plans_path = plans.c_str();
    planned.budget_mode = 7;
    expect_open_error("an unknown budget mode", pack, planned, PIPESHARD_ERR_ARGUMENT);
    planned.budget_mode = PIPESHARD_BUDGET_FIXED;
    planned.prefill_chunk_tokens = -1;
    expect_open_error("a negative prefill chunk", pack, planned, PIPESHARD_ERR_ARGUMENT);
    planned.prefill_chunk_tokens = 0;
    planned.device = "cpu";
    expect_open_error("a plans file on the cpu device", pack, planned, PIPESHARD_ERR_ARGUMENT);
    planned.device = "tpu";
    expect_open_error("an unknown device", pack, planned, PIPESHARD_ERR_ARGUMENT);
    planned.device = "cuda";
    expect_open_error("cuda where there is none", pack, planned, PIPESHARD_ERR_DEVICE);
    pipeshard_options text = options;
    text.extensions_library = "/nonexistent/libortextensions.so";
    expect_open_error("a missing extensions library", pack, text, PIPESHARD_ERR_ARGUMENT);

    text.extensions_library = extensions.c_str();
    text.context = 64;
    text.threads = static_cast<int>(expected->at("threads").integer());
    if (pipeshard_open(pack.c_str(), &text, &host) != PIPESHARD_OK) {
        expect(false, std::string("open the pack: ") + pipeshard_last_error(nullptr));
        return failures;
    }
    pipeshard_sampling sampling;
    pipeshard_default_sampling(&sampling);
    sampling.max_new_tokens = 0;
    expect_status(pipeshard_generate(host, "Hello", &sampling, nullptr, nullptr), PIPESHARD_ERR_ARGUMENT, host,
                  "max_new_tokens 0");
    sampling.max_new_tokens = 64;
    expect_status(pipeshard_generate(host, "Hello", &sampling, nullptr, nullptr), PIPESHARD_ERR_CONTEXT, host,
                  "a prompt and answer beyond the context");
    int64_t outside[] = {1, 999999};
    sampling.max_new_tokens = 2;
    expect_status(pipeshard_generate_ids(host, outside, 2, &sampling, nullptr, nullptr), PIPESHARD_ERR_ARGUMENT, host,
                  "a token id outside the vocabulary");
    expect_status(pipeshard_set_vram_budget(host, 1), PIPESHARD_ERR_ARGUMENT, host, "a budget for an all-CPU host");
    int64_t ids[1];
    size_t count = 0;
    expect_status(pipeshard_tokenize(host, "a long enough text", ids, 1, &count), PIPESHARD_ERR_ARGUMENT, host,
                  "a too small ids buffer");
    expect(count > 1, "and the ids it needs are said: " + std::to_string(count));
    sampling.stop_string_count = 2;
    expect_status(pipeshard_generate(host, "Hello", &sampling, nullptr, nullptr), PIPESHARD_ERR_ARGUMENT, host,
                  "stop strings NULL with a count");
    const char* empty_stop[] = {""};
    sampling.stop_strings = empty_stop;
    sampling.stop_string_count = 1;
    expect_status(pipeshard_generate(host, "Hello", &sampling, nullptr, nullptr), PIPESHARD_ERR_ARGUMENT, host,
                  "an empty stop string");
    pipeshard_message reversed[] = {{"assistant", "Hi"}, {"user", "Hello"}};
    char text_buffer[4096];
    size_t length = 0;
    expect_status(pipeshard_render_chat(host, reversed, 2, text_buffer, sizeof text_buffer, &length),
                  PIPESHARD_ERR_ARGUMENT, host, "a conversation starting with the assistant");
    expect_status(pipeshard_wait(host, 123456, 0), PIPESHARD_ERR_ARGUMENT, host, "waiting for an unknown request");
    pipeshard_session* loaded = nullptr;
    std::ofstream(scratch + "/not-a-session.bin") << "pipeshard-session\n{\"schema_version\": 1, \"cached\": [";
    expect_status(pipeshard_session_load(host, (scratch + "/not-a-session.bin").c_str(), &loaded),
                  PIPESHARD_ERR_ARGUMENT, host, "a damaged session file");
    expect_status(pipeshard_session_load(host, "/nonexistent/session.bin", &loaded), PIPESHARD_ERR_ARGUMENT, host,
                  "a missing session file");
    pipeshard_session* session = nullptr;
    pipeshard_session_create(host, nullptr, &session);
    expect_status(pipeshard_session_rollback(session), PIPESHARD_ERR_ARGUMENT, host, "rolling back an empty session");
    struct Nested {
        pipeshard_host* host;
        pipeshard_status status = PIPESHARD_OK;
        std::string message;
    } nested{host};
    sampling.stop_strings = nullptr;
    sampling.stop_string_count = 0;
    sampling.max_new_tokens = 1;
    pipeshard_generate(host, "Hi", &sampling, [](int64_t, const char*, void* user) {
        auto* inner = static_cast<Nested*>(user);
        inner->status = pipeshard_generate(inner->host, "again", nullptr, nullptr, nullptr);
        inner->message = pipeshard_last_error(inner->host);
        return 0;
    }, &nested);
    expect(nested.status == PIPESHARD_ERR_ARGUMENT && !nested.message.empty(),
           "a blocking call from a callback is refused: " + nested.message);
    pipeshard_session_close(session);
    pipeshard_close(host);
    return failures;
}

// ---- Sentences ----

// `text` cut by a splitter fed in pieces of `size` bytes (0: whole), the remainder last when not empty.
std::vector<std::string> split(const std::string& text, size_t size) {
    pipeshard::SentenceSplitter splitter;
    std::vector<std::string> sentences;
    for (size_t at = 0; at < text.size(); at += size ? size : text.size())
        for (std::string& sentence : splitter.feed(text.substr(at, size ? size : text.size())))
            sentences.push_back(std::move(sentence));
    std::string rest = splitter.finish();
    if (!rest.empty()) sentences.push_back(rest);
    return sentences;
}

std::string quoted(const std::vector<std::string>& sentences) {
    std::string out;
    for (const std::string& sentence : sentences) {
        out += "[";
        for (char c : sentence)
            out += c == '\n' ? std::string("\\n") : c == '\t' ? std::string("\\t") : std::string(1, c);
        out += "]";
    }
    return out;
}

// A sentence other than the last ends as the splitter's rule says: a newline, or a mark before whitespace.
bool ends_a_sentence(const std::string& sentence, const std::string& next) {
    if (sentence.empty()) return false;
    if (sentence.back() == '\n') return true;
    bool ellipsis = sentence.size() >= 3 && sentence.compare(sentence.size() - 3, 3, "\xE2\x80\xA6") == 0;
    bool mark = std::strchr(".!?", sentence.back()) || ellipsis;
    return mark && !next.empty() && std::strchr(" \t\n\r\v\f", next.front());
}

// The splitter alone (no pack): crafted text, fed whole, byte by byte and in other cuts (an ellipsis cut inside).
int sentence_splitter() {
    struct Case {
        std::string text;
        std::vector<std::string> want;
    };
    const Case cases[] = {
        {"Hello there. How are you?  Fine!\nA list:\n\n1. One\xE2\x80\xA6 two...\tthree? 3.14 is pi.\"Quoted.\" End",
         {"Hello there.", " How are you?", "  Fine!", "\nA list:\n", "\n1.", " One\xE2\x80\xA6", " two...", "\tthree?",
          " 3.14 is pi.\"Quoted.\" End"}},
        {"Hi!", {"Hi!"}},
        {"Hi.\n", {"Hi.", "\n"}},
        {"Roses are red,\nviolets are blue.\n\nThe end.", {"Roses are red,\n", "violets are blue.", "\n\nThe end."}},
        {"\n\n  Wait\xE2\x80\xA6what? No. ", {"\n\n  Wait\xE2\x80\xA6what?", " No.", " "}},
        {"", {}},
    };
    for (const Case& c : cases)
        for (size_t size : {0, 1, 2, 3, 5, 7}) {
            std::vector<std::string> got = split(c.text, size);
            expect(got == c.want,
                   "pieces of " + std::to_string(size) + " bytes: " + quoted(got) + " want " + quoted(c.want));
        }
    return failures;
}

void on_sentence(pipeshard_request_id, const char* sentence, void* user_data) {
    auto* done = static_cast<Done*>(user_data);
    std::lock_guard<std::mutex> lock(done->mutex);
    done->sentences.push_back(sentence);
    if (done->done) done->sentence_after_done = true;
}

// A real generation's sentences (one-shot prompts and a session's turn): joined, the answer's text and the token
// pieces; each cut where the rule says; the same cut as the whole text fed at once.
int sentences(const Json& expected, const std::string& extensions) {
    pipeshard_host* host = open_host(expected, extensions, false);
    if (!host) return failures;
    pipeshard_session* session = nullptr;
    expect(pipeshard_session_create(host, nullptr, &session) == PIPESHARD_OK, "a session");
    pipeshard_sampling sampling = greedy(expected);
    sampling.max_new_tokens = 48;
    size_t sentences_seen = 0;
    for (const Json& prompt : expected.at("prompts").items)
        for (pipeshard_session* turn_of : {static_cast<pipeshard_session*>(nullptr), session}) {
            Done done;
            pipeshard_request_id request = 0;
            pipeshard_status status = pipeshard_submit_with_sentences(host, turn_of, prompt.at("text").str().c_str(),
                                                                      &sampling, count_token, on_sentence, on_done,
                                                                      &done, &request);
            expect(status == PIPESHARD_OK && pipeshard_wait(host, request, 120000) == PIPESHARD_OK,
                   "a request with sentences ends ok " + std::string(pipeshard_last_error(host)));
            std::string joined;
            bool cut_right = true;
            for (size_t i = 0; i < done.sentences.size(); ++i) {
                joined += done.sentences[i];
                if (i + 1 < done.sentences.size())
                    cut_right = cut_right && ends_a_sentence(done.sentences[i], done.sentences[i + 1]);
            }
            sentences_seen += done.sentences.size();
            std::string what =
                std::string(turn_of ? "session turn" : "one-shot") + " \"" + prompt.at("text").str() + "\": ";
            std::printf("     %s%s\n", what.c_str(), quoted(done.sentences).c_str());
            expect(!done.text.empty() && joined == done.text && joined == done.pieces,
                   what + "the sentences joined are the answer's text and the token pieces");
            expect(cut_right && done.sentences == split(done.text, 0), what + "each cut where a sentence ends");
            expect(!done.sentence_after_done, what + "every sentence before on_done");
        }
    expect(sentences_seen > 2 * expected.at("prompts").items.size(),
           "answers of several sentences: " + std::to_string(sentences_seen));
    // Without a sentence callback pipeshard_submit_with_sentences is pipeshard_submit.
    Done plain;
    pipeshard_request_id request = 0;
    pipeshard_submit_with_sentences(host, nullptr, expected.at("prompts").at(0).at("text").str().c_str(), &sampling,
                                    count_token, nullptr, on_done, &plain, &request);
    expect(pipeshard_wait(host, request, 120000) == PIPESHARD_OK && plain.sentences.empty() && !plain.pieces.empty(),
           "no sentence callback: tokens only");
    pipeshard_session_close(session);
    pipeshard_close(host);
    return failures;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 3) {
        std::fprintf(stderr, "usage: host_tests CASE EXTENSIONS_LIBRARY [EXPECTED_JSON]\n");
        return 2;
    }
    std::string which = argv[1], extensions = argv[2];
    std::string expected_path = argc > 3 ? argv[3] : "";
    Json expected;
    if (!expected_path.empty()) expected = Json::parse(pipeshard::read_file(expected_path));
    if (which == "bad-input") return bad_input(expected_path.empty() ? nullptr : &expected, extensions) ? 1 : 0;
    if (which == "sentence_splitter") return sentence_splitter() ? 1 : 0;
    if (expected_path.empty()) {
        std::fprintf(stderr, "%s needs EXPECTED_JSON\n", which.c_str());
        return 2;
    }
    int result = which == "all_cpu_tokens" ? all_cpu_tokens(expected, extensions)
                 : which == "planned_tokens" ? planned_tokens(expected, extensions)
                 : which == "budget_ladder" ? budget_ladder(expected, extensions)
                 : which == "auto_budget" ? auto_budget(expected, extensions)
                 : which == "async_cancel" ? async_cancel(expected, extensions)
                 : which == "sessions" ? sessions(expected, extensions)
                 : which == "shared_steps" ? shared_steps(expected, extensions)
                 : which == "sentences" ? sentences(expected, extensions)
                 : which == "tokenizer_round_trip" ? tokenizer_round_trip(expected, extensions) : -1;
    if (result < 0) {
        std::fprintf(stderr, "unknown case %s\n", which.c_str());
        return 2;
    }
    return result ? 1 : 0;
}
