"""Running the Triton kernel checks: compiled for real on a CUDA GPU when one is present, else under
Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors.

The interpreter is chosen when kernels are decorated, so the checks run in a subprocess started
with the variable set (or, on a GPU, unset): the test file re-runs itself with ``--kernel-worker``
and prints one JSON report line, which the parent test reads back (one failing case does not hide
the others). The worker builds its inputs on the CPU and moves them with ``to_kernel_device``."""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
REPORT_PREFIX = "KERNEL_REPORT "
DEVICE_VARIABLE = "SPECJET_KERNEL_DEVICE"  # set for the worker: "cuda" (compiled) or "cpu" (interpreted)


def interpreted() -> bool:
    """In the worker: are the kernels running under the interpreter (CPU tensors)?"""
    return os.environ.get(DEVICE_VARIABLE, "cpu") == "cpu"


def to_kernel_device(obj):
    """``obj`` (a tensor, or dicts, lists, tuples and dataclasses holding tensors) on the worker's
    device: the inputs are built on the CPU with a seeded CPU generator either way."""
    import torch

    device = os.environ.get(DEVICE_VARIABLE, "cpu")
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: to_kernel_device(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_kernel_device(v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: to_kernel_device(getattr(obj, f.name))
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def report_cases(cases: dict, run_case) -> None:
    """In the worker subprocess: run every case, one JSON report line {case name: result dict};
    an exception is reported per case so one failure does not hide the others."""
    assert interpreted() == (os.environ.get("TRITON_INTERPRET") == "1")
    report = {}
    for name, case in cases.items():
        try:
            report[name] = run_case(case)
        except Exception as exc:
            report[name] = {"error": f"{type(exc).__name__}: {exc}"}
    print(REPORT_PREFIX + json.dumps(report))


def run_kernel_worker(test_file: str, timeout: int = 300) -> dict:
    """Run ``test_file --kernel-worker`` (compiled on a GPU, else interpreted) and return its report."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"triton cannot be imported: {exc}")
    import torch

    env = dict(os.environ)
    if torch.cuda.is_available():
        env.pop("TRITON_INTERPRET", None)
        env[DEVICE_VARIABLE] = "cuda"
    else:
        env["TRITON_INTERPRET"] = "1"
        env[DEVICE_VARIABLE] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), str(REPO_ROOT / "tests"),
                                                      env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, test_file, "--kernel-worker"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(REPORT_PREFIX)]
    assert proc.returncode == 0 and lines, f"kernel worker failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[-1].removeprefix(REPORT_PREFIX))
