// NOT Unreal Engine: a stand-in for the syntax check (see CoreMinimal.h).
#pragma once

#include "CoreMinimal.h"

struct FPaths {
    static bool IsRelative(const FString&) { return true; }
    static FString ConvertRelativePathToFull(const FString& base, const FString&) { return base; }
    static FString ProjectContentDir() { return FString(); }
    static FString Combine(const FString& a, const FString&) { return a; }
};
