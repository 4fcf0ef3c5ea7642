// PipeshardHost.cs: the C# binding of pipeshard's native host (pipeshard_host.h), P/Invoke only.
// C# 7 (Debian's mcs compiles it; so does Unity, Mono or IL2CPP). Drop it into a Unity project beside the native
// libraries (Assets/Plugins/<platform>/: pipeshard_host, onnxruntime, ortextensions); see docs/native-host.md.
using System;
using System.Collections.Generic;
using System.Runtime.InteropServices;
using System.Text;
using System.Threading;
using System.Threading.Tasks;

namespace Pipeshard
{
    /// <summary>What a call of the native host returned; PipeshardException carries it with the host's message.</summary>
    public enum Status
    {
        Ok = 0, BadArgument = 1, BadPack = 2, BadPlans = 3, BudgetTooSmall = 4, DeviceNotUsable = 5,
        ContextExceeded = 6, RuntimeFailure = 7, Cancelled = 8
    }

    /// <summary>Fixed: a budget in bytes. Auto: the device's free memory minus a reserve, followed between steps.</summary>
    public enum BudgetMode { Fixed = 0, Auto = 1 }

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
        public ulong VramBudgetBytes;     // Fixed: 0 means the largest rung of the plans file's ladder
        public BudgetMode BudgetMode;     // Fixed by default
        public ulong VramReserveBytes;    // Auto: device memory left free for the game
        public int PrefillChunkTokens;    // prompt tokens per step (cancel acts between them); 0: the host's default
        public int SessionsPerStep;       // turns of this many sessions submitted together share decode steps; 0: 1
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
        public string[] StopStrings;      // the answer ends before the first of these
    }

    /// <summary>An image for a VLM pack's prompt (pipeshard_image): 8-bit RGB pixels, Height rows of Width pixels of 3
    /// bytes (R, G, B), top row first, no padding (a texture read back as RGB24, rows flipped if it stores the bottom
    /// row first).</summary>
    public sealed class RgbImage
    {
        public readonly byte[] Rgb;
        public readonly int Width, Height;
        public RgbImage(byte[] rgb, int width, int height) { Rgb = rgb; Width = width; Height = height; }
    }

    /// <summary>Unity's IL2CPP calls back into managed code only through static methods marked so.</summary>
    [AttributeUsage(AttributeTargets.Method)]
    public sealed class MonoPInvokeCallbackAttribute : Attribute
    {
        public MonoPInvokeCallbackAttribute(Type type) { }
    }

    /// <summary>One pack opened with its plans. Every request runs on the host's own worker thread, and the onToken
    /// callbacks are called there (marshal to the game's main thread yourself); GenerateAsync and ChatSession.SayAsync
    /// return at once, Generate and ChatSession.Say wait. Any method may be called from any thread, except the waiting
    /// ones from inside an onToken callback.</summary>
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
            public int budget_mode;
            public ulong vram_reserve_bytes;
            public int prefill_chunk_tokens;
            public int sessions_per_step;
        }

        [StructLayout(LayoutKind.Sequential)]
        internal struct NativeSampling
        {
            public int max_new_tokens;
            public float temperature;
            public int top_k;
            public float top_p;
            public float repetition_penalty;
            public ulong seed;
            public int use_chat_template;
            public IntPtr system_prompt;
            public IntPtr stop_strings;
            public UIntPtr stop_string_count;
        }

        [StructLayout(LayoutKind.Sequential)]
        struct NativeImage
        {
            public IntPtr rgb;
            public int width;
            public int height;
        }

        [UnmanagedFunctionPointer(CallingConvention.Cdecl)]
        internal delegate int TokenCallback(long tokenId, IntPtr textPiece, IntPtr userData);
        [UnmanagedFunctionPointer(CallingConvention.Cdecl)]
        delegate void DoneCallback(ulong request, Status status, IntPtr text, IntPtr message, IntPtr userData);
        [UnmanagedFunctionPointer(CallingConvention.Cdecl)]
        delegate void SentenceCallback(ulong request, IntPtr sentence, IntPtr userData);

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
        static extern Status pipeshard_generate_with_images(IntPtr host, IntPtr prompt, NativeImage[] images,
                                                            UIntPtr imageCount, ref NativeSampling sampling,
                                                            TokenCallback callback, IntPtr userData);
        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        static extern Status pipeshard_submit_with_sentences(IntPtr host, IntPtr session, IntPtr prompt,
                                                             ref NativeSampling sampling, TokenCallback onToken,
                                                             SentenceCallback onSentence, DoneCallback onDone,
                                                             IntPtr userData, out ulong request);
        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        static extern Status pipeshard_cancel(IntPtr host, ulong request);
        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        static extern Status pipeshard_session_create(IntPtr host, IntPtr systemPrompt, out IntPtr session);
        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        internal static extern Status pipeshard_session_say(IntPtr session, IntPtr userText, ref NativeSampling sampling,
                                                            TokenCallback callback, IntPtr userData);
        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        internal static extern Status pipeshard_session_rollback(IntPtr session);
        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        internal static extern Status pipeshard_session_turns(IntPtr session, out UIntPtr turns);
        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        internal static extern Status pipeshard_session_save(IntPtr session, IntPtr path);
        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        static extern Status pipeshard_session_load(IntPtr host, IntPtr path, out IntPtr session);
        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        internal static extern void pipeshard_session_close(IntPtr session);
        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        static extern Status pipeshard_set_auto_budget(IntPtr host, ulong reserveBytes);
        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        static extern Status pipeshard_set_free_vram(IntPtr host, ulong freeBytes);
        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        static extern Status pipeshard_release(IntPtr host);
        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        static extern Status pipeshard_warmup(IntPtr host);
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
        readonly List<ChatSession> sessions = new List<ChatSession>();
        // Static delegates to static methods, kept alive for as long as the library may call them (IL2CPP needs both).
        static readonly TokenCallback Callback = OnToken;
        static readonly DoneCallback Done = OnDone;
        static readonly SentenceCallback Sentence = OnSentence;

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
                native.budget_mode = (int)options.BudgetMode;
                native.vram_reserve_bytes = options.VramReserveBytes;
                native.prefill_chunk_tokens = options.PrefillChunkTokens;
                native.sessions_per_step = options.SessionsPerStep;
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
            var sink = new Request { OnToken = onToken };
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
            var sink = new Request { OnToken = onToken };
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

        /// <summary>Generate from a prompt with images (a VLM pack): image i goes where the prompt's i-th "&lt;image&gt;"
        /// is, or all before its text when it has none. Returns the generated ids, as Generate.</summary>
        public List<long> GenerateWithImages(string prompt, RgbImage[] images, Sampling sampling = null,
                                             Func<long, string, bool> onToken = null)
        {
            var strings = new List<IntPtr>();
            var pins = new List<GCHandle>();
            var sink = new Request { OnToken = onToken };
            GCHandle pinned = GCHandle.Alloc(sink);
            try
            {
                var native = new NativeImage[images.Length];
                for (int i = 0; i < images.Length; i++)
                {
                    GCHandle pixels = GCHandle.Alloc(images[i].Rgb, GCHandleType.Pinned);
                    pins.Add(pixels);
                    native[i] = new NativeImage
                    {
                        rgb = images[i].Rgb == null ? IntPtr.Zero : pixels.AddrOfPinnedObject(),
                        width = images[i].Width, height = images[i].Height
                    };
                }
                NativeSampling nativeSampling = ToNative(sampling ?? new Sampling(), strings);
                Check(pipeshard_generate_with_images(Handle, Utf8(prompt, strings), native,
                                                     new UIntPtr((ulong)native.Length), ref nativeSampling, Callback,
                                                     GCHandle.ToIntPtr(pinned)));
            }
            finally
            {
                pinned.Free();
                foreach (GCHandle pin in pins) pin.Free();
                foreach (IntPtr s in strings) Marshal.FreeHGlobal(s);
            }
            if (sink.Error != null) throw sink.Error;
            return sink.Ids;
        }

        /// <summary>Queue a generation and return at once; `onToken(textPiece)` and `onSentence(sentence)` (each whole
        /// sentence as it completes, then the rest of the answer: for speech) are called on the host's worker thread.
        /// The task ends with the answer's text, is cancelled when `cancellation` fires (the host stops between two
        /// sub-layer runs), or fails with a PipeshardException.</summary>
        public Task<string> GenerateAsync(string prompt, Sampling sampling = null, Action<string> onToken = null,
                                          CancellationToken cancellation = default(CancellationToken),
                                          Action<string> onSentence = null)
        {
            return Submit(IntPtr.Zero, prompt, sampling, onToken, cancellation, onSentence);
        }

        /// <summary>A conversation of its own (one per character), its KV cache kept between turns.</summary>
        public ChatSession CreateSession(string systemPrompt = null)
        {
            var strings = new List<IntPtr>();
            try
            {
                IntPtr session;
                Check(pipeshard_session_create(Handle, Utf8(systemPrompt, strings), out session));
                return Track(new ChatSession(this, session));
            }
            finally
            {
                foreach (IntPtr s in strings) Marshal.FreeHGlobal(s);
            }
        }

        /// <summary>A session saved with ChatSession.Save, continued on this host (the same pack).</summary>
        public ChatSession LoadSession(string path)
        {
            var strings = new List<IntPtr>();
            try
            {
                IntPtr session;
                Check(pipeshard_session_load(Handle, Utf8(path, strings), out session));
                return Track(new ChatSession(this, session));
            }
            finally
            {
                foreach (IntPtr s in strings) Marshal.FreeHGlobal(s);
            }
        }

        internal Task<string> Submit(IntPtr session, string prompt, Sampling sampling, Action<string> onToken,
                                     CancellationToken cancellation, Action<string> onSentence)
        {
            var strings = new List<IntPtr>();
            var request = new Request { OnSentence = onSentence };
            if (onToken != null) request.OnToken = (id, piece) => { onToken(piece); return true; };
            GCHandle pinned = GCHandle.Alloc(request);  // freed by OnDone, which the library calls exactly once
            try
            {
                NativeSampling native = ToNative(sampling ?? new Sampling(), strings);
                ulong id;
                Status status = pipeshard_submit_with_sentences(Handle, session, Utf8(prompt, strings), ref native,
                                                                Callback, onSentence == null ? null : Sentence, Done,
                                                                GCHandle.ToIntPtr(pinned), out id);
                if (status != Status.Ok)
                {
                    pinned.Free();
                    throw new PipeshardException(status, FromUtf8(pipeshard_last_error(handle)));
                }
                if (cancellation.CanBeCanceled)
                {
                    IntPtr host = handle;
                    request.Registration = cancellation.Register(() =>
                    {
                        lock (request) { if (!request.Ended) pipeshard_cancel(host, id); }
                    });
                }
            }
            finally
            {
                foreach (IntPtr s in strings) Marshal.FreeHGlobal(s);
            }
            return request.Completion.Task;
        }

        /// <summary>Follow the device's free memory (or SetFreeVram's figure), keeping `reserveBytes` for the game.</summary>
        public void SetAutoBudget(ulong reserveBytes) { Check(pipeshard_set_auto_budget(Handle, reserveBytes)); }

        /// <summary>The game's own figure of free device memory (e.g. DXGI's budget minus current usage).</summary>
        public void SetFreeVram(ulong freeBytes) { Check(pipeshard_set_free_vram(Handle, freeBytes)); }

        /// <summary>Free all device memory now; the next step uploads what its rung needs again.</summary>
        public void Release() { Check(pipeshard_release(Handle)); }

        /// <summary>Load the rung in force and run one token, so that the first request does not pay for it.</summary>
        public void Warmup() { Check(pipeshard_warmup(Handle)); }

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

        /// <summary>A fixed VRAM budget (the game took memory back, or gave it): the largest ladder rung that fits runs
        /// from the next step on; below every rung of the plans file, the all-CPU rung (no device memory).</summary>
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
            lock (sessions)
            {
                foreach (ChatSession session in sessions) session.Forget();  // pipeshard_close frees them
                sessions.Clear();
            }
            if (handle != IntPtr.Zero) pipeshard_close(handle);
            handle = IntPtr.Zero;
            GC.SuppressFinalize(this);
        }

        ChatSession Track(ChatSession session)
        {
            lock (sessions) sessions.Add(session);
            return session;
        }

        internal void Untrack(ChatSession session)
        {
            lock (sessions) sessions.Remove(session);
        }

        ~PipeshardHost() { Dispose(); }

        internal IntPtr Handle
        {
            get
            {
                if (handle == IntPtr.Zero) throw new ObjectDisposedException("PipeshardHost");
                return handle;
            }
        }

        internal void Check(Status status)
        {
            if (status != Status.Ok) throw new PipeshardException(status, FromUtf8(pipeshard_last_error(handle)));
        }

        // What the callbacks of one request reach through their user data (a GCHandle).
        internal sealed class Request
        {
            public Func<long, string, bool> OnToken;
            public Action<string> OnSentence;
            public readonly List<long> Ids = new List<long>();
            public Exception Error;
            // Continuations run on the thread pool, never on the host's worker (where a blocking call would be refused).
            public readonly TaskCompletionSource<string> Completion =
                new TaskCompletionSource<string>(TaskCreationOptions.RunContinuationsAsynchronously);
            public CancellationTokenRegistration Registration;
            public bool Ended;
        }

        [MonoPInvokeCallback(typeof(TokenCallback))]
        static int OnToken(long tokenId, IntPtr textPiece, IntPtr userData)
        {
            var sink = (Request)GCHandle.FromIntPtr(userData).Target;
            if (tokenId >= 0) sink.Ids.Add(tokenId);  // -1: text held back while it could begin a stop string
            if (sink.Error != null) return 1;  // a sentence callback threw
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

        [MonoPInvokeCallback(typeof(SentenceCallback))]
        static void OnSentence(ulong requestId, IntPtr sentence, IntPtr userData)
        {
            var sink = (Request)GCHandle.FromIntPtr(userData).Target;
            try
            {
                if (sink.Error == null) sink.OnSentence(FromUtf8(sentence));
            }
            catch (Exception error)  // not across the native frames: the next token stops, the task fails with it
            {
                sink.Error = error;
            }
        }

        [MonoPInvokeCallback(typeof(DoneCallback))]
        static void OnDone(ulong requestId, Status status, IntPtr text, IntPtr message, IntPtr userData)
        {
            GCHandle pinned = GCHandle.FromIntPtr(userData);
            var request = (Request)pinned.Target;
            pinned.Free();
            lock (request) request.Ended = true;
            request.Registration.Dispose();
            if (request.Error != null) request.Completion.TrySetException(request.Error);
            else if (status == Status.Ok) request.Completion.TrySetResult(FromUtf8(text));
            else if (status == Status.Cancelled) request.Completion.TrySetCanceled();
            else request.Completion.TrySetException(new PipeshardException(status, FromUtf8(message)));
        }

        // The native sampling struct; its strings (and the stop strings' array) go into `strings`, freed by the caller
        // once the call has returned (the library copies them).
        internal static NativeSampling ToNative(Sampling sampling, List<IntPtr> strings)
        {
            var native = new NativeSampling
            {
                max_new_tokens = sampling.MaxNewTokens, temperature = sampling.Temperature, top_k = sampling.TopK,
                top_p = sampling.TopP, repetition_penalty = sampling.RepetitionPenalty, seed = sampling.Seed,
                use_chat_template = sampling.UseChatTemplate ? 1 : 0,
                system_prompt = Utf8(sampling.SystemPrompt, strings)
            };
            if (sampling.StopStrings != null && sampling.StopStrings.Length > 0)
            {
                IntPtr array = Marshal.AllocHGlobal(IntPtr.Size * sampling.StopStrings.Length);
                strings.Add(array);
                for (int i = 0; i < sampling.StopStrings.Length; ++i)
                    Marshal.WriteIntPtr(array, i * IntPtr.Size, Utf8(sampling.StopStrings[i], strings));
                native.stop_strings = array;
                native.stop_string_count = new UIntPtr((ulong)sampling.StopStrings.Length);
            }
            return native;
        }

        internal static TokenCallback TokenCallbackFor() { return Callback; }

        internal static IntPtr Utf8(string text, List<IntPtr> owned)
        {
            if (text == null) return IntPtr.Zero;
            byte[] bytes = Encoding.UTF8.GetBytes(text);
            IntPtr native = Marshal.AllocHGlobal(bytes.Length + 1);
            Marshal.Copy(bytes, 0, native, bytes.Length);
            Marshal.WriteByte(native, bytes.Length, 0);
            owned.Add(native);
            return native;
        }

        internal static string FromUtf8(IntPtr text)
        {
            if (text == IntPtr.Zero) return "";
            int length = 0;
            while (Marshal.ReadByte(text, length) != 0) ++length;
            var bytes = new byte[length];
            Marshal.Copy(text, bytes, 0, length);
            return Encoding.UTF8.GetString(bytes);
        }
    }

    /// <summary>A conversation over a host (one per character): each turn renders the whole history with the pack's chat
    /// template and feeds only what the session's KV cache does not hold yet. Turns of one session run in order.</summary>
    public sealed class ChatSession : IDisposable
    {
        readonly PipeshardHost host;
        IntPtr handle;

        internal ChatSession(PipeshardHost host, IntPtr handle)
        {
            this.host = host;
            this.handle = handle;
        }

        /// <summary>The next user turn; the answer joins the history when it ends (not when cancelled). `onSentence`
        /// gets each whole sentence of the answer as it completes (see GenerateAsync).</summary>
        public Task<string> SayAsync(string userText, Sampling sampling = null, Action<string> onToken = null,
                                     CancellationToken cancellation = default(CancellationToken),
                                     Action<string> onSentence = null)
        {
            return host.Submit(Handle, userText, sampling, onToken, cancellation, onSentence);
        }

        /// <summary>The next user turn, waiting for the answer; returns its token ids.</summary>
        public List<long> Say(string userText, Sampling sampling = null, Func<long, string, bool> onToken = null)
        {
            var strings = new List<IntPtr>();
            var sink = new PipeshardHost.Request { OnToken = onToken };
            GCHandle pinned = GCHandle.Alloc(sink);
            try
            {
                var native = PipeshardHost.ToNative(sampling ?? new Sampling(), strings);
                host.Check(PipeshardHost.pipeshard_session_say(Handle, PipeshardHost.Utf8(userText, strings), ref native,
                                                               PipeshardHost.TokenCallbackFor(), GCHandle.ToIntPtr(pinned)));
            }
            finally
            {
                pinned.Free();
                foreach (IntPtr s in strings) Marshal.FreeHGlobal(s);
            }
            if (sink.Error != null) throw sink.Error;
            return sink.Ids;
        }

        /// <summary>Drop the last user turn and its answer.</summary>
        public void Rollback() { host.Check(PipeshardHost.pipeshard_session_rollback(Handle)); }

        /// <summary>How many turns (a user message and its answer) the history holds.</summary>
        public int Turns
        {
            get
            {
                UIntPtr turns;
                host.Check(PipeshardHost.pipeshard_session_turns(Handle, out turns));
                return (int)turns.ToUInt64();
            }
        }

        /// <summary>The history and its KV cache to a file (PipeshardHost.LoadSession reads it back).</summary>
        public void Save(string path)
        {
            var strings = new List<IntPtr>();
            try
            {
                host.Check(PipeshardHost.pipeshard_session_save(Handle, PipeshardHost.Utf8(path, strings)));
            }
            finally
            {
                foreach (IntPtr s in strings) Marshal.FreeHGlobal(s);
            }
        }

        /// <summary>Cancel the session's requests, wait for them, and free it.</summary>
        public void Dispose()
        {
            if (handle == IntPtr.Zero) return;
            host.Untrack(this);
            PipeshardHost.pipeshard_session_close(handle);
            handle = IntPtr.Zero;
        }

        internal void Forget() { handle = IntPtr.Zero; }

        IntPtr Handle
        {
            get
            {
                if (handle == IntPtr.Zero) throw new ObjectDisposedException("ChatSession");
                return handle;
            }
        }
    }
}
