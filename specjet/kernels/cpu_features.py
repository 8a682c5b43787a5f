"""What the CPU in hand can do, for choosing a dtype and for describing the machine in reports.

The choice that matters is bf16 vs fp32. With native bf16 matrix instructions (AVX-512 BF16 or
AMX-BF16) a bf16 matmul runs at least as fast as an fp32 one and speculation gains most in bf16;
without them (AVX2-only CPUs, AVX-512 without BF16) oneDNN and ATen emulate bf16 by converting to
fp32 and back, which makes a bf16 decode step several times slower than an fp32 one.

``SPECJET_CPU_NATIVE_BF16=0`` (or ``1``) overrides the detection, to simulate the other kind of CPU;
with ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` the kernels then run as on an AVX2-only CPU.
"""
from __future__ import annotations

import functools
import os
import pathlib
import platform
import subprocess

import torch

NATIVE_BF16_ENV = "SPECJET_CPU_NATIVE_BF16"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
# /proc/cpuinfo flags of native bf16 matrix instructions (x86).
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    fields: dict[str, str] = {}
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's model name: /proc/cpuinfo, else ``lscpu``, else ``platform.processor()``."""
    name = _cpuinfo().get("model name")
    if name:
        return name
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_flags() -> frozenset[str]:
    """The instruction-set flags /proc/cpuinfo lists (empty where it does not exist)."""
    return frozenset(_cpuinfo().get("flags", "").split())


def _override() -> bool | None:
    value = os.environ.get(NATIVE_BF16_ENV, "").strip().lower()
    if not value:
        return None
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{NATIVE_BF16_ENV}={value!r}: use 0 or 1")


@functools.lru_cache(maxsize=1)
def _detect_native_bf16() -> bool:
    flags = cpu_flags()
    hardware = (any(f in flags for f in BF16_FLAGS) if flags else
                torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    # oneDNN runs the bf16 matmuls; an ISA cap on it (ONEDNN_MAX_CPU_ISA=AVX2) leaves them emulated.
    return hardware and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def has_native_bf16() -> bool:
    """Whether bf16 matmuls run on native bf16 instructions here (AVX-512 BF16 or AMX), after the
    ``SPECJET_CPU_NATIVE_BF16`` override."""
    override = _override()
    return _detect_native_bf16() if override is None else override


def vector_isa() -> str:
    """The vector instruction set ATen dispatches to (it honours ``ATEN_CPU_CAPABILITY``), plus AMX."""
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2", "DEFAULT", ...
    isa = {"AVX512": "AVX-512", "DEFAULT": "no SIMD dispatch"}.get(capability, capability)
    if "amx_tile" in cpu_flags() and capability == "AVX512":
        isa += " + AMX"
    return isa


def cpu_generation() -> str:
    """``family F model M`` of an x86 CPU ("" where /proc/cpuinfo has no such fields): a virtual machine may
    name its CPU only "AMD EPYC", and two generations of it differ twofold in bf16 throughput."""
    info = _cpuinfo()
    family, model = info.get("cpu family"), info.get("model")
    return f"family {family} model {model}" if family and model else ""


def describe_cpu() -> str:
    """The CPU in one line, e.g. ``AMD EPYC 9R14, family 25 model 17 (AVX-512, native bf16)``."""
    bf16 = "native bf16" if has_native_bf16() else "no native bf16: bf16 emulated"
    override = " [forced]" if _override() is not None else ""
    generation = cpu_generation()
    return f"{cpu_model()}{', ' + generation if generation else ''} ({vector_isa()}, {bf16}{override})"
