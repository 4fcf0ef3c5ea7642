"""The profile DB (docs/profile-db.md) as typed records: one JSON file of a machine's measured (or specified) rates.
`ProfileDb.from_json` checks the schema, every field's type and range and that no field is unknown (a misspelt one
would silently fall back to a default); each problem is one UserError naming the file and the field. `to_json`
gives the document back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeshard.formats.fields import Fields

PROFILE_SCHEMA_VERSION = 1
SOURCES = ("measured", "spec")
FINGERPRINT_FIELDS = ("cpu_model", "logical_cpus", "physical_cores", "ram_bytes", "gpu", "gpu_driver", "onnxruntime",
                      "pipeshard", "platform")  # fmt: skip
FINGERPRINT_COUNTS = ("logical_cpus", "physical_cores", "ram_bytes")
PACK_PLACEMENTS = ("cpu", "device", "streamed")


QUANTIZED_MATMUL = "q4"  # the matmul table of 4-bit block-quantized products (MatMulNBits), by its dtype key


def quantized_rows(matmul: dict[str, tuple[MatmulRow, ...]]) -> tuple[MatmulRow, ...]:
    """A matmul table's rows of 4-bit block-quantized products (none where it has no such rows)."""
    return matmul.get(QUANTIZED_MATMUL, ())


def _without_none(document: dict) -> dict:
    """A record's JSON: its absent optional fields left out."""
    return {name: value for name, value in document.items() if value is not None}


def _thread_counts(fields: Fields) -> dict[int, str]:
    """The keys of an object keyed by intra-op thread counts ("1", "2", ...), by count."""
    for key in fields.document:
        if not key.isdigit() or int(key) < 1:
            fields.fail("must be keyed by thread counts", key)
    return {int(key): key for key in fields.document}


@dataclass(frozen=True)
class MatmulRow:
    """One timed MatMul: X[M, K] @ W[K, N] took `seconds`, i.e. `gflops`."""

    M: int
    K: int
    N: int
    seconds: float
    gflops: float

    @classmethod
    def from_json(cls, fields: Fields) -> MatmulRow:
        row = cls(
            fields.int("M", minimum=1),
            fields.int("K", minimum=1),
            fields.int("N", minimum=1),
            fields.float("seconds"),
            fields.float("gflops"),
        )
        fields.done()
        return row

    def to_json(self) -> dict:
        return {"M": self.M, "K": self.K, "N": self.N, "seconds": self.seconds, "gflops": self.gflops}


def _rate_tables(fields: Fields) -> dict[str, tuple[MatmulRow, ...]]:
    """dtype -> rows of measured matrix products."""
    return {
        dtype: tuple(MatmulRow.from_json(row) for row in fields.objects(dtype))
        for dtype in list(fields.document)
    }


def _rate_tables_json(tables: dict[str, tuple[MatmulRow, ...]]) -> dict:
    return {dtype: [row.to_json() for row in rows] for dtype, rows in tables.items()}


@dataclass(frozen=True)
class AttentionRow:
    """One timed attention: T new tokens over a context of C, `heads` query heads sharing `kv_heads` KV heads."""

    T: int
    C: int
    heads: int
    kv_heads: int
    head_dim: int
    seconds: float
    gflops: float

    @classmethod
    def from_json(cls, fields: Fields) -> AttentionRow:
        heads = fields.int("heads", minimum=1)
        row = cls(
            T=fields.int("T", minimum=1),
            C=fields.int("C", minimum=1),
            heads=heads,
            kv_heads=fields.int("kv_heads", heads, minimum=1, maximum=heads),  # before kv_heads: as many
            head_dim=fields.int("head_dim", minimum=1),
            seconds=fields.float("seconds"),
            gflops=fields.float("gflops"),
        )
        if heads % row.kv_heads:
            fields.fail(f"is {row.kv_heads}: it must divide heads ({heads})", "kv_heads")
        fields.done()
        return row

    @property
    def queries_per_kv_head(self) -> float:
        return self.heads / self.kv_heads

    def to_json(self) -> dict:
        return {
            "T": self.T,
            "C": self.C,
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "seconds": self.seconds,
            "gflops": self.gflops,
        }


def _attention_rows(fields: Fields, name: str, default: Any = ...) -> tuple[AttentionRow, ...]:
    """A table of attention rows, all measured at one head ratio (the estimator scales from it)."""
    rows = tuple(AttentionRow.from_json(row) for row in fields.objects(name, default))
    if len({row.queries_per_kv_head for row in rows}) > 1:
        fields.fail("mixes head ratios (heads / kv_heads): measure a table at one", name)
    return rows


@dataclass(frozen=True)
class UnderCopyLoad:
    """The CPU's MatMul rates and read rate while a copy runs beside them."""

    matmul: dict[str, tuple[MatmulRow, ...]]
    memory_read_gbps: float

    @classmethod
    def from_json(cls, fields: Fields) -> UnderCopyLoad:
        load = cls(_rate_tables(fields.object("matmul")), fields.float("memory_read_gbps"))
        fields.done()
        return load

    def to_json(self) -> dict:
        return {"matmul": _rate_tables_json(self.matmul), "memory_read_gbps": self.memory_read_gbps}


@dataclass(frozen=True)
class CpuRates:
    """The CPU EP's rates at one intra-op thread count."""

    matmul: dict[str, tuple[MatmulRow, ...]]  # by dtype
    memory_read_gbps: float  # M=1 MatMul streaming a large weight: the decode roofline
    attention: tuple[AttentionRow, ...]
    hop_us: float  # one session run
    under_copy_load: UnderCopyLoad
    op_us: float = 0.0  # one more op inside a session
    weight_read_gbps: dict[str, float] | None = None  # pipeshard's own products over stored dtypes
    memory_copy_gbps: float | None = None

    @classmethod
    def from_json(cls, fields: Fields) -> CpuRates:
        rates = cls(
            matmul=_rate_tables(fields.object("matmul")),
            memory_read_gbps=fields.float("memory_read_gbps"),
            attention=_attention_rows(fields, "attention"),
            hop_us=fields.float("hop_us"),
            under_copy_load=UnderCopyLoad.from_json(fields.object("under_copy_load")),
            op_us=fields.float("op_us", 0.0),
            weight_read_gbps=fields.number_map("weight_read_gbps", None, minimum=0.0),
            memory_copy_gbps=fields.float("memory_copy_gbps", None),
        )
        fields.done()
        return rates

    def to_json(self) -> dict:
        return _without_none(
            {
                "matmul": _rate_tables_json(self.matmul),
                "memory_read_gbps": self.memory_read_gbps,
                "weight_read_gbps": self.weight_read_gbps,
                "memory_copy_gbps": self.memory_copy_gbps,
                "attention": [row.to_json() for row in self.attention],
                "hop_us": self.hop_us,
                "op_us": self.op_us,
                "under_copy_load": self.under_copy_load.to_json(),
            }
        )


@dataclass(frozen=True)
class CpuProfile:
    """The CPU: its physical cores and its rates per intra-op thread count measured."""

    physical_cores: int
    threads: dict[int, CpuRates]

    @classmethod
    def from_json(cls, fields: Fields) -> CpuProfile:
        physical_cores = fields.int("physical_cores", 1, minimum=1)
        threads = fields.object("threads")
        if not threads.document:
            threads.fail("is empty")
        cpu = cls(
            physical_cores,
            {
                count: CpuRates.from_json(threads.object(key))
                for count, key in _thread_counts(threads).items()
            },
        )
        fields.done()
        return cpu

    def to_json(self) -> dict:
        return {
            "physical_cores": self.physical_cores,
            "threads": {str(count): rates.to_json() for count, rates in self.threads.items()},
        }


@dataclass(frozen=True)
class DeviceRates:
    """The accelerator: "cuda" (measured on the CUDA EP), "sim" (the CPU standing in) or a spec GPU."""

    kind: str
    name: str | None = None
    note: str | None = None
    driver: str | None = None
    memory_bytes: int | None = None  # None: unknown (sim)
    ep_overhead_bytes: int = 0
    matmul: dict[str, tuple[MatmulRow, ...]] = field(default_factory=dict)  # by dtype; empty on sim
    attention: tuple[AttentionRow, ...] = ()
    launch_us: float | None = None  # a one-op session; None: the estimator's default
    memory_read_gbps: float | None = None  # None: the estimator's default

    @classmethod
    def from_json(cls, fields: Fields) -> DeviceRates:
        device = cls(
            kind=fields.str("kind"),
            name=fields.str("name", None),
            note=fields.str("note", None),
            driver=fields.str("driver", None),
            memory_bytes=fields.int("memory_bytes", None),
            ep_overhead_bytes=fields.int("ep_overhead_bytes", 0),
            matmul=_rate_tables(fields.object("matmul", {})),
            attention=_attention_rows(fields, "attention", []),
            launch_us=fields.float("launch_us", None),
            memory_read_gbps=fields.float("memory_read_gbps", None),
        )
        fields.done()
        return device

    def to_json(self) -> dict:
        return {
            **_without_none({"kind": self.kind, "name": self.name, "note": self.note, "driver": self.driver}),
            "memory_bytes": self.memory_bytes,
            "ep_overhead_bytes": self.ep_overhead_bytes,
            **_without_none({"memory_read_gbps": self.memory_read_gbps}),
            "matmul": _rate_tables_json(self.matmul),
            "attention": [row.to_json() for row in self.attention],
            **_without_none({"launch_us": self.launch_us}),
        }


@dataclass(frozen=True)
class CopyRow:
    """A copy of `bytes` over the link at `gbps`, from pinned host memory or not."""

    bytes: int
    gbps: float
    pinned: bool = False

    @classmethod
    def from_json(cls, fields: Fields) -> CopyRow:
        row = cls(fields.int("bytes", minimum=1), fields.float("gbps"), fields.bool("pinned", False))
        fields.done()
        return row

    def to_json(self) -> dict:
        return {"bytes": self.bytes, "gbps": self.gbps, "pinned": self.pinned}


@dataclass(frozen=True)
class LinkRates:
    """Host <-> device copies by size: PCIe, or the sim device's memcpy on its copy thread."""

    kind: str
    h2d: tuple[CopyRow, ...]
    d2h: tuple[CopyRow, ...]
    name: str | None = None
    h2d_under_cpu_load: tuple[CopyRow, ...] | None = None  # while the CPU computes matrix products

    @classmethod
    def from_json(cls, fields: Fields) -> LinkRates:
        directions = {}
        for direction in ("h2d", "d2h"):
            directions[direction] = tuple(CopyRow.from_json(row) for row in fields.objects(direction))
            if not directions[direction]:
                fields.fail("must list {bytes, gbps} rows", direction)
        loaded_rows = None
        if loaded := fields.object("under_cpu_load", None):
            loaded_rows = tuple(CopyRow.from_json(row) for row in loaded.objects("h2d"))
            loaded.done()
        link = cls(
            kind=fields.str("kind"),
            name=fields.str("name", None),
            h2d_under_cpu_load=loaded_rows,
            **directions,
        )
        fields.done()
        return link

    def to_json(self) -> dict:
        loaded = self.h2d_under_cpu_load
        return _without_none(
            {
                "kind": self.kind,
                "name": self.name,
                "h2d": [row.to_json() for row in self.h2d],
                "d2h": [row.to_json() for row in self.d2h],
                "under_cpu_load": None if loaded is None else {"h2d": [row.to_json() for row in loaded]},
            }
        )


@dataclass(frozen=True)
class MatmulSlowdown:
    """How much slower CPU MatMuls run beside a copy, at one thread count: by token count M, and the M=1 read."""

    by_tier: dict[int, float]
    memory_read: float = 1.0

    @classmethod
    def from_json(cls, fields: Fields) -> MatmulSlowdown:
        by_tier = {}
        for key in list(fields.document):
            if key.isdigit():
                by_tier[int(key)] = fields.float(key)
        slowdown = cls(by_tier, fields.float("memory_read", 1.0))
        fields.done()
        return slowdown

    def to_json(self) -> dict:
        return {
            **{str(tier): factor for tier, factor in self.by_tier.items()},
            "memory_read": self.memory_read,
        }


@dataclass(frozen=True)
class Contention:
    """Slowdown factors (>= 1: slower) when CPU compute and copies overlap."""

    cpu_matmul_slowdown_under_copy: dict[int, MatmulSlowdown]  # by thread count
    copy_slowdown_under_cpu_matmul: float = 1.0

    @classmethod
    def from_json(cls, fields: Fields) -> Contention:
        factors = fields.object("cpu_matmul_slowdown_under_copy", {})
        contention = cls(
            {
                count: MatmulSlowdown.from_json(factors.object(key))
                for count, key in _thread_counts(factors).items()
            },
            fields.float("copy_slowdown_under_cpu_matmul", 1.0),
        )
        fields.done()
        return contention

    def to_json(self) -> dict:
        return {
            "cpu_matmul_slowdown_under_copy": {
                str(count): factors.to_json()
                for count, factors in self.cpu_matmul_slowdown_under_copy.items()
            },
            "copy_slowdown_under_cpu_matmul": self.copy_slowdown_under_cpu_matmul,
        }


STEP_KIND, COPY_KIND = "step", "copy"  # a pack timing's kinds besides the sub-layer kinds: see PackTimingRow


@dataclass(frozen=True)
class PackTimingRow:
    """One of a pack's own timings (profile --pack) at a placement: a sub-layer kind's `seconds`, a whole step's
    `ratio` over its parts (kind "step"), or a streaming run's copy rate `gbps` (kind "copy")."""

    placement: str
    kind: str
    T: int
    C: int
    seconds: float | None = None
    ratio: float | None = None
    gbps: float | None = None

    @property
    def value(self) -> float:
        """What the estimator interpolates: the ratio of a step, the rate of a copy, else the seconds."""
        return {STEP_KIND: self.ratio, COPY_KIND: self.gbps}.get(self.kind, self.seconds)

    @classmethod
    def from_json(cls, fields: Fields) -> PackTimingRow:
        kind = fields.str("kind")
        measured = {STEP_KIND: "ratio", COPY_KIND: "gbps"}.get(kind, "seconds")
        row = cls(
            placement=fields.str("placement", "cpu", choices=PACK_PLACEMENTS),
            kind=kind,
            T=fields.int("T", minimum=1),
            C=fields.int("C", minimum=1),
            **{measured: fields.float(measured)},
        )
        if row.C < row.T:
            fields.fail(f"is {row.C}, less than T ({row.T})", "C")
        fields.done()
        return row

    def to_json(self) -> dict:
        return _without_none(
            {
                "placement": self.placement,
                "kind": self.kind,
                "T": self.T,
                "C": self.C,
                "seconds": self.seconds,
                "ratio": self.ratio,
                "gbps": self.gbps,
            }
        )


@dataclass(frozen=True)
class PackTimings:
    """A pack's own sub-layers timed where plans put them (profile --pack), for that pack only."""

    model_sha256: str
    pasts: list[int]
    threads: dict[int, tuple[PackTimingRow, ...]]

    @classmethod
    def from_json(cls, fields: Fields) -> PackTimings:
        threads = fields.object("threads")
        timings = cls(
            fields.str("model_sha256"),
            fields.int_list("pasts", minimum=0),
            {
                count: tuple(PackTimingRow.from_json(row) for row in threads.objects(key))
                for count, key in _thread_counts(threads).items()
            },
        )
        threads.done()
        fields.done()
        return timings

    def to_json(self) -> dict:
        return {
            "model_sha256": self.model_sha256,
            "pasts": self.pasts,
            "threads": {str(count): [row.to_json() for row in rows] for count, rows in self.threads.items()},
        }


@dataclass(frozen=True)
class Fingerprint:
    """Which machine and software measured the DB (a spec profile names its parts only)."""

    cpu_model: str | None = None
    logical_cpus: int | None = None
    physical_cores: int | None = None
    ram_bytes: int | None = None
    gpu: str | None = None
    gpu_driver: str | None = None
    onnxruntime: str | None = None
    pipeshard: str | None = None
    platform: str | None = None

    @classmethod
    def from_json(cls, fields: Fields) -> Fingerprint:
        values = {
            name: fields.int(name, None) if name in FINGERPRINT_COUNTS else fields.str(name, None)
            for name in FINGERPRINT_FIELDS
        }
        fields.done()
        return cls(**values)

    def to_json(self) -> dict:
        return _without_none({name: getattr(self, name) for name in FINGERPRINT_FIELDS})


@dataclass(frozen=True)
class SweepPlan:
    """What a measured profile swept: MatMul token counts, shapes and dtypes."""

    tiers: list[int]
    shapes: list[list[int]]
    dtypes: list[str]

    @classmethod
    def from_json(cls, fields: Fields) -> SweepPlan:
        shapes = fields.list("shapes", [])
        for index, shape in enumerate(shapes):
            if not (
                isinstance(shape, list) and len(shape) == 2 and all(type(d) is int and d > 0 for d in shape)
            ):
                fields.fail(
                    f"[{index}] must be a [K, N] pair of positive integers, not {shape!r}"[:200], "shapes"
                )
        plan = cls(fields.int_list("tiers", [], minimum=1), shapes, fields.str_list("dtypes", []))
        fields.done()
        return plan

    def to_json(self) -> dict:
        return {"tiers": self.tiers, "shapes": self.shapes, "dtypes": self.dtypes}


@dataclass(frozen=True)
class ProfileDb:
    """One machine's rates: its CPU per thread count, its accelerator, the link between them and their contention;
    a measured DB may also hold one pack's own timings."""

    source: str  # "measured" or "spec" (built from public specifications)
    created: str
    fingerprint: Fingerprint
    fingerprint_id: str
    cpu: CpuProfile
    device: DeviceRates
    link: LinkRates
    contention: Contention
    plan: SweepPlan | None = None
    pack_timings: PackTimings | None = None
    name: str | None = None  # reference profiles: their name, description and the spec figures used
    description: str | None = None
    spec: dict | None = None

    @classmethod
    def from_json(cls, document: object, where: str) -> ProfileDb:
        fields = Fields(document, where)
        fields.schema(PROFILE_SCHEMA_VERSION, "measure again with `pipeshard profile`")
        plan, timings = fields.object("plan", None), fields.object("pack_timings", None)
        spec = fields.raw("spec", None)
        if spec is not None and not isinstance(spec, dict):
            fields.fail("must be an object", "spec")
        profile = cls(  # the fields in the order of the file: the first problem is the one reported
            source=fields.str("source", choices=SOURCES),
            created=fields.str("created"),
            fingerprint=Fingerprint.from_json(fields.object("fingerprint")),
            fingerprint_id=fields.str("fingerprint_id"),
            plan=SweepPlan.from_json(plan) if plan else None,
            cpu=CpuProfile.from_json(fields.object("cpu")),
            device=DeviceRates.from_json(fields.object("device")),
            link=LinkRates.from_json(fields.object("link")),
            contention=Contention.from_json(fields.object("contention")),
            pack_timings=PackTimings.from_json(timings) if timings else None,
            name=fields.str("name", None),
            description=fields.str("description", None),
            spec=spec,
        )
        fields.done()
        return profile

    def to_json(self) -> dict:
        return _without_none(
            {
                "schema_version": PROFILE_SCHEMA_VERSION,
                "source": self.source,
                "name": self.name,
                "description": self.description,
                "spec": self.spec,
                "created": self.created,
                "fingerprint": self.fingerprint.to_json(),
                "fingerprint_id": self.fingerprint_id,
                "plan": self.plan.to_json() if self.plan else None,
                "cpu": self.cpu.to_json(),
                "device": self.device.to_json(),
                "link": self.link.to_json(),
                "contention": self.contention.to_json(),
                "pack_timings": self.pack_timings.to_json() if self.pack_timings else None,
            }
        )

    @property
    def thread_counts(self) -> list[int]:
        """The CPU thread counts measured, fewest first."""
        return sorted(self.cpu.threads)
