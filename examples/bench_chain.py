"""The sub-layer chain vs the monolithic session: decode and prefill tok/s, peak RSS of each.

    python examples/bench_chain.py EXPORT_DIR PACK [--threads 2] [--repeat 5] [--new-tokens 64]

Each engine lives in its own worker process (so each has its own peak RSS); the workers are
driven alternately A B A B ..., never at the same time. Reports medians, spread and ratios.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import numpy as np

PREFILL_TOKENS = 256


def _worker(path: str, threads: int, new_tokens: int, commands, replies) -> None:
    import pipeshard

    pipeshard.use_process_thread_pool(threads)  # as the console script does for run / chat
    engine = pipeshard.load(path, threads=threads)
    engine.codec.eos_token_ids = []  # decode a fixed number of tokens
    rng = np.random.default_rng(0)
    prefill_ids = rng.integers(100, 40000, size=(1, PREFILL_TOKENS)).astype(np.int64)
    decode_prompt = [engine.generator.prompt_ids("Tell me about the history of Rome.")]
    from pipeshard.runtime.generate import SamplingSettings

    while (command := commands.get()) != "stop":
        if command == "decode":
            (result,) = engine.generator.generate(decode_prompt, SamplingSettings(max_new_tokens=new_tokens))
            replies.put(result.decode_tok_s)
        elif command == "prefill":
            engine.step.start(1)
            started = time.perf_counter()
            engine.step.forward(prefill_ids, np.ones_like(prefill_ids), np.arange(PREFILL_TOKENS)[None])
            replies.put(PREFILL_TOKENS / (time.perf_counter() - started))
    from pipeshard.bench import peak_rss_bytes

    replies.put(peak_rss_bytes())


def _summary(values: list[float]) -> str:
    return f"median {statistics.median(values):7.1f}  (min {min(values):.1f}, max {max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export_dir")
    parser.add_argument("pack")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    context = mp.get_context("spawn")
    workers = {}
    for name, path in (("monolithic", args.export_dir), ("chain", args.pack)):
        commands, replies = context.Queue(), context.Queue()
        process = context.Process(target=_worker, args=(path, args.threads, args.new_tokens, commands, replies))
        process.start()
        workers[name] = (process, commands, replies)
    results = {name: {"decode": [], "prefill": []} for name in workers}
    for _ in range(args.repeat + 1):  # the first round warms up and is dropped
        for kind in ("decode", "prefill"):
            for name, (_, commands, replies) in workers.items():
                commands.put(kind)
                results[name][kind].append(replies.get())
    peak_rss = {}
    for name, (process, commands, replies) in workers.items():
        commands.put("stop")
        peak_rss[name] = replies.get()
        process.join()
    print(f"{args.threads} threads, {args.repeat} interleaved rounds (after 1 warm-up), "
          f"decode {args.new_tokens} tokens, prefill {PREFILL_TOKENS} tokens")
    for name in workers:
        decode, prefill = results[name]["decode"][1:], results[name]["prefill"][1:]
        print(f"  {name:10s} decode  {_summary(decode)} tok/s")
        print(f"  {name:10s} prefill {_summary(prefill)} tok/s   peak RSS {peak_rss[name] / 2**20:.0f} MiB")
    for kind in ("decode", "prefill"):
        ratio = statistics.median(results["chain"][kind][1:]) / statistics.median(results["monolithic"][kind][1:])
        print(f"  chain / monolithic {kind}: {ratio:.3f}x")


if __name__ == "__main__":
    main()
