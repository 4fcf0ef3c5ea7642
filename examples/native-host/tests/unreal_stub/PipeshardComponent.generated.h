// NOT Unreal Engine: UnrealHeaderTool writes this file; empty for the syntax check (see CoreMinimal.h).
