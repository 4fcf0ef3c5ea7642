// NOT Unreal Engine: a stand-in for the syntax check (see CoreMinimal.h).
#pragma once

namespace ENamedThreads {
enum Type { GameThread, AnyThread };
}

template <typename Function>
void AsyncTask(ENamedThreads::Type, Function&&) {}
