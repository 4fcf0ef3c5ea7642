#include "json.hpp"

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace pipeshard {
namespace {

class Parser {
public:
    explicit Parser(const std::string& source) : s_(source) {}

    Json document() {
        Json value = parse_value(0);
        skip_space();
        if (pos_ != s_.size()) fail("text after the document");
        return value;
    }

private:
    const std::string& s_;
    size_t pos_ = 0;

    [[noreturn]] void fail(const std::string& what) const {
        throw JsonError("invalid JSON at byte " + std::to_string(pos_) + ": " + what);
    }

    void skip_space() {
        while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\n' || s_[pos_] == '\r' || s_[pos_] == '\t')) ++pos_;
    }

    char peek() {
        skip_space();
        if (pos_ >= s_.size()) fail("unexpected end");
        return s_[pos_];
    }

    void expect(const char* word) {
        for (const char* c = word; *c; ++c, ++pos_)
            if (pos_ >= s_.size() || s_[pos_] != *c) fail(std::string("expected ") + word);
    }

    Json parse_value(int depth) {
        if (depth > 64) fail("nested too deep");
        Json value;
        char c = peek();
        if (c == '{') {
            value.kind = Json::Kind::Object;
            ++pos_;
            if (peek() == '}') { ++pos_; return value; }
            while (true) {
                if (peek() != '"') fail("expected a field name");
                std::string key = parse_string();
                if (peek() != ':') fail("expected ':'");
                ++pos_;
                value.fields[key] = parse_value(depth + 1);
                char next = peek();
                ++pos_;
                if (next == '}') break;
                if (next != ',') fail("expected ',' or '}'");
            }
        } else if (c == '[') {
            value.kind = Json::Kind::Array;
            ++pos_;
            if (peek() == ']') { ++pos_; return value; }
            while (true) {
                value.items.push_back(parse_value(depth + 1));
                char next = peek();
                ++pos_;
                if (next == ']') break;
                if (next != ',') fail("expected ',' or ']'");
            }
        } else if (c == '"') {
            value.kind = Json::Kind::String;
            value.text = parse_string();
        } else if (c == 't') {
            expect("true");
            value.kind = Json::Kind::Bool;
            value.boolean = true;
        } else if (c == 'f') {
            expect("false");
            value.kind = Json::Kind::Bool;
        } else if (c == 'n') {
            expect("null");
        } else if (c == '-' || (c >= '0' && c <= '9')) {
            const char* start = s_.c_str() + pos_;
            char* end = nullptr;
            value.number = std::strtod(start, &end);
            if (end == start) fail("bad number");
            value.kind = Json::Kind::Number;
            pos_ += static_cast<size_t>(end - start);
        } else {
            fail(std::string("unexpected '") + c + "'");
        }
        return value;
    }

    unsigned hex4() {
        if (pos_ + 4 > s_.size()) fail("short \\u escape");
        unsigned code = 0;
        for (int i = 0; i < 4; ++i) {
            char h = s_[pos_++];
            code <<= 4;
            if (h >= '0' && h <= '9') code |= static_cast<unsigned>(h - '0');
            else if (h >= 'a' && h <= 'f') code |= static_cast<unsigned>(h - 'a' + 10);
            else if (h >= 'A' && h <= 'F') code |= static_cast<unsigned>(h - 'A' + 10);
            else fail("bad \\u escape");
        }
        return code;
    }

    static void append_utf8(std::string& out, unsigned code) {
        if (code < 0x80) {
            out += static_cast<char>(code);
        } else if (code < 0x800) {
            out += static_cast<char>(0xC0 | (code >> 6));
            out += static_cast<char>(0x80 | (code & 0x3F));
        } else if (code < 0x10000) {
            out += static_cast<char>(0xE0 | (code >> 12));
            out += static_cast<char>(0x80 | ((code >> 6) & 0x3F));
            out += static_cast<char>(0x80 | (code & 0x3F));
        } else {
            out += static_cast<char>(0xF0 | (code >> 18));
            out += static_cast<char>(0x80 | ((code >> 12) & 0x3F));
            out += static_cast<char>(0x80 | ((code >> 6) & 0x3F));
            out += static_cast<char>(0x80 | (code & 0x3F));
        }
    }

    std::string parse_string() {
        ++pos_;  // the opening quote
        std::string out;
        while (true) {
            if (pos_ >= s_.size()) fail("unterminated string");
            char c = s_[pos_++];
            if (c == '"') break;
            if (c != '\\') { out += c; continue; }
            if (pos_ >= s_.size()) fail("unterminated escape");
            char e = s_[pos_++];
            switch (e) {
                case '"': out += '"'; break;
                case '\\': out += '\\'; break;
                case '/': out += '/'; break;
                case 'b': out += '\b'; break;
                case 'f': out += '\f'; break;
                case 'n': out += '\n'; break;
                case 'r': out += '\r'; break;
                case 't': out += '\t'; break;
                case 'u': {
                    unsigned code = hex4();
                    if (code >= 0xD800 && code < 0xDC00 && pos_ + 6 <= s_.size() && s_[pos_] == '\\' &&
                        s_[pos_ + 1] == 'u') {
                        pos_ += 2;
                        unsigned low = hex4();
                        code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00);
                    }
                    append_utf8(out, code);
                    break;
                }
                default: fail("bad escape");
            }
        }
        return out;
    }
};

}  // namespace

Json Json::parse(const std::string& source) { return Parser(source).document(); }

const Json& Json::at(const std::string& key) const {
    if (!is_object()) throw JsonError("expected an object holding '" + key + "'");
    auto found = fields.find(key);
    if (found == fields.end()) throw JsonError("missing field '" + key + "'");
    return found->second;
}

const Json& Json::at(size_t index) const {
    if (!is_array() || index >= items.size()) throw JsonError("missing item " + std::to_string(index));
    return items[index];
}

const std::string& Json::str() const {
    if (!is_string()) throw JsonError("expected a string");
    return text;
}

int64_t Json::integer() const {
    if (!is_number() || std::floor(number) != number) throw JsonError("expected an integer");
    return static_cast<int64_t>(number);
}

double Json::real() const {
    if (!is_number()) throw JsonError("expected a number");
    return number;
}

std::string read_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::runtime_error(path + ": cannot be read");
    std::ostringstream buffer;
    buffer << in.rdbuf();
    return buffer.str();
}

}  // namespace pipeshard
