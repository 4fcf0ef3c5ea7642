"""`pipeshard batch` given careless or hostile files: a wrong OUT is refused untouched, a damaged OUT loses no line,
every bad input line becomes its own error record, and a failed write leaves OUT whole."""

from __future__ import annotations

import errno
import json
import os
import tracemalloc

import pytest

from pipeshard.batch import MAX_LINE_BYTES, read_jobs
from pipeshard.cli import main


def write_lines(path, count: int) -> list[str]:
    """A job of `count` short prompts; their custom_ids."""
    ids = [f"q{i}" for i in range(count)]
    path.write_text(
        "".join(json.dumps({"custom_id": c, "prompt": f"say {c}", "max_tokens": 3}) + "\n" for c in ids)
    )
    return ids


def records(path) -> list[dict]:
    """Every line of a results file, each of which must be a JSON object."""
    return [json.loads(line) for line in path.read_bytes().splitlines(keepends=True)]


def error_line(capsys, *argv: str) -> str:
    status = main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and err[0].startswith("error:"), (status, err)
    return err[0]


@pytest.mark.parametrize(
    "kind", ["same path", "another path", "hard link", "symbolic link", "text", "other JSONL"]
)
def test_an_out_that_is_no_results_file_is_refused_and_left_untouched(tiny_pack, tmp_path, capsys, kind):
    job = tmp_path / "job.jsonl"
    write_lines(job, 2)
    (tmp_path / "sub").mkdir()
    out = {
        "same path": job,
        "another path": tmp_path / "sub" / ".." / "job.jsonl",
        "hard link": tmp_path / "linked.jsonl",
        "symbolic link": tmp_path / "results.jsonl",
        "text": tmp_path / "notes.txt",
        "other JSONL": tmp_path / "data.jsonl",
    }[kind]
    if kind == "hard link":
        os.link(job, out)
    elif kind == "symbolic link":
        out.symlink_to(tmp_path / "elsewhere.jsonl")
    elif kind == "text":
        out.write_text("my notes\nsecond line\n")
    elif kind == "other JSONL":
        out.write_text(json.dumps({"custom_id": "x", "prompt": "an input, not a result"}) + "\n")
    before = {path: path.read_bytes() for path in tmp_path.iterdir() if path.is_file()}
    line = error_line(capsys, "batch", str(tiny_pack), str(job), str(out))
    assert str(out) in line
    assert {path: path.read_bytes() for path in tmp_path.iterdir() if path.is_file()} == before
    assert not (tmp_path / "elsewhere.jsonl").exists()


def test_a_resumed_out_keeps_every_line_and_ends_with_each_id_once(tiny_pack, tmp_path, capsys):
    job, out = tmp_path / "job.jsonl", tmp_path / "out.jsonl"
    ids = write_lines(job, 6)
    assert main(["batch", str(tiny_pack), str(job), str(out)]) == 0
    done = out.read_bytes().splitlines(keepends=True)
    other = json.dumps({"custom_id": "other", "output": "from another job"}).encode() + b"\n"
    original = b"".join(
        [
            done[0],
            b"\n",
            done[1],
            b"a stray log line\n",
            other,
            b"   \n",
            done[2],
            done[3][: len(done[3]) // 2],
        ]
    )
    out.write_bytes(original)  # blank lines, stray text, another job's result and a last line cut by a kill
    capsys.readouterr()
    assert main(["batch", str(tiny_pack), str(job), str(out)]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "out.jsonl.damaged" in line]
    assert len(notes) == 1 and "moved 4 unreadable line(s)" in notes[0]
    results = records(out)  # OUT is JSONL again
    assert sorted(r["custom_id"] for r in results) == sorted([*ids, "other"])
    damaged = (tmp_path / "out.jsonl.damaged").read_bytes()
    assert damaged == b"\n" + b"a stray log line\n" + b"   \n" + done[3][: len(done[3]) // 2] + b"\n"
    kept = out.read_bytes()
    assert all(line in kept or line in damaged for line in original.splitlines(keepends=True))


def test_a_last_result_without_its_newline_gets_one_before_the_next(tiny_pack, tmp_path):
    job, out = tmp_path / "job.jsonl", tmp_path / "out.jsonl"
    ids = write_lines(job, 3)
    out.write_text(json.dumps({"custom_id": "q0", "output": "written by hand"}))  # no newline at the end
    assert main(["batch", str(tiny_pack), str(job), str(out)]) == 0
    results = records(out)
    assert results[0] == {"custom_id": "q0", "output": "written by hand"}
    assert sorted(r["custom_id"] for r in results) == ids
    assert not (tmp_path / "out.jsonl.damaged").exists()


def test_every_hostile_line_becomes_its_own_error_record_and_the_job_goes_on(tiny_pack, tmp_path, capsys):
    job, out = tmp_path / "job.jsonl", tmp_path / "out.jsonl"
    huge = b"a" * (MAX_LINE_BYTES + 1)
    job.write_bytes(
        b"\n".join(
            [
                json.dumps({"custom_id": "good", "prompt": "hello", "max_tokens": 3}).encode(),
                json.dumps({"custom_id": "seed", "prompt": "hello", "seed": -5}).encode(),
                b'{"custom_id": "bytes", "prompt": "caf\xe9 \xff"}',
                b'{"custom_id": "surrogate", "prompt": "\\ud800"}',
                b'{"custom_id": "deep", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
                b"[" * 5000 + b"]" * 5000,
                b'"just a string"',
                b'{"custom_id": "long", "prompt": "' + huge + b'"}',
                b'{"prompt": "' + huge + b'"}',
                json.dumps(
                    {"custom_id": "after", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
                ).encode(),
            ]
        )
        + b"\n"
    )
    assert main(["batch", str(tiny_pack), str(job), str(out)]) == 0
    found = {r["custom_id"]: r for r in records(out)}
    assert set(found) == {
        "good",
        "seed",
        "bytes",
        "surrogate",
        "deep",
        "line-6",
        "line-7",
        "long",
        "line-9",
        "after",
    }
    assert "output" in found["good"] and "output" in found["after"]
    assert "seed" in found["seed"]["error"]
    assert "not UTF-8" in found["bytes"]["error"]
    assert "surrogate" in found["surrogate"]["error"]
    assert "nested" in found["deep"]["error"] and "nested" in found["line-6"]["error"]
    assert "not a JSON object" in found["line-7"]["error"]
    assert "over 4194304 bytes" in found["long"]["error"] and "over" in found["line-9"]["error"]
    assert "10 requests (0 already done, 8 failed)" in capsys.readouterr().err


def test_a_50_mb_line_is_read_past_without_being_held(tmp_path):
    job = tmp_path / "job.jsonl"
    with open(job, "wb") as lines:
        lines.write(b'{"custom_id": "huge", "prompt": "')
        for _ in range(50):
            lines.write(b"a" * (1 << 20))
        lines.write(b'"}\n' + json.dumps({"custom_id": "next", "prompt": "hi"}).encode() + b"\n")
    tracemalloc.start()
    try:
        jobs = read_jobs(job)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [(j.custom_id, j.error is None) for j in jobs] == [("huge", False), ("next", True)]
    assert peak < 3 * MAX_LINE_BYTES, peak


def test_a_full_disk_is_one_error_line_and_out_ends_at_its_last_whole_result(
    tiny_pack, tmp_path, capsys, monkeypatch
):
    job, out = tmp_path / "job.jsonl", tmp_path / "out.jsonl"
    ids = write_lines(job, 8)
    real_write, results_written = os.write, []

    def disk_fills_after_three_results(descriptor: int, data) -> int:
        if not out.exists() or os.fstat(descriptor).st_ino != out.stat().st_ino:
            return real_write(descriptor, data)
        if len(results_written) == 3:
            real_write(descriptor, bytes(data[: len(data) // 2]))  # the kernel took part of the line
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        results_written.append(data)
        return real_write(descriptor, data)

    monkeypatch.setattr(os, "write", disk_fills_after_three_results)
    line = error_line(capsys, "batch", str(tiny_pack), str(job), "--parallel", "1", str(out))
    monkeypatch.undo()
    assert str(out) in line and os.strerror(errno.ENOSPC) in line
    assert len(records(out)) == 3 and out.read_bytes().endswith(b"\n")
    assert main(["batch", str(tiny_pack), str(job), str(out)]) == 0  # the same command again goes on
    assert sorted(r["custom_id"] for r in records(out)) == ids
