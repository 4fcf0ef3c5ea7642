// NOT Unreal Engine: the few UnrealBuildTool types Pipeshard.Build.cs uses, so CTest's unreal_syntax_check can compile
// it with mcs where no Unreal Engine is installed (names and types against these stand-ins only).
using System.Collections.Generic;

namespace UnrealBuildTool
{
    public sealed class UnrealTargetPlatform
    {
        public static readonly UnrealTargetPlatform Win64 = new UnrealTargetPlatform();
        public static readonly UnrealTargetPlatform Linux = new UnrealTargetPlatform();
    }

    public class ReadOnlyTargetRules
    {
        public UnrealTargetPlatform Platform;
    }

    public enum PCHUsageMode { UseExplicitOrSharedPCHs }

    public enum CppStandardVersion { Cpp17 }

    public class RuntimeDependencyList
    {
        public void Add(string path, string sourcePath) { }
    }

    public class ModuleRules
    {
        public ModuleRules(ReadOnlyTargetRules target) { }
        public PCHUsageMode PCHUsage;
        public CppStandardVersion CppStandard;
        public string PluginDirectory = "";
        public List<string> PublicDependencyModuleNames = new List<string>();
        public List<string> PublicIncludePaths = new List<string>();
        public List<string> PublicAdditionalLibraries = new List<string>();
        public List<string> PublicDelayLoadDLLs = new List<string>();
        public RuntimeDependencyList RuntimeDependencies = new RuntimeDependencyList();
    }
}
