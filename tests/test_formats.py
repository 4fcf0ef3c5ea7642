"""The files between the stages are typed records: a hand-edited file with a misspelt, missing or out-of-range field
is refused at load with one `error:` line naming the file and the field, and the docs describe exactly the fields
the records read."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeshard.core.errors import UserError
from pipeshard.formats import fields as fields_module
from pipeshard.formats.manifest import MANIFEST_NAME, load_pack
from pipeshard.formats.plans import read_plans
from pipeshard.formats.profile_db import ProfileDb
from pipeshard.profiles.db import reference_profile_path

REPO = Path(__file__).resolve().parents[1]
PIPESHARD = [sys.executable, "-m", "pipeshard"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*PIPESHARD, *map(str, args)], capture_output=True, text=True, timeout=300)


def _one_error_line(result: subprocess.CompletedProcess, *words: str) -> str:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def plans_file(tiny_pack, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("plans") / "plans.json"
    result = _cli("plan", tiny_pack, "--vram", "1GiB", "--profile", "laptop-8gb", "--out", path)
    assert result.returncode == 0, result.stderr
    return path


def _edited_pack(tiny_pack: Path, folder: Path, edit) -> Path:
    pack = folder / "pack"
    shutil.copytree(tiny_pack, pack)
    manifest = json.loads((pack / MANIFEST_NAME).read_text())
    edit(manifest)
    (pack / MANIFEST_NAME).write_text(json.dumps(manifest))
    return pack


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda m: m.update(kv_bytes_per_tokn=m.pop("kv_bytes_per_token")), "kv_bytes_per_tokn"),
        (
            lambda m: m["sub_layers"][2].update(wieghts=m["sub_layers"][2].pop("weights")),
            "sub_layers[2].weights",
        ),
        (lambda m: m["model"].update(hidden_size="64"), "model.hidden_size"),
        (lambda m: m["model"].update(num_key_value_heads=-2), "model.num_key_value_heads"),
        (lambda m: m["sub_layers"][1].update(kind="atn"), "sub_layers[1].kind"),
        (lambda m: m["sub_layers"][2]["weights"][0].update(offset=1 << 30), "past the end"),
        (
            lambda m: m["sub_layers"][2]["weights"][0].update(file="../secret.bin"),
            "sub_layers[2].weights[0].file",
        ),
        (lambda m: m["sub_layers"][2]["blob"].update(file="/etc/passwd"), "sub_layers[2].blob.file"),
        (lambda m: m.update(schema_version=9), "schema_version"),
    ],
    ids=[
        "misspelt",
        "missing",
        "mistyped",
        "negative",
        "unknown-kind",
        "offset",
        "escape",
        "absolute",
        "version",
    ],
)
def test_a_hand_edited_manifest_is_refused_at_load_naming_the_field(tiny_pack, tmp_path, edit, named):
    pack = _edited_pack(tiny_pack, tmp_path, edit)
    with pytest.raises(UserError, match=re.escape(named)):
        load_pack(pack)
    _one_error_line(_cli("inspect", pack), named)


def test_a_misspelt_plans_field_is_refused_at_load(tiny_pack, plans_file, tmp_path):
    document = json.loads(plans_file.read_text())
    document["ladder"][0]["tiers"][0]["chosen"]["slotz"] = 2
    edited = tmp_path / "plans.json"
    edited.write_text(json.dumps(document))
    line = _one_error_line(
        _cli("run", tiny_pack, "hi", "--max-new-tokens", "2", "--device", "sim", "--plans", edited), "slotz"
    )
    assert str(edited) in line and "ladder[0].tiers[0].chosen.slotz" in line


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda p: p["ladder"][0].update(budget_bytes=-1), "ladder[0].budget_bytes"),
        (lambda p: p["ladder"][0]["tiers"][0].update(tier=0), "ladder[0].tiers[0].tier"),
        (lambda p: p["ladder"][0]["tiers"][0]["chosen"].update(slots="two"), "chosen.slots"),
        (lambda p: p["ladder"][0]["tiers"][0]["chosen"]["vram"].update(reserve=-(10**12)), "vram.reserve"),
        (lambda p: p.update(context=10**15), "context"),
        (lambda p: p["ladder"][0]["tiers"][0]["chosen"].update(vram=None), "chosen.vram"),
        (lambda p: p.update(batch=-1), "batch"),
        (lambda p: p.update(context=0), "context"),
        (lambda p: p["ladder"][0].update(budget_bytes=float("nan")), "ladder[0].budget_bytes"),
        (
            lambda p: p["ladder"][0]["tiers"].extend(
                [dict(p["ladder"][0]["tiers"][0], tier=t) for t in range(2, 20_000)]
            ),
            "ladder[0].tiers has 20",
        ),
        (lambda p: p["ladder"][0]["tiers"].append(p["ladder"][0]["tiers"][0]), "planned twice"),
    ],
    ids=[
        "budget",
        "tier",
        "slots",
        "reserve",
        "context",
        "vram",
        "batch",
        "context0",
        "nan",
        "20000tiers",
        "twice",
    ],
)
def test_damaged_plans_are_refused_naming_the_field(tiny_pack, plans_file, tmp_path, edit, named):
    document = json.loads(plans_file.read_text())
    edit(document)
    edited = tmp_path / "plans.json"
    edited.write_text(json.dumps(document))
    pack = load_pack(tiny_pack)
    with pytest.raises(UserError, match=re.escape(named)):
        read_plans(
            edited, tiny_pack / MANIFEST_NAME, [s.name for s in pack.sub_layers], pack.model.max_context
        )


def test_a_misspelt_profile_field_is_refused_at_load(tiny_pack, tmp_path):
    document = json.loads(reference_profile_path("laptop-8gb").read_text())
    document["link"]["h2dd"] = document["link"]["h2d"]
    edited = tmp_path / "profile.json"
    edited.write_text(json.dumps(document))
    _one_error_line(_cli("plan", tiny_pack, "--vram", "1GiB", "--profile", edited), str(edited), "link.h2dd")


def _fields_read(monkeypatch) -> set[str]:
    """Every field name a record reads (or names as known) while the patch is on."""
    seen: set[str] = set()
    raw, done = fields_module.Fields.raw, fields_module.Fields.done

    def recording_raw(self, name, default=...):
        seen.add(name)
        return raw(self, name, default)

    def recording_done(self, ignore=()):
        seen.update(ignore)
        return done(self, ignore)

    monkeypatch.setattr(fields_module.Fields, "raw", recording_raw)
    monkeypatch.setattr(fields_module.Fields, "done", recording_done)
    return seen


def _documented_keys(doc: str) -> set[str]:
    """The keys of the JSON examples (```jsonc blocks) of a doc."""
    text = (REPO / "docs" / doc).read_text()
    blocks = re.findall(r"```jsonc\n(.*?)```", text, re.S)
    return {key for block in blocks for key in re.findall(r'"([A-Za-z_][A-Za-z0-9_]*)":', block)}


def _check_doc(doc: str, read: set[str], values: set[str] = frozenset()) -> None:
    read = {
        name for name in read if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name)
    }  # not map keys (file names)
    documented = _documented_keys(doc)
    undocumented = sorted(read - documented)
    assert not undocumented, f"docs/{doc} does not describe the fields {undocumented}"
    # Keys in examples that are values of maps (placement names, thread counts, dtypes) are not fields.
    unread = sorted(documented - read - values)
    assert not unread, f"docs/{doc} describes fields no record reads: {unread}"


def test_docs_model_pack_describes_exactly_the_manifest_fields(tiny_pack, monkeypatch):
    read = _fields_read(monkeypatch)
    load_pack(tiny_pack)
    # a MoE pack's blocks and a VLM's section are read from their own packs in tests/test_moe.py and test_vlm.py;
    # here their documented fields are the records' by name
    read |= {
        "layer",
        "router",
        "experts",
        "residual",
        "hidden",
        "routing",
        "expert_outputs",
        "output",
        "expert",
    }
    read |= {"rows_of", "weight", "rows", "row_bytes", "shape_only"}
    _check_doc(
        "model-pack.md",
        read,
        values={
            "const",
            "T",
            "C",
            "TC",
            "activations",
            "tokens",
            "steps",
            "routed_tokens",
            "layers",
            "distinct_experts_per_step",
        },
    )


def test_docs_plans_describes_exactly_the_plan_fields(tiny_pack, plans_file, monkeypatch):
    pack = load_pack(tiny_pack)
    read = _fields_read(monkeypatch)
    read_plans(
        plans_file, tiny_pack / MANIFEST_NAME, [s.name for s in pack.sub_layers], pack.model.max_context
    )
    _check_doc(
        "plans.md",
        read | {"kv_streamed", "assumed_bits_per_weight"},
        values={"pinned", "streamed", "cpu", "prologue", "embed", "layers", "offload"},
    )


def test_docs_profile_db_describes_exactly_the_profile_fields(monkeypatch):
    read = _fields_read(monkeypatch)
    document = json.loads(reference_profile_path("laptop-8gb").read_text())
    # the sections a measured DB has beside a reference profile's: what it swept, and one pack's own timings
    document["plan"] = {"tiers": [1, 16], "shapes": [[576, 1536]], "dtypes": ["fp32"]}
    rows = [
        {"placement": "cpu", "kind": "attn", "T": 16, "C": 48, "seconds": 1e-4},
        {"placement": "device", "kind": "step", "T": 1, "C": 33, "ratio": 0.9},
        {"placement": "streamed", "kind": "copy", "T": 1, "C": 33, "gbps": 5.0},
    ]
    document["pack_timings"] = {"model_sha256": "0" * 64, "pasts": [32], "threads": {"1": rows}}
    assert ProfileDb.from_json(document, "laptop-8gb").to_json() == document
    _check_doc("profile-db.md", read, values={"fp32", "fp16", "bf16", "q4"})
