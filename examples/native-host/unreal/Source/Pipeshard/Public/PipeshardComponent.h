// A character's voice: an actor component that opens a pipeshard pack, takes prompts from Blueprints and fires
// OnToken / OnSentence / OnFinished on the game thread. The host's callbacks run on its worker thread; the bridge
// (PipeshardBridge.h) queues them as events and one AsyncTask on the game thread at a time drains the queue.
#pragma once

#include <memory>

#include "Components/ActorComponent.h"
#include "CoreMinimal.h"

#include "PipeshardComponent.generated.h"

namespace pipeshard_unreal {
class Bridge;
}

DECLARE_DYNAMIC_MULTICAST_DELEGATE_TwoParams(FPipeshardTokenEvent, int64, RequestId, const FString&, Piece);
DECLARE_DYNAMIC_MULTICAST_DELEGATE_TwoParams(FPipeshardSentenceEvent, int64, RequestId, const FString&, Sentence);
DECLARE_DYNAMIC_MULTICAST_DELEGATE_FourParams(FPipeshardFinishedEvent, int64, RequestId, bool, bSucceeded,
                                              const FString&, Text, const FString&, Message);

UCLASS(ClassGroup = (AI), meta = (BlueprintSpawnableComponent))
class PIPESHARD_API UPipeshardComponent : public UActorComponent {
    GENERATED_BODY()

public:
    UPipeshardComponent();

    // The pack folder, and the plans file of `pipeshard plan PACK --out` (empty: every unit on the CPU); relative
    // paths are under the project's Content folder (stage them with DirectoriesToAlwaysStageAsNonUFS).
    UPROPERTY(EditAnywhere, BlueprintReadWrite, Category = "Pipeshard")
    FString PackDir;
    UPROPERTY(EditAnywhere, BlueprintReadWrite, Category = "Pipeshard")
    FString PlansPath;
    // "cpu", "sim" or "cuda"; empty: cpu without plans, cuda with.
    UPROPERTY(EditAnywhere, BlueprintReadWrite, Category = "Pipeshard")
    FString Device;
    // Empty: ortextensions beside the game's binaries (the module stages it there).
    UPROPERTY(EditAnywhere, BlueprintReadWrite, Category = "Pipeshard")
    FString ExtensionsLibrary;
    // ONNX Runtime's CPU threads (0: all cores; leave the game some).
    UPROPERTY(EditAnywhere, BlueprintReadWrite, Category = "Pipeshard")
    int32 Threads = 2;
    // Keep one conversation (the KV cache between turns) with this system prompt; off: each prompt stands alone.
    UPROPERTY(EditAnywhere, BlueprintReadWrite, Category = "Pipeshard")
    bool bConversation = true;
    UPROPERTY(EditAnywhere, BlueprintReadWrite, Category = "Pipeshard")
    FString SystemPrompt;

    UPROPERTY(BlueprintAssignable, Category = "Pipeshard")
    FPipeshardTokenEvent OnToken;
    UPROPERTY(BlueprintAssignable, Category = "Pipeshard")
    FPipeshardSentenceEvent OnSentence;
    UPROPERTY(BlueprintAssignable, Category = "Pipeshard")
    FPipeshardFinishedEvent OnFinished;

    // Opens the pack (blocking: a loading screen's work); false with GetLastError() on failure.
    UFUNCTION(BlueprintCallable, Category = "Pipeshard")
    bool Load();
    // Queues a prompt and returns at once with its id (0 on failure); its events come on later frames.
    UFUNCTION(BlueprintCallable, Category = "Pipeshard")
    int64 Submit(const FString& Prompt, int32 MaxNewTokens = 64, float Temperature = 0.f);
    // Stops a request before its next sub-layer run; OnFinished follows with bSucceeded false.
    UFUNCTION(BlueprintCallable, Category = "Pipeshard")
    void Cancel(int64 RequestId);
    // A fixed VRAM budget in bytes (0 bytes: every unit on the CPU, the device's memory freed).
    UFUNCTION(BlueprintCallable, Category = "Pipeshard")
    bool SetVramBudget(int64 Bytes);
    UFUNCTION(BlueprintPure, Category = "Pipeshard")
    FString GetLastError() const { return LastError; }

protected:
    virtual void EndPlay(const EEndPlayReason::Type Reason) override;

private:
    void DrainEvents();  // game thread

    std::shared_ptr<pipeshard_unreal::Bridge> Bridge;
    FString LastError;
};
