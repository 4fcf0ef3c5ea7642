"""Executing plans: each step takes its tier's plan and runs the sub-layers in order.

For every sub-layer the plan says pinned (weights resident in device memory), streamed (weights
copied into a staging slot ahead of use by the prefetcher) or cpu (a CPU-EP session over the
memory-mapped blob). Device sessions are the pack's weights-as-inputs variants with the weights bound
by pointer. Switching plans (another tier, or a new budget) releases what the new plan does not
use before allocating what it needs, so device memory never passes the budget.
"""

from __future__ import annotations

import bisect
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeshard.errors import UserError
from pipeshard.partitioner.planner import CPU, PINNED, STREAMED, Plan, Planner
from pipeshard.partitioner.simulate import EXPERT_RUN_ORDER, EXPERT_SLOTS
from pipeshard.runtime.devices import cpu_ort_device
from pipeshard.runtime.exportdir import NUMPY_DTYPES
from pipeshard.runtime.kv import HostKvCache, check_step_shape
from pipeshard.runtime.moe import ExpertStats, MoeBlock, chosen_experts, combine, moe_blocks_of, run_on_arrays
from pipeshard.runtime.ort import cpu_session_options, import_onnxruntime
from pipeshard.runtime.pack import load_pack
from pipeshard.runtime.plansfile import PlanSet

log = logging.getLogger(__name__)
STEP_INPUTS = ("input_ids", "attention_mask", "position_ids")


def _host(value) -> np.ndarray:
    """A step value as a host array: ours already are; ONNX Runtime's are viewed (or copied) out."""
    return value if isinstance(value, np.ndarray) else value.numpy()


@dataclass
class StepStats:
    """What the runtime did, for benchmarks and tests."""

    steps: int = 0
    plan_switches: int = 0
    streamed_bytes: int = 0
    copy_wait_s: float = 0.0
    tiers_used: dict[int, int] = field(default_factory=dict)


@dataclass
class StepReport:
    """What a planned step has done so far, for people and tools (the CLI, the bench, a server's metrics)."""

    device: str
    budget_bytes: int
    peak_device_bytes: int
    plans: dict[int, str]  # tier -> strategy, for the tiers planned so far
    predicted_step_s: dict[int, float]
    placement_counts: dict[int, dict[str, int]]  # tier -> units pinned / streamed / on the CPU
    steps: int
    plan_switches: int
    streamed_weight_bytes: int
    copy_wait_s: float  # copy time not hidden behind compute: what steps waited for

    def to_json(self) -> dict:
        return {**self.__dict__, "plans": {str(t): s for t, s in self.plans.items()},
                "predicted_step_s": {str(t): s for t, s in self.predicted_step_s.items()},
                "placement_counts": {str(t): c for t, c in self.placement_counts.items()}}


class _Session:
    """A sub-layer's session; `produced` are the outputs it allocates (the KV is written in place)."""

    def __init__(self, ort, path: Path, options, providers, entry: dict) -> None:
        try:
            self.session = ort.InferenceSession(str(path), options, providers=providers)
        except (ort.capi.onnxruntime_pybind11_state.Fail, ort.capi.onnxruntime_pybind11_state.InvalidProtobuf,
                ort.capi.onnxruntime_pybind11_state.InvalidGraph) as error:
            raise UserError(f"{path}: ONNX Runtime cannot load it ({str(error).splitlines()[0][:300]}); "
                            "`pipeshard inspect PACK --verify` checks a pack's files") from None
        self.binding = self.session.io_binding()._iobinding
        self.run = self.session._sess.run_with_iobinding
        in_place = set(entry["kv"]["present"]) if entry["kv"] else set()
        self.produced = [o.name for o in self.session.get_outputs() if o.name not in in_place]


class PlanStep:
    """A ForwardStep that executes the planner's plan for each step's tier on a device."""

    def __init__(self, folder: Path, device, planner: Planner, threads: int | None = None,
                 strategy: str = "auto", tiers: tuple[int, ...] = (1, 4, 16, 64, 256, 1024),
                 saved: PlanSet | None = None) -> None:
        """`saved`: a plans file's ladder, run as it is: the plans of its largest budget that fits are the step's
        (their tiers its tiers), also after a budget change; the planner is asked only for a budget below every
        rung, a context or a batch beyond the file's."""
        self._ort = import_onnxruntime()
        self.pack = load_pack(folder)
        self.device = device
        self.planner = planner
        self.strategy = strategy
        self.saved = saved
        rung = saved.rung_for(planner.budget_bytes)[1] if saved else None
        self.tiers = sorted(rung or tiers)
        model = self.pack.model
        self.max_context = int(model["max_context"])
        self.kv_heads, self.head_dim = int(model["num_key_value_heads"]), int(model["head_dim"])
        self.dtype = NUMPY_DTYPES[model["dtype"]]
        self.entries = self.pack.sub_layers
        self.by_name = {e["name"]: e for e in self.entries}
        # What plans place: the sub-layers, with a large output layer as row chunks (planner.planning_units).
        self.units = {u["name"]: u for u in planner.sub_layers}
        self._chunks = {e["name"]: [u for u in planner.sub_layers if u.get("chunk_of") == e["name"]]
                        for e in self.entries}
        self._inputs = {e["name"]: [i["name"] for i in e["inputs"]] for e in self.entries}
        self.options = cpu_session_options(threads)
        self._cpu_sessions: dict[str, _Session] = {}
        self._cpu_input_sessions: dict[str, _Session] = {}  # weights-as-inputs variants on the CPU (row chunks)
        self._device_sessions: dict[str, _Session] = {}
        self._blobs = {e["blob"]["file"]: np.memmap(self.pack.path(e["blob"]["file"]), np.uint8, mode="r")
                       for e in self.entries if e["blob"]}
        self.run_options = self._ort.RunOptions()
        self._cpu = cpu_ort_device()
        self.stats = StepStats()
        self._plans: dict[int, Plan] = dict(rung or {})
        self.active: Plan | None = None
        self._schedule: list = []  # the active plan's runs per sub-layer (_schedule_for)
        self._device_outputs: set[str] = set()  # activations the active plan keeps in device memory
        self._pinned: dict[str, np.ndarray] = {}
        self._ring: list[np.ndarray] = []
        self._slot_name: list[str | None] = []
        self._slot_future: list[Future | None] = []
        self._streamed: list[str] = []
        # The KV cache: host buffers for every attention (see runtime/kv.py); the attentions that run on
        # the device keep theirs in device buffers of the same size, bound by pointer as past and present.
        self._kv_host = HostKvCache([past for e in self.entries if e["kv"] for past in e["kv"]["past"]],
                                    self.kv_heads, self.head_dim, self.dtype)
        self._past_names = set(self._kv_host.past_names)
        self._kv_device: dict[str, object] = {}
        self._kv_on_device: set[str] = set()
        self._reserved: dict[str, int] = {}
        self._ring_position = 0
        self.all_logits = False  # see ChainStep: the output layer gets the last position only
        # MoE layers: after a router runs, its chosen experts run (runtime/moe.py); streamed experts go
        # through slots of their own, copied once the router has chosen them.
        self.moe = moe_blocks_of(self.pack.manifest)
        self._expert_names = {name for block in self.moe.values() for name in block.experts}
        self.expert_stats = ExpertStats(int(model.get("num_experts") or 0))
        self._expert_slots: list[np.ndarray] = []

    def report(self) -> StepReport:
        ledger = getattr(self.device, "ledger", None)
        return StepReport(
            device=self.device.kind, budget_bytes=self.planner.budget_bytes,
            peak_device_bytes=ledger.peak if ledger else 0,
            plans={tier: plan.strategy for tier, plan in sorted(self._plans.items())},
            predicted_step_s={tier: plan.step_s for tier, plan in sorted(self._plans.items())},
            placement_counts={tier: plan.counts() for tier, plan in sorted(self._plans.items())},
            steps=self.stats.steps, plan_switches=self.stats.plan_switches,
            streamed_weight_bytes=self.stats.streamed_bytes, copy_wait_s=self.stats.copy_wait_s)

    # -- plans ------------------------------------------------------------------------------------------------------
    def tier_for(self, tokens: int) -> int:
        index = bisect.bisect_left(self.tiers, tokens)
        return self.tiers[min(index, len(self.tiers) - 1)]

    def plan_for(self, tier: int) -> Plan:
        if tier not in self._plans:
            self.planner.check_budget()
            policies = {"gpu-only": self.planner.gpu_only, "static": self.planner.static,
                        "dynamic": self.planner.dynamic, "layers": lambda t: self.planner.baseline("layers", t),
                        "offload": lambda t: self.planner.baseline("offload", t)}
            plan = policies[self.strategy](tier) if self.strategy in policies else None
            if plan is None:
                if self.strategy != "auto":
                    log.warning("warning: plan %s is not viable (or equals static) at tier %d within %.0f MiB: "
                                "using the planner's choice", self.strategy, tier, self.planner.budget_bytes / 1024**2)
                plan = self.planner.plan_tier(tier)["chosen"]
            self._plans[tier] = plan
        return self._plans[tier]

    def set_budget(self, budget_bytes: int) -> None:
        """Replan for a new VRAM budget; the sequences in flight keep their KV (moved as needed).
        A budget below the minimum is refused before anything changes."""
        previous = self.planner.budget_bytes
        self.planner.budget_bytes = budget_bytes
        try:
            self.planner.check_budget()
        except Exception:
            self.planner.budget_bytes = previous
            raise
        self._deactivate()
        self._plans.clear()
        rung = self.saved.rung_for(budget_bytes) if self.saved else None
        if rung is not None and set(rung[1]) == set(self.tiers):
            self._plans.update(rung[1])
        self.device.set_budget(budget_bytes)

    # -- device memory ----------------------------------------------------------------------------------------------
    def _drain(self) -> None:
        for future in self._slot_future:
            if future is not None:
                future.result()

    def _reserve(self, purpose: str, nbytes: int) -> None:
        old = self._reserved.pop(purpose, 0)
        if old:
            self.device.unreserve(old, purpose)
        if nbytes:
            self.device.reserve(nbytes, purpose)
            self._reserved[purpose] = nbytes

    def _deactivate(self) -> None:
        """Release everything on the device; KV comes back to the host."""
        self._drain()
        for buffer in self._pinned.values():
            self.device.free(buffer, "pinned")
        self._pinned.clear()
        for buffer in self._ring:
            self.device.free(buffer, "staging")
        self._ring, self._slot_name, self._slot_future = [], [], []
        self._free_expert_slots()
        for attn in list(self._kv_on_device):
            self._move_kv(attn, to_device=False)
        for purpose in list(self._reserved):
            self._reserve(purpose, 0)
        self.active = None

    def _free_expert_slots(self) -> None:
        for buffer in self._expert_slots:
            self.device.free(buffer, "expert staging")
        self._expert_slots = []

    def _move_kv(self, attn: str, to_device: bool) -> None:
        """Move an attention's KV buffers between host and device (a plan change moved the attention)."""
        for past in self.by_name[attn]["kv"]["past"]:
            host = self._kv_host.buffers.get(past)
            if to_device:
                self._kv_device[past] = self._device_kv_buffer(host)
            else:
                buffer = self._kv_device.pop(past)
                if host is not None:
                    self.device.copy_out(host, buffer)
                self.device.free(buffer, "kv")
        (self._kv_on_device.add if to_device else self._kv_on_device.discard)(attn)

    def _device_kv_buffer(self, host: np.ndarray | None):
        """A device buffer holding a copy of a host KV buffer (charged to the ledger as `kv`)."""
        nbytes = host.nbytes if host is not None else 0
        buffer = self.device.alloc(nbytes, "kv")
        if nbytes:
            self.device.copy_in(buffer, host)
        return buffer

    def _activate(self, plan: Plan) -> None:
        """Make device memory match `plan`: release first, then allocate and upload."""
        self._drain()
        placements = plan.placements
        for name in [n for n in self._pinned if placements.get(n) != PINNED]:
            self.device.free(self._pinned.pop(name), "pinned")
        streamed = [name for name in self.units if placements[name] == STREAMED and name not in self._expert_names]
        streamed_experts = [name for name in self.units if placements[name] == STREAMED and name in self._expert_names]
        expert_slot_bytes = max((self._unit_source(n).nbytes for n in streamed_experts), default=0)
        if not streamed_experts or (self._expert_slots and self._expert_slots[0].nbytes != expert_slot_bytes):
            self._free_expert_slots()
        slot_bytes = max((self._unit_source(n).nbytes for n in streamed), default=0)
        slots = min(plan.slots, len(streamed)) if streamed else 0
        if len(self._ring) != slots or (self._ring and self._ring[0].nbytes != slot_bytes):
            for buffer in self._ring:
                self.device.free(buffer, "staging")
            self._ring = []
        wanted_attn = {e["name"] for e in self.entries if e["kind"] == "attn" and placements[e["name"]] != CPU}
        for attn in self._kv_on_device - wanted_attn:
            self._move_kv(attn, to_device=False)
        self._reserve("workspace", plan.vram.workspace)
        self._reserve("ep_overhead+reserve", plan.vram.ep_overhead + plan.vram.reserve)
        for attn in wanted_attn - self._kv_on_device:
            self._move_kv(attn, to_device=True)
        for name in self.units:
            if placements[name] == PINNED and name not in self._pinned:
                source = self._unit_source(name)
                buffer = self.device.alloc(source.nbytes, "pinned")
                self.device.upload_now(buffer, source)
                self._pinned[name] = buffer
        if not self._ring and slots:
            self._ring = [self.device.alloc(slot_bytes, "staging") for _ in range(slots)]
        if streamed_experts and not self._expert_slots:
            self._expert_slots = [self.device.alloc(expert_slot_bytes, "expert staging") for _ in range(EXPERT_SLOTS)]
        self._streamed = streamed
        self._slot_name = [None] * len(self._ring)
        self._slot_future = [None] * len(self._ring)
        self._ring_position = 0
        if plan.prefetch:
            for slot in range(len(self._ring)):
                self._start_copy(slot, streamed[slot])
        self.active = plan
        self._schedule = self._schedule_for(plan)
        self._device_outputs = self.device_resident_activations(plan)
        self._make_cpu_sessions()
        self.stats.plan_switches += 1

    def _make_cpu_sessions(self) -> None:
        """The active plan's CPU sessions, made now and largest weights first (as the chain does): a
        session's memory-mapped blob is then never on top of the packed copies of all the others."""
        needed = [entry for entry, runs in self._schedule if any(p == CPU and not chunk for _, p, chunk in runs)]
        for entry in sorted(needed, key=lambda e: -e["weight_bytes"]):
            self._session(entry, on_device=False)

    def _unit_source(self, name: str) -> np.ndarray:
        """The host bytes a unit puts on the device: a sub-layer's blob, or a row chunk's rows of W."""
        unit = self.units[name]
        if "chunk_of" not in unit:
            return self._blobs[unit["blob"]["file"]][: unit["blob"]["bytes"]]
        chunks = unit["row_chunks"]
        weight = next(w for w in unit["weights"] if w["name"] == chunks["weight"])
        start, stop = (weight["offset"] + row * chunks["row_bytes"] for row in unit["rows"])
        return self._blobs[weight["file"]][start:stop]

    def _start_copy(self, slot: int, name: str) -> None:
        if self._slot_name[slot] == name:
            return  # already there (as many slots as streamed sub-layers)
        self._slot_name[slot] = name
        source = self._unit_source(name)
        self._slot_future[slot] = self.device.upload(self._ring[slot], source)
        self.stats.streamed_bytes += source.nbytes

    # -- sessions ---------------------------------------------------------------------------------------------------
    def _cpu_input_session(self, entry: dict) -> _Session:
        """The weights-as-inputs variant on the CPU EP: a row chunk of the output layer computed on the host."""
        if entry["name"] not in self._cpu_input_sessions:
            self._cpu_input_sessions[entry["name"]] = _Session(
                self._ort, self.pack.path(entry["files"]["weights_as_inputs"]), self.options, ["CPUExecutionProvider"],
                entry)
        return self._cpu_input_sessions[entry["name"]]

    def _session(self, entry: dict, on_device: bool) -> _Session:
        cache = self._device_sessions if on_device else self._cpu_sessions
        if entry["name"] not in cache:
            variant = "weights_as_inputs" if on_device else "onnx"
            cache[entry["name"]] = _Session(self._ort, self.pack.path(entry["files"][variant]), self.options,
                                            self.device.providers if on_device else ["CPUExecutionProvider"], entry)
        return cache[entry["name"]]

    # -- the step ---------------------------------------------------------------------------------------------------
    def start(self, batch_size: int, context: int | None = None) -> None:
        """New sequences. Device KV is reserved for the planner's context x batch: a larger batch or
        a longer generation is replanned first, so the budget also holds for what is really stored."""
        if batch_size > self.planner.batch or (context or 0) > self.planner.context:
            self._deactivate()
            self.planner.batch = max(batch_size, self.planner.batch)
            self.planner.context = max(context or 0, self.planner.context)
            self.planner.clear_costs()
            self._plans.clear()
        self._reset_kv(batch_size)

    def _reset_kv(self, batch_size: int) -> None:
        """Zeroed KV buffers of the planner's context for new sequences, where the active plan wants them."""
        for buffer in self._kv_device.values():
            self.device.free(buffer, "kv")
        self._kv_device.clear()
        self._kv_host.reset(batch_size, self.planner.context)
        for attn in self._kv_on_device:
            for past in self.by_name[attn]["kv"]["past"]:
                self._kv_device[past] = self._device_kv_buffer(self._kv_host.buffers[past])

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        batch, tokens = input_ids.shape
        total = attention_mask.shape[1]
        check_step_shape(batch, tokens, total)
        if total > self._kv_host.capacity:
            # Longer than start() was told: the KV comes home, grows, and the plans are made for the new context.
            self._deactivate()
            self._kv_host.ensure(total)
            self.planner.context = self._kv_host.capacity
            self.planner.clear_costs()
            self._plans.clear()
        largest = self.tiers[-1]
        if batch == 1 and tokens > largest:
            # Prefill longer than the largest tier: chunks of it (bounds activation memory too). A batch's
            # prompts go in one step: GQA on the CPU takes several new tokens after a past only for batch 1.
            chunk = largest
            past = attention_mask.shape[1] - tokens
            pieces = []
            for begin in range(0, tokens, chunk):
                end = min(begin + chunk, tokens)
                pieces.append(self.forward(input_ids[:, begin:end], attention_mask[:, : past + end],
                                           position_ids[:, begin:end]))
            return np.concatenate(pieces, axis=1)
        tier = self.tier_for(batch * tokens)
        plan = self.plan_for(tier)
        if plan is not self.active:
            self._activate(plan)
        self.stats.steps += 1
        self.stats.tiers_used[tier] = self.stats.tiers_used.get(tier, 0) + 1
        try:
            return self._run_plan(plan, input_ids, attention_mask, position_ids)
        except BaseException:
            # Interrupted mid-step (Ctrl-C) or failed: the ring and the KV are in an unknown state.
            # Release the device; the next generation starts clean (start() resets the KV).
            self._deactivate()
            raise

    def _schedule_for(self, plan: Plan) -> list[tuple[dict, list[tuple[str, str, dict | None]]]]:
        """Per sub-layer, the runs a plan makes of it, as (unit, placement, row chunk or None): the
        sub-layer itself, or its row chunks when any of them is on the device. Made once per activation."""
        schedule = []
        for entry in self.entries:
            if entry["name"] in self._expert_names:
                continue  # run by their router's block
            chunks = self._chunks[entry["name"]]
            if chunks and any(plan.placements[u["name"]] != CPU for u in chunks):
                runs = [(u["name"], plan.placements[u["name"]], u) for u in chunks]
            else:
                runs = [(entry["name"], CPU if chunks else plan.placements[entry["name"]], None)]
            schedule.append((entry, runs))
        return schedule

    def device_resident_activations(self, plan: Plan) -> set[str]:
        """Outputs of sub-layers on the device that only sub-layers on the device read: they stay in device
        memory, so activations cross devices only where the placement changes. Whatever the host reads
        stays on the host: the logits, a MoE layer's routing and residual (the runtime combines the experts
        on the host), and the hidden state the output layer reads its last positions from."""
        on_device = {entry["name"] for entry, runs in self._schedule if all(p != CPU for _, p, _ in runs)}
        read_by_host = {"logits"} | {t for b in self.moe.values() for t in (b.hidden, b.routing, b.residual, b.output)}
        readers: dict[str, list[dict]] = {}
        for entry in self.entries:
            for tensor in self._inputs[entry["name"]]:
                readers.setdefault(tensor, []).append(entry)
        return {output["name"] for entry in self.entries if entry["name"] in on_device for output in entry["outputs"]
                if output["name"] not in read_by_host and readers.get(output["name"])
                and all(r["name"] in on_device and r["kind"] != "final" for r in readers[output["name"]])}

    def _run_plan(self, plan: Plan, input_ids, attention_mask, position_ids) -> np.ndarray:
        step_inputs = {"input_ids": np.ascontiguousarray(input_ids, dtype=np.int64),
                       "attention_mask": np.ascontiguousarray(attention_mask, dtype=np.int64),
                       "position_ids": np.ascontiguousarray(position_ids, dtype=np.int64)}
        cpu, device = self._cpu, self.device.ort_device
        values: dict[str, object] = {}
        for entry, runs in self._schedule:
            name = entry["name"]
            pieces = []
            for unit, placement, chunk in runs:
                if chunk and placement == CPU:
                    session = self._cpu_input_session(entry)
                else:
                    session = self._session(entry, placement != CPU)
                binding = session.binding
                presents = self._bind_kv(binding, entry, placement)
                self._bind_inputs(binding, entry, values, step_inputs, cpu)
                slot = None
                if placement == STREAMED:
                    slot = self._wait_for_slot(plan, unit)
                if chunk:
                    buffer = self._pinned.get(unit) if placement == PINNED else \
                        self._ring[slot] if placement == STREAMED else None
                    self._bind_chunk_weights(binding, chunk, buffer)
                elif placement != CPU:
                    self._bind_weights(binding, entry, self._pinned[name] if placement == PINNED else self._ring[slot])
                produced = session.produced
                for output in produced:
                    binding.bind_output(output, device if output in self._device_outputs else cpu)
                session.run(binding, self.run_options)
                # Outputs come back in the order first bound: the KV (bound first, every step), then the rest.
                returned = binding.get_outputs()
                for index, output in enumerate(produced, start=len(presents)):
                    values[output] = returned[index]
                if chunk:
                    pieces.append(np.array(values.pop("logits").numpy(), copy=True))
                if placement == STREAMED:
                    self._release_slot(plan, slot)
            if pieces:
                values["logits"] = np.concatenate(pieces, axis=-1)
            if name in self.moe:
                self._run_experts(plan, self.moe[name], values, step_inputs["attention_mask"][:, -input_ids.shape[1]:])
        if self.moe:
            self.expert_stats.end_step(input_ids.size)
        return _host(values["logits"])

    def _run_experts(self, plan: Plan, block: MoeBlock, values: dict, live: np.ndarray) -> None:
        """The experts the router chose for the step's real tokens (`live`: their attention mask), over
        those tokens: pinned ones first, then CPU ones while the streamed ones' weights are copied (two
        slots in flight), then the streamed ones; summed with the residual into the block's output."""
        hidden, routing = values[block.hidden].numpy(), values[block.routing].numpy()
        chosen = chosen_experts(routing, live)
        self.expert_stats.record(block.layer, chosen, live.size)
        chosen.sort(key=lambda pair: EXPERT_RUN_ORDER[plan.placements[block.experts[pair[0]]]])
        streamed = [block.experts[e] for e, _ in chosen if plan.placements[block.experts[e]] == STREAMED]
        copies: dict[str, tuple[int, Future]] = {}

        def start_copy(position: int) -> None:
            if position < len(streamed):
                name, slot = streamed[position], position % len(self._expert_slots)
                source = self._unit_source(name)
                copies[name] = (slot, self.device.upload(self._expert_slots[slot], source))
                self.stats.streamed_bytes += source.nbytes

        for position in range(min(EXPERT_SLOTS, len(streamed))):
            start_copy(position)

        def run_expert(expert: int, rows_hidden: np.ndarray, rows_routing: np.ndarray) -> np.ndarray:
            name = block.experts[expert]
            entry, placement = self.by_name[name], plan.placements[name]
            session = self._session(entry, placement != CPU)
            if placement == PINNED:
                self._bind_weights(session.binding, entry, self._pinned[name])
            elif placement == STREAMED:
                slot, copied = copies.pop(name)
                waited = time.perf_counter()
                copied.result()
                self.stats.copy_wait_s += time.perf_counter() - waited
                self._bind_weights(session.binding, entry, self._expert_slots[slot])
            out = np.empty_like(rows_hidden)
            inputs = {block.hidden: rows_hidden, block.routing: rows_routing}
            run_on_arrays(session.binding, session.run, self.run_options, self._cpu,
                          {n: inputs[n] for n in self._inputs[name]}, session.produced[0], out)
            if placement == STREAMED:
                self.device.released_after_compute(self._expert_slots[slot])
                start_copy(streamed.index(name) + EXPERT_SLOTS)
            return out

        out = np.empty_like(hidden)
        combine(_host(values[block.residual]), hidden, routing, chosen, run_expert, out)
        values[block.output] = out

    def _bind_inputs(self, binding, entry: dict, values: dict, step_inputs: dict, cpu) -> None:
        """A sub-layer's activations: step inputs, values of earlier sub-layers (the output layer reads
        each sequence's last position only, unless all logits were asked for); the KV is bound apart."""
        last_only = entry["kind"] == "final" and not self.all_logits
        for tensor in self._inputs[entry["name"]]:
            if last_only and tensor in values:
                if "_last_hidden" not in values:
                    values["_last_hidden"] = np.ascontiguousarray(_host(values[tensor])[:, -1:, :])
                last = values["_last_hidden"]
                binding.bind_input(tensor, cpu, last.dtype, list(last.shape), last.ctypes.data)
            elif tensor in self._past_names:
                continue
            elif tensor in step_inputs or isinstance(values[tensor], np.ndarray):  # a host array: by pointer
                array = step_inputs[tensor] if tensor in step_inputs else values[tensor]
                binding.bind_input(tensor, cpu, array.dtype, list(array.shape), array.ctypes.data)
            else:
                binding.bind_ortvalue_input(tensor, values[tensor])

    def _wait_for_slot(self, plan: Plan, unit: str) -> int:
        """The staging slot holding `unit`'s weights, once its copy has landed. The ring runs on across
        steps: the g-th streamed use overall takes slot g mod slots."""
        slot = self._ring_position % len(self._ring)
        if not plan.prefetch:
            self._start_copy(slot, unit)
        assert self._slot_name[slot] == unit, (slot, self._slot_name[slot], unit)
        waited = time.perf_counter()
        self._slot_future[slot].result()
        self.stats.copy_wait_s += time.perf_counter() - waited
        return slot

    def _release_slot(self, plan: Plan, slot: int) -> None:
        """The slot's user has run: refill it with the streamed unit `slots` places ahead."""
        self.device.released_after_compute(self._ring[slot])
        if plan.prefetch:
            following = (self._ring_position + len(self._ring)) % len(self._streamed)
            self._start_copy(slot, self._streamed[following])
        self._ring_position += 1

    def _bind_chunk_weights(self, binding, chunk: dict, buffer) -> None:
        """A row chunk of the output layer: its rows of W from the device buffer holding them (or from
        the host blob on the CPU), the layer's other (small) weights from the host blob."""
        chunks, cpu = chunk["row_chunks"], self._cpu
        for weight in chunk["weights"]:
            dtype = NUMPY_DTYPES[weight["dtype"]]
            if weight["name"] != chunks["weight"]:
                host = self._blobs[weight["file"]][weight["offset"]: weight["offset"] + weight["bytes"]]
                binding.bind_input(weight["name"], cpu, dtype, weight["shape"], host.ctypes.data)
                continue
            shape = [chunk["rows"][1] - chunk["rows"][0], *weight["shape"][1:]]
            if buffer is None:
                host = self._unit_source(chunk["name"])
                binding.bind_input(weight["name"], cpu, dtype, shape, host.ctypes.data)
            else:
                self.device.bind_input(binding, weight["name"], buffer, 0, dtype, shape)

    def _bind_weights(self, binding, entry: dict, buffer: np.ndarray) -> None:
        for weight in entry["weights"]:
            self.device.bind_input(binding, weight["name"], buffer, weight["offset"],
                                   NUMPY_DTYPES[weight["dtype"]], weight["shape"])

    def _bind_kv(self, binding, entry: dict, placement: str) -> tuple[str, ...]:
        """Bind an attention's KV buffers (host, or device when it runs there) as past and present."""
        if not entry["kv"]:
            return ()
        shape, cpu = self._kv_host.shape, self._cpu
        for past, present in zip(entry["kv"]["past"], entry["kv"]["present"], strict=True):
            if placement != CPU:
                buffer = self._kv_device[past]
                self.device.bind_input(binding, past, buffer, 0, self.dtype, shape)
                self.device.bind_output(binding, present, buffer, 0, self.dtype, shape)
            else:
                host = self._kv_host.buffers[past]
                binding.bind_input(past, cpu, host.dtype, list(shape), host.ctypes.data)
                binding.bind_output(present, cpu, host.dtype, list(shape), host.ctypes.data)
        return tuple(entry["kv"]["present"])

    def close(self) -> None:
        self._deactivate()
