#!/usr/bin/env bash
# Early CUDA check: the CUDA-marked tests of the kernels and the patch, and the bf16 convergence tests.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 LIGER_FUSED_MOE_AUTOTUNE=0
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)"
timeout 420 python3 -m pytest -q -p no:cacheprovider -x -m cuda test/transformers/ops/test_interleaved_rope.py test/transformers/ops/test_moe_router.py test/convergence 2>&1 | tee $OUT/cuda_tests.log | tail -40
