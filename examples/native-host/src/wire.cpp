#include "wire.hpp"

#include <cstring>
#include <stdexcept>

namespace pipeshard::wire {

namespace {

uint64_t read_varint(const std::string& data, size_t& at) {
    uint64_t value = 0;
    for (int shift = 0;; shift += 7) {
        if (at >= data.size() || shift > 63) throw std::runtime_error("truncated varint in an ONNX model");
        uint8_t byte = static_cast<uint8_t>(data[at++]);
        value |= static_cast<uint64_t>(byte & 0x7F) << shift;
        if (byte < 0x80) return value;
    }
}

void write_varint(std::string& out, uint64_t value) {
    do {
        uint8_t byte = value & 0x7F;
        value >>= 7;
        out.push_back(static_cast<char>(byte | (value ? 0x80 : 0)));
    } while (value);
}

}  // namespace

std::vector<Field> parse(const std::string& data) {
    std::vector<Field> fields;
    size_t at = 0;
    while (at < data.size()) {
        uint64_t key = read_varint(data, at);
        Field field(static_cast<uint32_t>(key >> 3), static_cast<int>(key & 7));
        size_t size = 0;
        if (field.wire == VARINT) {
            field.varint = read_varint(data, at);
        } else {
            if (field.wire == LENGTH) size = static_cast<size_t>(read_varint(data, at));
            else if (field.wire == FIXED64) size = 8;
            else if (field.wire == FIXED32) size = 4;
            else throw std::runtime_error("unsupported protobuf wire type in an ONNX model");
            if (size > data.size() - at) throw std::runtime_error("truncated field in an ONNX model");
            field.bytes = data.substr(at, size);
            at += size;
        }
        fields.push_back(std::move(field));
    }
    return fields;
}

std::string serialize(const std::vector<Field>& fields) {
    std::string out;
    for (const Field& field : fields) {
        write_varint(out, static_cast<uint64_t>(field.number) << 3 | static_cast<uint64_t>(field.wire));
        if (field.wire == VARINT) {
            write_varint(out, field.varint);
        } else {
            if (field.wire == LENGTH) write_varint(out, field.bytes.size());
            out += field.bytes;
        }
    }
    return out;
}

std::vector<std::string> strings(const std::vector<Field>& fields, uint32_t number) {
    std::vector<std::string> found;
    for (const Field& field : fields)
        if (field.number == number && field.wire == LENGTH) found.push_back(field.bytes);
    return found;
}

std::string first_string(const std::vector<Field>& fields, uint32_t number) {
    for (const Field& field : fields)
        if (field.number == number && field.wire == LENGTH) return field.bytes;
    return std::string();
}

Field length_field(uint32_t number, std::string bytes) {
    Field field(number, LENGTH);
    field.bytes = std::move(bytes);
    return field;
}

Field varint_field(uint32_t number, uint64_t value) {
    Field field(number, VARINT);
    field.varint = value;
    return field;
}

int64_t signed_value(uint64_t varint) {
    int64_t value;
    std::memcpy(&value, &varint, sizeof value);
    return value;
}

std::map<std::string, double> node_attributes(const std::vector<Field>& node) {
    std::map<std::string, double> found;
    for (const Field& field : node) {
        if (field.number != kNodeAttribute || field.wire != LENGTH) continue;
        std::vector<Field> attribute = parse(field.bytes);
        std::string name = first_string(attribute, kAttributeName);
        for (const Field& value : attribute) {
            if (value.number == kAttributeFloat && value.wire == FIXED32) {
                float number;
                std::memcpy(&number, value.bytes.data(), 4);
                found[name] = number;
            } else if (value.number == kAttributeInt && value.wire == VARINT) {
                found[name] = static_cast<double>(signed_value(value.varint));
            }
        }
    }
    return found;
}

}  // namespace pipeshard::wire
