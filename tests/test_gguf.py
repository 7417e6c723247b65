"""GGUF files of every registered family: written as llama.cpp writes them, loaded through kvq like HF directories.

Each case is a tiny random model written as a float32 GGUF with llama.cpp's tensor names, metadata keys and
value transforms (Llama's q/k row permutation, Gemma's ``w + 1`` norms), then loaded with ``load_model(path)``:
the same weights (Gemma's norms come back as float32 ``(1 + w) - 1``), fp32 logits of a prefill and decode steps
within 1e-4 of the source model, and a quantized export that runs. The configs use what a GGUF states and
transformers' loader drops (Qwen3's head_dim, Phi3's partial rotary, soft-caps, linear RoPE scaling: kvq
restores them); what no GGUF key states (Gemma2/3's ``query_pre_attn_scalar``, Gemma3's layer pattern) keeps
the config default, so the source model is the model the file describes.

Families transformers cannot load from GGUF, and RoPE scaling it would silently drop, are refused by kvq with
one line.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from gguf_harness import LOADS, REFUSED, GgufCase, gemma_norm, source_model, write_gguf
from state_harness import teacher_forced_logits

from kvq_export.cli import cli
from kvq_export.errors import ModelError
from kvq_export.export.exporter import export_model
from kvq_export.model_source import GGUF_ARCHITECTURES, load_config, load_model, model_facts
from kvq_export.presets import PRESETS, resolve_scheme
from kvq_export.runtime.session import KVQSession

gguf = pytest.importorskip("gguf")

logger = logging.getLogger(__name__)

FP32_CACHE = resolve_scheme(str(Path(__file__).resolve().parents[1] / "tools" / "schemes" / "fp32-cache.json"))
PROMPT = [5, 17, 99, 3, 42, 8, 77, 1, 64, 23, 9]
DECODE = [7, 8, 9, 120, 33, 2]  # past Gemma's sliding window of 8


def _expected_weights(model, case: GgufCase) -> dict[str, torch.Tensor]:
    """The state dict transformers gives back: the source's, with Gemma's norms through fp32 ``(1 + w) - 1``."""
    want = {}
    for name, tensor in model.state_dict().items():
        if case.arch.startswith("GEMMA") and name.rsplit(".", 1)[0].endswith("norm"):
            tensor = torch.from_numpy(gemma_norm(tensor.numpy()) - np.float32(1.0))
        want[name] = tensor
    return want


@pytest.fixture(scope="module")
def kvq_cache(tmp_path_factory):
    """One kvq cache for the module: each GGUF is converted once, the later loads read the cached directory."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVQ_CACHE_DIR", str(tmp_path_factory.mktemp("kvq-cache")))
        yield


@pytest.fixture(scope="module", params=sorted(LOADS))
def written(request, tmp_path_factory, kvq_cache):
    """(kind, source model, GGUF path) for each family that loads."""
    kind = request.param
    model = source_model(kind)
    return kind, model, write_gguf(model, tmp_path_factory.mktemp("gguf") / f"tiny-{kind}.gguf", LOADS[kind])


def test_gguf_loads_the_same_weights(written):
    """Same facts (from the header alone, then from the converted model) and the same weights as the source."""
    kind, model, path = written
    case = LOADS[kind]
    want_facts = dataclasses.replace(model_facts(model.config), model_type=case.loads_as)
    assert model_facts(load_config(path)) == want_facts  # before any conversion: transformers + kvq's restore
    loaded, tokenizer = load_model(path)
    assert tokenizer is not None
    assert model_facts(loaded.config) == model_facts(load_config(path)) == want_facts
    want, got = _expected_weights(model, case), loaded.state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_gguf_export_matches_the_source_model(written, tmp_path):
    """fp32 cache: prefill and decode logits equal the source model's to 1e-4; int4 cache: equal the source's export."""
    kind, model, path = written
    tokens = PROMPT + DECODE
    with torch.no_grad():
        want = model(torch.tensor([tokens])).logits[0].numpy()
    session = KVQSession(export_model(path, FP32_CACHE, tmp_path / "fp32", flavor="ort-gqa"))
    got = teacher_forced_logits(session, tokens, len(PROMPT))
    err = float(np.abs(got - want).max())
    logger.warning("%s: GGUF export max |logits - source model| = %.2e (max |logit| %.2f)", kind, err,
                   float(np.abs(want).max()))
    assert got.shape == want.shape and err <= 1e-4, f"{kind}: max |Δlogits| {err:.2e}"

    # every token quantized (no high-precision window): the GGUF's export equals the source model's export
    scheme = PRESETS["int4-sym-g32"][0]
    got = teacher_forced_logits(KVQSession(export_model(path, scheme, tmp_path / "int4")), tokens, len(PROMPT))
    ref = teacher_forced_logits(KVQSession(export_model(model, scheme, tmp_path / "int4-source")), tokens, len(PROMPT))
    err, moved = float(np.abs(got - ref).max()), float(np.abs(ref - want).max())
    logger.warning("%s: int4-sym-g32 export of the GGUF vs of the source model: max |Δlogits| %.2e "
                   "(quantization itself moves them by %.2e)", kind, err, moved)
    assert np.isfinite(got).all() and err <= 1e-4, f"{kind}: int4 max |Δlogits| {err:.2e}"


# ---------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_gguf_of_a_family_transformers_cannot_load_is_refused_in_one_line(kind, tmp_path, monkeypatch):
    """The GGUF loader of transformers 5.24 has no config mapping for Gemma or OLMo2: kvq says so before converting."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    monkeypatch.setenv("KVQ_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(source_model(kind), tmp_path / f"tiny-{kind}.gguf", REFUSED[kind])
    arch = gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, REFUSED[kind].arch)]
    with pytest.raises(ValueError, match=f"GGUF model with architecture {arch} is not supported yet"):
        load_gguf_checkpoint(str(path))  # the reason: transformers itself refuses the architecture
    for load in (load_model, load_config):
        with pytest.raises(ModelError) as err:
            load(path)
        message = str(err.value)
        assert "\n" not in message and f"GGUF architecture {arch!r}" in message, message
        assert all(name in message for name in GGUF_ARCHITECTURES), message
    assert not (tmp_path / "cache").exists()  # refused before any conversion
    result = CliRunner().invoke(cli, ["memory", "--model", str(path), "--scheme", "fp16", "--seq-len", "8"])
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert f"GGUF architecture {arch!r}" in result.stderr


def test_gguf_of_an_architecture_kvq_does_not_export_is_refused_in_one_line(tmp_path):
    """A GGUF architecture transformers reads but kvq has no family for (GPT-2) is refused from its header."""
    path = _header_only(tmp_path / "gpt2.gguf", "gpt2", lambda writer: None)
    with pytest.raises(ModelError, match=r"GGUF architecture 'gpt2'.*gemma2.*qwen3") as err:
        load_config(path)
    assert "\n" not in str(err.value)


def _header_only(path: Path, arch: str, write) -> Path:
    """A GGUF with ``arch``'s header, what ``write(writer)`` adds, and no weights: enough for kvq's header check."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    write(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(("what", "write"), [
    ("per-frequency RoPE factors (rope_freqs)", lambda w: w.add_tensor("rope_freqs.weight", np.ones(16, np.float32))),
    ("RoPE scaling 'yarn'", lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.YARN)),
    ("needs a positive rope.scaling.factor", lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)),
])
def test_gguf_rope_scaling_transformers_would_drop_is_refused_in_one_line(tmp_path, what, write):
    """Llama 3 / LongRoPE factor tensors and YaRN: transformers' GGUF loader reads neither, the model would differ.

    (And linear scaling without its factor: nothing to restore.)
    """
    path = _header_only(tmp_path / "scaled.gguf", "llama", write)
    with pytest.raises(ModelError) as err:
        load_config(path)
    assert "\n" not in str(err.value) and what in str(err.value), str(err.value)


def test_loadable_gguf_architectures_are_the_tested_ones():
    assert set(GGUF_ARCHITECTURES) == {gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, c.arch)] for c in LOADS.values()}
    assert not set(GGUF_ARCHITECTURES) & {gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, c.arch)]
                                          for c in REFUSED.values()}


def test_gguf_transformers_cannot_map_is_refused_in_one_line(tmp_path, monkeypatch):
    """Transformers raises NotImplementedError for a ``llama`` GGUF whose name is exactly ``mistral``: one line."""
    monkeypatch.setenv("KVQ_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(source_model("llama"), tmp_path / "named.gguf", GgufCase("LLAMA", "llama", name="mistral"))
    with pytest.raises(ModelError, match="cannot read the model at") as err:
        load_model(path)
    assert "\n" not in str(err.value)
