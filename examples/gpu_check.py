"""The GPU check (shared/GPU-CHECK.md): one run of the CUDA path end to end, in stages that each write their JSON
the moment they finish, so a run cut short still leaves what it measured.

    python examples/gpu_check.py --pack PACK [--moe-pack PACK] [--device cuda|sim] [--budgets 0.25,0.6]
        [--native-host BINARY --extensions LIB] [--kernel-table FILE] [--deadline-s 330] [--out DIR] [--dry-run]

Stages, each OUT/<n>-<stage>.json, and OUT/summary.json rewritten after each:
1. environment: versions, the GPU, free device memory (cudaMemGetInfo), the providers a test session really got
   (stops here if CUDA did not load).
2. placement: every device graph of the packs (sub-layers and vision blocks, weights as inputs) in a session of the
   device's EP, CPU fallback allowed, with ONNX Runtime's verbose log: where it placed each node (all on CUDA
   expected), beside what the kernel check (runtime/kernel_check.py) predicted.
3. profile: a quick profile of this machine with its CUDA part (skipped with `--profile`).
4. bench at each budget (`--budgets`, fractions of the model's weights): pipeshard's plan and the `layers` and
   `offload` baselines on the device beside the all-CPU chain: decode tok/s, TTFT, greedy tokens against the
   chain's, predicted vs measured decode step, peak device memory (the ledger), bytes streamed, copy time hidden;
   cudaMemGetInfo's free bytes before and after. The same for `--moe-pack`.
5. native host: the C++ host (`--native-host`) on the device with the planner's plans, its tokens against the
   chain's.
A stage that would start after `--deadline-s` is recorded as skipped. `--dry-run`: every stage on `sim` with a
reference profile and a few tokens, as the test suite runs it. Exit status 0 when every stage that ran is ok.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

PROMPT = "Explain in two sentences why the sky is blue."
PLANS = ("auto", "layers", "offload")
_PLACED = re.compile(r"(?:All nodes|Node\(s\)) placed on \[(\w+)\]\. Number of nodes: (\d+)")
_PLACED_NODE = re.compile(r"VerifyEachNodeIsAssignedToAnEp\]\s{2,}(\S+) \((.*)\)\s*$")


class Check:
    """The stages' results, each written to OUT as it finishes."""

    def __init__(self, out: Path, deadline_s: float) -> None:
        self.out, self.deadline = out, time.perf_counter() + deadline_s
        self.started = time.perf_counter()
        self.summary: dict = {"stages": {}, "ok": True}
        out.mkdir(parents=True, exist_ok=True)

    def run(self, name: str, stage, *arguments) -> dict | None:
        """Run STAGE unless the deadline passed; write its JSON (ok, seconds, what it returned, or its error)."""
        record: dict = {"stage": name}
        if time.perf_counter() > self.deadline:
            record.update(ok=True, skipped="deadline")
        else:
            started = time.perf_counter()
            try:
                record.update(stage(*arguments))
                record.setdefault("ok", True)
            except Exception as error:  # noqa: BLE001 - a failed stage is a result; the next ones still run
                record.update(ok=False, error=f"{type(error).__name__}: {str(error).splitlines()[0][:500]}")
            record["seconds"] = round(time.perf_counter() - started, 2)
        index = len(self.summary["stages"]) + 1
        _write(self.out / f"{index}-{name}.json", record)
        self.summary["stages"][name] = {
            k: record[k] for k in ("ok", "seconds", "skipped", "error") if k in record
        }
        self.summary["ok"] &= record["ok"]
        self.summary["seconds"] = round(time.perf_counter() - self.started, 2)
        _write(self.out / "summary.json", self.summary)
        print(f"{name}: {'ok' if record['ok'] else 'FAILED'} {record.get('skipped', '')}", file=sys.stderr)
        return record


def _write(path: Path, document: dict) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(document, indent=1, default=str))
    partial.replace(path)


def _free_device_bytes(device: str) -> int | None:
    if device != "cuda":
        return None
    from pipeshard.profiles.measure_cuda import CudaRuntime

    return CudaRuntime().free_bytes()


def environment(device: str) -> dict:
    import numpy as np
    import onnxruntime

    from pipeshard.core.version import __version__
    from pipeshard.profiles.kernels import hop_model

    found = {
        "python": platform.python_version(),
        "pipeshard": __version__,
        "onnxruntime": onnxruntime.__version__,
        "numpy": np.__version__,
        "available_providers": onnxruntime.get_available_providers(),
        "device": device,
    }
    if device == "cuda":
        if hasattr(onnxruntime, "preload_dlls"):
            onnxruntime.preload_dlls()
        session = onnxruntime.InferenceSession(hop_model(8).SerializeToString(), providers=_providers(device))
        found["session_providers"] = session.get_providers()
        if found["session_providers"][0] != "CUDAExecutionProvider":
            raise RuntimeError(f"CUDA EP did not load: the session got {found['session_providers']}")
        session.run(None, {"X": np.ones((1, 1, 8), np.float32)})
        from pipeshard.profiles.measure_cuda import CudaRuntime

        found["gpu"] = CudaRuntime().properties()
    return found


def _providers(device: str) -> list:
    """The device's EP alone: ONNX Runtime adds the CPU EP itself, where nodes it cannot place go."""
    return [("CUDAExecutionProvider", {"device_id": 0})] if device == "cuda" else ["CPUExecutionProvider"]


def device_graph_files(pack: Path) -> dict[str, Path]:
    """Every graph a pack runs on a device: its sub-layers' and vision blocks' weights-as-inputs files."""
    from pipeshard.formats.manifest import load_pack
    from pipeshard.formats.plans import HOST_ONLY_KINDS

    loaded = load_pack(pack)
    vision = loaded.manifest.vision.sub_layers if loaded.manifest.vision else ()
    return {
        entry.name: loaded.path(entry.files["weights_as_inputs"])
        for entry in (*loaded.manifest.sub_layers, *vision)
        if entry.kind not in HOST_ONLY_KINDS
    }


def placed_nodes(model: Path, device: str) -> dict[str, dict]:
    """Where ONNX Runtime placed MODEL's nodes, from its verbose log: provider -> {nodes, ops not on the device}."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.log_severity_level = 0  # verbose: the session logs its node placements
    with tempfile.TemporaryFile() as log:
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)  # ONNX Runtime logs to the process's stderr
        try:
            onnxruntime.InferenceSession(str(model), options, providers=_providers(device))
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        log.seek(0)
        lines = log.read().decode(errors="replace").splitlines()
    placement: dict[str, dict] = {}
    provider = None
    for line in lines:
        if match := _PLACED.search(line):
            provider = match.group(1)
            placement.setdefault(provider, {"nodes": 0, "listed": []})["nodes"] += int(match.group(2))
        elif provider and (match := _PLACED_NODE.search(line)):
            placement[provider]["listed"].append(f"{match.group(1)} ({match.group(2)})")
    return placement


def placement(packs: list[Path], device: str, kernel_table_file: str | None) -> dict:
    import onnx

    from pipeshard.runtime import kernel_check

    expected = "CUDAExecutionProvider" if device == "cuda" else "CPUExecutionProvider"
    if kernel_table_file:
        table = kernel_check.KernelTable(json.loads(Path(kernel_table_file).read_text()))
    elif device == "cuda":
        table = kernel_check.kernel_table(__import__("onnxruntime"))
    else:
        table = None
    graphs, off_device, predicted = {}, [], []
    for pack in packs:
        for name, path in device_graph_files(pack).items():
            placed = placed_nodes(path, device)
            key = f"{pack.name}:{name}" if len(packs) > 1 else name
            graphs[key] = {provider: found["nodes"] for provider, found in placed.items()}
            off_device += [
                f"{key}: {node} on {provider}"
                for provider, found in placed.items()
                if provider != expected
                for node in found["listed"] or [f"{found['nodes']} nodes"]
            ]
            if table is not None:
                model = onnx.load(path, load_external_data=False)
                predicted += [str(m) + f" [{m.why}]" for m in kernel_check.missing_kernels(model, key, table)]
    totals = Counter()
    for counts in graphs.values():
        totals.update(counts)
    return {
        "ok": not off_device,
        "expected_provider": expected,
        "graphs": graphs,
        "nodes_by_provider": dict(totals),
        "off_device": off_device,
        "kernel_check": None
        if table is None
        else {"onnxruntime": table.version, "predicted_off_device": predicted},
    }


def profile(device: str, out: Path) -> dict:
    from pipeshard.profiles.db import save_profile
    from pipeshard.profiles.measure import QUICK, measure_machine

    document = measure_machine(QUICK, use_cuda=device == "cuda")
    path = out / "profile.json"
    measured = save_profile(document, path)
    return {
        "path": str(path),
        "device": measured.device.to_json(),
        "link_h2d": [r.to_json() for r in measured.link.h2d],
    }


def bench(
    pack: Path, device: str, fractions: list[float], profile_name: str, new_tokens: int, repeat: int
) -> dict:
    from pipeshard.bench import BenchSettings, bench_table, run_bench

    budgets, ok = {}, True
    for fraction in fractions:
        free_before = _free_device_bytes(device)
        settings = BenchSettings(
            pack=str(pack),
            device=device,
            vram=f"{fraction * 100:g}%",
            profile=profile_name,
            plans=["cpu", *PLANS],
            reference="cpu",
            new_tokens=new_tokens,
            prompt=PROMPT,
            repeat=repeat,
            threads=2,
        )
        document = run_bench(settings, log=lambda line: print(line, file=sys.stderr))
        print(bench_table(document), file=sys.stderr)
        rows = {row["name"]: _row_summary(row) for row in document["rows"]}
        planned = [rows.get(name) for name in PLANS]
        budget_ok = all(
            row and row["same_tokens_as_cpu"] and (row["peak_device_bytes"] or 0) <= row["budget_bytes"]
            for row in planned
        )
        ok &= budget_ok
        budgets[f"{fraction * 100:g}%"] = {
            "ok": budget_ok,
            "rows": rows,
            "free_device_bytes_before": free_before,
            "free_device_bytes_after": _free_device_bytes(device),
            "bench": document,
        }
    return {"ok": ok, "budgets": budgets}


def _row_summary(row: dict) -> dict:
    return {
        "decode_tok_s": row["decode_tok_s"],
        "ttft_s": row["ttft_s"],
        "same_tokens_as_cpu": row["same_tokens_as_reference"],
        "predicted_decode_step_s": row["predicted_decode_step_s"],
        "measured_decode_step_s": row["measured_decode_step_s"],
        "peak_device_bytes": row["peak_device_bytes"],
        "budget_bytes": row["facts"].get("budget_bytes"),
        "streamed_bytes_per_run": row["streamed_bytes_per_run"],
        "copy_hidden": row["copy_hidden"],
    }


def native_host(
    binary: str, extensions: str, pack: Path, device: str, fraction: float, new_tokens: int
) -> dict:
    import pipeshard
    from pipeshard.cli import main as cli

    plans = Path(tempfile.mkdtemp()) / "plans.json"
    vram = f"{fraction * 100:g}%"
    arguments = ["plan", str(pack), "--vram", vram, "--profile", "laptop-8gb", "--out", str(plans)]
    if cli(arguments) != 0:
        raise RuntimeError("pipeshard plan failed")
    engine = pipeshard.load(pack, threads=2)
    expected = engine.generate(PROMPT, max_new_tokens=new_tokens)[0].tokens
    command = [
        binary,
        str(pack),
        PROMPT,
        "--print-ids",
        "--max-new-tokens",
        str(new_tokens),
        "--threads",
        "2",
    ]
    command += ["--plans", str(plans), "--device", device, "--extensions", extensions]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    tokens = [int(t) for t in done.stdout.split()] if done.returncode == 0 else None
    return {
        "ok": tokens == expected,
        "returncode": done.returncode,
        "stderr": done.stderr[-2000:],
        "tokens": tokens,
        "cpu_tokens": expected,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pack", required=True)
    parser.add_argument("--moe-pack", default=None, help="also check this MoE pack")
    parser.add_argument("--device", default="cuda", choices=("cuda", "sim"))
    parser.add_argument("--budgets", default="0.25,0.6", help="VRAM budgets, fractions of the model's bytes")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument(
        "--profile", default=None, help="use this DB (or reference name) instead of profiling"
    )
    parser.add_argument(
        "--kernel-table", default=None, help="tests/ort_kernels.py's table (default: this ORT's)"
    )
    parser.add_argument("--native-host", default=None, help="the built pipeshard-host binary")
    parser.add_argument("--extensions", default=None, help="libortextensions.so for the native host")
    parser.add_argument(
        "--deadline-s", type=float, default=330.0, help="start no stage after this many seconds"
    )
    parser.add_argument("--out", default="gpu_check")
    parser.add_argument("--dry-run", action="store_true", help="every stage on sim, a reference profile")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.device, args.profile = "sim", args.profile or "laptop-8gb"
        args.new_tokens, args.repeat = min(args.new_tokens, 8), 1
    fractions = [float(f) for f in args.budgets.split(",")]
    packs = [Path(p) for p in (args.pack, args.moe_pack) if p]
    out = Path(args.out)
    check = Check(out, args.deadline_s)
    environment_record = check.run("environment", environment, args.device)
    if not environment_record["ok"]:
        return check.summary
    check.run("placement", placement, packs, args.device, args.kernel_table)
    profile_name = args.profile
    if profile_name is None:
        record = check.run("profile", profile, args.device, out)
        profile_name = record.get("path") or "laptop-8gb"
    for pack in packs:
        name = "bench" if pack == packs[0] else "moe_bench"
        check.run(name, bench, pack, args.device, fractions, profile_name, args.new_tokens, args.repeat)
    if args.native_host:
        check.run(
            "native_host",
            native_host,
            args.native_host,
            args.extensions,
            packs[0],
            args.device,
            fractions[-1],
            args.new_tokens,
        )
    print(json.dumps(check.summary, indent=1))
    return check.summary


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
