"""The native host (examples/native-host): its CTest cases against the Python engine's tokens on SmolLM2.

`make host` fetches the two npm packages and builds the host; these tests write what the CTest cases compare
against (the Python engine's greedy tokens for three prompts, all-CPU and with a saved plans file whose top rung
streams weights; the tokenizer's check strings; transformers' renderings of multi-turn chats), configure the build
with it and run `ctest` (requests, cancellation, sessions and budgets included); the Windows build (`make
host-windows`) runs the same cases under Wine. Without a C++ compiler, cmake or npm, or before `make host`, they
skip and say why.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from prompts import SMOLLM2_PROMPTS

REPO = Path(__file__).resolve().parents[1]
HOST = REPO / "examples" / "native-host"
DEPS = REPO / "build" / "native-host" / "deps"
BUILD = REPO / "build" / "native-host" / "build"
WINDOWS_BUILD = REPO / "build" / "native-host" / "build-windows"
MINGW = "x86_64-w64-mingw32-g++-posix"
WINE = Path("/usr/lib/wine/wine64")
MAX_NEW_TOKENS = 24
SESSION_MAX_NEW_TOKENS = 8  # per turn of the two-session case, which generates eleven times
THREADS = 2
CONTEXT = 512


def _missing_tools() -> str | None:
    missing = [tool for tool in ("cmake", "ctest", "npm") if shutil.which(tool) is None]
    if shutil.which("c++") is None and shutil.which("g++") is None:
        missing.append("a C++ compiler")
    if missing:
        return f"the native host needs {', '.join(missing)}"
    if not (DEPS / ".complete").is_file() or not (BUILD / "CMakeCache.txt").is_file():
        return "the native host is not built: `make host` fetches its npm packages and builds it"
    return None


def _plan_ladder(pack: Path, out: Path, batch: int = 1) -> dict:
    """A two-rung ladder for `pack` and `batch` sequences: the larger budget runs the planner's gpu-only plans (pinned
    and streamed units, the output layer in streamed row chunks), the smaller its static ones (pinned attention, the
    rest on the CPU)."""
    command = [
        sys.executable,
        "-P",
        "-m",
        "pipeshard",
        "plan",
        str(pack),
        "--vram",
        "10%,60%",
        "--profile",
        "laptop-8gb",
        "--tiers",
        "1,16,64",
        "--context",
        str(CONTEXT),
        "--batch",
        str(batch),
        "--out",
        str(out),
    ]
    subprocess.run(command, check=True, capture_output=True, text=True)
    document = json.loads(out.read_text())
    top = document["ladder"][0]
    for entry in top["tiers"]:
        entry["chosen"] = next(a for a in entry["alternatives"] if a["strategy"] == "gpu-only")
    document["tiers"] = top["tiers"]
    out.write_text(json.dumps(document))
    return document


@pytest.fixture(scope="module")
def host_expected(models, tiny_pack, tmp_path_factory) -> Path:
    """What the CTest cases compare against (the Python engine's tokens, plans, chat renders), written once for the
    Linux and the Windows build."""
    reason = _missing_tools()
    if reason:
        pytest.skip(reason)
    tmp_path = tmp_path_factory.mktemp("native-host")
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    import pipeshard
    from pipeshard.exporter.tokenizer_onnx import CHECK_STRINGS

    pack = models.pack("smollm2-135m")
    plans = tmp_path / "plans.json"
    document = _plan_ladder(pack, plans)
    assert any(p == "streamed" for p in document["ladder"][0]["tiers"][0]["chosen"]["placements"].values())
    batch_plans = tmp_path / "batch-plans.json"
    _plan_ladder(pack, batch_plans, batch=2)
    other_plans = tmp_path / "other-plans.json"
    subprocess.run(
        [
            sys.executable,
            "-P",
            "-m",
            "pipeshard",
            "plan",
            str(tiny_pack),
            "--vram",
            "25%",
            "--profile",
            "laptop-8gb",
            "--out",
            str(other_plans),
        ],
        check=True,
        capture_output=True,
    )

    cpu_engine = pipeshard.load(pack, threads=THREADS)
    planned_engine = pipeshard.load(pack, device="sim", plans=plans, threads=THREADS)
    prompts = []
    for text in SMOLLM2_PROMPTS:
        cpu = cpu_engine.generate(text, max_new_tokens=MAX_NEW_TOKENS)[0]
        planned = planned_engine.generate(text, max_new_tokens=MAX_NEW_TOKENS)[0]
        assert planned.tokens == cpu.tokens
        prompts.append(
            {
                "text": text,
                "prompt_ids": cpu.prompt_tokens,
                "cpu_tokens": cpu.tokens,
                "planned_tokens": planned.tokens,
            }
        )
    reference = Tokenizer.from_file(str(pack / "tokenizer.json"))
    checks = [
        {
            "text": text,
            "ids": (ids := reference.encode(text, add_special_tokens=False).ids),
            "decoded": reference.decode(ids, skip_special_tokens=False),
        }
        for text in CHECK_STRINGS
    ]
    rungs = sorted(int(rung["budget_bytes"]) for rung in document["ladder"])
    template = AutoTokenizer.from_pretrained(str(pack))
    histories = [
        [{"role": "user", "content": SMOLLM2_PROMPTS[0]}],
        [
            {"role": "user", "content": SMOLLM2_PROMPTS[0]},
            {"role": "assistant", "content": "Paris, of course."},
            {"role": "user", "content": SMOLLM2_PROMPTS[1]},
        ],
        [
            {"role": "system", "content": "You are a pirate captain."},
            {"role": "user", "content": "Ahoy!"},
            {"role": "assistant", "content": "Ahoy, matey!\nWhat brings ye here?"},
            {"role": "user", "content": "Treasure."},
            {"role": "assistant", "content": "Arr."},
            {"role": "user", "content": SMOLLM2_PROMPTS[2]},
        ],
    ]
    chat_renders = [
        {
            "messages": history,
            "text": template.apply_chat_template(history, tokenize=False, add_generation_prompt=True),
        }
        for history in histories
    ]
    expected = {
        "pack": str(pack),
        "plans": str(plans),
        "other_plans": str(other_plans),
        "batch_plans": str(batch_plans),
        "threads": THREADS,
        "max_new_tokens": MAX_NEW_TOKENS,
        "prompts": prompts,
        "check_strings": checks,
        "ladder": {
            "budget_after": 5,
            "small_budget_bytes": rungs[0] + 1,
            "small_rung_bytes": rungs[0],
            "large_rung_bytes": rungs[-1],
        },
        "too_small_budget_bytes": rungs[0] - 1,
        "chat_renders": chat_renders,
        "session_max_new_tokens": SESSION_MAX_NEW_TOKENS,
    }
    expected_path = tmp_path / "expected.json"
    expected_path.write_text(json.dumps(expected))
    # The same for the C# console program, in lines it reads without a JSON library.
    lines = [f"{pack}\t{plans}\t{THREADS}\t{MAX_NEW_TOKENS}"] + [
        f"{p['text']}\t{' '.join(map(str, p['cpu_tokens']))}" for p in prompts
    ]
    Path(f"{expected_path}.tsv").write_text("\n".join(lines) + "\n")
    return expected_path


def _ctest(build: Path, expected: Path, *configure: str) -> str:
    """Configure `build` with the expected file, build it and run its CTest cases; their output."""
    command = [
        "cmake",
        "-S",
        str(HOST),
        "-B",
        str(build),
        f"-DPIPESHARD_TEST_EXPECTED={expected}",
        *configure,
    ]
    subprocess.run(command, check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(build), "-j", "2"], check=True, capture_output=True)
    result = subprocess.run(
        ["ctest", "--test-dir", str(build), "--output-on-failure"], capture_output=True, text=True
    )
    print(result.stdout[-6000:], result.stderr[-2000:])
    assert result.returncode == 0, result.stdout[-6000:]
    return subprocess.run(["ctest", "--test-dir", str(build), "-N"], capture_output=True, text=True).stdout


@pytest.mark.slow
def test_native_host_ctest_matches_the_python_engine(host_expected):
    listed = _ctest(BUILD, host_expected)
    if "csharp_tokens" not in listed:
        print(
            "the C# test was skipped: mono and mcs are not installed (apt-get install mono-mcs mono-runtime)"
        )


@pytest.mark.slow
def test_the_windows_build_passes_the_same_ctest_cases_under_wine(host_expected):
    """The host cross-built for Windows x64 with mingw-w64 against the npm packages' Windows DLLs, its CTest cases
    run under Wine (slow: a second build of the host, and every case again under Wine)."""
    if shutil.which(MINGW) is None or not WINE.is_file():
        pytest.skip(
            f"the Windows build needs {MINGW} and {WINE}: `make host-windows` installs them where it may"
        )
    if not (DEPS / "windows-x64" / ".complete").is_file():
        pytest.skip("the npm packages' Windows DLLs are not unpacked: `make host-windows` does it")
    listed = _ctest(
        WINDOWS_BUILD, host_expected, f"-DCMAKE_TOOLCHAIN_FILE={HOST / 'cmake' / 'mingw-w64-x86_64.cmake'}"
    )
    assert "exported_names" in listed and "sessions" in listed


CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _rendered_with_pieces(pieces: dict, messages: list[dict]) -> str:
    """A conversation as the native host renders it from chat_template.json's pieces (src/conversation.cpp)."""
    if messages[0]["role"] == "system":
        text, rest = pieces["system_before"] + messages[0]["content"] + pieces["system_after"], messages[1:]
    else:
        text, rest = pieces["first_user_before"], messages
    for index, message in enumerate(rest):
        if message["role"] == "assistant":
            after = pieces["assistant_after"]
        else:
            after = pieces["generation_prompt" if index == len(rest) - 1 else "user_after"]
        text += message["content"] + after
    return text


def test_the_conversation_pieces_rebuild_multi_turn_histories_and_refuse_a_template_that_edits(tmp_path):
    from pipeshard.formats.chat_template import ChatTemplate
    from pipeshard.partitioner.host_files import prerendered_chat_template

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML_TEMPLATE}))
    pieces = prerendered_chat_template(tmp_path)["conversation"]
    template = ChatTemplate.read(tmp_path)
    turns = [
        ("user", "Hi"),
        ("assistant", "Hello!\nHow can I help?"),
        ("user", "A riddle."),
        ("assistant", ""),
    ]
    turns += [("user", "Another, {{ please }}.")]
    for system in ([], [("system", "You are a guard.")]):
        for length in (1, 3, 5):
            history = [{"role": role, "content": content} for role, content in system + turns[:length]]
            assert _rendered_with_pieces(pieces, history) == template.render(history)
    # A template that changes an assistant's text: one-turn prompts still render, conversations do not.
    edits = CHATML_TEMPLATE.replace(
        "message['content']",
        "(message['content'] | upper if message['role'] == 'assistant' else message['content'])",
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": edits}))
    edited = prerendered_chat_template(tmp_path)
    assert edited["user"] == {"before": pieces["first_user_before"], "after": pieces["generation_prompt"]}
    assert edited["conversation"] is None


def _edited_pack(pack: Path, folder: Path, edit) -> Path:
    """A copy of `pack` whose manifest `edit` changed (copied, not hard-linked: ONNX refuses weight files with
    several links, and the shared pack must stay as it was)."""
    shutil.copytree(pack, folder)
    manifest = folder / "manifest.json"
    document = json.loads(manifest.read_text())
    edit(document, folder)
    manifest.write_text(json.dumps(document))
    return folder


def _attention(document: dict) -> dict:
    return next(s for s in document["sub_layers"] if s["name"] == "L0.attn")


def _traversal(document, folder):
    secret = folder.parent / "secret.bin"
    secret.write_bytes(b"\7" * _attention(document)["blob"]["bytes"])
    _attention(document)["blob"]["file"] = "../secret.bin"
    for weight in _attention(document)["weights"]:
        weight["file"] = "../secret.bin"


def _linked_out(document, folder):
    secret = folder.parent / "outside.weights"
    blob = folder / _attention(document)["blob"]["file"]
    secret.write_bytes(blob.read_bytes())
    blob.unlink()
    blob.symlink_to(secret)


def _offset(value):
    def edit(document, folder):
        for weight in _attention(document)["weights"][1:]:
            weight["offset"] = value

    return edit


def _shape(document, folder):
    _attention(document)["weights"][0]["shape"][0] *= 1024


HOSTILE_PACKS = {
    "a blob outside the pack (..)": (_traversal, "not a plain file name"),
    "a blob that is a link out of the pack": (_linked_out, "leads outside the pack"),
    "an offset 1 MiB past the blob": (_offset(1 << 20), "past the end of its blob"),
    "an offset 64 KiB past the blob": (_offset(1 << 16), "past the end of its blob"),
    "a negative offset": (_offset(-8), "offset must be from 0"),
    "a shape larger than its bytes": (_shape, "not what its shape and dtype hold"),
    "an absolute chat template": (
        lambda d, f: d.setdefault("host", {}).update(chat_template="/etc/passwd"),
        "not a plain file name",
    ),
    "hidden size 0": (lambda d, f: d["model"].update(hidden_size=0), "model.hidden_size must be from 1"),
}


def _host(*arguments: str) -> subprocess.CompletedProcess:
    extensions = next(DEPS.rglob("libortextensions.so"))
    return subprocess.run(
        [str(BUILD / "pipeshard-host"), *arguments, "--extensions", str(extensions)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _refused(done: subprocess.CompletedProcess, fragment: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert done.stderr.startswith("error:") and len(done.stderr.splitlines()) == 1, done.stderr
    assert fragment in done.stderr, done.stderr


@pytest.mark.parametrize("case", HOSTILE_PACKS)
def test_the_native_host_refuses_a_pack_reaching_outside_itself_or_its_blobs(tiny_pack, tmp_path, case):
    reason = _missing_tools()
    if reason:
        pytest.skip(reason)
    edit, fragment = HOSTILE_PACKS[case]
    pack = _edited_pack(tiny_pack, tmp_path / "pack", edit)
    _refused(_host(str(pack), "--ids", "1,2,3", "--max-new-tokens", "2"), fragment)


def test_the_native_host_refuses_damaged_plans_and_options(tiny_pack, tmp_path):
    reason = _missing_tools()
    if reason:
        pytest.skip(reason)
    import hashlib

    plans = tmp_path / "plans.json"
    subprocess.run(
        [sys.executable, "-P", "-m", "pipeshard", "plan", str(tiny_pack), "--vram", "25%", "--profile"]
        + ["laptop-8gb", "--context", "256", "--out", str(plans)],
        check=True,
        capture_output=True,
    )
    document = json.loads(plans.read_text())
    assert document["pack_sha256"] == hashlib.sha256((tiny_pack / "manifest.json").read_bytes()).hexdigest()

    def damaged(name: str, change) -> str:
        copy = json.loads(json.dumps(document))
        change(copy)
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(copy))
        return str(path)

    def every_rung(change):
        def apply(copy):
            for rung in copy.get("ladder") or [copy]:
                change(rung)

        return apply

    planned = ("--device", "sim", "--ids", "1,2,3", "--max-new-tokens", "2")
    for plans_file, fragment in (
        (damaged("negative", every_rung(lambda r: r.update(budget_bytes=-1))), "budget_bytes must be from 0"),
        (damaged("tier0", every_rung(lambda r: r["tiers"][0].update(tier=0))), "a tier must be from 1"),
        (damaged("context", lambda c: c.update(context=1 << 40)), "context must be from 1"),
        (
            damaged(
                "reserve", every_rung(lambda r: r["tiers"][0]["chosen"]["vram"].update(reserve=-(10**12)))
            ),
            "vram.reserve must be from 0",
        ),
    ):
        _refused(_host(str(tiny_pack), "--plans", plans_file, *planned), fragment)
    for option, value, fragment in (
        ("--vram", "0", "--vram"),
        ("--temperature", "nan", "--temperature"),
        ("--threads", "100000", "--threads"),
        ("--top-p", "2", "--top-p"),
    ):
        _refused(_host(str(tiny_pack), "--plans", str(plans), *planned, option, value), fragment)


def _python_products(pack: Path) -> int:
    """How many products the Python engine's CPU sessions compute with pipeshard's ops (runtime/weight_matmul.py),
    over every sub-layer: the count the host's decode step must match."""
    from pipeshard.formats.manifest import load_pack
    from pipeshard.runtime.joined import join
    from pipeshard.runtime.weight_matmul import product_weights

    loaded = load_pack(pack)
    count = 0
    for entry in loaded.manifest.sub_layers:
        if weights := product_weights(entry.weights, False):
            joined = join(
                [loaded.path(entry.graph_file)], {o.name for o in entry.outputs}, product_weights=weights
            )
            assert b"MatMulNBits" not in joined.model, entry.name  # every product swapped, 2-bit planes too
            count += joined.weight_matmul_nodes
    return count


@pytest.mark.slow
def test_the_hosts_product_swap_rewrites_the_nodes_the_python_engine_does(tiny_gguf):
    """Every quantized format's products (high planes and minimum terms fused into one BlockMatMul, as
    runtime/weight_matmul.py fuses them) computed by pipeshard's ops in the host's decode step, with the Python
    engine's tokens."""
    reason = _missing_tools()
    if reason:
        pytest.skip(reason)
    import pipeshard

    _, _, pack = tiny_gguf
    expected_products = _python_products(pack)
    engine = pipeshard.load(pack, threads=THREADS)
    for prompt in ("The capital of France is", "def fibonacci(n):"):
        ids = engine.generator.prompt_ids(prompt, chat_template=False)
        (done_by_python,) = engine.generator.generate(
            [ids], pipeshard.api.SamplingSettings(max_new_tokens=MAX_NEW_TOKENS)
        )
        expected = done_by_python.tokens
        arguments = ["--ids", ",".join(map(str, ids)), "--print-ids", "--report", "--threads", str(THREADS)]
        done = _host(str(pack), *arguments, "--max-new-tokens", str(MAX_NEW_TOKENS))
        assert done.returncode == 0, done.stderr[-2000:]
        assert [int(t) for t in done.stdout.split()] == expected, prompt
        report = json.loads(done.stderr.splitlines()[-1])
        assert report["decode_product_nodes"] == expected_products > 0, report


@pytest.mark.slow
def test_the_native_host_runs_a_quantized_pack_with_the_python_engines_tokens(models, tmp_path):
    """The GGUF's blocks kept as stored (MatMulNBits, an embedding's gathered rows): the same graphs through ONNX
    Runtime's C API alone, all-CPU and planned on the simulated device."""
    reason = _missing_tools()
    if reason:
        pytest.skip(reason)
    import pipeshard

    pack = models.pack("smollm2-135m", "gguf")
    plans = tmp_path / "plans.json"
    arguments = ["plan", str(pack), "--vram", "10%", "--profile", "laptop-8gb", "--tiers", "1,16,64"]
    subprocess.run([sys.executable, "-P", "-m", "pipeshard", *arguments, "--out", str(plans)], check=True)
    engine = pipeshard.load(pack, threads=THREADS)
    products = _python_products(pack)
    for text in SMOLLM2_PROMPTS:
        expected = engine.generate(text, max_new_tokens=MAX_NEW_TOKENS)[0].tokens
        common = [
            str(pack),
            text,
            "--print-ids",
            "--threads",
            str(THREADS),
            "--max-new-tokens",
            str(MAX_NEW_TOKENS),
        ]
        for extra in (["--report"], ["--plans", str(plans), "--device", "sim", "--report"]):
            done = _host(*common, *extra)
            assert done.returncode == 0, done.stderr[-2000:]
            assert [int(t) for t in done.stdout.split()] == expected, (text, extra)
            # all-CPU: every product computed by pipeshard's ops, as the Python engine's are
            if not extra[1:]:
                report = json.loads(done.stderr.splitlines()[-1])
                assert report["decode_product_nodes"] == products > 0, report
        # the planned run's report: its blocks went through the device
        report = json.loads(done.stderr.splitlines()[-1])
        assert report["peak_device_bytes"] > 0 and report["streamed_weight_bytes"] > 0, report


@pytest.mark.slow
def test_the_native_host_runs_a_moe_pack_all_cpu_and_planned_with_the_python_engines_tokens(models, tmp_path):
    """tiny:moe's routed layers: the host runs each expert its router chose over those tokens only and adds their
    outputs in expert order (runtime/moe.py's combine), all-CPU and on every rung of a ladder whose plans pin,
    stream (through the two expert slots, copied after the router ran) or keep experts on the CPU."""
    reason = _missing_tools()
    if reason:
        pytest.skip(reason)
    import pipeshard

    pack = models.pack("tiny:moe")
    probe, plans = tmp_path / "probe.json", tmp_path / "plans.json"
    plan = [sys.executable, "-P", "-m", "pipeshard", "plan", str(pack), "--profile", "laptop-8gb"]
    subprocess.run([*plan, "--vram", "25%", "--out", str(probe)], check=True, capture_output=True)
    floor = json.loads(probe.read_text())["minimum_budget_bytes"]
    # Above the floor: all experts pinned; some pinned, the rest streamed; all streamed; all on the CPU.
    budgets = [floor + extra for extra in (6 << 20, 1 << 20, 600 << 10, 100 << 10)]
    subprocess.run(
        [*plan, "--vram", ",".join(map(str, budgets)), "--out", str(plans)], check=True, capture_output=True
    )
    expert_placements = {
        rung["budget_bytes"]: {
            where for name, where in rung["tiers"][0]["chosen"]["placements"].items() if ".expert" in name
        }
        for rung in json.loads(plans.read_text())["ladder"]
    }
    assert {"pinned", "streamed"} <= set().union(*expert_placements.values()), expert_placements
    assert any(len(places) > 1 for places in expert_placements.values()), expert_placements
    engine = pipeshard.load(pack, threads=THREADS)
    for text in ("Hi", "What is the capital of France, and why is it famous?", "Tell me a story."):
        expected = engine.generate(text, max_new_tokens=MAX_NEW_TOKENS)[0].tokens
        arguments = ["--print-ids", "--threads", str(THREADS), "--max-new-tokens", str(MAX_NEW_TOKENS)]
        done = _host(str(pack), text, *arguments)
        assert done.returncode == 0, done.stderr[-2000:]
        assert [int(t) for t in done.stdout.split()] == expected, text
        for budget, places in expert_placements.items():
            planned = ["--plans", str(plans), "--device", "sim", "--vram", str(budget), "--report"]
            done = _host(str(pack), text, *arguments, *planned)
            assert done.returncode == 0, done.stderr[-2000:]
            assert [int(t) for t in done.stdout.split()] == expected, (text, places)
            report = json.loads(done.stderr.splitlines()[-1])
            assert 0 < report["peak_device_bytes"] <= budget, report
            if "streamed" in places:
                assert report["streamed_weight_bytes"] > 0, report
