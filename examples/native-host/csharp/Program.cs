// A console program over PipeshardHost.cs: what a Unity script would do, run under mono in the tests.
//   mono PipeshardConsole.exe PACK "prompt" [EXTENSIONS_LIBRARY]      streams the answer
//   mono PipeshardConsole.exe --check EXTENSIONS_LIBRARY EXPECTED.tsv the CTest case csharp_tokens
// EXPECTED.tsv (tests/test_native_host.py): "pack \t plans \t threads \t max_new_tokens", then one line per prompt:
// "prompt \t the Python engine's greedy ids".
using System;
using System.Collections.Generic;
using System.IO;
using System.Diagnostics;
using System.Linq;
using System.Threading;
using System.Threading.Tasks;
using Pipeshard;

static class Program
{
    static int failures;

    static void Expect(bool ok, string what)
    {
        Console.WriteLine((ok ? "ok   " : "FAIL ") + what);
        if (!ok) ++failures;
    }

    static int Main(string[] args)
    {
        if (args.Length == 3 && args[0] == "--check") return Check(args[1], args[2]);
        if (args.Length < 2)
        {
            Console.Error.WriteLine("usage: PipeshardConsole PACK PROMPT [EXTENSIONS_LIBRARY]");
            return 2;
        }
        try
        {
            using (var host = new PipeshardHost(args[0], new HostOptions { ExtensionsLibrary = args.Length > 2 ? args[2] : null }))
            {
                host.Generate(args[1], new Sampling(), (id, piece) => { Console.Write(piece); return true; });
                Console.WriteLine();
            }
            return 0;
        }
        catch (PipeshardException error)
        {
            Console.Error.WriteLine("error: " + error.Message);
            return 2;
        }
    }

    // GenerateAsync with a token callback, a cancelled long prefill, and two sessions taking turns on one host (an
    // all-CPU one, whose context holds the long prompt; the sessions' turns submitted together share decode steps).
    static void AsyncCancelAndSessions(PipeshardHost host, Sampling sampling, string prompt, List<long> expectedIds,
                                       string otherPrompt)
    {
        string expected = host.Detokenize(expectedIds.ToArray());
        string streamed = "";
        string answer = host.GenerateAsync(prompt, sampling, piece => streamed += piece).Result;
        Expect(answer == expected && streamed == expected, "GenerateAsync: \"" + answer + "\"");

        string longPrompt = string.Concat(Enumerable.Repeat("The quick brown fox jumps over the lazy dog near the river bank. ", 140));
        var cancellation = new CancellationTokenSource();
        Task<string> running = host.GenerateAsync(longPrompt, sampling, null, cancellation.Token);
        Thread.Sleep(300);
        var clock = Stopwatch.StartNew();
        cancellation.Cancel();
        try
        {
            running.Wait();
            Expect(false, "a cancelled GenerateAsync ends cancelled");
        }
        catch (AggregateException error)
        {
            Expect(error.InnerException is TaskCanceledException && running.IsCanceled,
                   "a cancelled GenerateAsync ends cancelled after " + clock.Elapsed.TotalMilliseconds.ToString("F1") +
                   " ms (" + error.InnerException.GetType().Name + ")");
        }
        sampling = new Sampling { MaxNewTokens = 8 };  // a prefix of the answers above: greedy
        string after = host.GenerateAsync(prompt, sampling).Result;
        Expect(after.Length > 0 && expected.StartsWith(after), "the host answers after a cancel: \"" + after + "\"");
        string pirateSystem = "You are a pirate captain. Answer briefly.";
        string pirateExpected = host.GenerateAsync(prompt, new Sampling { MaxNewTokens = 8, SystemPrompt = pirateSystem }).Result;
        using (ChatSession guard = host.CreateSession(), pirate = host.CreateSession(pirateSystem))
        {
            var spokenTurn = new List<string>();
            var turns = new[] { guard.SayAsync(prompt, sampling, null, default(CancellationToken), spokenTurn.Add),
                                pirate.SayAsync(prompt, sampling),
                                guard.SayAsync(otherPrompt, sampling), pirate.SayAsync(otherPrompt, sampling) };
            Task.WaitAll(turns);
            Expect(turns[0].Result == after && string.Concat(spokenTurn) == after,
                   "session 1, turn 1 is the one-shot answer, also in sentences: \"" + turns[0].Result + "\"");
            Expect(turns[1].Result == pirateExpected, "session 2, turn 1 is the one-shot answer with its system prompt: \"" +
                                                      turns[1].Result + "\"");
            Expect(guard.Turns == 2 && pirate.Turns == 2, "each session keeps its own two turns");
            string report = host.Report();
            Expect(report.Contains("\"shared_steps\": ") && !report.Contains("\"shared_steps\": 0,"),
                   "the two sessions' turns shared decode steps: " + report);
            pirate.Rollback();
            string again = pirate.SayAsync(otherPrompt, sampling).Result;
            Expect(again == turns[3].Result && pirate.Turns == 2, "a rolled-back turn said again: \"" + again + "\"");
        }
    }

    static int Check(string extensions, string expectedPath)
    {
        string[] lines = File.ReadAllLines(expectedPath);
        string[] head = lines[0].Split('\t');
        string pack = head[0], plans = head[1];
        int threads = int.Parse(head[2]);
        var sampling = new Sampling { MaxNewTokens = int.Parse(head[3]) };
        var cases = lines.Skip(1).Select(line => line.Split('\t'))
                         .Select(parts => new { Prompt = parts[0], Ids = parts[1].Split(' ').Select(long.Parse).ToList() })
                         .ToList();
        using (var host = new PipeshardHost(pack, new HostOptions { ExtensionsLibrary = extensions, Threads = threads,
                                                                SessionsPerStep = 2 }))
        {
            foreach (var item in cases)
            {
                string text = "";
                List<long> ids = host.Generate(item.Prompt, sampling, (id, piece) => { text += piece; return true; });
                Expect(ids.SequenceEqual(item.Ids), "all-CPU \"" + item.Prompt + "\": C# [" + string.Join(" ", ids) +
                                                    "] python [" + string.Join(" ", item.Ids) + "]");
                Console.WriteLine("     " + text.Replace("\n", "\\n"));
            }
            long[] hello = host.Tokenize("Hello, world!");
            Expect(host.Detokenize(hello) == "Hello, world!", "Tokenize/Detokenize round trip: " + string.Join(" ", hello));
            var stopped = host.Generate(cases[0].Prompt, sampling, (id, piece) => false);
            Expect(stopped.Count == 1, "a callback returning false stops after its token");
            var sentences = new List<string>();
            var last = cases[cases.Count - 1];
            string spoken = host.GenerateAsync(last.Prompt, sampling, null, default(CancellationToken), sentences.Add).Result;
            Expect(spoken == host.Detokenize(last.Ids.ToArray()) && string.Concat(sentences) == spoken && sentences.Count > 1,
                   "GenerateAsync's sentences make the answer: [" + string.Join("][", sentences) + "]");
            AsyncCancelAndSessions(host, sampling, cases[0].Prompt, cases[0].Ids, cases[1].Prompt);
        }
        var options = new HostOptions { ExtensionsLibrary = extensions, Threads = threads, PlansPath = plans, Device = "sim" };
        using (var host = new PipeshardHost(pack, options))
        {
            List<long> ids = host.Generate(cases[0].Prompt, sampling);
            Expect(ids.SequenceEqual(cases[0].Ids), "with the plans file: C# [" + string.Join(" ", ids) + "]");
            host.SetVramBudget(1024);
            Expect(host.Generate(cases[0].Prompt, sampling).SequenceEqual(cases[0].Ids),
                   "a 1 KiB budget runs the all-CPU rung with the same tokens");
            Console.WriteLine("     report: " + host.Report());
        }
        try
        {
            new PipeshardHost("/nonexistent/pack").Dispose();
            Expect(false, "a missing pack is refused");
        }
        catch (PipeshardException error)
        {
            Expect(error.Status == Status.BadPack, "a missing pack is refused: " + error.Message);
        }
        return failures == 0 ? 0 : 1;
    }
}
