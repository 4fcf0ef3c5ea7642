"""Atomic writes: a file or folder appears complete under its final name, or not at all."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from pipeshard.core.errors import UserError


def sha256_file(path: Path, chunk_bytes: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def write_json_atomic(path: Path, document: object) -> None:
    """Write JSON to a temporary file beside `path`, fsync it, then rename over `path`."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(document, handle, indent=2)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_output_dir(out: Path, force: bool) -> Iterator[Path]:
    """Yield a staging folder beside `out`; on success it replaces `out`, on failure it is removed.

    An existing `out` is refused unless `force`; with `force` it is only replaced once the new
    content is complete, so an interrupted run never leaves a half-written folder behind.
    """
    out = check_output_dir(out, force)
    _remove_abandoned_staging(out)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-{os.getpid()}-", dir=out.parent))
    try:
        yield staging
        os.chmod(staging, 0o755)
        if out.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, trash / out.name)
            os.replace(staging, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def check_output_dir(out: Path, force: bool) -> Path:
    """Where an output folder will go, its parent made: refused if it exists (without `force`), is a file, or a
    file stands where a parent folder must be. Call it before the work, as `atomic_output_dir` does again."""
    out = Path(out).absolute()
    if out.exists() and not force:
        raise UserError(f"{out} already exists (use --force to replace it)")
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} exists and is not a folder")
    make_parent(out, f"cannot make {out}")
    return out


def make_parent(path: Path, what: str) -> None:
    """Make the folder `path` goes in; a file standing where a folder must be is a UserError starting `what`."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocking = path.parent
        while not blocking.exists():
            blocking = blocking.parent
        raise UserError(f"{what}: {blocking} is a file, not a folder") from None


def _remove_abandoned_staging(out: Path) -> None:
    """Staging folders beside `out` whose process is gone (killed before it could clean up)."""
    for staging in out.parent.glob(f".{out.name}.partial-*"):
        owner = staging.name[len(f".{out.name}.partial-") :].split("-", 1)[0]
        if owner.isdigit() and not _process_alive(int(owner)):
            shutil.rmtree(staging, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_json(path: Path, what: str) -> dict:
    """Load a JSON object from `path`; a missing or malformed file is a UserError naming it."""
    if not path.is_file():
        raise UserError(f"{path.parent} is not a {what} (no {path.name})")
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise UserError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(document, dict):
        raise UserError(f"{path} is not a JSON object")
    return document
