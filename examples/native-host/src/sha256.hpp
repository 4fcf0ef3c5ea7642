#pragma once

#include <string>

namespace pipeshard {

// Lower-case hex SHA-256 of a file's bytes; throws std::runtime_error when it cannot be read.
std::string sha256_file(const std::string& path);

}  // namespace pipeshard
