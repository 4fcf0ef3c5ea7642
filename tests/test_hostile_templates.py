"""A model's chat template is a stranger's code: a hostile or broken one is one `error:` line naming its file, fast,
never a hang, a huge allocation or a traceback."""

from __future__ import annotations

import hashlib
import json
import shutil
import time

import pytest

from pipeshard.cli import main
from pipeshard.core.errors import UserError
from pipeshard.formats.chat_template import ChatTemplate

HOSTILE = {
    "include": "{% include 'other.jinja' %}",
    "import": "{% import 'macros.jinja' as macros %}{{ macros.turn() }}",
    "extends": "{% extends 'base.jinja' %}",
    "huge output": "{% for i in range(90000) %}{{ 'twenty-six letters a to z' }}{% endfor %}",
    "huge output in a macro": "{% macro m() %}{% for i in range(90000) %}twenty-six letters a to z{% endfor %}"
    "{% endmacro %}{{ m() | length }}",
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "recursive macro": "{% macro again(n) %}{{ again(n + 1) }}{% endmacro %}{{ again(0) }}",
    "branching macro": "{% macro twice(n) %}{% if n < 40 %}{{ twice(n + 1) }}{{ twice(n + 1) }}{% endif %}"
    "{% endmacro %}{{ twice(0) }}",
    "string times a float": "{{ 'a' * 4e9 }}",
    "string times an int": "{{ 'a' * 4000000000 }}",
    "list times an int": "{{ [0] * 4000000000 }}",
    "doubling with ~": "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s }}",
    "a huge width": "{{ 'a'.center(4000000000) }}",
    "division by zero": "{{ 1 / 0 }}",
    "a syntax error": "{% for message in messages %}{{ message['content'] }}",
    "raise_exception": "{{ raise_exception('only user and assistant\nroles are supported') }}",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_template_is_one_error_naming_its_file(tmp_path, name):
    (tmp_path / "chat_template.jinja").write_text(HOSTILE[name])
    (tmp_path / "other.jinja").write_text("an included file's text")
    template = ChatTemplate.read(tmp_path)
    started = time.perf_counter()
    with pytest.raises(UserError) as caught:
        template.render([{"role": "user", "content": "hi"}])
    assert time.perf_counter() - started < 5
    message = str(caught.value)
    assert message.startswith(f"{tmp_path / 'chat_template.jinja'}: ") and "\n" not in message
    assert "included file" not in message


def test_a_template_within_the_limits_renders_as_before():
    template = ChatTemplate(
        "{% for message in messages %}{{ '<|' ~ message['role'] ~ '|>' + message['content'] }}{% endfor %}"
        "{% for i in range(1000) %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    messages = [{"role": "user", "content": "x" * 100_000}, {"role": "assistant", "content": "ok"}]
    assert template.render(messages) == "<|user|>" + "x" * 100_000 + "<|assistant|>ok<|assistant|>"


def test_tokenizer_configs_template_errors_name_that_file(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ 1 / 0 }}"}))
    with pytest.raises(UserError, match=r"tokenizer_config\.json \(chat_template\): cannot be rendered"):
        ChatTemplate.read(tmp_path).render([{"role": "user", "content": "hi"}])


@pytest.fixture(scope="module")
def pack_with_template(tiny_pack, tmp_path_factory):
    """Puts a chat template into a copy of the tiny pack, its size and sha256 in the manifest updated to match."""
    pack = tmp_path_factory.mktemp("hostile") / "pack"
    shutil.copytree(tiny_pack, pack)

    def with_template(text: str):
        data = text.encode()
        (pack / "chat_template.jinja").write_bytes(data)
        manifest = json.loads((pack / "manifest.json").read_text())
        manifest["files"]["chat_template.jinja"] = {
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
        (pack / "manifest.json").write_text(json.dumps(manifest, indent=2))
        return pack

    return with_template


@pytest.mark.parametrize(
    "name", ["include", "nested loops", "recursive macro", "string times a float", "division by zero"]
)
def test_run_with_a_hostile_template_is_one_error_line(pack_with_template, capsys, name):
    pack = pack_with_template(HOSTILE[name])
    assert main(["run", str(pack), "hi", "--verify", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {pack / 'chat_template.jinja'}: "), err
