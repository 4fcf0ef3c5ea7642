"""Decode tok/s of the native host (examples/native-host) against the Python engine, on one pack, paired rounds.

Each round starts one process per engine (their order alternates between rounds, so neither always runs first on
a warmer or quieter machine); each loads the pack, warms up on a short run, then decodes the same prompt ids
greedily and prints its tokens and decode tok/s. The figure is the median over rounds of native / Python, with
the medians and spread of each side. `--plans FILE` runs both on that plans file with the simulated device
(`sim`); without it both run every unit on the CPU. Both must give the same tokens (the host stops at the
end-of-sequence token, so the prompt should ask for a long answer).

    make host
    python examples/bench_native_host.py PACK --rounds 7 --new-tokens 64 --threads 2 [--plans plans.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "Write a long story about a dragon who learns to bake bread, with many details."


def _python_worker(args: argparse.Namespace, prompt: list[int]) -> dict:
    import pipeshard
    from pipeshard.runtime.generate import SamplingSettings
    from pipeshard.runtime.ort import request_process_thread_pool

    request_process_thread_pool(args.threads)
    if args.plans:
        engine = pipeshard.load(args.pack, threads=args.threads, device="sim", plans=args.plans)
    else:
        engine = pipeshard.load(args.pack, threads=args.threads, device="cpu", plan="cpu")
    engine.generator.generate([prompt], SamplingSettings(max_new_tokens=args.warmup_tokens))
    result = engine.generator.generate([prompt], SamplingSettings(max_new_tokens=args.new_tokens))[0]
    return {"tokens": result.tokens, "decode_tok_s": result.decode_tok_s}


def _native_worker(args: argparse.Namespace, prompt: list[int]) -> dict:
    from pipeshard.peers import HOST_TOKEN_CALLBACK, HostOptions, HostSampling, native_host_library

    library = ctypes.CDLL(str(native_host_library()))
    library.pipeshard_last_error.restype = ctypes.c_char_p
    options = HostOptions()
    library.pipeshard_default_options(ctypes.byref(options))
    options.threads = args.threads
    if args.plans:
        options.plans_path, options.device = args.plans.encode(), b"sim"
    else:
        options.context = len(prompt) + args.new_tokens + 8
    host = ctypes.c_void_p()
    if library.pipeshard_open(args.pack.encode(), ctypes.byref(options), ctypes.byref(host)) != 0:
        raise SystemExit(f"error: {library.pipeshard_last_error(None).decode()}")
    ids = (ctypes.c_int64 * len(prompt))(*prompt)

    def generate(new_tokens: int) -> tuple[list[int], list[float]]:
        sampling = HostSampling()
        library.pipeshard_default_sampling(ctypes.byref(sampling))
        sampling.max_new_tokens = new_tokens
        tokens, times = [], []

        def on_token(token: int, _piece: bytes, _user_data) -> int:
            times.append(time.perf_counter())
            tokens.append(int(token))
            return 0

        callback = HOST_TOKEN_CALLBACK(on_token)
        if (
            library.pipeshard_generate_ids(host, ids, len(prompt), ctypes.byref(sampling), callback, None)
            != 0
        ):
            raise SystemExit(f"error: {library.pipeshard_last_error(host).decode()}")
        return tokens, times

    generate(args.warmup_tokens)
    tokens, times = generate(args.new_tokens)
    library.pipeshard_close(host)
    rate = (len(tokens) - 1) / (times[-1] - times[0]) if len(tokens) > 1 else 0.0
    return {"tokens": tokens, "decode_tok_s": rate}


def _prompt_ids(pack: str, text: str) -> list[int]:
    from pipeshard.runtime.text import TextCodec

    codec = TextCodec(Path(pack))
    return codec.encode(codec.render_chat(text))


def _run_worker(args: argparse.Namespace, engine: str, prompt: list[int]) -> dict:
    command = [
        sys.executable,
        *(["-P"] if sys.flags.safe_path else []),
        __file__,
        args.pack,
        "--worker",
        engine,
    ]
    command += ["--threads", str(args.threads), "--new-tokens", str(args.new_tokens)]
    command += ["--warmup-tokens", str(args.warmup_tokens), "--prompt-ids", ",".join(map(str, prompt))]
    command += ["--plans", args.plans] if args.plans else []
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: the {engine} worker failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pack")
    parser.add_argument("--plans", help="a plans.json: both engines run it on the simulated device")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--warmup-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--json", help="write the rounds and figures here")
    parser.add_argument("--worker", choices=("python", "native"), help=argparse.SUPPRESS)
    parser.add_argument("--prompt-ids", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        prompt = [int(i) for i in args.prompt_ids.split(",")]
        worker = _python_worker if args.worker == "python" else _native_worker
        print(json.dumps(worker(args, prompt)))
        return
    prompt = _prompt_ids(args.pack, args.prompt)
    rounds = []
    for index in range(args.rounds):
        order = ("python", "native") if index % 2 == 0 else ("native", "python")
        measured = {engine: _run_worker(args, engine, prompt) for engine in order}
        same = (
            measured["native"]["tokens"] == measured["python"]["tokens"][: len(measured["native"]["tokens"])]
        )
        if not same:
            raise SystemExit(
                f"error: round {index}: the native host's tokens differ from the Python engine's"
            )
        rates = {engine: measured[engine]["decode_tok_s"] for engine in ("python", "native")}
        rounds.append({"order": list(order), **rates, "ratio": rates["native"] / rates["python"]})
        print(
            f"round {index}: python {rates['python']:.2f} tok/s, native {rates['native']:.2f} tok/s, "
            f"ratio {rounds[-1]['ratio']:.3f} ({order[0]} first)",
            flush=True,
        )
    summary = {
        "prompt_tokens": len(prompt),
        "new_tokens": args.new_tokens,
        "threads": args.threads,
        "plans": args.plans,
        "rounds": rounds,
    }
    for engine in ("python", "native"):
        values = [r[engine] for r in rounds]
        summary[engine] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    ratios = [r["ratio"] for r in rounds]
    summary["ratio"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    for key in ("python", "native", "ratio"):
        figures = summary[key]
        print(f"{key}: median {figures['median']:.3f} (min {figures['min']:.3f}, max {figures['max']:.3f})")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
