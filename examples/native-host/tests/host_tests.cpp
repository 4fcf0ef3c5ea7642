// CTest cases of the native host, through its C ABI only. EXPECTED is written by tests/test_native_host.py: the
// Python engine's greedy tokens for three prompts (all-CPU and with a saved plans file), the tokenizer's check
// strings with the `tokenizers` library's ids, and the files the bad-input cases use.
//   host_tests CASE EXTENSIONS_LIBRARY EXPECTED_JSON
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "json.hpp"
#include "pipeshard_host.h"

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
    int budget_status = -1;
};

int collect(int64_t token, const char* piece, void* user_data) {
    auto* collected = static_cast<Collected*>(user_data);
    collected->ids.push_back(token);
    collected->text += piece;
    if (collected->budget_after && collected->ids.size() == collected->budget_after)
        collected->budget_status = pipeshard_set_vram_budget(collected->host, collected->budget_bytes);
    return 0;
}

std::string report(pipeshard_host* host) {
    char buffer[8192];
    size_t length = 0;
    return pipeshard_report(host, buffer, sizeof buffer, &length) == PIPESHARD_OK ? buffer : "";
}

pipeshard_host* open_host(const Json& expected, const std::string& extensions, bool planned, uint64_t budget = 0) {
    pipeshard_options options;
    pipeshard_default_options(&options);
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

int all_cpu_tokens(const Json& expected, const std::string& extensions) {
    pipeshard_host* host = open_host(expected, extensions, false);
    if (host) compare_prompts(host, expected, "cpu_tokens");
    pipeshard_close(host);
    return failures;
}

int planned_tokens(const Json& expected, const std::string& extensions) {
    pipeshard_host* host = open_host(expected, extensions, true);
    if (host) compare_prompts(host, expected, "planned_tokens");
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
    status = pipeshard_set_vram_budget(host, static_cast<uint64_t>(expected.at("too_small_budget_bytes").integer()));
    std::string refusal = pipeshard_last_error(host);
    expect(status == PIPESHARD_ERR_BUDGET && refusal.find("below every rung") != std::string::npos,
           "a budget below every rung is refused: " + refusal);
    Collected again;
    status = pipeshard_generate(host, prompt.at("text").str().c_str(), &sampling, collect, &again);
    expect(status == PIPESHARD_OK && again.ids == want, "and the host still generates the same tokens");
    pipeshard_close(host);
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
    std::string scratch = std::string(std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp") + "/pipeshard-host-test";
    std::string command = "mkdir -p '" + scratch + "/corrupt' '" + scratch + "/future'";
    if (std::system(command.c_str()) != 0) return ++failures;
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
    planned.vram_budget_bytes = static_cast<uint64_t>(expected->at("too_small_budget_bytes").integer());
    expect_open_error("a budget below every rung", pack, planned, PIPESHARD_ERR_BUDGET);
    planned.vram_budget_bytes = 0;
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
    if (expected_path.empty()) {
        std::fprintf(stderr, "%s needs EXPECTED_JSON\n", which.c_str());
        return 2;
    }
    int result = which == "all_cpu_tokens" ? all_cpu_tokens(expected, extensions)
                 : which == "planned_tokens" ? planned_tokens(expected, extensions)
                 : which == "budget_ladder" ? budget_ladder(expected, extensions)
                 : which == "tokenizer_round_trip" ? tokenizer_round_trip(expected, extensions) : -1;
    if (result < 0) {
        std::fprintf(stderr, "unknown case %s\n", which.c_str());
        return 2;
    }
    return result ? 1 : 0;
}
