"""Seeded random mutations of the files a user downloads: manifests and plans through `run` and `inspect --verify`
(in this process, so a traceback is seen as one) and through the native host, GGUF headers through the exporter's
reader. Every outcome must be exit 0 or one clean `error:` (exit 2): never a traceback, a hang or a signal. Each
test prints its counts of outcomes by kind (`pytest -s` shows them)."""

from __future__ import annotations

import collections
import contextlib
import copy
import io
import json
import random
import shutil
import signal
import subprocess
import traceback
from pathlib import Path

import pytest
from test_hostile_gguf import gguf_bytes

from pipeshard.cli import main
from pipeshard.core.errors import UserError
from pipeshard.exporter.sources import resolve_source

SECONDS_PER_CASE = 60  # a case past this is a hang
HOSTILE_VALUES = (
    -1,
    0,
    1,
    2**63,
    -(2**63),
    1e308,
    float("nan"),
    "",
    "x",
    "../x",
    "/etc/passwd",
    None,
    True,
    [],
    {},
)
pytestmark = pytest.mark.slow


class Hang(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: int):
    def alarm(*_):
        raise Hang(f"no answer in {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def leaves(document, path=()):
    """Every (path, value) of a JSON document, containers included."""
    yield path, document
    if isinstance(document, dict):
        for key, value in document.items():
            yield from leaves(value, (*path, key))
    elif isinstance(document, list):
        for index, value in enumerate(document):
            yield from leaves(value, (*path, index))


def mutated(document, rng: random.Random):
    """A copy of `document` with one node replaced by a hostile value, removed, or given an unknown sibling."""
    document = copy.deepcopy(document)
    path, value = rng.choice([entry for entry in leaves(document) if entry[0]])
    parent = document
    for key in path[:-1]:
        parent = parent[key]
    action = rng.random()
    if action < 0.15 and isinstance(parent, dict):
        del parent[path[-1]]
    elif action < 0.2 and isinstance(parent, dict):
        parent["unexpected_field"] = 1
    elif isinstance(value, int | float) and not isinstance(value, bool) and action < 0.6:
        parent[path[-1]] = rng.choice([value + 1, value - 1, value * 1024, -value, value // 2])
    else:
        parent[path[-1]] = rng.choice(HOSTILE_VALUES)
    return document


def byte_mutated(raw: bytes, rng: random.Random) -> bytes:
    data = bytearray(raw)
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(len(data))
        choice = rng.random()
        if choice < 0.6:
            data[at] = rng.randrange(256)
        elif choice < 0.8:
            data[at : at + 8] = rng.randbytes(8)
        else:
            del data[at:]
            break
    return bytes(data)


def outcome(argv: list[str]) -> tuple[str, str]:
    """What `pipeshard ARGV` did in this process: ("ok", stdout), ("error", its line), or a failure kind."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with time_limit(SECONDS_PER_CASE), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    except Hang as exc:
        return "hang", str(exc)
    except BaseException:  # noqa: BLE001 - a traceback is what this test looks for
        return "traceback", traceback.format_exc()
    lines = [line for line in err.getvalue().splitlines() if line.strip()]
    if code == 0:
        return "ok", out.getvalue()
    if code == 2 and len(lines) == 1 and lines[0].startswith("error: "):
        return "error", lines[0]
    return "unclean", f"exit {code}: {err.getvalue()[-2000:]}"


def report(name: str, counts: collections.Counter, failures: list) -> None:
    print(
        f"\n{name}: {sum(counts.values())} runs, " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    )
    assert not failures, (
        "\n\n".join(failures[:3]) + "\n\nall:\n" + "\n".join(f.strip().splitlines()[-1] for f in failures)
    )


@pytest.fixture(scope="module")
def fuzz_plans(tiny_pack, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fuzz-plans") / "plans.json"
    assert (
        main(["plan", str(tiny_pack), "--vram", "1GiB", "--profile", "laptop-8gb", "--out", str(path)]) == 0
    )
    return path


def _pack_with(tiny_pack: Path, folder: Path, manifest: bytes) -> Path:
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(tiny_pack, folder)
    (folder / "manifest.json").write_bytes(manifest)
    return folder


def test_mutated_manifests_through_run_and_inspect_verify(tiny_pack, tmp_path):
    rng = random.Random(42)
    original = json.loads((tiny_pack / "manifest.json").read_text())
    counts, failures = collections.Counter(), []
    for case in range(60):
        if case % 5 == 4:
            raw = byte_mutated((tiny_pack / "manifest.json").read_bytes(), rng)
        else:
            raw = json.dumps(mutated(original, rng)).encode()
        pack = _pack_with(tiny_pack, tmp_path / "pack", raw)
        for argv in (
            ["run", str(pack), "hi", "--max-new-tokens", "2", "--json"],
            ["inspect", str(pack), "--verify"],
        ):
            kind, detail = outcome(argv)
            counts[f"{argv[0]} {kind}"] += 1
            if kind not in ("ok", "error"):
                failures.append(f"{argv[0]}, case {case}: {kind}\n{detail}")
    report("manifest", counts, failures)


def test_mutated_plans_through_run_on_sim(tiny_pack, fuzz_plans, tmp_path):
    rng = random.Random(7)
    original = json.loads(fuzz_plans.read_text())
    counts, failures = collections.Counter(), []
    for case in range(40):
        path = tmp_path / "plans.json"
        if case % 5 == 4:
            path.write_bytes(byte_mutated(fuzz_plans.read_bytes(), rng))
        else:
            path.write_text(json.dumps(mutated(original, rng)))
        kind, detail = outcome(
            [
                "run",
                str(tiny_pack),
                "hi",
                "--max-new-tokens",
                "2",
                "--json",
                "--device",
                "sim",
                "--plans",
                str(path),
            ]
        )
        counts[kind] += 1
        if kind not in ("ok", "error"):
            failures.append(f"case {case}: {kind}\n{detail}")
    report("plans", counts, failures)


def test_mutated_gguf_headers_are_read_or_refused(tmp_path):
    rng = random.Random(3)
    original = gguf_bytes()
    counts, failures = collections.Counter(), []
    for case in range(400):
        path = tmp_path / "fuzz.gguf"
        path.write_bytes(byte_mutated(original, rng))
        try:
            with time_limit(10):
                resolve_source(str(path))
            counts["ok"] += 1
        except UserError:
            counts["error"] += 1
        except Hang:
            counts["hang"] += 1
            failures.append(f"case {case}: hang")
        except Exception:  # noqa: BLE001
            counts["traceback"] += 1
            failures.append(f"case {case}: {traceback.format_exc()}")
    report("gguf", counts, failures)


def test_mutated_manifests_and_plans_through_the_native_host(tiny_pack, fuzz_plans, tmp_path):
    from test_native_host import BUILD, DEPS, _missing_tools

    reason = _missing_tools()
    if reason:
        pytest.skip(reason)
    host, extensions = BUILD / "pipeshard-host", next(DEPS.rglob("libortextensions.so"))
    rng = random.Random(11)
    manifest = json.loads((tiny_pack / "manifest.json").read_text())
    plans = json.loads(fuzz_plans.read_text())
    counts, failures = collections.Counter(), []
    for case in range(80):
        planned = case % 2 == 1
        # the plans' pack_sha256 is of the manifest's own bytes
        raw = (
            (tiny_pack / "manifest.json").read_bytes()
            if planned
            else json.dumps(mutated(manifest, rng)).encode()
        )
        pack = _pack_with(tiny_pack, tmp_path / "pack", raw)
        command = [
            str(host),
            str(pack),
            "--ids",
            "1,2,3",
            "--max-new-tokens",
            "2",
            "--extensions",
            str(extensions),
        ]
        if planned:
            damaged = mutated(plans, rng)
            damaged["pack_sha256"] = plans[
                "pack_sha256"
            ]  # so that the damage, not the digest, is what is read
            (tmp_path / "plans.json").write_text(json.dumps(damaged))
            command += ["--device", "sim", "--plans", str(tmp_path / "plans.json")]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=SECONDS_PER_CASE)
        except subprocess.TimeoutExpired:
            counts["hang"] += 1
            failures.append(f"case {case}: hang")
            continue
        lines = done.stderr.strip().splitlines()
        if done.returncode == 0:
            kind = "ok"
        elif done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "):
            kind = "error"
        else:
            kind = "signal" if done.returncode < 0 else "unclean"
            failures.append(f"case {case}: exit {done.returncode}\n{done.stderr[-2000:]}")
        counts[f"{'plans' if planned else 'manifest'} {kind}"] += 1
    report("native host", counts, failures)
