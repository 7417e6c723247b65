"""``device`` -> ONNX Runtime execution providers: what ``kvq ... --device`` and the library's ``providers`` mean."""

from __future__ import annotations

from collections.abc import Sequence

from kvq_export.errors import RuntimeInputError

#: The devices kvq can be asked for; ``auto`` leaves the choice to
#: :func:`~kvq_export.runtime.ort_setup.choose_providers`.
DEVICES = ("auto", "cpu", "cuda")
CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"


def providers_for(device: str | None) -> list[str] | None:
    """The providers a session on ``device`` opens with (None for ``auto``: CUDA when ONNX Runtime has it, else CPU).

    ``cuda`` needs an ONNX Runtime built with CUDA (``onnxruntime-gpu``); without one this is a one-line error
    naming the providers the installed ONNX Runtime has.
    """
    if device in (None, "auto"):
        return None
    if device == "cpu":
        return [CPU]
    if device != "cuda":
        raise RuntimeInputError(f"unknown device {device!r}; allowed: {', '.join(DEVICES)}")
    import onnxruntime as ort

    available = ort.get_available_providers()
    if CUDA not in available:
        raise RuntimeInputError(f"device cuda needs onnxruntime with {CUDA} (onnxruntime-gpu); this onnxruntime has "
                                f"{', '.join(available)}", cli=f"--device cuda needs onnxruntime with {CUDA} "
                                f"(onnxruntime-gpu); this onnxruntime has {', '.join(available)}")
    return [CUDA, CPU]


def genai_providers(providers: list[str] | None) -> list[str] | None:
    """The onnxruntime-genai provider names (``cuda``; CPU is its default and has none) for ONNX Runtime ``providers``.

    None leaves the export's ``genai_config.json`` as written.
    """
    if providers is None:
        return None
    names = {CUDA: "cuda", CPU: None}
    unknown = [p for p in providers if p not in names]
    if unknown:
        raise RuntimeInputError(f"onnxruntime-genai cannot run on {', '.join(unknown)}; allowed: {', '.join(names)}")
    return [names[p] for p in providers if names[p]]


def set_genai_providers(config, providers: Sequence[str] | None) -> None:
    """Make an ``og.Config`` run on ONNX Runtime ``providers`` (None: as its ``genai_config.json`` says)."""
    named = genai_providers(None if providers is None else list(providers))
    if named is not None:  # a device was asked for: it replaces the config's own providers
        config.clear_providers()
        for provider in named:
            config.append_provider(provider)
