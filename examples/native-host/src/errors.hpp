#pragma once

#include <stdexcept>
#include <string>

#include "pipeshard_host.h"

namespace pipeshard {

// What every failure inside the library becomes: a status for the C ABI and one line for people.
struct HostError : std::runtime_error {
    pipeshard_status status;
    HostError(pipeshard_status code, const std::string& message) : std::runtime_error(message), status(code) {}
};

[[noreturn]] inline void fail(pipeshard_status code, const std::string& message) { throw HostError(code, message); }

}  // namespace pipeshard
