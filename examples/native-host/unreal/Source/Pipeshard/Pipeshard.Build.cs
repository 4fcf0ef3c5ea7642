// The Pipeshard module: UPipeshardComponent over the pipeshard native host's C ABI (include/pipeshard_host.h).
// The host library and ONNX Runtime's come prebuilt (make host-windows / make host) in
// ThirdParty/PipeshardHost/<platform>/ beside this plugin's Source folder; they are staged next to the game's binaries.
using System.IO;
using UnrealBuildTool;

public class Pipeshard : ModuleRules
{
    public Pipeshard(ReadOnlyTargetRules Target) : base(Target)
    {
        PCHUsage = PCHUsageMode.UseExplicitOrSharedPCHs;
        CppStandard = CppStandardVersion.Cpp17;
        PublicDependencyModuleNames.AddRange(new string[] { "Core", "CoreUObject", "Engine" });

        string hostDir = Path.Combine(PluginDirectory, "ThirdParty", "PipeshardHost");
        PublicIncludePaths.Add(Path.Combine(hostDir, "include"));

        if (Target.Platform == UnrealTargetPlatform.Win64)
        {
            string binaries = Path.Combine(hostDir, "Win64");
            // pipeshard_host.lib: the import library made from the build's pipeshard_host.def (docs/native-host.md).
            PublicAdditionalLibraries.Add(Path.Combine(binaries, "pipeshard_host.lib"));
            // Loaded by FPipeshardModule::StartupModule from the binaries folder, not at process start.
            PublicDelayLoadDLLs.Add("pipeshard_host.dll");
            foreach (string dll in new string[] { "pipeshard_host.dll", "onnxruntime.dll",
                                                  "onnxruntime_providers_shared.dll", "ortextensions.dll" })
            {
                RuntimeDependencies.Add(Path.Combine("$(BinaryOutputDir)", dll), Path.Combine(binaries, dll));
            }
        }
        else if (Target.Platform == UnrealTargetPlatform.Linux)
        {
            string binaries = Path.Combine(hostDir, "Linux");
            PublicAdditionalLibraries.Add(Path.Combine(binaries, "libpipeshard_host.so"));
            foreach (string library in new string[] { "libpipeshard_host.so", "libonnxruntime.so.1", "libortextensions.so" })
            {
                RuntimeDependencies.Add(Path.Combine("$(BinaryOutputDir)", library), Path.Combine(binaries, library));
            }
        }
    }
}
