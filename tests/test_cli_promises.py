"""The CLI keeps its promises: chat holds a conversation, every user mistake is one `error:` line (exit 2, no
traceback, nothing half-written), and no flag is silently ignored."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import pipeshard
from pipeshard.cli import main
from pipeshard.runtime.conversation import Conversation
from pipeshard.runtime.generate import SamplingSettings

CLI = [sys.executable, "-m", "pipeshard"]


def cli(capsys, *argv) -> tuple[int, str, str]:
    status = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def one_error(status: int, err: str, *fragments: str) -> None:
    lines = [line for line in err.strip().splitlines() if not line.startswith("warning:")]
    assert status == 2, err
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def process(*argv, stdin: bytes | None = None, env: dict | None = None, timeout: float = 180):
    return subprocess.run(
        [*CLI, *map(os.fsencode, map(str, argv))],
        input=stdin,
        capture_output=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture()
def pack_copy(tiny_pack, tmp_path) -> Path:
    shutil.copytree(tiny_pack, tmp_path / "pack")
    return tmp_path / "pack"


@pytest.fixture()
def export_copy(tiny_llama_export, tmp_path) -> Path:
    shutil.copytree(tiny_llama_export, tmp_path / "export")
    return tmp_path / "export"


# chat ------------------------------------------------------------------------------------------------------------


def _answer_pieces(engine, messages, max_new_tokens):
    ids = engine.codec.encode(engine.codec.render_messages(messages))
    return "".join(
        e.text for e in engine.generator.stream([ids], SamplingSettings(max_new_tokens=max_new_tokens))
    )


def test_chat_sends_the_whole_history_through_the_template(tiny_pack):
    first, second = "Write a long story about a dragon.", "Say hello."
    done = process("chat", tiny_pack, "--max-new-tokens", 12, stdin=f"{first}\n{second}\n".encode())
    assert done.returncode == 0, done.stderr
    answers = [line.removeprefix("> ") for line in done.stdout.decode().splitlines()[1:3]]
    engine = pipeshard.load(tiny_pack)
    one = _answer_pieces(engine, [{"role": "user", "content": first}], 12)
    two = _answer_pieces(
        engine,
        [
            {"role": "user", "content": first},
            {"role": "assistant", "content": one},
            {"role": "user", "content": second},
        ],
        12,
    )
    assert answers == [one.strip("\n"), two.strip("\n")] and one != two
    assert done.stdout.decode().endswith("\n")  # Ctrl-D / end of input ends the line


@pytest.mark.parametrize("device", ["cpu", "sim"])
def test_a_new_turn_feeds_only_its_new_tokens_and_gives_a_fresh_prefills_tokens(tiny_pack, device):
    options = {"device": "sim", "vram": "30%", "profile": "laptop-8gb"} if device == "sim" else {}
    engine = pipeshard.load(tiny_pack, **options)
    settings = SamplingSettings(max_new_tokens=16)
    conversation = Conversation(engine.generator, settings, 512)
    "".join(conversation.ask("Write a long story about a dragon."))
    "".join(conversation.ask("Say hello."))
    history_ids = engine.codec.encode(engine.codec.render_messages(conversation.messages[:-1]))
    assert engine.generator.reused_tokens > 20
    assert conversation.last.tokens == engine.generator.generate([history_ids], settings)[0].tokens


def test_an_interrupted_answer_stays_as_far_as_it_got_and_is_not_replayed(tiny_pack):
    engine = pipeshard.load(tiny_pack)
    conversation = Conversation(engine.generator, SamplingSettings(max_new_tokens=40), 512)
    answer = conversation.ask("Write a long story about a dragon.")
    partial = "".join(next(answer) for _ in range(3))
    answer.close()  # what the chat loop does on Ctrl-C
    assert conversation.messages[-1] == {"role": "assistant", "content": partial}
    assert engine.generator.cached_tokens == []  # the next turn starts from a fresh cache
    second = "".join(conversation.ask("Say hello."))
    expected = _answer_pieces(engine, conversation.messages[:-1], 40)
    assert second == expected and not second.startswith(partial)


def test_history_that_outgrows_the_context_is_cut_oldest_first(tiny_pack):
    engine = pipeshard.load(tiny_pack)
    conversation = Conversation(engine.generator, SamplingSettings(max_new_tokens=16), 160)
    for question in ("What is the capital of France?", "And of Italy?", "And of Spain?", "And of Portugal?"):
        "".join(conversation.ask(question))
    assert conversation.dropped_turns >= 1
    assert conversation.messages[-2]["content"] == "And of Portugal?"


def test_chat_commands_answer_instead_of_failing(tiny_pack, tiny_llama_export):
    done = process(
        "chat",
        tiny_pack,
        "--device",
        "sim",
        "--vram",
        "30%",
        "--profile",
        "laptop-8gb",
        stdin=b"/budget\n/plan\n/nonsense\n/budget 25\n/quit\n",
    )
    assert done.returncode == 0, done.stderr
    err, out = done.stderr.decode(), done.stdout.decode()
    assert "usage: /budget SIZE" in err and "unknown command /nonsense" in err and "give a unit" in err
    assert "no plan chosen yet" in out and "plans ;" not in out
    assert "Traceback" not in err
    exported = process("chat", tiny_llama_export, stdin=b"/plan\n/budget 1GiB\n")
    assert "one session over the whole export" in exported.stdout.decode()
    assert (
        "--device sim|cuda --vram SIZE" in exported.stderr.decode()
        and "device=" not in exported.stderr.decode()
    )


def test_a_chat_line_that_is_not_utf8_is_an_error_and_the_chat_goes_on(tiny_pack):
    done = process("chat", tiny_pack, "--max-new-tokens", 4, stdin=b"caf\xe9\nHi\n")
    assert done.returncode == 0 and "not valid UTF-8" in done.stderr.decode()
    assert done.stdout.decode().count("> ") >= 3 and "Traceback" not in done.stderr.decode()


# flags that used to be ignored ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "options", "fragment"),
    [
        ("export", ["--device", "tpu", "--plan", "foo", "--vram", "abc"], "cannot read size 'abc'"),
        ("export", ["--device", "tpu"], "unknown device 'tpu'"),
        ("export", ["--plan", "foo"], "unknown plan 'foo'"),
        ("export", ["--device", "cuda"], "export folder"),
        ("export", ["--device", "sim", "--vram", "1GiB"], "export folder"),
        ("pack", ["--plan", "foo"], "unknown plan 'foo'"),
        ("pack", ["--plan", "gpu-only"], "--device sim|cuda"),
        ("pack", ["--vram", "25%"], "--device sim"),
        ("pack", ["--device", "cpu", "--vram", "1GiB"], "drop --vram"),
        ("pack", ["--plan", "monolithic", "--device", "sim", "--vram", "1GiB"], "drop --device"),
        ("pack", ["--device", "cuda"], "no usable CUDA"),  # said before asking for --vram or a profile
        ("pack", ["--temperature", "nan"], "--temperature"),
        ("pack", ["--temperature", "inf"], "--temperature"),
        ("pack", ["--seed", "-1"], "--seed"),
        ("pack", ["--threads", "999"], "cores"),
        ("pack", ["--threads", "0"], "--threads"),
        ("pack", ["--threads", "-2"], "--threads"),
        ("pack", ["--context", "0"], "--context"),
        ("pack", ["--context", "-5"], "--context"),
        ("pack", ["--context", "100000"], "maximum of 512"),
        ("pack", ["--save-expert-stats", "stats.json"], "MoE model"),
        ("pack", ["--expert-stats", "nope.json"], "nope.json does not exist"),
    ],
)
def test_a_flag_takes_effect_or_is_one_error_line(
    capsys, tiny_llama_export, tiny_pack, target, options, fragment
):
    folder = tiny_llama_export if target == "export" else tiny_pack
    one_error(*cli(capsys, "run", folder, "hi", *options)[::2], fragment)


def test_verify_checks_an_exports_checksums(capsys, export_copy):
    data = export_copy / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    one_error(*cli(capsys, "run", export_copy, "hello", "--verify")[::2], "model.onnx.data", "sha256")


def test_numbers_and_sizes_are_read_as_meant(capsys, tiny_pack):
    one_error(*cli(capsys, "plan", tiny_pack, "--vram", "25", "--profile", "laptop-8gb")[::2], "give a unit")
    one_error(*cli(capsys, "plan", tiny_pack, "--vram", "25%", "--context", "100000")[::2], "maximum of 512")
    one_error(*cli(capsys, "inspect", tiny_pack, "--context", "-100000")[::2], "--context")
    one_error(*cli(capsys, "inspect", tiny_pack, "--context", "100000")[::2], "maximum of 512")
    one_error(*cli(capsys, "chat", tiny_pack, "--max-new-tokens", "0")[::2], "--max-new-tokens")


def test_plan_and_run_size_the_cache_alike(capsys, tiny_pack):
    status, out, _ = cli(capsys, "plan", tiny_pack, "--vram", "25%", "--profile", "laptop-8gb")
    assert status == 0 and "context 512," in out  # min(4096, the model's 512), as run does


def test_prompt_and_system_that_are_not_utf8_are_error_lines(tiny_pack):
    for argv in (["run", tiny_pack, b"caf\xe9"], ["run", tiny_pack, "hi", "--system", b"caf\xe9"]):
        done = subprocess.run(
            [*CLI, *[a if isinstance(a, bytes) else os.fsencode(str(a)) for a in argv]],
            capture_output=True,
            timeout=120,
        )
        assert done.returncode == 2 and done.stderr.decode().strip().startswith("error:")
        assert "UTF-8" in done.stderr.decode() and "Traceback" not in done.stderr.decode()


def test_generated_text_ends_with_a_newline(tiny_pack):
    done = process("run", tiny_pack, "hi", "--max-new-tokens", 3)
    assert done.returncode == 0 and done.stdout.endswith(b"\n")


def test_bare_pipeshard_prints_the_help(capsys):
    status, out, _ = cli(capsys)
    assert status == 2 and "export" in out and "partition" in out and "usage:" in out


# output paths --------------------------------------------------------------------------------------------------


def test_output_paths_are_checked_or_made_before_the_work(
    capsys, tiny_pack, tiny_llama_export, tmp_path, monkeypatch
):
    (tmp_path / "afile").write_text("a file")
    status, out, err = cli(
        capsys,
        "plan",
        tiny_pack,
        "--vram",
        "25%",
        "--profile",
        "laptop-8gb",
        "--out",
        tmp_path / "nodir" / "deeper" / "plans.json",
    )
    assert status == 0 and json.loads((tmp_path / "nodir" / "deeper" / "plans.json").read_text())["tiers"]
    plan = ["plan", tiny_pack, "--vram", "25%", "--profile", "laptop-8gb"]

    def work(*args, **kwargs):
        raise AssertionError("the work started before the output path was checked")

    import pipeshard.bench
    import pipeshard.exporter.sources
    import pipeshard.partitioner.partition
    from pipeshard.partitioner.planner import Planner

    for target, name in (
        (pipeshard.bench, "run_bench"),
        (pipeshard, "load"),
        (Planner, "plan"),
        (pipeshard.exporter.sources, "load_source"),
        (pipeshard.partitioner.partition, "build_graph"),
    ):
        monkeypatch.setattr(target, name, work)
    for argv in (
        [*plan, "--out", tmp_path / "afile" / "p.json"],
        [*plan, "--plot", tmp_path / "afile" / "x.png"],
        ["bench", tiny_pack, "--device", "cpu", "--json", tmp_path / "afile" / "b.json"],
        ["bench", tiny_pack, "--device", "cpu", "--plot", tmp_path / "afile" / "b.png"],
        ["run", tiny_pack, "hi", "--save-expert-stats", tmp_path / "afile" / "s.json"],
        ["export", "tiny:llama", tmp_path / "afile" / "sub"],
        ["partition", tiny_llama_export, tmp_path / "afile" / "sub"],
    ):
        one_error(*cli(capsys, *argv)[::2], "afile")


# damaged files -------------------------------------------------------------------------------------------------


def test_a_garbage_sub_layer_file_fails_verify_and_run_names_it(capsys, pack_copy):
    (pack_copy / "L1.ffn.onnx").write_bytes(os.urandom(2000))
    one_error(*cli(capsys, "inspect", pack_copy, "--verify")[::2], "L1.ffn.onnx")
    one_error(*cli(capsys, "run", pack_copy, "hi")[::2], "L1.ffn.onnx")


def test_a_garbage_sub_layer_of_the_same_size_is_named_by_run(capsys, pack_copy):
    target = pack_copy / "L1.ffn.onnx"
    target.write_bytes(os.urandom(target.stat().st_size))
    one_error(*cli(capsys, "inspect", pack_copy, "--verify")[::2], "L1.ffn.onnx")
    one_error(*cli(capsys, "run", pack_copy, "hi")[::2], "L1.ffn.onnx")


@pytest.mark.parametrize("missing", ["model.onnx.data", "tokenizer.json"])
def test_an_export_missing_a_file_is_named(capsys, export_copy, tmp_path, missing):
    (export_copy / missing).unlink()
    one_error(*cli(capsys, "run", export_copy, "hi")[::2], missing)
    one_error(*cli(capsys, "partition", export_copy, tmp_path / "pack")[::2], missing)
    assert not (tmp_path / "pack").exists()


def test_a_pack_missing_its_tokenizer_is_named(capsys, pack_copy):
    (pack_copy / "tokenizer.json").unlink()
    one_error(*cli(capsys, "run", pack_copy, "hi")[::2], "tokenizer.json")


def test_garbage_tokenizer_and_broken_template_are_error_lines(capsys, pack_copy, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(pack_copy, broken)
    (pack_copy / "tokenizer.json").write_text("{ not a tokenizer")
    manifest = json.loads((pack_copy / "manifest.json").read_text())
    manifest["files"].pop("tokenizer.json")  # past the size check: the tokenizer's own parse must say it
    (pack_copy / "manifest.json").write_text(json.dumps(manifest))
    one_error(*cli(capsys, "run", pack_copy, "hi")[::2], "tokenizer.json")
    (broken / "chat_template.jinja").write_text("{% for message in messages %}{{ message['content'] }")
    manifest = json.loads((broken / "manifest.json").read_text())
    manifest["files"].pop("chat_template.jinja", None)
    (broken / "manifest.json").write_text(json.dumps(manifest))
    one_error(*cli(capsys, "run", broken, "hi")[::2], "chat template")


# defaults that used to strand a newcomer -----------------------------------------------------------------------


def test_a_machine_never_profiled_plans_with_a_stated_reference(tiny_pack, tmp_path):
    done = process(
        "run",
        tiny_pack,
        "hi",
        "--device",
        "sim",
        "--vram",
        "30%",
        "--max-new-tokens",
        4,
        env={"XDG_CACHE_HOME": str(tmp_path / "cache")},
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.decode().startswith("warning: this machine has no profile yet")


def test_bench_with_no_flags_plans_at_25_percent_and_makes_no_peers(capsys, tiny_pack, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    status, out, err = cli(
        capsys,
        "bench",
        tiny_pack,
        "--plans",
        "cpu,auto",
        "--new-tokens",
        2,
        "--repeat",
        1,
        "--prompt-tokens",
        40,
    )
    assert status == 0, err
    assert "auto" in out and "skipped auto" not in out + err
    assert not Path(f"{tiny_pack}.peers").exists()


# interrupted work ----------------------------------------------------------------------------------------------


def test_a_terminated_export_leaves_nothing_and_an_abandoned_one_is_cleaned_up(tmp_path):
    out = tmp_path / "out"
    abandoned = tmp_path / ".out.partial-999999999-abc"  # a process id that does not exist
    abandoned.mkdir()
    export = subprocess.Popen([*CLI, "export", "tiny:llama", str(out), "--quiet"], stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not [p for p in tmp_path.iterdir() if p != abandoned]:
        time.sleep(0.2)
    time.sleep(1.0)
    export.send_signal(signal.SIGTERM)
    assert export.wait(timeout=120) != 0
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == []


# fuzz: no number or path makes a traceback ---------------------------------------------------------------------

VALUES = [
    "nan",
    "inf",
    "-inf",
    "-1",
    "0",
    "1e30",
    "99999999999999999999",
    "",
    "abc",
    "25%",
    "-5%",
    "1e400GiB",
]


@pytest.mark.parametrize("value", VALUES)
def test_no_numeric_or_size_option_value_makes_a_traceback(capsys, tiny_pack, value):
    run = ["run", tiny_pack, "hi", "--max-new-tokens", "2"]
    options = [
        (run, "--max-new-tokens"),
        (run, "--temperature"),
        (run, "--top-k"),
        (run, "--top-p"),
        (run, "--repetition-penalty"),
        (run, "--seed"),
        (run, "--threads"),
        (run, "--context"),
        ([*run, "--device", "sim", "--profile", "laptop-8gb"], "--vram"),
        (["plan", tiny_pack, "--profile", "laptop-8gb"], "--vram"),
        (["plan", tiny_pack, "--vram", "25%", "--profile", "laptop-8gb"], "--context"),
        (["plan", tiny_pack, "--vram", "25%", "--profile", "laptop-8gb"], "--batch"),
        (["plan", tiny_pack, "--vram", "25%", "--profile", "laptop-8gb"], "--tiers"),
        (["plan", tiny_pack, "--vram", "25%", "--profile", "laptop-8gb"], "--threads"),
        (["inspect", tiny_pack], "--context"),
        (["bench", tiny_pack, "--device", "cpu", "--repeat", "1"], "--new-tokens"),
        (["bench", tiny_pack, "--device", "cpu", "--new-tokens", "2"], "--repeat"),
        (["bench", tiny_pack, "--device", "cpu", "--new-tokens", "2"], "--processes"),
        (["bench", tiny_pack, "--device", "cpu", "--new-tokens", "2"], "--prompt-tokens"),
        (["export", "tiny:llama", "/nonexistent-root-dir/x/out"], "--opset"),
    ]
    for command, option in options:
        whole_bench = command[0] == "bench" and option != "--prompt-tokens"
        if value in ("0", "-1", "1e30", "99999999999999999999") and whole_bench:
            continue  # valid or refused values of a command that would then run a whole benchmark
        status, _, err = cli(capsys, *command, option, value)
        assert status in (0, 2) and "Traceback" not in err, (command, option, value, err)
        if status == 2:
            one_error(status, err)


@pytest.mark.parametrize("kind", ["missing", "file", "file-parent"])
def test_no_path_makes_a_traceback(capsys, tiny_pack, tmp_path, kind):
    (tmp_path / "afile").write_text("x")
    path = {
        "missing": tmp_path / "nope",
        "file": tmp_path / "afile",
        "file-parent": tmp_path / "afile" / "below",
    }[kind]
    for argv in (
        ["run", path, "hi"],
        ["chat", path],
        ["inspect", path],
        ["plan", path, "--vram", "1GiB"],
        ["partition", path, tmp_path / "out"],
        ["export", path, tmp_path / "out2"],
        ["bench", path, "--device", "cpu"],
        ["profile", "--show", path],
        ["run", tiny_pack, "hi", "--device", "sim", "--vram", "30%", "--profile", path],
        ["plan", tiny_pack, "--vram", "25%", "--expert-stats", path, "--profile", "laptop-8gb"],
    ):
        status, _, err = cli(capsys, *argv)
        one_error(status, err)


def test_chat_on_a_model_without_a_chat_template_says_so_at_once(capsys, pack_copy):
    (pack_copy / "chat_template.jinja").unlink()
    manifest = json.loads((pack_copy / "manifest.json").read_text())
    manifest["files"].pop("chat_template.jinja", None)
    (pack_copy / "manifest.json").write_text(json.dumps(manifest))
    config = json.loads((pack_copy / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (pack_copy / "tokenizer_config.json").write_text(json.dumps(config))
    manifest["files"].pop("tokenizer_config.json", None)
    (pack_copy / "manifest.json").write_text(json.dumps(manifest))
    one_error(*cli(capsys, "chat", pack_copy)[::2], "no chat template", "--no-chat-template")
