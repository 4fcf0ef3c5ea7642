// Where pinned and streamed units compute: one small interface, two implementations.
//   sim:  device buffers are host memory charged to the budget, copies are memcpy, device sessions run on the
//         CPU EP. A test double for the scheduling (ring, budget, rung switches, KV moves), never a speed claim.
//   cuda: ONNX Runtime's CUDA EP; buffers from cudaMalloc, weight copies with cudaMemcpyAsync on a copy stream of
//         our own and an event per staging slot (the CUDA runtime is loaded at run time, so the host builds and
//         runs without CUDA). Written fully, unverified (no GPU run yet).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "onnxruntime_c_api.h"

namespace pipeshard {

class Device {
public:
    virtual ~Device() = default;
    virtual const char* name() const = 0;
    virtual void* allocate(size_t bytes) = 0;
    virtual void release(void* buffer) = 0;
    // Start copying host bytes into a device buffer; `event` (a staging slot's index, or -1: wait now) is what
    // `wait` later waits on.
    virtual void upload(void* device_buffer, const void* host, size_t bytes, int event) = 0;
    virtual void wait(int event) = 0;
    virtual void download(void* host, const void* device_buffer, size_t bytes) = 0;
    // Every copy started has landed (before buffers are released).
    virtual void drain() = 0;
    // How a tensor over a device buffer is described to ONNX Runtime.
    virtual const OrtMemoryInfo* memory_info() const = 0;
    // Registers the device's execution provider on a session's options (nothing for sim: the CPU EP).
    virtual void add_provider(OrtSessionOptions* options) = 0;
    // The device memory free now, where the device can say (cuda: cudaMemGetInfo); false where it cannot (sim).
    virtual bool free_memory(uint64_t* bytes) = 0;
};

// Throws std::runtime_error (the host maps it to PIPESHARD_ERR_DEVICE) when the device is not usable here.
std::unique_ptr<Device> make_device(const std::string& kind, const OrtApi* api, int slots);

}  // namespace pipeshard
