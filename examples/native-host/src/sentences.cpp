#include "sentences.hpp"

namespace pipeshard {

namespace {

const char kEllipsis[] = "\xE2\x80\xA6";  // U+2026, 3 bytes in UTF-8

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

// The byte after a sentence-ending mark that ends at `at` (exclusive), or 0 when none ends there.
size_t mark_ending_at(const std::string& text, size_t at) {
    char last = text[at - 1];
    if (last == '.' || last == '!' || last == '?' || last == '\n') return at;
    if (at >= 3 && text.compare(at - 3, 3, kEllipsis) == 0) return at;
    return 0;
}

bool blank(const std::string& text, size_t length) {
    for (size_t i = 0; i < length; ++i)
        if (!is_space(text[i])) return false;
    return true;
}

}  // namespace

std::vector<std::string> SentenceSplitter::feed(const std::string& piece) {
    std::vector<std::string> sentences;
    pending_ += piece;
    for (size_t end = scanned_ + 1; end <= pending_.size(); ++end) {
        if (!mark_ending_at(pending_, end)) continue;
        // A newline ends a sentence where it is; a mark only before whitespace (so not "3.14", "..." mid-run or a
        // mark at the end of what came so far, which the next piece decides). A blank run joins the next sentence.
        bool newline = pending_[end - 1] == '\n';
        if (!newline && (end == pending_.size() || !is_space(pending_[end]))) {
            if (end == pending_.size()) break;
            continue;
        }
        if (blank(pending_, end)) continue;
        sentences.push_back(pending_.substr(0, end));
        pending_.erase(0, end);
        end = 0;
    }
    // The next piece may complete an ellipsis begun in the last two bytes, or decide a mark in the last one.
    scanned_ = pending_.size() > 3 ? pending_.size() - 3 : 0;
    return sentences;
}

std::string SentenceSplitter::finish() {
    std::string rest;
    rest.swap(pending_);
    scanned_ = 0;
    return rest;
}

}  // namespace pipeshard
