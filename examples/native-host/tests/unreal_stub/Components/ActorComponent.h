// NOT Unreal Engine: a stand-in for the syntax check (see CoreMinimal.h).
#pragma once

#include "CoreMinimal.h"

namespace EEndPlayReason {
enum Type { Destroyed, LevelTransition, EndPlayInEditor, RemovedFromWorld, Quit };
}

struct FActorComponentTickFunction {
    bool bCanEverTick = true;
};

class UActorComponent {
public:
    virtual ~UActorComponent() = default;

protected:
    virtual void EndPlay(const EEndPlayReason::Type) {}
    FActorComponentTickFunction PrimaryComponentTick;
};

// UnrealHeaderTool's GENERATED_BODY declares Super (here: for the one class the module derives).
#define GENERATED_BODY() \
public:                  \
    using Super = UActorComponent;
