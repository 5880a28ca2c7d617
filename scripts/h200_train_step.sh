#!/usr/bin/env bash
# H200: the training step at the Qwen3-0.6B shape (issue 17) — GPU kernel tests, the loss
# microbenchmark and `python -m dspark.bench.train_step` over its variants. Needs nothing staged:
# the target is random; the missing wheels travel in .whl (see ../shared/GPU.md for how).
#   bash scripts/h200_train_step.sh [variants]   # results under $OUT (or outputs/h200/train_step)
set -euo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export DSPARK_COMMIT=${DSPARK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
R=${OUT:-outputs/h200/train_step}
mkdir -p "$R"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$R/machine.txt"
python3 -m pytest -p no:cacheprovider -m gpu tests/test_kernels.py -k "fused_loss" 2>&1 | tee "$R/gpu_tests.log" | tail -4
python3 -m dspark.kernels.bench_fused_loss --out "$R/fused_loss.json" 2>&1 | tail -7
python3 -m dspark.bench.train_step --variants "${1:-default,materialized,dense,flex,compiled,flex+compiled}" \
  --out "$R/train_step.json" 2>&1 | tee "$R/train_step.log" | grep -v Warning | tail -14
