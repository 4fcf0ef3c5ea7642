"""The GPU check script runs end to end on the simulated device (`--dry-run`), so it does not rot between GPU runs:
every stage writes its JSON as it finishes, in the shape the GPU run fills in."""

import importlib.util
import json
import time
from pathlib import Path

from ort_kernels import TABLE

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "gpu_check.py"
DRY_RUN_SECONDS = (
    60  # the GPU run's stages are sized for 6 minutes on a bare machine; the dry run is far smaller
)


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_dry_run_writes_every_stage_as_it_finishes(models, tmp_path, capsys):
    pack = models.pack("tiny:llama", attention="fp16")
    out = tmp_path / "check"
    arguments = ["--pack", str(pack), "--dry-run", "--budgets", "0.3,0.6", "--out", str(out)]
    if TABLE.is_file():
        arguments += ["--kernel-table", str(TABLE)]
    started = time.perf_counter()
    summary = _gpu_check().main(arguments)
    seconds = time.perf_counter() - started
    assert summary["ok"] and seconds < DRY_RUN_SECONDS, (summary, seconds)
    written = sorted(p.name for p in out.iterdir())
    assert written == ["1-environment.json", "2-placement.json", "3-bench.json", "summary.json"]
    assert json.loads((out / "summary.json").read_text()) == summary
    assert list(summary["stages"]) == ["environment", "placement", "bench"]

    environment = json.loads((out / "1-environment.json").read_text())
    assert environment["device"] == "sim" and environment["onnxruntime"]
    placement = json.loads((out / "2-placement.json").read_text())
    assert placement["expected_provider"] == "CPUExecutionProvider" and placement["off_device"] == []
    assert {"L0.attn", "L0.ffn", "final"} <= set(placement["graphs"])
    assert all(
        counts == {"CPUExecutionProvider": counts["CPUExecutionProvider"]}
        for counts in placement["graphs"].values()
    )
    if TABLE.is_file():
        assert placement["kernel_check"]["predicted_off_device"] == []
    bench = json.loads((out / "3-bench.json").read_text())
    assert list(bench["budgets"]) == ["30%", "60%"]
    for budget in bench["budgets"].values():
        assert list(budget["rows"]) == ["cpu", "auto", "layers", "offload"]
        for name in ("auto", "layers", "offload"):
            row = budget["rows"][name]
            assert row["same_tokens_as_cpu"] and row["decode_tok_s"] > 0
            assert row["peak_device_bytes"] <= row["budget_bytes"] and row["predicted_decode_step_s"] > 0


def test_a_stage_past_the_deadline_is_recorded_as_skipped(tiny_pack, tmp_path):
    out = tmp_path / "check"
    summary = _gpu_check().main(
        ["--pack", str(tiny_pack), "--dry-run", "--deadline-s", "0", "--out", str(out)]
    )
    assert summary["stages"]["environment"]["skipped"] == "deadline"
    assert summary["stages"]["bench"]["skipped"] == "deadline"
