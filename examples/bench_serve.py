"""Load on `pipeshard serve`: N concurrent clients against the same requests one after another.

    python examples/bench_serve.py PACK [--clients 1,4,8,16] [--new-tokens 64] [--threads 2] [--rounds 2]

Starts the server (`--parallel` = the most clients), and per round and client count sends that many chat requests
(distinct prompts, greedy, up to --new-tokens each) all at once, then the same requests one after another,
alternating which goes first. Reports aggregate decode tokens/s
(completion tokens over the wall time), TTFT p50 / p95 of the concurrent requests, and the ratio to sequential;
medians over rounds.

A load test of the server as clients see it (HTTP, SSE, the scheduler's queue, requests joining between steps), which
`pipeshard bench` cannot be: its rows are engines in worker processes, each run one generation. The engine's own
batched step beside onnxruntime-genai's batch is `pipeshard bench PACK --device cpu --plans cpu --peers ort-genai
--sequences 1,8` (docs/bench.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TOPICS = [
    "the sea",
    "mountains",
    "a city at night",
    "rain",
    "a library",
    "trains",
    "the moon",
    "a garden",
    "winter",
    "a market",
    "bridges",
    "the desert",
    "music",
    "a forest",
    "clocks",
    "rivers",
]


def start_server(pack: str, parallel: int, threads: int, port: int) -> subprocess.Popen:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipeshard.cli",
            "serve",
            pack,
            "--port",
            str(port),
            "--parallel",
            str(parallel),
            "--threads",
            str(threads),
            "--context",
            "512",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    import httpx

    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    process.kill()
    raise SystemExit("the server did not start")


def one_request(base: str, prompt: str, new_tokens: int) -> tuple[float, float, int]:
    """(seconds to the first token, seconds in all, completion tokens) of one streamed chat request."""
    import httpx

    body = {
        "model": "pack",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": new_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first, tokens = None, 0
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=600) as answer:
        for line in answer.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - started
    return first or 0.0, time.perf_counter() - started, tokens


def measure(base: str, clients: int, new_tokens: int, concurrent: bool) -> dict:
    prompts = [f"Write a short paragraph about {TOPICS[i % len(TOPICS)]}." for i in range(clients)]
    started = time.perf_counter()
    if concurrent:
        with ThreadPoolExecutor(clients) as pool:
            results = list(pool.map(lambda p: one_request(base, p, new_tokens), prompts))
    else:
        results = [one_request(base, p, new_tokens) for p in prompts]
    wall = time.perf_counter() - started
    ttfts = sorted(r[0] for r in results)
    return {
        "tok_s": sum(r[2] for r in results) / wall,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p95": ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))],
        "tokens": sum(r[2] for r in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pack")
    parser.add_argument("--clients", default="1,4,8,16")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=8877)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    counts = [int(c) for c in args.clients.split(",")]
    process = start_server(args.pack, max(counts), args.threads, args.port)
    base = f"http://127.0.0.1:{args.port}"
    rows = {}
    try:
        one_request(base, "Hi", 4)  # warm-up: the plans' sessions are made
        for clients in counts:
            rounds = []
            for round_index in range(args.rounds):
                order = (True, False) if round_index % 2 == 0 else (False, True)
                measured = {
                    concurrent: measure(base, clients, args.new_tokens, concurrent) for concurrent in order
                }
                rounds.append(measured)
            together = [r[True] for r in rounds]
            alone = [r[False] for r in rounds]
            rows[clients] = {
                "concurrent_tok_s": statistics.median(r["tok_s"] for r in together),
                "sequential_tok_s": statistics.median(r["tok_s"] for r in alone),
                "ratio": statistics.median(
                    t["tok_s"] / a["tok_s"] for t, a in zip(together, alone, strict=True)
                ),
                "ttft_p50_s": statistics.median(r["ttft_p50"] for r in together),
                "ttft_p95_s": statistics.median(r["ttft_p95"] for r in together),
                "sequential_ttft_p50_s": statistics.median(r["ttft_p50"] for r in alone),
            }
    finally:
        process.terminate()
        process.wait(timeout=30)
    print(
        f"{args.pack}: {args.new_tokens} new tokens per request, greedy, {args.threads} threads, "
        f"{args.rounds} rounds (medians)"
    )
    print(
        "clients  concurrent tok/s  sequential tok/s  ratio  TTFT p50 ms  TTFT p95 ms  (sequential TTFT p50 ms)"
    )
    for clients, row in rows.items():
        print(
            f"{clients:7d}  {row['concurrent_tok_s']:16.1f}  {row['sequential_tok_s']:16.1f}  {row['ratio']:5.2f}"
            f"  {row['ttft_p50_s'] * 1000:11.0f}  {row['ttft_p95_s'] * 1000:11.0f}  "
            f"({row['sequential_ttft_p50_s'] * 1000:.0f})"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
