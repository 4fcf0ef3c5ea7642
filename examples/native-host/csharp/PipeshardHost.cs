// PipeshardHost.cs: the C# binding of pipeshard's native host (pipeshard_host.h), P/Invoke only.
// C# 7 (Debian's mcs compiles it; so does Unity, Mono or IL2CPP). Drop it into a Unity project beside the native
// libraries (Assets/Plugins/<platform>/: pipeshard_host, onnxruntime, ortextensions); see docs/native-host.md.
using System;
using System.Collections.Generic;
using System.Runtime.InteropServices;
using System.Text;

namespace Pipeshard
{
    /// <summary>What a call of the native host returned; PipeshardException carries it with the host's message.</summary>
    public enum Status
    {
        Ok = 0, BadArgument = 1, BadPack = 2, BadPlans = 3, BudgetTooSmall = 4, DeviceNotUsable = 5,
        ContextExceeded = 6, RuntimeFailure = 7
    }

    public sealed class PipeshardException : Exception
    {
        public readonly Status Status;
        public PipeshardException(Status status, string message) : base(message) { Status = status; }
    }

    /// <summary>How a host is opened (pipeshard_options).</summary>
    public sealed class HostOptions
    {
        public string PlansPath;          // a plans.json of `pipeshard plan PACK --out`, or null: all on the CPU
        public string Device;             // "cpu", "sim" or "cuda"; null: cpu without plans, cuda with
        public string ExtensionsLibrary;  // path of libortextensions / ortextensions.dll; null: token ids only
        public int Threads;               // 0: all cores
        public int Context;               // 0: the plans file's, else min(4096, the model's)
        public ulong VramBudgetBytes;     // 0: the largest rung of the plans file's ladder
    }

    /// <summary>How tokens are chosen (pipeshard_sampling); the defaults are greedy with the chat template.</summary>
    public sealed class Sampling
    {
        public int MaxNewTokens = 64;
        public float Temperature = 0f;
        public int TopK = 0;
        public float TopP = 1f;
        public float RepetitionPenalty = 1f;
        public ulong Seed = 0;
        public bool UseChatTemplate = true;
        public string SystemPrompt;
    }

    /// <summary>Unity's IL2CPP calls back into managed code only through static methods marked so.</summary>
    [AttributeUsage(AttributeTargets.Method)]
    public sealed class MonoPInvokeCallbackAttribute : Attribute
    {
        public MonoPInvokeCallbackAttribute(Type type) { }
    }

    /// <summary>One pack opened with its plans: Generate streams tokens to a callback; SetVramBudget may be called
    /// from any thread while Generate runs (it takes effect between two steps).</summary>
    public sealed class PipeshardHost : IDisposable
    {
        const string Library = "pipeshard_host";

        [StructLayout(LayoutKind.Sequential)]
        struct NativeOptions
        {
            public int abi_version;
            public IntPtr plans_path;
            public IntPtr device;
            public IntPtr extensions_library;
            public int threads;
            public int context;
            public ulong vram_budget_bytes;
        }

        [StructLayout(LayoutKind.Sequential)]
        struct NativeSampling
        {
            public int max_new_tokens;
            public float temperature;
            public int top_k;
            public float top_p;
            public float repetition_penalty;
            public ulong seed;
            public int use_chat_template;
            public IntPtr system_prompt;
        }

        [UnmanagedFunctionPointer(CallingConvention.Cdecl)]
        delegate int TokenCallback(long tokenId, IntPtr textPiece, IntPtr userData);

        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        static extern void pipeshard_default_options(ref NativeOptions options);
        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        static extern Status pipeshard_open(IntPtr packDir, ref NativeOptions options, out IntPtr host);
        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        static extern Status pipeshard_generate(IntPtr host, IntPtr prompt, ref NativeSampling sampling,
                                                TokenCallback callback, IntPtr userData);
        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        static extern Status pipeshard_generate_ids(IntPtr host, long[] promptIds, UIntPtr promptLength,
                                                    ref NativeSampling sampling, TokenCallback callback,
                                                    IntPtr userData);
        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        static extern Status pipeshard_tokenize(IntPtr host, IntPtr text, long[] ids, UIntPtr capacity,
                                                out UIntPtr count);
        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        static extern Status pipeshard_detokenize(IntPtr host, long[] ids, UIntPtr count, byte[] text,
                                                  UIntPtr capacity, out UIntPtr length);
        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        static extern Status pipeshard_set_vram_budget(IntPtr host, ulong budgetBytes);
        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        static extern Status pipeshard_report(IntPtr host, byte[] json, UIntPtr capacity, out UIntPtr length);
        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        static extern IntPtr pipeshard_last_error(IntPtr host);
        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        static extern void pipeshard_close(IntPtr host);

        IntPtr handle;
        static readonly TokenCallback Callback = OnToken;  // kept alive for as long as the library may call it

        public PipeshardHost(string packDir, HostOptions options = null)
        {
            options = options ?? new HostOptions();
            var strings = new List<IntPtr>();
            try
            {
                var native = new NativeOptions();
                pipeshard_default_options(ref native);
                native.plans_path = Utf8(options.PlansPath, strings);
                native.device = Utf8(options.Device, strings);
                native.extensions_library = Utf8(options.ExtensionsLibrary, strings);
                native.threads = options.Threads;
                native.context = options.Context;
                native.vram_budget_bytes = options.VramBudgetBytes;
                Status status = pipeshard_open(Utf8(packDir, strings), ref native, out handle);
                if (status != Status.Ok) throw new PipeshardException(status, FromUtf8(pipeshard_last_error(IntPtr.Zero)));
            }
            finally
            {
                foreach (IntPtr s in strings) Marshal.FreeHGlobal(s);
            }
        }

        /// <summary>Generate from a prompt; `onToken(id, textPiece)` sees each token as it comes and returns false to
        /// stop. Returns the generated ids (without the end-of-sequence token).</summary>
        public List<long> Generate(string prompt, Sampling sampling = null, Func<long, string, bool> onToken = null)
        {
            var strings = new List<IntPtr>();
            var sink = new TokenSink { OnToken = onToken };
            GCHandle pinned = GCHandle.Alloc(sink);
            try
            {
                NativeSampling native = ToNative(sampling ?? new Sampling(), strings);
                Check(pipeshard_generate(Handle, Utf8(prompt, strings), ref native, Callback, GCHandle.ToIntPtr(pinned)));
            }
            finally
            {
                pinned.Free();
                foreach (IntPtr s in strings) Marshal.FreeHGlobal(s);
            }
            if (sink.Error != null) throw sink.Error;
            return sink.Ids;
        }

        public List<long> GenerateIds(long[] promptIds, Sampling sampling = null, Func<long, string, bool> onToken = null)
        {
            var strings = new List<IntPtr>();
            var sink = new TokenSink { OnToken = onToken };
            GCHandle pinned = GCHandle.Alloc(sink);
            try
            {
                NativeSampling native = ToNative(sampling ?? new Sampling(), strings);
                Check(pipeshard_generate_ids(Handle, promptIds, new UIntPtr((ulong)promptIds.Length), ref native, Callback,
                                             GCHandle.ToIntPtr(pinned)));
            }
            finally
            {
                pinned.Free();
                foreach (IntPtr s in strings) Marshal.FreeHGlobal(s);
            }
            if (sink.Error != null) throw sink.Error;
            return sink.Ids;
        }

        public long[] Tokenize(string text)
        {
            var strings = new List<IntPtr>();
            try
            {
                IntPtr native = Utf8(text, strings);
                UIntPtr count;
                Status status = pipeshard_tokenize(Handle, native, null, UIntPtr.Zero, out count);
                if (status != Status.Ok && status != Status.BadArgument) Check(status);
                var ids = new long[(int)count.ToUInt64()];
                Check(pipeshard_tokenize(Handle, native, ids, new UIntPtr((ulong)ids.Length), out count));
                return ids;
            }
            finally
            {
                foreach (IntPtr s in strings) Marshal.FreeHGlobal(s);
            }
        }

        public string Detokenize(long[] ids)
        {
            UIntPtr length;
            Status status = pipeshard_detokenize(Handle, ids, new UIntPtr((ulong)ids.Length), null, UIntPtr.Zero, out length);
            if (status != Status.Ok && status != Status.BadArgument) Check(status);
            var text = new byte[(int)length.ToUInt64()];
            Check(pipeshard_detokenize(Handle, ids, new UIntPtr((ulong)ids.Length), text, new UIntPtr((ulong)text.Length),
                                       out length));
            return Encoding.UTF8.GetString(text, 0, text.Length - 1);
        }

        /// <summary>A new VRAM budget (the game took memory back, or gave it): the largest ladder rung that fits runs
        /// from the next step on. Below every rung it throws (Status.BudgetTooSmall) and nothing changes.</summary>
        public void SetVramBudget(ulong budgetBytes) { Check(pipeshard_set_vram_budget(Handle, budgetBytes)); }

        /// <summary>The host's report as JSON (device, budget, rung, steps, plan switches, timings).</summary>
        public string Report()
        {
            var json = new byte[16384];
            UIntPtr length;
            Check(pipeshard_report(Handle, json, new UIntPtr((ulong)json.Length), out length));
            return Encoding.UTF8.GetString(json, 0, (int)length.ToUInt64() - 1);
        }

        public void Dispose()
        {
            if (handle != IntPtr.Zero) pipeshard_close(handle);
            handle = IntPtr.Zero;
            GC.SuppressFinalize(this);
        }

        ~PipeshardHost() { Dispose(); }

        IntPtr Handle
        {
            get
            {
                if (handle == IntPtr.Zero) throw new ObjectDisposedException("PipeshardHost");
                return handle;
            }
        }

        void Check(Status status)
        {
            if (status != Status.Ok) throw new PipeshardException(status, FromUtf8(pipeshard_last_error(handle)));
        }

        sealed class TokenSink
        {
            public Func<long, string, bool> OnToken;
            public readonly List<long> Ids = new List<long>();
            public Exception Error;
        }

        [MonoPInvokeCallback(typeof(TokenCallback))]
        static int OnToken(long tokenId, IntPtr textPiece, IntPtr userData)
        {
            var sink = (TokenSink)GCHandle.FromIntPtr(userData).Target;
            sink.Ids.Add(tokenId);
            try
            {
                return sink.OnToken == null || sink.OnToken(tokenId, FromUtf8(textPiece)) ? 0 : 1;
            }
            catch (Exception error)  // an exception must not cross the native frames: stop, and rethrow after
            {
                sink.Error = error;
                return 1;
            }
        }

        static NativeSampling ToNative(Sampling sampling, List<IntPtr> strings)
        {
            return new NativeSampling
            {
                max_new_tokens = sampling.MaxNewTokens, temperature = sampling.Temperature, top_k = sampling.TopK,
                top_p = sampling.TopP, repetition_penalty = sampling.RepetitionPenalty, seed = sampling.Seed,
                use_chat_template = sampling.UseChatTemplate ? 1 : 0,
                system_prompt = Utf8(sampling.SystemPrompt, strings)
            };
        }

        static IntPtr Utf8(string text, List<IntPtr> owned)
        {
            if (text == null) return IntPtr.Zero;
            byte[] bytes = Encoding.UTF8.GetBytes(text);
            IntPtr native = Marshal.AllocHGlobal(bytes.Length + 1);
            Marshal.Copy(bytes, 0, native, bytes.Length);
            Marshal.WriteByte(native, bytes.Length, 0);
            owned.Add(native);
            return native;
        }

        static string FromUtf8(IntPtr text)
        {
            if (text == IntPtr.Zero) return "";
            int length = 0;
            while (Marshal.ReadByte(text, length) != 0) ++length;
            var bytes = new byte[length];
            Marshal.Copy(text, bytes, 0, length);
            return Encoding.UTF8.GetString(bytes);
        }
    }
}
