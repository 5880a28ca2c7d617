#!/usr/bin/env bash
# H200 run, part 1 of 2: install, prepare target-written data, train DSpark-Markov.
# Needs the SmolLM2 GGUF and the missing wheels staged under /root/stage beforehand.
set -euo pipefail
export PYTHONPATH=/root/stage/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -20
T="target=smollm2_135m target.path=/root/stage target.device=cuda"
DATA="data=full data.num_prompts=${NUM_PROMPTS:-3000} data.max_length=1024 data.anchors_per_sequence=128"
TRAIN="trainer=gpu trainer.max_time=${TRAIN_TIME:-00:00:02:00} trainer.max_steps=100000 trainer.val_check_interval=200"
mkdir -p outputs/h200  # ignored by git, so it survives between calls on a held machine
# Sanity first (seconds): the tiny target trains and decodes on CUDA.
TINY="target=tiny target.device=cuda target.tiny.tokenizer.path=/root/stage"
python3 -m dspark.train experiment=cpu_smoke $TINY trainer=gpu trainer.max_steps=4 \
  hydra.run.dir=outputs/h200/smoke 2>&1 | tail -20
python3 -m dspark.evaluate $TINY drafter_dir=outputs/h200/smoke/drafter benchmarks=[gsm8k] \
  max_prompts=2 max_new_tokens=8 hydra.run.dir=outputs/h200/smoke_eval 2>&1 | tail -20
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee outputs/h200/machine.txt
python3 -m dspark.prepare $T $DATA hydra.run.dir=outputs/h200/prepare 2>&1 | tail -5
python3 -m dspark.train $T $DATA $TRAIN drafter=dspark hydra.run.dir=outputs/h200/dspark 2>&1 | tail -5
