"""Decode tokens/s of the native host (examples/native-host) beside the Python engine, same pack, prompt and threads.

Each round runs both, each in a fresh process, in alternating order; the ratio of a round is native / Python, and
the summary gives the median and the spread of the ratios (the machine is noisy: pairs, not absolute figures).

    python examples/bench_native_host.py PACK --threads 2 --rounds 6 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HOST_CLI = REPO / "build" / "native-host" / "build" / "pipeshard-host"
EXTENSIONS = REPO / "build" / "native-host" / "deps" / "extensions" / "lib" / "libortextensions.so"
PROMPT = "Write a short poem about autumn leaves."


def python_once(pack: str, prompt: str, threads: int, max_new_tokens: int) -> dict:
    """One generation by the Python engine (all-CPU chain)."""
    import pipeshard

    engine = pipeshard.load(pack, threads=threads)
    result = engine.generate(prompt, max_new_tokens=max_new_tokens)[0]
    return {"decode_tok_s": result.decode_tok_s, "tokens": result.tokens}


def native_once(pack: str, prompt: str, threads: int, max_new_tokens: int) -> dict:
    done = subprocess.run([str(HOST_CLI), pack, prompt, "--extensions", str(EXTENSIONS), "--threads", str(threads),
                           "--max-new-tokens", str(max_new_tokens), "--print-ids", "--report"],
                          capture_output=True, text=True, check=True)
    report = json.loads(done.stderr.strip().splitlines()[-1])
    return {"decode_tok_s": report["last"]["decode_tok_s"], "tokens": [int(t) for t in done.stdout.split()]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pack")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--python-once", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.python_once:
        print(json.dumps(python_once(args.pack, args.prompt, args.threads, args.max_new_tokens)))
        return
    python_command = [sys.executable, *(["-P"] if sys.flags.safe_path else []), __file__, args.pack, "--python-once",
                      "--threads", str(args.threads), "--max-new-tokens", str(args.max_new_tokens),
                      "--prompt", args.prompt]
    rows = []
    for round_index in range(args.rounds):
        def run_python() -> dict:
            done = subprocess.run(python_command, capture_output=True, text=True, check=True)
            return json.loads(done.stdout.strip().splitlines()[-1])

        def run_native() -> dict:
            return native_once(args.pack, args.prompt, args.threads, args.max_new_tokens)

        first, second = (run_native, run_python) if round_index % 2 == 0 else (run_python, run_native)
        results = {first.__name__: first(), second.__name__: second()}
        native, python = results["run_native"], results["run_python"]
        same = native["tokens"] == python["tokens"]
        ratio = native["decode_tok_s"] / python["decode_tok_s"]
        rows.append(ratio)
        print(f"round {round_index + 1}: native {native['decode_tok_s']:.1f} tok/s, "
              f"python {python['decode_tok_s']:.1f} tok/s, ratio {ratio:.2f}, {len(native['tokens'])} tokens, "
              f"same tokens: {same}", flush=True)
    print(f"native / python decode tok/s over {len(rows)} paired rounds: median {statistics.median(rows):.2f}, "
          f"min {min(rows):.2f}, max {max(rows):.2f}")


if __name__ == "__main__":
    main()
