"""Trace a transformers decoder with KV cache through the torch dynamo exporter into ONNX."""

from __future__ import annotations

import copy
import logging
import warnings
from pathlib import Path

import numpy as np

from pipeshard.exporter.configs import DecoderWithPastExportConfig
from pipeshard.exporter.fuse import stored_externally
from pipeshard.exporter.half_attention import use_attention_dtype
from pipeshard.exporter.layer_copies import LayerCopyError, copy_layers, layer_plan, traced_prefix
from pipeshard.exporter.moe_blocks import moe_export_form
from pipeshard.exporter.vlm import IMAGE_MERGE, image_merge_module
from pipeshard.formats.io_names import PAST_PREFIX, present_name

log = logging.getLogger(__name__)

DEFAULT_OPSET = 23
IMAGE_TOKENS_TRACED = 3
WRAPPER_ATTRIBUTE = "lm"


def _decoder_with_past(model, num_layers: int, image_token_id: int | None = None):
    """Wrap a causal LM so its KV cache is flat tensors in and out (what ONNX needs). With an image token, the
    wrapper takes `image_features` after `input_ids` and merges them into the embeddings (exporter/vlm.py)."""
    import torch
    from transformers.cache_utils import DynamicCache

    class DecoderWithPast(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            setattr(self, WRAPPER_ATTRIBUTE, model)

        def forward(self, input_ids, attention_mask, position_ids, *past):
            return self.decode(input_ids, None, attention_mask, position_ids, past)

        def decode(self, input_ids, inputs_embeds, attention_mask, position_ids, past):
            # No config: every layer a full DynamicLayer, so present = Concat(past, new) everywhere; a sliding
            # window stays in the attention mask (config-built sliding layers would crop the cache instead).
            cache = DynamicCache(ddp_cache_data=[(past[2 * i], past[2 * i + 1]) for i in range(num_layers)])
            # A decoder whose mask reads the ids (Gemma 3's image blocks, exporter/gemma3_vl.py) takes both.
            ids_too = getattr(model, "MASK_READS_INPUT_IDS", False)
            out = model(
                input_ids=None if inputs_embeds is not None and not ids_too else input_ids,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
            )
            present = []
            for layer in out.cache.layers:
                present += [layer.keys, layer.values]
            return (out.logits, *present)

    class DecoderWithImages(DecoderWithPast):
        def __init__(self) -> None:
            super().__init__()
            setattr(self, IMAGE_MERGE, image_merge_module(image_token_id))

        def forward(self, input_ids, image_features, attention_mask, position_ids, *past):
            embeds = getattr(self, IMAGE_MERGE)(
                input_ids, model.get_input_embeddings()(input_ids), image_features
            )
            return self.decode(input_ids, embeds, attention_mask, position_ids, past)

    return (DecoderWithPast() if image_token_id is None else DecoderWithImages()).eval()


def dummy_inputs(
    export_config: DecoderWithPastExportConfig,
    torch_dtype,
    batch=2,
    sequence=3,
    past=5,
    layers: int | None = None,
):
    """Example inputs for tracing and validation: a decode-like step with a non-empty past; for a VLM, up to four image
    tokens and three rows of features (the dimensions stay apart, and a token without features is traced too).
    `layers`: the past of only the first that many layers (default: every layer)."""
    import torch

    dims = export_config.dims
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, dims.vocab_size, (batch, sequence), generator=generator)
    image_token_id = export_config.image_token_id
    if image_token_id is not None:
        input_ids.view(-1)[1 : 1 + IMAGE_TOKENS_TRACED + 1] = image_token_id
        features = torch.randn(IMAGE_TOKENS_TRACED, dims.hidden_size, generator=generator).to(torch_dtype)
    attention_mask = torch.ones(batch, past + sequence, dtype=torch.int64)
    position_ids = torch.arange(past, past + sequence).unsqueeze(0).expand(batch, sequence).contiguous()
    if export_config.POSITION_ROWS > 1:  # M-RoPE: rows apart (an image's row and column positions)
        position_ids = torch.stack([position_ids + row for row in range(export_config.POSITION_ROWS)])
    kv_shape = (batch, dims.num_key_value_heads, past, dims.head_dim)
    past_names = export_config.past_names[: None if layers is None else 2 * layers]
    past_kv = [torch.randn(kv_shape, generator=generator).to(torch_dtype) for _ in past_names]
    if image_token_id is not None:
        return (input_ids, features, attention_mask, position_ids, *past_kv)
    return (input_ids, attention_mask, position_ids, *past_kv)


def _stand_in(shape: tuple[int, ...], dtype, index: int):
    """A weight's stand-in: 0.5 (not 0 or 1, so no rule that drops an addition of 0 or a product by 1 fires where
    a real weight would not let it), its first two elements numbering it (so no two weights look equal to the
    optimizer's deduplication of initializers, as real weights never do)."""
    import numpy as np

    values = np.full(shape, 0.5, dtype)
    flat = values.reshape(-1)
    if flat.size >= 2:
        flat[:2] = (index // 1024 + 1, index % 1024 + 1)
    return values


def _stand_in_weights(graph) -> None:
    """Give every weight of a meta-device trace a stand-in value, made lazily: the exporter's optimizer reads the
    small ones (folding constants) as it reads real weights."""
    import onnx_ir as ir

    for index, value in enumerate(graph.initializers.values()):
        raw = getattr(value.const_value, "raw", None)
        if getattr(raw, "is_meta", False):
            dtype, shape = value.const_value.dtype, value.const_value.shape
            value.const_value = ir.LazyTensor(
                lambda dtype=dtype, shape=shape, index=index: ir.tensor(
                    _stand_in(shape.numpy(), dtype.numpy(), index)
                ),
                dtype=dtype,
                shape=shape,
                name=value.name,
            )


def _weights_as_references(graph, data_file: str) -> None:
    """Every stand-in the export stores outside the graph becomes a reference to `data_file`, which is never
    written: a shape-only export keeps each weight's name, dtype and shape, and no data."""
    import onnx_ir as ir

    for value in graph.initializers.values():
        tensor = (
            value.const_value
        )  # a stand-in, or what the optimizer folded from stand-ins (a transposed weight)
        if not isinstance(tensor, ir.ExternalTensor) and stored_externally(tensor.nbytes):
            value.const_value = ir.ExternalTensor(
                data_file, 0, tensor.nbytes, tensor.dtype, shape=tensor.shape, name=value.name
            )


def _trace(model, export_config: DecoderWithPastExportConfig, layers: int, opset: int, shape_only: bool):
    """The dynamo exporter's ONNX program of `model` with its first `layers` layers (the model has that many)."""
    import torch

    wrapper = _decoder_with_past(model, layers, export_config.image_token_id)
    args = dummy_inputs(export_config, model.dtype, layers=layers)
    if shape_only:
        args = tuple(arg.to("meta") for arg in args)
    past_names = export_config.past_names[: 2 * layers]
    fixed_inputs = [name for name in export_config.inputs if not name.startswith(PAST_PREFIX)]
    output_names = ["logits", *(present_name(name) for name in past_names)]
    batch, sequence = torch.export.Dim("batch"), torch.export.Dim("sequence")
    past, total = torch.export.Dim("past_sequence"), torch.export.Dim("total_sequence")
    dynamic_shapes = {"input_ids": {0: batch, 1: sequence}}  # in the order of the wrapper's arguments
    if export_config.image_token_id is not None:
        dynamic_shapes["image_features"] = {0: torch.export.Dim("image_tokens")}
    dynamic_shapes |= {
        "attention_mask": {0: batch, 1: total},
        "position_ids": {0: batch, 1: sequence}
        if export_config.POSITION_ROWS == 1
        else {1: batch, 2: sequence},
        "past": tuple({0: batch, 2: past} for _ in past_names),
    }
    return torch.onnx.export(
        wrapper,
        args,
        dynamo=True,
        input_names=fixed_inputs + past_names,
        output_names=output_names,
        dynamic_shapes=dynamic_shapes,
        opset_version=opset,
        optimize=not shape_only,
        verbose=False,
    )


def export_decoder(
    model, export_config: DecoderWithPastExportConfig, onnx_path: Path, opset: int, shape_only: bool = False
) -> None:
    """Export `model` to `onnx_path` with its weights in `<name>.data` beside it: traced with as few layers as
    stand for all and the rest copied (exporter/layer_copies.py), or traced whole. `shape_only`: the model's
    weights are on the meta device, and the weights of the file are references to a data file that is not
    written (`_weights_as_references`)."""
    import torch

    with warnings.catch_warnings(), torch.no_grad(), moe_export_form(model):
        warnings.simplefilter("ignore")
        program = None
        plan = None if shape_only else layer_plan(model)
        if plan is not None:
            with traced_prefix(model, plan):
                program = _trace(model, export_config, plan.traced, opset, shape_only)
            try:
                copy_layers(program.model.graph, model, plan, WRAPPER_ATTRIBUTE)
            except LayerCopyError as exc:
                log.warning("tracing every layer, as the traced layers cannot be copied: %s", exc)
                program = None
        if program is None:
            program = _trace(model, export_config, export_config.dims.num_layers, opset, shape_only)
    if shape_only:
        _stand_in_weights(program.model.graph)
        program.optimize()
        _weights_as_references(program.model.graph, onnx_path.name + ".data")
    prefix = WRAPPER_ATTRIBUTE + "."
    for value in list(program.model.graph.initializers.values()):
        if value.name.startswith(prefix):
            value.name = value.name[len(prefix) :]
    if shape_only:  # the references are written as they are (a save with external data would copy their data)
        import onnx
        import onnx_ir as ir

        onnx.save(ir.to_proto(program.model), str(onnx_path))
        return
    program.save(str(onnx_path), external_data=True)


def max_logit_difference(
    model, export_config: DecoderWithPastExportConfig, onnx_path: Path, attention_dtype: str = "fp32"
) -> tuple[float, float]:
    """Largest |logit| difference between ONNX Runtime and PyTorch (fp32, its attention in ATTENTION_DTYPE) on the
    dummy inputs, with the KV cache given both ways: a past of its own (present allocated by ORT), and the
    runtimes' way, one buffer of larger capacity bound as both past and present; and PyTorch's largest |logit|."""
    import onnxruntime
    import torch

    past_length, capacity = 3, 16
    args = dummy_inputs(export_config, model.dtype, batch=1, sequence=4, past=past_length)
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    session = onnxruntime.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    kinds = {i.name: i.type for i in session.get_inputs()}
    feeds = {
        name: tensor.numpy().astype(np.float16) if kinds[name] == "tensor(float16)" else tensor.numpy()
        for name, tensor in zip(export_config.inputs, args, strict=True)
    }
    (own_past_logits,) = session.run(["logits"], feeds)
    binding = session.io_binding()
    binding.bind_output("logits")  # first bound, first returned
    buffers = []
    for name, array in feeds.items():
        if not name.startswith(PAST_PREFIX):
            binding.bind_cpu_input(name, array)
            continue
        buffer = np.zeros((*array.shape[:2], capacity, array.shape[3]), array.dtype)
        buffer[:, :, :past_length] = array
        value = onnxruntime.OrtValue.ortvalue_from_numpy(buffer)
        buffers.append(value)
        binding.bind_ortvalue_input(name, value)
        binding.bind_ortvalue_output(present_name(name), value)
    session.run_with_iobinding(binding)
    shared_logits = binding.get_outputs()[0].numpy()
    # The reference is PyTorch in fp32: its CPU fp16 kernels are themselves further from fp32 (0.37 on
    # SmolLM2's logits) than ONNX Runtime's fp16 graph is (0.03).
    reference = (
        model if model.dtype == torch.float32 and attention_dtype == "fp32" else copy.deepcopy(model).float()
    )
    use_attention_dtype(reference, attention_dtype)
    reference_args = [a.float() if a.is_floating_point() else a for a in args]
    with torch.no_grad():
        torch_logits = _decoder_with_past(
            reference, export_config.dims.num_layers, export_config.image_token_id
        )(*reference_args)[0].numpy()
    difference = max(
        float(np.abs(logits.astype(np.float32) - torch_logits).max())
        for logits in (own_past_logits, shared_logits)
    )
    return difference, float(np.abs(torch_logits).max())
