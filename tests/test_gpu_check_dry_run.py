"""The GPU check script runs end to end on the simulated device, so it does not rot between GPU runs."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "gpu_check.py"


def test_gpu_check_dry_run_on_sim(tiny_pack, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    report = gpu_check.main(
        [
            "--pack",
            str(tiny_pack),
            "--device",
            "sim",
            "--profile",
            "laptop-8gb",
            "--fraction",
            "0.5",
            "--new-tokens",
            "8",
            "--out",
            str(tmp_path / "check.json"),
        ]
    )
    assert report["ok"]
    assert [row["name"] for row in report["bench"]["rows"]] == ["cpu", "auto", "layers", "offload"]
    saved = json.loads((tmp_path / "check.json").read_text())
    assert saved["environment"]["device"] == "sim"
    assert all(r["same_tokens_as_reference"] for r in saved["bench"]["rows"])
    assert "wrote" in capsys.readouterr().out
