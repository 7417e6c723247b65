"""``--flavor ort-gqa``'s fused body: fewer, larger ONNX Runtime nodes with the unfused body's arithmetic.

The ort-gqa flavour asks the decoder body for one MatMul over q/k/v and one over gate/up (then a Split where
the parts are needed),
RMSNorm as ``RMSNormalization`` and residual add + norm as ``com.microsoft.SkipSimplifiedLayerNormalization``
(fp32 bodies), and feeds GroupQueryAttention the packed q|k|v where nothing sits between projection and node.
Each registered architecture is exported twice, fused and with ``fuse_body=False`` (the
portable body the reference flavour also builds), and must give the same logits within 1e-5 over a
left-padded batch and decode steps (measured: 4e-7 to 3.3e-6, 7.6e-6 on qwen3's loud model; only the
kernels' summation order differs), with the node counts the fusion promises.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import onnx
import pytest
from gqa_harness import PROMPTS, SCHEMES, calibration, left_pad
from tiny_models import ARCHS, NEW_ARCHS, VOCAB, loud_model

from kvq_export.export.exporter import export_model
from kvq_export.flavors.cache_graph import AttentionForm
from kvq_export.flavors.ort_gqa.graph import GQABodyRopeCacheGraph, GQACacheGraph
from kvq_export.runtime.session import KVQSession

LAYERS = 2  # tests/tiny_models.py
#: per architecture: (SkipSimplifiedLayerNormalization, RMSNormalization) nodes of the fused tiny graph.
#: Llama-like layers: layer 0's input norm alone, then residual + norm for the MLP, the next layer and the
#: final norm. Gemma2/3 add a plain norm on each attention/MLP output, Qwen3/Gemma3 one per q and k head
#: block, OLMo2 norms only outputs and whole q/k projections (its one residual + norm is the final norm).
NORMS = {
    "llama": (2 * LAYERS, 1), "llama-tied": (2 * LAYERS, 1), "mistral": (2 * LAYERS, 1), "qwen2": (2 * LAYERS, 1),
    "phi3": (2 * LAYERS, 1), "gemma": (2 * LAYERS, 1), "qwen3": (2 * LAYERS, 1 + 2 * LAYERS),
    "gemma2": (2 * LAYERS, 1 + 2 * LAYERS), "gemma3": (2 * LAYERS, 1 + 4 * LAYERS), "olmo2": (1, 4 * LAYERS),
}
TIED = {"llama-tied", "qwen2", "qwen3", "gemma", "gemma2", "gemma3"}
#: q/k norms sit between the projection and attention: these take q, k, v apart (3 realignments in, not 1)
QK_NORMED = {"qwen3", "gemma3", "olmo2"}
#: primitive RMSNorm ops: none may remain in a fused fp32 body
PRIMITIVE_NORM = ("ReduceMean", "Sqrt", "Reciprocal")


@pytest.fixture
def unfused():
    """Export with the ort-gqa cache graph and the portable (unfused) body: ``unfused(model, scheme, out, **kw)``."""
    original = GQACacheGraph.for_model

    def export_unfused(model, scheme, out, **options):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(GQACacheGraph, "for_model", classmethod(
                lambda cls, scheme, facts, *, static=None: original(scheme, facts, static=static, fuse_body=False)))
            return export_model(model, scheme, out, flavor="ort-gqa", **options)

    return export_unfused


def _ops(directory) -> collections.Counter:
    graph = onnx.load(directory / "model.onnx", load_external_data=False).graph
    return collections.Counter(node.op_type for node in graph.node)


def _walk(a: KVQSession, b: KVQSession, steps: int = 8):
    """Largest |Δ logit| over a left-padded prompt batch and ``steps`` single-token steps, and both caches after."""
    ids, mask = left_pad(PROMPTS["padded"])
    la, ca = a.step(ids, mask)
    lb, cb = b.step(ids, mask)
    gap = float(np.abs(la - lb)[mask.astype(bool)].max())
    rng = np.random.default_rng(0)
    for _ in range(steps):
        token = rng.integers(0, VOCAB, (ids.shape[0], 1))
        la, ca = a.step(token, None, ca)
        lb, cb = b.step(token, None, cb)
        gap = max(gap, float(np.abs(la - lb).max()))
    return gap, ca, cb


def _max_logit_gap(a: KVQSession, b: KVQSession, steps: int = 8) -> float:
    """Largest |Δ logit| of :func:`_walk`."""
    return _walk(a, b, steps)[0]


def _gap_and_ties(a: KVQSession, b: KVQSession, steps: int = 8) -> tuple[float, int]:
    """:func:`_walk`'s gap, and how many stored codes differ at its end (each by one level at most)."""
    gap, ca, cb = _walk(a, b, steps)
    ties = 0
    for name, value in ca.items():
        diff = np.abs(value.numpy().astype(np.int32) - cb[name].numpy().astype(np.int32))
        assert diff.max() <= 1, name
        ties += int((diff != 0).sum())
    return gap, ties


@pytest.mark.parametrize("arch", ARCHS + NEW_ARCHS)
def test_fused_body_uses_fused_ops_and_equals_the_unfused_body(tmp_path, unfused, arch):
    model = loud_model(arch)
    scheme = SCHEMES["fp32"]
    fused_dir = export_model(model, scheme, tmp_path / "fused", flavor="ort-gqa")
    plain_dir = unfused(model, scheme, tmp_path / "plain")
    fused, plain = _ops(fused_dir), _ops(plain_dir)
    head = 0 if arch in TIED else 1
    assert fused["MatMul"] == 4 * LAYERS + 1  # qkv, o, gate_up, down; lm_head (tied: on the embedding's Transpose)
    assert (fused["Gemm"], fused["Transpose"]) == (0, 1 - head)
    # gate/up; q/k/v only where q/k norms need the parts (the node reads the packed projection, and so do probes)
    assert fused["Split"] == (2 if arch in QK_NORMED else 1) * LAYERS
    assert plain["MatMul"] == 7 * LAYERS + head and plain["Split"] == 0 and plain["Gemm"] == 1 - head
    assert (fused["SkipSimplifiedLayerNormalization"], fused["RMSNormalization"]) == NORMS[arch]
    assert not any(fused[op] for op in PRIMITIVE_NORM)
    assert not plain["SkipSimplifiedLayerNormalization"] and not plain["RMSNormalization"]
    assert sum(fused.values()) < sum(plain.values())
    # GQA's packed query: one left-to-right realignment of q|k|v and one back, per layer
    assert fused["GatherND"] == (4 if arch in QK_NORMED else 2) * LAYERS and plain["GatherND"] == 4 * LAYERS
    gap = _max_logit_gap(KVQSession(fused_dir), KVQSession(plain_dir))
    assert gap <= 1e-5, gap


def test_fused_projections_keep_folded_value_rotation_and_rotated_keys(tmp_path, unfused):
    """Rotated values (folded into v_proj/o_proj) and keys (RoPE in the body) through the fused qkv MatMul.

    Quantized, so the codes are compared too: the fused body must store the same codes as the unfused one.
    """
    base = SCHEMES["ort-int8/hp-fp32"]
    for keys in (False, True):
        key = dataclasses.replace(base.key, rotation="hadamard") if keys else base.key
        scheme = dataclasses.replace(base, key=key, value=dataclasses.replace(base.value, rotation="hadamard"),
                                     name=None)
        static = calibration("qwen2", scheme)  # q/k/v biases: the value bias is rotated with its weight
        model = loud_model("qwen2")
        fused_dir = export_model(model, scheme, tmp_path / f"fused-{keys}", static=static, flavor="ort-gqa")
        plain_dir = unfused(model, scheme, tmp_path / f"plain-{keys}", static=static)
        ops = _ops(fused_dir)
        assert ops["MatMul"] == 4 * LAYERS + 1 + (LAYERS if keys else 0)  # + one rotation of the q and k heads
        assert ops["GatherND"] == 2 * LAYERS  # packed q|k|v (RoPE in the body or not): realigned together
        fused, plain = KVQSession(fused_dir), KVQSession(plain_dir)
        # the two bodies sum in other orders: a value at a rounding tie may land one level apart (then its logits
        # move by that level's weight), never more
        gap, ties = _gap_and_ties(fused, plain)
        assert ties <= 1 and gap <= (1e-5 if not ties else 1e-3), (gap, ties)
        ids, mask = left_pad(PROMPTS["padded"])
        _, ca = fused.step(ids, mask)
        _, cb = plain.step(ids, mask)
        assert ca.keys() == cb.keys()
        for name, value in ca.items():
            assert np.array_equal(value.numpy(), cb[name].numpy()), name


def test_fp16_body_fuses_projections_but_keeps_primitive_norms(tmp_path, unfused):
    """An fp16 Llama norm is rounded before its weight multiply (as transformers does): no fused norm there."""
    model = loud_model("llama")
    scheme = SCHEMES["fp16"]
    fused_dir = export_model(model, scheme, tmp_path / "fused", flavor="ort-gqa", dtype="fp16")
    plain_dir = unfused(model, scheme, tmp_path / "plain", dtype="fp16")
    fused = _ops(fused_dir)
    assert fused["MatMul"] == 4 * LAYERS + 1 and fused["Split"] == LAYERS  # gate/up only
    assert fused["ReduceMean"] == 2 * LAYERS + 1
    assert not fused["SkipSimplifiedLayerNormalization"] and not fused["RMSNormalization"]
    a, b = KVQSession(fused_dir), KVQSession(plain_dir)
    ids, mask = left_pad(PROMPTS["padded"])
    la, _ = a.step(ids, mask)
    lb, _ = b.step(ids, mask)
    real = mask.astype(bool)
    assert float(np.abs(la - lb)[real].max()) <= 2e-3 * float(np.abs(lb[real]).max())


@pytest.mark.parametrize("arch", ["qwen2", "phi3", "gemma3"])
def test_packed_rope_gives_the_per_head_ropes_floats(tmp_path, monkeypatch, arch):
    """RoPE on the packed q|k|v (the body's RoPE for GQA) against the per-head form, with keys offset after RoPE.

    Same products and sums, so the same floats: identical codes and logits, with partial rotary (phi3) and a
    local and a global RoPE (gemma3); and about 20 fewer nodes per layer (no per-head transposes or Split).
    """
    scheme = SCHEMES["ort-int4-asymk/hp-fp32"]
    static = calibration(arch, scheme)
    model = loud_model(arch)
    packed_dir = export_model(model, scheme, tmp_path / "packed", static=static, flavor="ort-gqa")
    monkeypatch.setattr(GQABodyRopeCacheGraph, "attention", AttentionForm.HEADS)  # the per-head RoPE
    heads_dir = export_model(model, scheme, tmp_path / "heads", static=static, flavor="ort-gqa")
    packed, heads = _ops(packed_dir), _ops(heads_dir)
    assert packed["Transpose"] == (arch in TIED) < heads["Transpose"]  # a tied lm_head's only
    assert sum(heads.values()) - sum(packed.values()) >= 15 * LAYERS
    a, b = KVQSession(packed_dir), KVQSession(heads_dir)
    assert _max_logit_gap(a, b) == 0.0
    ids, mask = left_pad(PROMPTS["padded"])
    _, ca = a.step(ids, mask)
    _, cb = b.step(ids, mask)
    for name, value in ca.items():
        assert np.array_equal(value.numpy(), cb[name].numpy()), name
