"""The CPU a figure was measured on, and its arithmetic peaks, from ``/proc/cpuinfo``.

Every timing kvq prints names the CPU (:func:`cpu_name`): ONNX Runtime picks its kernels at run time from the CPU's
flags (AVX512-VNNI, AMX), so one table can differ twofold between two machines of the same size.

:func:`cpu_peaks` states each core's peak, so a kernel's GFLOP/s reads as a share of what the silicon can do::

    fp32 peak = cores x FMA pipes x fp32 lanes per pipe x 2 (multiply + add) x clock
    int8 peak = cores x pipes x 32-bit lanes per pipe x 4 (u8 x s8 products per lane, VNNI) x 2 x clock
    AMX int8  = cores x 1024 multiply-adds per cycle x 2 x clock

The lanes come from the flags (``avx512f``: 16 per pipe, ``avx2``: 8); two FMA pipes per core, as on current x86
server cores; AMD family 25 (Zen 4) runs 512-bit instructions on 256-bit pipes, so 8 lanes. The clock is
``/proc/cpuinfo``'s ``cpu MHz``, which under a hypervisor is the nominal one: a core that boosts above it can
exceed "100%". The peaks are the arithmetic ceiling, not a promise; the shares compare kernels on one machine.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

#: the flags that decide which of ONNX Runtime's CPU kernels run
KERNEL_FLAGS = ("avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_int8")
#: FMA pipes per core assumed for the peaks
FMA_PIPES = 2
#: AMX's int8 multiply-adds per core and cycle (one TMUL: 16 x 64 bytes times 64 x 16 in 16 cycles)
AMX_INT8_MACS = 1024


@dataclass(frozen=True)
class CpuInfo:
    """What ``/proc/cpuinfo`` says of the CPU this process runs on."""

    name: str
    vendor: str
    family: int | None
    model: int | None
    flags: frozenset[str]
    mhz: float | None
    cores: int  # the cores this process may run on

    @classmethod
    def read(cls, text: str | None = None) -> CpuInfo:
        """The CPU of this machine (``text``: a ``/proc/cpuinfo`` to parse instead)."""
        if text is None:
            try:
                text = Path("/proc/cpuinfo").read_text()
            except OSError:
                text = ""
        fields: dict[str, str] = {}
        for line in text.splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return cls(name=fields.get("model name") or platform.processor() or platform.machine(),
                   vendor=fields.get("vendor_id", ""), family=_int(fields.get("cpu family")),
                   model=_int(fields.get("model")), flags=frozenset(fields.get("flags", "").split()),
                   mhz=_float(fields.get("cpu MHz")), cores=cores)

    def describe(self) -> str:
        """``AMD EPYC (family 26 model 2), 2 cores at 2596 MHz (avx512_vnni, avx512_bf16)``."""
        where = f" (family {self.family} model {self.model})" if self.family is not None else ""
        clock = f" at {self.mhz:.0f} MHz" if self.mhz else ""
        extras = [f for f in KERNEL_FLAGS if f in self.flags]
        return f"{self.name}{where}, {self.cores} cores{clock}" + (f" ({', '.join(extras)})" if extras else "")


@dataclass(frozen=True)
class CpuPeaks:
    """Arithmetic peaks of ``cores`` cores in GFLOP/s (fp32) and GOP/s (int8), and how they were reckoned."""

    fp32: float | None
    int8: float | None
    how: str


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def fp32_lanes(cpu: CpuInfo) -> int:
    """fp32 lanes per FMA pipe: 16 with AVX-512 on 512-bit pipes, 8 with AVX2 or on Zen 4, 4 otherwise."""
    if "avx512f" in cpu.flags:
        return 8 if (cpu.vendor == "AuthenticAMD" and cpu.family == 25) else 16
    return 8 if "avx2" in cpu.flags else 4


def cpu_peaks(cpu: CpuInfo, cores: int | None = None) -> CpuPeaks:
    """The fp32 and int8 peaks of ``cores`` (default: all this process may use) of ``cpu`` (see the module)."""
    cores = cores or cpu.cores
    if not cpu.mhz:
        return CpuPeaks(None, None, "no clock in /proc/cpuinfo: no peak")
    ghz, lanes = cpu.mhz / 1000, fp32_lanes(cpu)
    fp32 = cores * FMA_PIPES * lanes * 2 * ghz
    if "amx_int8" in cpu.flags:
        int8, int8_how = cores * AMX_INT8_MACS * 2 * ghz, f"AMX {AMX_INT8_MACS} int8 MACs/cycle"
    else:
        per_lane = 4 if cpu.flags & {"avx512_vnni", "avx_vnni"} else 2  # without VNNI: two instructions per 4 MACs
        int8 = cores * FMA_PIPES * lanes * per_lane * 2 * ghz
        int8_how = f"{per_lane} int8 MACs per 32-bit lane{' (VNNI)' if per_lane == 4 else ''}"
    how = (f"{cores} cores x {FMA_PIPES} pipes x {lanes} fp32 lanes x 2 x {ghz:.2f} GHz; int8: {int8_how}; "
           "clock from /proc/cpuinfo (nominal under a hypervisor)")
    return CpuPeaks(fp32, int8, how)


def cpu_name() -> str:
    """The CPU and the flags that decide which kernels run, for the line beside every figure."""
    return CpuInfo.read().describe()
