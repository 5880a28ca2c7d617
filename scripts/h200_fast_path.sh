#!/usr/bin/env bash
# H200: the fast engine's GPU tests and benchmarks (issue #8), in two back-to-back calls on one held
# machine (it keeps outputs/ between calls while warm). Needs /root/stage (the GGUF and wheels staged
# beforehand); the benchmark prompts ship with the package.
#   bash scripts/h200_fast_path.sh 1   # GPU tests, SPS(B), prepare data, train DSpark (~9 min)
#   bash scripts/h200_fast_path.sh 2   # end-to-end tok/s: target-only vs DSpark, same engine (~4 min)
#   bash scripts/h200_fast_path.sh 3   # prepare + train + end-to-end in one call (~7 min)
set -euo pipefail
export PYTHONPATH=/root/stage/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export DSPARK_COMMIT=${DSPARK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}  # pass it: a copied .git may be stale
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -5
T="target=smollm2_135m target.path=/root/stage target.device=cuda"
R=outputs/h200/fast
mkdir -p $R
E2E="--drafter-dir $R/dspark/drafter --benchmark gsm8k --prompts 32 --concurrency 1,64,256 \
  --max-new-tokens 128 --temperature 0 --policies fixed,hardware_aware --cost-table $R/cost_table.json"
DATA="data=full data.num_prompts=${NUM_PROMPTS:-2000} data.max_length=1024 data.anchors_per_sequence=128"
train() {
  python3 -m dspark.prepare $T $DATA hydra.run.dir=$R/prepare 2>&1 | tail -3
  python3 -m dspark.train $T $DATA trainer=gpu trainer.max_time=${TRAIN_TIME:-00:00:03:30} \
    trainer.max_steps=100000 trainer.val_check_interval=200 drafter=dspark head=markov \
    hydra.run.dir=$R/dspark 2>&1 | tail -3
}
e2e() {  # the drafter in the target's precision; in float32 if that fails
  # Cost table with the draft step too (the hardware-aware policy charges T_draft(R) + T_verify(B)).
  python3 -m dspark.bench.engine_sps $T target.dtype=bfloat16 --context 512 --no-hf --temperature 0 --drafter-dir $R/dspark/drafter \
    --out $R/engine_sps_draft.json --cost-table $R/cost_table.json 2>&1 | tee $R/engine_sps_draft.log | tail -12
  python3 -m dspark.bench.e2e $T target.dtype=bfloat16 $E2E --out $R/e2e.json 2>&1 | tee $R/e2e.log | tail -14 ||
    python3 -m dspark.bench.e2e $T target.dtype=bfloat16 $E2E --drafter-dtype float32 --out $R/e2e.json 2>&1 |
    tee $R/e2e_fp32.log | tail -14
}
if [ "${1:-1}" = 1 ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/machine.txt
  python3 -m pytest -p no:cacheprovider -m gpu tests/test_fast_engine.py tests/test_kernels.py \
    2>&1 | tee $R/gpu_tests.log | tail -5
  python3 -m dspark.bench.engine_sps $T target.dtype=bfloat16 --context 512 --temperature 0 \
    --out $R/engine_sps.json --cost-table $R/cost_table.json 2>&1 | tee $R/engine_sps.log | tail -24
  train
elif [ "$1" = 2 ]; then
  e2e
else
  train
  e2e
fi
