// NOT Unreal Engine: a stand-in for the syntax check (see CoreMinimal.h).
#pragma once

#include "CoreMinimal.h"

struct FPlatformProcess {
    static FString GetModulesDirectory() { return FString(); }
    static void PushDllDirectory(const TCHAR*) {}
    static void PopDllDirectory(const TCHAR*) {}
    static void* GetDllHandle(const TCHAR*) { return nullptr; }
    static void FreeDllHandle(void*) {}
};
