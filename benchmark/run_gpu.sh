#!/usr/bin/env bash
# Tests and benchmark on the GPU machine, in one command of at most 10 minutes; logs, CSVs and plots go to $OUT.
#
#   bash benchmark/run_gpu.sh STEP...
#   STEP: tests | convergence | bench-quick | bench-compile | bench-part1 | bench-part2 | bench-optin | bench-sweep | bench-sweep-defaults
#         | profile | bench-dspine | bench-dspine-objective | bench-dspine-step | bench-dspine-accuracy
#         | profile-dspine | profile-dspine-objective | bench-masked-attention | bench-masked-attention-sweep | bench-frozen-head-kernels | host-per-call | profile-family | profile-compile | profile-compile-step | bench-family | bench-family-v32 | bench-family-v4 | bench-family-minicpm5 | bench-vocab-parallel | bench-family-v4-sweep | bench-capture | train-drafter | bench-drafter-acceptance
#         | train-drafter-fsdp | transformers-tests | bench-fp8-gemm | bench-fp8-quantize | profile-fp8-step | bench-fp8-step | bench-fp8-convergence
#         | bench-family-fp8
#
# The liger-kernel wheel is installed from .whl/ into /tmp/site (carry .whl). With NEW_TRANSFORMERS=1 the transformers
# and huggingface-hub wheels there are installed too (otherwise they are left out): models that only transformers 5.24
# has (deepseek_v32, glm_moe_dsa, ...). Download them here (pure-python wheels) with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform any -d .whl \
#     transformers==5.24.0 huggingface-hub==1.33.0
# (5.24 wants huggingface-hub >= 1.31; its other requirements, tokenizers, safetensors and regex, are 5.17's.)
# Every step runs under `timeout`
# inside one budget for the whole script, so the command ends in time and $OUT holds what finished.
# Environment (all optional):
#   OUT            where results go (default /tmp/liger-dspine-bench)
#   RUN_BUDGET_S   seconds for all steps together (default 570)
#   TEST_TIMEOUT_S cap of each pytest step (default 300)
#   PYTHON         interpreter (default python3)
#   WHEELS         folder of wheels to install (default .whl; none there: use what is installed)
#   NEW_TRANSFORMERS  1: also install the transformers / huggingface-hub wheels of $WHEELS (default 0)
#   BENCH_ARGS     extra arguments of the benchmark script (e.g. --tiny, --variant ...)
#   PYTEST_ARGS    extra arguments of pytest (split on spaces)
#   PROFILE_MODEL / PROFILE_IMPLS / PROFILE_OPTIONS  profile-family's model (deepseek_v2), implementations
#                  ("hf liger-dspine") and liger-dspine options (JSON; hf ignores them)
#   PROFILE_TOP    profile-compile-step: kernels, operators and peak allocations listed (default 30)
#   TF_TESTS_TIMEOUT_S  transformers-tests: seconds per pytest run (default: what is left, less 60)
#   MASKED_ATTENTION_BASELINE  bench-masked-attention: a file of another ops/masked_attention.py to measure too
#   FP8_QUANTIZE_BASELINE  bench-fp8-quantize: a file of another ops/fp8_quantize.py to measure too
#   PYTEST_K       a pytest -k expression (may contain spaces), e.g. "head_grouped or compile"; convergence
#                  runs "bf16 and (PYTEST_K)"
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
OUT=${OUT:-/tmp/liger-dspine-bench}
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
BUDGET=${RUN_BUDGET_S:-570}
TEST_TIMEOUT=${TEST_TIMEOUT_S:-300}
START=$(date +%s)
mkdir -p "$OUT" "$ROOT/benchmark/data"
exec > >(tee -a "$OUT/run.log") 2>&1
TEE_PID=$!

left() { echo $((BUDGET - ($(date +%s) - START))); }

wheels=()
for wheel in "$WHEELS"/*.whl; do
  [[ -e $wheel ]] || continue
  case ${wheel##*/} in
    transformers-* | huggingface_hub-*) [[ ${NEW_TRANSFORMERS:-0} == 1 ]] && wheels+=("$wheel") ;;
    *) wheels+=("$wheel") ;;
  esac
done
if ((${#wheels[@]})); then
  $PYTHON -m pip install -q --no-index --no-deps --upgrade --target /tmp/site "${wheels[@]}" || exit 1
  export PYTHONPATH=/tmp/site:$ROOT/src
else
  echo "no wheels in $WHEELS: using the installed liger-kernel"
  export PYTHONPATH=$ROOT/src
fi
export PYTHONUNBUFFERED=1

if command -v nvidia-smi >/dev/null; then nvidia-smi; fi
$PYTHON - <<'EOF'
import sys
from importlib import metadata

import torch

print("python", sys.version.split()[0])
for name in ("torch", "transformers", "huggingface-hub", "triton", "liger-kernel"):
    print(name, metadata.version(name))
print("cuda device:", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
EOF

run_pytest() {  # run_pytest LOGNAME K_EXPRESSION ARGS...; the expression is and-ed with $PYTEST_K
  local log=$1 k=$2 limit
  shift 2
  if [[ -n ${PYTEST_K:-} ]]; then k="${k:+$k and }($PYTEST_K)"; fi
  limit=$(left)
  limit=$((limit - 5 < TEST_TIMEOUT ? limit - 5 : TEST_TIMEOUT))
  LIGER_FUSED_MOE_AUTOTUNE=0 timeout -k 10 "$limit" $PYTHON -m pytest -q -p no:cacheprovider "$@" ${PYTEST_ARGS:-} \
    ${k:+-k "$k"} \
    2>&1 | tee "$OUT/$log"
  return "${PIPESTATUS[0]}"
}

run_bench() {  # run_bench ARGS...; copies what it wrote in benchmark/data to $OUT
  local limit marker script=${BENCH_SCRIPT:-benchmark/bench_deepseek_v3.py}
  limit=$(left)
  marker=$(mktemp)
  # shellcheck disable=SC2086
  timeout -k 10 $((limit - 5)) $PYTHON "$script" "$@" --budget-s $((limit - 25)) ${BENCH_ARGS:-}
  local status=$?
  find "$ROOT/benchmark/data" -type f -newer "$marker" -exec cp {} "$OUT"/ \;
  rm -f "$marker"
  return $status
}

for step in "$@"; do
  if (($(left) < 60)); then
    echo "=== $step skipped: $(left) s left of ${BUDGET} s"
    continue
  fi
  echo "=== $step ($(left) s left)"
  case $step in
    tests) run_pytest tests.log "" test -m cuda --ignore=test/convergence ;;
    convergence) run_pytest convergence.log bf16 test/convergence ;;
    bench-quick) run_bench --suite quick ;;
    # native and liger-dspine, eager and torch.compile, at 2 layers / 4096 (bench_compile.py): DeepSeek-V3, GLM-4.7-Flash-like
    bench-compile) BENCH_SCRIPT=benchmark/bench_compile.py run_bench --models deepseek_v3,glm4_moe_lite ;;
    bench-part1) run_bench --suite full --part 1 ;;
    bench-part2) run_bench --suite full --part 2 ;;
    # liger-dspine's defaults and its opt-in memory saver at the lengths of the memory goals
    bench-optin) run_bench --suite custom --impls liger-dspine --shapes 2x16384,2x32768 --name optin \
      --variant 'liger-dspine-recompute={"recompute_attention": true}' ;;
    # the longest sequence of liger-kernel and of liger-dspine with the opt-in, from a length both fit
    bench-sweep) run_bench --suite custom --impls liger --shapes "" --max-seq --sweep-start 131072 \
      --name sweep --variant 'liger-dspine-recompute={"recompute_attention": true}' ;;
    # the same for liger-dspine's defaults
    bench-sweep-defaults) run_bench --suite custom --impls liger,liger-dspine --shapes "" --max-seq --sweep-start 131072 \
      --name sweep_defaults ;;
    # where the time (8 layers / 4096) and the memory (2 layers / 16384) of a liger-dspine step go
    profile)
      LIGER_FUSED_MOE_AUTOTUNE=0 timeout -k 10 $(($(left) - 5)) $PYTHON benchmark/profile_step.py \
        --impl liger-dspine --layers 8 --seq 4096 2>&1 | tee "$OUT/profile_8x4096.txt"
      LIGER_FUSED_MOE_AUTOTUNE=0 timeout -k 10 $(($(left) - 5)) $PYTHON benchmark/profile_step.py \
        --impl liger-dspine --layers 2 --seq 16384 --no-time --memory-trace 2>&1 | tee "$OUT/profile_2x16384.txt" ;;
    # a step of bench-compile (2 layers, 4096; PROFILE_MODEL, default deepseek_v3), eager and torch.compile'd:
    # kernels and the peak's blocks
    profile-compile-step)
      for mode in "" --compile; do
        LIGER_FUSED_MOE_AUTOTUNE=0 timeout -k 10 $(($(left) - 5)) $PYTHON benchmark/profile_step.py --impl liger-dspine \
          --model "${PROFILE_MODEL:-deepseek_v3}" --layers 2 --seq 4096 --peak-blocks --top "${PROFILE_TOP:-30}" $mode 2>&1 \
          | tee "$OUT/profile_compile_step_${PROFILE_MODEL:-deepseek_v3}${mode:+_compiled}.txt"
      done ;;
    # a DeepSeek-family step at the family benchmark's depth and widths, 4096 tokens, transformers and liger-dspine
    # (with the benchmark's options); PROFILE_MODEL picks the model (default deepseek_v2)
    profile-family)
      for impl in ${PROFILE_IMPLS:-hf liger-dspine}; do
        LIGER_FUSED_MOE_AUTOTUNE=0 timeout -k 10 $(($(left) - 5)) $PYTHON benchmark/profile_step.py \
          --model "${PROFILE_MODEL:-deepseek_v2}" --impl $impl --seq 4096 --top 25 \
          ${PROFILE_OPTIONS:+--options "$PROFILE_OPTIONS"} 2>&1 | tee -a "$OUT/profile_family.txt"
      done ;;
    # where the time of the fused DSpine objective (both widths) and the memory of a DSpine step go
    profile-dspine)
      for width in "7168 129280" "4096 151936"; do
        read -r hidden vocab <<<"$width"
        timeout -k 10 $(($(left) - 5)) $PYTHON benchmark/profile_dspine.py --part objective --hidden "$hidden" \
          --vocab "$vocab" 2>&1 | tee -a "$OUT/profile_dspine_objective.txt"
      done
      for rows in "" 512; do
        timeout -k 10 $(($(left) - 5)) $PYTHON benchmark/profile_dspine.py --part step \
          ${rows:+--head-chunk-rows $rows} 2>&1 | tee -a "$OUT/profile_dspine_step.txt"
      done ;;
    # the fused objective at 7168 / 129280 for each head chunk height of PROFILE_ROWS ("default": the op's choice),
    # with the operators behind its kernels, and the head GEMMs alone at several chunk heights (both widths)
    profile-dspine-objective)
      for rows in ${PROFILE_ROWS:-default}; do
        [[ $rows == default ]] && rows=""
        timeout -k 10 $(($(left) - 5)) $PYTHON benchmark/profile_dspine.py --part objective ${rows:+--head-chunk-rows $rows} \
          2>&1 | tee -a "$OUT/profile_dspine_objective.txt"
      done
      for width in "7168 129280" "4096 151936"; do
        read -r hidden vocab <<<"$width"
        timeout -k 10 $(($(left) - 5)) $PYTHON benchmark/profile_dspine.py --part gemm --hidden "$hidden" --vocab "$vocab" \
          2>&1 | tee -a "$OUT/profile_dspine_gemm.txt"
      done ;;
    # DSpine: the objective alone at two widths, the whole step in four variants and three modes, accuracy vs fp32
    bench-dspine) BENCH_SCRIPT=benchmark/bench_dspine.py run_bench --part all --name dspine ;;
    bench-dspine-objective) BENCH_SCRIPT=benchmark/bench_dspine.py run_bench --part objective --name dspine_objective ;;
    bench-dspine-step) BENCH_SCRIPT=benchmark/bench_dspine.py run_bench --part step --name dspine_step ;;
    bench-dspine-accuracy) BENCH_SCRIPT=benchmark/bench_dspine.py run_bench --part accuracy --name dspine_accuracy ;;
    # DSpine target capture against output_hidden_states=True: DeepSeek-V3 widths, 2 layers, 4096 tokens
    bench-capture) BENCH_SCRIPT=benchmark/bench_capture.py run_bench --name capture ;;
    # the DeepSeek family at 2 layers of real widths (bench_family.py): family.csv / .md / .png; each model's rows
    # replace its old ones, so the two steps fill one table (bench-family-v32 needs NEW_TRANSFORMERS=1)
    bench-family) BENCH_SCRIPT=benchmark/bench_family.py run_bench --models deepseek_v2,glm4_moe_lite ;;
    bench-family-v32) BENCH_SCRIPT=benchmark/bench_family.py run_bench --models deepseek_v32 ;;
    # DeepSeek-V4-Flash-like at 3 layers (needs NEW_TRANSFORMERS=1 for 5.24's V4, or 5.17's); liger-dspine with its
    # defaults (the attention kernel and hyper-connections included)
    bench-family-v4) BENCH_SCRIPT=benchmark/bench_family.py run_bench --models deepseek_v4 ;;
    # the longest sequence of each implementation at batch 1 (V4's 3-layer plan, to 1024 tokens)
    bench-family-v4-sweep) BENCH_SCRIPT=benchmark/bench_family.py run_bench --models deepseek_v4 --sweep-only ;;
    # MiniCPM5-MoE-like at 2 layers, 4096 and 16384 tokens (needs NEW_TRANSFORMERS=1 with transformers 5.25 in .whl)
    bench-family-minicpm5) BENCH_SCRIPT=benchmark/bench_family.py run_bench --models minicpm5_moe ;;
    # the loss on a tensor-parallel lm_head, one rank's share: logits path against the vocabulary-parallel fused loss
    bench-vocab-parallel) BENCH_SCRIPT=benchmark/bench_vocab_parallel_ce.py run_bench ;;
    # every Triton compilation of a cold first step at 4096 and of a first step at 6144 (PROFILE_MODEL, default V4)
    profile-compile)
      timeout -k 10 $(($(left) - 5)) $PYTHON benchmark/profile_compile.py --model "${PROFILE_MODEL:-deepseek_v4}" \
        --seq 4096 --second-seq 6144 2>&1 | tee -a "$OUT/profile_compile.txt" ;;
    # DeepSeek-V4's attention kernel alone against transformers' eager attention, per layer kind (4096 tokens)
    bench-sink-attention) BENCH_SCRIPT=benchmark/bench_sink_attention.py run_bench ;;
    # launch settings of the DSpine refinement loss's candidate-score kernels
    bench-candidate-scores) BENCH_SCRIPT=benchmark/bench_candidate_scores.py run_bench ;;
    # DSpine's draft-block attention alone: sdpa against the masked-attention kernel (bench_masked_attention.py)
    # (MASKED_ATTENTION_BASELINE: another version of ops/masked_attention.py, measured beside it)
    bench-masked-attention) BENCH_SCRIPT=benchmark/bench_masked_attention.py run_bench \
      ${MASKED_ATTENTION_BASELINE:+--baseline "$MASKED_ATTENTION_BASELINE"} ;;
    # the fused objective's logit kernels on one chunk: stats and gradient launch settings, top-k kernel vs torch
    bench-frozen-head-kernels) BENCH_SCRIPT=benchmark/bench_frozen_head_kernels.py run_bench ;;
    # the masked-attention kernels under each candidate of tile sizes and launch settings
    bench-masked-attention-sweep) BENCH_SCRIPT=benchmark/bench_masked_attention.py run_bench --sweep ;;
    # the host's time per call of one RMSNorm by each route (aten, liger-kernel, the custom op with and without
    # torch's dispatcher)
    host-per-call) timeout -k 10 $(($(left) - 5)) $PYTHON benchmark/host_per_call.py 2>&1 | tee -a "$OUT/host_per_call.txt" ;;
    # train-drafter: slim DeepSeek-V3 target at real widths (4 layers, taps 0-3), 2-layer drafter, embedded text, 50
    # steps; prints step time, peak memory and the capture's share; passes when the last-10 mean loss is >= 10% lower
    train-drafter) BENCH_SCRIPT=benchmark/bench_train_drafter.py run_bench ;;
    # drafter quality, native against Liger training, and spec_generate against target.generate (4-layer V3 target)
    bench-drafter-acceptance) BENCH_SCRIPT=benchmark/bench_drafter_acceptance.py run_bench ;;
    # the GEMMs of a DeepSeek-V3 layer, bf16 against the FP8 rowwise ops (forward + backward, quantisation included)
    bench-fp8-gemm) BENCH_SCRIPT=benchmark/bench_fp8_gemm.py run_bench --profile ;;
    # the FP8 quantisers alone at the step's shapes: GB/s against a copy of the same bytes
    # where the FP8 step's time goes, beside the bf16 defaults' (8 layers, 4096 tokens): kernels by category
    profile-fp8-step)
      for options in '{}' '{"fp8": true}'; do
        timeout -k 10 $(($(left) - 5)) $PYTHON benchmark/profile_step.py --impl liger-dspine --layers 8 --seq 4096 \
          --top 40 --options "$options"
      done 2>&1 | tee "$OUT/profile_fp8_step.txt" ;;
    bench-fp8-quantize) BENCH_SCRIPT=benchmark/bench_fp8_quantize.py \
      run_bench ${FP8_QUANTIZE_BASELINE:+--baseline "$FP8_QUANTIZE_BASELINE"} ;;
    # the DeepSeek-V3 step with fp8=True beside the bf16 defaults, side by side (2 and 8 layers, 4096 tokens)
    bench-fp8-step) run_bench --suite custom --impls liger-dspine --shapes 2x4096,8x4096 --name fp8_step \
      --variant 'liger-dspine-fp8={"fp8": true}' ;;
    # the 2-layer DeepSeek-V3 trained 300 AdamW steps with the bf16 defaults, then fp8=True: end losses within 0.5%?
    bench-fp8-convergence) BENCH_SCRIPT=benchmark/bench_fp8_convergence.py run_bench ;;
    # the DeepSeek-V2-Lite-like and GLM-4.7-Flash-like steps with fp8=True beside liger-dspine's defaults
    bench-family-fp8) BENCH_SCRIPT=benchmark/bench_family.py run_bench --models deepseek_v2,glm4_moe_lite \
      --impls liger-dspine --name family_fp8 --variant 'fp8={"fp8": true}' ;;
    # train-drafter's sharded paths on CUDA with NCCL, one rank: FSDP2 drafter and FSDP2 target, then a resume
    train-drafter-fsdp)
      rm -rf /tmp/train-drafter-fsdp
      for extra in "--steps 4 --save-every 2" "--steps 6 --resume"; do
        # shellcheck disable=SC2086
        timeout -k 10 $(($(left) - 5)) $PYTHON -m torch.distributed.run --standalone --nproc-per-node 1 \
          -m liger_dspine.cli train-drafter --tiny --drafter-parallel fsdp --target-parallel fsdp \
          --output-dir /tmp/train-drafter-fsdp $extra 2>&1 | tee -a "$OUT/train_drafter_fsdp.log" || break
      done ;;
    # transformers' own model tests natively and patched (benchmark/transformers_model_tests.py), all eight runs
    # at once; TF_TREE: a transformers tree with tests/ (carry it), by default .tf-tree
    transformers-tests)
      # its test_pipeline_mixin.py imports the tree's src/transformers: the installed one
      tree=${TF_TREE:-.tf-tree}
      mkdir -p "$tree/src"
      ln -sfn "$($PYTHON -c 'import os, transformers; print(os.path.dirname(transformers.__file__))')" "$tree/src/transformers"
      limit=$(left)
      # USE_HUB_KERNELS=NO: no hub kernels (no network here), for the native and the patched run alike
      USE_HUB_KERNELS=NO timeout -k 10 $((limit - 5)) $PYTHON benchmark/transformers_model_tests.py --tree "$tree" \
        --models deepseek_v3,deepseek_v2,glm4_moe_lite,deepseek_v4 --jobs 8 --timeout "${TF_TESTS_TIMEOUT_S:-$((limit - 60))}" \
        --out-dir "$OUT/transformers_model_tests"
      tar -C "$OUT" -czf "$OUT/transformers_model_tests.tar.gz" transformers_model_tests && rm -r "$OUT/transformers_model_tests" ;;
    *) echo "unknown step $step (tests | convergence | bench-quick | bench-compile | bench-part1 | bench-part2 | bench-optin | bench-sweep | bench-sweep-defaults | profile | profile-dspine | profile-dspine-objective | profile-family | profile-compile | bench-dspine* | bench-family* | bench-sink-attention | bench-candidate-scores | bench-masked-attention | bench-capture | train-drafter | bench-drafter-acceptance | train-drafter-fsdp | transformers-tests | bench-fp8-gemm | bench-fp8-quantize | profile-fp8-step | bench-fp8-step | bench-fp8-convergence)" ;;
  esac
  echo "=== $step: exit code $?, $(($(date +%s) - START)) s since the start"
done
ls -l "$OUT"
exec >&- 2>&-
wait "$TEE_PID"
