"""Running Triton kernel checks under the interpreter (TRITON_INTERPRET=1) on CPU tensors.

The interpreter is chosen when kernels are decorated, so the checks run in a subprocess started
with the variable set: the test file re-runs itself with ``--kernel-worker`` and prints one JSON
report line, which the parent test reads back (one failing case does not hide the others)."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
REPORT_PREFIX = "KERNEL_REPORT "


def report_cases(cases: dict, run_case) -> None:
    """In the worker subprocess: run every case, one JSON report line {case name: result dict};
    an exception is reported per case so one failure does not hide the others."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    report = {}
    for name, case in cases.items():
        try:
            report[name] = run_case(case)
        except Exception as exc:
            report[name] = {"error": f"{type(exc).__name__}: {exc}"}
    print(REPORT_PREFIX + json.dumps(report))


def run_kernel_worker(test_file: str, timeout: int = 300) -> dict:
    """Run ``test_file --kernel-worker`` under the interpreter and return its report."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"triton cannot be imported: {exc}")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), str(REPO_ROOT / "tests"),
                                                      env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, test_file, "--kernel-worker"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(REPORT_PREFIX)]
    assert proc.returncode == 0 and lines, f"kernel worker failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[-1].removeprefix(REPORT_PREFIX))
