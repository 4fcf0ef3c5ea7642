#include "device.hpp"

#include <cstdlib>
#include <cstring>
#include <map>
#include <stdexcept>
#include <type_traits>
#include <vector>

#if defined(_WIN32)
#ifndef NOMINMAX
#define NOMINMAX
#endif
#include <windows.h>
#else
#include <dlfcn.h>
#endif

namespace pipeshard {
namespace {

std::string take_message(const OrtApi* api, OrtStatus* status) {
    std::string message = api->GetErrorMessage(status);
    api->ReleaseStatus(status);
    return message;
}

class SimDevice final : public Device {
public:
    explicit SimDevice(const OrtApi* api) : api_(api) {
        OrtStatus* status = api_->CreateCpuMemoryInfo(OrtDeviceAllocator, OrtMemTypeDefault, &memory_);
        if (status) throw std::runtime_error(take_message(api_, status));
    }
    ~SimDevice() override { api_->ReleaseMemoryInfo(memory_); }
    const char* name() const override { return "sim"; }
    void* allocate(size_t bytes) override {
        void* buffer = std::malloc(bytes ? bytes : 1);
        if (!buffer) throw std::bad_alloc();
        return buffer;
    }
    void release(void* buffer) override { std::free(buffer); }
    void upload(void* device_buffer, const void* host, size_t bytes, int) override {
        std::memcpy(device_buffer, host, bytes);
    }
    void wait(int) override {}
    void download(void* host, const void* device_buffer, size_t bytes) override {
        std::memcpy(host, device_buffer, bytes);
    }
    void drain() override {}
    const OrtMemoryInfo* memory_info() const override { return memory_; }
    void add_provider(OrtSessionOptions*) override {}
    bool free_memory(uint64_t*) override { return false; }

private:
    const OrtApi* api_;
    OrtMemoryInfo* memory_ = nullptr;
};

// The few CUDA runtime entry points the device needs, resolved from the CUDA runtime library at run time.
struct CudaRuntime {
    using Stream = void*;
    using Event = void*;
    int (*get_device_count)(int*) = nullptr;
    int (*malloc_device)(void**, size_t) = nullptr;
    int (*free_device)(void*) = nullptr;
    int (*stream_create)(Stream*, unsigned) = nullptr;
    int (*stream_destroy)(Stream) = nullptr;
    int (*stream_synchronize)(Stream) = nullptr;
    int (*event_create)(Event*, unsigned) = nullptr;
    int (*event_destroy)(Event) = nullptr;
    int (*event_record)(Event, Stream) = nullptr;
    int (*event_synchronize)(Event) = nullptr;
    int (*memcpy_async)(void*, const void*, size_t, int, Stream) = nullptr;
    int (*memcpy_sync)(void*, const void*, size_t, int) = nullptr;
    int (*mem_get_info)(size_t*, size_t*) = nullptr;
    const char* (*error_string)(int) = nullptr;
    void* library = nullptr;

    static constexpr int kHostToDevice = 1, kDeviceToHost = 2;
    static constexpr unsigned kNonBlocking = 1, kDisableTiming = 2;

    void load() {
#if defined(_WIN32)
        for (const char* name : {"cudart64_13.dll", "cudart64_12.dll"})
            if ((library = LoadLibraryA(name))) break;
        auto symbol = [this](const char* name) { return (void*)GetProcAddress((HMODULE)library, name); };
#else
        for (const char* name : {"libcudart.so.13", "libcudart.so.12", "libcudart.so"})
            if ((library = dlopen(name, RTLD_NOW | RTLD_LOCAL))) break;
        auto symbol = [this](const char* name) { return dlsym(library, name); };
#endif
        if (!library) throw std::runtime_error("device cuda: the CUDA runtime (libcudart 12 or 13) is not installed");
        auto resolve = [&](auto& function, const char* name) {
            function = reinterpret_cast<std::remove_reference_t<decltype(function)>>(symbol(name));
            if (!function) throw std::runtime_error(std::string("device cuda: the CUDA runtime lacks ") + name);
        };
        resolve(get_device_count, "cudaGetDeviceCount");
        resolve(malloc_device, "cudaMalloc");
        resolve(free_device, "cudaFree");
        resolve(stream_create, "cudaStreamCreateWithFlags");
        resolve(stream_destroy, "cudaStreamDestroy");
        resolve(stream_synchronize, "cudaStreamSynchronize");
        resolve(event_create, "cudaEventCreateWithFlags");
        resolve(event_destroy, "cudaEventDestroy");
        resolve(event_record, "cudaEventRecord");
        resolve(event_synchronize, "cudaEventSynchronize");
        resolve(memcpy_async, "cudaMemcpyAsync");
        resolve(memcpy_sync, "cudaMemcpy");
        resolve(mem_get_info, "cudaMemGetInfo");
        resolve(error_string, "cudaGetErrorString");
    }

    void check(int error, const char* what) const {
        if (error != 0) throw std::runtime_error(std::string("device cuda: ") + what + ": " + error_string(error));
    }
};

class CudaDevice final : public Device {
public:
    CudaDevice(const OrtApi* api, int slots) : api_(api) {
        cuda_.load();
        int count = 0;
        cuda_.check(cuda_.get_device_count(&count), "cudaGetDeviceCount");
        if (count < 1) throw std::runtime_error("device cuda: no GPU is visible");
        cuda_.check(cuda_.stream_create(&copy_stream_, CudaRuntime::kNonBlocking), "cudaStreamCreateWithFlags");
        for (int slot = 0; slot < slots + 1; ++slot) event(slot);
        OrtStatus* status = api_->CreateMemoryInfo("Cuda", OrtDeviceAllocator, 0, OrtMemTypeDefault, &memory_);
        if (status) throw std::runtime_error(take_message(api_, status));
        OrtSessionOptions* probe = nullptr;
        status = api_->CreateSessionOptions(&probe);
        if (!status) {
            try {
                add_provider(probe);
            } catch (...) {
                api_->ReleaseSessionOptions(probe);
                throw;
            }
            api_->ReleaseSessionOptions(probe);
        } else {
            throw std::runtime_error(take_message(api_, status));
        }
    }

    ~CudaDevice() override {
        if (copy_stream_) cuda_.stream_synchronize(copy_stream_);
        for (auto& entry : events_) cuda_.event_destroy(entry.second);
        if (copy_stream_) cuda_.stream_destroy(copy_stream_);
        if (memory_) api_->ReleaseMemoryInfo(memory_);
    }

    const char* name() const override { return "cuda"; }

    void* allocate(size_t bytes) override {
        void* buffer = nullptr;
        cuda_.check(cuda_.malloc_device(&buffer, bytes ? bytes : 1), "cudaMalloc");
        return buffer;
    }

    void release(void* buffer) override { cuda_.free_device(buffer); }

    void upload(void* device_buffer, const void* host, size_t bytes, int slot) override {
        cuda_.check(cuda_.memcpy_async(device_buffer, host, bytes, CudaRuntime::kHostToDevice, copy_stream_),
                    "cudaMemcpyAsync");
        if (slot < 0) {
            cuda_.check(cuda_.stream_synchronize(copy_stream_), "cudaStreamSynchronize");
            return;
        }
        cuda_.check(cuda_.event_record(event(slot), copy_stream_), "cudaEventRecord");
    }

    // ONNX Runtime's CUDA runs return once their outputs are ready, so a run started after the wait sees the
    // slot's weights, and a slot is free again as soon as the run that read it has returned.
    void wait(int slot) override {
        if (slot >= 0) cuda_.check(cuda_.event_synchronize(event(slot)), "cudaEventSynchronize");
    }

    void download(void* host, const void* device_buffer, size_t bytes) override {
        cuda_.check(cuda_.memcpy_sync(host, device_buffer, bytes, CudaRuntime::kDeviceToHost), "cudaMemcpy");
    }

    void drain() override { cuda_.check(cuda_.stream_synchronize(copy_stream_), "cudaStreamSynchronize"); }

    const OrtMemoryInfo* memory_info() const override { return memory_; }

    bool free_memory(uint64_t* bytes) override {
        size_t free_bytes = 0, total_bytes = 0;
        if (cuda_.mem_get_info(&free_bytes, &total_bytes) != 0) return false;
        *bytes = free_bytes;
        return true;
    }

    void add_provider(OrtSessionOptions* options) override {
        OrtCUDAProviderOptionsV2* cuda_options = nullptr;
        OrtStatus* status = api_->CreateCUDAProviderOptions(&cuda_options);
        if (!status) {
            const char* keys[] = {"device_id"};
            const char* values[] = {"0"};
            status = api_->UpdateCUDAProviderOptions(cuda_options, keys, values, 1);
        }
        if (!status) status = api_->SessionOptionsAppendExecutionProvider_CUDA_V2(options, cuda_options);
        if (cuda_options) api_->ReleaseCUDAProviderOptions(cuda_options);
        if (status) throw std::runtime_error("device cuda: ONNX Runtime's CUDA execution provider is not usable "
                                             "here (" + take_message(api_, status) + ")");
    }

private:
    const OrtApi* api_;
    CudaRuntime cuda_;
    CudaRuntime::Stream copy_stream_ = nullptr;
    std::map<int, CudaRuntime::Event> events_;
    OrtMemoryInfo* memory_ = nullptr;

    CudaRuntime::Event event(int slot) {
        auto found = events_.find(slot);
        if (found != events_.end()) return found->second;
        CudaRuntime::Event created = nullptr;
        cuda_.check(cuda_.event_create(&created, CudaRuntime::kDisableTiming), "cudaEventCreateWithFlags");
        events_[slot] = created;
        return created;
    }
};

}  // namespace

std::unique_ptr<Device> make_device(const std::string& kind, const OrtApi* api, int slots) {
    if (kind == "sim") return std::make_unique<SimDevice>(api);
    if (kind == "cuda") return std::make_unique<CudaDevice>(api, slots);
    throw std::runtime_error("unknown device '" + kind + "' (cpu, sim or cuda)");
}

}  // namespace pipeshard
