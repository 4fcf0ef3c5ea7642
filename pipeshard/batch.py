"""`pipeshard batch`: a JSONL job through the continuous-batching scheduler, resumable and lossless.

Input lines are the OpenAI Batch format (`custom_id`, `method`, `url` = /v1/chat/completions or /v1/completions,
`body`) or a plain form (`{"prompt": ...}` or `{"messages": [...]}`, other fields passed through, `custom_id`
optional: `line-N` by default). Each result is one line appended to OUT and flushed as its request finishes
(OpenAI's output format for the first form: `id`, `custom_id`, `response: {status_code, request_id, body}`,
`error`; the input's fields plus `output`, `finish_reason` and `usage` for the second). A rerun skips the
custom_ids OUT already has, so a job killed at any moment loses only the requests in flight; a last line cut off
by the kill is dropped and redone.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from pipeshard.core.errors import UserError

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"


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
    """Every line of IN as a job (malformed ones carry their error); duplicate custom_ids are refused."""
    jobs, seen = [], {}
    with open(path, encoding="utf-8") as lines:
        for number, text in enumerate(lines, start=1):
            if not text.strip():
                continue
            job = _job(number, text)
            if job.custom_id in seen:
                raise UserError(
                    f"{path}: custom_id {job.custom_id!r} on lines {seen[job.custom_id]} and {number}"
                )
            seen[job.custom_id] = number
            jobs.append(job)
    return jobs


def _job(number: int, text: str) -> Job:
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        return Job(number, f"line-{number}", False, error=f"line {number} is not JSON ({exc.msg})")
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
        from pipeshard.server import SAMPLING_FIELDS

        body = {k: v for k, v in record.items() if k in ("messages", "prompt", *SAMPLING_FIELDS)}
        return Job(number, custom_id, False, chat=chat, body=body, passthrough=record)
    return Job(
        number, custom_id, False, error=f"line {number}: needs messages or prompt (or an OpenAI Batch body)"
    )


def finished_ids(path: Path) -> set[str]:
    """The custom_ids OUT holds; a last line cut off mid-write (no newline, or not JSON) is removed first."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    good_end, done = 0, set()
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        try:
            done.add(json.loads(line)["custom_id"])
        except (json.JSONDecodeError, KeyError, TypeError):
            break
        good_end += len(line)
    if good_end != len(data):
        with open(path, "r+b") as out:
            out.truncate(good_end)
    return done


class ResultWriter:
    """Appends one JSON line per result, flushed to the OS at once (a kill then loses nothing written)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, record: dict) -> None:
        line = json.dumps(record, ensure_ascii=False) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        self._file.close()


@dataclass
class Summary:
    requests: int = 0
    skipped: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    wall_s: float = 0.0

    def line(self) -> str:
        rate = self.generated_tokens / self.wall_s if self.wall_s else 0.0
        return (
            f"{self.requests} requests ({self.skipped} already done, {self.failed} failed), "
            f"{self.prompt_tokens} prompt + {self.generated_tokens} generated tokens in {self.wall_s:.1f} s: "
            f"{rate:.1f} generated tok/s"
        )


def result_record(job: Job, model: str, text: str | None, end, error: str | None) -> dict:
    """The output line of a job: OpenAI's batch output for its form, or the input's fields plus the answer."""
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
                "body": completion_document(job.chat, identifier, model, text, end),
            },
            "error": None,
        }
    record = {**job.passthrough, "custom_id": job.custom_id}
    if error is not None:
        return {**record, "error": error}
    return {
        **record,
        "output": text,
        "finish_reason": "length" if end.finish_reason == "length" else "stop",
        "usage": {"prompt_tokens": end.prompt_tokens, "completion_tokens": end.completion_tokens},
    }


def run_jobs(engine, jobs: list[Job], model: str, parallel: int, default_max_tokens: int, on_record) -> None:
    """Every job through the engine's scheduler; `on_record(job, record, end)` as each finishes (`end`: its last
    event, None for a job refused before it ran). A job cancelled by an interruption gets no record."""
    from pipeshard.runtime.scheduler import QueueFull
    from pipeshard.server import RequestError, prompt_ids, sampling_settings

    scheduler = engine.serve(parallel=parallel, queue_size=parallel)
    in_flight = threading.Semaphore(2 * parallel)  # the slots and as many waiting
    finished = threading.Condition()
    outstanding = [0]

    def refused(job: Job, error: str) -> None:
        on_record(job, result_record(job, model, None, None, error), None)

    def sink_for(job: Job):
        pieces: list[str] = []

        def sink(event) -> None:
            pieces.append(event.text)
            if event.finish_reason is None:
                return
            if (
                event.finish_reason != "cancelled"
            ):  # a cancelled one (the job interrupted) is redone on a rerun
                error = event.error if event.finish_reason == "error" else None
                on_record(job, result_record(job, model, "".join(pieces), event, error), event)
            in_flight.release()
            with finished:
                outstanding[0] -= 1
                finished.notify_all()

        return sink

    for job in jobs:
        if job.error is not None:
            refused(job, job.error)
            continue
        try:
            ids = prompt_ids(engine.codec, job.body, job.chat, scheduler.step.vocab_size)
            settings = sampling_settings({"temperature": 0, **job.body}, default_max_tokens)
        except (RequestError, UserError) as exc:
            refused(job, f"line {job.line}: {exc}")
            continue
        in_flight.acquire()
        with finished:
            outstanding[0] += 1
        while True:
            try:
                scheduler.submit(ids, settings, sink=sink_for(job))
                break
            except QueueFull:
                time.sleep(0.01)
            except UserError as exc:
                in_flight.release()
                with finished:
                    outstanding[0] -= 1
                refused(job, f"line {job.line}: {exc}")
                break
    with finished:
        finished.wait_for(lambda: outstanding[0] == 0)


def run_batch(
    engine,
    source: Path,
    target: Path,
    model: str,
    parallel: int,
    default_max_tokens: int,
    progress: bool = True,
) -> Summary:
    """Run every job of `source` not yet in `target`, appending results as they finish."""
    started = time.perf_counter()
    jobs = read_jobs(source)
    done = finished_ids(target)
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
        run_jobs(engine, pending, model, parallel, default_max_tokens, on_record)
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


class RayWorker:
    """A Ray Data actor: loads the pack once on its node and runs batches of job lines through its scheduler."""

    def __init__(
        self, pack: str, load_options: dict, model: str, parallel: int, default_max_tokens: int
    ) -> None:
        import ray

        import pipeshard

        self.engine = pipeshard.load(pack, **load_options)
        self.model, self.parallel, self.default_max_tokens = model, parallel, default_max_tokens
        self.node_id = ray.get_runtime_context().get_node_id()

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

        run_jobs(self.engine, jobs, self.model, self.parallel, self.default_max_tokens, on_record)
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
) -> Summary:
    """The same job on a Ray cluster: Ray Data spreads the pending lines over one actor per node (each loads the
    pack once and runs its scheduler); the driver appends the results to `target` as batches come back."""
    try:
        import ray
    except ImportError:
        raise UserError("--ray needs Ray Data: pip install 'pipeshard[ray]'") from None
    started = time.perf_counter()
    jobs = read_jobs(source)
    done = finished_ids(target)
    texts = Path(source).read_text(encoding="utf-8").splitlines()
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
    try:
        nodes = [node for node in ray.nodes() if node["Alive"]]
        # Each actor takes a whole node's cores (its engine uses them all), so there is one per node.
        cores = min(node["Resources"].get("CPU", 1.0) for node in nodes)
        rows = ray.data.from_items([{"line": job.line, "text": texts[job.line - 1]} for job in pending])
        results = rows.map_batches(
            RayWorker,
            fn_constructor_args=(str(pack), load_options, model, parallel, default_max_tokens),
            batch_size=4 * parallel,
            num_cpus=cores,
            compute=ray.data.ActorPoolStrategy(size=len(nodes)),
        )
        for batch in results.iter_batches(batch_size=None):
            for line in batch["record"]:
                record = json.loads(line)
                writer.write(record)
                prompt_tokens, completion_tokens = record["metadata"]["tokens"]
                summary.prompt_tokens += prompt_tokens
                summary.generated_tokens += completion_tokens
                _count(summary, record, None)
                if bar is not None:
                    bar.update(1)
    finally:
        writer.close()
        if bar is not None:
            bar.close()
        if owns_connection:
            ray.shutdown()
    summary.wall_s = time.perf_counter() - started
    return summary


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
