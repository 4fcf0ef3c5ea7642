#include "PipeshardComponent.h"

#include "Async/Async.h"
#include "Misc/Paths.h"
#include "PipeshardBridge.h"

namespace {

std::string Utf8(const FString& Text) { return std::string(TCHAR_TO_UTF8(*Text)); }

FString FromUtf8(const std::string& Text) { return FString(UTF8_TO_TCHAR(Text.c_str())); }

FString UnderContent(const FString& Path) {
    if (Path.IsEmpty() || !FPaths::IsRelative(Path)) return Path;
    return FPaths::ConvertRelativePathToFull(FPaths::ProjectContentDir(), Path);
}

}  // namespace

UPipeshardComponent::UPipeshardComponent() { PrimaryComponentTick.bCanEverTick = false; }

bool UPipeshardComponent::Load() {
    // The worker's notify posts a drain to the game thread; a component gone by then is skipped.
    TWeakObjectPtr<UPipeshardComponent> Self(this);
    Bridge = std::make_shared<pipeshard_unreal::Bridge>([Self] {
        AsyncTask(ENamedThreads::GameThread, [Self] {
            if (UPipeshardComponent* Component = Self.Get()) Component->DrainEvents();
        });
    });
    pipeshard_unreal::BridgeOptions Options;
    Options.pack_dir = Utf8(UnderContent(PackDir));
    Options.plans_path = Utf8(UnderContent(PlansPath));
    Options.device = Utf8(Device);
    FString Extensions = PLATFORM_WINDOWS ? TEXT("ortextensions.dll") : TEXT("libortextensions.so");
    Options.extensions_library = Utf8(ExtensionsLibrary.IsEmpty() ? Extensions : ExtensionsLibrary);
    Options.threads = Threads;
    bool bOpened = Bridge->Open(Options) && (!bConversation || Bridge->StartConversation(Utf8(SystemPrompt)));
    LastError = FromUtf8(Bridge->LastError());
    if (!bOpened) Bridge.reset();
    return bOpened;
}

int64 UPipeshardComponent::Submit(const FString& Prompt, int32 MaxNewTokens, float Temperature) {
    if (!Bridge) {
        LastError = TEXT("Load the pack first");
        return 0;
    }
    pipeshard_sampling Sampling;
    pipeshard_default_sampling(&Sampling);
    Sampling.max_new_tokens = MaxNewTokens;
    Sampling.temperature = Temperature;
    int64 Id = Bridge->Submit(Utf8(Prompt), Sampling);
    if (!Id) LastError = FromUtf8(Bridge->LastError());
    return Id;
}

void UPipeshardComponent::Cancel(int64 RequestId) {
    if (Bridge) Bridge->Cancel(RequestId);
}

bool UPipeshardComponent::SetVramBudget(int64 Bytes) {
    if (!Bridge || Bytes < 0) {
        LastError = Bridge ? TEXT("a budget is 0 bytes or more") : TEXT("Load the pack first");
        return false;
    }
    bool bSet = Bridge->SetVramBudget(static_cast<uint64_t>(Bytes));
    if (!bSet) LastError = FromUtf8(Bridge->LastError());
    return bSet;
}

void UPipeshardComponent::DrainEvents() {
    if (!Bridge) return;
    std::shared_ptr<pipeshard_unreal::Bridge> Keep = Bridge;  // a handler may call Load or end play
    for (const pipeshard_unreal::Event& Event : Keep->Drain()) {
        switch (Event.kind) {
            case pipeshard_unreal::EventKind::Token:
                OnToken.Broadcast(Event.request, FromUtf8(Event.text));
                break;
            case pipeshard_unreal::EventKind::Sentence:
                OnSentence.Broadcast(Event.request, FromUtf8(Event.text));
                break;
            case pipeshard_unreal::EventKind::Finished:
                OnFinished.Broadcast(Event.request, Event.status == PIPESHARD_OK, FromUtf8(Event.text),
                                     FromUtf8(Event.message));
                break;
        }
    }
}

void UPipeshardComponent::EndPlay(const EEndPlayReason::Type Reason) {
    Bridge.reset();  // cancels what runs and joins the host's worker
    Super::EndPlay(Reason);
}
