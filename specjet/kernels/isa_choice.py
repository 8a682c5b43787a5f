"""Which instruction set a kernel module of specjet's runs: the one an environment variable names, checked against
what this CPU and the built extension offer, else the module's own preference.

Shared by kernels/bf16_gemm.py, kernels/fp32_gemm.py and kernels/qgemm.py, whose ``SPECJET_*`` variables force one
build of their kernels (or oneDNN's path) for measurements and tests.
"""
from __future__ import annotations

import os

from specjet.kernels import cpu_ops


def offered_isas(isas: dict[str, int], probe: str, kernel: str) -> list[str]:
    """The names of ``isas`` (name -> the extension's code; code 0: oneDNN's path, always offered) whose code the
    extension's ``probe`` says this CPU runs, where the extension has ``kernel`` at all."""
    ext = cpu_ops.extension()
    runs = ext is not None and hasattr(ext, kernel)
    return [name for name, code in isas.items() if code == 0 or (runs and getattr(ext, probe)(code))]


def forced_isa(env: str, isas, available: list[str]) -> str | None:
    """The instruction set ``env`` names, or None where it is unset; an unknown name, or one not in ``available``,
    is refused with the reason."""
    forced = os.environ.get(env, "").strip().lower()
    if not forced:
        return None
    if forced not in isas:
        raise ValueError(f"{env}={forced!r}: use one of {', '.join(isas)}")
    if forced not in available:
        raise ValueError(f"{env}={forced!r}: this CPU (or a missing extension) does not run it")
    return forced
