"""The profile DB (docs/profile-db.md): one JSON file of a machine's measured (or specified) rates. Loaders check
the schema, every field the planner reads and that no field is unknown (a misspelt one would silently fall back
to a default); each problem is one UserError naming the file and the field."""

from __future__ import annotations

from pipeshard.formats.fields import Fields

PROFILE_SCHEMA_VERSION = 1
RATE_TABLE_FIELDS = ("M", "K", "N", "seconds", "gflops")
TOP_FIELDS = ("schema_version", "source", "created", "fingerprint", "fingerprint_id", "plan", "cpu", "device",
              "link", "contention", "pack_timings", "name", "description", "spec")  # fmt: skip
THREAD_FIELDS = ("matmul", "memory_read_gbps", "weight_read_gbps", "memory_copy_gbps", "attention", "hop_us",
                 "op_us", "under_copy_load")  # fmt: skip
DEVICE_FIELDS = ("kind", "name", "note", "memory_bytes", "ep_overhead_bytes", "matmul", "attention", "launch_us",
                 "memory_read_gbps")  # fmt: skip
DEVICE_KINDS = ("cuda", "sim", "spec")
LINK_FIELDS = ("kind", "name", "h2d", "d2h", "under_cpu_load")
FINGERPRINT_FIELDS = ("cpu_model", "logical_cpus", "physical_cores", "ram_bytes", "gpu", "gpu_driver", "onnxruntime",
                      "pipeshard", "platform")  # fmt: skip
ATTENTION_FIELDS = ("T", "C", "heads", "head_dim", "seconds", "gflops")
CONTENTION_FIELDS = ("cpu_matmul_slowdown_under_copy", "copy_slowdown_under_cpu_matmul")


def validate(document: object, where: str) -> dict:
    """Check a DB against schema 1 and return it; a violation is a UserError naming the file and the field."""
    fields = Fields(document, where)
    fields.schema(PROFILE_SCHEMA_VERSION, "measure again with `pipeshard profile`")
    fields.str("source", choices=("measured", "spec"))
    fields.str("created")
    fingerprint = fields.object("fingerprint")
    for name in FINGERPRINT_FIELDS:
        fingerprint.raw(name, None)
    fingerprint.done()
    fields.str("fingerprint_id")
    fields.object("plan", {}).done(ignore=("tiers", "shapes", "dtypes"))  # what the profile measured
    cpu = fields.object("cpu")
    cpu.int("physical_cores", 1, minimum=1)
    threads = cpu.object("threads")
    if not threads.document:
        threads.fail("is empty")
    for count in list(threads.document):
        if not count.isdigit() or int(count) < 1:
            threads.fail("must be keyed by thread counts", count)
        rates = threads.object(count)
        _rate_table(rates.object("matmul"))
        rates.float("memory_read_gbps")
        rates.float("hop_us")
        for row in rates.objects("attention"):
            for name in ATTENTION_FIELDS:
                row.float(name)
            row.done()
        rates.done(ignore=THREAD_FIELDS)
    cpu.done()
    device = fields.object("device")
    device.str("kind")
    _rate_table(device.object("matmul", {}))
    device.done(ignore=DEVICE_FIELDS)
    link = fields.object("link")
    for direction in ("h2d", "d2h"):
        rows = link.objects(direction)
        if not rows:
            link.fail("must list {bytes, gbps} rows", direction)
        for row in rows:
            row.int("bytes", minimum=1)
            row.float("gbps")
            row.bool("pinned", False)
            row.done()
    link.done(ignore=LINK_FIELDS)
    fields.object("contention").done(ignore=CONTENTION_FIELDS)
    fields.done(ignore=TOP_FIELDS)
    return document


def _rate_table(table: Fields) -> None:
    """dtype -> rows of measured matrix products."""
    for dtype in list(table.document):
        for row in table.objects(dtype):
            for name in RATE_TABLE_FIELDS:
                row.float(name)
            row.done()
