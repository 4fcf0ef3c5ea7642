// A small JSON reader for the pack's manifest and the plans file: values, a recursive-descent parser, and
// lookups that throw a message naming the missing field (the host turns it into an error code).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace pipeshard {

struct JsonError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

class Json {
public:
    enum class Kind { Null, Bool, Number, String, Array, Object };

    Kind kind = Kind::Null;
    bool boolean = false;
    double number = 0.0;
    std::string text;
    std::vector<Json> items;
    std::map<std::string, Json> fields;

    static Json parse(const std::string& source);

    bool is_null() const { return kind == Kind::Null; }
    bool is_object() const { return kind == Kind::Object; }
    bool is_array() const { return kind == Kind::Array; }
    bool is_string() const { return kind == Kind::String; }
    bool is_number() const { return kind == Kind::Number; }
    bool has(const std::string& key) const { return is_object() && fields.count(key) != 0; }

    // Field `key` of an object; throws JsonError naming it when absent or when this is not an object.
    const Json& at(const std::string& key) const;
    const Json& at(size_t index) const;
    const std::string& str() const;
    int64_t integer() const;
    double real() const;
    size_t size() const { return is_array() ? items.size() : fields.size(); }
};

std::string read_file(const std::string& path);

}  // namespace pipeshard
