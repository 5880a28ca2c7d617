#!/usr/bin/env bash
# H200 run, part 2 of 2: train DFlash and Eagle3 on the same data for the same time, evaluate all
# three on the six benchmarks (T=1.0, γ=7; STS fitted for DSpark), replay the rounds through the
# schedulers, and pack the results for the trip back.
set -euo pipefail
export PYTHONPATH=/root/stage/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
T="target=smollm2_135m target.path=/root/stage target.device=cuda"
DATA="data=full data.num_prompts=${NUM_PROMPTS:-3000} data.max_length=1024 data.anchors_per_sequence=128"
TRAIN="trainer=gpu trainer.max_time=${TRAIN_TIME:-00:00:02:00} trainer.max_steps=100000 trainer.val_check_interval=200"
for d in dflash eagle3; do
  python3 -m dspark.train $T $DATA $TRAIN drafter=$d hydra.run.dir=outputs/h200/$d 2>&1 | tail -3
done
EVAL="benchmarks=[gsm8k,math500,aime25,humaneval,mbpp,mt-bench] temperature=1.0 max_prompts=${EVAL_PROMPTS:-16} max_new_tokens=192 concurrency=16"
python3 -m dspark.evaluate $T $EVAL drafter_dir=outputs/h200/dspark/drafter policy=fixed policy.gamma=null calibrate=true hydra.run.dir=outputs/h200/eval_dspark 2>&1 | tail -3
for d in dflash eagle3; do
  python3 -m dspark.evaluate $T $EVAL drafter_dir=outputs/h200/$d/drafter policy=fixed policy.gamma=null hydra.run.dir=outputs/h200/eval_$d 2>&1 | tail -3
done
python3 -m dspark.schedule mode=analytical rounds=outputs/h200/eval_dspark hydra.run.dir=outputs/h200/schedule 2>&1 | tail -3 || true
tar czf "$OUT/runs.tgz" --exclude='*.safetensors' --exclude='*.ckpt' --exclude='*.pt' outputs/h200
ls -la "$OUT"
