#!/usr/bin/env bash
# The patched DeepSeek-V3 against native under each multi-GPU engine: bf16 loss curves over 20 steps, tokens/s and
# peak memory per rank, on N GPUs of one host (NCCL).
#
#   bash benchmark/run_multi_gpu.sh [--dry-run] [--nproc N] [--steps S] [ENGINE...]
#   ENGINE: ddp tp ep fsdp2 tp_fsdp ep_fsdp zero3 (default: all; tp_fsdp and ep_fsdp need N >= 4)
#
# --dry-run checks the script on CPU: gloo, fp32, a tiny model, 2 steps, 2 ranks (4 for the 2-D engines).
# Results: $OUT (default benchmark/data/multi_gpu; for --dry-run $TMPDIR/multi_gpu_dry_run): one JSON per engine and implementation, multi_gpu.csv,
# multi_gpu.md and multi_gpu.png (loss curves), from benchmark/multi_gpu_report.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
dry_run=0
nproc=${NPROC:-$(${PYTHON} -c "import torch; print(max(torch.cuda.device_count(), 2))")}
steps=20
engines=()
while (($#)); do
  case $1 in
    --dry-run) dry_run=1 ;;
    --nproc) nproc=$2; shift ;;
    --steps) steps=$2; shift ;;
    -*) echo "run_multi_gpu.sh: unknown option $1" >&2; exit 2 ;;
    *) engines+=("$1") ;;
  esac
  shift
done
((${#engines[@]})) || engines=(ddp tp ep fsdp2 tp_fsdp ep_fsdp zero3)
OUT=${OUT:-$( ((dry_run)) && echo "${TMPDIR:-/tmp}/multi_gpu_dry_run" || echo benchmark/data/multi_gpu)}
mkdir -p "$OUT"
extra=()
if ((dry_run)); then
  extra=(--tiny)
  steps=2
  export LIGER_DSPINE_INTERPRET=1 GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
for engine in "${engines[@]}"; do
  ranks=$nproc
  case $engine in
    tp_fsdp | ep_fsdp) if ((dry_run)); then ranks=4; elif ((nproc < 4)); then
        echo "=== $engine skipped: needs 4 or more GPUs"; continue; fi ;;
    *) if ((dry_run)); then ranks=2; fi ;;
  esac
  for impl in native liger-dspine; do
    echo "=== $engine $impl on $ranks ranks"
    ${PYTHON} -m torch.distributed.run --standalone --nproc-per-node "$ranks" benchmark/multi_gpu_train.py \
      --engine "$engine" --impl "$impl" --steps "$steps" --out "$OUT" "${extra[@]}"
  done
done
${PYTHON} benchmark/multi_gpu_report.py "$OUT" $( ((dry_run)) && echo --no-plot)
