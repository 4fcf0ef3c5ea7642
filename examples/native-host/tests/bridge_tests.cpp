// CTest case unreal_bridge: the Unreal module's engine-independent half (unreal/Source/Pipeshard/Private/
// PipeshardBridge.cpp) with the real host, this thread playing the game thread: it sleeps until the bridge's notify
// (called on the host's worker) says events are queued, then drains them, as UPipeshardComponent's AsyncTask does.
//   bridge_tests EXTENSIONS_LIBRARY EXPECTED_JSON   (tests/test_native_host.py's)
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "PipeshardBridge.h"
#include "json.hpp"

using pipeshard::Json;
using pipeshard_unreal::Event;
using pipeshard_unreal::EventKind;

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
    std::printf("%s %s\n", ok ? "ok  " : "FAIL", what.c_str());
    if (!ok) ++failures;
}

// The game thread's side: notify wakes it (from the worker), it drains on its own thread.
struct GameThread {
    std::mutex mutex;
    std::condition_variable wake;
    bool scheduled = false;
    int notifies = 0;
    bool notified_off_game_thread = true;
    std::thread::id id = std::this_thread::get_id();

    void notify() {
        std::lock_guard<std::mutex> lock(mutex);
        scheduled = true;
        ++notifies;
        if (std::this_thread::get_id() == id) notified_off_game_thread = false;
        wake.notify_one();
    }

    // Events until `request` finishes (or 120 s pass), drained in batches as the game thread would.
    std::vector<Event> until_finished(pipeshard_unreal::Bridge& bridge, int64_t request, int* drains) {
        std::vector<Event> events;
        auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
        for (;;) {
            {
                std::unique_lock<std::mutex> lock(mutex);
                if (!wake.wait_until(lock, deadline, [&] { return scheduled; })) return events;
                scheduled = false;
            }
            ++*drains;
            for (Event& event : bridge.Drain()) {
                bool last = event.kind == EventKind::Finished && event.request == request;
                events.push_back(std::move(event));
                if (last) return events;
            }
        }
    }
};

std::vector<int64_t> ids_of(const Json& list) {
    std::vector<int64_t> ids;
    for (const Json& item : list.items) ids.push_back(item.integer());
    return ids;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 3) {
        std::fprintf(stderr, "usage: bridge_tests EXTENSIONS_LIBRARY EXPECTED_JSON\n");
        return 2;
    }
    Json expected = Json::parse(pipeshard::read_file(argv[2]));
    GameThread game;
    pipeshard_unreal::Bridge bridge([&game] { game.notify(); });
    pipeshard_sampling sampling;
    pipeshard_default_sampling(&sampling);
    sampling.max_new_tokens = static_cast<int>(expected.at("max_new_tokens").integer());
    bool refused = bridge.Submit("Hello", sampling) == 0;
    expect(refused && !bridge.LastError().empty(), "Submit before Open is refused: " + bridge.LastError());

    pipeshard_unreal::BridgeOptions options;
    options.pack_dir = expected.at("pack").str();
    options.extensions_library = argv[1];
    options.threads = static_cast<int>(expected.at("threads").integer());
    bool opened = bridge.Open(options);
    expect(opened, "Open " + bridge.LastError());

    // One-shot prompts: the Python engine's tokens, events in order, sentences joined = the answer.
    for (const Json& prompt : expected.at("prompts").items) {
        int drains = 0;
        int64_t request = bridge.Submit(prompt.at("text").str(), sampling);
        std::vector<Event> events = game.until_finished(bridge, request, &drains);
        std::vector<int64_t> ids;
        std::string pieces, sentences;
        bool ordered = !events.empty() && events.back().kind == EventKind::Finished;
        for (size_t i = 0; i < events.size(); ++i) {
            bool in_place = events[i].kind != EventKind::Finished || i + 1 == events.size();
            ordered = ordered && events[i].request == request && in_place;
            if (events[i].kind == EventKind::Token) ids.push_back(events[i].token_id), pieces += events[i].text;
            if (events[i].kind == EventKind::Sentence) sentences += events[i].text;
        }
        const Event& finished = events.empty() ? Event{EventKind::Finished, 0, ""} : events.back();
        std::string what = "\"" + prompt.at("text").str() + "\": ";
        expect(request > 0 && ordered && finished.status == PIPESHARD_OK,
               what + std::to_string(events.size()) + " events in order, Finished last, in " + std::to_string(drains) +
                   " drains");
        expect(ids == ids_of(prompt.at("cpu_tokens")), what + "the Python engine's tokens");
        expect(pieces == finished.text && sentences == finished.text, what + "tokens and sentences make the answer");
    }
    expect(game.notified_off_game_thread, "notify comes from the host's worker, never the game thread");
    expect(bridge.RequestsRunning() == 0, "no request left running");

    // A conversation, a cancel, a budget, and closing with a request running.
    bool started = bridge.StartConversation("You are the castle guard. Answer briefly.");
    expect(started, "StartConversation " + bridge.LastError());
    sampling.max_new_tokens = 512;
    int drains = 0;
    int64_t running = bridge.Submit("Tell me a very long story about the castle, its kings and its wars.", sampling);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    bool cancelled = bridge.Cancel(running);
    expect(cancelled, "Cancel");
    std::vector<Event> events = game.until_finished(bridge, running, &drains);
    expect(!events.empty() && events.back().status == PIPESHARD_ERR_CANCELLED,
           "a cancelled request finishes cancelled after " + std::to_string(events.size() - 1) +
               " token/sentence events");
    expect(bridge.Cancel(running), "cancelling an ended request is no error");
    sampling.max_new_tokens = 8;
    int64_t turn = bridge.Submit("Who goes there?", sampling);
    events = game.until_finished(bridge, turn, &drains);
    expect(!events.empty() && events.back().status == PIPESHARD_OK && !events.back().text.empty(),
           "the conversation answers after the cancel: " + (events.empty() ? "" : events.back().text));
    bool budget_set = bridge.SetVramBudget(0);
    expect(!budget_set && !bridge.LastError().empty(), "an all-CPU host takes no budget: " + bridge.LastError());

    // Reopened with the plans file on sim: a 0-byte budget runs the all-CPU rung, with the same tokens.
    options.plans_path = expected.at("plans").str();
    options.device = "sim";
    opened = bridge.Open(options);
    expect(opened, "Open with the plans file " + bridge.LastError());
    budget_set = bridge.SetVramBudget(0);
    expect(budget_set, "SetVramBudget(0) " + bridge.LastError());
    sampling.max_new_tokens = static_cast<int>(expected.at("max_new_tokens").integer());
    const Json& first = expected.at("prompts").at(0);
    events = game.until_finished(bridge, bridge.Submit(first.at("text").str(), sampling), &drains);
    std::vector<int64_t> ids;
    for (const Event& event : events)
        if (event.kind == EventKind::Token) ids.push_back(event.token_id);
    expect(ids == ids_of(first.at("cpu_tokens")), "the all-CPU rung gives the Python engine's tokens");
    bridge.Submit("And then?", sampling);
    std::printf("     %d notifies for the game thread's drains\n", game.notifies);
    return failures ? 1 : 0;  // the bridge closes with a request queued or running: no callback after
}
