"""Thread pools: the C-API engines' own pool, and the Python binding's process pool (what the console script
asks for) taken only when a session is made through the binding: never by the step, planned or not."""

import subprocess
import sys

import pipeshard

SIM_SCRIPT = """
import sys, pipeshard
from pipeshard.runtime import ort
assert pipeshard.use_process_thread_pool(2)
engine = pipeshard.load(sys.argv[1], device="sim", vram="50%", plan="static", profile="laptop-8gb")
engine.codec.eos_token_ids = []
print(engine.generate("tell me a story", max_new_tokens=12)[0].tokens)
assert ort._process_pool_threads == 2
"""

CONSOLE_SCRIPT = """
import sys
from pipeshard.cli import main
from pipeshard.runtime import ort
assert main(["run", sys.argv[1], "hi", "--max-new-tokens", "4", "--threads", "1"] + sys.argv[2:], own_process=True) == 0
print("\\n" + ("binding loaded" if "onnxruntime" in sys.modules else "binding not loaded"), ort._process_pool_threads)
"""


def test_planned_tokens_are_the_chains_with_the_process_pool(tiny_pack):
    engine = pipeshard.load(tiny_pack)
    engine.codec.eos_token_ids = []
    expected = engine.generate("tell me a story", max_new_tokens=12)[0].tokens
    done = subprocess.run(
        [sys.executable, "-c", SIM_SCRIPT, str(tiny_pack)], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == str(expected)


def test_the_console_command_never_loads_the_binding_for_a_pack_or_an_export(tiny_llama_export, tiny_pack):
    def run(*extra) -> str:
        done = subprocess.run(
            [sys.executable, "-c", CONSOLE_SCRIPT, *map(str, extra)], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.split("\n")[-2]

    assert run(tiny_llama_export) == "binding not loaded 0"  # the monolithic session: C API only
    assert (
        run(tiny_pack, "--device", "sim", "--vram", "50%", "--profile", "laptop-8gb")
        == "binding not loaded 0"
    )
