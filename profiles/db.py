"""The profile DB: one JSON file of measured (or specified) machine rates, schema_version 1.

Layout (docs/profile-db.md):
  fingerprint / fingerprint_id  which machine and software measured it
  source                        "measured" or "spec" (built from public specifications)
  cpu.threads[N]                rates of the CPU EP with N intra-op threads, idle and under copy load
  device                        the accelerator: "cuda" (measured on the CUDA EP), "sim" or a spec GPU
  link                          host<->device copies by size (PCIe, or the sim device's memcpy)
  contention                    slowdown factors when CPU compute and copies overlap
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from datetime import UTC, datetime
from importlib.resources import files
from pathlib import Path

from pipeshard.core.errors import UserError
from pipeshard.core.fsutil import read_json, write_json_atomic
from pipeshard.core.version import __version__
from pipeshard.formats.profile_db import ProfileDb

log = logging.getLogger(__name__)
MAX_DB_BYTES = 200 * 1024
REFERENCE_PROFILES = ("laptop-8gb", "desktop-24gb", "laptop-4gb", "desktop-rtx5090")
STALE_AFTER_DAYS = 180


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def physical_cores() -> int:
    """Physical cores (hyper-threads counted once), falling back to logical CPUs."""
    try:
        pairs = set()
        core = physical = None
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("physical id"):
                physical = line.split(":")[1].strip()
            elif line.startswith("core id"):
                core = line.split(":")[1].strip()
                pairs.add((physical, core))
        if pairs:
            return min(len(pairs), os.cpu_count() or len(pairs))
    except OSError:
        pass
    return os.cpu_count() or 1


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def machine_fingerprint(gpu: dict | None = None) -> dict:
    """What identifies the machine and the software that measured it."""
    import onnxruntime

    return {
        "cpu_model": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "physical_cores": physical_cores(),
        "ram_bytes": _ram_bytes(),
        "gpu": (gpu or {}).get("name", "none"),
        "gpu_driver": (gpu or {}).get("driver", "none"),
        "onnxruntime": onnxruntime.__version__,
        "pipeshard": __version__,
        "platform": platform.platform(),
    }


def fingerprint_id(fingerprint: dict) -> str:
    """A short stable hash of the hardware part of a fingerprint (software versions excluded)."""
    hardware = {
        k: fingerprint.get(k) for k in ("cpu_model", "logical_cpus", "ram_bytes", "gpu", "gpu_driver")
    }
    return hashlib.sha256(json.dumps(hardware, sort_keys=True).encode()).hexdigest()[:12]


def default_profile_path(fingerprint: dict) -> Path:
    """The user's cache dir, keyed by fingerprint."""
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("pipeshard")) / "profiles" / f"{fingerprint_id(fingerprint)}.json"


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def save_profile(document: dict, path: Path) -> ProfileDb:
    """Validate and write atomically; refuse a DB over the size limit. Returns the DB as read back."""
    profile = ProfileDb.from_json(document, str(path))
    text = json.dumps(document, separators=(",", ":"))
    if len(text) > MAX_DB_BYTES:
        raise ValueError(f"profile DB is {len(text)} bytes, over the {MAX_DB_BYTES} byte limit")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, document)
    return profile


def reference_profile_path(name: str) -> Path:
    return Path(str(files("pipeshard.profiles") / f"{name}.json"))


def load_profile(name_or_path: str | Path, check_machine: bool = True) -> ProfileDb:
    """Load a DB by reference name or path; warn when it is stale or from another machine."""
    if str(name_or_path) in REFERENCE_PROFILES:
        path = reference_profile_path(str(name_or_path))
    else:
        path = Path(name_or_path)
        if not path.exists():
            raise UserError(
                f"unknown profile {str(name_or_path)!r}: not a file, and not one of the reference "
                f"profiles ({', '.join(REFERENCE_PROFILES)})"
            )
    profile = ProfileDb.from_json(read_json(path, "profile DB"), str(path))
    if check_machine and profile.source == "measured":
        for warning in staleness(profile):
            log.warning("warning: %s: %s", path, warning)
    return profile


def staleness(profile: ProfileDb) -> list[str]:
    """Why a measured DB may not describe this machine and software any more."""
    warnings = []
    here = machine_fingerprint()
    measured_on = profile.fingerprint
    if profile.fingerprint_id != fingerprint_id(here) and measured_on.cpu_model != here["cpu_model"]:
        warnings.append(
            f"measured on another machine ({measured_on.cpu_model}); plans made from it may not fit this one"
        )
    if measured_on.onnxruntime != here["onnxruntime"]:
        warnings.append(
            f"measured with onnxruntime {measured_on.onnxruntime}, "
            f"this is {here['onnxruntime']}: re-run `pipeshard profile`"
        )
    try:
        age = datetime.now(UTC) - datetime.fromisoformat(profile.created)
        if age.days > STALE_AFTER_DAYS:
            warnings.append(f"{age.days} days old: re-run `pipeshard profile`")
    except ValueError:
        warnings.append("has an unreadable 'created' date")
    return warnings
