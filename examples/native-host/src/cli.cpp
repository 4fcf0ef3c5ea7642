// pipeshard-host: the C ABI from the command line.
//   pipeshard-host PACK "prompt" [--plans FILE --device sim|cuda [--vram SIZE]] [--extensions LIB] [--threads N]
//                  [--context N] [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P]
//                  [--repetition-penalty R] [--seed S] [--system TEXT] [--no-chat-template] [--ids 1,2,3]
//                  [--budget-after N:SIZE] [--auto-reserve SIZE] [--stop TEXT]... [--print-ids] [--report]
//                  [--image FILE.ppm]...
// --image takes binary PPM files (P6, 8 bits a channel: `convert photo.jpg photo.ppm`, or Pillow's save as .ppm),
// the host's raw RGB input with a small header; the CLI decodes no other format.
// Bad input: one line starting with "error:" on stderr, exit status 2.
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "pipeshard_host.h"

namespace {

int error(const std::string& message) {
    std::fprintf(stderr, "error: %s\n", message.c_str());
    return 2;
}

bool parse_size(const std::string& text, uint64_t* bytes) {
    char* end = nullptr;
    double value = std::strtod(text.c_str(), &end);
    if (end == text.c_str() || !(value > 0 && value < 1e18)) return false;  // 0 would mean "the largest rung"
    std::string unit(end);
    double scale = unit.empty() || unit == "B" ? 1 : unit == "KiB" ? 1024.0 : unit == "MiB" ? 1048576.0
                   : unit == "GiB" ? 1073741824.0 : -1;
    if (scale < 0) return false;
    *bytes = static_cast<uint64_t>(value * scale);
    return true;
}

// A whole number from `least` to `most`, all of `text`; a number from `least` to `most` for parse_number.
bool parse_int(const char* text, int least, int most, int* out) {
    char* end = nullptr;
    long value = std::strtol(text, &end, 10);
    if (end == text || *end != '\0' || value < least || value > most) return false;
    *out = static_cast<int>(value);
    return true;
}

bool parse_number(const char* text, float least, float most, float* out) {
    char* end = nullptr;
    float value = std::strtof(text, &end);
    if (end == text || *end != '\0' || !(value >= least && value <= most)) return false;  // NaN fails here
    *out = value;
    return true;
}

struct Image {
    int width = 0, height = 0;
    std::vector<uint8_t> rgb;
};

// A binary PPM (P6, maxval 255): its pixels as the C ABI takes them; false with `why` otherwise.
bool read_ppm(const std::string& path, Image* image, std::string* why) {
    std::ifstream in(path, std::ios::binary);
    if (!in) {
        *why = path + ": cannot be opened";
        return false;
    }
    auto field = [&in]() -> std::string {  // the next header field, past whitespace and # comments
        std::string token;
        for (int c = in.get(); c != EOF; c = in.get()) {
            if (c == '#' && token.empty()) {
                while (c != EOF && c != '\n') c = in.get();
            } else if (std::isspace(c)) {
                if (!token.empty()) return token;
            } else {
                token += static_cast<char>(c);
            }
        }
        return token;
    };
    std::string magic = field(), width = field(), height = field(), maxval = field();
    int w = 0, h = 0;
    if (magic != "P6" || !parse_int(width.c_str(), 1, 32768, &w) || !parse_int(height.c_str(), 1, 32768, &h) ||
        maxval != "255") {
        *why = path + " is not a binary PPM of 8-bit RGB (P6, maxval 255): the CLI reads no other image format";
        return false;
    }
    image->width = w;
    image->height = h;
    image->rgb.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    if (image->rgb.size() < static_cast<size_t>(w) * h * 3) {
        *why = path + " is truncated (" + std::to_string(w) + "x" + std::to_string(h) + " pixels announced)";
        return false;
    }
    image->rgb.resize(static_cast<size_t>(w) * h * 3);
    return true;
}

struct Session {
    pipeshard_host* host = nullptr;
    bool print_ids = false;
    std::vector<int64_t> ids;
    int budget_after = -1;
    uint64_t budget_bytes = 0;
    int budget_status = PIPESHARD_OK;
};

int on_token(int64_t token_id, const char* piece, void* user_data) {
    auto* session = static_cast<Session*>(user_data);
    if (token_id >= 0) session->ids.push_back(token_id);  // -1: text held back while it could begin a stop string
    if (!session->print_ids) {
        std::fputs(piece, stdout);
        std::fflush(stdout);
    }
    if (static_cast<int>(session->ids.size()) == session->budget_after) {
        session->budget_status = pipeshard_set_vram_budget(session->host, session->budget_bytes);
        if (session->budget_status != PIPESHARD_OK)
            std::fprintf(stderr, "warning: %s\n", pipeshard_last_error(session->host));
    }
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    pipeshard_options options;
    pipeshard_default_options(&options);
    pipeshard_sampling sampling;
    pipeshard_default_sampling(&sampling);
    std::vector<std::string> positional;
    std::vector<int64_t> prompt_ids;
    bool report = false;
    Session session;
    std::vector<const char*> stops;
    std::vector<Image> images;
    for (int i = 1; i < argc; ++i) {
        std::string arg = argv[i];
        auto value = [&]() -> const char* {
            if (i + 1 >= argc) return nullptr;
            return argv[++i];
        };
        const char* v = nullptr;
        if (arg == "--print-ids") { session.print_ids = true; continue; }
        if (arg == "--report") { report = true; continue; }
        if (arg == "--no-chat-template") { sampling.use_chat_template = 0; continue; }
        if (arg.rfind("--", 0) != 0) { positional.push_back(arg); continue; }
        if (!(v = value())) return error(arg + " needs a value");
        if (arg == "--plans") options.plans_path = v;
        else if (arg == "--device") options.device = v;
        else if (arg == "--extensions") options.extensions_library = v;
        else if (arg == "--threads") { if (!parse_int(v, 0, 1024, &options.threads)) return error("--threads: a whole number from 0 (all cores) to 1024, not " + std::string(v)); }
        else if (arg == "--context") { if (!parse_int(v, 0, 1 << 24, &options.context)) return error("--context: a number of tokens, not " + std::string(v)); }
        else if (arg == "--vram") { if (!parse_size(v, &options.vram_budget_bytes)) return error("--vram: not a size above 0 (600MiB, 2GiB): " + std::string(v)); }
        else if (arg == "--max-new-tokens") { if (!parse_int(v, 1, 1 << 24, &sampling.max_new_tokens)) return error("--max-new-tokens: a whole number from 1, not " + std::string(v)); }
        else if (arg == "--temperature") { if (!parse_number(v, 0, 100, &sampling.temperature)) return error("--temperature: a number from 0 to 100, not " + std::string(v)); }
        else if (arg == "--top-k") { if (!parse_int(v, 0, 1 << 24, &sampling.top_k)) return error("--top-k: a whole number from 0 (off), not " + std::string(v)); }
        else if (arg == "--top-p") { if (!parse_number(v, 1e-9f, 1, &sampling.top_p)) return error("--top-p: a number in (0, 1], not " + std::string(v)); }
        else if (arg == "--repetition-penalty") { if (!parse_number(v, 1e-3f, 100, &sampling.repetition_penalty)) return error("--repetition-penalty: a number from 0.001 to 100, not " + std::string(v)); }
        else if (arg == "--seed") sampling.seed = std::strtoull(v, nullptr, 10);
        else if (arg == "--system") sampling.system_prompt = v;
        else if (arg == "--stop") stops.push_back(v);
        else if (arg == "--image") {
            std::string why;
            images.emplace_back();
            if (!read_ppm(v, &images.back(), &why)) return error("--image: " + why);
        }
        else if (arg == "--auto-reserve") {
            if (!parse_size(v, &options.vram_reserve_bytes)) return error("--auto-reserve: not a size above 0 (1GiB): " + std::string(v));
            options.budget_mode = PIPESHARD_BUDGET_AUTO;
        }
        else if (arg == "--ids") {
            std::stringstream in(v);
            std::string part;
            while (std::getline(in, part, ',')) prompt_ids.push_back(std::atoll(part.c_str()));
        } else if (arg == "--budget-after") {
            std::string spec = v;
            size_t colon = spec.find(':');
            if (colon == std::string::npos || !parse_size(spec.substr(colon + 1), &session.budget_bytes))
                return error("--budget-after: give TOKENS:SIZE, e.g. 8:600MiB");
            session.budget_after = std::atoi(spec.substr(0, colon).c_str());
        } else {
            return error("unknown option " + arg);
        }
    }
    if (positional.empty() || (positional.size() < 2 && prompt_ids.empty()))
        return error("usage: pipeshard-host PACK PROMPT [options] (or --ids 1,2,3 instead of PROMPT)");
    sampling.stop_strings = stops.data();
    sampling.stop_string_count = stops.size();
    if (pipeshard_open(positional[0].c_str(), &options, &session.host) != PIPESHARD_OK)
        return error(pipeshard_last_error(nullptr));
    if (!images.empty() && !prompt_ids.empty()) return error("--image needs a text prompt, not --ids");
    std::vector<pipeshard_image> views;
    for (const Image& image : images) views.push_back({image.rgb.data(), image.width, image.height});
    const char* prompt = positional.size() > 1 ? positional[1].c_str() : nullptr;
    pipeshard_status status =
        !images.empty() ? pipeshard_generate_with_images(session.host, prompt, views.data(), views.size(), &sampling,
                                                         on_token, &session)
        : prompt_ids.empty()
            ? pipeshard_generate(session.host, prompt, &sampling, on_token, &session)
            : pipeshard_generate_ids(session.host, prompt_ids.data(), prompt_ids.size(), &sampling, on_token, &session);
    if (status != PIPESHARD_OK) {
        int code = error(pipeshard_last_error(session.host));
        pipeshard_close(session.host);
        return code;
    }
    if (session.print_ids) {
        for (size_t i = 0; i < session.ids.size(); ++i) std::printf("%s%lld", i ? " " : "", (long long)session.ids[i]);
    }
    std::printf("\n");
    if (report) {
        std::vector<char> json(8192);
        size_t length = 0;
        if (pipeshard_report(session.host, json.data(), json.size(), &length) == PIPESHARD_OK)
            std::fprintf(stderr, "%s\n", json.data());
    }
    pipeshard_close(session.host);
    return session.budget_status == PIPESHARD_OK ? 0 : 2;
}
