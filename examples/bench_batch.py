"""Throughput of a `pipeshard batch` job: --parallel N against one prompt at a time, and on a local Ray cluster.

    python examples/bench_batch.py PACK [--prompts 256] [--new-tokens 32] [--parallel 8] [--threads 2]

Writes a job of distinct chat prompts, runs it with `--parallel N`, with `--parallel 1`, and through `--ray` on a
local two-node cluster (`ray.cluster_utils.Cluster`, one core per node, so the two actors share this machine's
cores as the single process does), each from an empty output, and prints requests, generated tokens, wall time
and generated tokens/s per run.

The job front end as a user runs it (JSONL in and out, the scheduler's slots, a Ray cluster), which `pipeshard bench`
cannot be: its rows are engines in worker processes, each run one generation. The engine's own batched step at N
sequences against one is `pipeshard bench PACK --device cpu --plans cpu --sequences 1,8` (docs/bench.md).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

TOPICS = ["the sea", "mountains", "a city at night", "rain", "a library", "trains", "the moon", "a garden"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pack")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import pipeshard
    from pipeshard.batch import run_batch, run_batch_ray

    folder = Path(tempfile.mkdtemp(prefix="pipeshard-bench-batch-"))
    job = folder / "job.jsonl"
    with open(job, "w") as lines:
        for i in range(args.prompts):
            lines.write(
                json.dumps(
                    {
                        "custom_id": f"q{i}",
                        "messages": [
                            {
                                "role": "user",
                                "content": f"Write one sentence about {TOPICS[i % len(TOPICS)]} (number {i}).",
                            }
                        ],
                        "max_tokens": args.new_tokens,
                    }
                )
                + "\n"
            )
    rows = []
    for label, parallel in ((f"--parallel {args.parallel}", args.parallel), ("--parallel 1", 1)):
        engine = pipeshard.load(args.pack, threads=args.threads, batch=parallel)
        started = time.perf_counter()
        summary = run_batch(
            engine, job, folder / f"out-{parallel}.jsonl", "pack", parallel, args.new_tokens, progress=False
        )
        rows.append((label, summary, time.perf_counter() - started))
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 200 * 2**20}
    )
    try:
        cluster.add_node(num_cpus=1, object_store_memory=200 * 2**20)
        cluster.wait_for_nodes()
        started = time.perf_counter()
        summary = run_batch_ray(
            cluster.address,
            Path(args.pack).resolve(),
            job,
            folder / "out-ray.jsonl",
            "pack",
            args.parallel,
            args.new_tokens,
            {"threads": 1, "batch": args.parallel},
            progress=False,
        )
        rows.append(
            (f"--ray (2 nodes x 1 core), --parallel {args.parallel}", summary, time.perf_counter() - started)
        )
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()
    print(f"{args.pack}: {args.prompts} chat prompts, up to {args.new_tokens} new tokens each, greedy")
    print(f"{'run':48s} {'requests':>8s} {'generated':>9s} {'wall s':>7s} {'tok/s':>7s}")
    for label, summary, wall in rows:
        print(
            f"{label:48s} {summary.requests:8d} {summary.generated_tokens:9d} {wall:7.1f} "
            f"{summary.generated_tokens / wall:7.1f}"
        )


if __name__ == "__main__":
    main()
