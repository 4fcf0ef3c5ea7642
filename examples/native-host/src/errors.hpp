#pragma once

#include <new>
#include <stdexcept>
#include <string>

#include "json.hpp"
#include "pipeshard_host.h"

namespace pipeshard {

// What every failure inside the library becomes: a status for the C ABI and one line for people.
struct HostError : std::runtime_error {
    pipeshard_status status;
    HostError(pipeshard_status code, const std::string& message) : std::runtime_error(message), status(code) {}
};

[[noreturn]] inline void fail(pipeshard_status code, const std::string& message) { throw HostError(code, message); }

// Runs `body`, turning whatever it throws into a status and `error` (cleared on success): nothing crosses the ABI.
template <typename Body>
pipeshard_status guarded(std::string& error, Body&& body) {
    try {
        body();
        error.clear();
        return PIPESHARD_OK;
    } catch (const HostError& failure) {
        error = failure.what();
        return failure.status;
    } catch (const JsonError& failure) {
        error = failure.what();
        return PIPESHARD_ERR_PACK;
    } catch (const std::bad_alloc&) {
        error = "out of memory";
        return PIPESHARD_ERR_RUNTIME;
    } catch (const std::exception& failure) {
        error = failure.what();
        return PIPESHARD_ERR_RUNTIME;
    } catch (...) {
        error = "unknown failure";
        return PIPESHARD_ERR_RUNTIME;
    }
}

}  // namespace pipeshard
