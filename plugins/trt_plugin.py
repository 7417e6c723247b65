"""The TensorRT Python plugin (``tensorrt.plugin``, TensorRT >= 10.9) around the fused attention kernel.

For each :class:`~kvq_export.flavors.trt.signature.PluginSignature` (one per distinct plugin name), :func:`register`
defines the three small functions of a quickly deployable plugin plus its JIT fallback:

* ``@trtp.register`` — shape/dtype description: the output is shaped and typed like ``q``;
* ``@trtp.autotune`` — the type combinations the signatures declare (q/output in fp32 or fp16);
* ``@trtp.aot_impl`` — compiles the Triton kernel to PTX (:func:`aot_kernel`) so the engine runs without
  Python (``trtexec``). One kernel per plugin there: the single-split variant of the fused kernel, tiled
  over query blocks, so prefill and decode both run in it (no flash-decoding split/reduce in AOT);
* ``@trtp.impl`` — JIT fallback in Python: :func:`kvq_plugins.attention.attention` (split + reduce for
  decode, dequantized temporary buffer + standard attention for long prompts).

The functions' parameter lists come from the signature (TensorRT reads them with ``inspect.signature``),
so names, inputs and attributes are never written here. tensorrt and triton are imported only inside the
functions. Nothing in this module has run under TensorRT on these machines (TensorRT is not installable
here); the PTX it hands over is checked on CPU by compiling for a CUDA target.
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvq_plugins.layout import StreamLayout

from kvq_export._lazy import require
from kvq_export.errors import KVQError
from kvq_export.flavors.trt.signature import PluginSignature

logger = logging.getLogger(__name__)

#: kernel pointer parameters fed by each plugin input role (keys ``k*``, values ``v*``), in kernel order
_KERNEL_POINTERS = {"sinks": "s_ptr", "codes": "c_ptr", "scales": "scale_ptr", "zero_points": "zero_ptr",
                    "recent": "r_ptr", "channel_order": "o_ptr"}
_LENGTH_ARGS = ("T", "KS_LEN", "KQ_LEN", "KR_LEN", "VS_LEN", "VQ_LEN", "VR_LEN")
NUM_WARPS = 4


@dataclass
class _Entry:
    structure: tuple
    combos: set[tuple[str, ...]] = field(default_factory=set)


_REGISTERED: dict[str, _Entry] = {}


# ------------------------------------------------------------------------------------------- AOT kernel
@dataclass(frozen=True)
class AotKernel:
    """A compiled fused kernel: PTX and what the launch needs."""

    name: str
    ptx: str
    num_warps: int
    shared: int
    block_m: int
    groups: int
    kv_heads: int
    params: int  # entry parameters of the PTX (plugin inputs + length scalars + output)


def layouts(attrs: dict[str, Any]) -> tuple[StreamLayout, StreamLayout]:
    """(key, value) layouts from a node's plugin attributes."""
    return StreamLayout.from_attributes("key", attrs), StreamLayout.from_attributes("value", attrs)


def _kernel_signature(sig: PluginSignature, compute: str) -> tuple[dict[str, str], dict[str, Any]]:
    """Runtime parameter types and constexprs of the single-split fused kernel for ``sig``.

    The runtime parameters are, in order, the plugin's inputs, the int32 region lengths and the output:
    exactly what TensorRT passes an AOT kernel (inputs, extra scalar args, outputs).
    """
    from kvq_plugins.attention import kernel_constants

    from kvq_export.dtypes import DType, onnx_name

    attrs = sig.attribute_dict
    key, value = layouts(attrs)
    consts = kernel_constants(key, value, num_heads=int(attrs["num_heads"]), kv_heads=int(attrs["num_kv_heads"]),
                              scale=float(attrs["scale"]), window=int(attrs["window"]) or None,
                              dot_f16=compute == "fp16", t_max=1, num_splits=1)
    q_type = DType.get(onnx_name(compute)).triton
    given = {i.name: i for i in sig.inputs}
    types: dict[str, str] = {"q_ptr": q_type, "seqlens_ptr": "*i64", "out_ptr": q_type}
    constexprs: dict[str, Any] = {"part_o_ptr": None, "part_ml_ptr": None, **consts}
    for part, prefix in (("key", "k"), ("value", "v")):
        for role, suffix in _KERNEL_POINTERS.items():
            declared = given.get(f"{part}_{role}")
            if declared is None:  # a role this stream lacks: specialized away (not a PTX parameter)
                constexprs[prefix + suffix] = None
            else:
                types[prefix + suffix] = DType.get(declared.dtype).triton
    types.update(dict.fromkeys(_LENGTH_ARGS, "i32"))
    return types, constexprs


def aot_kernel(sig: PluginSignature, *, compute: str | None = None, target: tuple[str, int] | None = None) -> AotKernel:
    """Compile the fused kernel of ``sig`` to PTX for ``target`` (``("cuda", 90)``; default: the current GPU).

    Needs compiled (not interpreted) kernels: ``TRITON_INTERPRET`` unset when they are first built.
    """
    from kvq_plugins import triton_kernels as tk

    compute = compute or {"float32": "fp32", "float16": "fp16"}[sig.output_dtype]
    types, constexprs = _kernel_signature(sig, compute)
    compiled = tk.compile_kernel("_decode_attention_kernel", types, constexprs, target=target, num_warps=NUM_WARPS)
    meta = compiled.metadata
    for scratch in ("global_scratch_size", "profile_scratch_size"):
        if getattr(meta, scratch, 0):
            raise KVQError(f"the compiled kernel needs {scratch}={getattr(meta, scratch)} bytes, which a TensorRT "
                           "AOT plugin cannot provide")
    expected = len(sig.inputs) + len(_LENGTH_ARGS) + 1
    ptx = fit_ptx_params(compiled.asm["ptx"], meta.name, expected)
    return AotKernel(meta.name, ptx, meta.num_warps, meta.shared, int(constexprs["BLOCK_M"]),
                     int(constexprs["GROUPS"]), int(constexprs["KV_HEADS"]), expected)


_ENTRY = re.compile(r"\.entry\s+(?P<name>\w+)\s*\((?P<params>[^)]*)\)", re.S)


def fit_ptx_params(ptx: str, name: str, expected: int) -> str:
    """Make the PTX entry take exactly ``expected`` parameters, the ones TensorRT passes.

    TensorRT launches an AOT kernel with the plugin's input pointers, the extra int32 scalars and the
    output pointers. Triton >= 3.3 appends two hidden pointers (global and profile scratch); when the
    kernel needs no scratch they are unused and are removed here. Anything else is an error.
    """
    match = _ENTRY.search(ptx)
    if match is None or match["name"] != name:
        raise KVQError(f"no .entry {name} in the compiled PTX")
    params = [p.strip() for p in match["params"].split(",") if p.strip()]
    if len(params) == expected:
        return ptx
    extra = params[expected:]
    body = ptx[match.end():]
    names = [p.split()[-1] for p in extra]
    if len(params) < expected or any(re.search(rf"\b{re.escape(n)}\b", body) for n in names):
        raise KVQError(f"kernel {name} takes {len(params)} parameters; TensorRT passes {expected}")
    kept = ",\n\t".join(params[:expected])
    return ptx[:match.start("params")] + "\n\t" + kept + "\n" + ptx[match.end("params"):]


# ------------------------------------------------------------------------------------------- registration
def register(signatures: Iterable[PluginSignature]) -> list[str]:
    """Register the plugins these signatures need (once per name per process); return their ids."""
    ids = []
    for sig in signatures:
        entry = _REGISTERED.get(sig.plugin_id)
        if entry is None:
            entry = _REGISTERED[sig.plugin_id] = _Entry(sig.structure())
            _define(sig, entry)
            logger.info("registered TensorRT plugin %s (%d inputs)", sig.plugin_id, len(sig.inputs))
        elif entry.structure != sig.structure():
            raise KVQError(f"plugin {sig.plugin_id} was registered with other inputs/attributes in this process")
        entry.combos.update({tuple(sig.io_types("fp32")), tuple(sig.io_types("fp16"))})
        ids.append(sig.plugin_id)
    return ids


def register_for_export(export_dir) -> list[str]:
    """Register every plugin an export directory's graph uses (from its manifest)."""
    from kvq_export.flavors.trt.signature import manifest_signatures
    from kvq_export.manifest import Manifest

    return register(manifest_signatures(Manifest.load(export_dir)))


def _define(sig: PluginSignature, entry: _Entry) -> None:
    trtp = require("tensorrt.plugin")
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    tensors = [inspect.Parameter(i.name, kind, annotation=trtp.TensorDesc) for i in sig.inputs]
    attrs = [inspect.Parameter(name, kind, annotation=type(value)) for name, value in sig.attributes]
    input_names = [i.name for i in sig.inputs]
    attr_names = [name for name, _ in sig.attributes]

    desc_sig = inspect.Signature(tensors + attrs, return_annotation=trtp.TensorDesc)

    def describe(*args, **kwargs):
        return desc_sig.bind(*args, **kwargs).arguments["q"].like()

    describe.__signature__ = desc_sig
    trtp.register(sig.plugin_id)(describe)

    tune_sig = inspect.Signature(
        tensors + [inspect.Parameter("outputs", kind, annotation=tuple[trtp.TensorDesc])],
        return_annotation=list[trtp.AutoTuneCombination])

    def autotune(*args, **kwargs):
        return [trtp.AutoTuneCombination(", ".join(types)) for types in sorted(entry.combos)]

    autotune.__signature__ = tune_sig
    trtp.autotune(sig.plugin_id)(autotune)

    impl_sig = inspect.Signature(tensors + attrs + [
        inspect.Parameter("outputs", kind, annotation=tuple[trtp.Tensor]),
        inspect.Parameter("stream", kind, annotation=int)], return_annotation=None)

    def impl(*args, **kwargs):
        bound = impl_sig.bind(*args, **kwargs).arguments
        _run_jit(sig, {n: bound[n] for n in input_names}, {n: bound[n] for n in attr_names},
                 bound["outputs"][0], bound["stream"])

    impl.__signature__ = impl_sig
    trtp.impl(sig.plugin_id)(impl)

    aot_sig = inspect.Signature(tensors + attrs + [
        inspect.Parameter("outputs", kind, annotation=tuple[trtp.TensorDesc]),
        inspect.Parameter("tactic", kind, annotation=int)],
        return_annotation=tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymIntExprs])

    def aot_impl(*args, **kwargs):
        bound = aot_sig.bind(*args, **kwargs).arguments
        return _aot_launch(trtp, sig, {n: bound[n] for n in input_names}, {n: bound[n] for n in attr_names})

    aot_impl.__signature__ = aot_sig
    trtp.aot_impl(sig.plugin_id)(aot_impl)


def _node_signature(sig: PluginSignature, attrs: dict[str, Any], q_dtype) -> tuple[PluginSignature, str]:
    """The registered signature with this node's attribute values, and the compute dtype of its q."""
    import dataclasses

    trt = require("tensorrt")
    compute = "fp16" if q_dtype == trt.float16 else "fp32"
    values = tuple((name, attrs[name]) for name, _ in sig.attributes)
    return dataclasses.replace(sig, attributes=values), compute


def _aot_launch(trtp, sig: PluginSignature, inputs: dict[str, Any], attrs: dict[str, Any]):
    """Compile for this node's attributes and dtypes; grid from the symbolic input shapes."""
    node, compute = _node_signature(sig, attrs, inputs["q"].dtype)
    kernel = aot_kernel(node, compute=compute)
    q = inputs["q"].shape_expr  # [B, Hq, T, D]
    lengths = [q[2]]
    for part in ("key", "value"):
        for role in ("sinks", "codes", "recent"):
            desc = inputs.get(f"{part}_{role}")
            lengths.append(desc.shape_expr[2] if desc is not None else 0)
    launch = trtp.KernelLaunchParams()
    launch.grid_x = q[0] * kernel.kv_heads
    launch.grid_y = trtp.cdiv(q[2] * kernel.groups, kernel.block_m)
    launch.grid_z = 1
    launch.block_x = kernel.num_warps * 32
    launch.shared_mem = kernel.shared
    extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(e) for e in lengths])
    return kernel.name.encode(), kernel.ptx.encode(), launch, extra


def _run_jit(sig: PluginSignature, inputs: dict[str, Any], attrs: dict[str, Any], output, stream: int) -> None:
    """The JIT implementation: torch views of TensorRT's buffers, then :func:`kvq_plugins.attention.attention`."""
    import torch
    from kvq_plugins.attention import attention

    key_layout, value_layout = layouts(attrs)
    tensors = {name: torch.as_tensor(value, device="cuda") for name, value in inputs.items()}
    out = torch.as_tensor(output, device="cuda")
    streams: dict[str, dict[str, torch.Tensor]] = {"key": {}, "value": {}}
    for declared in sig.inputs[2:]:
        streams[declared.part][declared.role] = tensors[declared.name]
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        result = attention(tensors["q"], tensors["seq_lengths"], streams["key"], streams["value"], key_layout,
                           value_layout, scale=float(attrs["scale"]), window=int(attrs["window"]) or None,
                           out=out)
        if result is not out:
            out.copy_(result)
