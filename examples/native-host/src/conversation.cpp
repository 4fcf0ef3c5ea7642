// Conversations over one host (docs/native-host.md, "Sessions"): the chat template's multi-turn pieces, the KV
// cells of each conversation moved in and out of the host's cache, and a conversation's file.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "errors.hpp"
#include "host.hpp"

namespace pipeshard {

namespace {

constexpr const char* kSessionMagic = "pipeshard-session\n";
constexpr int kSessionSchemaVersion = 1;

std::string json_string(const std::string& text) {
    std::string out = "\"";
    for (unsigned char c : text) {
        if (c == '"' || c == '\\') {
            out += '\\';
            out += static_cast<char>(c);
        } else if (c < 0x20) {
            char escape[8];
            std::snprintf(escape, sizeof escape, "\\u%04x", c);
            out += escape;
        } else {
            out += static_cast<char>(c);
        }
    }
    return out + "\"";
}

}  // namespace

std::string Host::render_chat(const std::vector<Message>& messages) const {
    if (!has_chat_template_ || !chat_template_.has("conversation") || chat_template_.at("conversation").is_null())
        fail(PIPESHARD_ERR_PACK, manifest_.folder + "/chat_template.json has no multi-turn pieces (its template does "
                                 "more than paste messages in, or the pack predates them: partition it again)");
    const Json& pieces = chat_template_.at("conversation");
    std::string text;
    size_t first = 0;
    if (!messages.empty() && messages[0].role == "system") {
        text = pieces.at("system_before").str() + messages[0].content + pieces.at("system_after").str();
        first = 1;
    } else {
        text = pieces.at("first_user_before").str();
    }
    if (first == messages.size()) fail(PIPESHARD_ERR_ARGUMENT, "a conversation needs a user message");
    for (size_t i = first; i < messages.size(); ++i) {
        const std::string& want = (i - first) % 2 == 0 ? "user" : "assistant";
        if (messages[i].role != want)
            fail(PIPESHARD_ERR_ARGUMENT, "message " + std::to_string(i) + " is '" + messages[i].role + "': after an "
                                         "optional system message, user and assistant take turns, starting with user");
        bool last = i + 1 == messages.size();
        if (want == "assistant" && last) fail(PIPESHARD_ERR_ARGUMENT, "a conversation ends with a user message");
        text += messages[i].content;
        if (want == "assistant") text += pieces.at("assistant_after").str();
        else text += pieces.at(last ? "generation_prompt" : "user_after").str();
    }
    return text;
}

std::vector<Message> Host::history_with(const Conversation& conversation, const std::string& user) const {
    std::vector<Message> messages;
    if (conversation.has_system) messages.push_back({"system", conversation.system});
    messages.insert(messages.end(), conversation.turns.begin(), conversation.turns.end());
    messages.push_back({"user", user});
    return messages;
}

Answer Host::say(Conversation& conversation, const std::string& user, const Sampling& sampling,
                 const TokenSink& sink) {
    std::vector<int64_t> ids = tokenize(render_chat(history_with(conversation, user)));
    Answer answer = generate(ids, sampling, sink, &conversation);
    conversation.turns.push_back({"user", user});
    conversation.turns.push_back({"assistant", answer.text});
    return answer;
}

// ---- A conversation's cells in and out of the host's cache ------------------------------------------------------

void Host::sync_kv_to_host() {
    for (auto& [index, cache] : kv_)
        if (cache.on_device)
            for (size_t i = 0; i < cache.device.size(); ++i)
                device_->download(cache.host[i].data(), cache.device[i], cache.host[i].size());
}

void Host::sync_kv_to_device() {
    for (auto& [index, cache] : kv_)
        if (cache.on_device)
            for (size_t i = 0; i < cache.device.size(); ++i)
                device_->upload(cache.device[i], cache.host[i].data(), cache.host[i].size(), -1);
}

void Host::store_cells(Conversation& conversation, size_t sequence) {
    sync_kv_to_host();
    size_t positions = conversation.cached.size();
    conversation.kv.clear();
    for (auto& [index, cache] : kv_)
        for (size_t i = 0; i < cache.host.size(); ++i) {
            size_t row = positions * cache.position_bytes[i];
            size_t stride = static_cast<size_t>(capacity_) * cache.position_bytes[i];
            const uint8_t* first = cache.host[i].data() + sequence * cache.rows[i] * stride;
            std::vector<uint8_t> cells(cache.rows[i] * row);
            for (size_t r = 0; r < cache.rows[i]; ++r) std::memcpy(cells.data() + r * row, first + r * stride, row);
            conversation.kv.push_back(std::move(cells));
        }
}

void Host::load_cells(Conversation& conversation, size_t sequence) {
    size_t positions = conversation.cached.size(), buffer = 0;
    if (positions > static_cast<size_t>(capacity_)) {
        conversation.cached.clear();  // from a host with a longer context: fed again
        return;
    }
    for (auto& [index, cache] : kv_)
        for (size_t i = 0; i < cache.host.size(); ++i, ++buffer) {
            size_t row = positions * cache.position_bytes[i];
            if (buffer >= conversation.kv.size() || conversation.kv[buffer].size() != cache.rows[i] * row) {
                conversation.cached.clear();
                return;
            }
        }
    sync_kv_to_host();  // the other sequences' cells, when the cache is on the device
    buffer = 0;
    for (auto& [index, cache] : kv_)
        for (size_t i = 0; i < cache.host.size(); ++i, ++buffer) {
            size_t row = positions * cache.position_bytes[i];
            size_t stride = static_cast<size_t>(capacity_) * cache.position_bytes[i];
            uint8_t* first = cache.host[i].data() + sequence * cache.rows[i] * stride;
            for (size_t r = 0; r < cache.rows[i]; ++r)
                std::memcpy(first + r * stride, conversation.kv[buffer].data() + r * row, row);
        }
    conversation.kv.clear();
    sync_kv_to_device();
}

size_t Host::sequence_for(Conversation* conversation, const std::vector<size_t>& busy) {
    auto taken = [&](size_t s) { return std::find(busy.begin(), busy.end(), s) != busy.end(); };
    size_t chosen = sequences_;
    for (size_t s = 0; s < sequences_ && conversation && chosen == sequences_; ++s)
        if (owner_[s] == conversation) chosen = s;
    if (chosen == sequences_) {
        for (size_t s = 0; s < sequences_ && chosen == sequences_; ++s)  // a free one
            if (!owner_[s] && !taken(s)) chosen = s;
        if (chosen == sequences_)  // else the one used longest ago
            for (size_t s = 0; s < sequences_; ++s)
                if (!taken(s) && (chosen == sequences_ || last_used_[s] < last_used_[chosen])) chosen = s;
        if (chosen == sequences_) fail(PIPESHARD_ERR_ARGUMENT, "every sequence of the cache is in use");
        if (owner_[chosen]) store_cells(*owner_[chosen], chosen);
        owner_[chosen] = nullptr;
        if (conversation) load_cells(*conversation, chosen);
        owner_[chosen] = conversation;
    }
    last_used_[chosen] = ++uses_;
    return chosen;
}

void Host::forget(Conversation* conversation) {
    for (Conversation*& owner : owner_)
        if (owner == conversation) owner = nullptr;
}

// ---- A conversation's file: one header line of JSON, then its cells -----------------------------------------------

void Host::save(Conversation& conversation, const std::string& path) {
    for (size_t s = 0; s < sequences_; ++s)
        if (owner_[s] == &conversation) {
            store_cells(conversation, s);
            owner_[s] = nullptr;
        }
    std::ostringstream header;
    header << "{\"schema_version\": " << kSessionSchemaVersion << ", \"pack_manifest_sha256\": "
           << json_string(manifest_sha256_) << ", \"system\": " << (conversation.has_system ? json_string(conversation.system)
                                                                                         : std::string("null"))
           << ", \"turns\": [";
    for (size_t i = 0; i < conversation.turns.size(); ++i)
        header << (i ? ", " : "") << "{\"role\": " << json_string(conversation.turns[i].role)
               << ", \"content\": " << json_string(conversation.turns[i].content) << "}";
    header << "], \"cached\": [";
    for (size_t i = 0; i < conversation.cached.size(); ++i) header << (i ? ", " : "") << conversation.cached[i];
    header << "], \"kv_bytes\": [";
    for (size_t i = 0; i < conversation.kv.size(); ++i) header << (i ? ", " : "") << conversation.kv[i].size();
    header << "]}\n";
    std::string temporary = path + ".partial";
    {
        std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
        out << kSessionMagic << header.str();
        for (const auto& cells : conversation.kv)
            out.write(reinterpret_cast<const char*>(cells.data()), static_cast<std::streamsize>(cells.size()));
        if (!out.good()) {
            std::remove(temporary.c_str());
            fail(PIPESHARD_ERR_ARGUMENT, path + ": cannot be written");
        }
    }
    std::error_code error;
    std::filesystem::rename(std::filesystem::u8path(temporary), std::filesystem::u8path(path), error);
    if (error) {
        std::remove(temporary.c_str());
        fail(PIPESHARD_ERR_ARGUMENT, path + ": cannot be written");
    }
}

std::unique_ptr<Conversation> Host::load(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) fail(PIPESHARD_ERR_ARGUMENT, path + ": cannot be opened");
    std::string magic(std::strlen(kSessionMagic), '\0'), line;
    in.read(&magic[0], static_cast<std::streamsize>(magic.size()));
    if (!in || magic != kSessionMagic || !std::getline(in, line))
        fail(PIPESHARD_ERR_ARGUMENT, path + " is not a session file of pipeshard_session_save");
    auto conversation = std::make_unique<Conversation>();
    try {
        Json header = Json::parse(line);
        if (header.at("schema_version").integer() != kSessionSchemaVersion)
            fail(PIPESHARD_ERR_ARGUMENT, path + ": unsupported schema_version");
        if (header.at("pack_manifest_sha256").str() != manifest_sha256_)
            fail(PIPESHARD_ERR_ARGUMENT, path + " was saved with another pack than " + manifest_.folder);
        const Json& system = header.at("system");
        conversation->has_system = !system.is_null();
        if (conversation->has_system) conversation->system = system.str();
        const Json& turns = header.at("turns");
        for (size_t i = 0; i < turns.size(); ++i) {
            Message message{turns.at(i).at("role").str(), turns.at(i).at("content").str()};
            if (message.role != (i % 2 == 0 ? "user" : "assistant"))
                fail(PIPESHARD_ERR_ARGUMENT, path + ": turn " + std::to_string(i) + " has the role " + message.role);
            conversation->turns.push_back(message);
        }
        if (conversation->turns.size() % 2 != 0) fail(PIPESHARD_ERR_ARGUMENT, path + ": a turn has no answer");
        const Json& cached = header.at("cached");
        for (size_t i = 0; i < cached.size(); ++i) {
            int64_t id = cached.at(i).integer();
            if (id < 0 || id >= manifest_.vocab_size)
                fail(PIPESHARD_ERR_ARGUMENT, path + ": token id " + std::to_string(id) + " outside the vocabulary");
            conversation->cached.push_back(id);
        }
        const Json& sizes = header.at("kv_bytes");
        for (size_t i = 0; i < sizes.size(); ++i) {
            int64_t bytes = sizes.at(i).integer();
            if (bytes < 0 || bytes > (int64_t{1} << 40)) fail(PIPESHARD_ERR_ARGUMENT, path + ": kv_bytes out of range");
            std::vector<uint8_t> cells(static_cast<size_t>(bytes));
            in.read(reinterpret_cast<char*>(cells.data()), static_cast<std::streamsize>(cells.size()));
            if (!in) fail(PIPESHARD_ERR_ARGUMENT, path + " is shorter than its header says");
            conversation->kv.push_back(std::move(cells));
        }
    } catch (const JsonError& error) {
        fail(PIPESHARD_ERR_ARGUMENT, path + ": " + error.what());
    }
    return conversation;  // cells that do not fit this host's cache are dropped when it is loaded (fed again)
}

}  // namespace pipeshard
