"""`pipeshard batch`: a JSONL job through the scheduler, its results equal to `pipeshard run`, surviving kills."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

import pipeshard
from pipeshard.cli import main

WORDS = ["tell", "me", "about", "the", "sea", "a", "story", "why", "how", "numbers", "colors", "rivers"]


def prompt(index: int) -> str:
    return " ".join(WORDS[(index * 7 + k) % len(WORDS)] for k in range(1 + index % 9))


def write_job(path, count: int, max_tokens: int) -> None:
    """Every third line in OpenAI's Batch form (chat), the others plain (completions and chat, extra fields)."""
    with open(path, "w") as job:
        for i in range(count):
            if i % 3 == 0:
                line = {
                    "custom_id": f"req-{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {
                        "model": "pack",
                        "messages": [{"role": "user", "content": prompt(i)}],
                        "max_tokens": max_tokens,
                    },
                }
            elif i % 3 == 1:
                line = {"custom_id": f"req-{i}", "prompt": prompt(i), "max_tokens": max_tokens, "answer": i}
            else:
                line = {
                    "custom_id": f"req-{i}",
                    "messages": [{"role": "user", "content": prompt(i)}],
                    "max_tokens": max_tokens,
                }
            job.write(json.dumps(line) + "\n")


def answers(path) -> dict[str, str]:
    """custom_id -> the answer's text, every line of a results file (each custom_id must appear once)."""
    records = [json.loads(line) for line in open(path)]
    ids = [record["custom_id"] for record in records]
    assert len(ids) == len(set(ids)), ids
    return answers_of(records)


def answers_of(records: list[dict]) -> dict[str, str]:
    """custom_id -> the answer's text of result records (OpenAI Batch or plain)."""
    found = {}
    for record in records:
        if "response" in record:
            found[record["custom_id"]] = record["response"]["body"]["choices"][0]["message"]["content"]
        else:
            found[record["custom_id"]] = record["output"]
    return found


@pytest.fixture(scope="module")
def expected(tiny_pack):
    """What `pipeshard run` gives for each line of a 200-line job, one prompt at a time."""
    engine = pipeshard.load(tiny_pack)
    result = {}
    for i in range(200):
        chat = i % 3 != 1
        result[f"req-{i}"] = engine.generate(prompt(i), chat_template=chat, max_new_tokens=24)[0].text
    return result


def test_a_200_line_job_gives_what_run_gives_prompt_by_prompt(tiny_pack, expected, tmp_path, capsys):
    job, out = tmp_path / "job.jsonl", tmp_path / "out.jsonl"
    write_job(job, 200, 24)
    assert main(["batch", str(tiny_pack), str(job), str(out), "--parallel", "6"]) == 0
    assert answers(out) == expected
    records = [json.loads(line) for line in open(out)]
    openai_form = next(r for r in records if r["custom_id"] == "req-0")
    assert openai_form["response"]["status_code"] == 200 and openai_form["error"] is None
    assert openai_form["response"]["body"]["object"] == "chat.completion"
    plain = next(r for r in records if r["custom_id"] == "req-1")
    assert plain["answer"] == 1 and plain["usage"]["completion_tokens"] <= 24  # its fields passed through
    assert "200 requests (0 already done, 0 failed)" in capsys.readouterr().err


def batch_command(pack, job, out) -> list[str]:
    return [sys.executable, "-m", "pipeshard.cli", "batch", str(pack), str(job), str(out), "--parallel", "2"]


def kill_after(command: list[str], out, lines: int) -> None:
    """Start the batch job and SIGKILL it once OUT holds `lines` lines (or after a minute)."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not out.exists() or out.read_bytes().count(b"\n") < lines):
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait()


def test_a_job_killed_midway_and_rerun_has_every_request_exactly_once(tiny_pack, expected, tmp_path):
    job, out = tmp_path / "job.jsonl", tmp_path / "out.jsonl"
    write_job(job, 200, 24)
    command = batch_command(tiny_pack, job, out)
    kill_after(command, out, 30)
    written = out.read_bytes().count(b"\n")
    assert 30 <= written < 200, written  # killed in the middle
    subprocess.run(command, check=True, capture_output=True)
    assert answers(out) == expected


def test_kills_at_random_points_and_a_damaged_out_lose_no_line_and_double_none(tiny_pack, expected, tmp_path):
    """kill -9 after a random number of results, three times, with blank, torn and foreign lines put into OUT
    between the runs: the final OUT holds every custom_id once, and every whole line it ever held."""
    import random

    rng = random.Random(5)
    job, out = tmp_path / "job.jsonl", tmp_path / "out.jsonl"
    write_job(job, 200, 24)
    command = batch_command(tiny_pack, job, out)
    foreign = json.dumps({"custom_id": "other-job", "output": "precious"}) + "\n"
    kept: list[bytes] = []
    for _ in range(3):
        kill_after(command, out, (out.read_bytes().count(b"\n") if out.exists() else 0) + rng.randint(5, 40))
        kept = [
            line
            for line in out.read_bytes().splitlines(keepends=True)
            if line.endswith(b"\n") and line.strip()
        ]
        with open(out, "ab") as damage:
            damage.write(rng.choice([b"\n", b"   \n", b"not json\n", foreign.encode()]))
    with open(out, "ab") as damage:
        damage.write(foreign.encode() + b"\n" + b'{"custom_id": "req-1", "outp')  # and a line torn by a kill
    subprocess.run(command, check=True, capture_output=True)
    final = out.read_bytes()
    records = [json.loads(line) for line in final.splitlines()]
    ids = [r["custom_id"] for r in records if r["custom_id"] != "other-job"]
    assert sorted(ids) == sorted(expected) and len(ids) == len(set(ids))
    assert {k: v for k, v in answers_of(records).items() if k != "other-job"} == expected
    damaged = out.with_name(out.name + ".damaged")
    aside = damaged.read_bytes() if damaged.exists() else b""
    assert all(line in final or line in aside for line in kept)  # no line the killed runs left was lost
    assert b"precious" in final


def test_a_last_line_cut_off_is_moved_aside_and_redone(tiny_pack, expected, tmp_path):
    job, out = tmp_path / "job.jsonl", tmp_path / "out.jsonl"
    write_job(job, 12, 24)
    assert main(["batch", str(tiny_pack), str(job), str(out)]) == 0
    lines = out.read_bytes().splitlines(keepends=True)
    cut = json.loads(lines[-1])["custom_id"]
    fragment = lines[-1][: len(lines[-1]) // 2]
    out.write_bytes(b"".join(lines[:-1]) + fragment)  # a kill in the middle of a write
    assert main(["batch", str(tiny_pack), str(job), str(out)]) == 0
    redone = answers(out)
    assert redone == {k: v for k, v in expected.items() if int(k.split("-")[1]) < 12}
    assert json.loads(out.read_bytes().splitlines()[-1])["custom_id"] == cut
    assert (tmp_path / "out.jsonl.damaged").read_bytes() == fragment + b"\n"  # kept, not dropped


def test_malformed_lines_become_error_records_and_the_job_goes_on(tiny_pack, tmp_path):
    job, out = tmp_path / "job.jsonl", tmp_path / "out.jsonl"
    job.write_text(
        "\n".join(
            [
                json.dumps({"prompt": "hello", "max_tokens": 4}),
                "{not json",
                json.dumps({"question": "no prompt here"}),
                json.dumps({"custom_id": "b", "url": "/v1/embeddings", "body": {}}),
                json.dumps({"custom_id": "c", "url": "/v1/chat/completions", "body": {"messages": []}}),
                json.dumps({"custom_id": "d", "prompt": "fine", "max_tokens": 0}),
                json.dumps({"custom_id": "e", "prompt": "fine too", "max_tokens": 4}),
            ]
        )
        + "\n"
    )
    assert main(["batch", str(tiny_pack), str(job), str(out)]) == 0
    records = {r["custom_id"]: r for r in map(json.loads, open(out))}
    assert set(records) == {"line-1", "line-2", "line-3", "b", "c", "d", "e"}
    assert "output" in records["line-1"] and "output" in records["e"]
    assert "not JSON" in records["line-2"]["error"] and "messages or prompt" in records["line-3"]["error"]
    assert records["b"]["response"]["status_code"] == 400 and records["c"]["response"]["status_code"] == 400
    assert "max_tokens" in records["d"]["error"]


def test_duplicate_custom_ids_are_one_error_naming_the_lines(tiny_pack, tmp_path, capsys):
    job = tmp_path / "job.jsonl"
    job.write_text("\n".join(json.dumps({"custom_id": c, "prompt": "x"}) for c in ("a", "b", "a")) + "\n")
    assert main(["batch", str(tiny_pack), str(job), str(tmp_path / "out.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "'a' on lines 1 and 3" in err and len(err.splitlines()) == 1


def _ray_processes() -> set[int]:
    done = subprocess.run(["pgrep", "-f", "raylet|gcs_server"], capture_output=True, text=True)
    return {int(pid) for pid in done.stdout.split()}


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_job_on_a_two_node_ray_cluster_spreads_and_gives_the_same_results(tiny_pack, expected, tmp_path):
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    from pipeshard.batch import run_batch_ray

    job, out = tmp_path / "job.jsonl", tmp_path / "out.jsonl"
    write_job(job, 200, 24)
    before = _ray_processes()
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 100 * 2**20}
    )
    try:
        cluster.add_node(num_cpus=1, object_store_memory=100 * 2**20)
        cluster.wait_for_nodes()
        summary = run_batch_ray(
            cluster.address, tiny_pack, job, out, "pack", 4, 256, {"threads": 1}, progress=False
        )
    finally:
        ray.shutdown()
        cluster.shutdown()
    assert summary.requests == 200 and summary.failed == 0
    assert answers(out) == expected
    assert len({json.loads(line)["metadata"]["node_id"] for line in open(out)}) == 2  # both nodes worked
    deadline = time.monotonic() + 10
    while _ray_processes() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _ray_processes() - before  # the cluster's processes are gone


def test_ray_without_the_extra_is_one_error_line(tiny_pack, tmp_path, monkeypatch, capsys):
    job = tmp_path / "job.jsonl"
    write_job(job, 2, 4)
    monkeypatch.setitem(sys.modules, "ray", None)  # as if pipeshard[ray] were not installed
    assert main(["batch", str(tiny_pack), str(job), str(tmp_path / "out.jsonl"), "--ray", "auto"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "pipeshard[ray]" in err
