"""`pipeshard batch`: a JSONL job through the continuous-batching scheduler, resumable and lossless.

Input lines are the OpenAI Batch format (`custom_id`, `method`, `url` = /v1/chat/completions or /v1/completions,
`body`) or a plain form (`{"prompt": ...}` or `{"messages": [...]}`, other fields passed through, `custom_id`
optional: `line-N` by default). Each result is one line appended to OUT and flushed as its request finishes
(OpenAI's output format for the first form: `id`, `custom_id`, `response: {status_code, request_id, body}`,
`error`; the input's fields plus `output`, `finish_reason` and `usage` for the second). A line that cannot be
used (not UTF-8, not JSON, too long, too deep, a bad field) becomes an error record and the job goes on.

A rerun skips the custom_ids OUT already has, so a job killed at any moment loses only the requests in flight. OUT
must be a results file: not IN, not a link, and each of its JSON lines a result. Its lines that are not JSON (blank,
cut off by a kill) are moved to OUT.damaged, never dropped; a failed write is cut back to the last whole line.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from pipeshard.core.errors import UserError

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
MAX_LINE_BYTES = 4 << 20  # a longer input line is an error record, read past without being held
MAX_NESTING = 64  # JSON nesting a line may have (a request needs about six)
RESULT_FIELDS = ("response", "output", "error")  # a result line has a custom_id and one of these
_ID_PEEK_CHARS = 64 << 10
_PLAIN_CUSTOM_ID = re.compile(r'"custom_id"\s*:\s*"([^"\\\ufffd]{1,256})"')
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_UNREADABLE = object()


@dataclass
class Job:
    """One input line: its custom_id, whether it came in the OpenAI Batch form, its request, or why it is bad."""

    line: int
    custom_id: str
    openai_form: bool
    chat: bool = True
    body: dict = field(default_factory=dict)
    passthrough: dict = field(default_factory=dict)
    error: str | None = None


def read_jobs(path: Path) -> list[Job]:
    """Every line of IN as a job (unusable ones carry their error); duplicate custom_ids are refused. IN is read as
    bytes a line at a time, so neither a bad byte nor a huge line stops the job."""
    jobs, seen = [], {}
    try:
        with open(path, "rb") as lines:
            for number, line, whole in _numbered_lines(lines):
                if whole and not line.strip():
                    continue
                job = _job_of_line(number, line, whole)
                if job.custom_id in seen:
                    raise UserError(
                        f"{path}: custom_id {job.custom_id!r} on lines {seen[job.custom_id]} and {number}"
                    )
                seen[job.custom_id] = number
                jobs.append(job)
    except OSError as exc:
        raise UserError(f"{path} cannot be read ({exc.strerror})") from None
    return jobs


def _numbered_lines(lines: BinaryIO) -> Iterator[tuple[int, bytes, bool]]:
    """(number, line, whole) for each line; one over MAX_LINE_BYTES comes as its start with whole=False, its
    rest read past in pieces."""
    number = 0
    while line := lines.readline(MAX_LINE_BYTES + 1):
        number += 1
        whole = len(line) <= MAX_LINE_BYTES or line.endswith(b"\n")
        while not whole and (rest := lines.readline(1 << 20)) and not rest.endswith(b"\n"):
            pass
        yield number, line, whole


def _job_of_line(number: int, line: bytes, whole: bool) -> Job:
    """A line of IN as read: one too long or not UTF-8 is an error record, any other is parsed."""
    if not whole:
        error = f"line {number} is over {MAX_LINE_BYTES} bytes (not read)"
    else:
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            error = f"line {number} is not UTF-8 (byte {line[exc.start]:#04x} at column {exc.start + 1})"
        else:
            return _job(number, text)
    return Job(
        number, _peeked_id(number, line[:_ID_PEEK_CHARS].decode("utf-8", "replace")), False, error=error
    )


def _peeked_id(number: int, text: str) -> str:
    """The custom_id written plainly near the start of a line that cannot be parsed, else `line-N`."""
    found = _PLAIN_CUSTOM_ID.search(text, 0, _ID_PEEK_CHARS)
    return found.group(1) if found else f"line-{number}"


def _job(number: int, text: str) -> Job:
    try:
        record = json.loads(text)
        too_deep = _nesting(record) > MAX_NESTING
    except json.JSONDecodeError as exc:
        return Job(number, _peeked_id(number, text), False, error=f"line {number} is not JSON ({exc.msg})")
    except RecursionError:  # nested past Python's own limit
        too_deep = True
    if too_deep:
        error = f"line {number} is JSON nested more than {MAX_NESTING} deep"
        return Job(number, _peeked_id(number, text), False, error=error)
    if _SURROGATE_ESCAPE.search(text) and not _is_unicode(record):
        return Job(
            number,
            _peeked_id(number, text),
            False,
            error=f"line {number} has a lone surrogate escape (\\ud800-\\udfff) in a string: not Unicode text",
        )
    if not isinstance(record, dict):
        return Job(number, f"line-{number}", False, error=f"line {number} is not a JSON object")
    custom_id = record.get("custom_id", f"line-{number}")
    if not isinstance(custom_id, str) or not custom_id:
        return Job(
            number, f"line-{number}", False, error=f"line {number}: custom_id must be a non-empty string"
        )
    if "body" in record or "url" in record:
        url, body = record.get("url"), record.get("body")
        if url not in (CHAT_URL, COMPLETIONS_URL) or not isinstance(body, dict):
            return Job(
                number,
                custom_id,
                True,
                error=f"line {number}: url must be {CHAT_URL} or {COMPLETIONS_URL} with a JSON object body",
            )
        if record.get("method", "POST") != "POST":
            return Job(number, custom_id, True, error=f"line {number}: method must be POST")
        return Job(number, custom_id, True, chat=url == CHAT_URL, body=body)
    if "messages" in record or "prompt" in record:
        chat = "messages" in record
        from pipeshard.server import ANSWER_FIELDS, UNSUPPORTED_FIELDS

        # The request's fields; those the server cannot honour too, so that they are refused, not dropped.
        asked = ("messages", "prompt", *ANSWER_FIELDS, *UNSUPPORTED_FIELDS)
        body = {k: v for k, v in record.items() if k in asked}
        return Job(number, custom_id, False, chat=chat, body=body, passthrough=record)
    return Job(
        number, custom_id, False, error=f"line {number}: needs messages or prompt (or an OpenAI Batch body)"
    )


def _nesting(value) -> int:
    """How deep JSON containers nest in `value` (0 for a number or string), found without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return deepest


def _is_unicode(value) -> bool:
    """Whether every string in `value` can be written as UTF-8 (JSON's \\ud800 escapes make ones that cannot)."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def resume_output(source: Path, target: Path) -> set[str]:
    """The custom_ids OUT holds, once it is checked to be this job's results file. Its lines that are not JSON
    (blank, cut off by a kill, stray text) are moved to OUT.damaged, with one line on stderr saying how many."""
    _check_output_path(source, target)
    if not target.exists():
        return set()
    try:
        done, damaged = _scan_output(target)
        if damaged:
            aside = _move_damaged(target)
            print(
                f"{target}: moved {damaged} unreadable line(s) (blank, cut off or stray text) to {aside}",
                file=sys.stderr,
            )
    except OSError as exc:
        raise UserError(
            f"{target} cannot be read or rewritten ({exc.strerror}); it was left as it is"
        ) from None
    return done


def _check_output_path(source: Path, target: Path) -> None:
    if target.is_symlink():
        raise UserError(f"{target} is a symbolic link: give the results file itself")
    if not target.exists():
        return
    out, given = target.stat(), source.stat()
    if not stat.S_ISREG(out.st_mode):
        raise UserError(f"{target} is not a regular file")
    if (out.st_dev, out.st_ino) == (given.st_dev, given.st_ino):
        raise UserError(f"{target} is the input file {source}: give another file for the results")


def _scan_output(target: Path) -> tuple[set[str], int]:
    """OUT's custom_ids and how many lines are not JSON. A JSON line that is no result, or a file with no result and
    a whole line of text, is refused: OUT is then some other file, and it is left as it is."""
    done, damaged, text_line = set(), 0, None
    with open(target, "rb") as lines:
        for number, line in enumerate(lines, start=1):
            value = _parsed(line)
            if _is_result(value):
                done.add(value["custom_id"])
            elif value is not _UNREADABLE:
                raise UserError(
                    f"{target}: line {number} is JSON but no batch result (a custom_id and one of "
                    f"{', '.join(RESULT_FIELDS)}): is OUT the right file? It was left as it is"
                )
            else:
                damaged += 1
                cut_off = not line.endswith(b"\n") and line.startswith(b"{")
                if text_line is None and line.strip() and not cut_off:
                    text_line = number
    if not done and text_line is not None:
        raise UserError(
            f"{target} holds no batch result (line {text_line} is not JSON): is OUT the right file? "
            "It was left as it is"
        )
    return done, damaged


def _move_damaged(target: Path) -> Path:
    """Move OUT's lines that are not JSON to the end of OUT.damaged. Each file is replaced whole (written beside it,
    then renamed), OUT.damaged first: a crash leaves a line in both files at worst, never in neither."""
    aside = target.with_name(target.name + ".damaged")
    kept_path, moved_path = _temporary_beside(target), _temporary_beside(aside)
    try:
        with open(target, "rb") as lines, open(kept_path, "wb") as kept, open(moved_path, "wb") as moved:
            if aside.is_file():
                with open(aside, "rb") as earlier:
                    shutil.copyfileobj(earlier, moved)
            for line in lines:
                whole = line if line.endswith(b"\n") else line + b"\n"
                (kept if _is_result(_parsed(line)) else moved).write(whole)
            for written in (kept, moved):
                written.flush()
                os.fsync(written.fileno())
        shutil.copymode(target, kept_path)
        shutil.copymode(target, moved_path)
        os.replace(moved_path, aside)
        os.replace(kept_path, target)
    finally:
        for temporary in (kept_path, moved_path):
            temporary.unlink(missing_ok=True)
    return aside


def _temporary_beside(path: Path) -> Path:
    descriptor, name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(descriptor)
    return Path(name)


def _last_byte(path: Path) -> bytes:
    with open(path, "rb") as existing:
        existing.seek(-1, os.SEEK_END)
        return existing.read(1)


def _parsed(line: bytes):
    """A line of OUT as JSON, or _UNREADABLE."""
    try:
        return json.loads(line)
    except (ValueError, RecursionError):  # ValueError: not JSON, or not UTF-8
        return _UNREADABLE


def _is_result(value) -> bool:
    return (
        isinstance(value, dict)
        and isinstance(value.get("custom_id"), str)
        and any(name in value for name in RESULT_FIELDS)
    )


class ResultWriter:
    """Appends one JSON line per result in one unbuffered write, so a kill loses nothing written. A write that fails
    (disk full) is cut back to the last whole line and raised as a UserError."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
            self._end = os.lseek(self._descriptor, 0, os.SEEK_END)
            ends_a_line = self._end == 0 or _last_byte(path) == b"\n"
        except OSError as exc:
            raise UserError(f"{path} cannot be appended to ({exc.strerror})") from None
        if not ends_a_line:  # a last result written without its newline: the next starts a line of its own
            self._append(b"\n")

    def write(self, record: dict) -> None:
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        with self._lock:
            self._append(line)

    def _append(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._descriptor, view) :]
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(self._descriptor, self._end)
            raise UserError(
                f"{self.path}: a result could not be written ({exc.strerror}); the file ends at its last whole "
                "result: make room and run the same command again to go on"
            ) from None
        self._end += len(data)

    def close(self) -> None:
        os.close(self._descriptor)


@dataclass
class Summary:
    requests: int = 0
    skipped: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens the prefix cache gave
    wall_s: float = 0.0

    def line(self) -> str:
        rate = self.generated_tokens / self.wall_s if self.wall_s else 0.0
        reused = f" ({self.reused_tokens} of them from the prefix cache)" if self.reused_tokens else ""
        return (
            f"{self.requests} requests ({self.skipped} already done, {self.failed} failed), "
            f"{self.prompt_tokens} prompt{reused} + {self.generated_tokens} generated tokens in "
            f"{self.wall_s:.1f} s: {rate:.1f} generated tok/s"
        )


def result_record(
    job: Job,
    model: str,
    text: str | None,
    end,
    error: str | None,
    logprobs: dict | None = None,
    tool_calls: list[dict] | None = None,
) -> dict:
    """The output line of a job: OpenAI's batch output for its form, or the input's fields plus the answer (its
    `logprobs` object, as the API's choice has it, when the line asked for them; `tool_calls` when the answer is
    calls of the line's tools)."""
    from pipeshard.server import completion_document

    if job.openai_form:
        if error is not None:
            return {
                "id": f"batch_req_{uuid.uuid4().hex[:24]}",
                "custom_id": job.custom_id,
                "response": {
                    "status_code": 400,
                    "request_id": uuid.uuid4().hex,
                    "body": {"error": {"message": error, "type": "invalid_request_error"}},
                },
                "error": None,
            }
        identifier = ("chatcmpl-" if job.chat else "cmpl-") + uuid.uuid4().hex[:24]
        return {
            "id": f"batch_req_{uuid.uuid4().hex[:24]}",
            "custom_id": job.custom_id,
            "response": {
                "status_code": 200,
                "request_id": uuid.uuid4().hex,
                "body": completion_document(
                    job.chat, identifier, model, text, end, logprobs=logprobs, tool_calls=tool_calls
                ),
            },
            "error": None,
        }
    record = {**job.passthrough, "custom_id": job.custom_id}
    if error is not None:
        return {**record, "error": error}
    if tool_calls:
        return {
            **record,
            "output": None,
            "tool_calls": tool_calls,
            "finish_reason": "tool_calls",
            "usage": {"prompt_tokens": end.prompt_tokens, "completion_tokens": end.completion_tokens},
            **({"logprobs": logprobs} if logprobs is not None else {}),
        }
    return {
        **record,
        "output": text,
        "finish_reason": "length" if end.finish_reason == "length" else "stop",
        "usage": {"prompt_tokens": end.prompt_tokens, "completion_tokens": end.completion_tokens},
        **({"logprobs": logprobs} if logprobs is not None else {}),
    }


def run_jobs(
    engine,
    jobs: list[Job],
    model: str,
    parallel: int,
    default_max_tokens: int,
    on_record,
    prefix_cache_bytes: int = 0,
) -> None:
    """Every job through the engine's scheduler; `on_record(job, record, end)` as each finishes (`end`: its last
    event, None for a job refused before it ran). A job cancelled by an interruption gets no record. When
    `on_record` raises (OUT cannot take a result), nothing more is started or recorded and the error is raised
    here, on the caller's thread."""
    from pipeshard.logprobs import TokenTexts
    from pipeshard.runtime.scheduler import QueueFull
    from pipeshard.server import (
        Answer,
        RequestError,
        answer_constraint,
        check_fields,
        echoed_prompt,
        prompt_ids,
        request_tools,
        sampling_settings,
    )

    scheduler = engine.serve(parallel=parallel, queue_size=parallel, prefix_cache_bytes=prefix_cache_bytes)
    if (
        prefix_cache_bytes
    ):  # lines that start alike run one after another: each shared prefix is kept while in use
        jobs = sorted(jobs, key=_prompt_order)
    changed = threading.Condition()
    outstanding = 0  # submitted and not finished: at most the slots and as many waiting
    failures: list[Exception] = []
    texts = TokenTexts(engine.codec)

    def refused(job: Job, error: str) -> None:
        on_record(job, result_record(job, model, None, None, error), None)

    def sink_for(job: Job, answer: Answer):
        def sink(event) -> None:
            nonlocal outstanding
            answer.add(event)
            if event.finish_reason is None:
                return
            # a cancelled one (the job interrupted) is redone on a rerun
            if event.finish_reason != "cancelled" and not failures:
                error = event.error if event.finish_reason == "error" else None
                try:
                    record = result_record(
                        job, model, answer.text, event, error, answer.logprobs(), answer.tool_calls()
                    )
                    on_record(job, record, event)
                except Exception as exc:  # noqa: BLE001 - raised again on the caller's thread
                    failures.append(exc)
            with changed:
                outstanding -= 1
                changed.notify_all()

        return sink

    def room_or_failure() -> bool:
        return outstanding < 2 * parallel or bool(failures)

    for job in jobs:
        if failures:
            break
        if job.error is not None:
            refused(job, job.error)
            continue
        try:
            if not job.openai_form:  # the plain form's other fields are the caller's, passed through
                check_fields(job.body, job.chat)
            ids = prompt_ids(engine.codec, job.body, job.chat, scheduler.step.vocab_size)
            settings = sampling_settings(
                {"temperature": 0, **job.body}, default_max_tokens, job.chat if job.openai_form else None
            )
            answer = Answer(
                texts,
                job.chat,
                ids,
                echoed_prompt(job.body, ids, engine.codec),
                settings,
                request_tools(job.body) if job.chat else None,
            )
            constraint = answer_constraint(job.body, engine.codec, scheduler.step.vocab_size)
            if settings.seed is not None and settings.seed < 0:
                raise RequestError("'seed' must be a non-negative integer", param="seed")
        except (RequestError, UserError) as exc:
            refused(job, f"line {job.line}: {exc}")
            continue
        with changed:
            changed.wait_for(room_or_failure)
            if failures:
                break
            outstanding += 1
        while True:
            try:
                scheduler.submit(ids, settings, sink=sink_for(job, answer), constraint=constraint)
                break
            except QueueFull:
                time.sleep(0.01)
            except UserError as exc:
                with changed:
                    outstanding -= 1
                refused(job, f"line {job.line}: {exc}")
                break
    with changed:
        changed.wait_for(lambda: outstanding == 0 or failures)
    if failures:
        raise failures[0]


def _prompt_order(job: Job) -> str:
    """A job's place when lines are ordered to share prefixes: its messages' or prompt's text (bad lines first)."""
    prompt = job.body.get("messages", job.body.get("prompt"))
    return "" if job.error is not None else json.dumps(prompt, ensure_ascii=False)


def run_batch(
    engine,
    source: Path,
    target: Path,
    model: str,
    parallel: int,
    default_max_tokens: int,
    progress: bool = True,
    prefix_cache_bytes: int = 0,
) -> Summary:
    """Run every job of `source` not yet in `target`, appending results as they finish (`prefix_cache_bytes`: the
    prompt prefixes' KV kept across lines)."""
    started = time.perf_counter()
    jobs = read_jobs(source)
    done = resume_output(source, target)
    pending = [job for job in jobs if job.custom_id not in done]
    summary = Summary(requests=len(jobs), skipped=len(jobs) - len(pending))
    writer = ResultWriter(target)
    bar = _progress(len(jobs), summary.skipped) if progress else None
    lock = threading.Lock()

    def on_record(job: Job, record: dict, end) -> None:
        writer.write(record)
        with lock:
            _count(summary, record, end)
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"{summary.generated_tokens / (time.perf_counter() - started):.1f} tok/s")

    try:
        run_jobs(engine, pending, model, parallel, default_max_tokens, on_record, prefix_cache_bytes)
        cache = engine.scheduler.prefix_cache
        summary.reused_tokens = cache.reused_tokens if cache is not None else 0
    finally:
        engine.scheduler.close()
        writer.close()
        if bar is not None:
            bar.close()
    summary.wall_s = time.perf_counter() - started
    return summary


def _count(summary: Summary, record: dict, end) -> None:
    if (
        record.get("error")
        or record.get("response", {}).get("status_code", 200) != 200
        or (end is not None and end.finish_reason == "error")
    ):
        summary.failed += 1
    if end is not None:
        summary.prompt_tokens += end.prompt_tokens
        summary.generated_tokens += end.completion_tokens


# How long a Ray job waits for its workers (one per node, each loading the pack) before it gives up.
ACTOR_START_LIMIT_S = 300


class RayWorker:
    """A Ray Data actor: loads the pack once on its node and runs batches of job lines through its scheduler."""

    def __init__(
        self,
        pack: str,
        load_options: dict,
        model: str,
        parallel: int,
        default_max_tokens: int,
        prefix_cache_bytes: int = 0,
    ) -> None:
        import ray

        import pipeshard

        self.engine = pipeshard.load(pack, **load_options)
        self.model, self.parallel, self.default_max_tokens = model, parallel, default_max_tokens
        self.node_id = ray.get_runtime_context().get_node_id()
        self.prefix_cache_bytes = prefix_cache_bytes

    def __call__(self, batch: dict) -> dict:
        jobs = [
            _job(int(number), str(text)) for number, text in zip(batch["line"], batch["text"], strict=True)
        ]
        records: list[str] = []
        lock = threading.Lock()

        def on_record(job: Job, record: dict, end) -> None:
            record["metadata"] = {
                "node_id": self.node_id,
                "tokens": [end.prompt_tokens, end.completion_tokens] if end is not None else [0, 0],
            }
            with lock:
                records.append(json.dumps(record, ensure_ascii=False))

        run_jobs(
            self.engine,
            jobs,
            self.model,
            self.parallel,
            self.default_max_tokens,
            on_record,
            self.prefix_cache_bytes,
        )
        return {"record": records}


def run_batch_ray(
    address: str,
    pack: Path,
    source: Path,
    target: Path,
    model: str,
    parallel: int,
    default_max_tokens: int,
    load_options: dict,
    progress: bool = True,
    prefix_cache_bytes: int = 0,
) -> Summary:
    """The same job on a Ray cluster: Ray Data spreads the pending lines over one actor per node (each loads the
    pack once and runs its scheduler); the driver appends the results to `target` as batches come back."""
    try:
        import ray
    except ImportError:
        raise UserError("--ray needs Ray Data: pip install 'pipeshard[ray]'") from None
    started = time.perf_counter()
    jobs = read_jobs(source)
    done = resume_output(source, target)
    pending = [job for job in jobs if job.custom_id not in done]
    summary = Summary(requests=len(jobs), skipped=len(jobs) - len(pending))
    if not pending:
        return summary
    owns_connection = not ray.is_initialized()
    if owns_connection:
        try:
            ray.init(address=address, log_to_driver=False, include_dashboard=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise UserError(
                f"--ray {address}: no Ray cluster to join there ({str(exc).splitlines()[0][:200]}); "
                "start one with `ray start --head`, or give its address"
            ) from None
    writer = ResultWriter(target)
    bar = _progress(len(jobs), summary.skipped) if progress else None

    def append(record: dict) -> None:
        writer.write(record)
        prompt_tokens, completion_tokens = record["metadata"]["tokens"]
        summary.prompt_tokens += prompt_tokens
        summary.generated_tokens += completion_tokens
        _count(summary, record, None)
        if bar is not None:
            bar.update(1)

    try:
        for job in pending:  # a line refused as it was read is answered here, not sent to the cluster
            if job.error is not None:
                append({**result_record(job, model, None, None, job.error), "metadata": _NO_NODE})
        rows = _rows_to_send(source, {job.line for job in pending if job.error is None})
        if rows:
            nodes = [node for node in ray.nodes() if node["Alive"]]
            # Each actor takes a whole node's cores (its engine uses them all), so there is one per node.
            cores = min(node["Resources"].get("CPU", 1.0) for node in nodes)
            # Ray Data waits forever for actors by default; a cluster that cannot place one is an error instead.
            ray.data.DataContext.get_current().wait_for_min_actors_s = ACTOR_START_LIMIT_S
            results = ray.data.from_items(rows).map_batches(
                RayWorker,
                fn_constructor_args=(
                    str(pack),
                    load_options,
                    model,
                    parallel,
                    default_max_tokens,
                    prefix_cache_bytes,
                ),
                batch_size=4 * parallel,
                num_cpus=cores,
                compute=ray.data.ActorPoolStrategy(size=len(nodes)),
            )
            try:
                for batch in results.iter_batches(batch_size=None):
                    for line in batch["record"]:
                        append(json.loads(line))
            except ray.exceptions.GetTimeoutError:
                raise UserError(
                    f"--ray {address}: the cluster started no worker within {ACTOR_START_LIMIT_S} s "
                    f"({len(nodes)} wanted, {cores:g} CPUs each); the lines done so far are kept in {target}"
                ) from None
    finally:
        writer.close()
        if bar is not None:
            bar.close()
        if owns_connection:
            ray.shutdown()
    summary.wall_s = time.perf_counter() - started
    return summary


_NO_NODE = {"node_id": None, "tokens": [0, 0]}


def _rows_to_send(source: Path, line_numbers: set[int]) -> list[dict]:
    """The given lines of IN (ones that read as jobs: whole and UTF-8), as Ray Data rows."""
    with open(source, "rb") as lines:
        return [
            {"line": number, "text": line.decode("utf-8")}
            for number, line, _ in _numbered_lines(lines)
            if number in line_numbers
        ]


def _progress(total: int, already: int):
    from tqdm import tqdm

    return tqdm(
        total=total,
        initial=already,
        unit="req",
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
        smoothing=0.1,
    )
