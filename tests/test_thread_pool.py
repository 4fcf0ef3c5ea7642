"""The process-wide thread pool (what the console script uses for run / chat): same tokens as
per-session pools, and the console command really takes it."""

import subprocess
import sys

import pipeshard
from pipeshard.partitioner.pack import partition

SCRIPT = """
import sys, pipeshard
assert pipeshard.use_process_thread_pool(2)
engine = pipeshard.load(sys.argv[1])
engine.codec.eos_token_ids = []
print(engine.generate("tell me a story", max_new_tokens=12)[0].tokens)
"""


def test_chain_tokens_are_the_same_with_the_process_pool(tiny_llama_export, tmp_path):
    pack = tmp_path / "pack"
    partition(tiny_llama_export, pack)
    engine = pipeshard.load(pack)
    engine.codec.eos_token_ids = []
    expected = engine.generate("tell me a story", max_new_tokens=12)[0].tokens
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(pack)], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == str(expected)


def test_the_console_command_runs_with_the_process_pool(tiny_llama_export):
    done = subprocess.run([sys.executable, "-m", "pipeshard", "run", str(tiny_llama_export), "hi",
                           "--max-new-tokens", "4", "--threads", "1"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "decode" in done.stderr
