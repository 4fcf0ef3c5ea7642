"""How long a small request waits while four ~1 MiB chat bodies arrive (issue 42's server probe).

Starts `pipeshard serve PACK` on a free port; per round, the best of three small completions alone, then one small
completion 50 ms after four large bodies start (they are refused: too long for the context). Prints both in ms per
round and the median delay.

    python examples/bench_large_bodies.py PACK [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pack")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "pipeshard.cli", "serve", args.pack, "--port", str(port)]
    server = subprocess.Popen(
        [*command, "--parallel", "4", "--context", "256"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        big = json.dumps({"model": "pack", "messages": [{"role": "user", "content": "word " * 200_000}]})
        small = {"model": "pack", "prompt": "Hi", "max_tokens": 1}

        def small_seconds() -> float:
            begin = time.perf_counter()
            httpx.post(base + "/v1/completions", json=small, timeout=60)
            return time.perf_counter() - begin

        alone, beside = [], []
        for _ in range(args.rounds):
            alone.append(min(small_seconds() for _ in range(3)))
            with ThreadPoolExecutor(4) as pool:
                posts = [
                    pool.submit(httpx.post, base + "/v1/chat/completions", content=big, timeout=120)
                    for _ in range(4)
                ]
                time.sleep(0.05)
                beside.append(small_seconds())
                for post in posts:
                    post.result()
    finally:
        server.terminate()
        server.wait()
    print("alone ms", [round(s * 1e3) for s in alone], "beside ms", [round(s * 1e3) for s in beside])
    print("median delay ms", round((statistics.median(beside) - statistics.median(alone)) * 1e3))


if __name__ == "__main__":
    main()
