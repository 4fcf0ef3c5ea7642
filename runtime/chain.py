"""The all-CPU chain: every sub-layer of a pack in manifest order, one CPU-EP session each.

Boundary tensors move through IO binding. The residual stream lives in two preallocated buffers per
batch shape (each residual tensor always in the same one, so a stage's pointer bindings stay valid
from step to step and are only redone when the batch shape changes); each attention's KV cache is
one host buffer bound as its past and present (appended in place), bound once per generation; the
rotary cos/sin tables the manifest marks as row prefixes of a stored weight are that whole weight,
bound once; the step's token inputs (ids, positions) are buffers bound once per batch shape; the prologue's
other per-step values (the mask bias) are ORT-allocated values handed on without touching numpy.

At one new token the prologue does not run: its values are kept in place by the runtime (each row's
length, the KV capacity as the total length, the padding bias over the capacity's columns; see
`runtime/kv.py`), in buffers every attention is bound to once, so a dense model's decode step is one
run per sub-layer that does work and binds nothing (a MoE layer still hands its routing on).

Every binding a step must redo is made in a burst, not one before each run: the step's inputs before
the first run, a produced value into all of its consumers right after its producer ran. Between two
runs the caches hold the last sub-layer's weights, so each call into ONNX Runtime's binding code made
there started cold (~6-12 us here against ~1 us in a burst). For the same reason the sessions are made
through ONNX Runtime's C API (`runtime/capi.py`) and the runs between two such bursts are one call into
C: a dense model's decode step is a single call.

At one new token the step runs fewer, larger sessions: each stretch of sub-layers with nothing between them in
Python (a dense model's decoder, up to 64 MiB of weights at a time) joined into one graph (`runtime/joined.py`),
its GroupQueryAttention nodes swapped for pipeshard's decode op (`runtime/decode_attention.py`), its weights the
sub-layer sessions' packed ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from pipeshard.runtime import capi
from pipeshard.runtime.exportdir import NUMPY_DTYPES
from pipeshard.runtime.joined import JoinedGraph, join
from pipeshard.runtime.kv import PADDING_BIAS, SEQLENS, TOTAL, HostKvCache, check_step_shape
from pipeshard.runtime.moe import ExpertStats, MoeBlock, chosen_experts, combine, moe_blocks_of
from pipeshard.runtime.pack import MappedWeights, Pack, load_pack

STEP_INPUTS = ("input_ids", "attention_mask", "position_ids")
TOKEN_INPUTS = ("input_ids", "position_ids")  # [batch, new tokens]: buffers of the runtime, bound by pointer
LOGITS = "logits"
# The most weight bytes one joined decode session takes: making it pages all of them in from the blobs at once
# (ONNX Runtime packs every weight before the pages can be let go), so this bounds what joining adds to the load
# peak. SmolLM2: 10 sessions a decode step, load peak +62 MiB; the whole decoder as one session decoded within 1 %
# of that (per-step interleaved A/B) and raised the load peak by ~540 MiB.
JOINED_WEIGHT_BYTES = 64 * 2**20


@dataclass(frozen=True)
class _Roles:
    """How the chain binds a boundary tensor, by name: residual-stream buffers, fixed prologue values, whole
    rotary tables."""

    residual: frozenset[str]
    fixed: frozenset[str]
    tables: frozenset[str]


class _Stage:
    """One session a step runs: a sub-layer's, or a stretch of sub-layers joined into one (`runtime/joined.py`),
    with its boundary names sorted by how they are bound."""

    def __init__(self, name: str, session: capi.Session, inputs: list[str], outputs: list[str], past: list[str],
                 present: list[str], roles: _Roles, last_sub_layer: str | None = None) -> None:
        self.name = name
        self.last_sub_layer = last_sub_layer or name  # a MoE router's experts run after the stage that ends with it
        self.session = session
        self.binding = session.binding()
        self.inputs = inputs
        self.past, self.present = past, present
        outputs = [n for n in outputs if n not in roles.tables]  # consumers get whole tables
        self.token_inputs = [n for n in inputs if n in TOKEN_INPUTS]
        self.mask_inputs = [n for n in inputs if n in STEP_INPUTS and n not in TOKEN_INPUTS]
        self.residual_inputs = [n for n in inputs if n in roles.residual]
        self.fixed_inputs = [n for n in inputs if n in roles.fixed or n in roles.tables]
        self.shared_inputs = [n for n in inputs if n not in STEP_INPUTS and n not in roles.residual
                              and n not in past and n not in self.fixed_inputs]
        self.pointer_outputs = [n for n in outputs if n in roles.residual or n == LOGITS or n in roles.fixed]
        self.allocated_outputs = [n for n in outputs if n not in self.pointer_outputs and n not in present]
        # IO binding returns outputs in the order they were first bound: KV (at start), pointers, the rest.
        self.bound_output_order = present + self.pointer_outputs + self.allocated_outputs
        self.takes_last_hidden = LOGITS in self.pointer_outputs and len(self.residual_inputs) == 1

    def run_on_arrays(self, inputs: dict[str, np.ndarray], output: str, out: np.ndarray, run_options) -> None:
        """One run with host arrays bound by pointer, writing into `out`."""
        for name, array in inputs.items():
            self.binding.bind_input(name, array)
        self.binding.bind_output(output, out)
        capi.run(self.session, self.binding, run_options)


class ChainStep:
    """A ForwardStep over a model pack, all on the CPU EP."""

    def __init__(self, folder: Path, threads: int | None = None, optimize: bool = True, prepack: bool = True,
                 verify: bool = False, all_logits: bool = False, join_decode: bool = True,
                 decode_attention: bool = True) -> None:
        self.pack = load_pack(folder, verify=verify)
        model = self.pack.model
        self.max_context = int(model["max_context"])
        self.hidden_size = int(model["hidden_size"])
        self.vocab_size = int(model["vocab_size"])
        self.kv_heads = int(model["num_key_value_heads"])
        self.head_dim = int(model["head_dim"])
        self.dtype = NUMPY_DTYPES[model["dtype"]]
        self._runtime = rt = capi.runtime(threads)
        # A MoE layer is its router stage, then the routed experts and the combine (runtime/moe.py).
        self.moe = moe_blocks_of(self.pack.manifest)
        expert_names = {name for block in self.moe.values() for name in block.experts}
        in_line = [e for e in self.pack.sub_layers if e["name"] not in expert_names]
        residual_names = []
        for entry in in_line:
            if entry["name"] in self.moe:
                residual_names.append(self.moe[entry["name"]].output)
            else:
                residual_names += [o["name"] for o in entry["outputs"] if len(o["shape"]) == 3 and
                                   o["shape"][-1] == self.hidden_size and o["name"] != LOGITS]
        # Consecutive residual tensors alternate between two buffers: a stage never reads and
        # writes the same one.
        self._buffer_of = {name: index % 2 for index, name in enumerate(residual_names)}
        # Prologue values whose shape depends on the batch shape only (rotary angles, sequence lengths) live
        # in buffers of their own, bound by pointer when the batch shape changes; the others (the mask bias
        # grows with the context) are allocated by ONNX Runtime and handed on every step.
        self._fixed = {o["name"]: o for e in in_line if e["kind"] == "prologue" for o in e["outputs"]
                       if all(isinstance(d, int) or d in ("batch", "sequence") for d in o["shape"])}
        self._fixed_buffers: dict[str, np.ndarray] = {}
        # Prologue outputs that are each step's first rows of a stored table (the rotary cos/sin): every
        # consumer is bound to the whole table once, and the prologue no longer slices it per step.
        self._tables = {o["name"]: _stored_weight(self.pack, entry, o["rows_of"]) for entry in in_line
                        if entry["kind"] == "prologue" for o in entry["outputs"] if "rows_of" in o}
        # Every session takes its sub-layers' stored weights as arrays mapped from the blobs, with one
        # prepacked-weights container: ONNX Runtime shares packed weights between sessions only for initializers
        # the caller provides, so a joined decode session and the sub-layers' own sessions hold one packed copy.
        # Sessions are made largest weights first: while one is made, its blob is mapped beside the packed
        # copies of those made before, so the 108 MiB output layer made last would raise the load peak.
        self._weights = MappedWeights()
        self._shared_weights = capi.SharedWeights(rt)
        self._session = partial(rt.session, threads=threads, optimize=optimize, prepack=prepack,
                                shared=self._shared_weights, weights_folder=self.pack.folder)
        roles = _Roles(frozenset(residual_names), frozenset(self._fixed), frozenset(self._tables))
        made = {entry["name"]: self._sub_layer_stage(entry, roles)
                for entry in sorted(in_line, key=lambda e: -e["weight_bytes"])}
        self.stages = [made[entry["name"]] for entry in in_line]
        self.experts = {entry["name"]: self._sub_layer_stage(entry, _Roles(frozenset(), frozenset(), frozenset()))
                        for entry in self.pack.sub_layers if entry["name"] in expert_names}
        # The prologue a decode step does without (its values kept by the runtime), and those values' buffers.
        skippable = in_line and in_line[0]["kind"] == "prologue" and _makes_attention_step_values(in_line[0], roles)
        self._skippable_prologue = self.stages[0] if skippable else None
        # Decode steps run each stretch of sub-layers with nothing between them in Python as one session
        # (runtime/joined.py), attention through pipeshard's op (runtime/decode_attention.py) where it applies:
        # float32 caches, head sizes in multiples of 8, the C extension built.
        self.decode_attention = (decode_attention and capi.custom_ops_available() and self.dtype == np.float32
                                 and self.head_dim % 8 == 0)
        self.decode_stages = self._joined_decode_stages(in_line, roles) if join_decode else [
            stage for stage in self.stages if stage is not self._skippable_prologue]
        self._joined = [stage for stage in self.decode_stages if stage not in self.stages]
        self.expert_stats = ExpertStats(int(model.get("num_experts") or 0))
        # Generation reads only the last token's logits: unless asked for all, the output layer gets the
        # last position only (a 256-token prefill then skips 255 lm_head rows and their logits memory).
        self._all_logits = all_logits
        self._last_hidden = np.empty(0, self.dtype)
        self.run_options = rt.run_options()
        self._stage_timer = None
        self.kv = HostKvCache([name for stage in self.stages for name in stage.past], self.kv_heads, self.head_dim,
                              self.dtype)
        self._shape: tuple[int, int] | None = None
        self._residual: list[np.ndarray] = []
        self._logits = np.empty(0, self.dtype)
        self._shared: dict[str, object] = {}
        self._tokens: dict[str, np.ndarray] = {}  # the token inputs' buffers
        self._mask_inputs: list[tuple] = []  # (bind, name) of every run stage's attention mask input
        self._allocated_outputs: list[tuple] = []  # (bind, name) of every output ONNX Runtime allocates anew
        self._program: list[tuple] = []
        self._decoding = False
        self._bias_dtype = next((np.dtype(o["dtype"]) for e in in_line if e["kind"] == "prologue"
                                 for o in e["outputs"] if o["name"] == PADDING_BIAS), self.dtype)
        self._bias_lowest = np.finfo(self._bias_dtype).min  # the bias where the mask is not set
        self._decode_bias = np.empty(0, self._bias_dtype)

    def _sub_layer_stage(self, entry: dict, roles: _Roles) -> _Stage:
        session = self._session(self.pack.path(entry["files"]["onnx"]),
                                initializers=self._weights.add(self.pack.folder, entry["weights"]))
        self._weights.release_pages()  # the session holds packed copies; weights read unpacked page back in
        capi.release_free_heap()  # the copies packed to find shared weights: not held to the end of loading
        kv = entry["kv"] or {}
        return _Stage(entry["name"], session, [i["name"] for i in entry["inputs"]],
                      [o["name"] for o in entry["outputs"]], kv.get("past", []), kv.get("present", []), roles)

    def _joined_decode_stages(self, in_line: list[dict], roles: _Roles) -> list[_Stage]:
        """The stages of a one-token step: each stretch of sub-layers that runs back to back (cut after a stage
        whose outputs Python hands on or a MoE router) joined into one session, outputs kept where read outside
        it; a lone sub-layer stays as it is unless its attention runs the decode op."""
        entries = {entry["name"]: entry for entry in in_line}
        stretches: list[list[_Stage]] = [[]]
        size = 0
        for stage in self.stages:
            if stage is self._skippable_prologue:
                continue
            weight_bytes = entries[stage.name]["weight_bytes"]
            if stretches[-1] and size + weight_bytes > JOINED_WEIGHT_BYTES:
                stretches.append([])
                size = 0
            stretches[-1].append(stage)
            size += weight_bytes
            if stage.allocated_outputs or stage.name in self.moe:
                stretches.append([])
                size = 0
        read_in_python = {name for block in self.moe.values() for name in (block.residual, block.hidden,
                                                                          block.routing)}
        float_inputs = {i["name"] for entry in in_line for i in entry["inputs"] if i["dtype"] == "float32"}
        decode_stages = []
        for stretch in filter(None, stretches):
            inside = {name for stage in stretch for name in stage.bound_output_order}
            read_outside = read_in_python | {name for stage in self.stages if stage not in stretch
                                             for name in stage.inputs}
            outputs = {name for name in inside if name in read_outside or name == LOGITS or
                       any(name in stage.present for stage in stretch)}
            joined = join([self.pack.path(entries[stage.name]["files"]["onnx"]) for stage in stretch], outputs,
                          float_inputs if self.decode_attention else None)
            if len(stretch) == 1 and not joined.decode_attention_nodes or not self._buffers_safe(joined, roles):
                decode_stages += stretch
                continue
            weights: dict[str, np.ndarray] = {}
            for stage in stretch:
                weights.update(self._weights.add(self.pack.folder, entries[stage.name]["weights"]))
            session = self._session(joined.model, initializers=weights)
            self._weights.release_pages()
            capi.release_free_heap()
            decode_stages.append(_Stage(f"{stretch[0].name}..{stretch[-1].name}", session, joined.inputs,
                                        joined.outputs, [n for s in stretch for n in s.past],
                                        [n for s in stretch for n in s.present], roles, stretch[-1].name))
        return decode_stages

    def _buffers_safe(self, joined: JoinedGraph, roles: _Roles) -> bool:
        """Whether the joined graph's residual inputs and outputs may live in the chain's two residual buffers:
        ONNX Runtime cannot know two of its tensors share memory and may order the joined nodes otherwise than
        the sub-layers ran, so an output may share an input's buffer only if it depends on every read of it."""
        inputs = [name for name in joined.inputs if name in roles.residual]
        outputs = [name for name in joined.outputs if name in roles.residual]
        buffers = [self._buffer_of[name] for name in outputs]
        return len(set(buffers)) == len(buffers) and all(
            joined.read_before_written(read, written) for read in inputs for written in outputs
            if self._buffer_of[read] == self._buffer_of[written])

    @property
    def stage_timer(self):
        """None, or a callable(sub-layer name, seconds) called after every run (each run then made from Python)."""
        return self._stage_timer

    @stage_timer.setter
    def stage_timer(self, timer) -> None:
        self._stage_timer = timer
        self._shape = None  # the program is remade at the next step

    @property
    def all_logits(self) -> bool:
        return self._all_logits

    @all_logits.setter
    def all_logits(self, value: bool) -> None:
        self._all_logits = value
        self._shape = None  # buffers are remade at the next step, and every stage's pointer bindings with them

    def start(self, batch_size: int, context: int | None = None) -> None:
        for stage in self.stages + self._joined:
            stage.binding.clear()  # every binding is redone below or at the next step
        self._shared.clear()
        self.kv.reset(batch_size, context)
        self._bind_kv()
        self._shape = None  # a decode step's values span the KV capacity: remade with the buffers

    def _bind_kv(self) -> None:
        for stage in self.stages + self._joined:
            for past, present in zip(stage.past, stage.present, strict=True):
                stage.binding.bind_input(past, self.kv.buffers[past])
                stage.binding.bind_output(present, self.kv.buffers[past])

    def _buffer(self, name: str) -> np.ndarray:
        if name == LOGITS:
            return self._logits
        if name in self._tables:
            return self._tables[name]
        if name in self._tokens:
            return self._tokens[name]
        return self._fixed_buffers[name] if name in self._fixed_buffers else self._residual[self._buffer_of[name]]

    def _bind_pointers(self, stage: _Stage) -> None:
        """(Re)bind the residual buffers, fixed prologue values and logits of a stage for the current batch shape."""
        last_only = LOGITS in stage.pointer_outputs and not self.all_logits and self._shape[1] > 1
        for name in stage.residual_inputs + stage.fixed_inputs + stage.token_inputs:
            array = self._last_hidden if last_only and name in stage.residual_inputs else self._buffer(name)
            stage.binding.bind_input(name, array)
        for name in stage.pointer_outputs:
            stage.binding.bind_output(name, self._buffer(name))

    def _make_program(self, shape: tuple[int, int]) -> None:
        """Buffers for a batch shape, every stage's pointer bindings, the bindings each step redoes before its
        first run (attention masks, outputs ONNX Runtime allocates), and what a step does: blocks of runs, each
        ended by what follows its last run (hand produced values to their consumers, route a MoE layer, copy the
        last position for the output layer — or None). At one new token a prologue making only attention step
        values is left out, its values bound from the runtime's buffers."""
        self._shape = shape
        one_token = shape[1] == 1
        self._decoding = one_token and self._skippable_prologue is not None
        sizes = {"batch": shape[0], "sequence": shape[1]}
        self._residual = [np.empty((*shape, self.hidden_size), self.dtype) for _ in range(2)]
        self._tokens = {name: np.empty(shape, np.int64) for name in TOKEN_INPUTS}
        self._fixed_buffers = {name: np.empty([sizes.get(d, d) for d in o["shape"]], np.dtype(o["dtype"]))
                               for name, o in self._fixed.items()}
        logit_rows = shape[1] if self.all_logits else 1
        self._logits = np.empty((shape[0], logit_rows, self.vocab_size), self.dtype)
        self._last_hidden = np.empty((shape[0], 1, self.hidden_size), self.dtype)
        # A timed step runs every sub-layer's own session, so that each is timed apart.
        stages = self.decode_stages if one_token and self._stage_timer is None else self.stages
        stages = [stage for stage in stages if not (self._decoding and stage is self._skippable_prologue)]
        for stage in stages:
            self._bind_pointers(stage)
        if self._decoding:
            self._bind_decode_values(stages)
        self._mask_inputs = [(stage.binding.bind_input, name) for stage in stages for name in stage.mask_inputs]
        self._allocated_outputs = [(stage.binding.bind_output_to_cpu, name) for stage in stages
                                   for name in stage.allocated_outputs]
        consumers: dict[str, list[tuple]] = {}
        for stage in stages:
            for name in stage.shared_inputs:
                consumers.setdefault(name, []).append((stage.binding.bind_value_input, name))
        follow: list[list] = [[] for _ in stages]
        for index, stage in enumerate(stages):
            if stage.allocated_outputs:
                names = tuple(stage.allocated_outputs)
                places = tuple(stage.bound_output_order.index(name) for name in names)
                bindings = tuple(bind for name in names for bind in consumers.get(name, ()))
                follow[index].append(partial(self._hand_on, stage.binding, names, places, bindings))
            if stage.last_sub_layer in self.moe:
                follow[index].append(partial(self._run_experts, self.moe[stage.last_sub_layer]))
            if index and stage.takes_last_hidden and not self.all_logits and shape[1] > 1:
                residual = self._residual[self._buffer_of[stage.residual_inputs[0]]]
                follow[index - 1].append(partial(np.copyto, self._last_hidden, residual[:, -1:, :]))
        self._program = []
        block: list[tuple] = []
        for stage, actions in zip(stages, follow, strict=True):
            block.append((stage.name, stage.session, stage.binding))
            if actions or stage is stages[-1] or self._stage_timer:
                runs = capi.Block(self._runtime, block, self.run_options, timer=self._stage_timer)
                self._program.append((runs, None if not actions else actions[0] if len(actions) == 1
                                      else partial(_each, tuple(actions))))
                block = []

    def _bind_decode_values(self, stages: list[_Stage]) -> None:
        """The prologue's values for one new token, over the KV capacity: the total length is the capacity
        (or the rotary tables' length, if shorter: GQA wants a row for every position up to it), the padding
        bias has its columns (those past a row's length are never read); both bound once."""
        columns = min([self.kv.capacity] + [len(table) for table in self._tables.values()])
        self._fixed_buffers[TOTAL][...] = columns
        self._decode_bias = np.zeros((self._shape[0], 1, 1, columns), self._bias_dtype)
        for stage in stages:
            if PADDING_BIAS in stage.shared_inputs:
                stage.binding.bind_input(PADDING_BIAS, self._decode_bias)

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        shape = input_ids.shape
        check_step_shape(shape[0], shape[1], attention_mask.shape[1])
        if self.kv.ensure(attention_mask.shape[1]):
            self._bind_kv()
            self._shape = None
        if shape != self._shape:
            self._make_program(shape)
        np.copyto(self._tokens["input_ids"], input_ids)
        np.copyto(self._tokens["position_ids"], position_ids)
        # What a step hands from stage to stage besides the pointer-bound buffers: the attention mask, then
        # the values ONNX Runtime allocates (the mask bias, a router's outputs).
        shared = self._shared
        shared["attention_mask"] = mask = np.ascontiguousarray(attention_mask, dtype=np.int64)
        if self._decoding:
            total = mask.shape[1]
            self._fixed_buffers[SEQLENS].fill(total - 1)
            np.copyto(self._decode_bias[:, 0, 0, :total], np.where(mask != 0, 0, self._bias_lowest))
        for bind, name in self._mask_inputs:
            bind(name, shared[name])
        for bind, name in self._allocated_outputs:
            bind(name)
        # The step loop touches as little as it can: after each sub-layer's weights have streamed through
        # the caches, every object it reads is a cache miss.
        for runs, follow in self._program:
            runs()
            if follow is not None:
                follow()
        if self.moe:
            self.expert_stats.end_step(shape[0] * shape[1])
        return self._logits

    def _hand_on(self, binding, names: tuple[str, ...], places: tuple[int, ...], consumers: tuple) -> None:
        """A stage's ORT-allocated outputs, bound into every stage that takes them, one call after another."""
        produced = binding.outputs()
        shared = self._shared
        for name, place in zip(names, places, strict=True):
            shared[name] = produced[place]
        for bind, name in consumers:
            bind(name, shared[name])

    def _run_experts(self, block: MoeBlock) -> None:
        """The experts the router chose for the step's real tokens (`live`: their attention mask), each over
        its tokens, summed into the next residual buffer."""
        shared = self._shared
        hidden, routing = shared[block.hidden].numpy(), shared[block.routing].numpy()
        live = shared["attention_mask"][:, -self._shape[1]:]
        chosen = chosen_experts(routing, live)
        self.expert_stats.record(block.layer, chosen, live.size)

        def run_expert(expert: int, rows_hidden: np.ndarray, rows_routing: np.ndarray) -> np.ndarray:
            stage = self.experts[block.experts[expert]]
            out = np.empty_like(rows_hidden)
            stage.run_on_arrays({block.hidden: rows_hidden, block.routing: rows_routing}, stage.allocated_outputs[0],
                                out, self.run_options)
            return out

        combine(self._residual[self._buffer_of[block.residual]], hidden, routing, chosen, run_expert,
                self._residual[self._buffer_of[block.output]])


def _makes_attention_step_values(prologue: dict, roles: _Roles) -> bool:
    """Whether a prologue makes exactly GroupQueryAttention's step values (runtime/kv.py) from the step's inputs,
    besides the rotary tables bound whole."""
    made = {o["name"] for o in prologue["outputs"]} - roles.tables
    return made == {SEQLENS, TOTAL, PADDING_BIAS} and {i["name"] for i in prologue["inputs"]} <= set(STEP_INPUTS)


def _stored_weight(pack: Pack, entry: dict, name: str) -> np.ndarray:
    """A sub-layer's weight as stored in its blob."""
    weight = next(w for w in entry["weights"] if w["name"] == name)
    dtype = np.dtype(weight["dtype"])
    return np.fromfile(pack.path(weight["file"]), dtype, weight["bytes"] // dtype.itemsize,
                       offset=weight["offset"]).reshape(weight["shape"])


def _each(actions: tuple) -> None:
    for action in actions:
        action()
