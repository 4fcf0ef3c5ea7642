"""Time to first token with and without the prefix cache, for requests sharing a long system prompt.

    python examples/bench_prefix_cache.py PACK [--requests 16] [--prefix-tokens 1000] [--threads 2]
                                          [--cache 256MiB] [--new-tokens 8] [-- SERVE OPTIONS ...]

Starts `pipeshard serve` twice, without and with `--prefix-cache`, and each time sends the same chat requests one
after another, streamed and greedy: one system prompt of about --prefix-tokens tokens (a few-shot preamble, as an
evaluation harness or an agent sends) and a different short question each. Prints each run's TTFT (request sent to
first streamed text) of the first request and the median of the others, their ratio, the prompt tokens the cache
gave, and whether every answer is the same text in both runs. Options after `--` go to both servers (e.g.
`-- --device sim --vram 25% --profile laptop-8gb`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

QUESTIONS = [
    "What is the capital of France?",
    "Name a large river.",
    "How many legs does a spider have?",
    "What colour is the sky?",
    "Who wrote Hamlet?",
    "What is 12 times 12?",
    "Name a planet.",
    "What do bees make?",
    "Which ocean is the largest?",
    "What is ice made of?",
    "Name a musical instrument.",
    "How many days are in a week?",
    "What is the opposite of hot?",
    "Name a fruit that is yellow.",
    "What language is spoken in Spain?",
    "What gas do plants take in?",
    "Name a bird that cannot fly.",
    "What is the freezing point of water?",
]
FACTS = [
    "Answer in one short sentence.",
    "Prefer plain words over technical terms.",
    "If a question has a number as its answer, give the number first.",
    "Never invent a source or a quotation.",
    "When you are unsure, say so and give your best guess.",
    "Keep the tone friendly and calm.",
    "Do not repeat the question back.",
    "Use the metric system unless asked otherwise.",
]


def system_prompt(tokens: int) -> str:
    """A preamble of rules and examples of about `tokens` tokens (SmolLM2 reads ~3.1 of its characters a token)."""
    lines, number = ["You are a helpful assistant for a quiz. Follow these rules."], 0
    while sum(len(line) for line in lines) < tokens * 3.1:
        lines.append(f"Rule {number + 1}: {FACTS[number % len(FACTS)]}")
        lines.append(f"Example {number + 1}: Q: {QUESTIONS[number % len(QUESTIONS)]} A: (a short answer).")
        number += 1
    return "\n".join(lines)


def start_server(pack: str, port: int, threads: int, extra: list[str]) -> subprocess.Popen:
    import httpx

    command = [sys.executable, "-m", "pipeshard.cli", "serve", pack, "--port", str(port)]
    command += ["--threads", str(threads), "--parallel", "4", "--context", "2048", *extra]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for _ in range(1200):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        if process.poll() is not None:
            raise SystemExit(process.stdout.read())
        time.sleep(0.1)
    process.kill()
    raise SystemExit("the server did not start")


def ask(base: str, system: str, question: str, new_tokens: int) -> tuple[float, str]:
    """One streamed greedy request: seconds to its first text, and its whole text."""
    import httpx

    body = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": new_tokens,
        "temperature": 0,
        "stream": True,
    }
    started, first, pieces = time.perf_counter(), None, []
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
            if delta:
                first = first or time.perf_counter() - started
                pieces.append(delta)
    return (first if first is not None else time.perf_counter() - started), "".join(pieces)


def run(pack: str, cache: str, args, port: int) -> dict:
    import httpx

    options = [*args.serve_options, *(["--prefix-cache", cache] if cache != "0" else [])]
    process = start_server(pack, port, args.threads, options)
    base = f"http://127.0.0.1:{port}"
    try:
        system = system_prompt(args.prefix_tokens)
        prefix = len(httpx.post(base + "/tokenize", json={"content": system}).json()["tokens"])
        timed = [ask(base, system, q, args.new_tokens) for q in QUESTIONS[: args.requests]]
        reused = 0.0
        for line in httpx.get(base + "/metrics").text.splitlines():
            if line.startswith("pipeshard_prefix_cache_reused_tokens_total "):
                reused = float(line.split()[1])
        return {
            "ttft": [t for t, _ in timed],
            "texts": [x for _, x in timed],
            "prefix": prefix,
            "reused": reused,
        }
    finally:
        process.terminate()
        process.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pack")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache", default="256MiB")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--port", type=int, default=8097)
    parser.add_argument("serve_options", nargs="*", help="after --: options for both servers")
    args = parser.parse_args()
    without = run(args.pack, "0", args, args.port)
    with_cache = run(args.pack, args.cache, args, args.port + 1)
    print(
        f"{args.requests} requests, a system prompt of {without['prefix']} tokens, {args.new_tokens} new tokens each"
    )
    for name, result in (("without the cache", without), (f"--prefix-cache {args.cache}", with_cache)):
        ttft = result["ttft"]
        print(
            f"{name:>26}: first request TTFT {ttft[0] * 1e3:7.1f} ms, median of the others "
            f"{statistics.median(ttft[1:]) * 1e3:7.1f} ms, prompt tokens reused {result['reused']:.0f}"
        )
    speedup = statistics.median(without["ttft"][1:]) / statistics.median(with_cache["ttft"][1:])
    print(f"TTFT of the requests after the first: {speedup:.1f}x faster with the cache")
    print(f"same texts in both runs: {without['texts'] == with_cache['texts']}")


if __name__ == "__main__":
    main()
