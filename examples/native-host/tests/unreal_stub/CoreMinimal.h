// NOT Unreal Engine: the few declarations of its headers that the Pipeshard module's UE files use, so CTest's
// unreal_syntax_check can compile them (-fsyntax-only) where no Unreal Engine is installed. It checks C++ syntax,
// names and types against these stand-ins only; UnrealHeaderTool's reflection is not run.
#pragma once

#include <cstdint>
#include <string>

using int32 = int32_t;
using int64 = int64_t;
using TCHAR = char;
#define TEXT(x) x
#define TCHAR_TO_UTF8(x) (x)
#define UTF8_TO_TCHAR(x) (x)
#ifndef PLATFORM_WINDOWS
#define PLATFORM_WINDOWS 0
#endif
#define UCLASS(...)
#define UPROPERTY(...)
#define UFUNCTION(...)
#define PIPESHARD_API

class FString {
public:
    FString() = default;
    FString(const TCHAR* text) : text_(text) {}
    const TCHAR* operator*() const { return text_.c_str(); }
    bool IsEmpty() const { return text_.empty(); }

private:
    std::string text_;
};

template <typename T>
class TWeakObjectPtr {
public:
    explicit TWeakObjectPtr(T* object) : object_(object) {}
    T* Get() const { return object_; }

private:
    T* object_;
};

#define DECLARE_DYNAMIC_MULTICAST_DELEGATE_TwoParams(Name, T1, N1, T2, N2) \
    struct Name {                                                         \
        void Broadcast(T1, T2) const {}                                   \
    };
#define DECLARE_DYNAMIC_MULTICAST_DELEGATE_FourParams(Name, T1, N1, T2, N2, T3, N3, T4, N4) \
    struct Name {                                                                           \
        void Broadcast(T1, T2, T3, T4) const {}                                             \
    };
