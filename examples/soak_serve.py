"""A bounded soak of `pipeshard serve` on the simulated device: random requests, disconnects and budget changes.

    python examples/soak_serve.py PACK [--seconds 120] [--clients 6] [--profile laptop-8gb]

Starts `serve PACK --device sim` at 25 % of the model, then for --seconds runs --clients threads that each send
random requests (chat or completion, streamed or not, 1-48 new tokens, some sampled), a quarter of the streamed
ones dropped after a few chunks, while another thread moves the budget between 25 % and 60 % every few seconds.
At the end, with nothing in flight: every slot free, nothing queued, no request failed with a 5xx or a broken
stream, the device's ledger within the budget, and the server's RSS sampled every second (the median of each
quarter of the run).
Prints one JSON object; exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import threading
import time


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def metrics(base: str) -> dict[str, float]:
    import httpx

    values = {}
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        name, _, value = line.rpartition(" ")
        if "{" not in name:
            values[name] = float(value)
    return values


def main() -> None:
    import httpx

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pack")
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--profile", default="laptop-8gb")
    parser.add_argument("--port", type=int, default=8878)
    args = parser.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipeshard.cli",
            "serve",
            args.pack,
            "--port",
            str(args.port),
            "--device",
            "sim",
            "--vram",
            "25%",
            "--profile",
            args.profile,
            "--parallel",
            "4",
            "--queue",
            "8",
            "--context",
            "512",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    for _ in range(600):
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    counts = {"ok": 0, "dropped": 0, "busy_503": 0, "failed": 0, "budget_changes": 0}
    failures: list[str] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + args.seconds

    def count(key: str, detail: str | None = None) -> None:
        with lock:
            counts[key] += 1
            if detail and len(failures) < 10:
                failures.append(detail)

    def client(seed: int) -> None:
        rng = random.Random(seed)
        words = [
            "tell",
            "me",
            "about",
            "the",
            "sea",
            "a",
            "story",
            "why",
            "how",
            "numbers",
            "colors",
            "please",
        ]
        while time.monotonic() < stop_at:
            text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 40)))
            chat = rng.random() < 0.5
            body = {
                "model": "pack",
                "max_tokens": rng.randint(1, 48),
                "stream": rng.random() < 0.6,
                "temperature": rng.choice([0, 0, 0.8]),
                "seed": rng.randint(0, 9),
            }
            body.update({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text})
            url = base + ("/v1/chat/completions" if chat else "/v1/completions")
            try:
                if body["stream"]:
                    drop = rng.random() < 0.25
                    with httpx.stream("POST", url, json=body, timeout=120) as answer:
                        if answer.status_code == 503:
                            count("busy_503")
                            continue
                        if answer.status_code != 200:
                            count("failed", f"{answer.status_code}")
                            continue
                        chunks, done = 0, False
                        for line in answer.iter_lines():
                            chunks += line.startswith("data: {")
                            done = done or line == "data: [DONE]"
                            if drop and chunks >= 2:
                                break
                    count(
                        "dropped" if drop and not done else "ok" if done else "failed",
                        None if done or drop else "stream ended without [DONE]",
                    )
                else:
                    answer = httpx.post(url, json=body, timeout=120)
                    if answer.status_code == 503:
                        count("busy_503")
                    elif (
                        answer.status_code == 200
                        and answer.json()["usage"]["completion_tokens"] <= body["max_tokens"]
                    ):
                        count("ok")
                    else:
                        count("failed", f"{answer.status_code} {answer.text[:200]}")
            except httpx.HTTPError as error:
                count("failed", repr(error))

    def budgets() -> None:
        rng = random.Random(99)
        while time.monotonic() < stop_at:
            time.sleep(rng.uniform(2, 6))
            answer = httpx.post(
                base + "/v1/budget", json={"vram": rng.choice(["25%", "40%", "60%"])}, timeout=60
            )
            count(
                "budget_changes" if answer.status_code == 200 else "failed",
                None if answer.status_code == 200 else answer.text[:200],
            )

    rss: list[float] = []

    def sample() -> None:
        while time.monotonic() < stop_at:
            rss.append(rss_mib(process.pid))
            time.sleep(1)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    threads += [threading.Thread(target=budgets), threading.Thread(target=sample)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    time.sleep(0.5)
    final = metrics(base)
    process.terminate()
    process.wait(timeout=30)
    quarter = max(1, len(rss) // 4)
    report = {
        "seconds": args.seconds,
        **counts,
        "failures": failures,
        "slots_free": final["pipeshard_slots_free"],
        "slots_total": final["pipeshard_slots_total"],
        "queued": final["pipeshard_requests_queued"],
        "running": final["pipeshard_requests_running"],
        "requests_total": final["pipeshard_requests_total"],
        "cancelled_total": final["pipeshard_requests_cancelled_total"],
        "device_used_bytes": final["pipeshard_device_used_bytes"],
        "budget_bytes": final["pipeshard_vram_budget_bytes"],
        "device_peak_bytes": final["pipeshard_device_peak_bytes"],
        "rss_mib_by_quarter": [
            round(statistics.median(rss[i * quarter : (i + 1) * quarter]), 1) for i in range(4)
        ]
        if len(rss) >= 4
        else rss,
    }
    print(json.dumps(report, indent=1))
    checks = [
        counts["failed"] == 0,
        report["slots_free"] == report["slots_total"],
        report["queued"] == 0,
        report["running"] == 0,
        report["device_used_bytes"] <= report["budget_bytes"],
    ]
    sys.exit(0 if all(checks) else 1)


if __name__ == "__main__":
    main()
