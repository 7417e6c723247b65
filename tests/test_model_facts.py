"""ModelFacts: one typed object for the model section of kvq.json, derived once and read by attribute."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import ARCHS, NEW_ARCHS, _config, save_tiny_model_dir

from kvq_export.arch import get_arch
from kvq_export.errors import KVQError, RuntimeInputError
from kvq_export.manifest import MANIFEST_NAME, Manifest
from kvq_export.model_facts import INT_FACTS, ModelFacts
from kvq_export.model_source import model_facts

#: The model section of a kvq.json written by kvq 0.1.0 (SmolLM2-135M): the keys and values it must keep.
WRITTEN = {
    "model_type": "llama", "num_layers": 30, "num_heads": 9, "num_kv_heads": 3, "head_dim": 64, "hidden_size": 576,
    "vocab_size": 49152, "max_position_embeddings": 8192, "tie_word_embeddings": True, "scaling": 0.125,
    "sliding_windows": [None] * 30,
    "rope": {"type": "default", "attention_scaling": 1.0,
             "parameters": {"rope_theta": 100000.0, "rope_type": "default"}},
    "source": "smollm2",
}


@pytest.mark.parametrize("kind", ARCHS + NEW_ARCHS)
def test_every_architecture_round_trips(kind):
    config = _config(kind)
    arch = get_arch(config)
    facts = ModelFacts.from_config(config, arch, source="given")
    data = json.loads(json.dumps(facts.to_dict()))  # through JSON, as kvq.json stores it
    assert set(data) == set(WRITTEN)
    assert ModelFacts.from_dict(data) == facts and ModelFacts.from_dict(data).to_dict() == data
    assert model_facts(config) == ModelFacts.from_config(config, arch)  # one derivation, whoever asks
    assert (facts.num_layers, facts.num_heads, facts.num_kv_heads, facts.head_dim) == \
        (arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim)
    assert facts.sliding_windows == tuple(arch.layer_window(i) for i in range(arch.num_layers))
    assert (facts.scaling, facts.rope.rope_type, facts.source) == (arch.scaling, arch.rope().rope_type, "given")
    assert facts.rope_theta == float(arch.rope_parameters(arch.global_rope_layer_type)["rope_theta"])


def test_a_written_model_section_loads_unchanged():
    facts = ModelFacts.from_dict(WRITTEN)
    assert facts.to_dict() == WRITTEN
    assert (facts.vocab_size, facts.num_kv_heads, facts.rope_theta, facts.sliding_windows[29]) == (49152, 3, 1e5, None)


@pytest.mark.parametrize("name", [*INT_FACTS, "model_type", "tie_word_embeddings", "scaling", "sliding_windows",
                                  "rope"])
def test_a_missing_field_is_named(name):
    data = copy.deepcopy(WRITTEN)
    del data[name]
    with pytest.raises(RuntimeInputError, match=f"^missing the field 'model.{name}'$"):
        ModelFacts.from_dict(data)


@pytest.mark.parametrize("name, value, message", [
    ("num_layers", 2.0, "'model.num_layers' must be an integer, got float"),
    ("vocab_size", "128", "'model.vocab_size' must be an integer, got str"),
    ("head_dim", True, "'model.head_dim' must be an integer, got bool"),
    ("num_kv_heads", 0, "'model.num_kv_heads' is 0; allowed: 1 .. 4096"),
    ("num_layers", 10**9, "'model.num_layers' is 1000000000; allowed: 1 .. 4096"),
    ("num_heads", 10, r"'model.num_heads' is 10; allowed: a multiple of model.num_kv_heads \(3\)"),
    ("model_type", 7, "'model.model_type' must be a string, got int"),
    ("tie_word_embeddings", 1, "'model.tie_word_embeddings' must be a boolean, got int"),
    ("scaling", "0.125", "'model.scaling' must be a number, got str"),
    ("scaling", False, "'model.scaling' must be a number, got bool"),
    ("scaling", float("nan"), "'model.scaling' is nan; allowed: a finite number > 0"),
    ("sliding_windows", [None] * 29, "'model.sliding_windows' must list one entry per layer"),
    ("sliding_windows", [None] * 29 + [0], "'model.sliding_windows' must list one entry per layer"),
    ("sliding_windows", [None] * 29 + [8.0], "'model.sliding_windows' must list one entry per layer"),
    ("rope", [], "'model.rope' must be an object, got list"),
    ("source", 3, "'model.source' must be a string, got int"),
])
def test_a_wrongly_typed_field_is_named_with_what_it_allows(name, value, message):
    data = {**copy.deepcopy(WRITTEN), name: value}
    with pytest.raises(RuntimeInputError, match=message):
        ModelFacts.from_dict(data)


@pytest.mark.parametrize("name, value, message", [
    ("type", None, "'model.rope.type' must be a string"),
    ("attention_scaling", "1", "'model.rope.attention_scaling' must be a number"),
    ("attention_scaling", -1.0, "'model.rope.attention_scaling' is -1.0; allowed: a finite number > 0"),
    ("parameters", [], "'model.rope.parameters' must be an object"),
])
def test_a_wrongly_typed_rope_entry_is_named(name, value, message):
    data = copy.deepcopy(WRITTEN)
    data["rope"][name] = value
    with pytest.raises(RuntimeInputError, match=message):
        ModelFacts.from_dict(data)


def test_an_integral_float_field_may_be_written_as_an_integer():
    facts = ModelFacts.from_dict({**WRITTEN, "scaling": 1, "source": None})
    assert facts.scaling == 1.0 and isinstance(facts.scaling, float) and facts.source is None


_WRONG = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=False), st.text(max_size=4),
                   st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=2), st.integers(), max_size=1))
_KINDS = {**dict.fromkeys(INT_FACTS, int), "model_type": str, "tie_word_embeddings": bool, "scaling": float,
          "sliding_windows": list, "rope": dict}


def _fits(kind: type, value) -> bool:
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(sorted(_KINDS)), value=_WRONG)
def test_any_corruption_of_a_field_is_one_line_naming_it(name, value):
    """A value of another type is refused with one line naming the field; never another exception."""
    if _fits(_KINDS[name], value):
        return
    with pytest.raises(KVQError) as err:
        ModelFacts.from_dict({**copy.deepcopy(WRITTEN), name: value})
    message = str(err.value)
    assert f"'model.{name}'" in message and "\n" not in message


def test_an_export_writes_and_reloads_the_facts(tmp_path):
    """An export's kvq.json keeps the model section's keys, loads as ModelFacts, and is read by attribute."""
    from kvq_export.export.exporter import export_model

    model_dir = save_tiny_model_dir(tmp_path / "tiny")
    out = export_model(model_dir, "fp16", tmp_path / "export")
    written = json.loads((out / MANIFEST_NAME).read_text())["model"]
    assert set(written) == set(WRITTEN) and written["source"] == str(model_dir)
    manifest = Manifest.load(out)
    assert isinstance(manifest.model, ModelFacts) and manifest.model.to_dict() == written
    assert manifest.num_layers == manifest.model.num_layers == 2 and manifest.model.vocab_size == 128
    assert manifest.to_dict()["model"] == written
    broken = json.loads((out / MANIFEST_NAME).read_text())
    broken["model"]["head_dim"] = "32"
    (out / MANIFEST_NAME).write_text(json.dumps(broken))
    with pytest.raises(RuntimeInputError, match="^invalid manifest: field 'model.head_dim' must be an integer, got s"):
        Manifest.load(out)
