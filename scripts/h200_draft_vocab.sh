#!/usr/bin/env bash
# H200 / H100, issue 18: what a draft vocabulary (decoding.draft_vocab: the drafter drafts among the K
# most frequent tokens of its training answers) buys, with a trained drafter (on an H100, 2026-12-07-b:
# each engine_sps run 44-72 s, each e2e run at R = 1,64,256 92-101 s; K = 0 and 16 384 at T = 0: 309 s):
#   1. per K of VOCAB_SIZES (default "0 16384 32768"; 0: the whole vocabulary) the draft step per row
#      count and drafted length, and the verify steps beside it, at T = 0 (python -m dspark.bench.engine_sps
#      --draft-vocab K, the e2e prompts' mean context, ROUND_CONTEXT, default 172): the draft step's share
#      of the verify step, the goal being <= 25 %;
#   2. per temperature (VOCAB_TEMPERATURES, default "0 1") and K of VOCAB_E2E_SIZES (default "0 16384")
#      python -m dspark.bench.e2e: target-only against fixed γ (VOCAB_POLICIES, default fixed) at
#      R = VOCAB_CONCURRENCY (default 1,64,256), gsm8k, 32 prompts, 128 new tokens: τ (what the tokens
#      the vocabulary leaves out cost the acceptance) and the speeds.
# An empty list skips its part (VOCAB_E2E_SIZES="": the step times alone).
# Needs /root/stage (SmolLM2 and the wheels) and a drafter folder trained by this version (its
# token_counts.safetensors), or VOCAB_COUNTS=<the data folder it was trained on>:
#   bash scripts/h200_draft_vocab.sh [drafter folder]       # default outputs/h200/dspark/drafter
# VOCAB_FRESH="drafter=dspark head=markov" (train overrides) builds an untrained drafter there first
# where none is: the steps' times do not depend on the weights (give VOCAB_COUNTS; its e2e τ means
# nothing, so leave VOCAB_E2E_SIZES empty).
# Writes into $OUT (default outputs/h200/out/draft_vocab): engine_sps_K<K>_T0.json, e2e_K<K>_T<t>.json,
# log.txt. Each run has its own time limit and writes as it goes.
set -uo pipefail
export PYTHONPATH=/root/stage/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export DSPARK_COMMIT=${DSPARK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
DRAFTER=${1:-outputs/h200/dspark/drafter}
OUT=${OUT:-outputs/h200/out/draft_vocab}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
T="target=${TARGET:-smollm2_135m} target.path=/root/stage target.device=cuda target.dtype=bfloat16"
counts=()
[ -z "${VOCAB_COUNTS:-}" ] || counts=(--draft-vocab-counts "$VOCAB_COUNTS")
quiet() { grep -v -e "^Loading" -e "FutureWarning" -e "return forward_call"; }
started=$SECONDS
stage() { echo "== $1 ($((SECONDS - started)) s)"; }
if [ ! -f "$DRAFTER/config.json" ] && [ -n "${VOCAB_FRESH:-}" ]; then
  stage "an untrained drafter: $VOCAB_FRESH"
  # shellcheck disable=SC2086
  python3 - "$DRAFTER" $T $VOCAB_FRESH <<'PY' || exit 2
import sys

from hydra import compose, initialize_config_module

from dspark.checkpoints import save_drafter
from dspark.core.types import TargetDims
from dspark.drafters import build_drafter
from dspark.target import load_target

folder, overrides = sys.argv[1], sys.argv[2:]
with initialize_config_module(config_module="dspark.conf", version_base="1.3"):
    cfg = compose(config_name="train", overrides=overrides)
target = load_target(cfg.target)
drafter = build_drafter(TargetDims.of(target), cfg.drafter, cfg.head)
save_drafter(drafter, folder, cfg.drafter, cfg.head, target.describe())
print(f"saved an untrained {cfg.drafter.name} drafter ({sum(p.numel() for p in drafter.parameters())} parameters)")
PY
fi
[ -f "$DRAFTER/config.json" ] || { echo "no drafter checkpoint at $DRAFTER (config.json)"; exit 2; }

for k in ${VOCAB_SIZES-0 16384 32768}; do
  stage "draft and verify steps, draft vocabulary $k, T = 0"
  timeout 240 python3 -m dspark.bench.engine_sps $T --context "${ROUND_CONTEXT:-172}" --no-hf --warmup 3 \
    --repeats 15 --widths 1,8 --tokens 1,8,16,64,128,256,512,2048 --temperature 0 --drafter-dir "$DRAFTER" \
    --draft-vocab "$k" ${counts[@]+"${counts[@]}"} --out "$OUT/engine_sps_K${k}_T0.json" 2>&1 | quiet | tail -30
done
for t in ${VOCAB_TEMPERATURES-0 1}; do
  for k in ${VOCAB_E2E_SIZES-0 16384}; do
    stage "end to end, draft vocabulary $k, T = $t"
    timeout 300 python3 -m dspark.bench.e2e $T --drafter-dir "$DRAFTER" --draft-vocab "$k" ${counts[@]+"${counts[@]}"} \
      --benchmark gsm8k --prompts 32 --concurrency "${VOCAB_CONCURRENCY:-1,64,256}" --max-new-tokens 128 \
      --temperature "$t" --repeats "${VOCAB_REPEATS:-2}" --policies "${VOCAB_POLICIES:-fixed}" \
      --out "$OUT/e2e_K${k}_T$t.json" 2>&1 | quiet | tail -14
  done
done
stage "done"
