// NOT Unreal Engine: a stand-in for the syntax check (see CoreMinimal.h).
#pragma once

#include "CoreMinimal.h"

class IModuleInterface {
public:
    virtual ~IModuleInterface() = default;
    virtual void StartupModule() {}
    virtual void ShutdownModule() {}
};

#define IMPLEMENT_MODULE(Class, Name) static Class* Name##_module_for_the_syntax_check = nullptr;
