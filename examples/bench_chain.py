"""The sub-layer chain vs the monolithic session: decode and prefill tok/s and peak RSS of each.

    python examples/bench_chain.py PACK [--threads 2] [--repeat 5] [--processes 1] [--new-tokens 64]
                                        [--prompt-tokens 256]

A shortcut for `pipeshard bench PACK --device cpu --plans monolithic,cpu --peers none --prompt-tokens 256`:
each engine in worker processes of its own (`--processes` per engine), driven round-robin, medians,
spread and paired ratios.
"""

from __future__ import annotations

import argparse
import sys

from pipeshard.bench import BenchSettings, bench_table, run_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pack")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    args = parser.parse_args()
    settings = BenchSettings(pack=args.pack, device="cpu", plans=["monolithic", "cpu"],
                             prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, threads=args.threads,
                             repeat=args.repeat, processes=args.processes)
    document = run_bench(settings, log=lambda line: print(line, file=sys.stderr))
    print(bench_table(document))
    chain = next(row for row in document["rows"] if row["name"] == "cpu")
    print(f"chain / monolithic, median of per-round ratios: decode {chain['decode_tok_s_paired_ratio']:.3f}x, "
          f"prefill ({document['settings']['prompt_token_count']} tokens) {chain['prefill_tok_s_paired_ratio']:.3f}x")


if __name__ == "__main__":
    main()
