#!/usr/bin/env bash
# Prepares, on this machine, what scripts/gpu_check.sh needs on a lent GPU machine (see its header).
# The device tool sends the working tree (tracked files, and the ignored paths a call names in
# `carry`) and at most 64 MiB a call; the GPU image has its own python3 with CUDA torch and triton,
# no registry, and not this project's other packages nor the default model.
#
#   scripts/gpu_prepare.sh              wheels (.whl/), tokenizer + config (.gpu/tok/), data (.gpu/data/)
#                                       and the GGUF xz-compressed in two halves (.gpu/part1, .gpu/part2);
#                                       with OLD=<commit>, that commit's specjet/ and bench/ in .gpu/old
#                                       (carry it in the first call; gpu_check.sh's bench with TREE=old)
#   scripts/gpu_prepare.sh hide-assets  untrack specjet/assets (22 MB) for the first call, which carries
#                                       the GGUF's first half and does not need the drafts' weights
#   scripts/gpu_prepare.sh show-assets  track them again (right after that call: nothing is committed)
#
# The calls, back to back (a machine stays warm 30 s; a carried path does not outlive its call, so
# the first call copies the first half to /tmp there):
#   1. hide-assets; run `bash scripts/gpu_check.sh tests`, carry .whl .gpu/tok .gpu/data .gpu/part1 (~4.5 min of
#      tests after the machine's start: give the call a timeout_s of 420 or more)
#   2. show-assets; run `bash scripts/gpu_check.sh bench`, carry .gpu/part2 .gpu/data; more phases in the same call
#      (at most 8 files come back from $OUT), e.g. `O=$OUT; OUT=$O/bf16 JSONL=0 BATCH_SIZES="1 4" EAGER=0 REPEATS=1
#      bash scripts/gpu_check.sh bench; OUT=$O bash scripts/gpu_check.sh heldout; OUT=$O bash scripts/gpu_check.sh prediction`
#      (~3.5 min; the profile phase adds ~1 min)
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
exclude=.git/info/exclude

case "${1:-prepare}" in
  hide-assets)
    git rm -r -q --cached specjet/assets
    grep -qx '/specjet/assets/' "$exclude" || echo '/specjet/assets/' >> "$exclude"
    echo "specjet/assets untracked for the next call; run '$0 show-assets' right after it"
    exit 0 ;;
  show-assets)
    git reset -q -- specjet/assets
    sed -i '\#^/specjet/assets/$#d' "$exclude"
    git status --short specjet/assets
    exit 0 ;;
  prepare) ;;
  *) echo "usage: $0 [prepare|hide-assets|show-assets]" >&2; exit 2 ;;
esac

for path in /.whl/ /.gpu/; do grep -qx "$path" "$exclude" || echo "$path" >> "$exclude"; done
rm -rf .whl .gpu && mkdir -p .whl .gpu/tok .gpu/data

# The packages the GPU image lacks (xgrammar and what it needs, gguf for the GGUF conversion,
# jsonschema for the output checks), at this environment's versions, built for its Python 3.12.
packages="xgrammar apache-tvm-ffi gguf pydantic pydantic_core annotated-types typing-inspection jsonschema
          jsonschema-specifications referencing rpds-py"
pins=$(for p in $packages; do printf '%s==%s ' "$p" "$($py -m pip show "$p" | awk '/^Version:/{print $2}')"; done)
$py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl $pins

model_dir=$($py -c "from specjet.models.weights import resolve_model_path; print(resolve_model_path(None))")
cp "$model_dir"/{config.json,generation_config.json,tokenizer.json,tokenizer_config.json} .gpu/tok/
head -40 ../shared/data/gsm8k/test.jsonl > .gpu/data/gsm8k.jsonl
cp -r ../shared/data/jsonschema .gpu/data/

gguf=$($py -c "from specjet.models.weights import default_gguf_path; print(default_gguf_path())")
if [ -n "${OLD:-}" ]; then
  # An older commit's code for an A/B on one GPU host (~1.4 MB without the drafts' weights and RESULTS).
  mkdir -p .gpu/old && git archive "$OLD" specjet bench | tar -x -C .gpu/old
  rm -rf .gpu/old/specjet/assets .gpu/old/bench/RESULTS.md
fi
xz -T0 -9e -c "$gguf" | split -b 51000000 -a 1 --numeric-suffixes=1 - .gpu/part
du -sh .whl .gpu/tok .gpu/data .gpu/part1 .gpu/part2 $( [ -d .gpu/old ] && echo .gpu/old )
