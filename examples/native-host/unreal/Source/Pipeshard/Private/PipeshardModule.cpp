// The module: on Windows, pipeshard_host.dll is delay-loaded, so it is loaded here from the folder the build staged
// it in (beside the game's binaries, with ONNX Runtime's DLLs) before any component calls it.
#include "Modules/ModuleManager.h"

#if PLATFORM_WINDOWS
#include "HAL/PlatformProcess.h"
#include "Misc/Paths.h"
#endif

class FPipeshardModule : public IModuleInterface {
public:
    virtual void StartupModule() override {
#if PLATFORM_WINDOWS
        FString Folder = FPlatformProcess::GetModulesDirectory();
        FPlatformProcess::PushDllDirectory(*Folder);  // onnxruntime.dll beside it, not one found elsewhere first
        Handle = FPlatformProcess::GetDllHandle(*FPaths::Combine(Folder, TEXT("pipeshard_host.dll")));
        FPlatformProcess::PopDllDirectory(*Folder);
#endif
    }

    virtual void ShutdownModule() override {
#if PLATFORM_WINDOWS
        if (Handle) FPlatformProcess::FreeDllHandle(Handle);
        Handle = nullptr;
#endif
    }

private:
    void* Handle = nullptr;
};

IMPLEMENT_MODULE(FPipeshardModule, Pipeshard)
